//! Starting and stopping the pool, the schema DDL, and what the Elixir side
//! asks of the library itself.

use std::str::FromStr;
use std::time::{Duration, Instant};

use locks_core::args::{CLICK_REF_PREFIX, MAX_REF_BYTES, MAX_TTL_S};
use locks_core::{global, schema, Deadline, Error, Location, Prepare, Settings, SslMode};
use rustler::{Atom, Decoder, Env, NifMap, NifResult, NifStruct, Term};

use crate::atoms;
use crate::call::{go, tell, QUEUE};
use crate::error::{exception, raise};

/// Every setting, resolved, defaulted and checked by the Elixir side.
#[derive(NifStruct)]
#[module = "PhoenixKitAgent.Turns.Locks.Config"]
#[rustler(decode)]
struct Config {
    hostname: Option<String>,
    socket_dir: Option<String>,
    // rustler decodes a u16 by truncating a u32: 70_000 would be 4_464.
    port: u32,
    username: String,
    password: Option<String>,
    database: String,
    sslmode: Named<SslMode>,
    ssl_ca_file: Option<String>,
    application_name: String,
    prefix: Option<String>,
    pool_size: usize,
    connect_timeout: u64,
    checkout_timeout: u64,
    statement_timeout: u64,
    prepare: Named<Prepare>,
}

/// An atom that names a value of `T` (`:verify_full`, `:unnamed`).
struct Named<T>(T);

impl<'a, T: FromStr + 'a> Decoder<'a> for Named<T> {
    fn decode(term: Term<'a>) -> NifResult<Self> {
        term.atom_to_string()?.parse().map(Named).map_err(|_| rustler::Error::BadArg)
    }
}

/// Installs a new pool and sizes the queue to it. Connects nothing; reads the
/// CA file, if one is set, unless TLS is off.
#[rustler::nif(schedule = "DirtyIo")]
fn start(env: Env<'_>, c: Config) -> NifResult<Atom> {
    let port = u16::try_from(c.port).ok().filter(|port| *port > 0).ok_or(rustler::Error::BadArg)?;
    let pool = global::start(Settings {
        // A socket directory wins over a host name, as in Postgrex.
        location: match (c.socket_dir, c.hostname) {
            (Some(dir), _) => Location::SocketDir(dir),
            (None, host) => Location::Host(host.unwrap_or_default()),
        },
        port,
        username: c.username,
        password: c.password,
        database: c.database,
        sslmode: c.sslmode.0,
        ssl_ca_file: c.ssl_ca_file,
        application_name: c.application_name,
        prefix: c.prefix,
        pool_size: c.pool_size,
        connect_timeout: Duration::from_millis(c.connect_timeout),
        checkout_timeout: Duration::from_millis(c.checkout_timeout),
        statement_timeout: Duration::from_millis(c.statement_timeout),
        prepare: c.prepare.0,
    })
    .map_err(raise)?;
    QUEUE.resize(pool.settings().pool_size, go(env));
    Ok(atoms::ok())
}

/// Tells every caller in line that the pool is gone, then closes it: its
/// idle connections at once, each busy one as its call ends.
#[rustler::nif(schedule = "DirtyIo")]
fn stop(env: Env<'_>) -> Atom {
    QUEUE.close(tell(env, exception(Error::NotStarted)));
    global::stop();
    atoms::ok()
}

fn ddl_text(kind: Atom, prefix: Option<&str>) -> NifResult<String> {
    if kind == atoms::tables() {
        Ok(schema::tables(prefix))
    } else if kind == atoms::lock_columns() {
        Ok(schema::lock_columns(prefix))
    } else {
        Err(rustler::Error::BadArg)
    }
}

#[rustler::nif]
fn ddl(kind: Atom, prefix: Option<String>) -> NifResult<String> {
    ddl_text(kind, prefix.as_deref())
}

#[rustler::nif(schedule = "DirtyIo")]
fn setup(kind: Atom) -> NifResult<Atom> {
    let pool = global::current().map_err(raise)?;
    let ddl = ddl_text(kind, pool.settings().prefix.as_deref())?;
    let deadline = Deadline::new(Instant::now(), pool.settings());
    pool.run_ddl(deadline, &ddl).map_err(raise)?;
    Ok(atoms::ok())
}

#[rustler::nif]
fn loaded() -> bool {
    true
}

/// The limits of the argument rules (`locks_core::args`), which the Elixir
/// API checks before any call, to word its `ArgumentError`.
#[derive(NifMap)]
#[rustler(encode)]
struct Rules {
    click_prefix: &'static str,
    max_ref_bytes: usize,
    max_ttl_s: i32,
}

#[rustler::nif]
fn rules() -> Rules {
    Rules { click_prefix: CLICK_REF_PREFIX, max_ref_bytes: MAX_REF_BYTES, max_ttl_s: MAX_TTL_S }
}

/// `status/0`'s `:pool`: the queue's slots and the pool's connections.
#[derive(NifMap)]
#[rustler(encode)]
struct Status {
    size: usize,
    running: usize,
    waiting: usize,
    connections: usize,
    idle: usize,
}

#[rustler::nif]
fn status() -> NifResult<Status> {
    let pool = global::current().map_err(raise)?;
    let counts = QUEUE.counts();
    let (connections, idle) = pool.connections();
    Ok(Status {
        size: counts.limit,
        running: counts.running + counts.handed,
        waiting: counts.waiting,
        connections,
        idle,
    })
}
