//! The queue (`locks_core::queue`) through its public API: the limit, first
//! come first served, calls taken from the line, leaving, a stop. Pure data:
//! no database, no VM. The callers are names; their `W` is the name too,
//! and "told" records the names handed a slot, in order.

use std::cell::RefCell;

use locks_core::queue::{Counts, Queue, Start};

type Q = Queue<&'static str, &'static str>;

#[derive(Default)]
struct Told(RefCell<Vec<&'static str>>);

impl Told {
    fn hand(&self) -> impl FnMut(&&'static str, &&'static str) + '_ {
        |who, _| self.0.borrow_mut().push(*who)
    }

    fn take(&self) -> Vec<&'static str> {
        self.0.take()
    }
}

fn queue(limit: usize) -> Q {
    let queue = Q::new();
    let told = Told::default();
    queue.resize(limit, told.hand());
    assert!(told.take().is_empty());
    queue
}

/// `who` starts its call, or waits watched by its own name.
fn start(queue: &Q, who: &'static str) -> Start<&'static str> {
    queue.start(who, || Some(who))
}

/// `who` runs with a slot taken free (no watch: it never waited).
fn free(queue: &Q, who: &'static str) {
    assert_eq!(start(queue, who), Start::Run(None), "{who} should find a free slot");
}

fn wait(queue: &Q, who: &'static str) {
    assert_eq!(start(queue, who), Start::Wait, "{who} should wait");
}

fn counts(limit: usize, running: usize, handed: usize, waiting: usize) -> Counts {
    Counts { limit, running, handed, waiting }
}

#[test]
fn a_free_slot_starts_at_once_then_callers_wait_in_line_once_each() {
    let queue = queue(2);
    free(&queue, "a");
    free(&queue, "b");
    wait(&queue, "c");
    // A caller already in line keeps its one place.
    wait(&queue, "c");
    assert_eq!(queue.counts(), counts(2, 2, 0, 1));
}

#[test]
fn a_caller_that_cannot_be_watched_is_not_put_in_line() {
    let queue = queue(1);
    free(&queue, "a");
    assert_eq!(queue.start("b", || None), Start::Wait);
    assert_eq!(queue.counts(), counts(1, 1, 0, 0));
}

#[test]
fn a_freed_slot_goes_to_the_first_in_line_and_newcomers_queue_behind() {
    let queue = queue(1);
    let told = Told::default();
    free(&queue, "a");
    wait(&queue, "b");
    wait(&queue, "c");
    queue.finish(false, told.hand());
    assert_eq!(told.take(), ["b"]);
    // The slot is b's until b starts it or leaves: d waits behind c.
    wait(&queue, "d");
    assert_eq!(queue.counts(), counts(1, 0, 1, 2));
    assert_eq!(start(&queue, "b"), Start::Run(Some("b")));
    queue.finish(false, told.hand());
    assert_eq!(told.take(), ["c"]);
}

#[test]
fn a_caller_that_leaves_the_line_is_never_handed_a_slot() {
    let queue = queue(1);
    let told = Told::default();
    free(&queue, "a");
    wait(&queue, "b");
    wait(&queue, "c");
    assert_eq!(queue.leave(&"b", told.hand()), Some("b"));
    queue.finish(false, told.hand());
    assert_eq!(told.take(), ["c"]);
    assert_eq!(queue.leave(&"b", told.hand()), None);
}

#[test]
fn a_slot_given_back_unstarted_goes_to_the_next_in_line_at_once() {
    // A caller that died holding it, or was handed it as its deadline passed.
    let queue = queue(1);
    let told = Told::default();
    free(&queue, "x");
    wait(&queue, "a");
    wait(&queue, "b");
    queue.finish(false, told.hand());
    assert_eq!(told.take(), ["a"]);
    assert_eq!(queue.leave(&"a", told.hand()), Some("a"));
    assert_eq!(told.take(), ["b"]);
    assert_eq!(queue.counts(), counts(1, 0, 1, 0));
    // a holds nothing now: a new call of a's waits behind b's slot.
    wait(&queue, "a");
}

#[test]
fn closing_empties_the_line_and_hands_nothing_more() {
    let queue = queue(1);
    let told = Told::default();
    free(&queue, "a");
    wait(&queue, "b");
    wait(&queue, "c");
    let mut out = Vec::new();
    queue.close(|(who, _)| out.push(who));
    assert_eq!(out, ["b", "c"]);
    queue.finish(false, told.hand());
    assert!(told.take().is_empty());
    wait(&queue, "d");
    // A new pool's size hands the line its slots again.
    queue.resize(1, told.hand());
    assert_eq!(told.take(), ["d"]);
}

#[test]
fn a_message_about_a_slot_is_sent_only_while_it_is_unstarted() {
    let queue = queue(1);
    let told = Told::default();
    let sent = RefCell::new(0);
    free(&queue, "x");
    wait(&queue, "a");
    queue.finish(false, told.hand());
    queue.if_handed(&"a", |w| *w == "a", || *sent.borrow_mut() += 1);
    assert_eq!(start(&queue, "a"), Start::Run(Some("a")));
    queue.if_handed(&"a", |w| *w == "a", || *sent.borrow_mut() += 1);
    assert_eq!(*sent.borrow(), 1);
}

#[test]
fn a_late_message_about_a_slot_is_not_sent_for_a_later_one_of_the_same_caller() {
    let queue = queue(1);
    let told = Told::default();
    let sent = RefCell::new(0);
    free(&queue, "b");
    // a waits; b's call ends and hands the slot to a (first handing)…
    assert_eq!(queue.start("a", || Some("a-1")), Start::Wait);
    queue.finish(false, told.hand());
    assert_eq!(told.take(), ["a"]);
    // …a leaves at its deadline unaware, waits again behind c, and is
    // handed the slot again (second handing).
    assert_eq!(queue.leave(&"a", told.hand()), Some("a-1"));
    assert_eq!(told.take(), Vec::<&str>::new());
    free(&queue, "c");
    assert_eq!(queue.start("a", || Some("a-2")), Start::Wait);
    queue.finish(false, told.hand());
    assert_eq!(told.take(), ["a"]);
    // The first handing's late message finds the second, and is not sent.
    queue.if_handed(&"a", |w| *w == "a-1", || *sent.borrow_mut() += 1);
    assert_eq!(*sent.borrow(), 0);
    queue.if_handed(&"a", |w| *w == "a-2", || *sent.borrow_mut() += 1);
    assert_eq!(*sent.borrow(), 1);
}

#[test]
fn a_caller_that_expects_to_wait_is_handed_a_free_slot_or_waits_in_line() {
    let queue = queue(2);
    // A free slot, nobody waiting: handed, watched, and started next.
    assert!(queue.enter("a", || Some("a")));
    assert_eq!(queue.counts(), counts(2, 0, 1, 0));
    assert!(queue.enter("a", || Some("a")), "a keeps the slot it was handed");
    assert_eq!(start(&queue, "a"), Start::Run(Some("a")));
    free(&queue, "b");
    // No free slot: in line, once.
    assert!(!queue.enter("c", || Some("c")));
    assert!(!queue.enter("c", || Some("c")));
    // A caller that cannot be watched is neither handed a slot nor in line.
    assert!(!queue.enter("d", || None));
    assert_eq!(queue.counts(), counts(2, 2, 0, 1));
    let told = Told::default();
    queue.finish(false, told.hand());
    assert_eq!(told.take(), ["c"]);
}

#[test]
fn a_caller_entering_while_a_handed_slot_is_unstarted_waits_behind_it() {
    let queue = queue(1);
    free(&queue, "a");
    wait(&queue, "b");
    // A free slot goes to the first in line, never to a newcomer.
    let told = Told::default();
    queue.finish(false, told.hand());
    assert_eq!(told.take(), ["b"]);
    assert!(!queue.enter("c", || Some("c")));
    assert_eq!(queue.counts(), counts(1, 0, 1, 1));
}

#[test]
fn a_call_that_ends_takes_no_call_while_more_slots_are_used_than_a_new_pool_has() {
    let queue = queue(2);
    let told = Told::default();
    free(&queue, "a");
    free(&queue, "b");
    // The pool is replaced by one of a single slot while a and b run.
    queue.close(|_| {});
    queue.resize(1, told.hand());
    wait(&queue, "c");
    wait(&queue, "d");
    // a ends: two slots used of one, so it takes nothing and hands nothing.
    assert_eq!(queue.finish(true, told.hand()), None);
    assert!(told.take().is_empty());
    assert_eq!(queue.counts(), counts(1, 1, 0, 2));
    // b ends: one of one; it may take c onto its slot.
    assert_eq!(queue.finish(true, told.hand()), Some(("c", "c")));
    assert_eq!(queue.counts(), counts(1, 1, 0, 1));
}

#[test]
fn a_call_that_ends_takes_the_first_call_in_line_onto_its_slot() {
    let queue = queue(1);
    let told = Told::default();
    free(&queue, "a");
    wait(&queue, "b");
    wait(&queue, "c");
    // a's call ended: b's call is taken, first come first served, and runs
    // on a's slot (still one running); nobody is handed a slot.
    assert_eq!(queue.finish(true, told.hand()), Some(("b", "b")));
    assert!(told.take().is_empty());
    assert_eq!(queue.counts(), counts(1, 1, 0, 1));
    // b, at its deadline, is in neither the line nor a slot: its answer comes.
    assert_eq!(queue.leave(&"b", told.hand()), None);
    // Without taking, the slot goes to c; with the line empty, taking frees it.
    assert_eq!(queue.finish(false, told.hand()), None);
    assert_eq!(told.take(), ["c"]);
    assert_eq!(start(&queue, "c"), Start::Run(Some("c")));
    assert_eq!(queue.finish(true, told.hand()), None);
    assert_eq!(queue.counts(), counts(1, 0, 0, 0));
}
