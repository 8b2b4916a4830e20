//! Starting and stopping the pool, and the schema DDL.

use locks_core::config::Options;
use locks_core::{global, schema, Config};
use rustler::{Atom, Decoder, NifResult, Term};

use crate::atoms;
use crate::error::raise;

/// The options `PhoenixKitAgent.Turns.Locks.Config` hands over: a map with
/// an atom key per setting, `nil` (or an absent key) meaning "the default".
/// Decoded by hand rather than with `NifMap`, which needs every key: a map
/// written for an older set of keys still starts the pool.
struct StartOptions {
    url: Option<String>,
    host: Option<String>,
    port: Option<i64>,
    user: Option<String>,
    password: Option<String>,
    dbname: Option<String>,
    socket_dir: Option<String>,
    sslmode: Option<String>,
    ssl_ca_file: Option<String>,
    pool_size: Option<i64>,
    connect_timeout: Option<i64>,
    checkout_timeout: Option<i64>,
    statement_timeout: Option<i64>,
    prefix: Option<String>,
}

impl<'a> Decoder<'a> for StartOptions {
    fn decode(term: Term<'a>) -> NifResult<Self> {
        if !term.is_map() {
            return Err(rustler::Error::BadArg);
        }
        // A key that is absent or nil is "not given"; a value of the wrong
        // type is a bad argument (the Elixir side checked the types already).
        fn get<'a, T: Decoder<'a>>(map: Term<'a>, key: &str) -> NifResult<Option<T>> {
            let key = Atom::from_str(map.get_env(), key)?;
            match map.map_get(key) {
                Ok(value) => value.decode(),
                Err(_) => Ok(None),
            }
        }
        Ok(StartOptions {
            url: get(term, "url")?,
            host: get(term, "host")?,
            port: get(term, "port")?,
            user: get(term, "user")?,
            password: get(term, "password")?,
            dbname: get(term, "dbname")?,
            socket_dir: get(term, "socket_dir")?,
            sslmode: get(term, "sslmode")?,
            ssl_ca_file: get(term, "ssl_ca_file")?,
            pool_size: get(term, "pool_size")?,
            connect_timeout: get(term, "connect_timeout")?,
            checkout_timeout: get(term, "checkout_timeout")?,
            statement_timeout: get(term, "statement_timeout")?,
            prefix: get(term, "prefix")?,
        })
    }
}

/// Checks the options and installs a new pool (closing the previous one).
/// Connects nothing; reads the CA file when a verifying `sslmode` names one.
#[rustler::nif(schedule = "DirtyIo")]
fn start(options: StartOptions) -> NifResult<Atom> {
    let config = Config::new(&Options {
        url: options.url.as_deref().unwrap_or(""),
        host: options.host.as_deref(),
        port: options.port,
        user: options.user.as_deref(),
        password: options.password.as_deref(),
        dbname: options.dbname.as_deref(),
        socket_dir: options.socket_dir.as_deref(),
        sslmode: options.sslmode.as_deref(),
        ssl_ca_file: options.ssl_ca_file.as_deref(),
        pool_size: options.pool_size,
        connect_timeout_ms: options.connect_timeout,
        checkout_timeout_ms: options.checkout_timeout,
        statement_timeout_ms: options.statement_timeout,
        prefix: options.prefix.as_deref(),
    })
    .map_err(raise)?;
    global::start(config).map_err(raise)?;
    Ok(atoms::ok())
}

/// Closes the pool; lock calls raise `:not_started` until the next `start/1`.
#[rustler::nif(schedule = "DirtyIo")]
fn stop() -> Atom {
    global::stop();
    atoms::ok()
}

/// Which DDL: `:tables` or `:lock_columns`; any other atom is a bad argument.
#[derive(Clone, Copy)]
enum Ddl {
    Tables,
    LockColumns,
}

impl Ddl {
    fn from_atom(kind: Atom) -> NifResult<Self> {
        if kind == atoms::tables() {
            Ok(Ddl::Tables)
        } else if kind == atoms::lock_columns() {
            Ok(Ddl::LockColumns)
        } else {
            Err(rustler::Error::BadArg)
        }
    }

    /// The text, for tables qualified by `schema` (already quoted).
    fn sql(self, schema: Option<&str>) -> String {
        match self {
            Ddl::Tables => schema::tables(schema),
            Ddl::LockColumns => schema::lock_columns(schema),
        }
    }
}

/// The DDL for `kind` (`:tables` or `:lock_columns`) under `prefix` (or none).
#[rustler::nif]
fn ddl(kind: Atom, prefix: Option<String>) -> NifResult<String> {
    let kind = Ddl::from_atom(kind)?;
    let schema = prefix
        .as_deref()
        .map(schema::quote_schema)
        .transpose()
        .map_err(raise)?;
    Ok(kind.sql(schema.as_deref()))
}

/// Runs the DDL for `kind` on the installed pool, under its prefix. Any
/// other `kind` is a bad argument, checked before the pool is touched.
#[rustler::nif(schedule = "DirtyIo")]
fn setup(kind: Atom) -> NifResult<Atom> {
    let kind = Ddl::from_atom(kind)?;
    let locks = global::current().map_err(raise)?;
    let ddl = kind.sql(locks.config().schema());
    global::block_on(locks.run_ddl(&ddl))
        .map_err(raise)?
        .map_err(raise)?;
    Ok(atoms::ok())
}

/// `true` once the library is loaded (the Elixir stub answers `false`).
#[rustler::nif]
fn loaded() -> bool {
    true
}

/// The text of every statement as the installed pool runs it, by function
/// name: what `mix locks.bench` sends to pgbench to compare against.
#[rustler::nif]
fn statements() -> NifResult<Vec<(String, String)>> {
    let locks = global::current().map_err(raise)?;
    Ok(locks
        .statements()
        .iter()
        .map(|(name, sql)| ((*name).to_owned(), (*sql).to_owned()))
        .collect())
}
