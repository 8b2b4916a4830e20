//! The tables the locks live in: the DDL that makes them, and what the
//! statements must know of the tables a host really has.
//!
//! [`tables`] makes both tables from nothing; [`lock_columns`] only adds the
//! lock columns (and the unique index the user statements rely on) to tables
//! a host already has. Both are idempotent and take an optional schema,
//! quoted by [`quote_ident`]. `priv/schema.sql` is [`tables`]`(None)`, kept
//! equal by a test.
//!
//! A host's tables are not always the ones shipped here: an Ecto migration
//! makes `inserted_at`/`updated_at` `NOT NULL` without a database default,
//! may give the settings table a `uuid` key without one, and `busy_since`
//! may be `timestamp without time zone`. `Tables::from_catalog` reads the
//! catalog's answer (the `COLUMNS` statement of `sql.rs`, run once per pool)
//! and decides how the statements write their times and what a new settings
//! row needs besides its lock. It also refuses, as a `:config` error naming
//! the table, the column and the fix, what the statements would trip on
//! with a raw PostgreSQL error: a missing table, a key that is not a unique
//! `uuid`, a lock column of the wrong type, too short or `NOT NULL`.

use crate::error::{Error, Result};
use crate::row::{Row, Value};

/// The chat table's name.
pub const CHATS: &str = "phoenix_kit_agent_conversations";
/// The user settings table's name.
pub const USERS: &str = "phoenix_kit_agent_user_settings";

const TABLES: &str = "\
-- The tables of phoenix_kit_agent_locks. Idempotent: safe to run again.
-- busy_since / busy_turn_ref are a row's lock: free when busy_turn_ref is NULL.
{create_schema}CREATE TABLE IF NOT EXISTS {chats} (
  uuid uuid PRIMARY KEY,
  busy_since timestamptz,
  busy_turn_ref text
);

CREATE TABLE IF NOT EXISTS {users} (
  user_uuid uuid PRIMARY KEY,
  busy_since timestamptz,
  busy_turn_ref text,
  inserted_at timestamptz NOT NULL DEFAULT now(),
  updated_at timestamptz NOT NULL DEFAULT now()
);
";

const LOCK_COLUMNS: &str = "\
-- The lock columns for tables a host already has. Idempotent.
ALTER TABLE {chats}
  ADD COLUMN IF NOT EXISTS busy_since timestamptz,
  ADD COLUMN IF NOT EXISTS busy_turn_ref text;

ALTER TABLE {users}
  ADD COLUMN IF NOT EXISTS busy_since timestamptz,
  ADD COLUMN IF NOT EXISTS busy_turn_ref text;

-- acquire/4 and acquire_user/4 upsert ON CONFLICT (user_uuid).
CREATE UNIQUE INDEX IF NOT EXISTS phoenix_kit_agent_user_settings_user_uuid_lock_index ON {users} (user_uuid);
";

/// `name` as a quoted SQL identifier; safe for any text (a `"` is doubled).
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The two table names, qualified by `prefix` (quoted) when given.
pub(crate) fn table_names(prefix: Option<&str>) -> (String, String) {
    match prefix.map(quote_ident) {
        Some(schema) => (format!("{schema}.{CHATS}"), format!("{schema}.{USERS}")),
        None => (CHATS.to_owned(), USERS.to_owned()),
    }
}

/// `text` with its `{chats}` and `{users}` naming the tables under `prefix`.
pub(crate) fn name_tables(text: &str, prefix: Option<&str>) -> String {
    let (chats, users) = table_names(prefix);
    text.replace("{chats}", &chats).replace("{users}", &users)
}

/// The DDL that creates both tables (and the schema `prefix`, when given).
pub fn tables(prefix: Option<&str>) -> String {
    let create_schema =
        prefix.map(|p| format!("CREATE SCHEMA IF NOT EXISTS {};\n", quote_ident(p)));
    name_tables(TABLES, prefix).replace("{create_schema}", &create_schema.unwrap_or_default())
}

/// The DDL that adds only the lock columns to existing tables.
pub fn lock_columns(prefix: Option<&str>) -> String {
    name_tables(LOCK_COLUMNS, prefix)
}

/// The characters a `varchar(n)` `busy_turn_ref` must hold: the longest ref
/// a call takes ([`MAX_REF_BYTES`](crate::args::MAX_REF_BYTES)) has at most as
/// many characters as bytes, so `varchar(255)` (what Ecto's `:string` makes)
/// is the shortest that does. A shorter one would hold the refs the library
/// makes (37 bytes for `with_turn/4`, 38 for a click) and fail a host's
/// longer turn ref at the statement, with 22001.
pub const MAX_REF_CHARS: i64 = crate::args::MAX_REF_BYTES as i64;

