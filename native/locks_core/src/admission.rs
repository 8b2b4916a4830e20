//! Admission: how many lock calls may run at once.
//!
//! A lock call waits on a dirty-I/O scheduler for as long as its statement
//! takes. With a database that hangs, calls let in freely would hold every
//! one of those schedulers, and the rest of the VM that runs there (file
//! I/O, code loading) would wait with them. So a call first asks the
//! [`Gate`] for a *turn*, on a normal scheduler, and enters a dirty one only
//! with a turn in hand. At most `capacity` turns exist (the pool's size), so
//! a turn is also a free connection.
//!
//! * [`Gate::admit`]: a turn at once when one is free and nobody waits
//!   (`Go`), or a place in the queue (`Wait`): the caller waits on a normal
//!   scheduler until its checkout deadline.
//! * [`Gate::enter`] trades the token for a [`Permit`]. After its own call
//!   the holder may run the first waiters' calls in the same turn
//!   ([`Gate::serve`]; their answers are sent later, then
//!   [`Gate::answered`]), and [`Gate::release`] hands the turn to the first
//!   live waiter.
//! * [`Gate::leave`]: a waiter whose deadline passed leaves the queue, or
//!   gives back a turn handed too late, or learns that its call was run and
//!   its answer is on the way.
//!
//! First come, first served: while anybody waits, a newcomer queues. A turn
//! handed out but never used (its caller was killed) lapses at the caller's
//! checkout deadline; a used one is released by the dirty call itself, which
//! runs to its end even when its process is killed. Times are the caller's
//! monotonic clock in nanoseconds; `W` names a waiter and its call.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

/// The answer of [`Gate::admit`].
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// A turn: pass the token to [`Gate::enter`].
    Go(u64),
    /// Queued: wait up to `wait_ns` for a [`Wake`] with this ticket.
    Wait {
        /// What the wake message will carry, and what [`Gate::leave`] takes.
        ticket: u64,
        /// Nanoseconds left until the caller's checkout deadline.
        wait_ns: i64,
    },
    /// The checkout deadline has passed already.
    TimedOut,
}

/// What the gate needs of the callers that wait: whether one is alive, and
/// how to hand one a turn. The gate calls both with itself locked, so a
/// turn's message has reached its waiter before anybody (the waiter's own
/// [`Gate::leave`] included) can see the turn handed: a waiter that leaves
/// finds the message, if any, in its mailbox, and none comes later.
pub trait Waiters<W> {
    /// Whether `who` can still take a turn.
    fn alive(&self, who: &W) -> bool;
    /// Hands a turn to a waiter.
    fn wake(&self, wake: Wake<W>);
}

/// A turn handed to a waiter: send it `ticket` and `token`.
#[derive(Debug, PartialEq, Eq)]
pub struct Wake<W> {
    /// The waiter.
    pub who: W,
    /// The ticket it waits for.
    pub ticket: u64,
    /// Its turn, for [`Gate::enter`].
    pub token: u64,
}

/// A running call's turn; give it back with [`Gate::release`].
#[must_use = "a permit must be given back with Gate::release"]
#[derive(Debug)]
pub struct Permit {
    _turn: (),
}

/// What [`Gate::leave`] found of a waiter.
#[derive(Debug, PartialEq, Eq)]
pub enum Left {
    /// It was queued, or handed a turn too late: it is out, and its call
    /// was never run.
    Out,
    /// Its call is being run by another ([`Gate::serve`]), or was, and its
    /// answer is not sent yet: the answer is coming.
    Served,
}

/// What the gate holds right now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Turns in all: the most calls that run at once.
    pub capacity: usize,
    /// Calls running now.
    pub running: usize,
    /// Turns handed out and not yet used.
    pub granted: usize,
    /// Callers waiting for a turn.
    pub waiting: usize,
    /// Calls run in another call's turn, since the gate was made.
    pub served: u64,
}

/// The turns of one VM (see the module doc).
#[derive(Debug)]
pub struct Gate<W> {
    state: Mutex<State<W>>,
}

#[derive(Debug)]
struct State<W> {
    capacity: usize,
    running: usize,
    granted: Vec<Grant>,
    queue: VecDeque<Waiter<W>>,
    /// The tickets of the waiters whose calls run, or ran, in another's
    /// turn, until their answers are sent.
    serving: Vec<u64>,
    served: u64,
    last_id: u64,
}

#[derive(Debug)]
struct Grant {
    token: u64,
    /// The ticket of the waiter it was handed to; `None` for an immediate turn.
    ticket: Option<u64>,
    expires: i64,
}

#[derive(Debug)]
struct Waiter<W> {
    ticket: u64,
    who: W,
    expires: i64,
}

impl<W> Default for Gate<W> {
    fn default() -> Self {
        Self::new()
    }
}

