//! The settings a pool is built from: discrete, checked values, one field
//! per setting, named as the Elixir configuration names them.
//!
//! `PhoenixKitAgent.Turns.Locks.Config` resolves every source (its own
//! settings, the host's repo, a URL, `DATABASE_URL`), applies the defaults
//! and checks every range: nothing here parses a URL or knows a default.
//! What only Rust can check (a CA file) fails as [`Error::Config`].
//! `Settings` has no `Debug`, so its password cannot end up in a message.

use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};

/// Where and how to connect, and the pool's limits.
#[derive(Clone)]
#[allow(missing_docs)] // the fields: the Elixir settings of the same names
pub struct Settings {
    pub location: Location,
    pub port: u16,
    pub username: String,
    pub password: Option<String>,
    pub database: String,
    pub sslmode: SslMode,
    /// A PEM file of the CA certificates the verifying modes trust.
    pub ssl_ca_file: Option<String>,
    pub application_name: String,
    /// A schema that qualifies both tables, or `None` for the `search_path`.
    pub prefix: Option<String>,
    /// Connections in the pool, and lock calls that run at once.
    pub pool_size: usize,
    /// Time to open a connection: TCP, TLS and the login.
    pub connect_timeout: Duration,
    /// Time a call may wait for its turn (a free connection).
    pub checkout_timeout: Duration,
    /// Time the statement may take once sent.
    pub statement_timeout: Duration,
    pub prepare: Prepare,
}

/// Where the server is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A host name or IP address, over TCP.
    Host(String),
    /// A directory holding the server's socket `.s.PGSQL.<port>`.
    SocketDir(String),
}

impl Settings {
    /// The longest one call may take, from the moment its caller made it:
    /// waiting for its turn, opening a connection, running the statement.
    pub fn call_timeout(&self) -> Duration {
        self.checkout_timeout + self.connect_timeout + self.statement_timeout
    }
}

/// How a connection uses TLS: libpq's `sslmode`, spelled as Elixir atoms.
/// Never over a Unix socket (the server refuses it there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP, even when the server offers TLS.
    Disable,
    /// TLS when the server offers it, unverified; plain otherwise.
    Prefer,
    /// TLS or no connection; the certificate is not checked.
    Require,
    /// TLS, and the certificate must chain up to the CA file.
    VerifyCa,
    /// As `VerifyCa`, and the certificate must name the host connected to.
    VerifyFull,
}

/// How statements are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prepare {
    /// Prepared once per connection, by name, then run by name: the server
    /// plans each statement once.
    Named,
    /// Sent unnamed with its parameters' types, in the same one round trip:
    /// nothing outlives the call on the server, so it works behind a pooler
    /// that hands each transaction to another server connection (PgBouncer
    /// in transaction mode).
    Unnamed,
}

impl FromStr for SslMode {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self> {
        Ok(match name {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify_ca" => SslMode::VerifyCa,
            "verify_full" => SslMode::VerifyFull,
            _ => return Err(Error::config("sslmode", "unknown mode")),
        })
    }
}

impl FromStr for Prepare {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self> {
        match name {
            "named" => Ok(Prepare::Named),
            "unnamed" => Ok(Prepare::Unnamed),
            _ => Err(Error::config("prepare", "unknown mode")),
        }
    }
}