/// What the catalog says of the two tables (the `COLUMNS` statement of
/// `sql.rs`): each one's columns, `None` for a table that does not exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Catalog {
    pub chats: Option<Vec<Column>>,
    pub users: Option<Vec<Column>>,
}

/// One column of either table, as the catalog describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Column {
    pub name: String,
    /// `pg_type.typname`: `timestamptz`, `timestamp`, `uuid`, `text`, …
    pub type_name: String,
    /// The type as SQL writes it (`format_type`): `character varying(10)`, `integer`, …
    pub sql_type: String,
    /// The `n` of a `varchar(n)` or `char(n)`; `None` for any other type.
    pub max_chars: Option<i64>,
    pub not_null: bool,
    /// A default, an identity or a generated column: the database fills it.
    pub has_default: bool,
    /// A valid unique index (or constraint) has this column as its only
    /// key, with no predicate: no two rows have the same value.
    pub unique: bool,
    /// The name of one of those that is deferrable: `ON CONFLICT (column)`
    /// fails while there is one.
    pub deferrable: Option<String>,
}

impl Catalog {
    /// The rows of the `COLUMNS` statement: one per column of a table that
    /// exists, one with `found` false (and NULLs) for a table that does not.
    pub fn from_rows(rows: &[Vec<Value>]) -> Result<Self> {
        let mut catalog = Catalog { chats: None, users: None };
        for row in rows {
            let table = if row.bool(0)? { &mut catalog.chats } else { &mut catalog.users };
            if !row.bool(1)? {
                continue;
            }
            let columns = table.get_or_insert_with(Vec::new);
            // A table without a single column comes as one row of NULLs.
            let Some(name) = row.text(2)? else { continue };
            columns.push(Column {
                name: name.to_owned(),
                type_name: row.str(3)?.to_owned(),
                sql_type: row.str(4)?.to_owned(),
                max_chars: row.int(5)?,
                not_null: row.bool(6)?,
                has_default: row.bool(7)?,
                unique: row.bool(8)?,
                deferrable: row.text(9)?.map(str::to_owned),
            });
        }
        Ok(catalog)
    }
}

/// What the statements need to know of the two tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tables {
    /// The chat table's name, qualified and quoted as the statements use it.
    pub chats: String,
    /// The user settings table's name, likewise.
    pub users: String,
    /// The database's time as the chat table's `busy_since` holds it.
    pub chat_now: &'static str,
    /// The database's time as the user table's `busy_since` holds it.
    pub user_now: &'static str,
    /// The other `NOT NULL` columns of the user table without a default,
    /// and what a new row gets in each: `(quoted column, expression)`.
    pub user_fills: Vec<(String, &'static str)>,
}

/// The database's time, as a column of type `type_name` holds it: a
/// `timestamp without time zone` (what Ecto's `timestamps()` and
/// `:utc_datetime` make) holds UTC, written and compared as UTC whatever the
/// session's `TimeZone`, so no connection needs a time zone pinned.
fn now_for(type_name: &str) -> Option<&'static str> {
    match type_name {
        "timestamptz" => Some("now()"),
        "timestamp" => Some("(now() AT TIME ZONE 'UTC')"),
        _ => None,
    }
}

/// What a new settings row gets in a `NOT NULL` column without a default:
/// the database's time in a timestamp, a random uuid in a `uuid` key (Ecto
/// generates those in the application, not in the database).
fn fill_for(type_name: &str) -> Option<&'static str> {
    now_for(type_name).or((type_name == "uuid").then_some("gen_random_uuid()"))
}

/// One of the two tables, as the checks of [`Tables::from_catalog`] see it.
struct Table<'a> {
    /// The name as the statements (and so every message) write it.
    name: &'a str,
    /// Its key column: `uuid` for the chat table, `user_uuid` for the other.
    key: &'static str,
    columns: &'a [Column],
}

impl<'a> Table<'a> {
    /// The table, or a `Config` error when the catalog did not find it.
    fn new(name: &'a str, key: &'static str, columns: &'a Option<Vec<Column>>) -> Result<Self> {
        let columns = columns.as_deref().ok_or_else(|| {
            Error::config(
                name,
                "no such table: create the tables (mix locks.setup, \
                 or Schema.statements(:tables, …) in a migration)",
            )
        })?;
        Ok(Table { name, key, columns })
    }

    fn error(&self, reason: String) -> Error {
        Error::config(self.name.to_owned(), reason)
    }

