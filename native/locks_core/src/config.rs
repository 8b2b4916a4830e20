//! Configuration: where the database is, how many connections, how long to wait.
//!
//! Every setting is checked once, when the pool is built, and an error names
//! the setting, never its value (a URL carries a password). Nothing here
//! connects: the pool opens connections on first use.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};

/// Connections in the pool when `pool_size` is not given: the number of
/// dirty-I/O schedulers a BEAM has by default, so every scheduler that can
/// run a lock call at once finds a connection without waiting.
pub const DEFAULT_POOL_SIZE: usize = 10;

/// Milliseconds to open a connection (TCP, TLS and authentication) when
/// `connect_timeout` is not given.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 5_000;

/// Milliseconds to wait for a free pooled connection when `checkout_timeout`
/// is not given. deadpool's own default is to wait forever, which would let a
/// burst of callers block dirty schedulers without bound.
pub const DEFAULT_CHECKOUT_TIMEOUT_MS: u64 = 5_000;

/// Milliseconds a statement may run on the server when `statement_timeout`
/// is not given (the session's `statement_timeout`; a lock statement normally
/// takes well under a millisecond, so this only bounds pathological waits).
pub const DEFAULT_STATEMENT_TIMEOUT_MS: u64 = 5_000;

const MAX_POOL_SIZE: i64 = 1_000;
const MAX_TIMEOUT_MS: i64 = 3_600_000;

/// What the host configured, unchecked. `None` means "the default".
#[derive(Default)]
pub struct Options<'a> {
    /// A libpq URL (`postgres://user:pass@host:port/db?sslmode=…`) or key=value string.
    pub url: &'a str,
    /// Connections in the pool, 1 to 1000.
    pub pool_size: Option<i64>,
    /// Milliseconds, 1 to 3,600,000.
    pub connect_timeout_ms: Option<i64>,
    /// Milliseconds, 1 to 3,600,000.
    pub checkout_timeout_ms: Option<i64>,
    /// Milliseconds, 1 to 3,600,000.
    pub statement_timeout_ms: Option<i64>,
    /// A schema to qualify both tables with (an identifier).
    pub prefix: Option<&'a str>,
}

/// A checked configuration, ready to build a [`crate::Locks`] from.
#[derive(Clone)]
pub struct Config {
    pub(crate) pg: tokio_postgres::Config,
    pub(crate) pool_size: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) checkout_timeout: Duration,
    pub(crate) statement_timeout: Duration,
    pub(crate) schema: Option<String>,
}

impl Config {
    /// Checks `options` and pins what every connection needs: the session
    /// `TimeZone` is UTC (so `timestamp without time zone` columns hold UTC)
    /// and `statement_timeout` is set, both as startup options, which costs no
    /// round trip.
    pub fn new(options: &Options<'_>) -> Result<Self> {
        if options.url.is_empty() {
            return Err(Error::config(
                "url",
                "missing: set config :phoenix_kit_agent_locks, url: … or DATABASE_URL",
            ));
        }
        let mut pg = tokio_postgres::Config::from_str(options.url)
            // tokio-postgres names the bad part, never the whole string.
            .map_err(|e| Error::config("url", redact_cause(&e.to_string())))?;
        if pg.get_hosts().is_empty() {
            return Err(Error::config("url", "names no host"));
        }

        let pool_size = match setting("pool_size", options.pool_size, MAX_POOL_SIZE)? {
            0 => DEFAULT_POOL_SIZE,
            // 1..=1000, so it always fits.
            n => usize::try_from(n).unwrap_or(DEFAULT_POOL_SIZE),
        };
        let millis = |name, value, default| -> Result<Duration> {
            Ok(match setting(name, value, MAX_TIMEOUT_MS)? {
                0 => Duration::from_millis(default),
                // 1..=3_600_000, so it always fits.
                ms => Duration::from_millis(u64::try_from(ms).unwrap_or(default)),
            })
        };
        let connect_timeout = millis(
            "connect_timeout",
            options.connect_timeout_ms,
            DEFAULT_CONNECT_TIMEOUT_MS,
        )?;
        let checkout_timeout = millis(
            "checkout_timeout",
            options.checkout_timeout_ms,
            DEFAULT_CHECKOUT_TIMEOUT_MS,
        )?;
        let statement_timeout = millis(
            "statement_timeout",
            options.statement_timeout_ms,
            DEFAULT_STATEMENT_TIMEOUT_MS,
        )?;
        let schema = options
            .prefix
            .map(crate::schema::quote_schema)
            .transpose()?;

        let pinned = format!(
            "-c TimeZone=UTC -c statement_timeout={}",
            statement_timeout.as_millis()
        );
        let startup = match pg.get_options() {
            Some(own) if !own.is_empty() => format!("{own} {pinned}"),
            _ => pinned,
        };
        pg.options(&startup);
        pg.connect_timeout(connect_timeout);
        if pg.get_application_name().is_none() {
            pg.application_name("phoenix_kit_agent_locks");
        }

        Ok(Config {
            pg,
            pool_size,
            connect_timeout,
            checkout_timeout,
            statement_timeout,
            schema,
        })
    }

