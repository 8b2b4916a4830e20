//! The queue (`locks_core::queue`) through its public API: the limit, first
//! come first served, calls taken from the line, leaving, a late go, no pool. Pure data: no database, no
//! VM. The callers are names; their watch is the name too, and "told"
//! records the names sent go, in order.

use std::cell::{Cell, RefCell};

use locks_core::queue::{Counts, Queue};

type Q = Queue<&'static str, &'static str>;

#[derive(Default)]
struct Told(RefCell<Vec<&'static str>>);

impl Told {
    fn go(&self) -> impl FnMut(&&'static str, &&'static str) + '_ {
        |who, _| self.0.borrow_mut().push(*who)
    }

    fn take(&self) -> Vec<&'static str> {
        self.0.take()
    }
}

fn queue(limit: usize) -> Q {
    let queue = Q::new();
    let told = Told::default();
    queue.resize(Some(limit), told.go());
    assert!(told.take().is_empty());
    queue
}

/// `who` takes a slot (a free one, or the one handed to it) and runs its call.
fn run(queue: &Q, who: &'static str) {
    assert_eq!(queue.take(who, who, || true, true), Some(who), "{who} should find a slot");
}

fn wait(queue: &Q, who: &'static str) {
    assert_eq!(queue.take(who, who, || true, true), None, "{who} should wait");
}

fn counts(running: usize, held: usize, waiting: usize) -> Counts {
    Counts { running, held, waiting }
}

#[test]
fn a_free_slot_is_taken_at_once_then_callers_wait_in_line_once_each() {
    let queue = queue(2);
    run(&queue, "a");
    run(&queue, "b");
    wait(&queue, "c");
    // A caller keeps its one place in line; its latest call is the one in it.
    assert_eq!(queue.take("c", "c-2", || true, true), None);
    assert_eq!(queue.counts(), counts(2, 0, 1));
    assert_eq!(queue.leave(&"c", |_, _| {}), Some("c-2"));
}

#[test]
fn a_caller_that_cannot_be_watched_takes_nothing() {
    let queue = queue(1);
    assert_eq!(queue.take("a", "a", || false, true), None);
    assert_eq!(queue.counts(), counts(0, 0, 0));
    run(&queue, "b");
    assert_eq!(queue.take("c", "c", || false, true), None);
    assert_eq!(queue.counts(), counts(1, 0, 0));
}

#[test]
fn a_freed_slot_goes_to_the_first_in_line_and_newcomers_queue_behind() {
    let queue = queue(1);
    let told = Told::default();
    run(&queue, "a");
    wait(&queue, "b");
    wait(&queue, "c");
    assert_eq!(queue.finish(|| false, told.go()), None);
    assert_eq!(told.take(), ["b"]);
    // The slot is b's until b takes it or leaves: d waits behind c.
    wait(&queue, "d");
    assert_eq!(queue.counts(), counts(0, 1, 2));
    // b's call again (after its go): its own slot, with the call it makes now.
    assert_eq!(queue.take("b", "b-2", || true, true), Some("b-2"));
    assert_eq!(queue.finish(|| false, told.go()), None);
    assert_eq!(told.take(), ["c"]);
}

#[test]
fn a_caller_that_leaves_the_line_is_never_handed_a_slot() {
    let queue = queue(1);
    let told = Told::default();
    run(&queue, "a");
    wait(&queue, "b");
    wait(&queue, "c");
    assert_eq!(queue.leave(&"b", told.go()), Some("b"));
    assert_eq!(queue.finish(|| false, told.go()), None);
    assert_eq!(told.take(), ["c"]);
    assert_eq!(queue.leave(&"b", told.go()), None);
}

#[test]
fn a_slot_given_back_before_it_is_taken_goes_to_the_next_in_line_at_once() {
    // A caller that died holding it, or was handed it as its deadline passed.
    let queue = queue(1);
    let told = Told::default();
    run(&queue, "x");
    wait(&queue, "a");
    wait(&queue, "b");
    assert_eq!(queue.finish(|| false, told.go()), None);
    assert_eq!(told.take(), ["a"]);
    assert_eq!(queue.leave(&"a", told.go()), Some("a"));
    assert_eq!(told.take(), ["b"]);
    assert_eq!(queue.counts(), counts(0, 1, 0));
    // a holds nothing now: a new call of a's waits behind b's slot.
    wait(&queue, "a");
}

#[test]
fn with_no_pool_the_line_is_handed_its_slots_and_nothing_more() {
    let queue = queue(1);
    let told = Told::default();
    run(&queue, "a");
    wait(&queue, "b");
    wait(&queue, "c");
    queue.resize(None, told.go());
    assert_eq!(told.take(), ["b", "c"]);
    assert_eq!(queue.counts(), counts(1, 2, 0));
    assert_eq!(queue.finish(|| false, told.go()), None);
    // b and c come with their go: there are no slots, so they wait again.
    wait(&queue, "b");
    wait(&queue, "c");
    wait(&queue, "d");
    assert_eq!(queue.counts(), counts(0, 0, 3));
    assert!(told.take().is_empty());
    // A new pool's size hands the line its slots again.
    queue.resize(Some(1), told.go());
    assert_eq!(told.take(), ["b"]);
}

