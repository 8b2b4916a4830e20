//! How one lock call runs: the NIFs `enter/3`, `run/3` and `leave/0` of the protocol
//! that `locks_core::queue` states, and a waiter's [`Reply`].

use std::cell::OnceCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, mpsc::Sender, OnceLock};
use std::time::{Duration, Instant};

use locks_core::queue::{Queue, RUN_NEXT};
use locks_core::{global, Answer, Deadline, Error, Job, Settings};
use rustler::sys::{enif_monotonic_time, ErlNifTimeUnit::ERL_NIF_NSEC};
use rustler::{Encoder, Env, LocalPid, Monitor, NifResult, OwnedEnv, Resource, ResourceArc, Term};

use crate::atoms;
use crate::error::{exception, raise, LocksError};
use crate::locks::{encode, job};

/// The slots of this VM, and its callers with their calls.
pub static QUEUE: Queue<LocalPid, Waiter> = Queue::new();

/// A caller's call: its stamp, which no other call of the caller has, and its job.
pub struct Waiter {
    start: i64,
    job: Job,
}

/// The one message a caller in line gets, `{:phoenix_kit_agent_locks, reply}`:
/// `:go` (a slot is its own: it makes its call again), or the outcome of its
/// call taken from the line, `{:ok, answer}` or `{:error, exception}`.
enum Reply {
    Go,
    Done(Result<Answer, LocksError>),
}

impl Reply {
    fn encode<'a>(&self, env: Env<'a>) -> Term<'a> {
        let reply = match self {
            Reply::Go => atoms::go().encode(env),
            Reply::Done(Ok(answer)) => (atoms::ok(), encode(env, answer)).encode(env),
            Reply::Done(Err(error)) => (atoms::error(), error).encode(env),
        };
        (atoms::phoenix_kit_agent_locks(), reply).encode(env)
    }
}

/// Sends `pid` its reply; from a dead process (killed while its call ran), which the VM
/// sends nothing for, [`later`]: a go only while its call (`start`) holds the slot
/// untaken (if the OS gives no thread, a caller sent go leaves at its deadline).
fn send(env: Env<'_>, pid: LocalPid, reply: Reply, start: Option<i64>) {
    if env.send(&pid, reply.encode(env)).is_err() {
        later(move || match start {
            Some(start) => QUEUE.if_held(&pid, |w| w.start == start, || post(&pid, &reply)),
            None => post(&pid, &reply),
        });
    }
}

/// Sends `pid` its reply from a thread that is no process.
fn post(pid: &LocalPid, reply: &Reply) {
    let _ = OwnedEnv::new().send_and_clear(pid, |env| reply.encode(env));
}

/// Sends a caller handed a slot its go (`admin.rs` too: a new pool, a stop).
pub fn go(env: Env<'_>) -> impl FnMut(&LocalPid, &Waiter) + '_ {
    move |pid, waiter| send(env, *pid, Reply::Go, Some(waiter.start))
}

/// The resource whose monitors (one a caller, for its life) take the dead out.
struct Callers;

#[rustler::resource_impl]
impl Resource for Callers {
    const IMPLEMENTS_DOWN: bool = true;

    /// Called holding the dead process's locks, which a call handing it its
    /// go may be waiting for, so the queue is taken [`later`] (here only if
    /// the OS gave no thread).
    fn down<'a>(&'a self, env: Env<'a>, pid: LocalPid, _monitor: Monitor) {
        let posted = |pid: &LocalPid, _: &Waiter| post(pid, &Reply::Go);
        if !later(move || QUEUE.gone(&pid, posted)) {
            QUEUE.gone(&pid, go(env));
        }
    }
}

/// Work for the NIF's own thread.
type Work = Box<dyn FnOnce() + Send>;

/// Runs `work` on a thread of the NIF's own, one after the other: it is no
/// process, so it may send from nowhere and wait for the queue whatever
/// process locks are held meanwhile. False if the OS gave it no thread.
fn later(work: impl FnOnce() + Send + 'static) -> bool {
    static LATER: OnceLock<Option<Sender<Work>>> = OnceLock::new();
    let start = || {
        let (later, todo) = mpsc::channel::<Work>();
        let thread = std::thread::Builder::new().name("locks-later".into());
        thread.spawn(move || todo.into_iter().for_each(|work| work())).ok()?;
        Some(later)
    };
    LATER.get_or_init(start).as_ref().is_some_and(|later| later.send(Box::new(work)).is_ok())
}

