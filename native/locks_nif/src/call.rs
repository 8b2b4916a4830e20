//! How one lock call runs: its slot in the queue (`locks_core::queue`, whose
//! module doc states the protocol), its deadline, the pool.
//!
//! In NIF calls: `run/3`, on a dirty-I/O scheduler, runs the call with a
//! slot, or answers `{:wait, ms}` at once; `enter/1`, on a normal scheduler,
//! answers `:go` (a free slot handed: `run/3` starts it) or `{:wait, ms}`,
//! for a caller that saw the queue full; a waiter is sent
//! `{:phoenix_kit_agent_locks, :go}` when handed a slot (and calls `run/3`
//! again), or `{:phoenix_kit_agent_locks, exception}` when the pool closes;
//! a waiter whose checkout deadline passed calls `leave/0` instead, which
//! answers the exception to raise.

use std::time::{Duration, Instant};

use std::sync::OnceLock;

use locks_core::queue::{Queue, Start};
use locks_core::{global, Deadline, Error, Settings};
use rustler::{
    Encoder, Env, LocalPid, Monitor, NifMap, NifResult, OwnedEnv, Resource, ResourceArc, Term,
};

use crate::atoms;
use crate::error::{exception, raise, LocksError};
use crate::locks::{encode, job};

/// The slots of this VM; its limit is the installed pool's size. Each
/// caller in line, or handed a slot it has not started, is watched by a
/// monitor. The VM refuses one for a process that is dead already (killed
/// while its `run/3` runs on the dirty scheduler): such a caller is not put
/// in line.
pub static QUEUE: Queue<LocalPid, Monitor> = Queue::new();

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
pub fn go(env: Env<'_>) -> impl FnMut(&LocalPid, &Monitor) + '_ {
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
pub fn tell(env: Env<'_>, why: LocksError) -> impl FnMut((LocalPid, Monitor)) + '_ {
    let why = why.encode(env);
    move |(pid, monitor)| {
        unwatch(env, Some(monitor));
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

/// The caller's checkout deadline passed: out of the line (or the slot it
/// was handed just now goes back, and its `:go` is in the mailbox). The
/// exception to raise: `:pool_timeout`, or `:not_started` after a stop.
#[rustler::nif]
fn leave(env: Env<'_>) -> LocksError {
    unwatch(env, QUEUE.leave(&env.pid(), go(env)));
    match global::current() {
        Ok(pool) => exception(Error::PoolTimeout(pool.settings().checkout_timeout)),
        Err(err) => exception(err),
    }
}

/// Runs the call with a slot, which it frees at the end; or, with none
/// free, puts the caller in line and answers `{:wait, ms}` until its
/// checkout deadline (`{:wait, 0}` when it has passed already). Raises
/// `:not_started` without a pool.
///
/// A caller in line always leaves by `leave/0` from its `receive`, never from
/// here while a pool is installed: once it is in line and the queue unlocked,
/// a slot may be handed to it (its `:go` sent) before it leaves, and only the
/// Elixir side, on its way out, takes that message out of the mailbox. (With
/// no pool the queue has no slots to hand, and `wait` takes it out at once.)
#[rustler::nif(schedule = "DirtyIo")]
fn run<'a>(
    env: Env<'a>,
    start: Term<'a>,
    function: Term<'a>,
    args: Term<'a>,
) -> NifResult<Term<'a>> {
    let start: i64 = start.decode()?;
    let pid = env.pid();
    // The slot first, before the job is decoded or the pool looked up: from
    // here every way out (a bad argument, no pool) frees it.
    let slot = match QUEUE.start(pid, || env.monitor(callers(), &pid)) {
        Start::Run(watch) => Slot::started(env, watch),
        Start::Wait => return wait(env, start),
    };
    let pool = global::current().map_err(raise)?;
    let job = job(function, args)?;
    let answer = pool.run(deadline(start, pool.settings()), &job).map_err(raise)?;
    drop(slot);
    Ok(encode(env, &answer))
}

/// For a caller that expects to wait (the Elixir side saw the queue full):
/// on a normal scheduler, a free slot is handed to it (`:go`, and its
/// `run/3` next starts it), or it waits in line (`{:wait, ms}`, as from
/// `run/3`, and leaves it as `run/3`'s doc says), without a dirty-I/O
/// scheduler's round trip. Raises `:not_started` without a pool.
#[rustler::nif]
fn enter<'a>(env: Env<'a>, start: Term<'a>) -> NifResult<Term<'a>> {
    let start: i64 = start.decode()?;
    let pid = env.pid();
    if QUEUE.enter(pid, || env.monitor(callers(), &pid)) {
        Ok(atoms::go().encode(env))
    } else {
        wait(env, start)
    }
}

/// `{:wait, ms}` for a caller put in line, its checkout deadline's time
/// left: at most the checkout timeout, since a stamp from the future counts
/// as now (as for the statement's deadline). With no pool (it closed as the
/// caller came) the caller leaves the line again and `:not_started` is
/// raised.
fn wait(env: Env<'_>, start: i64) -> NifResult<Term<'_>> {
    let checkout = match global::current() {
        Ok(pool) => pool.settings().checkout_timeout,
        Err(err) => {
            unwatch(env, QUEUE.leave(&env.pid(), go(env)));
            return Err(raise(err));
        }
    };
    let checkout_ns = i64::try_from(checkout.as_nanos()).unwrap_or(i64::MAX);
    let left = start.saturating_add(checkout_ns).saturating_sub(now_ns()).clamp(0, checkout_ns);
    Ok((atoms::wait(), left.saturating_add(999_999) / 1_000_000).encode(env))
}

/// A started slot: finished, and handed to the first in line, when dropped,
/// on every path out of `run/3`.
struct Slot<'a>(Env<'a>);

impl<'a> Slot<'a> {
    /// The slot `run/3` started; a caller that waited for it is no longer watched.
    fn started(env: Env<'a>, watch: Option<Monitor>) -> Self {
        unwatch(env, watch);
        Slot(env)
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
