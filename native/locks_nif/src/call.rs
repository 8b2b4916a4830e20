//! How one lock call runs: its slot in the queue (`locks_core::queue`, whose
//! module doc states the protocol), its deadline, the pool.
//!
//! In NIF calls: `admit/1` on a normal scheduler answers `:go` (a slot) or
//! `{:wait, ms}`; a waiter is sent `{:phoenix_kit_agent_locks, :go}` when
//! handed a slot, or `{:phoenix_kit_agent_locks, exception}` when the pool
//! closes; with a slot, `run/3` on a dirty-I/O scheduler runs the call; a
//! waiter whose checkout deadline passed calls `leave/0` instead, which
//! answers the exception to raise.

use std::time::{Duration, Instant};

use std::sync::OnceLock;

use locks_core::queue::Queue;
use locks_core::{global, Deadline, Error, Settings};
use rustler::{
    Encoder, Env, LocalPid, Monitor, NifMap, NifResult, OwnedEnv, Resource, ResourceArc, Term,
};

use crate::atoms;
use crate::error::{exception, raise, LocksError};
use crate::locks::{encode, job};

/// The slots of this VM; its limit is the installed pool's size. Each
/// caller holding an unstarted slot, or in line, is watched by a monitor
/// (`None` only if the VM refused one, which it does for dead processes).
pub static QUEUE: Queue<LocalPid, Option<Monitor>> = Queue::new();

/// The resource whose monitors tell the queue that a caller died holding a
/// slot it had not started, or in line.
struct Callers;

#[rustler::resource_impl]
impl Resource for Callers {
    const IMPLEMENTS_DOWN: bool = true;

    fn down<'a>(&'a self, env: Env<'a>, pid: LocalPid, _monitor: Monitor) {
        QUEUE.leave(&pid, go(env));
    }
}

static CALLERS: OnceLock<ResourceArc<Callers>> = OnceLock::new();

fn callers() -> &'static ResourceArc<Callers> {
    CALLERS.get_or_init(|| ResourceArc::new(Callers))
}

/// Tells a caller in line that it was handed a slot. A caller that died
/// meanwhile is taken out by its monitor. The VM refuses a message whose
/// sender is dead: when the call handing the slot was killed while it ran,
/// a thread of its own sends it instead, with the queue locked again, only
/// while that same slot is still the caller's, by its monitor: none is sent
/// after the caller left, nor for a slot handed to it since, which was told.
pub fn go(env: Env<'_>) -> impl FnMut(&LocalPid, &Option<Monitor>) + '_ {
    move |pid, monitor| {
        if env.send(pid, (atoms::phoenix_kit_agent_locks(), atoms::go())).is_err() {
            let (pid, monitor) = (*pid, *monitor);
            // Should the OS refuse a thread (no panic here: the queue is
            // locked), the caller leaves at its deadline and the slot goes on.
            let _ = std::thread::Builder::new().spawn(move || {
                QUEUE.if_handed(&pid, &monitor, || {
                    let _ = OwnedEnv::new().send_and_clear(&pid, |_env| {
                        (atoms::phoenix_kit_agent_locks(), atoms::go())
                    });
                })
            });
        }
    }
}

/// Takes a caller out of the line for good, telling it why.
pub fn tell(env: Env<'_>, why: LocksError) -> impl FnMut((LocalPid, Option<Monitor>)) + '_ {
    let why = why.encode(env);
    move |(pid, monitor)| {
        unwatch(env, monitor);
        let _ = env.send(&pid, (atoms::phoenix_kit_agent_locks(), why));
    }
}

fn unwatch(env: Env<'_>, monitor: Option<Monitor>) {
    if let Some(monitor) = monitor {
        env.demonitor(callers(), &monitor);
    }
}

/// The Erlang monotonic clock in nanoseconds, which callers stamp calls by.
#[allow(unsafe_code)]
fn now_ns() -> i64 {
    // SAFETY: enif_monotonic_time only reads the VM's clock; it may be
    // called from any thread and takes no pointer.
    unsafe { rustler::sys::enif_monotonic_time(rustler::sys::ErlNifTimeUnit::ERL_NIF_NSEC) }
}

/// The deadline of a call stamped `start`, carried over to the core's
/// clock; a stamp from the future counts as now.
fn deadline(start: i64, settings: &Settings) -> Deadline {
    let waited = Duration::from_nanos(u64::try_from(now_ns().saturating_sub(start)).unwrap_or(0));
    let started = Instant::now().checked_sub(waited).unwrap_or_else(Instant::now);
    Deadline::new(started, settings)
}

/// `:go` with a slot for the caller, or `{:wait, ms}` until its checkout
/// deadline, in line; `{:wait, 0}` when the deadline has passed already.
/// Raises `:not_started` without a pool.
///
/// A caller in line always leaves by `leave/0` from its `receive`, never from
/// here: once it is in line and the queue unlocked, a slot may be handed to
/// it (its `:go` sent) before it leaves, and only the Elixir side, on its way
/// out, takes that message out of the mailbox.
#[rustler::nif]
fn admit(env: Env<'_>, start: i64) -> NifResult<Term<'_>> {
    let pool = global::current().map_err(raise)?;
    let pid = env.pid();
    if QUEUE.admit(pid, || env.monitor(callers(), &pid)) {
        return Ok(atoms::go().encode(env));
    }
    let checkout_ns =
        i64::try_from(pool.settings().checkout_timeout.as_nanos()).unwrap_or(i64::MAX);
    let left = start.saturating_add(checkout_ns).saturating_sub(now_ns()).max(0);
    Ok((atoms::wait(), left.saturating_add(999_999) / 1_000_000).encode(env))
}

/// The caller's checkout deadline passed: out of the line (or the slot it
/// was handed just now goes back, and its `:go` is in the mailbox). The
/// exception to raise: `:pool_timeout`, or `:not_started` after a stop.
#[rustler::nif]
fn leave(env: Env<'_>) -> LocksError {
    unwatch(env, QUEUE.leave(&env.pid(), go(env)).flatten());
    match global::current() {
        Ok(pool) => exception(Error::PoolTimeout(pool.settings().checkout_timeout)),
        Err(err) => exception(err),
    }
}

/// Runs the call with the caller's slot, and frees the slot. Raises
/// `:pool_timeout` when the caller holds none.
#[rustler::nif(schedule = "DirtyIo")]
fn run<'a>(
    env: Env<'a>,
    start: Term<'a>,
    function: Term<'a>,
    args: Term<'a>,
) -> NifResult<Term<'a>> {
    // The slot first, before any term is decoded or the pool looked up: from
    // here every way out (a bad argument, no pool) frees it.
    let Some(slot) = Slot::start(env) else {
        let checkout = global::current().map_err(raise)?.settings().checkout_timeout;
        return Err(raise(Error::PoolTimeout(checkout)));
    };
    let pool = global::current().map_err(raise)?;
    let job = job(function, args)?;
    let deadline = deadline(start.decode()?, pool.settings());
    let answer = global::block_on(pool.run(deadline, &job)).and_then(|a| a).map_err(raise)?;
    drop(slot);
    Ok(encode(env, &answer))
}

/// A started slot: finished, and handed to the first in line, when dropped,
/// on every path out of `run/3`.
struct Slot<'a>(Env<'a>);

impl<'a> Slot<'a> {
    fn start(env: Env<'a>) -> Option<Self> {
        unwatch(env, QUEUE.start(&env.pid())?);
        Some(Slot(env))
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        QUEUE.finish(go(self.0));
    }
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
