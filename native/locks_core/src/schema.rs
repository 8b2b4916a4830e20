//! The tables the locks live in, and the DDL that makes them.
//!
//! [`tables`] makes both tables from nothing; [`lock_columns`] only adds the
//! lock columns (and the unique index the user statements rely on) to tables
//! a host already has. Both are idempotent, and both take an optional schema
//! prefix, validated by [`quote_schema`] and quoted: a prefix is never spliced
//! into SQL unchecked. `priv/schema.sql` is [`tables`]`(None)`, kept equal by a
//! test.

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

-- A row is created with only user_uuid and the lock columns when a user has
-- none, so every other NOT NULL column needs a default.
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
CREATE UNIQUE INDEX IF NOT EXISTS {users_index} ON {users} (user_uuid);
";

/// Validates a schema name as a plain SQL identifier (a letter or `_`, then
/// letters, digits, `_` or `$`, at most 63 bytes) and returns it quoted.
pub fn quote_schema(name: &str) -> Result<String> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$');
    if !first_ok || !rest_ok || name.len() > 63 {
        return Err(Error::config(
            "prefix",
            "must be an identifier: a letter or _, then letters, digits, _ or $ (at most 63)",
        ));
    }
    Ok(format!("\"{name}\""))
}

/// The two table names, qualified by `schema` (already quoted) when given.
pub(crate) fn table_names(schema: Option<&str>) -> (String, String) {
    match schema {
        Some(s) => (format!("{s}.{CHATS}"), format!("{s}.{USERS}")),
        None => (CHATS.to_owned(), USERS.to_owned()),
    }
}

/// The DDL that creates both tables (and the schema, when given).
pub fn tables(schema: Option<&str>) -> String {
    let (chats, users) = table_names(schema);
    let create_schema = match schema {
        Some(s) => format!("CREATE SCHEMA IF NOT EXISTS {s};\n"),
        None => String::new(),
    };
    TABLES
        .replace("{create_schema}", &create_schema)
        .replace("{chats}", &chats)
        .replace("{users}", &users)
}

/// The DDL that adds only the lock columns to existing tables.
pub fn lock_columns(schema: Option<&str>) -> String {
    let (chats, users) = table_names(schema);
    LOCK_COLUMNS
        .replace("{chats}", &chats)
        .replace("{users}", &users)
        .replace(
            "{users_index}",
            "phoenix_kit_agent_user_settings_user_uuid_lock_index",
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priv_schema_sql_is_the_unprefixed_ddl() {
        let shipped = include_str!("../../../priv/schema.sql");
        assert_eq!(shipped, tables(None));
    }

    #[test]
    fn a_prefix_is_quoted_and_qualifies_both_tables() {
        let schema = quote_schema("phoenix_kit").expect("valid");
        let ddl = tables(Some(&schema));
        assert!(ddl.starts_with("-- The tables"));
        assert!(ddl.contains("CREATE SCHEMA IF NOT EXISTS \"phoenix_kit\";"));
        assert!(ddl.contains(
            "CREATE TABLE IF NOT EXISTS \"phoenix_kit\".phoenix_kit_agent_conversations ("
        ));
        assert!(lock_columns(Some(&schema))
            .contains("ALTER TABLE \"phoenix_kit\".phoenix_kit_agent_user_settings"));
    }

    #[test]
    fn a_prefix_that_is_not_an_identifier_is_refused() {
        for bad in [
            "",
            "1abc",
            "a b",
            "a\"b",
            "public; DROP TABLE x",
            &"a".repeat(64),
        ] {
            let err = quote_schema(bad).expect_err(bad);
            assert!(
                err.to_string()
                    .starts_with("invalid configuration: prefix: "),
                "{err}"
            );
        }
        assert_eq!(quote_schema("_x$1").ok().as_deref(), Some("\"_x$1\""));
    }
}
