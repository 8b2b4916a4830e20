//! The admission gate (`locks_core::admission`) through its public API:
//! capacity, first come first served, deadlines, and calls served in
//! another call's turn. Pure data: no database, no VM.

use std::cell::RefCell;

use locks_core::admission::{Admission, Counts, Gate, Left, Permit, Waiters, Wake};

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
    assert_eq!(gate.counts(), Counts { capacity: 1, running: 1, served: 2, ..Counts::default() });
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
