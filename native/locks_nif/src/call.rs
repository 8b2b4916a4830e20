//! How one lock call runs: its turn at the gate, its deadline, the pool.
//!
//! A call is two NIF calls. `admit/1`, on a normal scheduler, asks the
//! [`Gate`] for a turn; a caller that must wait gets a ticket and waits in
//! Elixir (a `receive`, on a normal scheduler) for the message
//! `{:phoenix_kit_agent_locks, ticket, token}`, or gives up with `leave/1`
//! at its checkout deadline. Then the lock function itself, on a dirty-I/O
//! scheduler, trades the token for a permit ([`Call::enter`]) and runs; the
//! permit goes back, and the next waiter is sent its turn, when [`Call`] is
//! dropped, whatever the call's outcome. A dirty NIF always runs to its end,
//! even when its process is killed meanwhile, so no turn is ever lost.
//!
//! Every time is the Erlang monotonic clock in nanoseconds
//! (`System.monotonic_time(:nanosecond)`, `enif_monotonic_time` here): the
//! caller stamps the call once, before it queues anywhere, and that stamp is
//! the start of the call's one deadline (`locks_core::Deadline`). No wall
//! clock is involved, so a clock step changes nothing.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use locks_core::admission::{Admission, Gate, Permit, Wake};
use locks_core::{global, Deadline, Error, LockPool};
use rustler::{Encoder, Env, LocalPid, NifMap, NifResult, Term};

use crate::atoms;
use crate::error::raise;

/// The turns of this VM; its capacity is the installed pool's size.
pub static GATE: Gate<LocalPid> = Gate::new();

/// The Erlang monotonic clock, in nanoseconds.
#[allow(unsafe_code)]
pub fn now_ns() -> i64 {
    // SAFETY: enif_monotonic_time only reads the VM's clock; it may be
    // called from any thread and takes no pointer.
    unsafe { rustler::sys::enif_monotonic_time(rustler::sys::ErlNifTimeUnit::ERL_NIF_NSEC) }
}

fn nanos(duration: Duration) -> i64 {
    i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX)
}

/// Sends each waiter its turn.
pub fn wake(env: Env<'_>, wakes: Vec<Wake<LocalPid>>) {
    for Wake { who, ticket, token } in wakes {
        // A waiter that died meanwhile does not need it; its turn lapses.
        let _ = env.send(&who, (atoms::phoenix_kit_agent_locks(), ticket, token));
    }
}

fn alive(env: Env<'_>) -> impl Fn(&LocalPid) -> bool + '_ {
    move |pid| env.is_process_alive(*pid)
}

/// A turn for a call its caller started at `start`: the token, or
/// `{:wait, ticket, milliseconds}`. Raises `:pool_timeout` when the checkout
/// timeout has passed already, `:not_started` without a pool.
#[rustler::nif]
fn admit(env: Env<'_>, start: i64) -> NifResult<Term<'_>> {
    let pool = global::current().map_err(raise)?;
    let checkout = pool.settings().checkout_timeout;
    let expires = start.saturating_add(nanos(checkout));
    let (admission, wakes) = GATE.admit(now_ns(), expires, env.pid(), alive(env));
    wake(env, wakes);
    match admission {
        Admission::Go(token) => Ok(token.encode(env)),
        Admission::Wait { ticket, wait_ns } => {
            let wait_ms = wait_ns.saturating_add(999_999) / 1_000_000;
            Ok((atoms::wait(), ticket, wait_ms).encode(env))
        }
        Admission::TimedOut => Err(raise(Error::PoolTimeout(checkout))),
    }
}

/// Gives up the wait of `ticket` (its checkout deadline passed): leaves the
/// queue, or gives back a turn that came too late, and raises `:pool_timeout`.
#[rustler::nif]
fn leave(env: Env<'_>, ticket: u64) -> NifResult<()> {
    let wakes = GATE.leave(ticket, now_ns(), alive(env));
    wake(env, wakes);
    let pool = global::current().map_err(raise)?;
    Err(raise(Error::PoolTimeout(pool.settings().checkout_timeout)))
}

/// What the gate and the pool hold right now, for `status/0`.
#[derive(NifMap)]
#[rustler(encode)]
struct Status {
    capacity: usize,
    running: usize,
    waiting: usize,
    connections: usize,
    idle: usize,
}

/// The gate's turns and the pool's connections (`:not_started` without a pool).
#[rustler::nif]
fn status() -> NifResult<Status> {
    let pool = global::current().map_err(raise)?;
    let counts = GATE.counts();
    let (connections, idle) = pool.connections();
    Ok(Status {
        capacity: counts.capacity,
        running: counts.running + counts.granted,
        waiting: counts.waiting,
        connections,
        idle,
    })
}

/// A turn in use: given back, and the next waiter woken, when dropped.
struct Slot<'a> {
    env: Env<'a>,
    permit: Option<Permit>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            let wakes = GATE.release(permit, now_ns(), alive(self.env));
            wake(self.env, wakes);
        }
    }
}

/// A running lock call: its turn, the pool and the deadline.
pub struct Call<'a> {
    _slot: Slot<'a>,
    pool: Arc<LockPool>,
    deadline: Deadline,
}

impl<'a> Call<'a> {
    /// Trades the turn `token` for a permit, for a call its caller stamped
    /// `start`. Raises `:pool_timeout` when the turn lapsed (its checkout
    /// deadline passed) or was given back, `:not_started` without a pool; a
    /// term that is not a token or a stamp is a bad argument.
    pub fn enter(env: Env<'a>, token: Term<'a>, start: Term<'a>) -> NifResult<Self> {
        let token: u64 = token.decode()?;
        let now = now_ns();
        let (permit, wakes) = GATE.enter(token, now, alive(env));
        wake(env, wakes);
        // From here on the turn goes back whatever happens.
        let slot = Slot { env, permit };
        let start: i64 = start.decode()?;
        let pool = global::current().map_err(raise)?;
        if slot.permit.is_none() {
            return Err(raise(Error::PoolTimeout(pool.settings().checkout_timeout)));
        }
        // The time since the stamp, carried over to this thread's clock; a
        // stamp from the future counts as now.
        let waited = Duration::from_nanos(u64::try_from(now.saturating_sub(start)).unwrap_or(0));
        let started = Instant::now()
            .checked_sub(waited)
            .unwrap_or_else(Instant::now);
        let deadline = Deadline::new(started, pool.settings());
        Ok(Call {
            _slot: slot,
            pool,
            deadline,
        })
    }

    /// Runs one call of the pool within the deadline; its error raised.
    pub fn run<'p, T, F, Fut>(&'p self, call: F) -> NifResult<T>
    where
        F: FnOnce(&'p LockPool, Deadline) -> Fut,
        Fut: Future<Output = locks_core::Result<T>>,
    {
        global::block_on(call(&self.pool, self.deadline))
            .map_err(raise)?
            .map_err(raise)
    }
}
