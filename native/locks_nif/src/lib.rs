//! The NIF of `PhoenixKitAgent.Turns.Locks.Native`: terms in, `locks_core`
//! calls, terms out; nothing here decides anything about locks. How a lock
//! call runs: `call.rs`, whose `since` makes the one `unsafe` call.

#![deny(unsafe_code)]

mod admin;
mod atoms;
mod call;
mod error;
mod locks;
mod repo;

rustler::init!("Elixir.PhoenixKitAgent.Turns.Locks.Native");
