//! The errors of the library, one enum, mapped to Elixir exceptions in one
//! place (the NIF's `error.rs`).
//!
//! Contention is never an error: a busy lock is an [`crate::Acquire`] outcome.
//! An error means the call could not be answered (bad input, no database, a
//! timeout, a failed statement), and no message ever carries the password of
//! the configured URL: connection errors are rendered from tokio-postgres'
//! own messages, which name the cause and never the connection string.

use std::time::Duration;

use deadpool_postgres::{PoolError, TimeoutType};

/// The result of every fallible call of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument is not what the API takes; raised before any SQL runs.
    #[error("invalid {name}: {reason}")]
    InvalidArgument {
        /// The argument's name, as in the Elixir API (`conversation_uuid`, `ttl_s`, …).
        name: &'static str,
        /// What it must be.
        reason: &'static str,
    },

    /// A configuration setting is unusable; names the setting, never its secret.
    #[error("invalid configuration: {setting}: {reason}")]
    Config {
        /// The setting's name (`url`, `pool_size`, …).
        setting: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// No pool is installed: the application has not been started, or was stopped.
    #[error("not started: the :phoenix_kit_agent_locks application is not running, or has no url (config :phoenix_kit_agent_locks, url: … or DATABASE_URL)")]
    NotStarted,

    /// A connection could not be made or broke while in use.
    #[error("database connection failed: {0}")]
    Connect(String),

    /// Every pooled connection stayed busy for the whole checkout timeout.
    #[error("timed out after {} ms waiting for a pooled connection", .0.as_millis())]
    PoolTimeout(Duration),

    /// The call as a whole took longer than its deadline (checkout, connect
    /// and statement timeouts added up): the database did not answer in time.
    #[error("timed out after {} ms waiting for the database", .0.as_millis())]
    Timeout(Duration),

    /// PostgreSQL refused or aborted the statement.
    #[error("statement failed: {sqlstate}: {message}")]
    Statement {
        /// The five-character SQLSTATE, e.g. `57014` for a statement timeout.
        sqlstate: String,
        /// PostgreSQL's message.
        message: String,
    },
}

impl Error {
    pub(crate) fn invalid(name: &'static str, reason: &'static str) -> Self {
        Error::InvalidArgument { name, reason }
    }

    pub(crate) fn config(setting: &'static str, reason: impl Into<String>) -> Self {
        Error::Config {
            setting,
            reason: reason.into(),
        }
    }

    /// The SQLSTATE of a failed statement, if that is what this is.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Statement { sqlstate, .. } => Some(sqlstate),
            _ => None,
        }
    }

    /// Classifies a pool checkout failure; `wait` is the configured checkout
    /// timeout, reported in the message.
    pub(crate) fn from_pool(err: PoolError, wait: Duration, connect: Duration) -> Self {
        match err {
            // Checking a connection out only ever connects or recycles: a
            // server's refusal here (bad password 28P01, too many clients
            // 53300, no such database 3D000) is a connection failure, not a
            // failed statement.
            PoolError::Backend(e) => match e.as_db_error() {
                Some(db) => Error::Connect(format!("{} ({})", db.message(), db.code().code())),
                None => Error::from(e),
            },
            PoolError::Timeout(TimeoutType::Wait) => Error::PoolTimeout(wait),
            PoolError::Timeout(TimeoutType::Create) => {
                Error::Connect(format!("no connection within {} ms", connect.as_millis()))
            }
            PoolError::Timeout(TimeoutType::Recycle) => {
                Error::Connect("checking a pooled connection timed out".into())
            }
            PoolError::Closed => Error::NotStarted,
            other => Error::Connect(other.to_string()),
        }
    }
}

impl From<tokio_postgres::Error> for Error {
    fn from(err: tokio_postgres::Error) -> Self {
        if let Some(db) = err.as_db_error() {
            return Error::Statement {
                sqlstate: db.code().code().to_owned(),
                message: db.message().to_owned(),
            };
        }
        // tokio-postgres' Display ("error connecting to server") leaves out its
        // source; append it so the cause (refused, reset, closed) is named.
        match std::error::Error::source(&err) {
            Some(cause) => Error::Connect(format!("{err}: {cause}")),
            None => Error::Connect(err.to_string()),
        }
    }
}
