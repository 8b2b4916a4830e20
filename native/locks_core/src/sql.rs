//! Every statement the library runs, one constant per public call.
//!
//! Rules every statement keeps:
//!
//! * **One statement, autocommit.** A call is one round trip; there is no
//!   transaction to leave open and no advisory lock to hold a connection for
//!   the length of a turn. What must be all-or-nothing is chained inside the
//!   statement (data-modifying CTEs reading each other's `RETURNING`).
//! * **The database's clock.** Every time is `now()`; a node's clock never
//!   enters a comparison. Each connection pins its session `TimeZone` to UTC
//!   (see `config.rs`), so a `busy_since` of type `timestamp without time
//!   zone` is written and compared as UTC exactly like a `timestamptz`.
//! * **Ownership in every write.** A lock is only freed, re-dated or taken
//!   over by a predicate on `busy_turn_ref` inside the same statement.
//! * **Locks in one order: chat row, then user row.** Statements that touch
//!   both make the user row's part depend on the chat row's part, so two calls
//!   never wait on each other in a cycle (no deadlock error reaches a caller).
//! * **`updated_at` is never named**: a settings row keeps the time its
//!   settings last changed.
//!
//! A lock is *free for ref `r`* when its ref is NULL, its `busy_since` is NULL
//! or older than the TTL, or it is already `r`'s (taking a lock you hold again
//! re-dates it; it never steals). `{chats}` and `{users}` stand for the two
//! table names, optionally schema-qualified; [`Statements::new`] fills them in
//! once per pool.
//!
//! Parameters are cast in the text so their types are fixed at `PREPARE`:
//! uuids are `uuid`, refs `text`, seconds `int4`.

/// Takes the chat's and the user's lock for a turn, or neither.
///
/// `$1` chat uuid, `$2` user uuid, `$3` turn ref, `$4` TTL in seconds.
///
/// 1. `chat` locks the chat row (`FOR UPDATE`) only if it is free for `$3`;
///    under READ COMMITTED the predicate is re-checked on the newest version
///    after waiting, so of racing turns exactly one gets the row.
///    A uuid with no row leaves `chat` empty: the chat is busy.
/// 2. `usr` runs only with a locked chat row (`FROM chat`). It creates the
///    settings row if missing, and otherwise *always* takes the row lock and
///    writes the lock back either as `$3`'s (when free) or unchanged. Writing
///    it back unchanged is deliberate: `RETURNING` then reports the current
///    holder even when that holder's row was inserted after this statement's
///    snapshot, which a plain `SELECT` could not see. So a refusal can still
///    say *who* holds the lock without a second statement.
/// 3. `took` writes the chat row only when `usr` reports `$3` as the holder:
///    a refused user lock leaves the chat exactly as it was.
///
/// Returns one row: `acquired` (both taken) and `user_holder` (NULL when the
/// chat was busy and the user row was never touched).
pub const ACQUIRE: &str = "
WITH chat AS (
  SELECT c.uuid FROM {chats} c
  WHERE c.uuid = $1::uuid
    AND (c.busy_turn_ref IS NULL OR c.busy_turn_ref = $3::text OR c.busy_since IS NULL
         OR c.busy_since < now() - $4::int4 * interval '1 second')
  FOR UPDATE
),
usr AS (
  INSERT INTO {users} AS u (user_uuid, busy_since, busy_turn_ref)
  SELECT $2::uuid, now(), $3::text FROM chat
  ON CONFLICT (user_uuid) DO UPDATE SET
    busy_since = CASE
      WHEN u.busy_turn_ref IS NULL OR u.busy_turn_ref = $3::text OR u.busy_since IS NULL
           OR u.busy_since < now() - $4::int4 * interval '1 second'
      THEN now() ELSE u.busy_since END,
    busy_turn_ref = CASE
      WHEN u.busy_turn_ref IS NULL OR u.busy_turn_ref = $3::text OR u.busy_since IS NULL
           OR u.busy_since < now() - $4::int4 * interval '1 second'
      THEN $3::text ELSE u.busy_turn_ref END
  RETURNING u.busy_turn_ref AS holder
),
took AS (
  UPDATE {chats} c SET busy_since = now(), busy_turn_ref = $3::text
  WHERE c.uuid = (SELECT uuid FROM chat)
    AND (SELECT holder FROM usr) = $3::text
  RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM took) AS acquired, (SELECT holder FROM usr) AS user_holder";

