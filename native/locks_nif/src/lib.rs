//! The NIF of `PhoenixKitAgent.Turns.Locks.Native`: terms in, `locks_core`
//! calls, terms out. Nothing here decides anything about locks.
//!
//! Every lock function runs on a dirty-I/O scheduler, so a call waiting for
//! PostgreSQL never holds a normal scheduler, and only with a turn from the
//! gate (`call.rs`), so waiting calls never hold all the dirty ones either.
//! The one `unsafe` call reads the VM's monotonic clock (`call.rs`).

#![deny(unsafe_code)]

mod admin;
mod atoms;
mod call;
mod error;
mod locks;

rustler::init!("Elixir.PhoenixKitAgent.Turns.Locks.Native");
