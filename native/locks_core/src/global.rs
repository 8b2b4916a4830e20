//! The process-wide runtime and the installed [`Locks`], for the NIF.
//!
//! A NIF call arrives on a dirty-I/O scheduler thread, outside any runtime.
//! [`block_on`] runs its future on that thread, driving the shared runtime's
//! I/O and timers, so the scheduler thread is parked (not spinning) while
//! PostgreSQL answers. The runtime lives for the whole VM: rustler supports no
//! unloading, and a runtime dropped under a running connection task would
//! abort it. The pool, unlike the runtime, can be replaced: [`start`]
//! installs one per application start and [`stop`] closes it.

use std::future::Future;
use std::sync::{Arc, RwLock};

use once_cell::sync::Lazy;
use tokio::runtime::Runtime;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::locks::Locks;

/// Two worker threads: the connection tasks only move bytes between the
/// sockets and the callers, and the machines this runs on have few cores.
static RUNTIME: Lazy<std::result::Result<Runtime, String>> = Lazy::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
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
pub fn block_on<F: Future>(future: F) -> Result<F::Output> {
    Ok(runtime()?.block_on(future))
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
        previous.close();
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
        previous.close();
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
