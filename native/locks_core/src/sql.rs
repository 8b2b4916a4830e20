//! Every statement the library runs, one constant per public call.
//!
//! Rules every lock statement keeps:
//!
//! * **One statement, autocommit.** A call is one round trip; there is no
//!   transaction to leave open and no advisory lock to hold a connection for
//!   the length of a turn. What must be all-or-nothing is chained inside the
//!   statement (data-modifying CTEs reading each other's `RETURNING`). So a
//!   statement that failed changed nothing, and one rolled back by a
//!   serialization failure or a deadlock can simply be sent again.
//! * **The database's clock.** Every time is `now()`, as the column holds
//!   it: `{chat_now}` and `{user_now}` are `now()` for a `timestamptz`
//!   column and `(now() AT TIME ZONE 'UTC')` for a `timestamp without time
//!   zone` one (see `schema.rs`), so the answers do not depend on the
//!   session's `TimeZone` and no connection needs one pinned. A node's clock
//!   never enters a comparison.
//! * **Ownership in every write.** A lock is only freed, re-dated or taken
//!   over by a predicate on `busy_turn_ref` inside the same statement.
//! * **Locks in one order: chat row, then user row.** Statements that touch
//!   both make the user row's part depend on the chat row's part, so two calls
//!   never wait on each other in a cycle.
//! * **`updated_at` is never changed**: a settings row keeps the time its
//!   settings last changed. Only a new row gets one, among `{fill_columns}`
//!   (the host's `NOT NULL` columns without a default).
//! * **No long wait on another session's row lock.** A row that another
//!   transaction holds (a fenced write under way, a host's own transaction,
//!   a psql left open) is the lock being busy right now, not a reason to
//!   wait. The takers ([`ACQUIRE`], [`ACQUIRE_USER`]) lock what they may
//!   take `SKIP LOCKED` and answer busy at once, naming the holder their
//!   snapshot saw committed. Every statement that writes sets `lock_timeout`
//!   to [`ROW_WAIT`] for itself alone (`{wait}`: a `set_config(…, true)`,
//!   which ends with the statement's transaction) in the `WHERE` of the
//!   first row it may wait for, which PostgreSQL evaluates before it locks
//!   that row (the takers' `SKIP LOCKED` locks come before it, and wait for
//!   nothing). So a lock that outlasts it (on a row the statement could not
//!   skip: its holder's own renewal and release, a new settings row another
//!   transaction is inserting) fails the statement with `55P03`, which
//!   changed nothing; [`Job::locked`](crate::Job::locked) says what that
//!   answers. Rows are locked `FOR NO KEY UPDATE`, the strength of an
//!   `UPDATE` that keeps the key: a foreign key's `FOR KEY SHARE` (a host's
//!   transaction inserting a message of the chat) does not conflict with it.
//! * **Any isolation level.** Under READ COMMITTED a statement that waited
//!   for a row re-checks its predicate on the row's newest version; under
//!   REPEATABLE READ or SERIALIZABLE it fails with 40001 instead, and the
//!   pool sends it again (see `pool.rs`).
//!
//! A lock is *free for ref `r`* when its ref is NULL, its `busy_since` is NULL
//! or older than the TTL, or it is already `r`'s (taking a lock you hold again
//! re-dates it; it never steals). That predicate, and the age comparison
//! within it (`stale!`, the take-over predicate), are written once, as the
//! macros below, and every statement is composed from them with `concat!`:
//! each is still one `&'static str` constant. `{chats}` and `{users}` stand for the two
//! table names, optionally schema-qualified; [`Statements::new`] fills every
//! placeholder in once per pool.
//!
//! Parameters are cast in the text and their types listed with each
//! statement ([`Def::params`]): a prepared statement gets them at `PREPARE`,
//! an unnamed one (behind PgBouncer) sends them with every call.

use std::time::Duration;

use tokio_postgres::types::Type;

use crate::error::{Error, Result};
use crate::schema::{name_tables, Tables};

