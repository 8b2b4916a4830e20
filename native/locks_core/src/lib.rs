//! The turn locks of PhoenixKitAgent, without the BEAM.
//!
//! A turn of an AI chat holds two locks, both rows in PostgreSQL: the chat's
//! (`busy_since`/`busy_turn_ref` of `phoenix_kit_agent_conversations`) and the
//! user's (the same columns of `phoenix_kit_agent_user_settings`). Every public
//! call of [`Locks`] is **one** prepared statement, one round trip, in
//! autocommit: the statements live in `sql.rs` with what each one guarantees.
//!
//! The goal of this crate is that no input can crash the BEAM that loads it:
//! every argument is validated into a type of [`args`] before any SQL runs,
//! nothing that comes from outside is unwrapped, and every failure is an
//! [`Error`] that names its cause without the database password.
//!
//! The NIF (`locks_nif`) owns nothing but term conversion: it calls
//! [`global::current`] for the installed [`Locks`] and [`global::block_on`] to
//! run one call on the shared tokio runtime.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod args;
pub mod config;
mod error;
pub mod global;
mod locks;
mod outcome;
pub mod schema;
mod sql;
mod tls;

pub use args::{ClickRef, Hold, Ttl, TurnRef, Uuid};
pub use config::Config;
pub use error::{Error, Result};
pub use locks::Locks;
pub use outcome::{Acquire, AcquireUser};
pub use tls::SslMode;
