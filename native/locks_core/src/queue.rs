//! The queue: the whole protocol by which a lock call runs.
//!
//! A **call** blocks a dirty-I/O scheduler while its statement runs. With a
//! database that hangs, calls let in freely would hold every such scheduler,
//! and the VM's file I/O with them. So a call runs only with a **slot**, and
//! there are `limit` slots, one per pooled connection. A **caller** (a
//! process) without one waits in the **line** with its call, on a normal
//! scheduler, until it is sent its **reply** or its **deadline** (its stamp
//! plus the checkout timeout) passes. Each caller in line, or holding a slot
//! it has not started, is **watched** (the NIF's monitor of the process).
//!
//! 1. [`Queue::take`], on a normal scheduler: a slot while one is free and
//!    nobody waits (the caller runs its call at once, on a dirty-I/O
//!    scheduler), else a place at the end of the line, with its call.
//! 2. [`Queue::start`] as a call begins. When it ends, [`Queue::finish`]:
//!    the call that ended takes the first call in line and runs it on its
//!    own slot and thread, its reply the answer ([`RUN_NEXT`] calls at
//!    most); then the slot goes to the first in line, whose reply is **go**:
//!    it runs its own call. So most waiters are woken once, by their answer.
//! 3. At its deadline, a caller still waiting leaves ([`Queue::leave`]): out
//!    of the line, or giving back the slot handed to it (its go is then in
//!    its mailbox, or never comes). A caller in neither had its call taken:
//!    its answer comes, by that call's deadline.
//!
//! A caller that dies while watched is taken out by [`Queue::leave`] at
//! once: no slot outlives its caller, nobody waits behind a dead one. A
//! started call runs to its end even when its caller is killed, so a
//! started slot needs no watching. Slots are handed, and calls taken, with
//! the queue locked. Closing the pool hands every caller in line a slot
//! (its call then finds no pool and fails at once). The queue keeps no
//! clock: each caller leaves by itself at its deadline.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// How many calls from the line one call that ends runs before it hands its
/// slot on: each makes its own caller's answer wait one more statement (8
/// bounds that to about a full line's wait at the default pool of 8), and
/// saves the caller it runs a dirty-I/O call (`bench/README.md` measures it).
pub const RUN_NEXT: usize = 8;

/// What the queue holds right now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Slots in all: the most calls that run at once.
    pub limit: usize,
    /// Calls running now.
    pub running: usize,
    /// Slots taken or handed, and not yet started.
    pub held: usize,
    /// Callers in line.
    pub waiting: usize,
}

/// The slots and the line of one VM, for callers `K` watched by `W`.
#[derive(Debug)]
pub struct Queue<K, W> {
    state: Mutex<State<K, W>>,
}

#[derive(Debug)]
struct State<K, W> {
    limit: usize,
    running: usize,
    held: Vec<(K, W)>,
    line: VecDeque<(K, W)>,
}

impl<K: PartialEq, W> Default for Queue<K, W> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: PartialEq, W> Queue<K, W> {
    /// A queue with no slots: every caller waits until [`Queue::resize`].
    pub const fn new() -> Self {
        let state = State { limit: 0, running: 0, held: Vec::new(), line: VecDeque::new() };
        Queue { state: Mutex::new(state) }
    }

    fn lock(&self) -> MutexGuard<'_, State<K, W>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets the number of slots (a new pool's size) and hands the new ones.
    pub fn resize(&self, limit: usize, go: impl FnMut(&K, &W)) {
        let mut state = self.lock();
        state.limit = limit;
        state.fill(go);
    }

    /// No slots from now on, and every caller in line is handed one.
    pub fn close(&self, mut go: impl FnMut(&K, &W)) {
        let mut state = self.lock();
        state.limit = 0;
        while let Some((key, watch)) = state.line.pop_front() {
            go(&key, &watch);
            state.held.push((key, watch));
        }
    }

    /// `true`: `key` holds a slot (taken now while one is free and nobody
    /// waits, or held already). `false`: it waits in line (put at its end,
    /// or where it was). It is watched by what `watch` makes; with nothing
    /// made (the caller is dead), it is in neither.
    pub fn take(&self, key: K, watch: impl FnOnce() -> Option<W>) -> bool {
        let mut state = self.lock();
        if state.held.iter().any(|(k, _)| *k == key) {
            return true;
        }
        if state.line.iter().any(|(k, _)| *k == key) {
            return false;
        }
        let free = state.line.is_empty() && state.used() < state.limit;
        if let Some(watch) = watch() {
            if free {
                state.held.push((key, watch));
            } else {
                state.line.push_back((key, watch));
            }
        }
        free
    }

    /// Starts the slot `key` holds: its watch back, or `None` if it holds none.
    pub fn start(&self, key: &K) -> Option<W> {
        let mut state = self.lock();
        let i = state.held.iter().position(|(k, _)| k == key)?;
        state.running += 1;
        Some(state.held.swap_remove(i).1)
    }

    /// A started call has ended. With `take`, the first call in line, if
    /// any, is taken to run on the same slot (its caller and watch back,
    /// for its reply), unless more slots are in use than there are now (a
    /// smaller pool was installed meanwhile); else the slot goes to the
    /// first in line.
    pub fn finish(&self, take: bool, go: impl FnMut(&K, &W)) -> Option<(K, W)> {
        let mut state = self.lock();
        if take && state.used() <= state.limit {
            if let Some(taken) = state.line.pop_front() {
                return Some(taken);
            }
        }
        state.running = state.running.saturating_sub(1);
        state.fill(go);
        None
    }

    /// Takes `key` out of the line, or takes back the slot it holds and
    /// hands it on; its watch, or `None` when it was in neither (its call
    /// was taken, or started).
    pub fn leave(&self, key: &K, go: impl FnMut(&K, &W)) -> Option<W> {
        let mut state = self.lock();
        let left = match state.line.iter().position(|(k, _)| k == key) {
            Some(i) => state.line.remove(i),
            None => {
                let i = state.held.iter().position(|(k, _)| k == key);
                i.map(|i| state.held.swap_remove(i))
            }
        };
        state.fill(go);
        left.map(|(_, watch)| watch)
    }

    /// Runs `f` with the queue locked if `key` still holds the slot it was
    /// handed with a watch that `was` recognises, unstarted: for a go sent
    /// late, which must come for that slot only.
    pub fn if_held(&self, key: &K, was: impl Fn(&W) -> bool, f: impl FnOnce()) {
        let state = self.lock();
        if state.held.iter().any(|(k, w)| k == key && was(w)) {
            f();
        }
    }

    /// What the queue holds right now.
    pub fn counts(&self) -> Counts {
        let state = self.lock();
        Counts {
            limit: state.limit,
            running: state.running,
            held: state.held.len(),
            waiting: state.line.len(),
        }
    }
}

impl<K, W> State<K, W> {
    fn used(&self) -> usize {
        self.running + self.held.len()
    }

    /// Hands free slots to the first in line, sending each go.
    fn fill(&mut self, mut go: impl FnMut(&K, &W)) {
        while self.used() < self.limit {
            let Some((key, watch)) = self.line.pop_front() else { break };
            go(&key, &watch);
            self.held.push((key, watch));
        }
    }
}
