//! The errors of the library, one enum, mapped to Elixir exceptions in one
//! place (the NIF's `error.rs`).
//!
//! Contention is never an error: a busy lock is a [`crate::Busy`] answer.
//! An error means the call could not be answered. Each variant says how far
//! the call got, which is what a caller needs to know to recover:
//!
//! | variant            | the statement…                                  |
//! | ------------------ | ----------------------------------------------- |
//! | `Config`, `NotStarted`, `Connect`, `PoolTimeout` | was never sent        |
//! | `Statement`, `RowLocked` | was refused by PostgreSQL and changed nothing |
//! | `Timeout`, `Disconnected` | was sent, and may have run                |
//!
//! No message ever carries the database password: connection errors are
//! rendered from tokio-postgres' own messages, which name the cause and never
//! the connection settings, after the server they were for (`host:port`, or
//! the socket's path: see `connect.rs`).

use std::time::Duration;

use tokio_postgres::error::{DbError, Severity, SqlState};

/// The result of every fallible call of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting, or the tables it points at, cannot be used; names the
    /// setting (or table), never a secret.
    #[error("invalid configuration: {setting}: {reason}")]
    Config {
        /// The setting's name (`ssl_ca_file`, …) or the table's.
        setting: String,
        /// What is wrong with it, and how to fix it.
        reason: String,
    },

    /// No pool is installed: the application has not been started, or was stopped.
    #[error("not started: the :phoenix_kit_agent_locks application is not running, or has no database configured")]
    NotStarted,

    /// No connection could be opened; nothing was sent.
    #[error("database connection failed: {0}")]
    Connect(String),

    /// The call waited its whole checkout timeout for its turn; nothing was sent.
    #[error("timed out after {} ms waiting for a pooled connection", .0.as_millis())]
    PoolTimeout(Duration),

    /// The database did not answer within the call's time; the statement may
    /// have run. Its connection was closed and the statement cancelled.
    #[error("timed out after {} ms waiting for the database", .0.as_millis())]
    Timeout(Duration),

    /// The connection was lost while the statement was in flight (a server
    /// shutdown, a terminated backend, a broken network path); it may have run.
    #[error("connection lost while the statement was in flight: {0}")]
    Disconnected(String),

    /// A row the call writes stayed locked by another session's transaction
    /// (the turn's own fenced write, a host's transaction) for the whole
    /// wait; the statement was cancelled and changed nothing. Try again.
    #[error("a lock row stayed locked by another transaction for {} ms (a fenced write under way, a host's own transaction): nothing was changed; try again once it ends", .0.as_millis())]
    RowLocked(Duration),

    /// PostgreSQL refused the statement, which changed nothing.
    #[error("statement failed: {sqlstate}: {message}")]
    Statement {
        /// The five-character SQLSTATE, e.g. `42501` for a role that may not write a table.
        sqlstate: String,
        /// PostgreSQL's message.
        message: String,
    },
}

impl Error {
    pub(crate) fn config(setting: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config { setting: setting.into(), reason: reason.into() }
    }

    /// An answer a statement should not have given: the tables are not what
    /// the statements were built for (they changed under a running pool).
    pub(crate) fn unexpected(reason: impl std::fmt::Display) -> Self {
        Error::config("tables", format!("unexpected answer ({reason}); restart the application"))
    }

    /// What a failure while a statement was in flight on a connection is:
    /// a refusal of the statement (the connection is fine), or the loss of
    /// the connection (a FATAL error from the server, an I/O error, a closed
    /// socket), after which the statement may or may not have run.
    pub(crate) fn in_flight(err: &tokio_postgres::Error) -> Self {
        match err.as_db_error() {
            Some(db) if !ends_session(db) => Error::Statement {
                sqlstate: db.code().code().to_owned(),
                message: db.message().to_owned(),
            },
            _ => Error::Disconnected(describe(err)),
        }
    }

    /// Whether the statement waited its whole `lock_timeout` for a row
    /// (`55P03`, `lock_not_available`).
    pub(crate) fn is_row_locked(&self) -> bool {
        matches!(self, Error::Statement { sqlstate, .. } if sqlstate == SqlState::LOCK_NOT_AVAILABLE.code())
    }

    /// Whether the same statement may simply be sent again: a serialization
    /// failure or a deadlock rolled it back as a whole (under REPEATABLE READ
    /// or SERIALIZABLE, a row changed since the statement's snapshot).
    pub(crate) fn is_retryable(&self) -> bool {
        matches!(self, Error::Statement { sqlstate, .. }
            if sqlstate == SqlState::T_R_SERIALIZATION_FAILURE.code()
                || sqlstate == SqlState::T_R_DEADLOCK_DETECTED.code())
    }

    /// Whether the server refused a write because it is read-only
    /// (`25006`): a standby, or a primary demoted or fenced by a failover.
    /// The statement changed nothing; its connection's server can serve no
    /// lock call any more.
    pub(crate) fn is_read_only(&self) -> bool {
        matches!(self, Error::Statement { sqlstate, .. }
            if sqlstate == SqlState::READ_ONLY_SQL_TRANSACTION.code())
    }
}

/// A FATAL or PANIC error ends the server's session: `57P01` (an
/// administrator shut the server down or terminated the backend), `57P02`,
/// `57P03`, and the like. The connection is gone with it.
fn ends_session(db: &DbError) -> bool {
    matches!(db.parsed_severity(), Some(Severity::Fatal | Severity::Panic))
        || [SqlState::ADMIN_SHUTDOWN, SqlState::CRASH_SHUTDOWN, SqlState::CANNOT_CONNECT_NOW]
            .contains(db.code())
}

/// tokio-postgres' message with its cause appended (its Display leaves the
/// source out: "error connecting to server" alone names nothing), or the
/// server's message and SQLSTATE: a failure to open a connection is the
/// server's refusal (a bad password 28P01, too many clients 53300, no such
/// database 3D000) or the network's, named with its cause.
pub(crate) fn describe(err: &tokio_postgres::Error) -> String {
    if let Some(db) = err.as_db_error() {
        return format!("{} ({})", db.message(), db.code().code());
    }
    match std::error::Error::source(err) {
        Some(cause) => format!("{err}: {cause}"),
        None => err.to_string(),
    }
}
