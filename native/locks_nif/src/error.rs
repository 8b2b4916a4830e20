//! The one place where a `locks_core::Error` becomes an Elixir exception,
//! `PhoenixKitAgent.Turns.Locks.Error`.

use locks_core::Error;
use rustler::{Atom, NifException};

use crate::atoms;

#[derive(Clone, NifException)]
#[module = "PhoenixKitAgent.Turns.Locks.Error"]
pub struct LocksError {
    reason: Atom,
    message: String,
    sqlstate: Option<String>,
}

pub fn raise(err: Error) -> rustler::Error {
    rustler::Error::RaiseTerm(Box::new(exception(err)))
}

/// The exception of a core error, as a term to raise or to send.
pub fn exception(err: Error) -> LocksError {
    let (reason, sqlstate) = match &err {
        Error::Config { .. } => (atoms::config(), None),
        Error::NotStarted => (atoms::not_started(), None),
        Error::Connect(_) => (atoms::connect(), None),
        Error::PoolTimeout(_) => (atoms::pool_timeout(), None),
        Error::Timeout(_) => (atoms::timeout(), None),
        Error::Disconnected(_) => (atoms::disconnected(), None),
        Error::RowLocked(_) => (atoms::row_locked(), None),
        Error::Statement { sqlstate, .. } => (atoms::statement(), Some(sqlstate.clone())),
    };
    LocksError { reason, message: err.to_string(), sqlstate }
}
