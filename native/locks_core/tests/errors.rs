//! When a call cannot be answered: no server, a refused login, no tables, a
//! statement or a checkout that outlasts its timeout, a terminated
//! connection, a closed pool. Each failure is the right [`Error`] variant,
//! comes within its timeout, never shows the password, and leaves the pool
//! usable for the next call.

mod common;

use std::time::{Duration, Instant};

use common::{harness_with, new_turn_ref, new_uuid, options, run, uuid, Harness, Table, TTL};
use locks_core::config::Options;
use locks_core::{Acquire, Config, Error, Locks};

/// A password that must never show in an error.
const PASSWORD: &str = "s3cr3t-never-shown";

/// A pool for `url` with short connect and checkout timeouts (ms).
fn locks_for(url: &str, timeout_ms: i64) -> Locks {
    let config = Config::new(&Options {
        url,
        pool_size: Some(1),
        connect_timeout_ms: Some(timeout_ms),
        checkout_timeout_ms: Some(timeout_ms),
        ..Options::default()
    })
    .expect("the url parses");
    Locks::new(config).expect("a pool can be built")
}

/// Runs one `acquire` on `locks`; its answer and how long it took.
async fn timed_acquire(locks: &Locks, chat: &str) -> (Result<Acquire, Error>, Duration) {
    let start = Instant::now();
    let answer = locks
        .acquire(
            &uuid(chat),
            &uuid(&new_uuid()),
            common::turn(&new_turn_ref()),
            common::ttl(TTL),
        )
        .await;
    (answer, start.elapsed())
}

#[test]
fn a_closed_port_is_a_connect_error_within_the_connect_timeout_every_time() {
    run(async {
        let timeout = Duration::from_millis(500);
        let url = format!("postgres://locks:{PASSWORD}@127.0.0.1:1/locks");
        let locks = locks_for(&url, timeout.as_millis() as i64);

        // Three calls on a pool of one: a failed connect does not keep the slot.
        for attempt in 0..3 {
            let (answer, elapsed) = timed_acquire(&locks, &new_uuid()).await;
            let err = answer.expect_err("nothing listens on port 1");
            assert!(
                matches!(err, Error::Connect(_)),
                "attempt {attempt}: {err:?}"
            );
            assert!(
                elapsed < timeout + Duration::from_secs(1),
                "attempt {attempt} took {elapsed:?}"
            );
            let shown = format!("{err} {err:?}");
            assert!(!shown.contains(PASSWORD), "{shown}");
            assert!(shown.starts_with("database connection failed: "), "{shown}");
        }
    })
}

/// The test database's URL with its password replaced by [`PASSWORD`].
fn url_with_a_wrong_password() -> String {
    let url = common::database_url();
    let config: tokio_postgres::Config = url.parse().expect("DATABASE_URL parses");
    let password = config
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .expect("DATABASE_URL has a password (scripts/pg logs `locks` in with one)");
    url.replacen(&format!(":{password}@"), &format!(":{PASSWORD}@"), 1)
}

#[test]
fn a_refused_login_is_an_error_that_does_not_show_the_password() {
    run(async {
        let locks = locks_for(&url_with_a_wrong_password(), 10_000);

        let (answer, _) = timed_acquire(&locks, &new_uuid()).await;

        let err = answer.expect_err("the password is wrong");
        let shown = format!("{err} {err:?}");
        assert!(!shown.contains(PASSWORD), "{shown}");
        assert!(shown.contains("password authentication failed"), "{shown}");
    })
}

#[test]
fn a_refused_login_is_a_connect_error() {
    run(async {
        let locks = locks_for(&url_with_a_wrong_password(), 10_000);

        let (answer, _) = timed_acquire(&locks, &new_uuid()).await;

        let err = answer.expect_err("the password is wrong");
        assert!(matches!(err, Error::Connect(_)), "{err:?}");
        assert_eq!(
            err.to_string(),
            "database connection failed: password authentication failed for user \"locks\" (28P01)"
        );
    })
}

#[test]
fn the_pool_replaces_a_connection_the_server_terminated() {
    run(async {
        // An application_name of this test's own singles out its backend.
        let app = format!("locks_cargo_{}", new_uuid().replace('-', ""));
        let base = common::database_url();
        let separator = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{separator}application_name={app}");
        let h = harness_with(Options {
            url: &url,
            pool_size: Some(1),
            ..options()
        })
        .await;
        let chat = h.db.insert_chat().await;
        let (answer, _) = timed_acquire(&h.locks, &chat).await;
        assert_eq!(answer.expect("the pool connects"), Acquire::Acquired);

        let terminated: i64 =
            h.db.client
                .query_one(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                 WHERE application_name = $1",
                    &[&app],
                )
                .await
                .expect("the pool's backend can be terminated")
                .get(0);
        assert_eq!(terminated, 1, "the pool of one had one connection");
        // Wait for the backend to exit and the client to read the end of its
        // socket: the pool notices the closed connection at the next checkout.
        for _ in 0..100 {
            let left: i64 =
                h.db.client
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                        &[&app],
                    )
                    .await
                    .expect("pg_stat_activity can be read")
                    .get(0);
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;

        let (answer, _) = timed_acquire(&h.locks, &h.db.insert_chat().await).await;
        assert_eq!(
            answer.expect("a new connection replaces the terminated one"),
            Acquire::Acquired
        );
    })
}

