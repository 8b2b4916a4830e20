//! The process-wide runtime and the installed [`LockPool`], for the NIF.
//!
//! A NIF call arrives on a dirty-I/O scheduler thread and [`block_on`] runs
//! its future there, on one *current-thread* runtime shared by every such
//! thread: whichever thread is inside [`block_on`] drives it (the connection
//! tasks, the I/O, the timers); the others wait for their answer or for the
//! runtime, whichever comes first. So a call that finds the runtime free
//! writes its request, waits in `epoll` and reads the answer on its own
//! thread, as libpq would. A multi-thread runtime would move every call
//! across threads twice, and on a loaded machine those wake-ups cost more
//! than the statement. One runtime per thread cannot work: a pooled
//! connection's task belongs to the runtime it was spawned on.
//!
//! Between calls nobody drives the runtime, so what happened meanwhile (a
//! connection the server closed, a task a closed pool aborted) is caught up
//! at the start of the next call ([`block_on`]) and right after a pool is
//! closed. The runtime lives as long as the VM (rustler cannot unload, and a
//! runtime dropped under a connection task would abort it); the pool is
//! replaced by each [`start`] and closed by [`stop`].

use std::future::Future;
use std::sync::{Arc, RwLock};

use once_cell::sync::Lazy;
use tokio::runtime::Runtime;

use crate::error::{Error, Result};
use crate::pool::LockPool;
use crate::settings::Settings;

/// The shared runtime: no threads of its own but tokio's blocking pool,
/// which only resolves host names.
static RUNTIME: Lazy<std::result::Result<Runtime, String>> = Lazy::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .thread_name("phoenix_kit_agent_locks")
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
});

static CURRENT: RwLock<Option<Arc<LockPool>>> = RwLock::new(None);

fn runtime() -> Result<&'static Runtime> {
    RUNTIME.as_ref().map_err(|e| Error::Connect(format!("cannot start the tokio runtime: {e}")))
}

/// Runs `future` to completion on the calling thread, within the runtime,
/// after catching up (so a connection the server closed meanwhile is
/// replaced at checkout instead of failing the call).
pub fn block_on<F: Future>(future: F) -> Result<F::Output> {
    Ok(runtime()?.block_on(async {
        catch_up().await;
        future.await
    }))
}

/// Lets the runtime poll its I/O driver and run every task that became
/// ready: the first yield collects pending socket events (an end of file on
/// an idle connection) and schedules their tasks, the second runs them, so
/// a dead connection's client reports `is_closed()`. Two non-blocking
/// `epoll_wait`s; at once when another thread drives the runtime.
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
        let mut current = CURRENT.write().unwrap_or_else(|poisoned| poisoned.into_inner());
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
    let previous = CURRENT.write().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
    if let Some(previous) = previous {
        close(&previous);
    }
}

/// Closes a pool, then drives the runtime once, which drops the aborted
/// idle connections' tasks and so closes their sockets (a connection still
/// checked out closes when its call ends). Not inside another runtime (a
/// test's), where blocking would panic: the next [`block_on`] catches up.
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
    CURRENT.read().unwrap_or_else(|poisoned| poisoned.into_inner()).clone().ok_or(Error::NotStarted)
}