/// The longest a lock statement waits for one lock that another session's
/// transaction holds: its `lock_timeout` (`{wait}`, see the module doc). A
/// row may cost two waits (the row's queue, then its holder), and a
/// statement writes at most two rows, so a statement gives up within four
/// times this, 1 s: far below a call's `statement_timeout`, so that a held
/// row is answered as contention, and a slot of the pool is never held long.
pub const ROW_WAIT: Duration = Duration::from_millis(250);

/// A statement: its name (the Elixir function that runs it, and the key of
/// its prepared statement), its text with placeholders, its parameters' types.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Def {
    pub name: &'static str,
    pub text: &'static str,
    pub params: &'static [Type],
}

/// The take-over predicate, the one place where a lock's age is judged:
/// `stale!` is true when the lock of row `$row` (`"c."`, `"u."` or `""`) is
/// older than the TTL `$ttl` (an `int4` parameter) by the clock `$now`
/// (`"{chat_now}"` or `"{user_now}"`), so another ref may take it over;
/// `fresh!` is its exact negation for a lock that has a `busy_since` (`>=`
/// against `<` on the same bound). Every statement that asks whether a lock
/// may be taken over (`free!`, [`RELEASE_STALE`], [`HELD_LOCKS`]) or is still
/// fresh ([`FRESH`], [`KEEP`]) is composed from them, so those answers can
/// never disagree.
macro_rules! age {
    ($row:literal, $op:literal, $now:literal, $ttl:literal) => {
        concat!($row, "busy_since ", $op, " ", $now, " - ", $ttl, "::int4 * interval '1 second'")
    };
}

macro_rules! stale {
    ($row:literal, $now:literal, $ttl:literal) => {
        age!($row, "<", $now, $ttl)
    };
}

macro_rules! fresh {
    ($row:literal, $now:literal, $ttl:literal) => {
        age!($row, ">=", $now, $ttl)
    };
}

/// The lock of `$row` is *free for ref `$r`*: no holder, already `$r`'s
/// (taking it again re-dates it), no `busy_since`, or `stale!`.
#[rustfmt::skip]
macro_rules! free {
    ($row:literal, $r:literal, $now:literal, $ttl:literal) => {
        concat!("(", $row, "busy_turn_ref IS NULL OR ", $row, "busy_turn_ref = ", $r, " OR ",
                $row, "busy_since IS NULL\n    OR ", stale!($row, $now, $ttl), ")")
    };
}

/// The `busy_since` of a lock taken or kept with a hold: `$now` dated back
/// by `$ttl - $hold` seconds, so that a taker judging by the TTL `$ttl` may
/// take it over `$hold` seconds from now (with `$hold = $ttl`, now).
macro_rules! dated {
    ($now:literal, $ttl:literal, $hold:literal) => {
        concat!($now, " - (", $ttl, "::int4 - ", $hold, "::int4) * interval '1 second'")
    };
}

/// The conflict arm of the user row's upsert, [`ACQUIRE`]'s and
/// [`ACQUIRE_USER`]'s: the existing row's lock is taken (with the row's
/// inserted values) when `free!` for `$r`, and otherwise written back
/// unchanged, so that `RETURNING` names its current holder even when that
/// holder's row is newer than the statement's snapshot.
#[rustfmt::skip]
macro_rules! take_user {
    ($r:literal, $ttl:literal) => {
        concat!("ON CONFLICT (user_uuid) DO UPDATE SET
  busy_since = CASE WHEN ", free!("u.", $r, "{user_now}", $ttl), "
    THEN EXCLUDED.busy_since ELSE u.busy_since END,
  busy_turn_ref = CASE WHEN ", free!("u.", $r, "{user_now}", $ttl), "
    THEN EXCLUDED.busy_turn_ref ELSE u.busy_turn_ref END")
    };
}

/// `seen`, the user row `$id` as the statement's snapshot has it: its
/// committed holder (`''` for none), whoever holds the row itself.
macro_rules! user_seen {
    ($id:literal) => {
        concat!(
            "seen AS (
  SELECT coalesce(u.busy_turn_ref, '') AS holder FROM {users} u WHERE u.user_uuid = ",
            $id,
            "::uuid
)"
        )
    };
}