/// Takes the user's lock alone for a click, dated back by `ttl - hold`.
///
/// `$1` user uuid, `$2` click ref, `$3` TTL, `$4` hold, both in seconds.
///
/// One upsert: the row is created if missing, else the lock is taken when it
/// is free for `$2` (another holder's lock older than `$3`). Dating the lock
/// `$3 - $4` seconds into the past makes a turn (which takes over after `$3`)
/// take it `$4` seconds after this call, should the click never release it.
/// As in [`ACQUIRE`], a refused row is written back unchanged so that
/// `RETURNING` names the current holder, even one newer than the snapshot.
pub const ACQUIRE_USER: &str = "
INSERT INTO {users} AS u (user_uuid, busy_since, busy_turn_ref)
VALUES ($1::uuid, now() - ($3::int4 - $4::int4) * interval '1 second', $2::text)
ON CONFLICT (user_uuid) DO UPDATE SET
  busy_since = CASE
    WHEN u.busy_turn_ref IS NULL OR u.busy_turn_ref = $2::text OR u.busy_since IS NULL
         OR u.busy_since < now() - $3::int4 * interval '1 second'
    THEN EXCLUDED.busy_since ELSE u.busy_since END,
  busy_turn_ref = CASE
    WHEN u.busy_turn_ref IS NULL OR u.busy_turn_ref = $2::text OR u.busy_since IS NULL
         OR u.busy_since < now() - $3::int4 * interval '1 second'
    THEN EXCLUDED.busy_turn_ref ELSE u.busy_turn_ref END
RETURNING u.busy_turn_ref AS holder";

/// Whether the chat's lock is `$2`'s and not older than `$3` seconds.
///
/// `$1` chat uuid, `$2` turn ref, `$3` TTL. "Fresh" is the exact negation of
/// the take-over predicate (`busy_since < now() - ttl`): a fresh lock cannot
/// be taken over, a lock that is not fresh can.
pub const FRESH: &str = "
SELECT EXISTS (
  SELECT 1 FROM {chats}
  WHERE uuid = $1::uuid AND busy_turn_ref = $2::text
    AND busy_since >= now() - $3::int4 * interval '1 second'
)";

/// Whether `$3` holds both the chat's (`$1`) and the user's (`$2`) lock.
///
/// Both rows are read from one snapshot, so the answer is true of one moment.
pub const HELD: &str = "
SELECT EXISTS (SELECT 1 FROM {chats} WHERE uuid = $1::uuid AND busy_turn_ref = $3::text)
   AND EXISTS (SELECT 1 FROM {users} WHERE user_uuid = $2::uuid AND busy_turn_ref = $3::text)";

/// Re-dates a click's lock as if taken now, only while `$2` still holds it.
///
/// `$1` user uuid, `$2` click ref, `$3` TTL, `$4` hold. One row updated means
/// the click held it (`true`); none means it had been released or taken over.
pub const KEEP_USER: &str = "
UPDATE {users} SET busy_since = now() - ($3::int4 - $4::int4) * interval '1 second'
WHERE user_uuid = $1::uuid AND busy_turn_ref = $2::text";

/// Frees whichever of the two locks `$3` still holds.
///
/// `$1` chat uuid, `$2` user uuid, `$3` turn ref. Each lock is freed only by
/// its holder's ref, so a late release never frees a newer turn's lock. The
/// user row's update waits for the chat row's (the `(SELECT count(*) FROM
/// chat)` term) to keep the chat-then-user lock order.
pub const RELEASE: &str = "
WITH chat AS (
  UPDATE {chats} SET busy_since = NULL, busy_turn_ref = NULL
  WHERE uuid = $1::uuid AND busy_turn_ref = $3::text
  RETURNING 1
)
UPDATE {users} SET busy_since = NULL, busy_turn_ref = NULL
WHERE user_uuid = $2::uuid AND busy_turn_ref = $3::text
  AND (SELECT count(*) FROM chat) >= 0";

