//! A short run of every lock call against the test database (DATABASE_URL),
//! with named and with unnamed statements: the statements prepare, bind and
//! answer as the core reads them. What each call guarantees is the ExUnit
//! contract suite's business (test/phoenix_kit_agent/turns/locks/).

mod common;

use locks_core::{Acquire, AcquireUser, ClickRef, Hold, LockPool, Prepare, Ttl, TurnRef, Uuid};

fn uuid(byte: u8) -> Uuid {
    let mut bytes = rand_bytes();
    bytes[0] = byte;
    Uuid::from_bytes(&bytes).expect("16 bytes")
}

/// 16 bytes that differ between runs (a new uuid for every test row).
fn rand_bytes() -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let mut bytes = [0u8; 16];
    for half in bytes.chunks_mut(8) {
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        half.copy_from_slice(&random.to_le_bytes());
    }
    bytes
}

async fn insert_chat(pool: &LockPool, chat: &Uuid) {
    let text = format!("{chat:?}");
    pool.run_ddl(
        common::now(pool.settings()),
        &format!("INSERT INTO phoenix_kit_agent_conversations (uuid) VALUES ('{text}')"),
    )
    .await
    .expect("a chat row");
}

async fn every_call(prepare: Prepare) {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL (scripts/pg start)");
    let mut settings = common::settings(&url);
    settings.prepare = prepare;
    let pool = LockPool::new(settings.clone()).expect("a pool");
    let at = || common::now(&settings);
    let (chat, other_chat, user) = (uuid(1), uuid(2), uuid(3));
    insert_chat(&pool, &chat).await;
    insert_chat(&pool, &other_chat).await;
    let (ttl, hold) = (
        Ttl::new(60).expect("ttl"),
        Hold::new(10, Ttl::new(60).expect("ttl")).expect("hold"),
    );
    let turn = TurnRef::new("smoke-turn").expect("a turn ref");
    let other = TurnRef::new("smoke-other").expect("a turn ref");
    let click = ClickRef::new("click:smoke").expect("a click ref");

    assert_eq!(
        pool.acquire(at(), &chat, &user, &turn, ttl).await.ok(),
        Some(Acquire::Acquired)
    );
    assert_eq!(
        pool.acquire(at(), &chat, &uuid(4), &other, ttl).await.ok(),
        Some(Acquire::ConversationBusy)
    );
    assert_eq!(
        pool.acquire(at(), &other_chat, &user, &other, ttl)
            .await
            .ok(),
        Some(Acquire::TurnInFlight)
    );
    assert_eq!(pool.held(at(), &chat, &user, &turn).await.ok(), Some(true));
    assert_eq!(pool.fresh(at(), &chat, &turn, ttl).await.ok(), Some(true));
    assert_eq!(
        pool.release_stale(at(), &chat, &user, &turn, ttl)
            .await
            .ok(),
        Some(false)
    );
    assert_eq!(
        pool.acquire_user(at(), &user, &click, ttl, hold).await.ok(),
        Some(AcquireUser::TurnInFlight)
    );
    assert!(pool.release(at(), &chat, &user, &turn).await.is_ok());
    assert_eq!(pool.held(at(), &chat, &user, &turn).await.ok(), Some(false));
    assert_eq!(
        pool.acquire_user(at(), &user, &click, ttl, hold).await.ok(),
        Some(AcquireUser::Acquired)
    );
    assert_eq!(
        pool.acquire(at(), &other_chat, &user, &other, ttl)
            .await
            .ok(),
        Some(Acquire::ClickInFlight)
    );
    assert_eq!(
        pool.keep_user(at(), &user, &click, ttl, hold).await.ok(),
        Some(true)
    );
    assert!(pool.release_user(at(), &user, &click).await.is_ok());
    assert_eq!(
        pool.keep_user(at(), &user, &click, ttl, hold).await.ok(),
        Some(false)
    );
}

#[tokio::test]
async fn every_call_answers_with_named_statements() {
    every_call(Prepare::Named).await;
}

#[tokio::test]
async fn every_call_answers_with_unnamed_statements() {
    every_call(Prepare::Unnamed).await;
}
