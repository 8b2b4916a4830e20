//! How one lock call runs: its turn at the gate (`locks_core::admission`),
//! its deadline, the pool.
//!
//! A call is at most two NIF calls. `admit/3`, on a normal scheduler, asks
//! the gate for a turn; with one (a token) the caller runs its job with
//! `run/4` on a dirty-I/O scheduler. A caller that must wait leaves its job
//! with the gate and waits in Elixir (a `receive`) for a message tagged
//! `{:phoenix_kit_agent_locks, ticket, _}`:
//!
//! * `{:turn, token}`: a turn was freed for it; it runs its job with `run/4`;
//! * `{:done, answer}` or `{:raise, exception}`: a call that finished in its
//!   turn ran this job too ([`serve`]): the turn goes from job to job on one
//!   dirty thread and its connection is never idle waiting for a woken
//!   process. The answers are kept and sent by [`send_answers`] from a
//!   normal scheduler: by the serving caller once back there (`run/4`
//!   answers `{:phoenix_kit_agent_locks, :deliver, answer}` and it calls
//!   `deliver/0`), else, if it was killed, by the next `admit/3` or
//!   `leave/2` of anyone, at the latest by the waiter's own `leave/2` or
//!   `deliver/0`. Not from the dirty thread: a message allocated there must
//!   be freed through the VM's aux thread (~10 µs of CPU a call at 50
//!   callers).
//!
//! At its checkout deadline a waiter gives up with `leave/2`: `{:left,
//! exception}` (`:pool_timeout`) when it was still queued or handed a turn
//! too late, which goes back, or when its answer was sent (it is in the
//! mailbox); `{:served, wait_ms}` when another call runs its job, or ran it
//! and has not sent the answer yet, which comes within the call's deadline
//! (plus a second). A turn goes back, and the next waiter gets it, when its
//! [`Slot`] drops, whatever the outcome; a dirty NIF runs to its end even
//! when its process is killed, so no turn is lost. Turns are handed while
//! the gate is locked (see `Waiters`) and kept answers sent while they are
//! locked: a caller that gives up finds whatever was meant for it in its
//! mailbox, and nothing later.

use std::sync::{Mutex, PoisonError, TryLockError};
use std::time::{Duration, Instant};

use locks_core::admission::{Admission, Gate, Left, Permit, Waiters, Wake};
use locks_core::{global, Answer, Deadline, Error, Job, LockPool, Settings};
use rustler::{Encoder, Env, LocalPid, NifMap, NifResult, Term};

use crate::atoms;
use crate::error::{exception, raise};
use crate::locks::{encode, job};

/// The most waiting jobs a call runs in its turn after its own: each delays
/// its own caller's answer by one statement, and keeps the connection busy.
const SERVE_AT_MOST: usize = 8;

/// A caller waiting for a turn, with its job and its call's stamp.
pub struct Waiter {
    pid: LocalPid,
    start: i64,
    job: Job,
}

/// The turns of this VM; its capacity is the installed pool's size.
pub static GATE: Gate<Waiter> = Gate::new();

/// The answers [`serve`] got and [`send_answers`] has not sent yet, with the
/// caller and the ticket each is for.
static ANSWERED: Mutex<Vec<(LocalPid, u64, locks_core::Result<Answer>)>> = Mutex::new(Vec::new());

/// A served job's answer, kept for [`send_answers`] when dropped: also if
/// the job never got one (a panic on the way, which rustler turns into a
/// raise of the serving call), so that its caller is told and its ticket
/// leaves the gate; it may have run, so it is told `:disconnected`.
struct Kept {
    pid: LocalPid,
    ticket: u64,
    answer: Option<locks_core::Result<Answer>>,
}

impl Drop for Kept {
    fn drop(&mut self) {
        let answer = self.answer.take().unwrap_or_else(|| {
            Err(Error::Disconnected("the call that ran this one stopped before its answer".into()))
        });
        let mut answers = ANSWERED.lock().unwrap_or_else(PoisonError::into_inner);
        answers.push((self.pid, self.ticket, answer));
    }
}

