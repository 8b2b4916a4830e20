//! The arguments of the lock calls, as types a statement can take.
//!
//! The Elixir API checks every argument against its documented limits (and
//! words the `ArgumentError`) before any NIF call. These types only keep what
//! the statements themselves need, so that nothing malformed is ever sent:
//! 16 bytes of a uuid, a ref PostgreSQL `text` can hold, and seconds that fit
//! the `int4` parameters with a hold no longer than its TTL. Each constructor
//! answers `None` for anything else.

use std::fmt;

use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};

/// The prefix that marks a ref as a click's (made by `click_ref/0`), so that a
/// refused caller can be told `:click_in_flight` rather than `:turn_in_flight`.
pub const CLICK_REF_PREFIX: &str = "click:";

/// A row id: the 16 bytes of a UUID (the Elixir side decodes the text form).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Uuid([u8; 16]);

impl Uuid {
    /// The UUID of these 16 bytes; `None` for any other length.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Uuid)
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

/// Text a `text` column can hold and compare: not empty, no NUL byte.
fn storable(text: &str) -> bool {
    !text.is_empty() && !text.as_bytes().contains(&0)
}

/// Whether a ref is a click's.
pub(crate) fn is_click_ref(text: &str) -> bool {
    text.starts_with(CLICK_REF_PREFIX)
}

/// A turn's ref: never a click's, so a refusal can tell the two apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnRef(pub(crate) String);

impl TurnRef {
    /// A turn ref, or `None` for a click's ref or text a `text` column cannot hold.
    pub fn new(text: &str) -> Option<Self> {
        (storable(text) && !is_click_ref(text)).then(|| TurnRef(text.to_owned()))
    }

    /// The ref as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A click's ref, as `click_ref/0` makes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClickRef(pub(crate) String);

impl ClickRef {
    /// A click ref, or `None` for anything that does not start with [`CLICK_REF_PREFIX`].
    pub fn new(text: &str) -> Option<Self> {
        (storable(text) && is_click_ref(text)).then(|| ClickRef(text.to_owned()))
    }

    /// The ref as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A TTL: how old another holder's lock must be to be taken over, whole seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ttl(pub(crate) i32);

impl Ttl {
    /// `None` unless `seconds` is positive and fits an `int4`.
    pub fn new(seconds: i64) -> Option<Self> {
        i32::try_from(seconds).ok().filter(|s| *s > 0).map(Ttl)
    }

    /// The seconds, as the statements bind them (`int4`).
    pub fn seconds(self) -> i32 {
        self.0
    }
}

/// How long a click's lock keeps turns out, whole seconds, at most its TTL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hold(pub(crate) i32);

impl Hold {
    /// `None` unless `seconds` is from 1 to `ttl`'s seconds: a longer hold
    /// would date the lock into the future.
    pub fn new(seconds: i64, ttl: Ttl) -> Option<Self> {
        i32::try_from(seconds).ok().filter(|s| (1..=ttl.0).contains(s)).map(Hold)
    }

    /// The seconds, as the statements bind them (`int4`).
    pub fn seconds(self) -> i32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_is_exactly_sixteen_bytes() {
        let uuid = Uuid::from_bytes(&[0xab; 16]).expect("16 bytes");
        assert_eq!(format!("{uuid:?}"), "abababab-abab-abab-abab-abababababab");
        assert_eq!(Uuid::from_bytes(&[0; 15]), None);
        assert_eq!(Uuid::from_bytes(&[0; 17]), None);
    }

    #[test]
    fn refs_are_told_apart_by_the_click_prefix() {
        assert_eq!(TurnRef::new("turn-1").as_ref().map(TurnRef::as_str), Some("turn-1"));
        assert_eq!(TurnRef::new("click:00"), None);
        assert_eq!(ClickRef::new("click:00").as_ref().map(ClickRef::as_str), Some("click:00"));
        assert_eq!(ClickRef::new("turn-1"), None);
        for unstorable in ["", "turn\0", "click:\0"] {
            assert_eq!(TurnRef::new(unstorable), None, "{unstorable:?}");
            assert_eq!(ClickRef::new(unstorable), None, "{unstorable:?}");
        }
    }

    #[test]
    fn seconds_must_fit_an_int4_and_a_hold_its_ttl() {
        let ttl = Ttl::new(60).expect("60 s");
        assert_eq!(ttl.seconds(), 60);
        for bad in [0, -1, i64::from(i32::MAX) + 1, i64::MIN] {
            assert_eq!(Ttl::new(bad), None, "{bad}");
        }
        assert_eq!(Hold::new(60, ttl).map(Hold::seconds), Some(60));
        assert_eq!(Hold::new(61, ttl), None);
        assert_eq!(Hold::new(0, ttl), None);
    }
}