/// The time since `start`, a caller's stamp (Erlang monotonic ns); a future one is now.
#[allow(unsafe_code)]
fn since(start: i64) -> Duration {
    // SAFETY: it only reads the VM's clock, from any thread, and takes no pointer.
    let now = unsafe { enif_monotonic_time(ERL_NIF_NSEC) };
    Duration::from_nanos(u64::try_from(now.saturating_sub(start)).unwrap_or(0))
}

/// The deadline of a call stamped `start`, on the core's clock.
fn deadline(start: i64, settings: &Settings) -> Deadline {
    let started = Instant::now().checked_sub(since(start)).unwrap_or_else(Instant::now);
    Deadline::new(started, settings)
}

/// At the deadline: out of the line (or the slot just handed goes back) and
/// the exception to raise; or `:taken`: the call's answer comes.
#[rustler::nif]
fn leave(env: Env<'_>) -> Term<'_> {
    if QUEUE.leave(&env.pid(), go(env)).is_none() {
        return atoms::taken().encode(env);
    }
    let left = global::current().map(|pool| Error::PoolTimeout(pool.settings().checkout()));
    exception(left.unwrap_or_else(|err| err)).encode(env)
}

/// Step 1's look, on the caller's scheduler: `:go` (`run/3` runs the call), or `{:wait, ms}`.
#[rustler::nif]
fn enter<'a>(env: Env<'a>, start: i64, function: Term<'a>, args: Term<'a>) -> NifResult<Term<'a>> {
    if WAITED.load(Ordering::Relaxed) {
        if take(env, start, job(env, function, args)?, false).is_none() {
            return Ok(wait(env, start));
        }
        WAITED.store(false, Ordering::Relaxed);
    }
    Ok(atoms::go().encode(env))
}

/// On a dirty-I/O scheduler: the call run with its slot, freed on every path
/// out; or, the slot taken meanwhile, in line as from `enter/3`.
#[rustler::nif(schedule = "DirtyIo")]
fn run<'a>(env: Env<'a>, start: i64, function: Term<'a>, args: Term<'a>) -> NifResult<Term<'a>> {
    let job = job(env, function, args)?;
    let Some(waiter) = take(env, start, job, true) else { return Ok(wait(env, start)) };
    let mut slot = Slot { env, own: None };
    let pool = global::current().map_err(raise)?;
    let own = deadline(waiter.start, pool.settings());
    let answer = pool.run(own, &waiter.job).map_err(raise)?;
    slot.own = Some(own);
    Ok(encode(env, &answer))
}

/// The call [`Queue::take`]n.
fn take(env: Env<'_>, start: i64, job: Job, run: bool) -> Option<Waiter> {
    static CALLERS: OnceLock<ResourceArc<Callers>> = OnceLock::new();
    let callers = CALLERS.get_or_init(|| ResourceArc::new(Callers));
    QUEUE.take(env.pid(), Waiter { start, job }, || env.monitor(callers, &env.pid()).is_some(), run)
}

/// Whether the last call had to wait: set by [`wait`], cleared by `enter/3`.
static WAITED: AtomicBool = AtomicBool::new(false);

/// `{:wait, ms}`: `ms` to the deadline of a call stamped `start` (0 without a pool).
fn wait(env: Env<'_>, start: i64) -> Term<'_> {
    WAITED.store(true, Ordering::Relaxed);
    let checkout = global::current().map_or(Duration::ZERO, |pool| pool.settings().checkout());
    let left = checkout.saturating_sub(since(start)).as_nanos().div_ceil(1_000_000);
    (atoms::wait(), u64::try_from(left).unwrap_or(u64::MAX)).encode(env)
}

/// A started slot, finished when dropped by step 2: `own` is the deadline of
/// its call once that has succeeded (whether its caller lives is asked only when a call waits).
struct Slot<'a> {
    env: Env<'a>,
    own: Option<Deadline>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let env = self.env;
        let alive = OnceCell::new();
        let take = || *alive.get_or_init(|| env.pid().is_alive(env));
        for _ in 0..RUN_NEXT {
            let Some(own) = self.own.filter(|own| !own.passed()) else { break };
            let Some((pid, waiter)) = QUEUE.finish(take, go(env)) else { return };
            let answer = global::current().and_then(|pool| {
                pool.run(deadline(waiter.start, pool.settings()).earlier(own), &waiter.job)
            });
            self.own = self.own.filter(|_| answer.is_ok());
            send(env, pid, Reply::Done(answer.map_err(exception)), None);
        }
        QUEUE.finish(|| false, go(env));
    }
}