/// Takes the chat's and the user's lock for a turn, or neither.
///
/// `$1` chat uuid, `$2` user uuid, `$3` turn ref, `$4` TTL, `$5` hold, both
/// in seconds (`$5` at most `$4`; `acquire/4` passes the TTL as the hold).
/// Both locks are dated `$4 - $5` seconds into the past, as a click's are
/// (see [`ACQUIRE_USER`]): a taker judging staleness by the TTL `$4` takes
/// them over `$5` seconds after this call (or the last [`KEEP`]), should
/// they never be released. With `$5 = $4` they are dated now.
///
/// 1. `chat` locks the chat row (`FOR NO KEY UPDATE SKIP LOCKED`) only if it is
///    free for `$3`; under READ COMMITTED the predicate is re-checked on the
///    newest version of a row another statement changed meanwhile, so of
///    racing turns exactly one gets the row. A row another session holds is
///    skipped, as is a uuid with no row: `chat` is empty, the chat is busy.
/// 2. `seen` is the user row as the snapshot has it (committed), `mine` the
///    same row locked (`SKIP LOCKED`, after the chat row: `FROM chat`).
/// 3. `usr` runs only with a locked chat row, and only when the user row is
///    `mine` or has none yet. It creates the settings row if missing, and
///    otherwise writes the lock back either as `$3`'s (when free) or
///    unchanged, so that `RETURNING` names the current holder. A user row
///    another session holds is left alone: its holder is `seen`'s.
/// 4. `took` writes the chat row only when `usr` reports `$3` as the holder:
///    a refused user lock leaves the chat exactly as it was.
///
/// Returns one row: `acquired` (both taken) and `user_holder`, the user
/// lock's holder (`''` for none, in a row another session holds), or NULL
/// when the chat was busy and the user row never looked at.
#[rustfmt::skip]
pub(crate) const ACQUIRE: Def = Def {
    name: "acquire",
    text: concat!("
WITH chat AS (
  SELECT c.uuid FROM {chats} c
  WHERE c.uuid = $1::uuid
    AND ", free!("c.", "$3::text", "{chat_now}", "$4"), "
  FOR NO KEY UPDATE SKIP LOCKED
),
", user_seen!("$2"), ",
mine AS (
  SELECT 1 FROM {users} u WHERE u.user_uuid = $2::uuid AND EXISTS (SELECT 1 FROM chat)
  FOR NO KEY UPDATE SKIP LOCKED
),
usr AS (
  INSERT INTO {users} AS u (user_uuid, busy_since, busy_turn_ref{fill_columns})
  SELECT $2::uuid, ", dated!("{user_now}", "$4", "$5"), ",
         $3::text{fill_values} FROM chat
  WHERE {wait} AND (EXISTS (SELECT 1 FROM mine) OR NOT EXISTS (SELECT 1 FROM seen))
  ", take_user!("$3::text", "$4"), "
  RETURNING u.busy_turn_ref AS holder
),
took AS (
  UPDATE {chats} c
  SET busy_since = ", dated!("{chat_now}", "$4", "$5"), ", busy_turn_ref = $3::text
  WHERE c.uuid = (SELECT uuid FROM chat)
    AND (SELECT holder FROM usr) = $3::text
  RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM took) AS acquired,
  CASE WHEN EXISTS (SELECT 1 FROM chat)
    THEN coalesce((SELECT holder FROM usr), (SELECT holder FROM seen)) END AS user_holder"),
    params: &[Type::UUID, Type::UUID, Type::TEXT, Type::INT4, Type::INT4],
};

/// Takes the user's lock alone for a click, dated back by `ttl - hold`.
///
/// `$1` user uuid, `$2` click ref, `$3` TTL, `$4` hold, both in seconds.
///
/// One upsert: the row is created if missing, else the lock is taken when it
/// is free for `$2` (another holder's lock older than `$3`). Dating the lock
/// `$3 - $4` seconds into the past makes a turn (which takes over after `$3`)
/// take it `$4` seconds after this call, should the click never release it.
/// As in [`ACQUIRE`], the row is locked `SKIP LOCKED` first (`mine`): a
/// refused row is written back unchanged so that `RETURNING` names the
/// current holder, even one newer than the snapshot, and a row another
/// session holds is left alone, its holder `seen`'s. Returns one row: the
/// holder (`''` for none).
#[rustfmt::skip]
pub(crate) const ACQUIRE_USER: Def = Def {
    name: "acquire_user",
    text: concat!("
WITH ", user_seen!("$1"), ",
mine AS (
  SELECT 1 FROM {users} u WHERE u.user_uuid = $1::uuid FOR NO KEY UPDATE SKIP LOCKED
),
usr AS (
  INSERT INTO {users} AS u (user_uuid, busy_since, busy_turn_ref{fill_columns})
  SELECT $1::uuid, ", dated!("{user_now}", "$3", "$4"), ", $2::text{fill_values}
  WHERE {wait} AND (EXISTS (SELECT 1 FROM mine) OR NOT EXISTS (SELECT 1 FROM seen))
  ", take_user!("$2::text", "$3"), "
  RETURNING u.busy_turn_ref AS holder
)
SELECT coalesce((SELECT holder FROM usr), (SELECT holder FROM seen)) AS holder"),
    params: &[Type::UUID, Type::TEXT, Type::INT4, Type::INT4],
};

/// Whether the chat's lock is `$2`'s and not older than `$3` seconds.
///
/// `$1` chat uuid, `$2` turn ref, `$3` TTL. "Fresh" is the exact negation of
/// the take-over predicate (`busy_since < now() - ttl`): a fresh lock cannot
/// be taken over, a lock that is not fresh can. Returns one row: the answer.
#[rustfmt::skip]
pub(crate) const FRESH: Def = Def {
    name: "fresh?",
    text: concat!("
SELECT EXISTS (
  SELECT 1 FROM {chats}
  WHERE uuid = $1::uuid AND busy_turn_ref = $2::text
    AND ", fresh!("", "{chat_now}", "$3"), "
)"),
    params: &[Type::UUID, Type::TEXT, Type::INT4],
};

/// Whether `$3` holds both the chat's (`$1`) and the user's (`$2`) lock.
///
/// Both rows are read from one snapshot, so the answer is true of one
/// moment. Returns one row: the answer.
pub(crate) const HELD: Def = Def {
    name: "held?",
    text: "
SELECT EXISTS (SELECT 1 FROM {chats} WHERE uuid = $1::uuid AND busy_turn_ref = $3::text)
   AND EXISTS (SELECT 1 FROM {users} WHERE user_uuid = $2::uuid AND busy_turn_ref = $3::text)",
    params: &[Type::UUID, Type::UUID, Type::TEXT],
};

/// The fence of `Locks.transaction/4`: the first statement of a transaction
/// of the host's repo, which commits the caller's writes only while the turn
/// `$3` holds both locks, bounded by the turn's lease `$4`.
/// Not run by the pool: its text goes to the host ([`fence`]), which runs it
/// with its own transaction.
///
/// `$1` chat uuid, `$2` user uuid, `$3` turn ref, `$4` the lease in
/// milliseconds. `chat` then `usr` take the two rows `FOR SHARE`, each only
/// where `busy_turn_ref` is `$3` (the rule of [`HELD`]), the chat row first,
/// as every statement orders them. A row lock `FOR SHARE` conflicts with
/// `FOR NO KEY UPDATE`, the lock of an `UPDATE` of non-key columns and of
/// the lock statements (`FOR KEY SHARE` would not), so until the
/// transaction ends no take-over ([`ACQUIRE`]'s row locks and
/// upsert, [`ACQUIRE_USER`], [`RELEASE`], [`RELEASE_STALE`], and the turn's
/// own [`KEEP`]) can write either row: the takers skip them and answer busy,
/// the others wait [`ROW_WAIT`] and fail with `55P03`. A take-over
/// committed first is seen: under READ COMMITTED the fence waits for a
/// writer under way and re-checks `$3` on the row's newest version (no row,
/// the turn lost it); under REPEATABLE READ or SERIALIZABLE it fails with
/// 40001 instead, and the transaction with it. So no write of the
/// transaction commits after another holder took either lock. No time is
/// compared: a lease that ran out but was not taken over still holds.
///
/// `{bound}` (the pool's mode; nothing under the sandbox, whose transaction
/// outlives the fence) sets, for the rest of the transaction, `$4` as its
/// `lock_timeout`, `statement_timeout`, `idle_in_transaction_session_timeout`
/// and, from PostgreSQL 17, `transaction_timeout`, in the `WHERE` of the
/// chat row before it is locked. So the fence gives up on a lock after a
/// lease, each later statement runs at most a lease, and a transaction
/// whose caller stalls (a stopped VM, a `fun` that waits) is ended by the
/// server a lease after it went idle: its writes roll back and the rows are
/// free. From PostgreSQL 17 the whole transaction lives at most a lease
/// after the fence; before, one that keeps running statements is not
/// bounded as a whole. Returns one row: `held`, whether it holds both (then both rows
/// are locked until the transaction ends).
#[rustfmt::skip]
pub(crate) const FENCE: Def = Def {
    name: "transaction",
    text: "
WITH chat AS (
  SELECT 1 FROM {chats} c WHERE c.uuid = $1::uuid AND c.busy_turn_ref = $3::text{bound}
  FOR SHARE
),
usr AS (
  SELECT 1 FROM {users} u WHERE u.user_uuid = $2::uuid AND u.busy_turn_ref = $3::text
    AND EXISTS (SELECT 1 FROM chat)
  FOR SHARE
)
SELECT EXISTS (SELECT 1 FROM usr) AS held",
    params: &[Type::UUID, Type::UUID, Type::TEXT, Type::INT4],
};

/// [`FENCE`]'s `{bound}`: each timeout set to `$4` for the transaction.
#[rustfmt::skip]
const FENCE_BOUND: &str = "
    AND set_config('lock_timeout', $4::int4::text, true) IS NOT NULL
    AND set_config('statement_timeout', $4::int4::text, true) IS NOT NULL
    AND set_config('idle_in_transaction_session_timeout', $4::int4::text, true) IS NOT NULL
    AND set_config({tt}, $4::int4::text || left(set_config({tt}, '0', true), 0), true) IS NOT NULL";

/// `transaction_timeout` from PostgreSQL 17 (set to 0 first: a timer already
/// running would otherwise keep its own, longer, time), else a setting set
/// anyway.
const TRANSACTION_TIMEOUT: &str = "CASE WHEN current_setting('server_version_num')::int4 >= 170000
      THEN 'transaction_timeout' ELSE 'lock_timeout' END";

/// [`FENCE`]'s text for the tables under `prefix` (quoted, as every
/// statement names them), `bounded` by the lease (`$4`) or not (then it
/// takes the first three parameters alone). It needs only the tables'
/// names, so it is known before the tables are read, in either mode.
pub fn fence(prefix: Option<&str>, bounded: bool) -> String {
    let bound = FENCE_BOUND.replace("{tt}", TRANSACTION_TIMEOUT);
    name_tables(FENCE.text, prefix).replace("{bound}", if bounded { &bound } else { "" })
}

/// Re-dates a click's lock as if taken now, only while `$2` still holds it.
///
/// `$1` user uuid, `$2` click ref, `$3` TTL, `$4` hold. Returns a row when
/// the click held it (`true`), none when it had been released or taken over.
#[rustfmt::skip]
pub(crate) const KEEP_USER: Def = Def {
    name: "keep_user",
    text: concat!("
UPDATE {users} SET busy_since = ", dated!("{user_now}", "$3", "$4"), "
WHERE user_uuid = $1::uuid AND busy_turn_ref = $2::text AND {wait}
RETURNING 1"),
    params: &[Type::UUID, Type::TEXT, Type::INT4, Type::INT4],
};

/// Re-dates both locks of a turn as if taken now (with [`ACQUIRE`]'s hold):
/// its lease, renewed.
///
/// `$1` chat uuid, `$2` user uuid, `$3` turn ref, `$4` TTL, `$5` hold, in
/// seconds. Both locks are dated `$4 - $5` seconds into the past, so a taker
/// with the TTL `$4` takes them over `$5` seconds after this statement's
/// `now()`, which is no earlier than the moment it was sent: a holder that
/// counts its lease from that moment learns it lost it first. Only while `$3`
/// holds both and neither is older than `$4` (exactly what "not yet
/// takeable" means): a lease that expired is not revived (another turn may
/// take it over any moment), and a turn that lost one of its locks does not
/// keep the other. `chat` then `usr` lock both rows (`FOR NO KEY UPDATE`, the chat
/// row first) with the predicate re-checked on their newest versions, and
/// the two updates run only when both rows qualified, so both are re-dated
/// or neither. Returns one row: whether they were.
#[rustfmt::skip]
pub(crate) const KEEP: Def = Def {
    name: "keep",
    text: concat!("
WITH chat AS (
  SELECT c.uuid FROM {chats} c
  WHERE c.uuid = $1::uuid AND c.busy_turn_ref = $3::text
    AND ", fresh!("c.", "{chat_now}", "$4"), " AND {wait}
  FOR NO KEY UPDATE
),
usr AS (
  SELECT u.user_uuid FROM {users} u
  WHERE u.user_uuid = $2::uuid AND u.busy_turn_ref = $3::text
    AND ", fresh!("u.", "{user_now}", "$4"), "
    AND EXISTS (SELECT 1 FROM chat)
  FOR NO KEY UPDATE
),
kept_chat AS (
  UPDATE {chats} SET busy_since = ", dated!("{chat_now}", "$4", "$5"), "
  WHERE uuid = (SELECT uuid FROM chat) AND EXISTS (SELECT 1 FROM usr)
  RETURNING 1
),
kept_user AS (
  UPDATE {users} SET busy_since = ", dated!("{user_now}", "$4", "$5"), "
  WHERE user_uuid = (SELECT user_uuid FROM usr) AND EXISTS (SELECT 1 FROM chat)
  RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM kept_chat) AND EXISTS (SELECT 1 FROM kept_user)"),
    params: &[Type::UUID, Type::UUID, Type::TEXT, Type::INT4, Type::INT4],
};

/// Frees whichever of the two locks `$3` still holds.
///
/// `$1` chat uuid, `$2` user uuid, `$3` turn ref. Each lock is freed only by
/// its holder's ref, so a late release never frees a newer turn's lock. The
/// user row's update waits for the chat row's (the `(SELECT count(*) FROM
/// chat)` term) to keep the chat-then-user lock order. Returns no rows.
pub(crate) const RELEASE: Def = Def {
    name: "release",
    text: "
WITH chat AS (
  UPDATE {chats} SET busy_since = NULL, busy_turn_ref = NULL
  WHERE uuid = $1::uuid AND busy_turn_ref = $3::text AND {wait}
  RETURNING 1
)
UPDATE {users} SET busy_since = NULL, busy_turn_ref = NULL
WHERE user_uuid = $2::uuid AND busy_turn_ref = $3::text AND {wait}
  AND (SELECT count(*) FROM chat) >= 0",
    params: &[Type::UUID, Type::UUID, Type::TEXT],
};

/// Frees a lost turn's locks: only while the chat's lock is still `$3`'s and
/// older than `$4` seconds.
///
/// `$1` chat uuid, `$2` user uuid, `$3` turn ref, `$4` TTL. Of two racing
/// callers the second waits on the chat row, re-checks the predicate on the
/// freed row and matches nothing: exactly one sees `released = true`. The
/// user's lock goes in the same statement, only if this call freed the chat
/// and `$3` still holds it. Returns one row: `released`.
#[rustfmt::skip]
pub(crate) const RELEASE_STALE: Def = Def {
    name: "release_stale",
    text: concat!("
WITH chat AS (
  UPDATE {chats} SET busy_since = NULL, busy_turn_ref = NULL
  WHERE uuid = $1::uuid AND busy_turn_ref = $3::text
    AND ", stale!("", "{chat_now}", "$4"), " AND {wait}
  RETURNING 1
),
usr AS (
  UPDATE {users} SET busy_since = NULL, busy_turn_ref = NULL
  WHERE user_uuid = $2::uuid AND busy_turn_ref = $3::text
    AND EXISTS (SELECT 1 FROM chat)
  RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM chat) AS released, (SELECT count(*) FROM usr) AS users"),
    params: &[Type::UUID, Type::UUID, Type::TEXT, Type::INT4],
};

/// Frees the user's lock if `$2` still holds it. `$1` user uuid. Returns no rows.
pub(crate) const RELEASE_USER: Def = Def {
    name: "release_user",
    text: "
UPDATE {users} SET busy_since = NULL, busy_turn_ref = NULL
WHERE user_uuid = $1::uuid AND busy_turn_ref = $2::text AND {wait}",
    params: &[Type::UUID, Type::TEXT],
};

/// [`HELD_LOCKS`]' rows of one table: `$kind`, its key `$id`, by its clock `$now`.
#[rustfmt::skip]
macro_rules! held {
    ($kind:literal, $id:literal, $table:literal, $now:literal) => {
        concat!("SELECT ", $kind, " AS kind, ", $id, "::text AS id, busy_turn_ref::text AS ref,
         (extract(epoch FROM s.busy_since) * 1000000)::int8 AS since,
         extract(epoch FROM ", $now, " - s.busy_since)::float8 AS age,
         coalesce(", stale!("s.", $now, "$1"), ", true) AS stale
  FROM ", $table, ", LATERAL (SELECT CASE WHEN isfinite(busy_since)
    AND busy_since < '10000-01-01 00:00:00+00' THEN busy_since END AS busy_since) s
  WHERE busy_turn_ref IS NOT NULL")
    };
}

/// Every lock taken, for an operator to see what is stuck: chats and users
/// whose `busy_turn_ref` names a holder, the oldest first, at most 1000 (a
/// listing for a person, not an export).
///
/// `$1` the TTL to judge staleness by: `stale` is the take-over predicate
/// (`stale!`, or no `busy_since`). `since` is microseconds since the Unix
/// epoch (a naive `busy_since` holds UTC); `age` is seconds by the
/// database's clock. A read: it changes nothing.
///
/// A row's `busy_since` is read (as `s.busy_since`) only when a caller can
/// represent it: finite and before the year 10000 (Elixir's `DateTime` ends
/// with 9999; PostgreSQL's begins after Elixir's does). Any other
/// (`infinity`, `-infinity`, the year 12000) is read as no `busy_since`:
/// `since` and `age` NULL and `stale` true, so that one bad row is listed,
/// first, instead of failing the statement (`now() - 'infinity'` and an
/// infinite epoch cast to `int8` raise) or its reading. Such a lock's age is
/// unknown: `stale` then asks for a look, not that a taker would take it
/// (one dated `-infinity` is taken, one dated `infinity` never is). The
/// bound's zone (`+00`) is ignored against a `timestamp` column and read as
/// UTC against a `timestamptz` one, so it is the same instant whatever the
/// session's `TimeZone`.
#[rustfmt::skip]
pub(crate) const HELD_LOCKS: Def = Def {
    name: "held_locks",
    text: concat!("
SELECT * FROM (
  ", held!("'chat'", "uuid", "{chats}", "{chat_now}"), "
  UNION ALL
  ", held!("'user'", "user_uuid", "{users}", "{user_now}"), "
) held
ORDER BY age DESC NULLS FIRST, kind, id
LIMIT 1000"),
    params: &[Type::INT4],
};

/// What the catalog says of both tables, as [`Catalog::from_rows`] reads
/// it and [`Tables::from_catalog`] checks it; run once per pool, before its
/// first lock statement.
///
/// `$1` the chat table's name, `$2` the user table's, each quoted and
/// qualified as the lock statements write them, so they resolve the same
/// way (`search_path` and all). `to_regclass` makes a table that does not
/// exist one row with `found` false (and NULLs), where a cast to `regclass`
/// would fail with 42P01. One row per column otherwise: its type (the
/// `varchar(n)`'s `n` from `atttypmod`, which is `n + 4`), whether the
/// database fills it, whether a unique index has it as its only key with no
/// predicate (`is_unique`; an index's `INCLUDE` columns are not keys), and
/// the name of one of those that is deferrable (`deferrable`): `ON CONFLICT
/// (column)` takes every such index as an arbiter and fails, at the first
/// insert, when one is deferrable; it never takes a partial one.
///
/// [`Catalog::from_rows`]: crate::schema::Catalog::from_rows
pub(crate) const COLUMNS: Def = Def {
    name: "columns",
    text: "
WITH t (chats, oid) AS (VALUES (true, to_regclass($1::text)), (false, to_regclass($2::text)))
SELECT t.chats, t.oid IS NOT NULL AS found, a.attname::text AS name,
       ty.typname::text AS type_name, format_type(a.atttypid, a.atttypmod) AS sql_type,
       CASE WHEN ty.typname IN ('varchar', 'bpchar') AND a.atttypmod >= 4
            THEN (a.atttypmod - 4)::int8 END AS max_chars,
       a.attnotnull AS not_null,
       (a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> '') AS has_default,
       i.is_unique, i.deferrable
FROM t
LEFT JOIN (pg_catalog.pg_attribute a JOIN pg_catalog.pg_type ty ON ty.oid = a.atttypid)
  ON a.attrelid = t.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN LATERAL (
  SELECT count(*) > 0 AS is_unique,
         min(c.relname::text) FILTER (WHERE NOT x.indimmediate) AS deferrable
  FROM pg_catalog.pg_index x JOIN pg_catalog.pg_class c ON c.oid = x.indexrelid
  WHERE x.indrelid = a.attrelid AND x.indisunique AND x.indisvalid
    AND x.indpred IS NULL AND x.indexprs IS NULL
    AND x.indnkeyatts = 1 AND x.indkey[0] = a.attnum
) i ON true
ORDER BY t.chats DESC, a.attnum",
    params: &[Type::TEXT, Type::TEXT],
};

/// The lock statements, one per job.
pub(crate) const LOCKS: [&Def; 10] = [
    &ACQUIRE,
    &ACQUIRE_USER,
    &FRESH,
    &HELD,
    &KEEP,
    &KEEP_USER,
    &HELD_LOCKS,
    &RELEASE,
    &RELEASE_STALE,
    &RELEASE_USER,
];

impl Def {
    /// The text with the placeholders filled in for `tables`; `{wait}` as
    /// [`ROW_WAIT`] when `bounded` (the pool), as nothing under the sandbox,
    /// whose transaction the setting would outlive each statement in.
    pub fn fill(&self, tables: &Tables, bounded: bool) -> String {
        let fill = |(column, value): &(String, &str)| (format!(", {column}"), format!(", {value}"));
        let (columns, values): (String, String) = tables.user_fills.iter().map(fill).unzip();
        let wait = if bounded {
            format!("set_config('lock_timeout', '{}', true) IS NOT NULL", ROW_WAIT.as_millis())
        } else {
            "true".to_owned()
        };
        self.text
            .replace("{chats}", &tables.chats)
            .replace("{users}", &tables.users)
            .replace("{chat_now}", tables.chat_now)
            .replace("{user_now}", tables.user_now)
            .replace("{fill_columns}", &columns)
            .replace("{fill_values}", &values)
            .replace("{wait}", &wait)
    }
}

/// The texts of the lock statements, filled in once for a pool's tables,
/// each by its statement's name (the key of its prepared statement on each
/// connection).
#[derive(Debug)]
pub(crate) struct Statements(Vec<(&'static str, String)>);

impl Statements {
    /// Fills the placeholders in for `tables`, `bounded` or not (see [`Def::fill`]).
    pub fn new(tables: &Tables, bounded: bool) -> Self {
        Statements(LOCKS.iter().map(|def| (def.name, def.fill(tables, bounded))).collect())
    }

    /// The text of `def`, one of [`LOCKS`].
    pub fn get(&self, def: &Def) -> Result<&str> {
        // Every job's statement is one of LOCKS: every call of tests/smoke.rs
        // and of the contract suite runs its own.
        let found = self.0.iter().find(|(name, _)| *name == def.name);
        found.map(|(_, text)| text.as_str()).ok_or_else(|| Error::unexpected(def.name))
    }
}
