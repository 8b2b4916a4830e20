//! What a pool does with rows, through the public API the NIF's
//! `testing: :sandbox` calls (`locks_core::repo`), with the rows a host's
//! repo would return: the catalog's rows of the tables (their checks, the
//! statements filled for them) and a statement's rows read into its answer
//! (`Job::answer`, the pool's own reading). No database: the rows are made
//! here. Moved from the unit tests of schema.rs, repo.rs and row.rs, which
//! needed nothing private.

use locks_core::repo::{Repo, Step};
use locks_core::schema::{quote_ident, CHATS, USERS};
use locks_core::Value::{self, Bool, Float, Int, Null, Text};
use locks_core::{Answer, Busy, ClickRef, HeldLock, Hold, Job, LockKind, Ttl, TurnRef, Uuid};

/// The rows of the `COLUMNS` statement for the shipped tables, as a repo
/// returns them: chats?, found, name, typname, format_type, max_chars,
/// not_null, has_default, is_unique, deferrable.
fn shipped() -> Vec<Vec<Value>> {
    let column = |chats, name: &str, ty: &str, not_null, key| {
        let at = name.ends_with("_at");
        let [name, ty] = [name, ty].map(|text| Text(text.into()));
        vec![
            Bool(chats),
            Bool(true),
            name,
            ty.clone(),
            ty,
            Null,
            Bool(not_null),
            Bool(at),
            Bool(key),
            Null,
        ]
    };
    vec![
        column(true, "uuid", "uuid", true, true),
        column(true, "busy_since", "timestamptz", false, false),
        column(true, "busy_turn_ref", "text", false, false),
        column(false, "user_uuid", "uuid", true, true),
        column(false, "busy_since", "timestamptz", false, false),
        column(false, "busy_turn_ref", "text", false, false),
        column(false, "inserted_at", "timestamptz", true, false),
        column(false, "updated_at", "timestamptz", true, false),
    ]
}

/// The message of the error the shipped tables give once `change` made one
/// mistake in the row of one column (of the chats or of the users, by
/// name), or `None` when they pass.
fn mistake(chats: bool, name: &str, change: impl FnOnce(&mut Vec<Value>)) -> Option<String> {
    let mut rows = shipped();
    let is_it = |row: &&mut Vec<Value>| row[0] == Bool(chats) && row[2] == Text(name.into());
    change(rows.iter_mut().find(is_it).expect("a shipped column"));
    Repo::new(None).columns(&rows).err().map(|e| e.to_string())
}

/// Gives a column's row the type `typname`, which SQL writes `sql_type`.
fn retype(row: &mut [Value], typname: &str, sql_type: &str) {
    (row[3], row[4]) = (Text(typname.into()), Text(sql_type.into()));
}

fn acquire() -> Job {
    let id = |byte| Uuid::from_bytes(&[byte; 16]).expect("16 bytes");
    let ttl = Ttl::new(60).expect("a ttl");
    let hold = Hold::new(10, ttl).expect("a hold");
    Job::Acquire(id(1), id(2), TurnRef::new("turn").expect("a turn ref"), ttl, hold)
}

#[test]
fn the_repo_reads_the_columns_then_runs_the_statement_filled_for_the_tables() {
    let repo = Repo::new(Some("phoenix_kit".into()));
    let names = [format!("\"phoenix_kit\".{CHATS}"), format!("\"phoenix_kit\".{USERS}")];
    match repo.step(&acquire()) {
        Ok(Step::Columns(text, tables)) => {
            assert!(text.contains("to_regclass($1::text)"), "{text}");
            assert_eq!(tables, names);
        }
        other => panic!("the columns first: {other:?}"),
    }

    assert!(repo.columns(&shipped()).is_ok());
    match repo.step(&acquire()) {
        Ok(Step::Run(text)) => {
            assert!(text.contains(&format!("INSERT INTO {} AS u", names[1])), "{text}");
            assert!(text.contains(&format!("UPDATE {} c", names[0])), "{text}");
            assert!(!text.contains('{'), "{text}");
        }
        other => panic!("then the call's statement: {other:?}"),
    }
}

