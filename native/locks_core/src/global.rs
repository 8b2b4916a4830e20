//! The process-wide runtime and the installed [`LockPool`], for the NIF.
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

use crate::error::{Error, Result};
use crate::pool::LockPool;
use crate::settings::Settings;

/// The shared current-thread runtime (see the module doc): no threads of its
/// own besides tokio's blocking pool, which only resolves host names.
static RUNTIME: Lazy<std::result::Result<Runtime, String>> = Lazy::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .thread_name("phoenix_kit_agent_locks")
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
});

static CURRENT: RwLock<Option<Arc<LockPool>>> = RwLock::new(None);

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

/// Lets the runtime poll its I/O driver and run every task that became ready.
///
/// Each `yield_now` hands control back to the runtime, which wakes the caller
/// only once it has run out of ready tasks *and* polled the I/O driver: the
/// first yield collects the pending socket events (an end of file on an idle
/// connection, say) and schedules their connection tasks, the second lets
/// those tasks run, so a dead connection's client reports `is_closed()`.
/// Costs two non-blocking `epoll_wait`s. When another thread holds the
/// runtime, it is the one driving it, and the yields return at once.
pub(crate) async fn catch_up() {
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
}

/// Builds a pool from `settings` and installs it, closing the one before.
pub fn start(settings: Settings) -> Result<Arc<LockPool>> {
    let locks = {
        let _entered = runtime()?.enter();
        Arc::new(LockPool::new(settings)?)
    };
    let previous = {
        let mut current = CURRENT
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        current.replace(locks.clone())
    };
    if let Some(previous) = previous {
        close(&previous);
    }
    Ok(locks)
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
fn close(locks: &LockPool) {
    locks.close();
    if tokio::runtime::Handle::try_current().is_err() {
        if let Ok(runtime) = runtime() {
            runtime.block_on(catch_up());
        }
    }
}

/// The installed pool.
pub fn current() -> Result<Arc<LockPool>> {
    CURRENT
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone()
        .ok_or(Error::NotStarted)
}
