//! One lock call as data: the arguments it was called with ([`Job`]) and
//! what the pool answered ([`Answer`]).
//!
//! [`LockPool::run`](crate::LockPool::run) sends any job as its one
//! statement; [`Job::answer`] reads the rows it returned.

use tokio_postgres::types::ToSql;

use crate::outcome::{Acquire, AcquireUser, HeldLock};
use crate::row::{only, Row};
use crate::sql::{self, Def};
use crate::{ClickRef, Hold, Result, Ttl, TurnRef, Uuid};

/// A lock call and its arguments: one variant per function of the Elixir
/// API, named after it, run as its statement in `sql.rs`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(missing_docs)] // the variants and fields: the Elixir functions and their arguments
pub enum Job {
    Acquire { chat: Uuid, user: Uuid, turn: TurnRef, ttl: Ttl, hold: Hold },
    AcquireUser { user: Uuid, click: ClickRef, ttl: Ttl, hold: Hold },
    Fresh { chat: Uuid, turn: TurnRef, ttl: Ttl },
    Held { chat: Uuid, user: Uuid, turn: TurnRef },
    Keep { chat: Uuid, user: Uuid, turn: TurnRef, ttl: Ttl, hold: Hold },
    KeepUser { user: Uuid, click: ClickRef, ttl: Ttl, hold: Hold },
    HeldLocks { ttl: Ttl },
    Release { chat: Uuid, user: Uuid, turn: TurnRef },
    ReleaseStale { chat: Uuid, user: Uuid, turn: TurnRef, ttl: Ttl },
    ReleaseUser { user: Uuid, click: ClickRef },
}

/// What a [`Job`] answered.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// `acquire/4`, `acquire/5`.
    Acquire(Acquire),
    /// `acquire_user/4`.
    AcquireUser(AcquireUser),
    /// `fresh?/3`, `held?/3`, `keep/5`, `keep_user/4`, `release_stale/4`.
    Yes(bool),
    /// `release/3`, `release_user/2`: done, whatever was held.
    Done,
    /// `held_locks/1`.
    Locks(Vec<HeldLock>),
}

impl Job {
    /// The job's statement (`sql.rs`).
    pub(crate) fn statement(&self) -> &'static Def {
        match self {
            Job::Acquire { .. } => &sql::ACQUIRE,
            Job::AcquireUser { .. } => &sql::ACQUIRE_USER,
            Job::Fresh { .. } => &sql::FRESH,
            Job::Held { .. } => &sql::HELD,
            Job::Keep { .. } => &sql::KEEP,
            Job::KeepUser { .. } => &sql::KEEP_USER,
            Job::HeldLocks { .. } => &sql::HELD_LOCKS,
            Job::Release { .. } => &sql::RELEASE,
            Job::ReleaseStale { .. } => &sql::RELEASE_STALE,
            Job::ReleaseUser { .. } => &sql::RELEASE_USER,
        }
    }

    /// The statement's parameters, in the order of its `$n`.
    pub(crate) fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        match self {
            Job::Acquire { chat, user, turn, ttl, hold }
            | Job::Keep { chat, user, turn, ttl, hold } => {
                vec![chat, user, &turn.0, &ttl.0, &hold.0]
            }
            Job::ReleaseStale { chat, user, turn, ttl } => vec![chat, user, &turn.0, &ttl.0],
            Job::AcquireUser { user, click, ttl, hold }
            | Job::KeepUser { user, click, ttl, hold } => vec![user, &click.0, &ttl.0, &hold.0],
            Job::Held { chat, user, turn } | Job::Release { chat, user, turn } => {
                vec![chat, user, &turn.0]
            }
            Job::Fresh { chat, turn, ttl } => vec![chat, &turn.0, &ttl.0],
            Job::HeldLocks { ttl } => vec![&ttl.0],
            Job::ReleaseUser { user, click } => vec![user, &click.0],
        }
    }

    /// The answer in the rows this job's statement returned, from a pooled
    /// connection or from the host's repo (`row.rs`): the one reading of both.
    pub(crate) fn answer<R: Row>(&self, rows: &[R]) -> Result<Answer> {
        Ok(match self {
            Job::Acquire { turn, .. } => {
                let row = only(rows)?;
                let acquired = row.bool(0)?;
                let holder = row.text(1)?;
                Answer::Acquire(match (acquired, holder) {
                    (true, _) => Acquire::Acquired,
                    (false, None) => Acquire::ConversationBusy,
                    (false, Some(holder)) => {
                        match AcquireUser::from_holder(holder, &turn.0) {
                            AcquireUser::ClickInFlight => Acquire::ClickInFlight,
                            // The user's lock was ours but the chat could not be
                            // written: impossible while the chat row is locked,
                            // but never report an acquisition that did not happen.
                            AcquireUser::Acquired => Acquire::ConversationBusy,
                            AcquireUser::TurnInFlight => Acquire::TurnInFlight,
                        }
                    }
                })
            }
            Job::AcquireUser { click, .. } => {
                let holder = only(rows)?.str(0)?;
                Answer::AcquireUser(AcquireUser::from_holder(holder, &click.0))
            }
            Job::Fresh { .. } | Job::Held { .. } | Job::Keep { .. } | Job::ReleaseStale { .. } => {
                Answer::Yes(only(rows)?.bool(0)?)
            }
            Job::KeepUser { .. } => Answer::Yes(rows.len() == 1),
            Job::HeldLocks { .. } => Answer::Locks(
                rows.iter()
                    .map(|row| {
                        Ok(HeldLock {
                            chat: row.str(0)? == "chat",
                            id: row.str(1)?.to_owned(),
                            holder: row.str(2)?.to_owned(),
                            since_us: row.int(3)?,
                            age_s: row.float(4)?,
                            stale: row.bool(5)?,
                        })
                    })
                    .collect::<Result<_>>()?,
            ),
            Job::Release { .. } | Job::ReleaseUser { .. } => Answer::Done,
        })
    }
}
