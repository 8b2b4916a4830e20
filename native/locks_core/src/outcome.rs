//! What a lock call answered. Contention is an outcome, not an error.

/// The answer of `acquire/4`: both locks taken, or why neither was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acquire {
    /// The turn now holds the chat's and the user's lock.
    Acquired,
    /// The chat is locked by another turn (or names no row).
    ConversationBusy,
    /// The user's lock is held by a turn (in another chat).
    TurnInFlight,
    /// The user's lock is held by a click on a confirmation card.
    ClickInFlight,
}

/// The answer of `acquire_user/4`: the user's lock taken, or what holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireUser {
    /// The click now holds the user's lock.
    Acquired,
    /// The user's lock is held by a turn.
    TurnInFlight,
    /// The user's lock is held by another click.
    ClickInFlight,
}

impl AcquireUser {
    /// Classifies the user's lock after a statement returned its holder.
    pub(crate) fn from_holder(holder: &str, mine: &str) -> Self {
        if holder == mine {
            AcquireUser::Acquired
        } else if crate::args::is_click_ref(holder) {
            AcquireUser::ClickInFlight
        } else {
            AcquireUser::TurnInFlight
        }
    }
}

/// A lock taken, as `held_locks/1` lists it.
#[derive(Clone, Debug, PartialEq)]
pub struct HeldLock {
    /// A chat's lock (`true`) or a user's.
    pub chat: bool,
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
