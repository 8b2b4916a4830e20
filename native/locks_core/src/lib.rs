//! The turn locks of PhoenixKitAgent, without the BEAM.
//!
//! A turn of an AI chat holds two locks, both rows in PostgreSQL: the chat's
//! (`busy_since`/`busy_turn_ref` of `phoenix_kit_agent_conversations`) and
//! the user's (the same columns of `phoenix_kit_agent_user_settings`). Each
//! call of [`LockPool::run`] is **one** statement, one round trip, in
//! autocommit (`sql.rs` says what each guarantees). No input can crash the
//! VM that loads this: arguments are [`args`] types before any SQL runs,
//! nothing from outside is unwrapped, and every failure is an [`Error`] that
//! never carries the password. The NIF (`locks_nif`) only converts terms: it
//! takes a slot of the [`queue::Queue`], decodes a [`Job`] and runs the
//! job on [`global::current`], on the calling thread.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod args;
mod connect;
mod error;
pub mod global;
mod job;
mod pool;
pub mod queue;
pub mod repo;
mod row;
pub mod schema;
mod settings;
mod sql;
mod tls;

pub use args::{ClickRef, Hold, Ttl, TurnRef, Uuid};
pub use error::{Error, Result};
pub use job::{Answer, Busy, HeldLock, Job, LockKind};
pub use pool::{Deadline, LockPool};
pub use row::Value;
pub use settings::{Der, KeyFormat, Prepare, Settings, SslMode, TargetServerType};
pub use sql::{fence, ROW_WAIT};
