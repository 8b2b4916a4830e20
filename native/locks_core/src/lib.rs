//! The turn locks of PhoenixKitAgent, without the BEAM.
//!
//! A turn of an AI chat holds two locks, both rows in PostgreSQL: the chat's
//! (`busy_since`/`busy_turn_ref` of `phoenix_kit_agent_conversations`) and the
//! user's (the same columns of `phoenix_kit_agent_user_settings`). Every public
//! call of [`LockPool`] is **one** statement, one round trip, in autocommit:
//! the statements live in `sql.rs` with what each one guarantees.
//!
//! The goal of this crate is that no input can crash the BEAM that loads it:
//! every argument is one of the types of [`args`] before any SQL runs,
//! nothing that comes from outside is unwrapped, and every failure is an
//! [`Error`] that names its cause without the database password.
//!
//! The NIF (`locks_nif`) owns nothing but term conversion: it decodes a
//! [`Job`], asks the [`admission::Gate`] for a turn, takes the installed
//! [`LockPool`] from [`global::current`] and runs the job with
//! [`global::block_on`].

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admission;
pub mod args;
mod connect;
mod error;
pub mod global;
mod job;
mod outcome;
mod pool;
pub mod schema;
mod settings;
mod sql;
mod tls;

pub use args::{ClickRef, Hold, Ttl, TurnRef, Uuid};
pub use error::{Error, Result};
pub use job::{Answer, Job};
pub use outcome::{Acquire, AcquireUser, HeldLock};
pub use pool::{Deadline, LockPool};
pub use settings::{Location, Prepare, Settings, SslMode};
