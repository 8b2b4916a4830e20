//! Terms to `locks_core` argument types.
//!
//! The Elixir module has checked every argument already; these checks make the
//! NIF safe on its own (it can be called directly), and their errors name the
//! argument exactly as the Elixir guards do. Each returns the exception to
//! raise (`ArgumentError`), mapped here once for every caller.

use locks_core::{ClickRef, Error, Hold, Ttl, TurnRef, Uuid};
use rustler::{NifResult, Term};

use crate::error::raise;

/// A term that must be a UTF-8 binary.
fn text<'a>(name: &'static str, term: Term<'a>) -> Result<&'a str, Error> {
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

pub fn uuid(name: &'static str, term: Term<'_>) -> NifResult<Uuid> {
    text(name, term)
        .and_then(|t| Uuid::parse(name, t))
        .map_err(raise)
}

pub fn turn_ref<'a>(term: Term<'a>) -> NifResult<TurnRef<'a>> {
    text("turn_ref", term)
        .and_then(|t| TurnRef::parse("turn_ref", t))
        .map_err(raise)
}

pub fn click_ref<'a>(term: Term<'a>) -> NifResult<ClickRef<'a>> {
    text("ref", term)
        .and_then(|t| ClickRef::parse("ref", t))
        .map_err(raise)
}

pub fn ttl(term: Term<'_>) -> NifResult<Ttl> {
    integer("ttl_s", term)
        .and_then(|s| Ttl::new("ttl_s", s))
        .map_err(raise)
}

pub fn hold(term: Term<'_>, ttl: Ttl) -> NifResult<Hold> {
    integer("hold_s", term)
        .and_then(|s| Hold::new("hold_s", s, ttl))
        .map_err(raise)
}

/// When the Elixir caller made the call: `System.os_time(:microsecond)`.
pub fn queued_at_us(term: Term<'_>) -> NifResult<i64> {
    term.decode::<i64>().map_err(|_| {
        raise(Error::InvalidArgument {
            name: "queued_at",
            reason: "must be the caller's System.os_time(:microsecond)",
        })
    })
}
