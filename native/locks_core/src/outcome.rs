//! What a lock call answered. Contention is an outcome, not an error.

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