    /// The longest one call can take: waiting for a connection, opening one,
    /// and running the statement. Every call is cut off after this.
    pub fn call_timeout(&self) -> Duration {
        self.checkout_timeout + self.connect_timeout + self.statement_timeout
    }

    /// Connections in the pool.
    pub fn pool_size(&self) -> usize {
        self.pool_size
    }

    /// The quoted schema prefix, if any.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }
}

/// A setting in `1..=max`, or 0 when absent (the caller's default).
fn setting(name: &'static str, value: Option<i64>, max: i64) -> Result<i64> {
    match value {
        None => Ok(0),
        Some(v) if (1..=max).contains(&v) => Ok(v),
        Some(_) => Err(Error::config(
            name,
            format!("must be an integer from 1 to {max}"),
        )),
    }
}

/// tokio-postgres' parse errors name the option and its (bad) value; a bad
/// value is never the password (any password parses), but keep only the
/// first clause so no value is ever echoed.
fn redact_cause(message: &str) -> String {
    message
        .split(':')
        .next()
        .unwrap_or("unparsable")
        .trim()
        .to_owned()
}

impl fmt::Debug for Config {
    /// Shows where the pool connects and how, never the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("hosts", &self.pg.get_hosts())
            .field("ports", &self.pg.get_ports())
            .field("user", &self.pg.get_user())
            .field("dbname", &self.pg.get_dbname())
            .field("password", &self.pg.get_password().map(|_| "[REDACTED]"))
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("checkout_timeout", &self.checkout_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("schema", &self.schema)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "postgres://locks:s3cr3t-pw@127.0.0.1:5433/locks_test";

    fn options(url: &str) -> Options<'_> {
        Options {
            url,
            ..Options::default()
        }
    }

    #[test]
    fn defaults_apply_when_a_setting_is_absent() {
        let config = Config::new(&options(URL)).expect("valid url");
        assert_eq!(config.pool_size(), DEFAULT_POOL_SIZE);
        assert_eq!(
            config.checkout_timeout,
            Duration::from_millis(DEFAULT_CHECKOUT_TIMEOUT_MS)
        );
        assert_eq!(config.call_timeout(), Duration::from_millis(15_000));
        assert_eq!(config.pg.get_dbname(), Some("locks_test"));
        assert_eq!(
            config.pg.get_application_name(),
            Some("phoenix_kit_agent_locks")
        );
    }

    #[test]
    fn every_connection_pins_utc_and_the_statement_timeout() {
        let config = Config::new(&Options {
            statement_timeout_ms: Some(750),
            ..options("postgres://u@h/db?options=-c%20search_path%3Dx")
        })
        .expect("valid");
        assert_eq!(
            config.pg.get_options(),
            Some("-c search_path=x -c TimeZone=UTC -c statement_timeout=750")
        );
    }

    #[test]
    fn explicit_settings_are_taken_and_checked() {
        let config = Config::new(&Options {
            pool_size: Some(3),
            connect_timeout_ms: Some(100),
            prefix: Some("phoenix_kit"),
            ..options(URL)
        })
        .expect("valid");
        assert_eq!(config.pool_size(), 3);
        assert_eq!(config.connect_timeout, Duration::from_millis(100));
        assert_eq!(config.schema(), Some("\"phoenix_kit\""));

        for (opts, message) in [
            (Options { pool_size: Some(0), ..options(URL) }, "invalid configuration: pool_size: must be an integer from 1 to 1000"),
            (Options { checkout_timeout_ms: Some(-5), ..options(URL) }, "invalid configuration: checkout_timeout: must be an integer from 1 to 3600000"),
            (options(""), "invalid configuration: url: missing: set config :phoenix_kit_agent_locks, url: … or DATABASE_URL"),
        ] {
            assert_eq!(Config::new(&opts).expect_err(message).to_string(), message);
        }
    }

    #[test]
    fn errors_and_debug_never_show_the_password() {
        let config = Config::new(&options(URL)).expect("valid");
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(shown.contains("[REDACTED]"), "{shown}");

        for bad in [
            "postgres://locks:s3cr3t-pw@127.0.0.1:notaport/db",
            "postgres://locks:s3cr3t-pw@127.0.0.1/db?sslmode=s3cr3t-pw",
            "postgres://locks:s3cr3t-pw@127.0.0.1/db?connect_timeout=s3cr3t-pw",
            "not a url s3cr3t-pw",
        ] {
            let err = Config::new(&options(bad)).expect_err(bad).to_string();
            assert!(err.starts_with("invalid configuration: url: "), "{err}");
            assert!(!err.contains("s3cr3t-pw"), "{err}");
        }
    }
}