impl<W> Gate<W> {
    /// A gate with no turns: every caller waits until [`Gate::set_capacity`].
    pub const fn new() -> Self {
        Gate {
            state: Mutex::new(State {
                capacity: 0,
                running: 0,
                granted: Vec::new(),
                queue: VecDeque::new(),
                serving: Vec::new(),
                served: 0,
                last_id: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<W>> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sets the number of turns (a new pool's size); waiters are woken if
    /// there are more now.
    pub fn set_capacity(&self, capacity: usize, now: i64, waiters: &impl Waiters<W>) {
        let mut state = self.lock();
        state.capacity = capacity;
        state.fill(now, waiters);
    }

    /// A turn for a caller whose checkout deadline is `expires`, or its
    /// place in the queue (after the turns this frees for earlier waiters).
    /// `who` is made only when the caller must wait; when it cannot be, the
    /// caller neither runs nor waits.
    pub fn admit<E>(
        &self,
        now: i64,
        expires: i64,
        who: impl FnOnce() -> Result<W, E>,
        waiters: &impl Waiters<W>,
    ) -> Result<Admission, E> {
        let mut state = self.lock();
        state.fill(now, waiters);
        if expires <= now {
            Ok(Admission::TimedOut)
        } else if state.queue.is_empty() && state.free() > 0 {
            let token = state.next_id();
            state.granted.push(Grant { token, ticket: None, expires });
            Ok(Admission::Go(token))
        } else {
            who().map(|who| {
                let ticket = state.next_id();
                state.queue.push_back(Waiter { ticket, who, expires });
                Admission::Wait { ticket, wait_ns: expires - now }
            })
        }
    }

    /// Trades a turn's token for a permit to run; `None` when the turn
    /// lapsed (its deadline passed) or was given back.
    pub fn enter(&self, token: u64, now: i64, waiters: &impl Waiters<W>) -> Option<Permit> {
        let mut state = self.lock();
        let permit = match state.granted.iter().position(|g| g.token == token) {
            Some(i) if state.granted[i].expires > now => {
                state.granted.swap_remove(i);
                state.running += 1;
                Some(Permit { _turn: () })
            }
            _ => None,
        };
        state.fill(now, waiters);
        permit
    }

    /// The first live waiter whose deadline has not passed, for the holder
    /// of `_permit` to run its call in this turn: its ticket and `W`. The
    /// waiter is told [`Left::Served`] until [`Gate::answered`]. `None` when
    /// nobody waits.
    pub fn serve(&self, _permit: &Permit, now: i64, waiters: &impl Waiters<W>) -> Option<(u64, W)> {
        let mut state = self.lock();
        while let Some(waiter) = state.queue.pop_front() {
            if waiter.expires > now && waiters.alive(&waiter.who) {
                state.serving.push(waiter.ticket);
                state.served += 1;
                return Some((waiter.ticket, waiter.who));
            }
        }
        None
    }

    /// The answers of these served calls have been sent to their callers.
    pub fn answered(&self, tickets: &[u64]) {
        self.lock().serving.retain(|t| !tickets.contains(t));
    }

    /// Gives a running call's turn back, and wakes a waiter with it.
    pub fn release(&self, permit: Permit, now: i64, waiters: &impl Waiters<W>) {
        drop(permit);
        let mut state = self.lock();
        state.running = state.running.saturating_sub(1);
        state.fill(now, waiters);
    }

    /// Takes the waiter of `ticket` out of the queue, or gives back the turn
    /// it was handed (and wakes the next waiter with it); or tells it its
    /// call is being run.
    pub fn leave(&self, ticket: u64, now: i64, waiters: &impl Waiters<W>) -> Left {
        let mut state = self.lock();
        let left = if state.serving.contains(&ticket) {
            Left::Served
        } else {
            match state.queue.iter().position(|w| w.ticket == ticket) {
                Some(i) => drop(state.queue.remove(i)),
                None => state.granted.retain(|g| g.ticket != Some(ticket)),
            }
            Left::Out
        };
        state.fill(now, waiters);
        left
    }

    /// What the gate holds right now.
    pub fn counts(&self) -> Counts {
        let state = self.lock();
        Counts {
            capacity: state.capacity,
            running: state.running,
            granted: state.granted.len(),
            waiting: state.queue.len(),
            served: state.served,
        }
    }
}

impl<W> State<W> {
    fn next_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    fn free(&self) -> usize {
        self.capacity.saturating_sub(self.running + self.granted.len())
    }

    /// Lets lapsed turns go, then hands free turns to the first live waiters
    /// whose deadline has not passed, waking each while the gate is locked.
    fn fill(&mut self, now: i64, waiters: &impl Waiters<W>) {
        self.granted.retain(|g| g.expires > now);
        while self.free() > 0 {
            let Some(waiter) = self.queue.pop_front() else {
                break;
            };
            if waiter.expires <= now || !waiters.alive(&waiter.who) {
                continue;
            }
            let token = self.next_id();
            self.granted.push(Grant {
                token,
                ticket: Some(waiter.ticket),
                expires: waiter.expires,
            });
            waiters.wake(Wake { who: waiter.who, ticket: waiter.ticket, token });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// Records, at each wake, whether the gate was locked. (The gate's other
    /// tests use its public API only: `tests/gate.rs`.)
    struct Probe<'g>(&'g Gate<()>, Cell<Option<bool>>);

    impl Waiters<()> for Probe<'_> {
        fn alive(&self, _: &()) -> bool {
            true
        }

        fn wake(&self, _: Wake<()>) {
            self.1.set(Some(self.0.state.try_lock().is_err()));
        }
    }

    #[test]
    fn a_turn_is_handed_while_the_gate_is_locked() {
        // So the waiter's own leave (which locks the gate) cannot come
        // between the hand-off and the turn's message.
        let gate = Gate::new();
        let probe = Probe(&gate, Cell::new(None));
        gate.set_capacity(1, 0, &probe);
        let token = match gate.admit(0, 10, || Ok::<_, ()>(()), &probe) {
            Ok(Admission::Go(token)) => token,
            other => panic!("not let in: {other:?}"),
        };
        let permit = gate.enter(token, 0, &probe).expect("a permit");
        let queued = gate.admit(0, 10, || Ok::<_, ()>(()), &probe);
        assert!(matches!(queued, Ok(Admission::Wait { .. })), "{queued:?}");
        gate.release(permit, 1, &probe);
        assert_eq!(probe.1.get(), Some(true));
    }
}
