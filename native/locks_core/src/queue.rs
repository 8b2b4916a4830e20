//! The queue: at most `limit` lock calls run at once; the others wait in line.
//!
//! A lock call blocks a dirty-I/O scheduler for as long as its statement
//! takes. With a database that hangs, calls let in freely would hold every
//! such scheduler, and the VM's file I/O with them. So a call runs only
//! with a *slot*, and there are `limit` slots, one per pooled connection.
//!
//! A call is one NIF call, or two when its caller is handed a slot, by a
//! caller `K` (a process) that leaves its call `W` (what it needs watched,
//! and the decoded job) in line:
//!
//! 1. [`Queue::start`], as the dirty call begins: the caller's slot when it
//!    was handed one, or a free slot while nobody waits; the call runs, and
//!    [`Queue::finish`] when it ends, whatever its outcome, frees the slot
//!    (or passes it to a call it takes, 2.).
//!    With no slot, the caller takes a place at the end of the line, its
//!    call with it, and the NIF call returns at once: the caller waits on a
//!    normal scheduler for its call's answer, for a slot, or for its
//!    checkout deadline.
//! 2. A call that ends takes the first call in line, if any, and runs it on
//!    its own slot and thread, then sends the answer to that call's caller:
//!    [`RUN_NEXT`] calls at most, then its slot is handed to the first in
//!    line, who starts it by its second NIF call. So most waiters cost one
//!    message, which brings the answer, and no dirty-I/O call of their own.
//! 3. At the deadline instead: [`Queue::leave`], out of the line, or giving
//!    back a slot handed too late. A caller that is in neither was told
//!    already, by a message that is in its mailbox or comes: its call's
//!    answer (which the call's deadline bounds), or the pool's closing.
//!
//! While the queue was full when a caller last looked (a hint the caller's
//! side keeps), a caller begins with [`Queue::enter`] instead, on a normal
//! scheduler: it is handed a free slot (and starts it by its dirty call) or
//! takes its place in line, so that waiting costs no round trip through a
//! dirty-I/O scheduler. A hint that is wrong costs one cheap call, never a
//! wrong answer.
//!
//! Each place in line, and each slot handed and not started, keeps the
//! caller's `W` (with the NIF's monitor of the process): a caller that dies
//! there is taken out by [`Queue::leave`] at once, so no slot outlives its
//! caller and nobody waits behind a dead one. A slot taken free is started
//! in the same call, which runs to its end even when its process is killed,
//! and so does a call taken from the line, so a started slot is always
//! finished and needs no watching. Slots are handed, and calls taken, with
//! the queue locked: a caller that leaves finds its `:go` in its mailbox,
//! or learns that its message comes, and no message comes later. The queue
//! keeps no clock: every caller in line leaves by itself at its deadline.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// How many calls from the line one call that ends runs, after its own,
/// before it hands its slot on: each makes its own caller's answer wait one
/// more statement (8 bounds that to about a full line's wait at the default
/// pool of 8), and saves the caller it runs a dirty-I/O call (its one
/// wake-up brings the answer, not a slot). Whether it pays is measured by
/// `mix locks.bench --alternate` at 50 callers (`bench/README.md`).
pub const RUN_NEXT: usize = 8;

/// What [`Queue::start`] gives a caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Start<W> {
    /// A slot, started: the `W` the caller left in line, if it was handed one.
    Run(Option<W>),
    /// A place in line.
    Wait,
}

/// What the queue holds right now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Slots in all: the most calls that run at once.
    pub limit: usize,
    /// Calls running now.
    pub running: usize,
    /// Slots handed, and not yet started.
    pub handed: usize,
    /// Callers in line.
    pub waiting: usize,
}

/// The slots and the line of one VM (see the module doc).
#[derive(Debug)]
pub struct Queue<K, W> {
    state: Mutex<State<K, W>>,
}

