//! Configuration: where the database is, how many connections, how long to wait.
//!
//! Every setting is checked once, when the pool is built, and an error names
//! the setting, never its value (a URL carries a password). Nothing here
//! connects: the pool opens connections on first use. The only thing read is
//! the CA file of a verifying `sslmode`, so a bad one stops the start.
//!
//! Where to connect is a URL, discrete settings, or both: the discrete ones
//! override the URL's parts, which is how a host's own repo settings and the
//! library's explicit ones combine (the Elixir side decides which is which).

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::config::Host;

use crate::error::{Error, Result};
use crate::tls::{self, SslMode, Tls};

/// Connections in the pool when `pool_size` is not given: the number of
/// dirty-I/O schedulers a BEAM has by default, so every scheduler that can
/// run a lock call at once finds a connection without waiting. (The Elixir
/// side passes the running VM's own count.)
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

/// What the host configured, unchecked. `None` (or an empty `url`) means
/// "not given". Errors name the settings as the Elixir configuration spells
/// them (`hostname`, `username`, `database`, …).
#[derive(Default)]
pub struct Options<'a> {
    /// A libpq URL (`postgres://user:pass@host:port/db?sslmode=…`) or
    /// key=value string; empty when the location is given by `host` or
    /// `socket_dir` alone. `sslmode` may be any of libpq's five modes and
    /// `sslrootcert` names the CA file, although tokio-postgres knows neither.
    pub url: &'a str,
    /// A host name or IP address (`hostname`); replaces the URL's hosts.
    pub host: Option<&'a str>,
    /// The port, 1 to 65535; replaces the URL's ports (default 5432).
    pub port: Option<i64>,
    /// The role to log in as (`username`); replaces the URL's.
    pub user: Option<&'a str>,
    /// The password; replaces the URL's.
    pub password: Option<&'a str>,
    /// The database (`database`); replaces the URL's.
    pub dbname: Option<&'a str>,
    /// An absolute directory holding the server's socket (`.s.PGSQL.<port>`);
    /// replaces the URL's hosts, and wins over `host`, as in Postgrex.
    pub socket_dir: Option<&'a str>,
    /// libpq's `sslmode` (see [`SslMode`]); overrides the URL's. Default `prefer`.
    pub sslmode: Option<&'a str>,
    /// A PEM file of the CA certificates that `verify-ca` and `verify-full`
    /// trust (`ssl_ca_file`); overrides the URL's `sslrootcert`.
    pub ssl_ca_file: Option<&'a str>,
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
    pub(crate) tls: Tls,
}

