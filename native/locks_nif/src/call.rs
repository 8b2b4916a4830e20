//! How one lock call runs: its slot in the queue (`locks_core::queue`, whose
//! module doc states the protocol), its deadline, the pool.
//!
//! In NIF calls: `run/3`, on a dirty-I/O scheduler, runs the call with a
//! slot, or answers `{:wait, ms}` at once, its call left in line; `enter/3`,
//! on a normal scheduler, answers `:go` (a free slot handed: `run/3` starts
//! it) or `{:wait, ms}`, for a caller that saw the queue full. A waiter is
//! sent `{:phoenix_kit_agent_locks, message}`: `{:answer, term}` when its
//! call was run from the line, `:go` when handed a slot (it calls `run/3`
//! again), or the exception to raise (its call failed, or the pool closed).
//! A waiter whose checkout deadline passed calls `leave/0` instead, which
//! answers the exception to raise, or `:told` (its message comes).

use std::sync::mpsc::{self, Sender};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use locks_core::queue::{Queue, Start, RUN_NEXT};
use locks_core::{global, Answer, Deadline, Error, Job, Settings};
use rustler::{Encoder, Env, LocalPid, Monitor, NifResult, OwnedEnv, Resource, ResourceArc, Term};

use crate::atoms;
use crate::error::{exception, raise, LocksError};
use crate::locks::{encode, job};

/// The slots of this VM; its limit is the installed pool's size. Each
/// caller in line, or handed a slot it has not started, is watched by a
/// monitor. The VM refuses one for a process that is dead already (killed
/// while its `run/3` runs on the dirty scheduler): such a caller is not put
/// in line.
pub static QUEUE: Queue<LocalPid, Waiter> = Queue::new();

/// What a caller leaves in line: its monitor, and its call (the stamp and
/// the job, decoded once), for whichever call runs it.
pub struct Waiter {
    monitor: Monitor,
    start: i64,
    job: Job,
}

impl Waiter {
    /// A waiter for the calling process, or `None` if it is dead already.
    fn new(env: Env<'_>, start: i64, job: Job) -> Option<Self> {
        let monitor = env.monitor(callers(), &env.pid())?;
        Some(Waiter { monitor, start, job })
    }
}

/// The resource whose monitors tell the queue that a caller died holding a
/// slot it had not started, or in line.
struct Callers;

#[rustler::resource_impl]
impl Resource for Callers {
    const IMPLEMENTS_DOWN: bool = true;

    fn down<'a>(&'a self, env: Env<'a>, pid: LocalPid, _monitor: Monitor) {
        let _ = QUEUE.leave(&pid, go(env));
    }
}

static CALLERS: OnceLock<ResourceArc<Callers>> = OnceLock::new();

fn callers() -> &'static ResourceArc<Callers> {
    CALLERS.get_or_init(|| ResourceArc::new(Callers))
}

