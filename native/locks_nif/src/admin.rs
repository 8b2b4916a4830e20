//! Starting and stopping the pool, and the schema DDL.

use locks_core::config::Options;
use locks_core::{global, schema, Config};
use rustler::{Atom, NifMap};

use crate::atoms;
use crate::error::raise;

/// The options `PhoenixKitAgent.Turns.Locks.Config` hands over; every key is
/// present, `nil` meaning "the default".
#[derive(NifMap)]
struct StartOptions {
    url: String,
    pool_size: Option<i64>,
    connect_timeout: Option<i64>,
    checkout_timeout: Option<i64>,
    statement_timeout: Option<i64>,
    prefix: Option<String>,
}

/// Checks the options and installs a new pool (closing the previous one).
/// Connects nothing.
#[rustler::nif(schedule = "DirtyIo")]
fn start(options: StartOptions) -> rustler::NifResult<Atom> {
    let config = Config::new(&Options {
        url: &options.url,
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

/// The DDL for `kind` (`:tables` or `:lock_columns`) under `prefix` (or none).
#[rustler::nif]
fn ddl(kind: Atom, prefix: Option<String>) -> rustler::NifResult<String> {
    let schema = prefix
        .as_deref()
        .map(schema::quote_schema)
        .transpose()
        .map_err(raise)?;
    if kind == atoms::tables() {
        Ok(schema::tables(schema.as_deref()))
    } else if kind == atoms::lock_columns() {
        Ok(schema::lock_columns(schema.as_deref()))
    } else {
        Err(rustler::Error::BadArg)
    }
}

/// Runs the DDL for `kind` on the installed pool, under its prefix.
#[rustler::nif(schedule = "DirtyIo")]
fn setup(kind: Atom) -> rustler::NifResult<Atom> {
    let locks = global::current().map_err(raise)?;
    let schema = locks.config().schema();
    let ddl = if kind == atoms::lock_columns() {
        schema::lock_columns(schema)
    } else {
        schema::tables(schema)
    };
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
fn statements() -> rustler::NifResult<Vec<(String, String)>> {
    let locks = global::current().map_err(raise)?;
    Ok(locks
        .statements()
        .iter()
        .map(|(name, sql)| ((*name).to_owned(), (*sql).to_owned()))
        .collect())
}