impl Config {
    /// Checks `options` and pins what every connection needs, as startup
    /// options (no round trip): the session `TimeZone` is UTC (so `timestamp
    /// without time zone` columns hold UTC), `statement_timeout` is set, and
    /// the isolation level is READ COMMITTED whatever the database's default:
    /// the statements rely on its re-check of a row that changed while they
    /// waited for it, where REPEATABLE READ or SERIALIZABLE would instead fail
    /// the loser of every race with a serialization error (40001).
    pub fn new(options: &Options<'_>) -> Result<Self> {
        if options.url.is_empty() && options.host.is_none() && options.socket_dir.is_none() {
            return Err(Error::config(
                "url",
                "missing: set config :phoenix_kit_agent_locks, url: … or DATABASE_URL",
            ));
        }
        let (url, url_tls) = tls::split_url(options.url);
        let parsed = match url {
            Cow::Borrowed("") => tokio_postgres::Config::new(),
            url => tokio_postgres::Config::from_str(&url)
                // tokio-postgres names the bad part, never the whole string.
                .map_err(|e| Error::config("url", redact_cause(&e.to_string())))?,
        };
        let mut pg = relocate(parsed, options)?;
        if pg.get_hosts().is_empty() {
            return Err(Error::config("url", "names no host"));
        }
        if let Some(user) = given("username", options.user)? {
            pg.user(user);
        }
        if let Some(password) = options.password {
            pg.password(password);
        }
        if let Some(dbname) = given("database", options.dbname)? {
            pg.dbname(dbname);
        }

        let sslmode = match (options.sslmode, url_tls.sslmode.as_deref()) {
            (Some(mode), _) => tls::parse_mode("sslmode", mode)?,
            (None, Some(mode)) => tls::parse_mode("url", mode)?,
            (None, None) => SslMode::Prefer,
        };
        pg.ssl_mode(sslmode.wire());
        let ca_file = match given("ssl_ca_file", options.ssl_ca_file)? {
            Some(file) => Some(file),
            None => given("url", url_tls.sslrootcert.as_deref())?,
        };
        if ca_file == Some("system") {
            return Err(Error::config(
                "ssl_ca_file",
                "the system store (`system`) is not supported: name a PEM file",
            ));
        }
        let tls = Tls::new(sslmode, ca_file)?;

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
            "-c TimeZone=UTC -c default_transaction_isolation=read\\ committed -c statement_timeout={}",
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
            tls,
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

    /// How connections use TLS.
    pub fn sslmode(&self) -> SslMode {
        self.tls.mode
    }
}

/// A text setting that, when given, must not be empty.
fn given<'a>(name: &'static str, value: Option<&'a str>) -> Result<Option<&'a str>> {
    match value {
        Some("") => Err(Error::config(name, "must not be empty")),
        other => Ok(other),
    }
}

/// Applies `host`, `socket_dir` and `port` to the parsed URL. tokio-postgres
/// can only add hosts and ports, so replacing them means copying every other
/// setting into a new configuration.
fn relocate(base: tokio_postgres::Config, options: &Options<'_>) -> Result<tokio_postgres::Config> {
    let host = given("hostname", options.host)?;
    let socket_dir = given("socket_dir", options.socket_dir)?;
    if socket_dir.is_some_and(|dir| !dir.starts_with('/')) {
        return Err(Error::config("socket_dir", "must be an absolute path"));
    }
    let port = options
        .port
        .map(|port| {
            u16::try_from(port)
                .ok()
                .filter(|port| *port > 0)
                .ok_or_else(|| Error::config("port", "must be an integer from 1 to 65535"))
        })
        .transpose()?;
    if host.is_none() && socket_dir.is_none() && port.is_none() {
        return Ok(base);
    }

    let mut pg = tokio_postgres::Config::new();
    if let Some(user) = base.get_user() {
        pg.user(user);
    }
    if let Some(password) = base.get_password() {
        pg.password(password);
    }
    if let Some(dbname) = base.get_dbname() {
        pg.dbname(dbname);
    }
    if let Some(own) = base.get_options() {
        pg.options(own);
    }
    if let Some(name) = base.get_application_name() {
        pg.application_name(name);
    }
    if let Some(timeout) = base.get_tcp_user_timeout() {
        pg.tcp_user_timeout(*timeout);
    }
    pg.ssl_mode(base.get_ssl_mode())
        .ssl_negotiation(base.get_ssl_negotiation())
        .keepalives(base.get_keepalives())
        .keepalives_idle(base.get_keepalives_idle())
        .target_session_attrs(base.get_target_session_attrs())
        .channel_binding(base.get_channel_binding())
        .load_balance_hosts(base.get_load_balance_hosts());
    if let Some(interval) = base.get_keepalives_interval() {
        pg.keepalives_interval(interval);
    }
    if let Some(retries) = base.get_keepalives_retries() {
        pg.keepalives_retries(retries);
    }

    match (socket_dir, host) {
        (Some(dir), _) => {
            pg.host_path(dir);
        }
        (None, Some(host)) => {
            pg.host(host);
        }
        (None, None) => {
            for host in base.get_hosts() {
                match host {
                    Host::Tcp(name) => pg.host(name),
                    Host::Unix(path) => pg.host_path(path),
                };
            }
            for addr in base.get_hostaddrs() {
                pg.hostaddr(*addr);
            }
        }
    }
    match port {
        Some(port) => {
            pg.port(port);
        }
        // A new host keeps the URL's port when there was just one.
        None => {
            if let [port] = base.get_ports() {
                pg.port(*port);
            }
        }
    }
    Ok(pg)
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
            .field("sslmode", &self.tls.mode)
            .field("ssl_ca_file", &self.tls.has_ca_file)
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
            Some(
                "-c search_path=x -c TimeZone=UTC \
                 -c default_transaction_isolation=read\\ committed -c statement_timeout=750"
            )
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

    #[test]
    fn discrete_settings_alone_name_the_database() {
        let config = Config::new(&Options {
            host: Some("db.internal"),
            port: Some(6432),
            user: Some("locks"),
            password: Some("s3cr3t-pw"),
            dbname: Some("app_prod"),
            ..Options::default()
        })
        .expect("valid");
        assert_eq!(config.pg.get_hosts(), [Host::Tcp("db.internal".into())]);
        assert_eq!(config.pg.get_ports(), [6432]);
        assert_eq!(config.pg.get_user(), Some("locks"));
        assert_eq!(config.pg.get_password(), Some(&b"s3cr3t-pw"[..]));
        assert_eq!(config.pg.get_dbname(), Some("app_prod"));
        assert_eq!(config.sslmode(), SslMode::Prefer);
    }

    #[test]
    fn a_socket_dir_is_a_unix_host_and_wins_over_a_host_name() {
        let config = Config::new(&Options {
            host: Some("localhost"),
            socket_dir: Some("/var/run/postgresql"),
            dbname: Some("app"),
            ..Options::default()
        })
        .expect("valid");
        assert_eq!(
            config.pg.get_hosts(),
            [Host::Unix("/var/run/postgresql".into())]
        );
        assert_eq!(config.pg.get_ports(), [] as [u16; 0]);
    }

    #[test]
    fn discrete_settings_override_the_parts_of_the_url() {
        let config = Config::new(&Options {
            host: Some("replica"),
            user: Some("other"),
            dbname: Some("elsewhere"),
            ..options("postgres://locks:s3cr3t-pw@127.0.0.1:5433/locks_test?application_name=app&connect_timeout=3")
        })
        .expect("valid");
        assert_eq!(config.pg.get_hosts(), [Host::Tcp("replica".into())]);
        assert_eq!(config.pg.get_ports(), [5433], "the URL's only port stays");
        assert_eq!(config.pg.get_user(), Some("other"));
        assert_eq!(config.pg.get_password(), Some(&b"s3cr3t-pw"[..]));
        assert_eq!(config.pg.get_dbname(), Some("elsewhere"));
        assert_eq!(config.pg.get_application_name(), Some("app"));

        let ported = Config::new(&Options {
            port: Some(6543),
            ..options("postgres://u@a:1,b:2/db")
        })
        .expect("valid");
        assert_eq!(
            ported.pg.get_hosts(),
            [Host::Tcp("a".into()), Host::Tcp("b".into())]
        );
        assert_eq!(ported.pg.get_ports(), [6543]);
    }

    #[test]
    fn sslmode_comes_from_the_option_then_the_url_then_prefer() {
        let ca = std::env::temp_dir().join(format!("locks-config-ca-{}.pem", std::process::id()));
        std::fs::write(&ca, TEST_CA).expect("temp CA file");
        let ca = ca.to_str().expect("utf-8 temp path").to_owned();
        let url = format!("postgres://u:s3cr3t-pw@h/db?sslmode=verify-full&sslrootcert={ca}");

        let from_url = Config::new(&options(&url)).expect("valid");
        assert_eq!(from_url.sslmode(), SslMode::VerifyFull);
        assert_eq!(
            from_url.pg.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        let overridden = Config::new(&Options {
            sslmode: Some("disable"),
            ..options(&url)
        })
        .expect("valid");
        assert_eq!(overridden.sslmode(), SslMode::Disable);
        let from_options = Config::new(&Options {
            sslmode: Some("verify-ca"),
            ssl_ca_file: Some(&ca),
            ..options(URL)
        })
        .expect("valid");
        assert_eq!(from_options.sslmode(), SslMode::VerifyCa);
        assert_eq!(
            Config::new(&options(URL)).expect("valid").sslmode(),
            SslMode::Prefer
        );
        let kv = Config::new(&options("host=h user=u sslmode=require")).expect("valid");
        assert_eq!(kv.sslmode(), SslMode::Require);
        let _ = std::fs::remove_file(&ca);
    }

    #[test]
    fn discrete_and_tls_settings_are_checked_and_named() {
        for (opts, message) in [
            (Options { port: Some(0), ..options(URL) }, "invalid configuration: port: must be an integer from 1 to 65535"),
            (Options { port: Some(65_536), ..options(URL) }, "invalid configuration: port: must be an integer from 1 to 65535"),
            (Options { host: Some(""), ..options(URL) }, "invalid configuration: hostname: must not be empty"),
            (Options { socket_dir: Some("tmp/pg"), ..options(URL) }, "invalid configuration: socket_dir: must be an absolute path"),
            (Options { user: Some(""), ..options(URL) }, "invalid configuration: username: must not be empty"),
            (Options { dbname: Some(""), ..options(URL) }, "invalid configuration: database: must not be empty"),
            (Options { sslmode: Some("allow"), ..options(URL) }, "invalid configuration: sslmode: must be disable, prefer, require, verify-ca or verify-full"),
            (options("postgres://u:s3cr3t-pw@h/db?sslmode=verify_full"), "invalid configuration: url: sslmode must be disable, prefer, require, verify-ca or verify-full"),
            (Options { sslmode: Some("verify-full"), ..options(URL) }, "invalid configuration: ssl_ca_file: required by sslmode verify-full: a PEM file of the CA certificates to trust (ssl_ca_file, or sslrootcert in the url)"),
            (Options { sslmode: Some("verify-ca"), ssl_ca_file: Some("system"), ..options(URL) }, "invalid configuration: ssl_ca_file: the system store (`system`) is not supported: name a PEM file"),
            (Options { sslmode: Some("verify-ca"), ssl_ca_file: Some("/nonexistent/s3cr3t-pw.pem"), ..options(URL) }, "invalid configuration: ssl_ca_file: cannot be read: No such file or directory (os error 2)"),
            (Options { password: Some("s3cr3t-pw"), ..Options::default() }, "invalid configuration: url: missing: set config :phoenix_kit_agent_locks, url: … or DATABASE_URL"),
        ] {
            assert_eq!(Config::new(&opts).expect_err(message).to_string(), message);
        }
    }

    #[test]
    fn debug_shows_the_tls_mode_and_never_the_discrete_password() {
        let config = Config::new(&Options {
            host: Some("h"),
            password: Some("s3cr3t-pw"),
            sslmode: Some("require"),
            ..Options::default()
        })
        .expect("valid");
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(shown.contains("sslmode: Require"), "{shown}");
    }

    /// A self-signed CA certificate (ECDSA P-256), only ever parsed here.
    const TEST_CA: &str = "\
-----BEGIN CERTIFICATE-----\n\
MIIBlTCCATugAwIBAgIUbKroQvKvcXerib0KsGkmld3adYswCgYIKoZIzj0EAwIw\n\
HzEdMBsGA1UEAwwUbG9ja3MgY29uZmlnIHRlc3QgQ0EwIBcNMjYxMTI5MTA0OTI2\n\
WhgPMjEyNjExMDUxMDQ5MjZaMB8xHTAbBgNVBAMMFGxvY2tzIGNvbmZpZyB0ZXN0\n\
IENBMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAERiUulDNomng7thT0bNPqUrsQ\n\
Io+MsVDTgakyNuuw4DewGOUbwYjpt2NezJWQgrkHSZqE0UfOEXmjQHkWvbyPtqNT\n\
MFEwHQYDVR0OBBYEFMQksJ5CB2nEDAwTEDdgv9tcYPbwMB8GA1UdIwQYMBaAFMQk\n\
sJ5CB2nEDAwTEDdgv9tcYPbwMA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwID\n\
SAAwRQIgW19GgEmXr+i43HQNqxQyv6OPHRwS33Uxx9f1/JHbBKkCIQCFOTsIScgk\n\
fVQQtVw9CvG3QFuXAfe1ROb4aGuv21fo5w==\n\
-----END CERTIFICATE-----\n";
}
