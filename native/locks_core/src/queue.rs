//! The queue: the whole protocol by which a lock call runs.
//!
//! A **call** blocks a dirty-I/O scheduler while its statement runs; let in
//! freely, calls to a hung database would hold them all, and the VM's file
//! I/O with them. So a call runs only with one of `limit` **slots**, one per
//! pooled connection. A **caller** (a process) without one waits in the
//! **line**, off the dirty schedulers, until it is sent its **reply** or its
//! **deadline** (its stamp plus the checkout timeout) passes. A caller is
//! **watched** (the NIF's monitor) from its first call until it dies.
//!
//! 1. [`Queue::take`], on a dirty-I/O scheduler: a slot while one is free and
//!    nobody waits, or the one handed to the caller, and the call runs; else a
//!    place at the end of the line, having done no I/O. While the last call
//!    had to wait, `take` first looks on the caller's own scheduler, and a
//!    caller with no slot in sight waits with no dirty-I/O scheduler used.
//! 2. [`Queue::finish`], when a call ends: if it succeeded and its caller
//!    lives, it takes the first call in line and runs it on its own slot by
//!    the earlier deadline of the two, the reply the answer ([`RUN_NEXT`] at
//!    most, until one fails); then the slot goes to the first in line, whose
//!    reply is **go**: it calls again, and `take` finds the slot its own.
//! 3. At its deadline, a caller still waiting leaves ([`Queue::leave`]) the
//!    line or gives back the slot handed to it (its go is in its mailbox or
//!    never comes); else its call was taken, and its answer comes by then.
//!
//! A caller that dies leaves at once; a started call runs to its end even
//! when its caller is killed. Slots are handed, and calls taken, with the
//! queue locked. With no pool, the line is handed slots (their calls find
//! none, or wait for the next pool's), and there are none. No clock is kept.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// How many calls from the line one call that ends runs: each makes its own
/// caller's answer wait one more statement, and saves a dirty-I/O call.
pub const RUN_NEXT: usize = 8;

/// What the queue holds: calls running, slots handed and not yet taken, callers in line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Counts {
    pub running: usize,
    pub held: usize,
    pub waiting: usize,
}

/// The slots and the line of one VM, for callers `K` making calls `W`.
pub struct Queue<K, W>(Mutex<State<K, W>>);

struct State<K, W> {
    limit: usize,
    running: usize,
    held: Vec<(K, W)>,
    line: VecDeque<(K, W)>,
    watched: BTreeSet<K>,
}

#[allow(clippy::new_without_default)] // `new` is const, for a static
impl<K: Ord + Copy, W> Queue<K, W> {
    /// A queue with no slots, until [`Queue::resize`].
    pub const fn new() -> Self {
        let state = State {
            limit: 0,
            running: 0,
            held: Vec::new(),
            line: VecDeque::new(),
            watched: BTreeSet::new(),
        };
        Queue(Mutex::new(state))
    }

    fn lock(&self) -> MutexGuard<'_, State<K, W>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets the number of slots to a new pool's size and hands the free ones;
    /// or, with no pool, hands every caller in line one and keeps none.
    pub fn resize(&self, limit: Option<usize>, go: impl FnMut(&K, &W)) {
        let mut state = self.lock();
        state.limit = limit.unwrap_or(usize::MAX);
        state.fill(go);
        state.limit = limit.unwrap_or(0);
    }

    /// `Some(call)`: `key` runs `call` now, with a slot: one free while
    /// nobody waits, or the one handed to it while fewer run than there are
    /// slots (a stop hands the line more than a new pool may have); unless
    /// `run` is false, which leaves that slot for the `take` to come. `None`:
    /// it waits in line with `call` (where it was, if it was). Not yet
    /// watched, it is first: if `watch` fails (it is dead), it is in neither.
    pub fn take(&self, key: K, call: W, watch: impl FnOnce() -> bool, run: bool) -> Option<W> {
        let mut state = self.lock();
        let held = state.held.iter().position(|(k, _)| *k == key);
        if let Some(i) = held.filter(|_| state.running < state.limit) {
            if run {
                state.held.swap_remove(i);
                state.running += 1;
            }
            return Some(call);
        }
        held.map(|i| state.held.swap_remove(i)); // it waits again
        if let Some((_, waiting)) = state.line.iter_mut().find(|(k, _)| *k == key) {
            *waiting = call;
            return None;
        }
        if !state.watched.contains(&key) && !watch() {
            return None;
        }
        state.watched.insert(key);
        if state.line.is_empty() && state.used() < state.limit {
            state.running += usize::from(run);
            return Some(call);
        }
        state.line.push_back((key, call));
        None
    }

    /// A started call has ended. The first call in line is taken to run on its
    /// slot if `take` says so, asked (with the queue locked) only when a call
    /// waits and the slot stays (no smaller pool came meanwhile); else the slot goes on.
    pub fn finish(&self, take: impl FnOnce() -> bool, go: impl FnMut(&K, &W)) -> Option<(K, W)> {
        let mut state = self.lock();
        if !state.line.is_empty() && state.used() <= state.limit && take() {
            return state.line.pop_front();
        }
        state.running = state.running.saturating_sub(1);
        state.fill(go);
        None
    }

    /// Takes `key` out of the line, or takes back the slot it holds and
    /// hands it on; its call, or `None` when it was in neither (its call
    /// was taken, or started).
    pub fn leave(&self, key: &K, go: impl FnMut(&K, &W)) -> Option<W> {
        let mut state = self.lock();
        let left = match state.line.iter().position(|(k, _)| k == key) {
            Some(i) => state.line.remove(i),
            None => {
                state.held.iter().position(|(k, _)| k == key).map(|i| state.held.swap_remove(i))
            }
        };
        state.fill(go);
        left.map(|(_, call)| call)
    }

    /// `key` died: it leaves, watched no more.
    pub fn gone(&self, key: &K, go: impl FnMut(&K, &W)) {
        self.lock().watched.remove(key);
        self.leave(key, go);
    }

    /// Runs `f` with the queue locked if `key` still holds, not yet taken, the
    /// slot handed for a call that `was` knows: a go sent late is for that slot only.
    pub fn if_held(&self, key: &K, was: impl Fn(&W) -> bool, f: impl FnOnce()) {
        let state = self.lock();
        if state.held.iter().any(|(k, w)| k == key && was(w)) {
            f();
        }
    }

    /// What the queue holds right now.
    pub fn counts(&self) -> Counts {
        let state = self.lock();
        Counts { running: state.running, held: state.held.len(), waiting: state.line.len() }
    }
}

impl<K, W> State<K, W> {
    fn used(&self) -> usize {
        self.running + self.held.len()
    }

    /// Hands free slots to the first in line, sending each go.
    fn fill(&mut self, mut go: impl FnMut(&K, &W)) {
        while self.used() < self.limit {
            let Some((key, call)) = self.line.pop_front() else { break };
            go(&key, &call);
            self.held.push((key, call));
        }
    }
}
