//! How one lock call runs, by the protocol of `locks_core::queue` (whose
//! module doc states it): `take/1` on a normal scheduler answers `:ok` (a
//! slot) or `{:wait, ms}` (in line, `ms` to the deadline); a caller in line
//! is sent `{:phoenix_kit_agent_locks, :go}`, or calls `leave/0` at its
//! deadline; `run/3` on a dirty-I/O scheduler runs the call with the slot.

use std::time::{Duration, Instant};

use locks_core::queue::Queue;
use locks_core::{global, Deadline, Error};
use rustler::{Encoder, Env, LocalPid, Monitor, NifResult, OwnedEnv, Resource, ResourceArc, Term};
use std::sync::OnceLock;

use crate::atoms;
use crate::error::{exception, raise};
use crate::locks::{encode, job};

/// The slots of this VM, its callers watched by a monitor.
pub static QUEUE: Queue<LocalPid, Monitor> = Queue::new();

/// The resource whose monitors take a dead caller out of the queue.
struct Callers;

#[rustler::resource_impl]
impl Resource for Callers {
    const IMPLEMENTS_DOWN: bool = true;

    fn down<'a>(&'a self, env: Env<'a>, pid: LocalPid, _monitor: Monitor) {
        QUEUE.leave(&pid, go(env));
    }
}

fn callers() -> &'static ResourceArc<Callers> {
    static CALLERS: OnceLock<ResourceArc<Callers>> = OnceLock::new();
    CALLERS.get_or_init(|| ResourceArc::new(Callers))
}

/// Sends a caller handed a slot its go. The VM sends nothing for a process
/// that is dead (one killed while its call ran, whose slot is handed on as
/// the call ends): then a thread of its own sends it, if the caller still
/// holds that slot (should the OS refuse the thread, the caller leaves at
/// its deadline and the slot goes on).
pub fn go(env: Env<'_>) -> impl FnMut(&LocalPid, &Monitor) + '_ {
    let go = (atoms::phoenix_kit_agent_locks(), atoms::go());
    move |pid, monitor| {
        if env.send(pid, go).is_err() {
            let (pid, monitor) = (*pid, *monitor);
            let _ = std::thread::Builder::new().spawn(move || {
                QUEUE.if_held(
                    &pid,
                    |m| *m == monitor,
                    || {
                        let _ = OwnedEnv::new().send_and_clear(&pid, |_| go);
                    },
                );
            });
        }
    }
}

/// The Erlang monotonic clock in nanoseconds, which callers stamp calls by.
#[allow(unsafe_code)]
fn now_ns() -> i64 {
    // SAFETY: enif_monotonic_time only reads the VM's clock; it may be
    // called from any thread and takes no pointer.
    unsafe { rustler::sys::enif_monotonic_time(rustler::sys::ErlNifTimeUnit::ERL_NIF_NSEC) }
}

/// The time since the stamp `start`; a stamp from the future counts as now.
fn since(start: i64) -> Duration {
    Duration::from_nanos(u64::try_from(now_ns().saturating_sub(start)).unwrap_or(0))
}

/// A slot (`:ok`), or a place in line (`{:wait, ms}`, the time left to the
/// caller's deadline, stamped `start`; `{:wait, 0}` without a pool).
#[rustler::nif]
fn take(env: Env<'_>, start: i64) -> Term<'_> {
    if QUEUE.take(env.pid(), || env.monitor(callers(), &env.pid())) {
        return atoms::ok().encode(env);
    }
    let checkout = global::current().map_or(Duration::ZERO, |pool| pool.settings().checkout());
    let left = checkout.saturating_sub(since(start)).as_nanos().div_ceil(1_000_000);
    (atoms::wait(), u64::try_from(left).unwrap_or(u64::MAX)).encode(env)
}

/// At the deadline: out of the line (or the slot handed just now goes back,
/// its go in the mailbox or never sent), and the exception to raise:
/// `:pool_timeout`, or `:not_started` with no pool.
#[rustler::nif]
fn leave(env: Env<'_>) -> Term<'_> {
    if let Some(monitor) = QUEUE.leave(&env.pid(), go(env)) {
        env.demonitor(callers(), &monitor);
    }
    match global::current() {
        Ok(pool) => exception(Error::PoolTimeout(pool.settings().checkout())),
        Err(err) => exception(err),
    }
    .encode(env)
}

/// Runs the call with the caller's slot, which it frees on every path out,
/// bad arguments included; a caller that holds none (it did not `take/1`
/// one) gets `ArgumentError`.
#[rustler::nif(schedule = "DirtyIo")]
fn run<'a>(
    env: Env<'a>,
    start: Term<'a>,
    function: Term<'a>,
    args: Term<'a>,
) -> NifResult<Term<'a>> {
    let monitor = QUEUE.start(&env.pid()).ok_or(rustler::Error::BadArg)?;
    env.demonitor(callers(), &monitor);
    let _slot = Slot(env);
    let (start, job): (i64, _) = (start.decode()?, job(env, function, args)?);
    let pool = global::current().map_err(raise)?;
    let started = Instant::now().checked_sub(since(start)).unwrap_or_else(Instant::now);
    let answer = pool.run(Deadline::new(started, pool.settings()), &job).map_err(raise)?;
    Ok(encode(env, &answer))
}

/// A started slot, finished when dropped.
struct Slot<'a>(Env<'a>);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        QUEUE.finish(go(self.0));
    }
}
