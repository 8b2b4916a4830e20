//! The settings a pool is built from: where the database is, how to log in,
//! how many connections, how long to wait.
//!
//! The Elixir side (`PhoenixKitAgent.Turns.Locks.Config`) resolves every
//! source (the library's own settings, the host's repo, a URL, `DATABASE_URL`),
//! applies the defaults and checks every range before anything reaches this
//! crate: a [`Settings`] holds discrete, checked values, one field per
//! setting, named as the Elixir configuration names it. Nothing here parses a
//! URL or knows a default. What only Rust can check (a CA file's
//! certificates) fails as [`Error::Config`] naming the setting.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};

/// Where and how to connect, and the pool's limits.
#[derive(Clone)]
pub struct Settings {
    /// Where the server is: a host name or address, or a socket directory.
    pub location: Location,
    /// The server's port (also the number in a Unix socket's file name).
    pub port: u16,
    /// The role to log in as.
    pub username: String,
    /// Its password, if the server asks for one. Never shown by `Debug`.
    pub password: Option<String>,
    /// The database.
    pub database: String,
    /// Whether and how connections use TLS.
    pub sslmode: SslMode,
    /// A PEM file of the CA certificates the verifying modes trust.
    pub ssl_ca_file: Option<String>,
    /// What the server shows of the connections (`pg_stat_activity`).
    pub application_name: String,
    /// A schema that qualifies both tables, or `None` for the `search_path`.
    pub prefix: Option<String>,
    /// Connections in the pool, and lock calls that run at once.
    pub pool_size: usize,
    /// Time to open a connection: TCP, TLS and the login.
    pub connect_timeout: Duration,
    /// Time a call may wait for a free connection (its turn to run).
    pub checkout_timeout: Duration,
    /// Time the statement may take once sent.
    pub statement_timeout: Duration,
    /// Named prepared statements, or unnamed ones (behind PgBouncer).
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

impl fmt::Debug for Settings {
    /// Every setting but the password, which shows as `[REDACTED]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("location", &self.location)
            .field("port", &self.port)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "[REDACTED]"))
            .field("database", &self.database)
            .field("sslmode", &self.sslmode)
            .field("ssl_ca_file", &self.ssl_ca_file)
            .field("application_name", &self.application_name)
            .field("prefix", &self.prefix)
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("checkout_timeout", &self.checkout_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("prepare", &self.prepare)
            .finish()
    }
}

/// How a connection uses TLS: libpq's `sslmode`, spelled as Elixir atoms.
///
/// | mode          | encrypted                           | certificate checked             |
/// | ------------- | ----------------------------------- | ------------------------------- |
/// | `disable`     | never                               | –                               |
/// | `prefer`      | when the server offers it           | no                              |
/// | `require`     | always, or no connection            | no                              |
/// | `verify_ca`   | always                              | chain, up to the CA file        |
/// | `verify_full` | always                              | chain, and the host name        |
///
/// TLS is never used over a Unix socket (the server refuses it there).
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

/// How statements are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prepare {
    /// Each connection prepares a statement once, by name, and then runs it
    /// by name: one round trip a call, and the server plans it once.
    Named,
    /// Every call sends its statement unnamed, with its parameters' types, in
    /// one round trip: nothing outlives the call on the server, so it works
    /// where a pooler (PgBouncer in transaction mode) hands each transaction
    /// to another server connection.
    Unnamed,
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Settings for unit tests; nothing connects with them.
    pub(crate) fn example() -> Settings {
        Settings {
            location: Location::Host("127.0.0.1".into()),
            port: 5432,
            username: "locks".into(),
            password: Some("s3cr3t-pw".into()),
            database: "locks".into(),
            sslmode: SslMode::Prefer,
            ssl_ca_file: None,
            application_name: "phoenix_kit_agent_locks".into(),
            prefix: None,
            pool_size: 4,
            connect_timeout: Duration::from_millis(1_000),
            checkout_timeout: Duration::from_millis(2_000),
            statement_timeout: Duration::from_millis(3_000),
            prepare: Prepare::Named,
        }
    }

    #[test]
    fn debug_shows_every_setting_but_the_password() {
        let shown = format!("{:?}", example());
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(shown.contains("password: Some(\"[REDACTED]\")"), "{shown}");
        assert!(shown.contains("username: \"locks\""), "{shown}");
    }

    #[test]
    fn a_call_may_take_its_three_timeouts() {
        assert_eq!(example().call_timeout(), Duration::from_millis(6_000));
    }

    #[test]
    fn modes_are_the_elixir_atoms() {
        for (name, mode) in [
            ("disable", SslMode::Disable),
            ("prefer", SslMode::Prefer),
            ("require", SslMode::Require),
            ("verify_ca", SslMode::VerifyCa),
            ("verify_full", SslMode::VerifyFull),
        ] {
            assert_eq!(name.parse::<SslMode>().ok(), Some(mode));
        }
        assert!("verify-full".parse::<SslMode>().is_err());
        assert_eq!("unnamed".parse::<Prepare>().ok(), Some(Prepare::Unnamed));
        assert!("Unnamed".parse::<Prepare>().is_err());
    }
}