/// Sends every kept answer to its caller, then tells the gate, all with the
/// answers locked (before the gate, never the other way). Unless `wait`,
/// nothing when another call is sending them right now: `admit/3` never
/// waits for a lock on a normal scheduler.
fn send_answers(env: Env<'_>, wait: bool) {
    let mut answers = match ANSWERED.try_lock() {
        Ok(answers) => answers,
        Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(TryLockError::WouldBlock) if !wait => return,
        Err(TryLockError::WouldBlock) => ANSWERED.lock().unwrap_or_else(PoisonError::into_inner),
    };
    if answers.is_empty() {
        return;
    }
    let mut tickets = Vec::with_capacity(answers.len());
    for (pid, ticket, answer) in answers.drain(..) {
        let reply = match answer {
            Ok(answer) => (atoms::done(), encode(env, &answer)).encode(env),
            Err(err) => (atoms::raise(), exception(err)).encode(env),
        };
        // A waiter that died meanwhile does not need its answer.
        let _ = env.send(&pid, (atoms::phoenix_kit_agent_locks(), ticket, reply));
        tickets.push(ticket);
    }
    GATE.answered(&tickets);
}

#[rustler::nif]
fn deliver(env: Env<'_>) -> rustler::Atom {
    send_answers(env, true);
    atoms::ok()
}

/// The Erlang monotonic clock in nanoseconds, which callers stamp calls by.
#[allow(unsafe_code)]
pub fn now_ns() -> i64 {
    // SAFETY: enif_monotonic_time only reads the VM's clock; it may be
    // called from any thread and takes no pointer.
    unsafe { rustler::sys::enif_monotonic_time(rustler::sys::ErlNifTimeUnit::ERL_NIF_NSEC) }
}

fn nanos(duration: Duration) -> i64 {
    i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX)
}

/// The deadline of a call stamped `start`, on this thread's clock: the time
/// since the stamp is carried over; a stamp from the future counts as now.
fn deadline(start: i64, now: i64, settings: &Settings) -> Deadline {
    let waited = Duration::from_nanos(u64::try_from(now.saturating_sub(start)).unwrap_or(0));
    let started = Instant::now().checked_sub(waited).unwrap_or_else(Instant::now);
    Deadline::new(started, settings)
}

/// The waiting callers, as the gate sees them from a NIF call in `env`.
pub struct Callers<'a>(pub Env<'a>);

impl Waiters<Waiter> for Callers<'_> {
    fn alive(&self, waiter: &Waiter) -> bool {
        self.0.is_process_alive(waiter.pid)
    }

    fn wake(&self, Wake { who, ticket, token }: Wake<Waiter>) {
        // A waiter that died meanwhile does not need it; its turn lapses.
        let message = (atoms::phoenix_kit_agent_locks(), ticket, (atoms::turn(), token));
        let _ = self.0.send(&who.pid, message);
    }
}

/// A token, or `{:wait, ticket, ms}` with the job left with the gate; bad
/// arguments are a bad argument only for a caller that must wait. Raises
/// `:pool_timeout` when the checkout deadline has passed already,
/// `:not_started` without a pool.
#[rustler::nif]
fn admit<'a>(env: Env<'a>, start: i64, function: Term<'a>, args: Term<'a>) -> NifResult<Term<'a>> {
    send_answers(env, false);
    let pool = global::current().map_err(raise)?;
    let checkout = pool.settings().checkout_timeout;
    let expires = start.saturating_add(nanos(checkout));
    let waiter = || Ok(Waiter { pid: env.pid(), start, job: job(function, args)? });
    match GATE.admit(now_ns(), expires, waiter, &Callers(env))? {
        Admission::Go(token) => Ok(token.encode(env)),
        Admission::Wait { ticket, wait_ns } => {
            let wait_ms = wait_ns.saturating_add(999_999) / 1_000_000;
            Ok((atoms::wait(), ticket, wait_ms).encode(env))
        }
        Admission::TimedOut => Err(raise(Error::PoolTimeout(checkout))),
    }
}

