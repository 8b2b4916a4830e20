//! How one lock call runs, by the protocol of `locks_core::queue` (whose
//! module doc states it): `take/3` on a normal scheduler decodes the call
//! and answers `:ok` (a slot: `run/0` next, on a dirty-I/O scheduler) or
//! `{:wait, ms}` (in line, `ms` to the deadline). A caller in line gets one
//! message, its [`Reply`], or calls `leave/0` at its deadline.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use locks_core::queue::{Queue, RUN_NEXT};
use locks_core::{global, Answer, Deadline, Error, Job, Settings};
use rustler::{Encoder, Env, LocalPid, Monitor, NifResult, OwnedEnv, Resource, ResourceArc, Term};

use crate::atoms;
use crate::error::{exception, raise, LocksError};
use crate::locks::{encode, job};

/// The slots of this VM, and its callers with their calls.
pub static QUEUE: Queue<LocalPid, Waiter> = Queue::new();

/// A caller's call, decoded once, and the monitor that watches the caller.
pub struct Waiter {
    monitor: Monitor,
    start: i64,
    job: Job,
}

/// The one message a caller in line gets, `{:phoenix_kit_agent_locks, reply}`.
enum Reply {
    /// `:go`: a slot is the caller's; it runs its call (`run/0`).
    Go,
    /// `{:ok, answer}`: its call was taken from the line and ran.
    Answer(Answer),
    /// `{:error, exception}`: its call was taken from the line and failed.
    Raise(LocksError),
}

impl Reply {
    fn encode<'a>(&self, env: Env<'a>) -> Term<'a> {
        let reply = match self {
            Reply::Go => atoms::go().encode(env),
            Reply::Answer(answer) => (atoms::ok(), encode(env, answer)).encode(env),
            Reply::Raise(error) => (atoms::error(), error).encode(env),
        };
        (atoms::phoenix_kit_agent_locks(), reply).encode(env)
    }
}

/// Sends `pid` its reply. The VM sends nothing for a process that is dead
/// (one killed while its call ran): then a thread of its own sends it, a go
/// only while the caller still holds that slot unstarted (`watch`). Should
/// the OS refuse the thread, a caller sent go leaves at its deadline and the
/// slot goes on; no call is taken from the line by a dead process.
fn send(env: Env<'_>, pid: LocalPid, reply: Reply, watch: Option<Monitor>) {
    if env.send(&pid, reply.encode(env)).is_ok() {
        return;
    }
    let _ = std::thread::Builder::new().spawn(move || {
        let send = || {
            let _ = OwnedEnv::new().send_and_clear(&pid, |env| reply.encode(env));
        };
        match watch {
            Some(monitor) => QUEUE.if_held(&pid, |w| w.monitor == monitor, send),
            None => send(),
        }
    });
}

/// Sends a caller handed a slot its go.
pub fn go(env: Env<'_>) -> impl FnMut(&LocalPid, &Waiter) + '_ {
    move |pid, waiter| send(env, *pid, Reply::Go, Some(waiter.monitor))
}

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

/// The deadline of a call stamped `start`, on the core's clock.
fn deadline(start: i64, settings: &Settings) -> Deadline {
    let started = Instant::now().checked_sub(since(start)).unwrap_or_else(Instant::now);
    Deadline::new(started, settings)
}

/// The call decoded (a bad argument takes nothing), then a slot (`:ok`) or a
/// place in line (`{:wait, ms}`, the time left to the caller's deadline;
/// `{:wait, 0}` without a pool).
#[rustler::nif]
fn take<'a>(env: Env<'a>, start: i64, function: Term<'a>, args: Term<'a>) -> NifResult<Term<'a>> {
    let job = job(env, function, args)?;
    let pid = env.pid();
    if QUEUE.take(pid, || Some(Waiter { monitor: env.monitor(callers(), &pid)?, start, job })) {
        return Ok(atoms::ok().encode(env));
    }
    let checkout = global::current().map_or(Duration::ZERO, |pool| pool.settings().checkout());
    let left = checkout.saturating_sub(since(start)).as_nanos().div_ceil(1_000_000);
    Ok((atoms::wait(), u64::try_from(left).unwrap_or(u64::MAX)).encode(env))
}

/// At the deadline: out of the line (or the slot handed just now goes back,
/// its go in the mailbox or never sent), and the exception to raise:
/// `:pool_timeout`, or `:not_started` with no pool. `:taken` when the call
/// was taken from the line: its reply comes.
#[rustler::nif]
fn leave(env: Env<'_>) -> Term<'_> {
    let Some(waiter) = QUEUE.leave(&env.pid(), go(env)) else {
        return atoms::taken().encode(env);
    };
    env.demonitor(callers(), &waiter.monitor);
    match global::current() {
        Ok(pool) => exception(Error::PoolTimeout(pool.settings().checkout())),
        Err(err) => exception(err),
    }
    .encode(env)
}

/// Runs the caller's call with its slot, freed on every path out; a caller
/// that holds none (it did not `take/3` one) gets `ArgumentError`.
#[rustler::nif(schedule = "DirtyIo")]
fn run(env: Env<'_>) -> NifResult<Term<'_>> {
    let waiter = QUEUE.start(&env.pid()).ok_or(rustler::Error::BadArg)?;
    env.demonitor(callers(), &waiter.monitor);
    let mut slot = Slot { env, own: None };
    let pool = global::current().map_err(raise)?;
    let own = deadline(waiter.start, pool.settings());
    let answer = pool.run(own, &waiter.job).map_err(raise)?;
    slot.own = Some(own);
    Ok(encode(env, &answer))
}

/// A started slot, finished when dropped. Once its own call has succeeded
/// (`own`, its deadline), it runs up to `RUN_NEXT` calls from the line, each
/// by its own deadline and this one's, whichever comes first (so this
/// call's answer is not later than its own deadline), until this one's
/// passes or one of them fails; then the slot goes to the first in line. A
/// call that failed, or whose caller is dead, runs none.
struct Slot<'a> {
    env: Env<'a>,
    own: Option<Deadline>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let env = self.env;
        let mut runs = if env.pid().is_alive(env) { RUN_NEXT } else { 0 };
        while let Some(own) = self.own.filter(|own| runs > 0 && !own.passed()) {
            runs -= 1;
            let Some((pid, waiter)) = QUEUE.finish(true, go(env)) else { return };
            env.demonitor(callers(), &waiter.monitor);
            let answer = global::current().and_then(|pool| {
                pool.run(deadline(waiter.start, pool.settings()).earlier(own), &waiter.job)
            });
            let reply = answer.map_or_else(|err| Reply::Raise(exception(err)), Reply::Answer);
            if matches!(reply, Reply::Raise(_)) {
                runs = 0;
            }
            send(env, pid, reply, None);
        }
        QUEUE.finish(false, go(env));
    }
}
