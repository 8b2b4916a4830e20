//! Validated arguments.
//!
//! Every value that reaches a statement is one of these types, and each one can
//! only be built through a check: a statement never sees a malformed uuid, an
//! empty or oversized ref, or a TTL that would overflow the interval arithmetic.
//! The checks mirror the guards of the Elixir module, so a bad argument is
//! refused twice before it could reach PostgreSQL.

use std::fmt;

use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};

use crate::error::{Error, Result};

/// The prefix that marks a ref as a click's (made by `click_ref/0`), so that a
/// refused caller can be told `:click_in_flight` rather than `:turn_in_flight`.
pub const CLICK_REF_PREFIX: &str = "click:";

/// The longest ref accepted, in bytes. Refs are stored in a `text` column and
/// compared on every call; 255 bytes is far more than a uuid-based ref needs.
pub const MAX_REF_BYTES: usize = 255;

/// The largest TTL accepted, in seconds: ten years of 365 days. Far above any
/// sensible turn, and small enough that `ttl_s * interval '1 second'` and
/// `now() - ttl` can never overflow.
pub const MAX_TTL_S: i64 = 315_360_000;

/// A row id: a UUID written as 36 characters, hyphenated (8-4-4-4-12), hex
/// digits in any letter case. Sent to PostgreSQL as the 16 bytes of a `uuid`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Uuid([u8; 16]);

impl Uuid {
    /// Parses a hyphenated UUID; `name` is the argument's name for the error.
    pub fn parse(name: &'static str, text: &str) -> Result<Self> {
        let bytes = text.as_bytes();
        if bytes.len() != 36 {
            return Err(Error::invalid(
                name,
                "must be a hyphenated UUID (36 characters)",
            ));
        }
        let mut out = [0u8; 16];
        let mut nibbles = 0usize;
        for (i, &b) in bytes.iter().enumerate() {
            if matches!(i, 8 | 13 | 18 | 23) {
                if b != b'-' {
                    return Err(Error::invalid(
                        name,
                        "must be a hyphenated UUID (8-4-4-4-12)",
                    ));
                }
                continue;
            }
            let v = match b {
                b'0'..=b'9' => b - b'0',
                b'a'..=b'f' => b - b'a' + 10,
                b'A'..=b'F' => b - b'A' + 10,
                _ => {
                    return Err(Error::invalid(
                        name,
                        "must contain only hex digits and hyphens",
                    ))
                }
            };
            out[nibbles / 2] |= if nibbles.is_multiple_of(2) { v << 4 } else { v };
            nibbles += 1;
        }
        Ok(Uuid(out))
    }

    /// The 16 bytes of the UUID.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Debug for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl ToSql for Uuid {
    fn to_sql(
        &self,
        _ty: &Type,
        out: &mut tokio_postgres::types::private::BytesMut,
    ) -> std::result::Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        out.extend_from_slice(&self.0);
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::UUID
    }

    to_sql_checked!();
}

/// Checks what every ref must be: 1 to [`MAX_REF_BYTES`] bytes, no NUL byte
/// (PostgreSQL `text` cannot hold one). UTF-8 is guaranteed by `&str`.
fn check_ref(name: &'static str, text: &str) -> Result<()> {
    if text.is_empty() {
        return Err(Error::invalid(name, "must not be empty"));
    }
    if text.len() > MAX_REF_BYTES {
        return Err(Error::invalid(name, "must be at most 255 bytes"));
    }
    if text.as_bytes().contains(&0) {
        return Err(Error::invalid(name, "must not contain a NUL byte"));
    }
    Ok(())
}

/// A turn's ref: any valid ref that does not start with [`CLICK_REF_PREFIX`],
/// so a lock held by a turn is always told apart from one held by a click.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnRef<'a>(&'a str);

impl<'a> TurnRef<'a> {
    /// Checks `text` as the turn ref argument `name`.
    pub fn parse(name: &'static str, text: &'a str) -> Result<Self> {
        check_ref(name, text)?;
        if text.starts_with(CLICK_REF_PREFIX) {
            return Err(Error::invalid(
                name,
                "is a click ref (made by click_ref/0), not a turn's",
            ));
        }
        Ok(TurnRef(text))
    }

    /// The ref as sent to PostgreSQL.
    pub fn as_str(&self) -> &'a str {
        self.0
    }
}

/// A click's ref: a valid ref that starts with [`CLICK_REF_PREFIX`], as made
/// by `click_ref/0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClickRef<'a>(&'a str);

impl<'a> ClickRef<'a> {
    /// Checks `text` as the click ref argument `name`.
    pub fn parse(name: &'static str, text: &'a str) -> Result<Self> {
        check_ref(name, text)?;
        if !text.starts_with(CLICK_REF_PREFIX) {
            return Err(Error::invalid(
                name,
                "must be a click ref made by click_ref/0",
            ));
        }
        Ok(ClickRef(text))
    }

    /// The ref as sent to PostgreSQL.
    pub fn as_str(&self) -> &'a str {
        self.0
    }
}

/// Whether a stored ref is a click's (decides `:click_in_flight` over
/// `:turn_in_flight`).
pub(crate) fn is_click_ref(stored: &str) -> bool {
    stored.starts_with(CLICK_REF_PREFIX)
}

