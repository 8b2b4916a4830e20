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
    use std::cell::RefCell;

    use super::*;

    const SECOND: i64 = 1_000_000_000;

    /// The callers of a test: all alive but `dead`; the turns handed to
    /// them, in order, until taken with `woken`.
    #[derive(Default)]
    struct Callers {
        dead: Option<&'static str>,
        woken: RefCell<Vec<Wake<&'static str>>>,
    }

    impl Waiters<&'static str> for Callers {
        fn alive(&self, who: &&'static str) -> bool {
            self.dead != Some(*who)
        }

        fn wake(&self, wake: Wake<&'static str>) {
            self.woken.borrow_mut().push(wake);
        }
    }

    impl Callers {
        fn but(dead: &'static str) -> Self {
            Callers { dead: Some(dead), ..Callers::default() }
        }

        fn woken(&self) -> Vec<Wake<&'static str>> {
            self.woken.take()
        }

        fn tickets(&self) -> Vec<u64> {
            self.woken().iter().map(|w| w.ticket).collect()
        }
    }

    fn gate(capacity: usize) -> Gate<&'static str> {
        let gate = Gate::default();
        let callers = Callers::default();
        gate.set_capacity(capacity, 0, &callers);
        assert!(callers.woken().is_empty());
        gate
    }

    fn admit(gate: &Gate<&'static str>, now: i64, expires: i64, who: &'static str) -> Admission {
        let admission = gate.admit(now, expires, || Ok::<_, ()>(who), &Callers::default());
        admission.expect("a waiter is always made")
    }

    fn go(gate: &Gate<&'static str>, now: i64, who: &'static str) -> u64 {
        let callers = Callers::default();
        match gate.admit(now, now + SECOND, || Err(()), &callers) {
            Ok(Admission::Go(token)) if callers.woken().is_empty() => token,
            other => panic!("{who} was not let in: {other:?}"),
        }
    }

    fn wait(gate: &Gate<&'static str>, now: i64, who: &'static str) -> u64 {
        match admit(gate, now, now + SECOND, who) {
            Admission::Wait { ticket, wait_ns } if wait_ns == SECOND => ticket,
            other => panic!("{who} did not queue: {other:?}"),
        }
    }

    fn run(gate: &Gate<&'static str>, token: u64, now: i64) -> Permit {
        match gate.enter(token, now, &Callers::default()) {
            Some(permit) => permit,
            None => panic!("token {token} did not run"),
        }
    }

    #[test]
    fn at_most_capacity_calls_run_and_the_rest_queue_in_order() {
        let gate = gate(2);
        let a = run(&gate, go(&gate, 0, "a"), 0);
        let _b = run(&gate, go(&gate, 0, "b"), 0);
        let c = wait(&gate, 0, "c");
        let d = wait(&gate, 0, "d");
        assert_eq!(
            gate.counts(),
            Counts { capacity: 2, running: 2, granted: 0, waiting: 2, served: 0 }
        );

        let callers = Callers::default();
        gate.release(a, 1, &callers);
        let wakes = callers.woken();
        assert_eq!(wakes.len(), 1);
        assert_eq!((wakes[0].who, wakes[0].ticket), ("c", c));
        let _c = run(&gate, wakes[0].token, 1);
        assert_eq!(gate.counts().waiting, 1, "d ({d}) still waits");
    }

    #[test]
    fn a_newcomer_queues_behind_waiters_even_when_a_turn_is_free() {
        let gate = gate(1);
        let a = run(&gate, go(&gate, 0, "a"), 0);
        let b = wait(&gate, 0, "b");
        let callers = Callers::default();
        gate.release(a, 1, &callers);
        assert_eq!(callers.tickets(), [b]);
        // b has been handed the turn but not used it yet: c must wait.
        wait(&gate, 1, "c");
    }

    #[test]
    fn a_waiter_that_left_or_died_is_skipped() {
        let gate = gate(1);
        let a = run(&gate, go(&gate, 0, "a"), 0);
        let b = wait(&gate, 0, "b");
        wait(&gate, 0, "dead");
        wait(&gate, 0, "d");
        let callers = Callers::but("dead");
        assert_eq!(gate.leave(b, 1, &callers), Left::Out);
        assert!(callers.woken().is_empty());
        gate.release(a, 2, &callers);
        assert_eq!(callers.woken().iter().map(|w| w.who).collect::<Vec<_>>(), ["d"]);
    }

    #[test]
    fn a_turn_handed_too_late_is_given_back_by_leave() {
        let gate = gate(1);
        let a = run(&gate, go(&gate, 0, "a"), 0);
        let b = wait(&gate, 0, "b");
        let c = wait(&gate, 0, "c");
        let callers = Callers::default();
        gate.release(a, 1, &callers);
        assert_eq!(callers.tickets(), [b]);
        // b timed out just as its turn came: leaving hands it on to c.
        assert_eq!(gate.leave(b, 2, &callers), Left::Out);
        assert_eq!(callers.tickets(), [c]);
    }

    #[test]
    fn an_unused_turn_lapses_at_its_deadline() {
        let gate = gate(1);
        let token = go(&gate, 0, "killed before it ran");
        wait(&gate, 0, "b");
        let callers = Callers::default();
        assert!(gate.enter(token, SECOND, &callers).is_none());
        // The lapsed turn went to nobody (b's own deadline passed with it),
        // and the next caller gets it.
        assert!(callers.woken().is_empty());
        assert_eq!(gate.counts().waiting, 0);
        go(&gate, SECOND, "c");
    }

    #[test]
    fn a_caller_past_its_deadline_is_told_so_and_a_spent_token_cannot_run_twice() {
        let gate = gate(1);
        assert_eq!(admit(&gate, 5, 5, "late"), Admission::TimedOut);
        let token = go(&gate, 0, "a");
        let permit = run(&gate, token, 0);
        let callers = Callers::default();
        assert!(gate.enter(token, 0, &callers).is_none());
        gate.release(permit, 0, &callers);
        assert!(callers.woken().is_empty());
        assert_eq!(gate.counts(), Counts { capacity: 1, ..Counts::default() });
    }

    #[test]
    fn a_caller_that_cannot_be_queued_neither_runs_nor_waits() {
        let gate = gate(1);
        let _a = run(&gate, go(&gate, 0, "a"), 0);
        let admission = gate.admit(0, SECOND, || Err("bad argument"), &Callers::default());
        assert_eq!(admission, Err("bad argument"));
        assert_eq!(gate.counts().waiting, 0);
    }

    #[test]
    fn a_running_call_runs_the_waiters_calls_in_its_turn_first_come_first_served() {
        let gate = gate(1);
        let a = run(&gate, go(&gate, 0, "a"), 0);
        let b = wait(&gate, 0, "b");
        wait(&gate, 0, "dead");
        assert!(matches!(admit(&gate, 0, 10, "late"), Admission::Wait { .. }));
        let d = wait(&gate, 0, "d");
        // "late" gave itself 10 ns: at 20 ns it is skipped.
        let now = 20;
        let callers = Callers::but("dead");
        assert_eq!(gate.serve(&a, now, &callers), Some((b, "b")));
        // While b's call runs, and until its answer is sent, b is told so.
        assert_eq!(gate.leave(b, now, &callers), Left::Served);
        assert_eq!(gate.serve(&a, now, &callers), Some((d, "d")));
        assert_eq!(gate.leave(b, now, &callers), Left::Served);
        gate.answered(&[b]);
        assert_eq!(gate.leave(b, now, &callers), Left::Out);
        assert_eq!(gate.leave(d, now, &callers), Left::Served);
        assert_eq!(gate.serve(&a, now, &callers), None);
        assert_eq!(
            gate.counts(),
            Counts { capacity: 1, running: 1, served: 2, ..Counts::default() }
        );
        gate.release(a, now, &callers);
        assert!(callers.woken().is_empty());
        assert_eq!(gate.counts().running, 0);
        gate.answered(&[d]);
        assert_eq!(gate.leave(d, now, &callers), Left::Out);
    }

    #[test]
    fn a_served_call_stays_served_after_the_release_until_its_answer_is_sent() {
        let gate = gate(1);
        let a = run(&gate, go(&gate, 0, "a"), 0);
        let b = wait(&gate, 0, "b");
        let c = wait(&gate, 0, "c");
        let callers = Callers::default();
        assert_eq!(gate.serve(&a, 1, &callers), Some((b, "b")));
        gate.release(a, 1, &callers);
        assert_eq!(callers.tickets(), [c]);
        assert_eq!(gate.leave(b, 1, &callers), Left::Served);
        gate.answered(&[b]);
        assert_eq!(gate.leave(b, 1, &callers), Left::Out);
    }

    #[test]
    fn a_turn_is_handed_while_the_gate_is_locked() {
        // So the waiter's own leave (which locks the gate) cannot come
        // between the hand-off and the turn's message.
        struct Probe<'g> {
            gate: &'g Gate<&'static str>,
            locked: RefCell<Vec<bool>>,
        }
        impl Waiters<&'static str> for Probe<'_> {
            fn alive(&self, _: &&'static str) -> bool {
                true
            }
            fn wake(&self, _: Wake<&'static str>) {
                let locked = self.gate.state.try_lock().is_err();
                self.locked.borrow_mut().push(locked);
            }
        }
        let gate = gate(1);
        let a = run(&gate, go(&gate, 0, "a"), 0);
        wait(&gate, 0, "b");
        let probe = Probe { gate: &gate, locked: RefCell::new(Vec::new()) };
        gate.release(a, 1, &probe);
        assert_eq!(probe.locked.take(), [true]);
    }
}
