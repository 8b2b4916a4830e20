//! One lock call as data: the arguments it was called with ([`Job`]) and
//! what the pool answered ([`Answer`]). Contention is an answer, not an
//! error: [`Busy`].
//!
//! [`LockPool::run`](crate::LockPool::run) sends any job as its one
//! statement; [`Job::answer`] reads the rows it returned.

use tokio_postgres::types::ToSql;

use crate::row::{only, Row, Value};
use crate::sql::{self, Def};
use crate::{ClickRef, Error, Hold, Result, Ttl, TurnRef, Uuid};

/// A lock call and its arguments: the one list of the lock functions. One
/// variant per function of the Elixir API, named after it (without its `?`),
/// its fields the function's arguments in their order, which is also the
/// order of its statement's parameters `$1`, `$2`… (`sql.rs`, named after
/// the function). The NIF decodes one by derive from the tuple `{function,
/// arg, …}` (the `nif` feature); a hold longer than its TTL is refused by
/// [`Job::checked`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "nif", derive(rustler::NifTaggedEnum), rustler(decode))]
pub enum Job {
    /// `acquire/4` (the TTL as the hold), `acquire/5`: chat, user, turn ref, TTL, hold.
    Acquire(Uuid, Uuid, TurnRef, Ttl, Hold),
    /// `acquire_user/4`: user, click ref, TTL, hold.
    AcquireUser(Uuid, ClickRef, Ttl, Hold),
    /// `fresh?/3`: chat, turn ref, TTL.
    Fresh(Uuid, TurnRef, Ttl),
    /// `held?/3`: chat, user, turn ref.
    Held(Uuid, Uuid, TurnRef),
    /// `keep/5`: chat, user, turn ref, TTL, hold.
    Keep(Uuid, Uuid, TurnRef, Ttl, Hold),
    /// `keep_user/4`: user, click ref, TTL, hold.
    KeepUser(Uuid, ClickRef, Ttl, Hold),
    /// `held_locks/1`: TTL.
    HeldLocks(Ttl),
    /// `release/3`: chat, user, turn ref.
    Release(Uuid, Uuid, TurnRef),
    /// `release_stale/4`: chat, user, turn ref, TTL.
    ReleaseStale(Uuid, Uuid, TurnRef, Ttl),
    /// `release_user/2`: user, click ref.
    ReleaseUser(Uuid, ClickRef),
}

/// What a [`Job`] answered.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// `acquire/4`, `acquire/5`, `acquire_user/4`: the locks taken;
    /// `release/3`, `release_user/2`: done, whatever was held.
    Ok,
    /// `acquire/4`, `acquire/5`, `acquire_user/4`: nothing taken, and why.
    Busy(Busy),
    /// `fresh?/3`, `held?/3`, `keep/5`, `keep_user/4`, `release_stale/4`.
    Yes(bool),
    /// `held_locks/1`.
    Locks(Vec<HeldLock>),
}

/// Why `acquire/4`, `acquire/5` or `acquire_user/4` took nothing: who holds a lock.
/// The NIF encodes it by derive (the `nif` feature) as the atom the API
/// answers in `{:error, reason}`: `:conversation_busy`, `:turn_in_flight`,
/// `:click_in_flight`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "nif", derive(rustler::NifUnitEnum), rustler(encode))]
pub enum Busy {
    /// The chat is locked by another turn (or names no row); `acquire` only.
    ConversationBusy,
    /// The user's lock is held by a turn (in another chat).
    TurnInFlight,
    /// The user's lock is held by a click on a confirmation card.
    ClickInFlight,
}

impl Busy {
    /// Who holds the user's lock, after a statement returned its `holder`;
    /// `None` when it is `mine`.
    pub(crate) fn user(holder: &str, mine: &str) -> Option<Self> {
        let click = crate::args::is_click_ref(holder);
        (holder != mine).then_some(if click { Busy::ClickInFlight } else { Busy::TurnInFlight })
    }
}

/// A lock taken, as `held_locks/1` lists it: the NIF encodes it by derive
/// (the `nif` feature) as the tuple of its fields, `{kind, id, holder,
/// since_us, age_s, stale}`.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "nif", derive(rustler::NifTuple), rustler(encode))]
pub struct HeldLock {
    /// A chat's lock or a user's.
    pub kind: LockKind,
    /// The chat's or the user's uuid, as text.
    pub id: String,
    /// The ref that holds it.
    pub holder: String,
    /// When it was taken or last re-dated: microseconds since the Unix
    /// epoch; `None` when unknown (no `busy_since`, or one outside years
    /// -4713 to 9999: `infinity`, the year 12000).
    pub since_us: Option<i64>,
    /// How old it is, in seconds by the database's clock; `None` when unknown.
    pub age_s: Option<f64>,
    /// Whether it may be taken over under the TTL asked about.
    pub stale: bool,
}

/// Whose lock a [`HeldLock`] is: `:chat` or `:user` in Elixir.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "nif", derive(rustler::NifUnitEnum), rustler(encode))]
pub enum LockKind {
    /// A chat's: a row of `phoenix_kit_agent_conversations`.
    Chat,
    /// A user's: a row of `phoenix_kit_agent_user_settings`.
    User,
}