/// A TTL in whole seconds, from 1 to [`MAX_TTL_S`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ttl(i32);

impl Ttl {
    /// Checks `seconds` as the TTL argument `name`.
    pub fn new(name: &'static str, seconds: i64) -> Result<Self> {
        if !(1..=MAX_TTL_S).contains(&seconds) {
            return Err(Error::invalid(
                name,
                "must be a whole number of seconds from 1 to 315360000",
            ));
        }
        // In range, so it fits an i32 (MAX_TTL_S < i32::MAX).
        i32::try_from(seconds).map(Ttl).map_err(|_| {
            Error::invalid(
                name,
                "must be a whole number of seconds from 1 to 315360000",
            )
        })
    }

    /// The seconds, as the `int4` the statements take.
    pub fn seconds(&self) -> i32 {
        self.0
    }
}

/// How long a click's lock blocks a turn, in whole seconds from 1 to the TTL
/// it goes with: the lock is dated back by `ttl - hold`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hold(i32);

impl Hold {
    /// Checks `seconds` as the hold argument `name`, against `ttl`.
    pub fn new(name: &'static str, seconds: i64, ttl: Ttl) -> Result<Self> {
        if !(1..=i64::from(ttl.seconds())).contains(&seconds) {
            return Err(Error::invalid(
                name,
                "must be a whole number of seconds from 1 to ttl_s",
            ));
        }
        i32::try_from(seconds)
            .map(Hold)
            .map_err(|_| Error::invalid(name, "must be a whole number of seconds from 1 to ttl_s"))
    }

    /// The seconds, as the `int4` the statements take.
    pub fn seconds(&self) -> i32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0b6c2b0e-5f55-4d8a-9f62-2c1e8d7a4b10";

    #[test]
    fn uuid_parses_any_letter_case_to_the_same_bytes() {
        let lower = Uuid::parse("id", ID).expect("lower case");
        let upper = Uuid::parse("id", &ID.to_uppercase()).expect("upper case");
        assert_eq!(lower, upper);
        assert_eq!(format!("{lower:?}"), ID);
    }

    #[test]
    fn uuid_refuses_wrong_length_misplaced_hyphens_and_non_hex() {
        for bad in [
            "",
            "0b6c2b0e5f554d8a9f622c1e8d7a4b10",
            "0b6c2b0e-5f55-4d8a-9f62-2c1e8d7a4b1",
            "0b6c2b0e-5f55-4d8a-9f62-2c1e8d7a4b100",
            "0b6c2b0e5-f55-4d8a-9f62-2c1e8d7a4b10",
            "0b6c2b0e-5f55-4d8a-9f62-2c1e8d7a4b1g",
            "'; DROP TABLE x; --------------------",
            "0b6c2b0e-5f55-4d8a-9f62-2c1e8d7a4bé",
        ] {
            let err = Uuid::parse("conversation_uuid", bad).expect_err(bad);
            assert!(
                err.to_string().starts_with("invalid conversation_uuid: "),
                "{err}"
            );
        }
    }

    #[test]
    fn turn_ref_refuses_empty_oversized_nul_and_click_refs() {
        assert!(TurnRef::parse("turn_ref", "turn-1").is_ok());
        assert!(TurnRef::parse("turn_ref", &"x".repeat(MAX_REF_BYTES)).is_ok());
        for bad in ["", "a\0b", "click:abc"] {
            assert!(TurnRef::parse("turn_ref", bad).is_err(), "{bad:?}");
        }
        assert!(TurnRef::parse("turn_ref", &"x".repeat(MAX_REF_BYTES + 1)).is_err());
    }

    #[test]
    fn click_ref_must_carry_the_click_prefix() {
        assert!(ClickRef::parse("ref", "click:0123").is_ok());
        let err = ClickRef::parse("ref", "turn-1").expect_err("a turn ref");
        assert_eq!(
            err.to_string(),
            "invalid ref: must be a click ref made by click_ref/0"
        );
        assert!(is_click_ref("click:0123"));
        assert!(!is_click_ref("turn-1"));
    }

    #[test]
    fn ttl_is_whole_seconds_from_one_to_ten_years() {
        assert_eq!(Ttl::new("ttl_s", 1).map(|t| t.seconds()).ok(), Some(1));
        assert_eq!(
            Ttl::new("ttl_s", MAX_TTL_S)
                .map(|t| t.seconds() as i64)
                .ok(),
            Some(MAX_TTL_S)
        );
        for bad in [0, -1, MAX_TTL_S + 1, i64::MAX, i64::MIN] {
            let err = Ttl::new("ttl_s", bad).expect_err("out of range");
            assert_eq!(
                err.to_string(),
                "invalid ttl_s: must be a whole number of seconds from 1 to 315360000"
            );
        }
    }

    #[test]
    fn hold_is_from_one_to_the_ttl() {
        let ttl = Ttl::new("ttl_s", 60).expect("ttl");
        assert!(Hold::new("hold_s", 1, ttl).is_ok());
        assert!(Hold::new("hold_s", 60, ttl).is_ok());
        assert!(Hold::new("hold_s", 0, ttl).is_err());
        assert!(Hold::new("hold_s", 61, ttl).is_err());
    }
}
