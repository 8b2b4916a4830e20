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
//! may be `timestamp without time zone`. `Tables::from_columns` reads the
//! catalog's answer (the `COLUMNS` statement of `sql.rs`, run once per pool)
//! and decides how the statements write their times and what a new settings
//! row needs besides its lock.

use crate::error::{Error, Result};

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

/// The DDL that creates both tables (and the schema `prefix`, when given).
pub fn tables(prefix: Option<&str>) -> String {
    let (chats, users) = table_names(prefix);
    let create_schema = match prefix {
        Some(schema) => format!("CREATE SCHEMA IF NOT EXISTS {};\n", quote_ident(schema)),
        None => String::new(),
    };
    TABLES
        .replace("{create_schema}", &create_schema)
        .replace("{chats}", &chats)
        .replace("{users}", &users)
}

/// The DDL that adds only the lock columns to existing tables.
pub fn lock_columns(prefix: Option<&str>) -> String {
    let (chats, users) = table_names(prefix);
    LOCK_COLUMNS.replace("{chats}", &chats).replace("{users}", &users)
}

/// One column of either table, as the catalog describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Column {
    /// `true` for the chat table, `false` for the user settings table.
    pub chats: bool,
    pub name: String,
    /// `pg_type.typname`: `timestamptz`, `timestamp`, `uuid`, `text`, …
    pub type_name: String,
    pub not_null: bool,
    /// A default, an identity or a generated column: the database fills it.
    pub has_default: bool,
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
    now_for(type_name).or(match type_name {
        "uuid" => Some("gen_random_uuid()"),
        _ => None,
    })
}

impl Tables {
    /// Checks the columns of both tables (for the tables named under
    /// `prefix`) and decides what the statements write.
    pub fn from_columns(prefix: Option<&str>, columns: &[Column]) -> Result<Self> {
        let (chats, users) = table_names(prefix);
        let find = |in_chats: bool, table: &str, name: &str| {
            columns
                .iter()
                .find(|c| c.chats == in_chats && c.name == name)
                .ok_or_else(|| {
                    Error::config(
                        table.to_owned(),
                        format!(
                            "has no column {name}: add the lock columns \
                             (mix locks.setup --lock-columns, or Schema.statements(:lock_columns, …) in a migration)"
                        ),
                    )
                })
        };
        let now = |in_chats: bool, table: &str| -> Result<&'static str> {
            let column = find(in_chats, table, "busy_since")?;
            find(in_chats, table, "busy_turn_ref")?;
            now_for(&column.type_name).ok_or_else(|| {
                Error::config(
                    table.to_owned(),
                    format!(
                        "busy_since is of type {}: it must be timestamptz or timestamp",
                        column.type_name
                    ),
                )
            })
        };
        let chat_now = now(true, CHATS)?;
        find(true, CHATS, "uuid")?;
        let user_now = now(false, USERS)?;
        find(false, USERS, "user_uuid")?;

        let mut user_fills = Vec::new();
        for column in columns.iter().filter(|c| {
            !c.chats
                && c.not_null
                && !c.has_default
                && !["user_uuid", "busy_since", "busy_turn_ref"].contains(&c.name.as_str())
        }) {
            let fill = fill_for(&column.type_name).ok_or_else(|| {
                Error::config(
                    USERS,
                    format!(
                        "column {name} is NOT NULL without a default, and a new settings row \
                         cannot fill a {ty}: give it a default \
                         (ALTER TABLE {users} ALTER COLUMN {name} SET DEFAULT …)",
                        name = quote_ident(&column.name),
                        ty = column.type_name,
                    ),
                )
            })?;
            user_fills.push((quote_ident(&column.name), fill));
        }
        Ok(Tables { chats, users, chat_now, user_now, user_fills })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn column(
        chats: bool,
        name: &str,
        type_name: &str,
        not_null: bool,
        has_default: bool,
    ) -> Column {
        Column { chats, name: name.into(), type_name: type_name.into(), not_null, has_default }
    }

    /// The shipped tables, as the catalog describes them.
    pub(crate) fn shipped() -> Vec<Column> {
        vec![
            column(true, "uuid", "uuid", true, false),
            column(true, "busy_since", "timestamptz", false, false),
            column(true, "busy_turn_ref", "text", false, false),
            column(false, "user_uuid", "uuid", true, false),
            column(false, "busy_since", "timestamptz", false, false),
            column(false, "busy_turn_ref", "text", false, false),
            column(false, "inserted_at", "timestamptz", true, true),
            column(false, "updated_at", "timestamptz", true, true),
        ]
    }

    #[test]
    fn identifiers_are_quoted_and_a_prefix_qualifies_both_tables() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(
            table_names(Some("a\"b")),
            (format!("\"a\"\"b\".{CHATS}"), format!("\"a\"\"b\".{USERS}"))
        );
    }

    #[test]
    fn missing_lock_columns_and_odd_types_are_named() {
        let mut columns = shipped();
        columns.retain(|c| !(c.chats && c.name == "busy_turn_ref"));
        let err = Tables::from_columns(None, &columns).err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.starts_with(
                "invalid configuration: phoenix_kit_agent_conversations: has no column busy_turn_ref"
            )),
            "{err:?}"
        );

        let mut columns = shipped();
        columns[4].type_name = "date".into();
        let err = Tables::from_columns(None, &columns).err().map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some(
                "invalid configuration: phoenix_kit_agent_user_settings: busy_since is of type \
                 date: it must be timestamptz or timestamp"
            )
        );
    }
}
