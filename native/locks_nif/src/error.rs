//! The one place where a `locks_core::Error` becomes an Elixir exception.
//!
//! Bad arguments raise `ArgumentError`; everything else raises
//! `PhoenixKitAgent.Turns.Locks.Error` with a `reason` atom to match on
//! (`:connect`, `:timeout`, `:pool_timeout`, `:statement`, `:config`,
//! `:not_started`), the SQLSTATE when PostgreSQL refused a statement, and a
//! message that never contains the database password.

use locks_core::Error;
use rustler::{Atom, NifException};

use crate::atoms;

#[derive(NifException)]
#[module = "ArgumentError"]
struct ArgumentError {
    message: String,
}

#[derive(NifException)]
#[module = "PhoenixKitAgent.Turns.Locks.Error"]
struct LocksError {
    reason: Atom,
    message: String,
    sqlstate: Option<String>,
}

/// Turns a core error into the exception the NIF raises.
pub fn raise(err: Error) -> rustler::Error {
    let message = err.to_string();
    let reason = match &err {
        Error::InvalidArgument { .. } => {
            return rustler::Error::RaiseTerm(Box::new(ArgumentError { message }))
        }
        Error::Config { .. } => atoms::config(),
        Error::NotStarted => atoms::not_started(),
        Error::Connect(_) => atoms::connect(),
        Error::PoolTimeout(_) => atoms::pool_timeout(),
        Error::Timeout(_) => atoms::timeout(),
        Error::Statement { .. } => atoms::statement(),
    };
    let sqlstate = err.sqlstate().map(str::to_owned);
    rustler::Error::RaiseTerm(Box::new(LocksError {
        reason,
        message,
        sqlstate,
    }))
}
