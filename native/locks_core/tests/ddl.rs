//! The DDL of `schema`: idempotent, and a schema prefix works end to end.

mod common;

use common::{new_turn_ref, new_uuid, options, run, Db, Table, TTL};
use locks_core::config::Options;
use locks_core::{schema, Acquire, Config, Locks};

/// The schema the prefixed test creates (and leaves, for the next run).
const PREFIX: &str = "locks_cargo_test";

/// A pool whose statements name the tables in `prefix`.
fn locks_in(prefix: Option<&str>) -> Locks {
    Locks::new(
        Config::new(&Options {
            prefix,
            ..options()
        })
        .expect("the test config is valid"),
    )
    .expect("a pool can be built")
}

#[test]
fn the_tables_ddl_can_run_again_on_existing_tables() {
    run(async {
        common::setup().await;
        let locks = locks_in(None);

        for run in 0..2 {
            locks
                .run_ddl(&schema::tables(None))
                .await
                .unwrap_or_else(|e| panic!("run {run}: {e}"));
        }
    })
}

#[test]
fn lock_columns_adds_the_locks_to_a_hosts_tables_and_can_run_again() {
    run(async {
        // A schema of this run's own, dropped at the end: the host's tables
        // start without lock columns, and without the unique index the upserts
        // need, every time.
        let name = format!("locks_cargo_host_{}", new_uuid().replace('-', ""));
        let quoted = schema::quote_schema(&name).expect("a valid identifier");
        let locks = locks_in(Some(&name));
        locks
            .run_ddl(&format!(
                "CREATE SCHEMA {quoted};
                 CREATE TABLE {quoted}.{chats} (uuid uuid PRIMARY KEY, title text);
                 CREATE TABLE {quoted}.{users} (
                   id bigserial PRIMARY KEY,
                   user_uuid uuid NOT NULL,
                   updated_at timestamptz NOT NULL DEFAULT now()
                 );",
                chats = schema::CHATS,
                users = schema::USERS,
            ))
            .await
            .expect("the host's tables can be created");

        for run in 0..2 {
            locks
                .run_ddl(&schema::lock_columns(Some(&quoted)))
                .await
                .unwrap_or_else(|e| panic!("run {run}: {e}"));
        }

        let db = Db::connect_in(Some(&quoted)).await;
        let chat = db.insert_chat().await;
        let (user, turn) = (new_uuid(), new_turn_ref());
        let answer = locks
            .acquire(
                &common::uuid(&chat),
                &common::uuid(&user),
                common::turn(&turn),
                common::ttl(TTL),
            )
            .await;
        let held = db.lock(Table::User, &user).await;
        db.client
            .batch_execute(&format!("DROP SCHEMA {quoted} CASCADE"))
            .await
            .expect("the schema can be dropped");

        assert_eq!(answer.expect("acquire answers"), Acquire::Acquired);
        assert_eq!(
            held.as_ref().and_then(|lock| lock.holder()),
            Some(turn.as_str())
        );
    })
}

#[test]
fn a_schema_prefix_qualifies_both_tables_end_to_end() {
    run(async {
        let quoted = schema::quote_schema(PREFIX).expect("a valid identifier");
        assert_eq!(quoted, format!("\"{PREFIX}\""));
        let locks = locks_in(Some(PREFIX));
        for run in 0..2 {
            locks
                .run_ddl(&schema::tables(Some(&quoted)))
                .await
                .unwrap_or_else(|e| panic!("run {run}: {e}"));
        }
        let db = Db::connect_in(Some(&quoted)).await;
        let public = Db::connect().await;
        let chat = db.insert_chat().await;
        let (user, turn) = (new_uuid(), new_turn_ref());
        let (c, u, t, ttl) = (
            common::uuid(&chat),
            common::uuid(&user),
            common::turn(&turn),
            common::ttl(TTL),
        );

        assert_eq!(
            locks
                .acquire(&c, &u, t, ttl)
                .await
                .expect("acquire answers"),
            Acquire::Acquired
        );
        assert_eq!(db.chat(&chat).await.holder(), Some(turn.as_str()));
        assert_eq!(db.user(&user).await.holder(), Some(turn.as_str()));
        assert!(locks.held(&c, &u, t).await.expect("held answers"));
        assert!(locks.fresh(&c, t, ttl).await.expect("fresh answers"));
        // Nothing reached the unprefixed tables.
        assert_eq!(public.lock(Table::Chat, &chat).await, None);
        assert_eq!(public.lock(Table::User, &user).await, None);

        locks.release(&c, &u, t).await.expect("release answers");
        assert!(db.chat(&chat).await.is_free());
        assert!(db.user(&user).await.is_free());
    })
}
