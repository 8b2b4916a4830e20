//! The installed [`LockPool`], for the NIF: replaced by each [`start`],
//! closed by [`stop`]. The pool's connections have runtimes of their own,
//! driven by the calls that hold them (see [`LockPool`]), so nothing here
//! runs in the background.

use std::sync::{Arc, PoisonError, RwLock};

use crate::error::{Error, Result};
use crate::pool::LockPool;

static CURRENT: RwLock<Option<Arc<LockPool>>> = RwLock::new(None);

/// Installs `pool`, built by the caller, closing the one before.
pub fn start(pool: LockPool) {
    install(Some(Arc::new(pool)));
}

/// Closes and uninstalls the pool; calls fail with [`Error::NotStarted`] until
/// the next [`start`].
pub fn stop() {
    install(None);
}

/// Installs `pool` in place of the pool before, which is closed.
fn install(pool: Option<Arc<LockPool>>) {
    let previous =
        std::mem::replace(&mut *CURRENT.write().unwrap_or_else(PoisonError::into_inner), pool);
    if let Some(previous) = previous {
        previous.close();
    }
}

/// The installed pool.
pub fn current() -> Result<Arc<LockPool>> {
    CURRENT.read().unwrap_or_else(PoisonError::into_inner).clone().ok_or(Error::NotStarted)
}
