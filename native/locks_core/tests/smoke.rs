//! A short run of every lock call against the test database (DATABASE_URL),
//! with named and with unnamed statements: the statements prepare, bind and
//! answer as the core reads them. What each call guarantees is the ExUnit
//! contract suite's business (test/phoenix_kit_agent/turns/locks/).

mod common;

use locks_core::{Answer, Busy, ClickRef, Hold, Job, LockPool, Prepare, Ttl, TurnRef, Uuid};

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
        let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
        half.copy_from_slice(&random.to_le_bytes());
    }
    bytes
}

fn insert_chat(pool: &LockPool, chat: &Uuid) {
    let text = format!("{chat:?}");
    pool.run_ddl(
        common::now(pool.settings()),
        &format!("INSERT INTO phoenix_kit_agent_conversations (uuid) VALUES ('{text}')"),
    )
    .expect("a chat row");
}

fn every_call(prepare: Prepare) {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL (scripts/pg start)");
    let mut settings = common::settings(&url);
    settings.prepare = prepare;
    let pool = LockPool::new(settings.clone()).expect("a pool");
    let at = || common::now(&settings);
    let (chat, other_chat, user) = (uuid(1), uuid(2), uuid(3));
    insert_chat(&pool, &chat);
    insert_chat(&pool, &other_chat);
    let (ttl, hold) =
        (Ttl::new(60).expect("ttl"), Hold::new(10, Ttl::new(60).expect("ttl")).expect("hold"));
    let full = Hold::new(60, ttl).expect("the whole TTL: locks dated now");
    let turn = TurnRef::new("smoke-turn").expect("a turn ref");
    let other = TurnRef::new("smoke-other").expect("a turn ref");
    let click = ClickRef::new("click:smoke").expect("a click ref");

    let run = |job: Job| pool.run(at(), &job).ok();
    let acquire =
        |chat: Uuid, user: Uuid, turn: &TurnRef| Job::Acquire(chat, user, turn.clone(), ttl, full);
    let (held, fresh) = (Job::Held(chat, user, turn.clone()), Job::Fresh(chat, turn.clone(), ttl));
    let (acquire_user, keep_user) = (
        Job::AcquireUser(user, click.clone(), ttl, hold),
        Job::KeepUser(user, click.clone(), ttl, hold),
    );

    assert_eq!(run(acquire(chat, user, &turn)), Some(Answer::Ok));
    assert_eq!(run(acquire(chat, uuid(4), &other)), Some(Answer::Busy(Busy::ConversationBusy)));
    assert_eq!(run(acquire(other_chat, user, &other)), Some(Answer::Busy(Busy::TurnInFlight)));
    assert_eq!(run(held.clone()), Some(Answer::Yes(true)));
    assert_eq!(run(fresh), Some(Answer::Yes(true)));
    let keep = Job::Keep(chat, user, turn.clone(), ttl, hold);
    assert_eq!(run(keep), Some(Answer::Yes(true)));
    // Every lock of the shared database: its rows are not this test's to count.
    assert!(matches!(run(Job::HeldLocks(ttl)), Some(Answer::Locks(_))));
    let release_stale = Job::ReleaseStale(chat, user, turn.clone(), ttl);
    assert_eq!(run(release_stale), Some(Answer::Yes(false)));
    assert_eq!(run(acquire_user.clone()), Some(Answer::Busy(Busy::TurnInFlight)));
    let release = Job::Release(chat, user, turn.clone());
    assert_eq!(run(release), Some(Answer::Ok));
    assert_eq!(run(held), Some(Answer::Yes(false)));
    assert_eq!(run(acquire_user), Some(Answer::Ok));
    assert_eq!(run(acquire(other_chat, user, &other)), Some(Answer::Busy(Busy::ClickInFlight)));
    assert_eq!(run(keep_user.clone()), Some(Answer::Yes(true)));
    let release_user = Job::ReleaseUser(user, click.clone());
    assert_eq!(run(release_user), Some(Answer::Ok));
    assert_eq!(run(keep_user), Some(Answer::Yes(false)));
}

// Plain tests: a pool's calls block their thread, driving their
// connection's own runtime, so they never run inside another runtime.
#[test]
fn every_call_answers_with_named_statements() {
    every_call(Prepare::Named);
}

#[test]
fn every_call_answers_with_unnamed_statements() {
    every_call(Prepare::Unnamed);
}
