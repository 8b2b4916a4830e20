//! The NIF of `PhoenixKitAgent.Turns.Locks.Native`: terms in, `locks_core`
//! calls, terms out. Nothing here decides anything about locks.
//!
//! Every function that may touch the network runs on a dirty-I/O scheduler,
//! so a call waiting for PostgreSQL never holds a normal scheduler.

#![forbid(unsafe_code)]

mod admin;
mod args;
mod atoms;
mod error;
mod locks;

rustler::init!("Elixir.PhoenixKitAgent.Turns.Locks.Native");