/// Frees a lost turn's locks: only while the chat's lock is still `$3`'s and
/// older than `$4` seconds.
///
/// `$1` chat uuid, `$2` user uuid, `$3` turn ref, `$4` TTL. Of two racing
/// callers the second waits on the chat row, re-checks the predicate on the
/// freed row and matches nothing: exactly one sees `released = true`. The
/// user's lock goes in the same statement, only if this call freed the chat
/// and `$3` still holds it.
pub const RELEASE_STALE: &str = "
WITH chat AS (
  UPDATE {chats} SET busy_since = NULL, busy_turn_ref = NULL
  WHERE uuid = $1::uuid AND busy_turn_ref = $3::text
    AND busy_since < now() - $4::int4 * interval '1 second'
  RETURNING 1
),
usr AS (
  UPDATE {users} SET busy_since = NULL, busy_turn_ref = NULL
  WHERE user_uuid = $2::uuid AND busy_turn_ref = $3::text
    AND EXISTS (SELECT 1 FROM chat)
  RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM chat) AS released, (SELECT count(*) FROM usr) AS users";

/// Frees the user's lock if `$2` still holds it. `$1` user uuid.
pub const RELEASE_USER: &str = "
UPDATE {users} SET busy_since = NULL, busy_turn_ref = NULL
WHERE user_uuid = $1::uuid AND busy_turn_ref = $2::text";

/// The statements with the table names filled in, built once per pool.
///
/// The texts are the cache keys of the per-connection prepared statements, so
/// building them once keeps each statement to one `PREPARE` per connection.
#[derive(Debug)]
pub(crate) struct Statements {
    pub acquire: String,
    pub acquire_user: String,
    pub fresh: String,
    pub held: String,
    pub keep_user: String,
    pub release: String,
    pub release_stale: String,
    pub release_user: String,
}

impl Statements {
    /// Fills in the table names; `schema` is an already quoted identifier.
    pub fn new(schema: Option<&str>) -> Self {
        let (chats, users) = crate::schema::table_names(schema);
        let fill = |sql: &str| sql.replace("{chats}", &chats).replace("{users}", &users);
        Statements {
            acquire: fill(ACQUIRE),
            acquire_user: fill(ACQUIRE_USER),
            fresh: fill(FRESH),
            held: fill(HELD),
            keep_user: fill(KEEP_USER),
            release: fill(RELEASE),
            release_stale: fill(RELEASE_STALE),
            release_user: fill(RELEASE_USER),
        }
    }

    /// Every statement, named after the Elixir function that runs it.
    pub fn all(&self) -> [(&'static str, &str); 8] {
        [
            ("acquire", &self.acquire),
            ("acquire_user", &self.acquire_user),
            ("fresh?", &self.fresh),
            ("held?", &self.held),
            ("keep_user", &self.keep_user),
            ("release", &self.release),
            ("release_stale", &self.release_stale),
            ("release_user", &self.release_user),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statement_has_its_table_names_filled_in() {
        let plain = Statements::new(None);
        let prefixed = Statements::new(Some("\"phoenix_kit\""));
        for (_, sql) in plain.all().iter().chain(prefixed.all().iter()) {
            assert!(!sql.contains('{'), "unfilled placeholder in {sql}");
        }
        assert!(prefixed
            .acquire
            .contains("\"phoenix_kit\".phoenix_kit_agent_conversations"));
        assert!(plain
            .acquire
            .contains(" phoenix_kit_agent_user_settings AS u"));
    }

    #[test]
    fn no_statement_names_updated_at_or_a_node_clock() {
        for (_, sql) in Statements::new(None).all() {
            assert!(!sql.contains("updated_at"), "{sql}");
            assert!(!sql.contains("clock_timestamp"), "{sql}");
            assert!(!sql.contains("$5"), "{sql}");
        }
    }
}
