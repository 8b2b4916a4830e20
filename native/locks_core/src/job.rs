//! One lock call as data: the arguments it was called with ([`Job`]) and
//! what the pool answered ([`Answer`]).
//!
//! A job owns its arguments, so that a call that waits for its turn can be
//! handed, whole, to the call that frees the turn and run there (see
//! `admission.rs`); [`LockPool::run`] runs any job as its one statement.

use crate::{Acquire, AcquireUser, ClickRef, Deadline, HeldLock, Hold, LockPool, Result};
use crate::{Ttl, TurnRef, Uuid};

/// A lock call and its arguments, one variant per function of the Elixir API.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Job {
    Acquire {
        chat: Uuid,
        user: Uuid,
        turn: TurnRef,
        ttl: Ttl,
    },
    AcquireUser {
        user: Uuid,
        click: ClickRef,
        ttl: Ttl,
        hold: Hold,
    },
    Fresh {
        chat: Uuid,
        turn: TurnRef,
        ttl: Ttl,
    },
    Held {
        chat: Uuid,
        user: Uuid,
        turn: TurnRef,
    },
    Keep {
        chat: Uuid,
        user: Uuid,
        turn: TurnRef,
        ttl: Ttl,
    },
    KeepUser {
        user: Uuid,
        click: ClickRef,
        ttl: Ttl,
        hold: Hold,
    },
    HeldLocks {
        ttl: Ttl,
    },
    Release {
        chat: Uuid,
        user: Uuid,
        turn: TurnRef,
    },
    ReleaseStale {
        chat: Uuid,
        user: Uuid,
        turn: TurnRef,
        ttl: Ttl,
    },
    ReleaseUser {
        user: Uuid,
        click: ClickRef,
    },
}

/// What a [`Job`] answered.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// `acquire/4`.
    Acquire(Acquire),
    /// `acquire_user/4`.
    AcquireUser(AcquireUser),
    /// `fresh?/3`, `held?/3`, `keep/4`, `keep_user/4`, `release_stale/4`.
    Yes(bool),
    /// `release/3`, `release_user/2`: done, whatever was held.
    Done,
    /// `held_locks/1`.
    Locks(Vec<HeldLock>),
}

impl LockPool {
    /// Runs `job`'s one statement within `deadline`.
    pub async fn run(&self, deadline: Deadline, job: &Job) -> Result<Answer> {
        Ok(match job {
            Job::Acquire {
                chat,
                user,
                turn,
                ttl,
            } => Answer::Acquire(self.acquire(deadline, chat, user, turn, *ttl).await?),
            Job::AcquireUser {
                user,
                click,
                ttl,
                hold,
            } => Answer::AcquireUser(
                self.acquire_user(deadline, user, click, *ttl, *hold)
                    .await?,
            ),
            Job::Fresh { chat, turn, ttl } => {
                Answer::Yes(self.fresh(deadline, chat, turn, *ttl).await?)
            }
            Job::Held { chat, user, turn } => {
                Answer::Yes(self.held(deadline, chat, user, turn).await?)
            }
            Job::Keep {
                chat,
                user,
                turn,
                ttl,
            } => Answer::Yes(self.keep(deadline, chat, user, turn, *ttl).await?),
            Job::KeepUser {
                user,
                click,
                ttl,
                hold,
            } => Answer::Yes(self.keep_user(deadline, user, click, *ttl, *hold).await?),
            Job::HeldLocks { ttl } => Answer::Locks(self.held_locks(deadline, *ttl).await?),
            Job::Release { chat, user, turn } => {
                self.release(deadline, chat, user, turn).await?;
                Answer::Done
            }
            Job::ReleaseStale {
                chat,
                user,
                turn,
                ttl,
            } => Answer::Yes(self.release_stale(deadline, chat, user, turn, *ttl).await?),
            Job::ReleaseUser { user, click } => {
                self.release_user(deadline, user, click).await?;
                Answer::Done
            }
        })
    }
}