#[test]
fn slots_a_stop_handed_are_taken_only_while_fewer_run_than_the_next_pool_has() {
    let queue = queue(2);
    let told = Told::default();
    run(&queue, "a");
    run(&queue, "b");
    for who in ["c", "d", "e"] {
        wait(&queue, who);
    }
    // A stop hands all three a slot; a pool of two comes before their go is read.
    queue.resize(None, told.go());
    queue.resize(Some(2), told.go());
    assert_eq!(told.take(), ["c", "d", "e"]);
    // a ends: c takes its slot (one runs, of two); d and e find two running and wait.
    assert_eq!(queue.finish(|| false, told.go()), None);
    run(&queue, "c");
    wait(&queue, "d");
    wait(&queue, "e");
    assert_eq!(queue.counts(), counts(2, 0, 2));
    assert_eq!(queue.finish(|| false, told.go()), None);
    assert_eq!(told.take(), ["d"]);
}

#[test]
fn a_smaller_pool_hands_no_slot_and_takes_no_call_until_fewer_are_used_than_it_has() {
    let queue = queue(2);
    let told = Told::default();
    run(&queue, "a");
    run(&queue, "b");
    // The pool is replaced by one of a single slot while a and b run.
    queue.resize(Some(1), told.go());
    wait(&queue, "c");
    wait(&queue, "d");
    // a ends: two slots used of one, so it takes nothing and hands nothing.
    assert_eq!(queue.finish(|| true, told.go()), None);
    assert!(told.take().is_empty());
    // b ends: one of one; it may take c onto its slot, and then hand it to d.
    assert_eq!(queue.finish(|| true, told.go()), Some(("c", "c")));
    assert_eq!(queue.counts(), counts(1, 0, 1));
    assert_eq!(queue.finish(|| false, told.go()), None);
    assert_eq!(told.take(), ["d"]);
}

#[test]
fn a_call_that_ends_takes_the_first_call_in_line_onto_its_slot() {
    let queue = queue(1);
    let told = Told::default();
    run(&queue, "a");
    wait(&queue, "b");
    wait(&queue, "c");
    // a's call ended: b's call is taken, first come first served, and runs
    // on a's slot (still one running); nobody is handed a slot. Whether to
    // take (a's caller is alive) is asked once, as a call waits.
    let asked = Cell::new(0);
    let take = || {
        asked.set(asked.get() + 1);
        true
    };
    assert_eq!(queue.finish(take, told.go()), Some(("b", "b")));
    assert_eq!(asked.get(), 1);
    assert!(told.take().is_empty());
    assert_eq!(queue.counts(), counts(1, 0, 1));
    // b, at its deadline, is in neither the line nor a slot: its answer comes.
    assert_eq!(queue.leave(&"b", told.go()), None);
    // Without taking, the slot goes to c; with the line empty, taking frees it.
    assert_eq!(queue.finish(|| false, told.go()), None);
    assert_eq!(told.take(), ["c"]);
    // With nobody in line, it is not asked (the NIF's check costs a call into the VM).
    run(&queue, "c");
    assert_eq!(queue.finish(take, told.go()), None);
    assert_eq!(asked.get(), 1);
    assert_eq!(queue.counts(), counts(0, 0, 0));
}

#[test]
fn a_late_go_is_sent_only_for_the_slot_it_is_about_until_it_is_taken() {
    let queue = queue(1);
    let told = Told::default();
    let sent = RefCell::new(Vec::new());
    let late = |watch: &'static str| {
        queue.if_held(&"a", |w| *w == watch, || sent.borrow_mut().push(watch));
    };
    run(&queue, "b");
    // a waits; b's call ends and hands the slot to a (first handing)…
    assert_eq!(queue.take("a", "a-1", || true, true), None);
    assert_eq!(queue.finish(|| false, told.go()), None);
    // …a leaves at its deadline unaware, waits again behind c, and is
    // handed the slot again (second handing).
    assert_eq!(queue.leave(&"a", told.go()), Some("a-1"));
    run(&queue, "c");
    assert_eq!(queue.take("a", "a-2", || true, true), None);
    assert_eq!(queue.finish(|| false, told.go()), None);
    assert_eq!(told.take(), ["a", "a"]);
    // The first handing's late go finds the second, and is not sent.
    late("a-1");
    late("a-2");
    // a takes the slot: a go sent late for it now is not sent either.
    assert_eq!(queue.take("a", "a-3", || true, true), Some("a-3"));
    late("a-2");
    assert_eq!(*sent.borrow(), ["a-2"]);
}

#[test]
fn a_caller_is_watched_from_its_first_call_until_it_is_gone() {
    let queue = queue(1);
    let told = Told::default();
    run(&queue, "a");
    assert_eq!(queue.finish(|| false, told.go()), None);
    // a's next call: a is watched already.
    assert_eq!(queue.take("a", "a", || panic!("a is watched already"), true), Some("a"));
    // b dies in line: it leaves, and is watched anew when it comes back.
    wait(&queue, "b");
    queue.gone(&"b", told.go());
    assert_eq!(queue.counts(), counts(1, 0, 0));
    let watched = Cell::new(false);
    let watch = || {
        watched.set(true);
        true
    };
    let taken = queue.take("b", "b", watch, true);
    assert_eq!(taken, None);
    assert!(watched.get());
}

#[test]
fn a_take_that_does_not_run_leaves_the_slot_for_the_take_that_runs() {
    let queue = queue(1);
    let told = Told::default();
    // A free slot, in sight but not taken: b takes it first, and a waits.
    assert_eq!(queue.take("a", "a", || true, false), Some("a"));
    assert_eq!(queue.counts(), counts(0, 0, 0));
    run(&queue, "b");
    wait(&queue, "a");
    // The slot handed to a stays held until a's take that runs.
    assert_eq!(queue.finish(|| false, told.go()), None);
    assert_eq!(told.take(), ["a"]);
    assert_eq!(queue.take("a", "a", || true, false), Some("a"));
    assert_eq!(queue.counts(), counts(0, 1, 0));
    run(&queue, "a");
    assert_eq!(queue.counts(), counts(1, 0, 0));
}