#[derive(Debug)]
struct State<K, W> {
    limit: usize,
    running: usize,
    handed: Vec<(K, W)>,
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
        Queue {
            state: Mutex::new(State {
                limit: 0,
                running: 0,
                handed: Vec::new(),
                line: VecDeque::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<K, W>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets the number of slots (a new pool's size) and hands the new ones.
    pub fn resize(&self, limit: usize, hand: impl FnMut(&K, &W)) {
        let mut state = self.lock();
        state.limit = limit;
        state.fill(hand);
    }

    /// Takes every slot away and empties the line (the pool is closed): each
    /// caller in line is given back to `out`, to be told. Slots already
    /// handed stay theirs until started or left: a call that starts one
    /// finds no pool and ends at once, or, after a new pool is installed,
    /// runs on it, counted against its size.
    pub fn close(&self, out: impl FnMut((K, W))) {
        let mut state = self.lock();
        state.limit = 0;
        state.line.drain(..).for_each(out);
    }

    /// Starts the slot of `key`: the one it was handed (`Run(Some(w))`, its
    /// `W` back), or a free one while nobody waits (`Run(None)`); else `key`
    /// waits at the end of the line, with the `W` `wait` makes, or where it
    /// already is (`Wait`). With no `W` from `wait` (its caller died while
    /// asking, or its call is not one to run), it is not put in line.
    pub fn start(&self, key: K, wait: impl FnOnce() -> Option<W>) -> Start<W> {
        let mut state = self.lock();
        if let Some(i) = state.handed.iter().position(|(k, _)| *k == key) {
            state.running += 1;
            return Start::Run(Some(state.handed.swap_remove(i).1));
        }
        if state.free() {
            state.running += 1;
            return Start::Run(None);
        }
        state.line_up(key, wait);
        Start::Wait
    }

    /// For a caller that expects to wait, before its dirty call: a free slot
    /// while nobody waits is handed to `key` (`true`: it starts it by
    /// [`Queue::start`] next), with the `W` `wait` makes; else `key` waits
    /// at the end of the line with it, or where it already is (`false`).
    pub fn enter(&self, key: K, wait: impl FnOnce() -> Option<W>) -> bool {
        let mut state = self.lock();
        if state.handed.iter().any(|(k, _)| *k == key) {
            return true;
        }
        if state.free() {
            let Some(w) = wait() else { return false };
            state.handed.push((key, w));
            return true;
        }
        state.line_up(key, wait);
        false
    }

    /// A started call has ended. With `take`, the first call in line, if
    /// any, is taken to run on the same slot (its caller and `W` back, to be
    /// sent its answer), unless more slots are in use than there are now (a
    /// smaller pool was installed meanwhile); else the slot goes to the first
    /// in line.
    pub fn finish(&self, take: bool, hand: impl FnMut(&K, &W)) -> Option<(K, W)> {
        let mut state = self.lock();
        if take && state.used() <= state.limit {
            if let Some(taken) = state.line.pop_front() {
                return Some(taken);
            }
        }
        state.running = state.running.saturating_sub(1);
        state.fill(hand);
        None
    }

    /// Takes `key` out of the line, or takes back the slot it was handed and
    /// hands it on; its `W`, or `None` when it was in neither (it was told:
    /// its call was taken from the line, or the pool closed; or its call
    /// started).
    pub fn leave(&self, key: &K, hand: impl FnMut(&K, &W)) -> Option<W> {
        let mut state = self.lock();
        let left = match state.line.iter().position(|(k, _)| k == key) {
            Some(i) => state.line.remove(i),
            None => {
                let i = state.handed.iter().position(|(k, _)| k == key);
                i.map(|i| state.handed.swap_remove(i))
            }
        };
        state.fill(hand);
        left.map(|(_, w)| w)
    }

    /// Runs `f` with the queue locked, if `key` holds the slot it was handed
    /// with a `W` that `was` recognises, and has not started it: for a
    /// message about that slot sent from elsewhere, later. The `W` tells
    /// that handing from a later one to the same caller (it may have left
    /// and been handed another since), which must not be announced twice.
    pub fn if_handed(&self, key: &K, was: impl Fn(&W) -> bool, f: impl FnOnce()) {
        let state = self.lock();
        if state.handed.iter().any(|(k, w)| k == key && was(w)) {
            f();
        }
    }

    /// What the queue holds right now.
    pub fn counts(&self) -> Counts {
        let state = self.lock();
        Counts {
            limit: state.limit,
            running: state.running,
            handed: state.handed.len(),
            waiting: state.line.len(),
        }
    }
}

impl<K: PartialEq, W> State<K, W> {
    /// Whether a newcomer may have a slot: one is free and nobody waits.
    fn free(&self) -> bool {
        self.line.is_empty() && self.used() < self.limit
    }

    /// `key` at the end of the line, with the `W` `wait` makes, unless it is
    /// in line already or `wait` makes none.
    fn line_up(&mut self, key: K, wait: impl FnOnce() -> Option<W>) {
        if !self.line.iter().any(|(k, _)| *k == key) {
            if let Some(w) = wait() {
                self.line.push_back((key, w));
            }
        }
    }
}

impl<K, W> State<K, W> {
    fn used(&self) -> usize {
        self.running + self.handed.len()
    }

    /// Hands free slots to the first in line, telling each with `hand`.
    fn fill(&mut self, mut hand: impl FnMut(&K, &W)) {
        while self.used() < self.limit {
            let Some(entry) = self.line.pop_front() else { break };
            hand(&entry.0, &entry.1);
            self.handed.push(entry);
        }
    }
}
