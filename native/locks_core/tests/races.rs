//! Calls racing for the same rows from many tokio tasks at once: each lock
//! has exactly one winner, losers learn why, and what a loser did not take
//! stays free. Every task waits on a barrier so that the calls overlap; one
//! test goes further and makes them all wait on the same row lock.

mod common;

use std::future::Future;
use std::sync::Arc;

use common::{
    new_click_ref, new_turn_ref, new_uuid, run, shared, Harness, Table, SHARED_POOL_SIZE, TTL,
};
use locks_core::{Acquire, AcquireUser};
use tokio::sync::Barrier;

/// Racing tasks per test; the pool runs `SHARED_POOL_SIZE` of them at once.
const RACERS: usize = 50;

/// Runs `n` tasks, the `i`-th calling `call(i)` once all are ready, and
/// returns their answers in order.
async fn race<T, F, Fut>(n: usize, call: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let barrier = Arc::new(Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let barrier = Arc::clone(&barrier);
            let call = call(i);
            tokio::spawn(async move {
                barrier.wait().await;
                call.await
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(n);
    for task in tasks {
        answers.push(task.await.expect("a racing task does not panic"));
    }
    answers
}

/// The one index whose answer `won`; fails unless there is exactly one.
fn the_one_winner<T: std::fmt::Debug>(answers: &[T], won: impl Fn(&T) -> bool) -> usize {
    let winners: Vec<usize> = (0..answers.len()).filter(|&i| won(&answers[i])).collect();
    assert_eq!(winners.len(), 1, "winners {winners:?} of {answers:?}");
    winners[0]
}

#[test]
fn of_fifty_turns_racing_for_one_chat_exactly_one_acquires() {
    run(async {
        let h: &'static Harness = shared().await;
        let chat: Arc<str> = h.db.insert_chat().await.into();
        let racers: Vec<(String, String)> =
            (0..RACERS).map(|_| (new_uuid(), new_turn_ref())).collect();

        let answers = race(RACERS, |i| {
            let (chat, (user, turn)) = (Arc::clone(&chat), racers[i].clone());
            async move { h.acquire(&chat, &user, &turn, TTL).await }
        })
        .await;

        let winner = the_one_winner(&answers, |a| *a == Acquire::Acquired);
        let (user, turn) = &racers[winner];
        assert_eq!(h.db.chat(&chat).await.holder(), Some(turn.as_str()));
        assert!(h.held(&chat, user, turn).await);
        for (i, (answer, (user, _))) in answers.iter().zip(&racers).enumerate() {
            if i != winner {
                assert_eq!(*answer, Acquire::ConversationBusy, "racer {i}");
                // The chat is tried first: a loser never touched its user's row.
                assert_eq!(h.db.lock(Table::User, user).await, None, "racer {i}");
            }
        }
    })
}

#[test]
fn of_fifty_turns_of_one_user_in_fifty_chats_exactly_one_acquires() {
    run(async {
        let h: &'static Harness = shared().await;
        let user: Arc<str> = new_uuid().into();
        let racers: Vec<(String, String)> =
            h.db.insert_chats(RACERS)
                .await
                .into_iter()
                .map(|chat| (chat, new_turn_ref()))
                .collect();

        let answers = race(RACERS, |i| {
            let (user, (chat, turn)) = (Arc::clone(&user), racers[i].clone());
            async move { h.acquire(&chat, &user, &turn, TTL).await }
        })
        .await;

        let winner = the_one_winner(&answers, |a| *a == Acquire::Acquired);
        let (chat, turn) = &racers[winner];
        assert_eq!(h.db.user(&user).await.holder(), Some(turn.as_str()));
        assert!(h.held(chat, &user, turn).await);
        for (i, (answer, (chat, _))) in answers.iter().zip(&racers).enumerate() {
            if i != winner {
                assert_eq!(*answer, Acquire::TurnInFlight, "racer {i}");
                // Both or neither: a refused user lock leaves the chat free.
                assert!(h.db.chat(chat).await.is_free(), "chat of racer {i}");
            }
        }
    })
}

/// What a racer of the mixed race answered.
#[derive(Debug, PartialEq)]
enum Answer {
    Turn(Acquire),
    Click(AcquireUser),
}

#[test]
fn of_turns_and_clicks_racing_for_one_user_exactly_one_wins_and_the_losers_name_it() {
    run(async {
        let h: &'static Harness = shared().await;
        let user: Arc<str> = new_uuid().into();
        // Even racers are turns, each in a chat of its own; odd ones clicks.
        let mut racers: Vec<(Option<String>, String)> = Vec::with_capacity(RACERS);
        for i in 0..RACERS {
            racers.push(if i % 2 == 0 {
                (Some(h.db.insert_chat().await), new_turn_ref())
            } else {
                (None, new_click_ref())
            });
        }

        let answers = race(RACERS, |i| {
            let (user, racer) = (Arc::clone(&user), racers[i].clone());
            async move {
                match racer {
                    (Some(chat), turn) => Answer::Turn(h.acquire(&chat, &user, &turn, TTL).await),
                    (None, click) => Answer::Click(h.acquire_user(&user, &click, TTL, 10).await),
                }
            }
        })
        .await;

        let winner = the_one_winner(&answers, |a| {
            matches!(
                a,
                Answer::Turn(Acquire::Acquired) | Answer::Click(AcquireUser::Acquired)
            )
        });
        let winner_is_a_turn = racers[winner].0.is_some();
        assert_eq!(
            h.db.user(&user).await.holder(),
            Some(racers[winner].1.as_str())
        );
        for (i, (answer, (chat, _))) in answers.iter().zip(&racers).enumerate() {
            if i == winner {
                continue;
            }
            let expected = match (chat, winner_is_a_turn) {
                (Some(_), true) => Answer::Turn(Acquire::TurnInFlight),
                (Some(_), false) => Answer::Turn(Acquire::ClickInFlight),
                (None, true) => Answer::Click(AcquireUser::TurnInFlight),
                (None, false) => Answer::Click(AcquireUser::ClickInFlight),
            };
            assert_eq!(*answer, expected, "racer {i}");
            if let Some(chat) = chat {
                assert!(h.db.chat(chat).await.is_free(), "chat of racer {i}");
            }
        }
    })
}

#[test]
fn turns_queued_on_a_locked_chat_row_get_exactly_one_acquisition_when_it_is_freed() {
    // A barrier alone leaves it to the scheduler whether the calls overlap on
    // the server. Here every call is *made* to overlap: the chat row is
    // locked by a transaction of the test, all calls are seen waiting on it,
    // then it is released. Each call must re-check the lock on the row it
    // finally gets (`FOR UPDATE` under READ COMMITTED): had any judged the
    // chat free from its snapshot alone, several would acquire.
    const QUEUED: usize = SHARED_POOL_SIZE as usize / 2;
    run(async {
        let h: &'static Harness = shared().await;
        let chat: Arc<str> = h.db.insert_chat().await.into();
        // Open the connections first: the calls below must all reach the
        // server while the row is locked, not be still logging in.
        race(QUEUED, |_| async move {
            h.held(&new_uuid(), &new_uuid(), &new_turn_ref()).await
        })
        .await;
        let mut blocker = common::Db::connect().await;
        let (chats, _) = blocker.table(Table::Chat);
        let tx = blocker
            .client
            .transaction()
            .await
            .expect("a transaction opens");
        let blocker_pid: i32 = tx
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("the backend has a pid")
            .get(0);
        tx.execute(
            &format!("SELECT 1 FROM {chats} WHERE uuid = $1::text::uuid FOR UPDATE"),
            &[&&*chat],
        )
        .await
        .expect("the chat row can be locked");
        let racers: Vec<(String, String)> =
            (0..QUEUED).map(|_| (new_uuid(), new_turn_ref())).collect();

        let calls = race(QUEUED, |i| {
            let (chat, (user, turn)) = (Arc::clone(&chat), racers[i].clone());
            async move { h.acquire(&chat, &user, &turn, TTL).await }
        });
        let release = async {
            // Wait (at most 20 s, under the shared pool's 30 s statement
            // timeout) until every call is blocked behind the test's
            // transaction, then roll it back.
            // Only the first call waits on the transaction itself; the others
            // queue behind it for the row, hence the transitive count.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            let mut waiting = 0;
            while waiting < QUEUED as i64 && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                waiting =
                    h.db.client
                        .query_one(
                            "WITH RECURSIVE blocked(pid) AS (
                           SELECT pid FROM pg_stat_activity
                           WHERE $1::int4 = ANY(pg_blocking_pids(pid))
                           UNION
                           SELECT a.pid FROM pg_stat_activity a
                           JOIN blocked b ON b.pid = ANY(pg_blocking_pids(a.pid))
                         )
                         SELECT count(*) FROM blocked",
                            &[&blocker_pid],
                        )
                        .await
                        .expect("pg_stat_activity can be read")
                        .get::<_, i64>(0);
            }
            tx.rollback().await.expect("the transaction rolls back");
            waiting
        };
        let (answers, waiting) = tokio::join!(calls, release);

        assert_eq!(waiting, QUEUED as i64, "calls seen waiting on the row");
        let winner = the_one_winner(&answers, |a| *a == Acquire::Acquired);
        for (i, answer) in answers.iter().enumerate() {
            if i != winner {
                assert_eq!(*answer, Acquire::ConversationBusy, "racer {i}");
            }
        }
        let (user, turn) = &racers[winner];
        assert!(h.held(&chat, user, turn).await);
    })
}

#[test]
fn two_callers_releasing_the_same_stale_turn_free_it_exactly_once_every_round() {
    run(async {
        let h: &'static Harness = shared().await;
        let chat: Arc<str> = h.db.insert_chat().await.into();
        let user: Arc<str> = new_uuid().into();

        for round in 0..25 {
            let turn: Arc<str> = new_turn_ref().into();
            assert_eq!(h.acquire(&chat, &user, &turn, TTL).await, Acquire::Acquired);
            h.db.backdate(Table::Chat, &chat, TTL + 1).await;
            h.db.backdate(Table::User, &user, TTL + 1).await;

            let released = race(2, |_| {
                let (chat, user, turn) = (Arc::clone(&chat), Arc::clone(&user), Arc::clone(&turn));
                async move { h.release_stale(&chat, &user, &turn, TTL).await }
            })
            .await;

            assert_eq!(
                released.iter().filter(|&&r| r).count(),
                1,
                "round {round}: {released:?}"
            );
            assert!(h.db.chat(&chat).await.is_free(), "round {round}");
            assert!(h.db.user(&user).await.is_free(), "round {round}");
        }
    })
}

#[test]
fn turns_crossing_ten_chats_and_ten_users_never_fail_nor_hold_one_lock_without_the_other() {
    // Every (chat, user) pair at once: statements that lock rows of both
    // tables must never deadlock (40P01, which would come back as an error)
    // nor leave a lock behind without its pair.
    const SIDE: usize = 10;
    run(async {
        let h: &'static Harness = shared().await;
        let chats = h.db.insert_chats(SIDE).await;
        let users: Vec<String> = (0..SIDE).map(|_| new_uuid()).collect();
        // Racer k runs in chat k % SIDE for user k / SIDE.
        let turns: Vec<String> = (0..SIDE * SIDE).map(|_| new_turn_ref()).collect();
        let racer = |k: usize| (chats[k % SIDE].clone(), users[k / SIDE].clone());

        let answers = race(SIDE * SIDE, |k| {
            let ((chat, user), turn) = (racer(k), turns[k].clone());
            async move {
                h.locks
                    .acquire(
                        &common::uuid(&chat),
                        &common::uuid(&user),
                        common::turn(&turn),
                        common::ttl(TTL),
                    )
                    .await
            }
        })
        .await;

        let mut winners = Vec::new();
        for (k, answer) in answers.into_iter().enumerate() {
            match answer {
                Ok(Acquire::Acquired) => winners.push(k),
                Ok(_) => {}
                Err(e) => panic!("racer {k} failed: {e}"),
            }
        }
        assert!((1..=SIDE).contains(&winners.len()), "winners {winners:?}");
        for &k in &winners {
            let (chat, user) = racer(k);
            assert!(h.held(&chat, &user, &turns[k]).await, "winner {k}");
        }
        // Every lock taken is a winner's: no chat or user lock of a loser.
        let winning: Vec<&str> = winners.iter().map(|&k| turns[k].as_str()).collect();
        for chat in &chats {
            if let Some(holder) = h.db.chat(chat).await.holder() {
                assert!(winning.contains(&holder), "chat {chat} held by {holder}");
            }
        }
        for user in &users {
            if let Some(lock) = h.db.lock(Table::User, user).await {
                if let Some(holder) = lock.holder() {
                    assert!(winning.contains(&holder), "user {user} held by {holder}");
                }
            }
        }
    })
}
