//! Starting and stopping the pool, the schema DDL, and what the Elixir side
//! asks of the library itself.

use std::time::Instant;

use locks_core::args::{CLICK_REF_PREFIX, MAX_REF_BYTES, MAX_TTL_S};
use locks_core::{global, schema, Deadline, Job, LockPool, Settings, ROW_WAIT};
use rustler::{Atom, Env, NifMap, NifResult, Term};

use crate::atoms;
use crate::call::{go, QUEUE};
use crate::error::raise;

/// Builds a new pool, sizes the queue to it, then installs it: a pool that
/// cannot be built changes nothing. Connects nothing; reads the CA file, if
/// one is set, unless TLS is off. `settings` is the Elixir `Config` struct,
/// every setting resolved, defaulted and checked there.
#[rustler::nif(schedule = "DirtyIo")]
fn start(env: Env<'_>, settings: Settings) -> NifResult<Atom> {
    let pool = LockPool::new(settings).map_err(raise)?;
    QUEUE.resize(Some(pool.settings().pool_size), go(env));
    global::start(pool);
    Ok(atoms::ok())
}

/// Closes the pool: its idle connections at once, each busy one as its call
/// ends; every caller in line is sent go, and its call finds no pool.
#[rustler::nif(schedule = "DirtyIo")]
fn stop(env: Env<'_>) -> Atom {
    global::stop();
    QUEUE.resize(None, go(env));
    atoms::ok()
}

/// The DDL of `kind`, `:tables` or `:lock_columns`; any other term is a bad argument.
fn ddl_text(kind: &str, prefix: Option<&str>) -> NifResult<String> {
    match kind {
        "tables" => Ok(schema::tables(prefix)),
        "lock_columns" => Ok(schema::lock_columns(prefix)),
        _ => Err(rustler::Error::BadArg),
    }
}

#[rustler::nif]
fn ddl(kind: Term<'_>, prefix: Option<String>) -> NifResult<String> {
    ddl_text(&kind.atom_to_string()?, prefix.as_deref())
}

#[rustler::nif(schedule = "DirtyIo")]
fn setup(kind: Term<'_>) -> NifResult<Atom> {
    let kind = kind.atom_to_string()?;
    let pool = global::current().map_err(raise)?;
    let ddl = ddl_text(&kind, pool.settings().prefix.as_deref())?;
    let deadline = Deadline::new(Instant::now(), pool.settings());
    pool.run_ddl(deadline, &ddl).map_err(raise)?;
    Ok(atoms::ok())
}

/// The fence of `Locks.transaction/4` for the pool's tables
/// (`locks_core::fence`); the host's repo runs it, not the pool.
#[rustler::nif]
fn fence_sql() -> NifResult<String> {
    let pool = global::current().map_err(raise)?;
    Ok(locks_core::fence(pool.settings().prefix.as_deref(), true))
}

#[rustler::nif]
fn loaded() -> bool {
    true
}

/// The limits of the argument rules (`locks_core::args`), which the Elixir
/// API checks before any call, to word its `ArgumentError`, and the longest
/// a statement waits for a row (`locks_core::ROW_WAIT`), which its docs state.
#[derive(NifMap)]
#[rustler(encode)]
struct Rules {
    click_prefix: &'static str,
    max_ref_bytes: usize,
    max_ttl_s: i32,
    row_wait_ms: u64,
}

#[rustler::nif]
fn rules() -> Rules {
    Rules {
        click_prefix: CLICK_REF_PREFIX,
        max_ref_bytes: MAX_REF_BYTES,
        max_ttl_s: MAX_TTL_S,
        row_wait_ms: u64::try_from(ROW_WAIT.as_millis()).unwrap_or(u64::MAX),
    }
}

/// The lock functions, as the Elixir API names them (`Job::functions`).
#[rustler::nif]
fn functions(env: Env<'_>) -> NifResult<Vec<Atom>> {
    Job::functions().map(|name| Atom::from_str(env, name)).collect()
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
        size: pool.settings().pool_size,
        running: counts.running + counts.held,
        waiting: counts.waiting,
        connections,
        idle,
    })
}
