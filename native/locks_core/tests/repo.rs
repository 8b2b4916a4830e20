//! What a pool does with rows, through the public API the NIF's
//! `testing: :sandbox` calls (`locks_core::repo`), with the rows a host's
//! repo would return: the catalog's rows of the tables (their checks, the
//! statements filled for them) and a statement's rows read into its answer
//! (`Job::answer`, the pool's own reading); and what the statements so
//! filled, and the fence (`locks_core::fence`), say. No database: the rows
//! are made here. Moved from the unit tests of schema.rs, repo.rs and
//! row.rs, which needed nothing private, and of sql.rs, rewritten from its
//! statement constants to the texts a repo is handed (filled as under the
//! sandbox, `{wait}` as `true`, which none of those checks looks at).

use std::collections::BTreeSet;

use locks_core::repo::{Repo, Step};
use locks_core::schema::{quote_ident, CHATS, USERS};
use locks_core::Value::{self, Bool, Float, Int, Null, Text};
use locks_core::{
    fence, Answer, Busy, ClickRef, HeldLock, Hold, Job, LockKind, Ttl, TurnRef, Uuid,
};

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

/// The shipped rows once `change` changed the row of one column (of the
/// chats or of the users, by name).
fn shipped_but(chats: bool, name: &str, change: impl FnOnce(&mut Vec<Value>)) -> Vec<Vec<Value>> {
    let mut rows = shipped();
    let is_it = |row: &&mut Vec<Value>| row[0] == Bool(chats) && row[2] == Text(name.into());
    change(rows.iter_mut().find(is_it).expect("a shipped column"));
    rows
}

/// The message of the error the shipped tables give once `change` made one
/// mistake in the row of one column (of the chats or of the users, by
/// name), or `None` when they pass.
fn mistake(chats: bool, name: &str, change: impl FnOnce(&mut Vec<Value>)) -> Option<String> {
    Repo::new(None).columns(&shipped_but(chats, name, change)).err().map(|e| e.to_string())
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

/// A job of each lock function, in `Job::functions()`'s order.
fn every_job() -> Vec<Job> {
    let id = |byte| Uuid::from_bytes(&[byte; 16]).expect("16 bytes");
    let (chat, user) = (id(1), id(2));
    let turn = TurnRef::new("turn").expect("a turn ref");
    let click = ClickRef::new("click:1").expect("a click ref");
    let ttl = Ttl::new(60).expect("a ttl");
    let hold = Hold::new(10, ttl).expect("a hold");
    vec![
        acquire(),
        Job::AcquireUser(user, click.clone(), ttl, hold),
        Job::Fresh(chat, turn.clone(), ttl),
        Job::Held(chat, user, turn.clone()),
        Job::Keep(chat, user, turn.clone(), ttl, hold),
        Job::KeepUser(user, click.clone(), ttl, hold),
        Job::HeldLocks(ttl),
        Job::Release(chat, user, turn.clone()),
        Job::ReleaseStale(chat, user, turn, ttl),
        Job::ReleaseUser(user, click),
    ]
}

/// A repo under `prefix` whose tables' columns are `rows`.
fn read(prefix: Option<&str>, rows: &[Vec<Value>]) -> Repo {
    let repo = Repo::new(prefix.map(str::to_owned));
    repo.columns(rows).expect("tables the statements can use");
    repo
}

/// The statement `repo`, its tables read, runs for `job`.
fn statement(repo: &Repo, job: &Job) -> String {
    match repo.step(job) {
        Ok(Step::Run(text)) => text,
        other => panic!("{job:?}: the call's statement, not {other:?}"),
    }
}

/// The tables a statement reads `FROM` under the aliases `c` (the chats')
/// and `u` (the users'): `(alias, table)`.
fn from_tables(text: &str) -> BTreeSet<(String, String)> {
    let aliased = |rest: &str| {
        let mut words = rest.split_whitespace();
        let (table, alias) = (words.next()?, words.next()?);
        ["c", "u"].contains(&alias).then(|| (alias.to_owned(), table.to_owned()))
    };
    text.split("FROM ").skip(1).filter_map(aliased).collect()
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

/// No lock statement changes `updated_at` (a settings row keeps the time its
/// settings last changed) or reads a node's clock (`clock_timestamp`):
/// checked in the statement of every lock function.
#[test]
fn no_statement_changes_updated_at_or_reads_a_node_clock() {
    let repo = read(None, &shipped());
    let jobs = every_job();
    assert_eq!(jobs.len(), Job::functions().count(), "a job for each lock function");
    let texts: BTreeSet<String> = jobs.iter().map(|job| statement(&repo, job)).collect();
    assert_eq!(texts.len(), jobs.len(), "each job its own statement");
    for text in &texts {
        assert!(!text.contains("updated_at"), "{text}");
        assert!(!text.contains("clock_timestamp"), "{text}");
    }
}

/// A new settings row gets the fills (here `updated_at`, `NOT NULL` without
/// a default) and an update of an existing one never does: in both upserts,
/// `acquire`'s and `acquire_user`'s, the column is only in the `INSERT`.
#[test]
fn a_new_settings_row_gets_the_fills_and_an_update_never_does() {
    let no_default = shipped_but(false, "updated_at", |row| row[7] = Bool(false));
    let repo = read(None, &no_default);
    let upserts = every_job()
        .into_iter()
        .filter(|job| matches!(job, Job::Acquire(..) | Job::AcquireUser(..)));
    for job in upserts {
        let text = statement(&repo, &job);
        let (insert, update) = text.split_once("ON CONFLICT").expect("an upsert");
        assert!(insert.contains("busy_turn_ref, \"updated_at\")"), "{insert}");
        assert!(!update.contains("updated_at"), "{update}");
    }
}

/// The fence (`fence`, the first statement of `Locks.transaction/4`) names
/// the tables as the lock statements do, with or without a prefix: every
/// placeholder filled, `$1`…`$4` when bounded by the lease and `$1`…`$3`
/// when not, and both rows locked `FOR SHARE`.
#[test]
fn the_fence_names_the_tables_as_the_lock_statements_do() {
    let used = |text: &str| (1..=9).filter(|n| text.contains(&format!("${n}"))).collect::<Vec<_>>();
    for prefix in [None, Some("phoenix_kit")] {
        let repo = Repo::new(prefix.map(str::to_owned));
        let Ok(Step::Columns(_, [chats, users])) = repo.step(&acquire()) else {
            panic!("the columns first")
        };
        let named = BTreeSet::from([("c".to_owned(), chats), ("u".to_owned(), users)]);
        let repo = read(prefix, &shipped());
        assert_eq!(from_tables(&statement(&repo, &acquire())), named);
        for (bounded, params) in [(false, 3), (true, 4)] {
            let text = fence(prefix, bounded);
            assert_eq!(from_tables(&text), named, "{text}");
            assert!(!text.contains('{'), "{text}");
            assert_eq!(used(&text), (1..=params).collect::<Vec<_>>(), "{text}");
            assert_eq!(text.matches("FOR SHARE").count(), 2, "{text}");
        }
    }
}
