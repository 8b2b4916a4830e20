//! Terms to `locks_core` argument types.
//!
//! The Elixir module has checked and worded every argument already (and
//! turned uuids into their 16 bytes); a term that still does not fit is a
//! bad argument (`ArgumentError`). Nothing is sent for it.

use locks_core::{ClickRef, Hold, Ttl, TurnRef, Uuid};
use rustler::{Binary, Error, NifResult, Term};

pub fn uuid(term: Term<'_>) -> NifResult<Uuid> {
    Uuid::from_bytes(term.decode::<Binary>()?.as_slice()).ok_or(Error::BadArg)
}

pub fn turn_ref(term: Term<'_>) -> NifResult<TurnRef> {
    TurnRef::new(term.decode()?).ok_or(Error::BadArg)
}

pub fn click_ref(term: Term<'_>) -> NifResult<ClickRef> {
    ClickRef::new(term.decode()?).ok_or(Error::BadArg)
}

pub fn ttl(term: Term<'_>) -> NifResult<Ttl> {
    Ttl::new(term.decode()?).ok_or(Error::BadArg)
}

pub fn hold(term: Term<'_>, ttl: Ttl) -> NifResult<Hold> {
    Hold::new(term.decode()?, ttl).ok_or(Error::BadArg)
}