impl Job {
    /// The job, or `None` when its hold is longer than its TTL (which would
    /// date the lock into the future).
    pub fn checked(self) -> Option<Self> {
        match &self {
            Job::Acquire(.., ttl, hold)
            | Job::Keep(.., ttl, hold)
            | Job::AcquireUser(.., ttl, hold)
            | Job::KeepUser(.., ttl, hold) => (hold.0 <= ttl.0).then_some(self),
            _ => Some(self),
        }
    }

    /// The lock functions as the Elixir API names them: their statements'
    /// names (`sql.rs`), for the counters of `status/0`.
    pub fn functions() -> impl Iterator<Item = &'static str> {
        sql::LOCKS.iter().map(|def| def.name)
    }

    /// The job's statement (`sql.rs`) and its parameters: the job's fields,
    /// in their order.
    pub(crate) fn statement(&self) -> (&'static Def, Vec<&(dyn ToSql + Sync)>) {
        match self {
            Job::Acquire(chat, user, turn, ttl, hold) => {
                (&sql::ACQUIRE, vec![chat, user, &turn.0, &ttl.0, &hold.0])
            }
            Job::AcquireUser(user, click, ttl, hold) => {
                (&sql::ACQUIRE_USER, vec![user, &click.0, &ttl.0, &hold.0])
            }
            Job::Fresh(chat, turn, ttl) => (&sql::FRESH, vec![chat, &turn.0, &ttl.0]),
            Job::Held(chat, user, turn) => (&sql::HELD, vec![chat, user, &turn.0]),
            Job::Keep(chat, user, turn, ttl, hold) => {
                (&sql::KEEP, vec![chat, user, &turn.0, &ttl.0, &hold.0])
            }
            Job::KeepUser(user, click, ttl, hold) => {
                (&sql::KEEP_USER, vec![user, &click.0, &ttl.0, &hold.0])
            }
            Job::HeldLocks(ttl) => (&sql::HELD_LOCKS, vec![&ttl.0]),
            Job::Release(chat, user, turn) => (&sql::RELEASE, vec![chat, user, &turn.0]),
            Job::ReleaseStale(chat, user, turn, ttl) => {
                (&sql::RELEASE_STALE, vec![chat, user, &turn.0, &ttl.0])
            }
            Job::ReleaseUser(user, click) => (&sql::RELEASE_USER, vec![user, &click.0]),
        }
    }

    /// What the job answers when its statement waited [`sql::ROW_WAIT`] for
    /// a row another session's transaction holds and was cancelled (`55P03`,
    /// having changed nothing; see `sql.rs`): the lock is busy right now.
    /// The takers are refused (a user row being inserted by a transaction
    /// still open, the one wait left to them, is a turn's), `release_stale/4`
    /// frees nothing, and the holder's own writes fail with
    /// [`Error::RowLocked`], to be tried again: a renewal must not lose a
    /// turn, nor a release claim to have freed a lock, because a
    /// transaction (the turn's own fenced write) held its row a while.
    pub fn locked(&self) -> Result<Answer> {
        match self {
            Job::Acquire(..) | Job::AcquireUser(..) => Ok(Answer::Busy(Busy::TurnInFlight)),
            Job::ReleaseStale(..) => Ok(Answer::Yes(false)),
            _ => Err(Error::RowLocked(sql::ROW_WAIT)),
        }
    }

    /// The answer in the rows this job's statement returned, from a pooled
    /// connection or from the host's repo (`row.rs`): the one reading of both.
    pub fn answer(&self, rows: &[Vec<Value>]) -> Result<Answer> {
        Ok(match self {
            Job::Acquire(_, _, turn, ..) => {
                let row = only(rows)?;
                match (row.bool(0)?, row.text(1)?) {
                    (true, _) => Answer::Ok,
                    // No holder: the chat was busy, the user row untouched.
                    (false, None) => Answer::Busy(Busy::ConversationBusy),
                    // The user's lock refused; or ours as the snapshot saw it
                    // in a row another session holds: busy all the same,
                    // never reported as an acquisition that did not happen.
                    (false, Some(holder)) => {
                        Answer::Busy(Busy::user(holder, &turn.0).unwrap_or(Busy::TurnInFlight))
                    }
                }
            }
            Job::AcquireUser(_, click, ..) => {
                Busy::user(only(rows)?.str(0)?, &click.0).map_or(Answer::Ok, Answer::Busy)
            }
            Job::Fresh(..) | Job::Held(..) | Job::Keep(..) | Job::ReleaseStale(..) => {
                Answer::Yes(only(rows)?.bool(0)?)
            }
            Job::KeepUser(..) => Answer::Yes(rows.len() == 1),
            Job::HeldLocks(..) => Answer::Locks(
                rows.iter()
                    .map(|row| {
                        let chat = row.str(0)? == "chat";
                        Ok(HeldLock {
                            kind: if chat { LockKind::Chat } else { LockKind::User },
                            id: row.str(1)?.to_owned(),
                            holder: row.str(2)?.to_owned(),
                            since_us: row.int(3)?,
                            age_s: row.float(4)?,
                            stale: row.bool(5)?,
                        })
                    })
                    .collect::<Result<_>>()?,
            ),
            Job::Release(..) | Job::ReleaseUser(..) => Answer::Ok,
        })
    }
}