#[rustler::nif]
fn leave(env: Env<'_>, ticket: u64, start: i64) -> NifResult<Term<'_>> {
    send_answers(env, true);
    let now = now_ns();
    let left = GATE.leave(ticket, now, &Callers(env));
    let pool = global::current().map_err(raise)?;
    let settings = pool.settings();
    Ok(match left {
        Left::Out => {
            let timeout = exception(Error::PoolTimeout(settings.checkout_timeout));
            (atoms::left(), timeout).encode(env)
        }
        Left::Served => {
            let ends = start.saturating_add(nanos(settings.call_timeout()));
            let wait_ms = ends.saturating_sub(now).max(0) / 1_000_000 + 1_000;
            (atoms::served(), wait_ms).encode(env)
        }
    })
}

/// Runs the call in the turn `token`, then [`serve`]s. Raises
/// `:pool_timeout` when the turn lapsed (its checkout deadline passed) or
/// was given back.
#[rustler::nif(schedule = "DirtyIo")]
fn run<'a>(
    env: Env<'a>,
    token: u64,
    start: Term<'a>,
    function: Term<'a>,
    args: Term<'a>,
) -> NifResult<Term<'a>> {
    let now = now_ns();
    // From here on the turn goes back whatever happens.
    let slot = Slot { env, permit: GATE.enter(token, now, &Callers(env)) };
    let start: i64 = start.decode()?;
    let pool = global::current().map_err(raise)?;
    let Some(permit) = &slot.permit else {
        return Err(raise(Error::PoolTimeout(pool.settings().checkout_timeout)));
    };
    let deadline = deadline(start, now, pool.settings());
    let answer = global::block_on(pool.run(deadline, &job(function, args)?)).and_then(|a| a);
    let answer = encode(env, &answer.map_err(raise)?);
    if serve(env, &pool, permit, deadline) == 0 {
        Ok(answer)
    } else {
        Ok((atoms::phoenix_kit_agent_locks(), atoms::deliver(), answer).encode(env))
    }
}

/// Runs the jobs of the first waiters in the turn of `permit`, each within
/// its own deadline and `until`, and keeps each answer; stops after
/// [`SERVE_AT_MOST`], when nobody waits, or at the first job that got no
/// answer (the database may be in trouble: the rest wait for their own
/// turns, within their own deadlines). How many it ran.
fn serve(env: Env<'_>, pool: &LockPool, permit: &Permit, until: Deadline) -> usize {
    for served in 0..SERVE_AT_MOST {
        let now = now_ns();
        let Some((ticket, waiter)) = GATE.serve(permit, now, &Callers(env)) else {
            return served;
        };
        let mut kept = Kept { pid: waiter.pid, ticket, answer: None };
        let deadline = deadline(waiter.start, now, pool.settings()).min(until);
        let answer = global::block_on(pool.run(deadline, &waiter.job)).and_then(|a| a);
        // Queued for send_answers when `kept` drops, at the end of this round.
        if kept.answer.insert(answer).is_err() {
            return served + 1;
        }
    }
    SERVE_AT_MOST
}

/// A turn in use: given back, and the next waiter woken, when dropped.
struct Slot<'a> {
    env: Env<'a>,
    permit: Option<Permit>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            GATE.release(permit, now_ns(), &Callers(self.env));
        }
    }
}

/// `status/0`'s `:pool`: the gate's turns and the pool's connections.
#[derive(NifMap)]
#[rustler(encode)]
struct Status {
    size: usize,
    running: usize,
    waiting: usize,
    served: u64,
    connections: usize,
    idle: usize,
}

#[rustler::nif]
fn status() -> NifResult<Status> {
    let pool = global::current().map_err(raise)?;
    let counts = GATE.counts();
    let (connections, idle) = pool.connections();
    Ok(Status {
        size: counts.capacity,
        running: counts.running + counts.granted,
        waiting: counts.waiting,
        served: counts.served,
        connections,
        idle,
    })
}