#[test]
fn identifiers_are_quoted_and_a_prefix_qualifies_both_tables() {
    assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    let names = [format!("\"a\"\"b\".{CHATS}"), format!("\"a\"\"b\".{USERS}")];
    let step = Repo::new(Some("a\"b".into())).step(&acquire());
    assert!(matches!(step, Ok(Step::Columns(_, tables)) if tables == names));
}

#[test]
fn tables_the_statements_cannot_use_are_the_pools_config_error() {
    let mut rows = shipped();
    rows.retain(|row| row[2] != Text("busy_turn_ref".into()));
    let err = Repo::new(None).columns(&rows).err().map(|e| e.to_string());
    assert!(
        err.as_deref().is_some_and(|e| e.starts_with(
            "invalid configuration: phoenix_kit_agent_conversations: has no column busy_turn_ref"
        )),
        "{err:?}"
    );
}

// What the catalog's rows can say and the ExUnit tests' tables cannot
// easily be made to (table_checks_test.exs makes the others, and asserts
// their messages).
#[test]
fn a_busy_since_of_another_type_is_named_by_its_sql_type() {
    let err = mistake(false, "busy_since", |row| row[4] = Text("date".into()));
    assert_eq!(err, None, "the decision is the typname's, the message the sql_type's");
    let err = mistake(false, "busy_since", |row| retype(row, "date", "date"));
    assert_eq!(
        err.as_deref(),
        Some(
            "invalid configuration: phoenix_kit_agent_user_settings: busy_since is of type \
             date: it must be timestamptz or timestamp"
        )
    );
}

#[test]
fn a_varchar_without_a_length_and_a_deferrable_chat_key_pass() {
    let unbounded =
        mistake(true, "busy_turn_ref", |row| retype(row, "varchar", "character varying"));
    assert_eq!(unbounded, None);
    // It keeps the chats one row each; ON CONFLICT, only on the user table,
    // fails with one.
    assert_eq!(mistake(true, "uuid", |row| row[9] = Text("d".into())), None);
}

#[test]
fn a_statements_rows_are_read_by_the_types_of_their_columns_and_nothing_else() {
    let ttl = Ttl::new(60).expect("a ttl");
    let held = Job::HeldLocks(ttl);
    let lock = |since, age| {
        vec![Text("chat".into()), Text("c".into()), Text("turn-1".into()), since, age, Bool(true)]
    };
    let expected = |since_us, age_s| HeldLock {
        kind: LockKind::Chat,
        id: "c".into(),
        holder: "turn-1".into(),
        since_us,
        age_s,
        stale: true,
    };
    let read = held.answer(&[lock(Int(7), Float(1.5)), lock(Null, Null)]);
    assert_eq!(
        read.ok(),
        Some(Answer::Locks(vec![expected(Some(7), Some(1.5)), expected(None, None)]))
    );
    let acquire = acquire();
    let busy = acquire.answer(&[vec![Bool(false), Text("click:1".into())]]);
    assert_eq!(busy.ok(), Some(Answer::Busy(Busy::ClickInFlight)));
    let (user, hold) = (Uuid::from_bytes(&[2; 16]).expect("16 bytes"), Hold::new(10, ttl));
    let click = ClickRef::new("click:1").expect("a click ref");
    let keep_user = Job::KeepUser(user, click, ttl, hold.expect("a hold"));
    assert_eq!(keep_user.answer(&[]).ok(), Some(Answer::Yes(false)));

    let wrong = [
        acquire.answer(&[vec![Text("turn-1".into()), Null]]),
        acquire.answer(&[vec![Bool(true)]]),
        held.answer(&[lock(Int(7), Int(7))]),
        held.answer(&[vec![Null]]),
        acquire.answer(&[]),
    ];
    let wrong: Vec<_> =
        wrong.iter().map(|answer| answer.as_ref().err().map(ToString::to_string)).collect();
    let expect = |reason: &str| {
        Some(format!(
            "invalid configuration: tables: unexpected answer ({reason}); restart the application"
        ))
    };
    assert_eq!(
        wrong,
        [
            expect("column 0 is Text(\"turn-1\"), not a boolean"),
            expect("no column 1"),
            expect("column 4 is Int(7), not a float"),
            expect("column 0 is NULL"),
            expect("0 rows where one was expected"),
        ]
    );
}