/// Tells a caller in line that it was handed a slot. A caller that died
/// meanwhile is taken out by its monitor. When the call handing the slot
/// was killed while it ran, [`MAIL`] sends it instead.
pub fn go(env: Env<'_>) -> impl FnMut(&LocalPid, &Waiter) + '_ {
    move |pid, waiter| {
        if env.send(pid, (atoms::phoenix_kit_agent_locks(), atoms::go())).is_err() {
            // Should the OS have refused the mail's thread, the caller
            // leaves at its deadline and the slot goes on.
            post(Letter::Go(*pid, waiter.monitor));
        }
    }
}

/// Takes a caller out of the line for good, telling it why (by [`MAIL`]
/// when the process telling it is dead: the caller's `leave/0` answers
/// `:told`, and it waits for this message).
pub fn tell(env: Env<'_>, why: LocksError) -> impl FnMut((LocalPid, Waiter)) + '_ {
    move |(pid, waiter)| {
        unwatch(env, Some(waiter.monitor));
        reply(env, pid, Err(why.clone()));
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
/// was handed just now goes back, and its `:go` is in the mailbox, or never
/// comes), and the exception to raise: `:pool_timeout`, or `:not_started`
/// after a stop. Or `:told`, for a caller out of the line already: its
/// message (its call's answer, by the call's deadline, or the pool's
/// closing) is there or comes.
#[rustler::nif]
fn leave(env: Env<'_>) -> Term<'_> {
    let Some(waiter) = QUEUE.leave(&env.pid(), go(env)) else {
        return atoms::told().encode(env);
    };
    unwatch(env, Some(waiter.monitor));
    match global::current() {
        Ok(pool) => exception(Error::PoolTimeout(pool.settings().checkout())),
        Err(err) => exception(err),
    }
    .encode(env)
}

/// Runs the call with a slot, which it frees at the end, after running up
/// to `RUN_NEXT` calls from the line; or, with none free, puts the caller
/// in line, its job decoded, and answers `{:wait, ms}` until its checkout
/// deadline (`{:wait, 0}` when it has passed already, or without a pool:
/// then `leave/0` raises `:not_started`).
///
/// A caller in line always leaves by `leave/0` from its `receive`, never from
/// here: once it is in line and the queue unlocked, a slot may be handed to
/// it, or its call taken, before it leaves, and only the Elixir side, on its
/// way out, takes that message out of the mailbox.
#[rustler::nif(schedule = "DirtyIo")]
fn run<'a>(
    env: Env<'a>,
    start: Term<'a>,
    function: Term<'a>,
    args: Term<'a>,
) -> NifResult<Term<'a>> {
    let start: i64 = start.decode()?;
    // The job is decoded once: into the line (with the queue locked) when the
    // caller is to wait, else with the slot, or taken back from the slot
    // handed to it. From the slot on, every way out frees it.
    let mut bad = None;
    let wait_in_line = || match job(env, function, args) {
        Ok(job) => Waiter::new(env, start, job),
        Err(err) => bad.replace(err).and(None),
    };
    let (mut slot, job) = match QUEUE.start(env.pid(), wait_in_line) {
        Start::Run(Some(waiter)) => (Slot::started(env, Some(waiter.monitor)), waiter.job),
        Start::Run(None) => (Slot::started(env, None), job(env, function, args)?),
        Start::Wait => return bad.map_or_else(|| wait(env, start), Err),
    };
    let pool = global::current().map_err(raise)?;
    let deadline = deadline(start, pool.settings());
    let answer = pool.run(deadline, &job).map_err(raise)?;
    slot.deadline = Some(deadline);
    drop(slot);
    Ok(encode(env, &answer))
}

/// For a caller that expects to wait (the Elixir side saw the queue full):
/// on a normal scheduler, a free slot is handed to it (`:go`, and its
/// `run/3` next starts it), or it waits in line (`{:wait, ms}`, as from
/// `run/3`, and leaves it as `run/3`'s doc says), without a dirty-I/O
/// scheduler's round trip. Without a pool, `{:wait, 0}` (as `run/3`).
#[rustler::nif]
fn enter<'a>(
    env: Env<'a>,
    start: Term<'a>,
    function: Term<'a>,
    args: Term<'a>,
) -> NifResult<Term<'a>> {
    let start: i64 = start.decode()?;
    let job = job(env, function, args)?;
    if QUEUE.enter(env.pid(), || Waiter::new(env, start, job)) {
        Ok(atoms::go().encode(env))
    } else {
        wait(env, start)
    }
}

/// `{:wait, ms}` for a caller put in line, its checkout deadline's time
/// left: at most the checkout timeout, since a stamp from the future counts
/// as now (as for the statement's deadline); `{:wait, 0}` with no pool (it
/// closed as the caller came), whose `leave/0` then raises `:not_started`.
fn wait(env: Env<'_>, start: i64) -> NifResult<Term<'_>> {
    let checkout = global::current().map_or(Duration::ZERO, |p| p.settings().checkout());
    let checkout_ns = i64::try_from(checkout.as_nanos()).unwrap_or(i64::MAX);
    let left = start.saturating_add(checkout_ns).saturating_sub(now_ns()).clamp(0, checkout_ns);
    Ok((atoms::wait(), left.saturating_add(999_999) / 1_000_000).encode(env))
}

/// A started slot: finished when dropped, on every path out of `run/3`.
/// Once its own call has succeeded (its deadline kept here), it first runs
/// up to `RUN_NEXT` calls from the line, each by its own deadline and this
/// one's, whichever comes first (so that this call's answer is not later
/// than its own deadline), until this one's passes or one of them fails;
/// then its slot goes to the first in line. A call that failed (no pool, a
/// bad argument, a database or path in doubt, its time up) runs none: each
/// waiter runs its own, by its own deadline.
struct Slot<'a> {
    env: Env<'a>,
    deadline: Option<Deadline>,
}

impl<'a> Slot<'a> {
    /// The slot `run/3` started; a caller that waited for it is no longer watched.
    fn started(env: Env<'a>, watch: Option<Monitor>) -> Self {
        unwatch(env, watch);
        Slot { env, deadline: None }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut runs = if MAIL.get_or_init(mail).is_some() { RUN_NEXT } else { 0 };
        let env = self.env;
        // A call taken from the line that fails stops the taking, as this
        // call's own deadline does: the rest run their own, by their own.
        while let Some(own) = self.deadline.filter(|own| runs > 0 && !own.passed()) {
            runs -= 1;
            let Some((pid, waiter)) = QUEUE.finish(true, go(env)) else { return };
            unwatch(env, Some(waiter.monitor));
            let answer = global::current().and_then(|pool| {
                let deadline = deadline(waiter.start, pool.settings()).earlier(own);
                pool.run(deadline, &waiter.job)
            });
            if answer.is_err() {
                runs = 0;
            }
            reply(env, pid, answer.map_err(exception));
        }
        QUEUE.finish(false, go(env));
    }
}

/// Sends a waiter taken out of the line its message (the answer of its call,
/// run from the line, or the exception to raise); by [`MAIL`] when the
/// sending process is dead (killed while its call ran).
fn reply(env: Env<'_>, pid: LocalPid, reply: Reply) {
    if env.send(&pid, message(env, &reply)).is_err() {
        post(Letter::Answer(pid, reply));
    }
}

/// A call's answer, or the exception its caller raises.
type Reply = Result<Answer, LocksError>;

fn message<'a>(env: Env<'a>, reply: &Reply) -> Term<'a> {
    let message = match reply {
        Ok(answer) => (atoms::answer(), encode(env, answer)).encode(env),
        Err(exception) => exception.encode(env),
    };
    (atoms::phoenix_kit_agent_locks(), message).encode(env)
}

