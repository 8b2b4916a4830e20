//! Terms to `locks_core` argument types.
//!
//! The Elixir module has checked every argument already; these checks make the
//! NIF safe on its own (it can be called directly), and their errors name the
//! argument exactly as the Elixir guards do.

use locks_core::{ClickRef, Error, Hold, Ttl, TurnRef, Uuid};
use rustler::Term;

/// A term that must be a UTF-8 binary.
pub fn text<'a>(name: &'static str, term: Term<'a>) -> Result<&'a str, Error> {
    if !term.is_binary() {
        return Err(Error::InvalidArgument {
            name,
            reason: "must be a string",
        });
    }
    term.decode::<&str>().map_err(|_| Error::InvalidArgument {
        name,
        reason: "must be valid UTF-8",
    })
}

/// A term that must be a small integer (a bignum is out of every range).
fn integer(name: &'static str, term: Term<'_>) -> Result<i64, Error> {
    term.decode::<i64>().map_err(|_| Error::InvalidArgument {
        name,
        reason: "must be a whole number of seconds",
    })
}

pub fn uuid(name: &'static str, term: Term<'_>) -> Result<Uuid, Error> {
    Uuid::parse(name, text(name, term)?)
}

pub fn turn_ref<'a>(term: Term<'a>) -> Result<TurnRef<'a>, Error> {
    TurnRef::parse("turn_ref", text("turn_ref", term)?)
}

pub fn click_ref<'a>(term: Term<'a>) -> Result<ClickRef<'a>, Error> {
    ClickRef::parse("ref", text("ref", term)?)
}

pub fn ttl(term: Term<'_>) -> Result<Ttl, Error> {
    Ttl::new("ttl_s", integer("ttl_s", term)?)
}

pub fn hold(term: Term<'_>, ttl: Ttl) -> Result<Hold, Error> {
    Hold::new("hold_s", integer("hold_s", term)?, ttl)
}

/// When the Elixir caller made the call: `System.os_time(:microsecond)`.
pub fn queued_at_us(term: Term<'_>) -> Result<i64, Error> {
    term.decode::<i64>().map_err(|_| Error::InvalidArgument {
        name: "queued_at",
        reason: "must be the caller's System.os_time(:microsecond)",
    })
}