    fn column(&self, name: &str) -> Result<&'a Column> {
        self.columns.iter().find(|c| c.name == name).ok_or_else(|| {
            self.error(format!(
                "has no column {name}: add the lock columns \
                 (mix locks.setup --lock-columns, or Schema.statements(:lock_columns, …) in a migration)"
            ))
        })
    }

    /// The key: a `uuid`, one row per value. The user table's key is also
    /// the arbiter of the upserts (`ON CONFLICT (user_uuid)`), which fail
    /// with a deferrable unique index on it.
    fn check_key(&self, arbiter: bool) -> Result<()> {
        let (key, table) = (self.key, self.name);
        let Column { type_name, sql_type, unique, deferrable, .. } = self.column(key)?;
        if type_name != "uuid" {
            return Err(self.error(format!(
                "{key} is of type {sql_type}: it must be uuid \
                 (ALTER TABLE {table} ALTER COLUMN {key} TYPE uuid USING {key}::uuid)"
            )));
        }
        match (deferrable.as_deref().map(quote_ident), unique) {
            (_, false) if arbiter => Err(self.error(format!(
                "no unique index on {key} alone (not partial), which the upserts of \
                 acquire/4 and acquire_user/4 need (ON CONFLICT ({key})): add one \
                 (mix locks.setup --lock-columns, or CREATE UNIQUE INDEX ON {table} ({key}))"
            ))),
            (_, false) => Err(self.error(format!(
                "no unique index on {key} alone (not partial): a chat must be one row \
                 (ALTER TABLE {table} ADD PRIMARY KEY ({key}))"
            ))),
            (Some(name), true) if arbiter => Err(self.error(format!(
                "the unique constraint {name} on {key} is deferrable, and the upserts of \
                 acquire/4 and acquire_user/4 (ON CONFLICT ({key})) fail with one: replace it \
                 by a unique index (mix locks.setup --lock-columns, then ALTER TABLE {table} \
                 DROP CONSTRAINT {name})"
            ))),
            _ => Ok(()),
        }
    }

    /// The lock columns: both nullable (a free lock is NULL), `busy_since`
    /// a timestamp, `busy_turn_ref` text that holds every ref; the
    /// database's time as `busy_since` holds it.
    fn check_lock(&self) -> Result<&'static str> {
        let table = self.name;
        let since = self.column("busy_since")?;
        let holder = self.column("busy_turn_ref")?;
        let (since_type, holder_type) = (&since.sql_type, &holder.sql_type);
        let Some(now) = now_for(&since.type_name) else {
            return Err(self.error(format!(
                "busy_since is of type {since_type}: it must be timestamptz or timestamp"
            )));
        };
        if !["text", "varchar"].contains(&holder.type_name.as_str()) {
            return Err(self.error(format!(
                "busy_turn_ref is of type {holder_type}: it must be text \
                 (ALTER TABLE {table} ALTER COLUMN busy_turn_ref TYPE text)"
            )));
        }
        // A varchar's `n`, if it has one (a text has none).
        if holder.max_chars.is_some_and(|n| n < MAX_REF_CHARS) {
            return Err(self.error(format!(
                "busy_turn_ref is of type {holder_type}, too short for a ref \
                 (up to {MAX_REF_CHARS} bytes): it must be text or varchar({MAX_REF_CHARS}) \
                 or longer (ALTER TABLE {table} ALTER COLUMN busy_turn_ref TYPE text)"
            )));
        }
        if let Some(Column { name, .. }) = [since, holder].into_iter().find(|c| c.not_null) {
            return Err(self.error(format!(
                "{name} is NOT NULL, and a free lock is NULL \
                 (ALTER TABLE {table} ALTER COLUMN {name} DROP NOT NULL)"
            )));
        }
        Ok(now)
    }
}

impl Tables {
    /// Checks both tables (those named under `prefix`) as the catalog
    /// describes them, and decides what the statements write. Each mistake
    /// the statements would trip on is a [`Error::Config`] naming the table,
    /// the column and the fix.
    pub fn from_catalog(prefix: Option<&str>, catalog: &Catalog) -> Result<Self> {
        let (chats, users) = table_names(prefix);
        let chat_table = Table::new(&chats, "uuid", &catalog.chats)?;
        let user_table = Table::new(&users, "user_uuid", &catalog.users)?;
        chat_table.check_key(false)?;
        let chat_now = chat_table.check_lock()?;
        user_table.check_key(true)?;
        let user_now = user_table.check_lock()?;

        let mut user_fills = Vec::new();
        let key_and_lock = ["user_uuid", "busy_since", "busy_turn_ref"];
        let needs_fill =
            |c: &&Column| c.not_null && !c.has_default && !key_and_lock.contains(&c.name.as_str());
        for column in user_table.columns.iter().filter(needs_fill) {
            let name = quote_ident(&column.name);
            let Some(fill) = fill_for(&column.type_name) else {
                return Err(user_table.error(format!(
                    "column {name} is NOT NULL without a default, and a new settings row \
                     cannot fill a {}: give it a default \
                     (ALTER TABLE {users} ALTER COLUMN {name} SET DEFAULT …)",
                    column.sql_type
                )));
            };
            user_fills.push((name, fill));
        }
        Ok(Tables { chats, users, chat_now, user_now, user_fills })
    }
}
