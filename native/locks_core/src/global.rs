//! The process-wide runtime and the installed [`Locks`], for the NIF.
//!
//! A NIF call arrives on a dirty-I/O scheduler thread, outside any runtime,
//! and [`block_on`] runs its future to completion on that thread. The runtime
//! is a single *current-thread* runtime shared by every dirty-I/O thread: it
//! has no worker threads of its own, and whichever thread is inside
//! [`block_on`] drives it (its connection tasks, its I/O, its timers).
//!
//! Why not a multi-thread runtime: there, the connection tasks run on the
//! runtime's workers, so every call crosses threads twice. The dirty thread
//! hands its request to a worker (waking it), the worker writes it to the
//! socket, waits for the answer and hands the rows back (waking the dirty
//! thread). On a loaded machine each of those wake-ups costs more than the
//! statement itself. With a current-thread runtime, a call that finds the
//! runtime free drives it: its own thread writes the request, waits in
//! `epoll` for the answer and reads it, as libpq would; no other thread is
//! involved. While one thread drives the runtime, the others' connection
//! tasks run on it too (tokio lets one thread at a time hold the runtime's
//! core; the others wait for their answer or for the core, whichever comes
//! first), and it is handed over when that thread's own call ends.
//!
//! One runtime per dirty thread is not possible: connections are pooled, and
//! a connection's task belongs to the runtime it was spawned on, so a
//! connection opened on one thread's runtime would never be driven while
//! another thread used it.
//!
//! Between calls nobody drives the runtime, so what happened meanwhile (a
//! connection closed by the server, a task aborted by a closed pool) is
//! caught up at the start of the next call, before it checks a connection out
//! ([`block_on`]), and right after a pool is closed ([`stop`], [`start`]).
//!
//! The runtime lives for the whole VM: rustler supports no unloading, and a
//! runtime dropped under a connection task would abort it. The pool, unlike
//! the runtime, can be replaced: [`start`] installs one per application start
//! and [`stop`] closes it.

use std::future::Future;
use std::sync::{Arc, RwLock};

use once_cell::sync::Lazy;
use tokio::runtime::Runtime;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::locks::Locks;

/// The shared current-thread runtime (see the module doc): no threads of its
/// own besides tokio's blocking pool, which only resolves host names.
static RUNTIME: Lazy<std::result::Result<Runtime, String>> = Lazy::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .thread_name("phoenix_kit_agent_locks")
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
});

static CURRENT: RwLock<Option<Arc<Locks>>> = RwLock::new(None);

fn runtime() -> Result<&'static Runtime> {
    RUNTIME
        .as_ref()
        .map_err(|e| Error::Connect(format!("cannot start the tokio runtime: {e}")))
}

/// Runs `future` to completion on the calling thread, within the runtime.
///
/// First the runtime catches up on what happened since it was last driven,
/// so that a connection the server closed in the meantime is known to be
/// closed when the pool checks it out, and is replaced instead of failing the
/// call (see [`catch_up`]).
pub fn block_on<F: Future>(future: F) -> Result<F::Output> {
    Ok(runtime()?.block_on(async {
        catch_up().await;
        future.await
    }))
}

/// Runs one call of `locks` for a caller that made it at `queued_at_us`
/// (the OS clock, microseconds since the Unix epoch, as the BEAM's
/// `System.os_time(:microsecond)`), within what is left of its timeout.
///
/// A NIF call may wait for a free dirty-I/O scheduler before any of this
/// runs: with the database frozen, ten calls hold the ten schedulers for a
/// whole timeout each, and the callers queued behind them would otherwise
/// start their own timeout only then, waiting twice, three times as long.
/// Counting the queueing against the budget keeps every call within
/// [`Config::call_timeout`](crate::Config::call_timeout) of the caller's
/// call (plus the scheduling delay itself): a caller whose budget is spent
/// by the time it runs fails at once with [`Error::Timeout`], sending nothing.
pub fn call<T>(
    locks: &Locks,
    queued_at_us: i64,
    call: impl Future<Output = Result<T>>,
) -> Result<T> {
    let budget = locks.config().call_timeout();
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(queued_at_us, |d| {
            i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
        });
    // A clock that stepped back (or a stamp from the future) counts as no wait.
    let waited = std::time::Duration::from_micros(
        u64::try_from(now_us.saturating_sub(queued_at_us)).unwrap_or(0),
    );
    let remaining = budget.saturating_sub(waited);
    if remaining.is_zero() {
        return Err(Error::Timeout(budget));
    }
    block_on(async {
        tokio::time::timeout(remaining, call)
            .await
            .unwrap_or(Err(Error::Timeout(budget)))
    })?
}

/// Lets the runtime poll its I/O driver and run every task that became ready.
///
/// Each `yield_now` hands control back to the runtime, which wakes the caller
/// only once it has run out of ready tasks *and* polled the I/O driver: the
/// first yield collects the pending socket events (an end of file on an idle
/// connection, say) and schedules their connection tasks, the second lets
/// those tasks run, so a dead connection's client reports `is_closed()`.
/// Costs two non-blocking `epoll_wait`s. When another thread holds the
/// runtime, it is the one driving it, and the yields return at once.
async fn catch_up() {
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
}

/// Builds a pool from `config` and installs it, closing the one before.
pub fn start(config: Config) -> Result<()> {
    // The pool registers its timers with the runtime it is built in.
    let locks = {
        let _entered = runtime()?.enter();
        Arc::new(Locks::new(config)?)
    };
    let previous = {
        let mut current = CURRENT
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        current.replace(locks)
    };
    if let Some(previous) = previous {
        close(&previous);
    }
    Ok(())
}

/// Closes and uninstalls the pool; calls fail with [`Error::NotStarted`] until
/// the next [`start`].
pub fn stop() {
    let previous = CURRENT
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .take();
    if let Some(previous) = previous {
        close(&previous);
    }
}

/// Closes a pool, then drives the runtime once: closing aborts the idle
/// connections' tasks, and only a driven runtime drops them and so closes
/// their sockets. A connection still checked out is closed when its call
/// ends, at the latest by the next call's [`catch_up`]. Not from inside
/// another runtime (a test's, say), where blocking on this one would panic:
/// the next call through [`block_on`] catches up instead.
fn close(locks: &Locks) {
    locks.close();
    if tokio::runtime::Handle::try_current().is_err() {
        if let Ok(runtime) = runtime() {
            runtime.block_on(catch_up());
        }
    }
}

/// The installed pool.
pub fn current() -> Result<Arc<Locks>> {
    CURRENT
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone()
        .ok_or(Error::NotStarted)
}
