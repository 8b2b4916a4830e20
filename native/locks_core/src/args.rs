//! The arguments of the lock calls, as types a statement can take: the one
//! place of the argument rules.
//!
//! Each constructor answers `None` for anything outside its rule, so nothing
//! malformed is ever sent: 16 bytes of a uuid; a ref of 1 to [`MAX_REF_BYTES`]
//! bytes with no NUL (UTF-8 by its type), a click's starting with
//! [`CLICK_REF_PREFIX`] and a turn's not; a TTL from 1 to [`MAX_TTL_S`]
//! seconds; a hold from 1 to its TTL. The Elixir API checks the same rules
//! before any NIF call, with the limits the NIF gives it (`rules/0`), only
//! to word the `ArgumentError` after the argument.

use std::fmt;

use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};

/// The prefix that marks a ref as a click's (made by `click_ref/0`), so that a
/// refused caller can be told `:click_in_flight` rather than `:turn_in_flight`.
pub const CLICK_REF_PREFIX: &str = "click:";

/// The longest ref, in bytes: what a `varchar(255)` `busy_turn_ref` holds
/// whatever its characters ([`MAX_REF_CHARS`](crate::schema::MAX_REF_CHARS)).
pub const MAX_REF_BYTES: usize = 255;

/// The longest TTL, in seconds: ten years, so that `now()` less it (or less
/// a TTL less its hold) stays far inside a timestamp's range.
pub const MAX_TTL_S: i32 = 315_360_000;

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

/// Whether a ref is a click's.
pub(crate) fn is_click_ref(text: &str) -> bool {
    text.starts_with(CLICK_REF_PREFIX)
}

/// A ref a `busy_turn_ref` column can hold and compare (1 to
/// [`MAX_REF_BYTES`] bytes, no NUL byte): a click's when `CLICK` (starting
/// with [`CLICK_REF_PREFIX`], as `click_ref/0` makes them), else a turn's,
/// never a click's, so that a refusal can tell the two apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ref<const CLICK: bool>(pub(crate) String);

/// A turn's ref.
pub type TurnRef = Ref<false>;

/// A click's ref.
pub type ClickRef = Ref<true>;

impl<const CLICK: bool> Ref<CLICK> {
    /// The ref, or `None` for text a `busy_turn_ref` cannot hold, or for a
    /// ref of the other kind.
    pub fn new(text: &str) -> Option<Self> {
        let storable = (1..=MAX_REF_BYTES).contains(&text.len()) && !text.as_bytes().contains(&0);
        (storable && is_click_ref(text) == CLICK).then(|| Ref(text.to_owned()))
    }
}

/// A TTL: how old another holder's lock must be to be taken over, whole seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ttl(pub(crate) i32);

impl Ttl {
    /// `None` unless `seconds` is from 1 to [`MAX_TTL_S`].
    pub fn new(seconds: i64) -> Option<Self> {
        i32::try_from(seconds).ok().filter(|s| (1..=MAX_TTL_S).contains(s)).map(Ttl)
    }
}

/// How long a lock keeps others out when it is not kept (a click's, or a
/// turn's lease), whole seconds, at most its TTL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hold(pub(crate) i32);

impl Hold {
    /// `None` unless `seconds` is from 1 to `ttl`'s seconds: a longer hold
    /// would date the lock into the future.
    pub fn new(seconds: i64, ttl: Ttl) -> Option<Self> {
        i32::try_from(seconds).ok().filter(|s| (1..=ttl.0).contains(s)).map(Hold)
    }
}

/// Each argument decoded from its term by its rule (the NIF's build): a
/// term that breaks it is a bad argument, as any other term. A hold is
/// checked against the longest TTL here, against its own by
/// [`Job::checked`](crate::Job::checked).
#[cfg(feature = "nif")]
mod decode {
    use super::{ClickRef, Hold, Ttl, TurnRef, Uuid, MAX_TTL_S};
    use rustler::{Binary, Decoder, Error, NifResult, Term};

    macro_rules! by_rule {
        ($($arg:ty: $rule:expr;)*) => {$(
            impl<'a> Decoder<'a> for $arg {
                fn decode(term: Term<'a>) -> NifResult<Self> {
                    $rule(term.decode()?).ok_or(Error::BadArg)
                }
            }
        )*};
    }

    by_rule! {
        Uuid: |bytes: Binary| Uuid::from_bytes(bytes.as_slice());
        TurnRef: TurnRef::new;
        ClickRef: ClickRef::new;
        Ttl: Ttl::new;
        Hold: |seconds| Hold::new(seconds, Ttl(MAX_TTL_S));
    }
}
