//! The settings a pool is built from: discrete, checked values, one field
//! per setting, named as the Elixir configuration names them.
//!
//! `PhoenixKitAgent.Turns.Locks.Config` resolves every source (its own
//! settings, the host's repo, a URL, `DATABASE_URL`), applies the defaults
//! and checks every range: nothing here parses a URL or knows a default.
//! Its struct crosses to the NIF as it is, decoded into [`Settings`] by
//! derive: the fields are declared here and there, nowhere else. What only
//! Rust can check (a CA file) fails as [`Error::Config`].
//! `Settings` has no `Debug`, so its password cannot end up in a message.

use std::time::Duration;

use crate::error::{Error, Result};

/// Where and how to connect, and the pool's limits: the Elixir
/// `PhoenixKitAgent.Turns.Locks.Config` struct itself, decoded field by field
/// by rustler's derive in the NIF's build (the `nif` feature).
#[derive(Clone)]
#[cfg_attr(
    feature = "nif",
    derive(rustler::NifStruct),
    module = "PhoenixKitAgent.Turns.Locks.Config",
    rustler(decode)
)]
#[allow(missing_docs)] // the fields: the Elixir settings of the same names
pub struct Settings {
    /// A host name or IP address, over TCP.
    pub hostname: Option<String>,
    /// A directory holding the server's socket `.s.PGSQL.<port>`; it wins
    /// over `hostname`, as in Postgrex.
    pub socket_dir: Option<String>,
    /// 1 to 65535 (a `u32`: rustler decodes a `u16` by truncating one, so
    /// 70_000 would be 4_464); checked by [`Settings::port`].
    pub port: u32,
    /// Every TCP server to try, in order, as `(host, port)`: Postgrex's
    /// `endpoints:`, or a multi-host URL's; `hostname`/`port` are its first.
    /// Empty: `hostname`:`port` alone. See [`Settings::servers`].
    pub endpoints: Vec<(String, u32)>,
    /// Which of the servers a connection may use.
    pub target_server_type: TargetServerType,
    pub username: String,
    pub password: Option<String>,
    pub database: String,
    pub sslmode: SslMode,
    /// A PEM file of the CA certificates the verifying modes trust.
    pub ssl_ca_file: Option<String>,
    /// The CA certificates the verifying modes trust, as DER, in place of
    /// `ssl_ca_file`: a repo's `cacerts:`, or the OS store as OTP reads it
    /// (`:public_key.cacerts_get()`, as Postgrex's `ssl: true` does).
    pub ssl_cacerts: Option<Vec<Der>>,
    /// A PEM file of the client certificate (and its chain), sent to a
    /// server that asks for one (libpq's `sslcert`).
    pub ssl_cert_file: Option<String>,
    /// A PEM file of the client certificate's private key (libpq's `sslkey`).
    pub ssl_key_file: Option<String>,
    /// The client certificate and its chain as DER, in place of `ssl_cert_file`.
    pub ssl_cert: Option<Vec<Der>>,
    /// The client certificate's private key as DER, in place of `ssl_key_file`.
    pub ssl_key: Option<(KeyFormat, Der)>,
    /// The name sent as SNI and checked by `verify_full`, in place of the
    /// host connected to (a repo's `server_name_indication:`).
    pub ssl_server_name: Option<String>,
    pub application_name: String,
    /// A schema that qualifies both tables, or `None` for the `search_path`.
    pub prefix: Option<String>,
    /// Connections in the pool, and lock calls that run at once.
    pub pool_size: usize,
    /// Milliseconds to open a connection: TCP, TLS and the login.
    pub connect_timeout: u64,
    /// Milliseconds a call may wait for its turn (a free connection).
    pub checkout_timeout: u64,
    /// Milliseconds the statement may take once sent.
    pub statement_timeout: u64,
    pub prepare: Prepare,
}

impl Settings {
    /// The port, or a `Config` error outside 1 to 65535.
    pub fn port(&self) -> Result<u16> {
        port(self.port, "port")
    }

    /// The TCP servers, in the order they are tried: `endpoints`, or else
    /// `hostname`:`port`; a `Config` error for a port outside 1 to 65535.
    pub fn servers(&self) -> Result<Vec<(String, u16)>> {
        if self.endpoints.is_empty() {
            return Ok(vec![(self.hostname.clone().unwrap_or_default(), self.port()?)]);
        }
        let server =
            |(host, number): &(String, u32)| Ok((host.clone(), port(*number, "endpoints")?));
        self.endpoints.iter().map(server).collect()
    }

    /// The checkout timeout.
    pub fn checkout(&self) -> Duration {
        Duration::from_millis(self.checkout_timeout)
    }
}

fn port(number: u32, setting: &str) -> Result<u16> {
    let valid = u16::try_from(number).ok().filter(|port| *port > 0);
    valid.ok_or_else(|| Error::config(setting, "must be an integer from 1 to 65535"))
}

/// Which server a connection may stay on: Postgrex's `target_server_type`,
/// but for `:secondary`, which `Config` refuses (lock calls write).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "nif", derive(rustler::NifUnitEnum))]
pub enum TargetServerType {
    /// The first server that takes writes: each login asks `SHOW
    /// transaction_read_only` (as libpq's `target_session_attrs=read-write`
    /// and Postgrex do) and goes on to the next server when it is `on` (a
    /// standby, or a server set read-only). A connection whose server
    /// refuses a write later (`25006`: it was demoted or fenced) is closed,
    /// with the idle ones to that server, and the call tries the servers
    /// again within its deadline.
    Primary,
    /// The first server that takes the connection, not asked: for a name
    /// or a proxy that follows the primary itself. A `25006` closes the
    /// connection (and the idle ones to its server) and is the call's
    /// answer; the next call connects anew.
    Any,
}

/// How a connection uses TLS: libpq's `sslmode`, spelled as Elixir atoms.
/// Never over a Unix socket (the server refuses it there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "nif", derive(rustler::NifUnitEnum))]
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

/// A DER encoding (a certificate or a key), from an Elixir binary.
#[derive(Clone)]
pub struct Der(pub Vec<u8>);

#[cfg(feature = "nif")]
impl<'a> rustler::Decoder<'a> for Der {
    fn decode(term: rustler::Term<'a>) -> rustler::NifResult<Self> {
        Ok(Der(term.decode::<rustler::Binary<'a>>()?.as_slice().to_vec()))
    }
}

/// How a private key given as DER is encoded: `:public_key`'s
/// `RSAPrivateKey` (PKCS #1), `ECPrivateKey` (SEC 1) and `PrivateKeyInfo`
/// (PKCS #8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "nif", derive(rustler::NifUnitEnum))]
#[allow(missing_docs)] // the variants: the encodings named above
pub enum KeyFormat {
    Pkcs1,
    Sec1,
    Pkcs8,
}

/// How statements are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "nif", derive(rustler::NifUnitEnum))]
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