/// A message that a call could not send because its own process is dead
/// (the VM refuses a message whose sender is dead).
enum Letter {
    /// `:go`, sent with the queue locked again, only while that same slot is
    /// still the caller's, by its monitor: none after the caller left, nor
    /// for a slot handed to it since, which was told.
    Go(LocalPid, Monitor),
    /// The answer of a call run from the line.
    Answer(LocalPid, Reply),
}

/// A thread of its own, started by the first call that ends, that sends
/// the letters. Calls are run from the line only while it runs: should the
/// OS refuse it, every waiter is handed its slot instead, and no answer is
/// ever lost.
static MAIL: OnceLock<Option<Sender<Letter>>> = OnceLock::new();

/// Whether the letter was posted.
fn post(letter: Letter) -> bool {
    MAIL.get_or_init(mail).as_ref().is_some_and(|mail| mail.send(letter).is_ok())
}

fn mail() -> Option<Sender<Letter>> {
    let (mail, letters) = mpsc::channel();
    let thread = std::thread::Builder::new().name("locks-mail".into()).spawn(move || {
        let mut env = OwnedEnv::new();
        for letter in letters {
            match letter {
                Letter::Go(pid, monitor) => QUEUE.if_handed(
                    &pid,
                    |w| w.monitor == monitor,
                    || {
                        let _ = env.send_and_clear(&pid, |_| {
                            (atoms::phoenix_kit_agent_locks(), atoms::go())
                        });
                    },
                ),
                Letter::Answer(pid, reply) => {
                    let _ = env.send_and_clear(&pid, |env| message(env, &reply));
                }
            }
        }
    });
    thread.ok().map(|_| mail)
}