#[test]
fn every_call_on_missing_tables_is_a_statement_error_42p01() {
    run(async {
        let h = harness_with(Options {
            prefix: Some("no_such_schema_xyz"),
            ..options()
        })
        .await;
        let (chat, user) = (uuid(&new_uuid()), uuid(&new_uuid()));
        let (t, c) = (new_turn_ref(), common::new_click_ref());
        let (turn, click, ttl) = (common::turn(&t), common::click(&c), common::ttl(TTL));
        let hold = common::hold(10, TTL);
        let l = &h.locks;

        let answers: Vec<(&str, Result<(), Error>)> = vec![
            (
                "acquire",
                l.acquire(&chat, &user, turn, ttl).await.map(drop),
            ),
            (
                "acquire_user",
                l.acquire_user(&user, click, ttl, hold).await.map(drop),
            ),
            ("fresh", l.fresh(&chat, turn, ttl).await.map(drop)),
            ("held", l.held(&chat, &user, turn).await.map(drop)),
            (
                "keep_user",
                l.keep_user(&user, click, ttl, hold).await.map(drop),
            ),
            ("release", l.release(&chat, &user, turn).await),
            (
                "release_stale",
                l.release_stale(&chat, &user, turn, ttl).await.map(drop),
            ),
            ("release_user", l.release_user(&user, click).await),
        ];

        for (call, answer) in answers {
            let err = answer.expect_err(call);
            assert!(
                matches!(&err, Error::Statement { sqlstate, message }
                    if sqlstate == "42P01" && message.contains("does not exist")),
                "{call}: {err:?}"
            );
            assert_eq!(err.sqlstate(), Some("42P01"), "{call}");
        }
    })
}

#[test]
fn acquire_on_a_row_locked_past_the_statement_timeout_is_query_canceled_57014() {
    run(async {
        let Harness { locks, mut db } = harness_with(Options {
            pool_size: Some(1),
            statement_timeout_ms: Some(50),
            ..options()
        })
        .await;
        let chat = db.insert_chat().await;
        // Connect first, so that the timed call below only runs the statement.
        let (warm, _) = timed_acquire(&locks, &new_uuid()).await;
        assert_eq!(warm.expect("a call answers"), Acquire::ConversationBusy);
        let (chats, _) = db.table(Table::Chat);
        let tx = db.client.transaction().await.expect("a transaction opens");
        tx.query(
            &format!("SELECT 1 FROM {chats} WHERE uuid = $1::text::uuid FOR UPDATE"),
            &[&chat],
        )
        .await
        .expect("the chat row can be locked");

        let (answer, elapsed) = timed_acquire(&locks, &chat).await;

        let err = answer.expect_err("the chat row stays locked past the statement timeout");
        assert!(
            matches!(&err, Error::Statement { sqlstate, .. } if sqlstate == "57014"),
            "{err:?}"
        );
        assert!(
            elapsed >= Duration::from_millis(50) && elapsed < Duration::from_millis(1_050),
            "took {elapsed:?}"
        );

        tx.rollback().await.expect("the transaction rolls back");
        // The same (only) pooled connection answers the next call.
        let (answer, _) = timed_acquire(&locks, &chat).await;
        assert_eq!(answer.expect("the row is free again"), Acquire::Acquired);
    })
}

#[test]
fn a_call_waits_at_most_the_checkout_timeout_for_a_pooled_connection() {
    run(async {
        let checkout = Duration::from_millis(100);
        let Harness { locks, mut db } = harness_with(Options {
            pool_size: Some(1),
            checkout_timeout_ms: Some(checkout.as_millis() as i64),
            statement_timeout_ms: Some(5_000),
            ..options()
        })
        .await;
        let (blocked_chat, other_chat) = (db.insert_chat().await, db.insert_chat().await);
        // Open the pool's one connection first, so that the blocked call below
        // only waits on the row, not on connecting.
        let (warm, _) = timed_acquire(&locks, &new_uuid()).await;
        assert_eq!(warm.expect("a call answers"), Acquire::ConversationBusy);

        let (chats, _) = db.table(Table::Chat);
        let tx = db.client.transaction().await.expect("a transaction opens");
        tx.query(
            &format!("SELECT 1 FROM {chats} WHERE uuid = $1::text::uuid FOR UPDATE"),
            &[&blocked_chat],
        )
        .await
        .expect("the chat row can be locked");

        let blocked = timed_acquire(&locks, &blocked_chat);
        let waiting = async {
            // Let the blocked call check the only connection out first.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let answer = timed_acquire(&locks, &other_chat).await;
            tx.rollback().await.expect("the transaction rolls back");
            answer
        };
        let ((blocked, _), (waited, elapsed)) = tokio::join!(blocked, waiting);

        let err = waited.expect_err("the only connection is busy");
        assert!(
            matches!(err, Error::PoolTimeout(wait) if wait == checkout),
            "{err:?}"
        );
        assert!(
            elapsed >= checkout && elapsed < checkout + Duration::from_secs(1),
            "took {elapsed:?}"
        );
        assert_eq!(
            blocked.expect("the blocked call ends once the row is free"),
            Acquire::Acquired
        );
        let (answer, _) = timed_acquire(&locks, &other_chat).await;
        assert_eq!(answer.expect("the pool is free again"), Acquire::Acquired);
    })
}

#[test]
fn a_closed_pool_answers_not_started() {
    run(async {
        let h = harness_with(options()).await;
        let chat = h.db.insert_chat().await;
        let (answer, _) = timed_acquire(&h.locks, &chat).await;
        assert_eq!(answer.expect("the pool is open"), Acquire::Acquired);

        h.locks.close();

        let (answer, _) = timed_acquire(&h.locks, &chat).await;
        assert!(matches!(answer, Err(Error::NotStarted)), "{answer:?}");
    })
}
