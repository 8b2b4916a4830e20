//! Every statement of the library against a real PostgreSQL, one behaviour of
//! the contract per test. Staleness is made by backdating `busy_since`.

mod common;

use common::{new_click_ref, new_turn_ref, new_uuid, run, shared, Table, TTL};
use locks_core::{Acquire, AcquireUser};

/// How long a statement may plausibly take between taking a lock and the test
/// reading its age back; ages are asserted within this margin.
const SLACK: f64 = 5.0;

/// Asserts that `age` is `expected` seconds, give or take the test's own delay.
fn assert_age(age: f64, expected: f64) {
    assert!(
        (expected..expected + SLACK).contains(&age),
        "age {age} s, expected {expected} s (+ up to {SLACK} s)"
    );
}

// ---------------------------------------------------------------- acquire

#[test]
fn acquire_takes_the_chat_and_the_user_lock_for_the_turn() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (
            h.db.insert_chat().await,
            h.db.insert_user().await,
            new_turn_ref(),
        );

        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);

        let (chat_lock, user_lock) = (h.db.chat(&chat).await, h.db.user(&user).await);
        assert_eq!(chat_lock.holder(), Some(t.as_str()));
        assert_age(chat_lock.age(), 0.0);
        assert_eq!(user_lock.holder(), Some(t.as_str()));
        assert_age(user_lock.age(), 0.0);
        assert!(h.held(&chat, &user, &t).await);
    })
}

#[test]
fn acquire_creates_the_user_settings_row_when_the_user_has_none() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (h.db.insert_chat().await, new_uuid(), new_turn_ref());
        assert_eq!(h.db.lock(Table::User, &user).await, None);

        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);

        let created = h.db.user(&user).await;
        assert_eq!(created.holder(), Some(t.as_str()));
        assert_age(created.age(), 0.0);
    })
}

#[test]
fn a_second_turn_in_the_same_chat_is_conversation_busy_and_takes_neither_lock() {
    run(async {
        let h = shared().await;
        let chat = h.db.insert_chat().await;
        let (user_a, turn_a) = (new_uuid(), new_turn_ref());
        let (user_b, turn_b) = (new_uuid(), new_turn_ref());
        assert_eq!(
            h.acquire(&chat, &user_a, &turn_a, TTL).await,
            Acquire::Acquired
        );

        assert_eq!(
            h.acquire(&chat, &user_b, &turn_b, TTL).await,
            Acquire::ConversationBusy
        );

        // The chat is tried first: its refusal leaves the other user's row absent.
        assert_eq!(h.db.lock(Table::User, &user_b).await, None);
        assert_eq!(h.db.chat(&chat).await.holder(), Some(turn_a.as_str()));
        assert!(h.held(&chat, &user_a, &turn_a).await);
    })
}

#[test]
fn a_second_turn_of_the_same_user_in_the_same_chat_is_conversation_busy() {
    run(async {
        let h = shared().await;
        let (chat, user) = (h.db.insert_chat().await, new_uuid());
        let (turn_a, turn_b) = (new_turn_ref(), new_turn_ref());
        assert_eq!(
            h.acquire(&chat, &user, &turn_a, TTL).await,
            Acquire::Acquired
        );

        // The chat answers before the user: not `TurnInFlight`.
        assert_eq!(
            h.acquire(&chat, &user, &turn_b, TTL).await,
            Acquire::ConversationBusy
        );
        assert!(h.held(&chat, &user, &turn_a).await);
    })
}

#[test]
fn a_busy_chat_leaves_an_existing_free_user_row_untouched() {
    run(async {
        let h = shared().await;
        let chat = h.db.insert_chat().await;
        let (holder, holder_turn) = (new_uuid(), new_turn_ref());
        assert_eq!(
            h.acquire(&chat, &holder, &holder_turn, TTL).await,
            Acquire::Acquired
        );
        let user = h.db.insert_user().await;

        assert_eq!(
            h.acquire(&chat, &user, &new_turn_ref(), TTL).await,
            Acquire::ConversationBusy
        );

        assert!(h.db.user(&user).await.is_free());
    })
}

#[test]
fn a_turn_of_the_user_in_another_chat_is_turn_in_flight_and_leaves_the_chat_free() {
    run(async {
        let h = shared().await;
        let (chat_a, chat_b, user) = (
            h.db.insert_chat().await,
            h.db.insert_chat().await,
            new_uuid(),
        );
        let (turn_a, turn_b) = (new_turn_ref(), new_turn_ref());
        assert_eq!(
            h.acquire(&chat_a, &user, &turn_a, TTL).await,
            Acquire::Acquired
        );

        assert_eq!(
            h.acquire(&chat_b, &user, &turn_b, TTL).await,
            Acquire::TurnInFlight
        );

        assert!(h.db.chat(&chat_b).await.is_free());
        assert_eq!(h.db.user(&user).await.holder(), Some(turn_a.as_str()));
        assert!(h.held(&chat_a, &user, &turn_a).await);
    })
}

#[test]
fn a_click_of_the_user_is_click_in_flight_and_leaves_the_chat_free() {
    run(async {
        let h = shared().await;
        let (chat, user, c) = (h.db.insert_chat().await, new_uuid(), new_click_ref());
        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );

        assert_eq!(
            h.acquire(&chat, &user, &new_turn_ref(), TTL).await,
            Acquire::ClickInFlight
        );

        assert!(h.db.chat(&chat).await.is_free());
        assert_eq!(h.db.user(&user).await.holder(), Some(c.as_str()));
    })
}

#[test]
fn acquire_takes_over_a_chat_lock_older_than_its_ttl() {
    run(async {
        let h = shared().await;
        let (chat, user) = (h.db.insert_chat().await, new_uuid());
        let (lost, next) = (new_turn_ref(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &lost, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::Chat, &chat, TTL + 1).await;
        h.db.backdate(Table::User, &user, TTL + 1).await;

        assert_eq!(h.acquire(&chat, &user, &next, TTL).await, Acquire::Acquired);

        let chat_lock = h.db.chat(&chat).await;
        assert_eq!(chat_lock.holder(), Some(next.as_str()));
        assert_age(chat_lock.age(), 0.0);
        assert_eq!(h.db.user(&user).await.holder(), Some(next.as_str()));
        assert!(!h.held(&chat, &user, &lost).await);
    })
}

#[test]
fn acquire_does_not_take_over_a_chat_lock_younger_than_its_ttl() {
    run(async {
        let h = shared().await;
        let chat = h.db.insert_chat().await;
        let (user, running) = (new_uuid(), new_turn_ref());
        assert_eq!(
            h.acquire(&chat, &user, &running, TTL).await,
            Acquire::Acquired
        );
        h.db.backdate(Table::Chat, &chat, TTL - SLACK as i64).await;

        assert_eq!(
            h.acquire(&chat, &new_uuid(), &new_turn_ref(), TTL).await,
            Acquire::ConversationBusy
        );
        assert_eq!(h.db.chat(&chat).await.holder(), Some(running.as_str()));
    })
}

#[test]
fn acquire_takes_over_a_user_lock_older_than_its_ttl_from_another_chat() {
    run(async {
        let h = shared().await;
        let (chat_a, chat_b, user) = (
            h.db.insert_chat().await,
            h.db.insert_chat().await,
            new_uuid(),
        );
        let (lost, next) = (new_turn_ref(), new_turn_ref());
        assert_eq!(
            h.acquire(&chat_a, &user, &lost, TTL).await,
            Acquire::Acquired
        );
        h.db.backdate(Table::User, &user, TTL + 1).await;

        assert_eq!(
            h.acquire(&chat_b, &user, &next, TTL).await,
            Acquire::Acquired
        );

        let user_lock = h.db.user(&user).await;
        assert_eq!(user_lock.holder(), Some(next.as_str()));
        assert_age(user_lock.age(), 0.0);
        assert!(!h.held(&chat_a, &user, &lost).await);
    })
}

#[test]
fn a_stale_chat_lock_is_left_as_it_was_when_the_user_lock_is_refused() {
    run(async {
        let h = shared().await;
        let (chat, other_chat) = (h.db.insert_chat().await, h.db.insert_chat().await);
        let (lost_user, lost) = (new_uuid(), new_turn_ref());
        let (user, running) = (new_uuid(), new_turn_ref());
        assert_eq!(
            h.acquire(&chat, &lost_user, &lost, TTL).await,
            Acquire::Acquired
        );
        h.db.backdate(Table::Chat, &chat, TTL + 30).await;
        assert_eq!(
            h.acquire(&other_chat, &user, &running, TTL).await,
            Acquire::Acquired
        );

        // The chat could be taken over, but the user's lock cannot: neither is.
        assert_eq!(
            h.acquire(&chat, &user, &new_turn_ref(), TTL).await,
            Acquire::TurnInFlight
        );

        let chat_lock = h.db.chat(&chat).await;
        assert_eq!(chat_lock.holder(), Some(lost.as_str()));
        assert_age(chat_lock.age(), (TTL + 30) as f64);
        assert_eq!(h.db.user(&user).await.holder(), Some(running.as_str()));
    })
}

#[test]
fn acquire_of_a_conversation_without_a_row_is_conversation_busy() {
    run(async {
        let h = shared().await;
        let (chat, user) = (new_uuid(), new_uuid());

        assert_eq!(
            h.acquire(&chat, &user, &new_turn_ref(), TTL).await,
            Acquire::ConversationBusy
        );

        assert_eq!(h.db.lock(Table::Chat, &chat).await, None);
        assert_eq!(h.db.lock(Table::User, &user).await, None);
    })
}

#[test]
fn the_holder_acquiring_again_succeeds_and_redates_both_locks() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (h.db.insert_chat().await, new_uuid(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::Chat, &chat, 30).await;
        h.db.backdate(Table::User, &user, 30).await;

        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);

        assert_age(h.db.chat(&chat).await.age(), 0.0);
        assert_age(h.db.user(&user).await.age(), 0.0);
    })
}

#[test]
fn a_mixed_case_uuid_addresses_the_same_rows() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (h.db.insert_chat().await, new_uuid(), new_turn_ref());
        let (chat_upper, user_upper) = (chat.to_uppercase(), user.to_uppercase());
        let user_mixed: String = user
            .chars()
            .enumerate()
            .map(|(i, c)| {
                if i % 2 == 0 {
                    c.to_ascii_uppercase()
                } else {
                    c
                }
            })
            .collect();

        assert_eq!(
            h.acquire(&chat_upper, &user_upper, &t, TTL).await,
            Acquire::Acquired
        );
        assert_eq!(h.db.chat(&chat).await.holder(), Some(t.as_str()));
        assert_eq!(h.db.user(&user).await.holder(), Some(t.as_str()));
        assert!(h.held(&chat, &user_mixed, &t).await);
        assert!(h.fresh(&chat_upper, &t, TTL).await);

        h.release(&chat, &user_mixed, &t).await;
        assert!(h.db.chat(&chat).await.is_free());
        assert!(h.db.user(&user).await.is_free());
    })
}

// ----------------------------------------------------------- acquire_user

#[test]
fn acquire_user_creates_the_row_and_dates_the_lock_back_by_ttl_minus_hold() {
    run(async {
        let h = shared().await;
        let (user, c) = (new_uuid(), new_click_ref());

        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );

        let lock = h.db.user(&user).await;
        assert_eq!(lock.holder(), Some(c.as_str()));
        assert_age(lock.age(), (TTL - 10) as f64);
    })
}

#[test]
fn acquire_user_with_a_hold_equal_to_the_ttl_is_not_dated_back() {
    run(async {
        let h = shared().await;
        let (user, c) = (h.db.insert_user().await, new_click_ref());

        assert_eq!(
            h.acquire_user(&user, &c, TTL, TTL).await,
            AcquireUser::Acquired
        );

        assert_age(h.db.user(&user).await.age(), 0.0);
    })
}

#[test]
fn acquire_user_is_turn_in_flight_while_a_turn_holds_the_user_lock() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (h.db.insert_chat().await, new_uuid(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);

        assert_eq!(
            h.acquire_user(&user, &new_click_ref(), TTL, 10).await,
            AcquireUser::TurnInFlight
        );
        assert!(h.held(&chat, &user, &t).await);
    })
}

#[test]
fn acquire_user_is_click_in_flight_while_another_click_holds_the_lock() {
    run(async {
        let h = shared().await;
        let (user, first) = (new_uuid(), new_click_ref());
        assert_eq!(
            h.acquire_user(&user, &first, TTL, 10).await,
            AcquireUser::Acquired
        );

        assert_eq!(
            h.acquire_user(&user, &new_click_ref(), TTL, 10).await,
            AcquireUser::ClickInFlight
        );
        assert_eq!(h.db.user(&user).await.holder(), Some(first.as_str()));
    })
}

#[test]
fn the_click_holding_the_lock_acquiring_again_succeeds_and_redates_it() {
    run(async {
        let h = shared().await;
        let (user, c) = (new_uuid(), new_click_ref());
        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );
        h.db.backdate(Table::User, &user, 5).await;

        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );

        let lock = h.db.user(&user).await;
        assert_eq!(lock.holder(), Some(c.as_str()));
        assert_age(lock.age(), (TTL - 10) as f64);
    })
}

#[test]
fn a_turn_takes_over_a_click_lock_hold_seconds_after_it_was_taken() {
    run(async {
        let h = shared().await;
        let (chat, user, c, t) = (
            h.db.insert_chat().await,
            new_uuid(),
            new_click_ref(),
            new_turn_ref(),
        );
        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );
        h.db.backdate(Table::User, &user, 10 - SLACK as i64).await;
        assert_eq!(
            h.acquire(&chat, &user, &t, TTL).await,
            Acquire::ClickInFlight
        );

        h.db.backdate(Table::User, &user, SLACK as i64 + 1).await;

        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);
        assert!(h.held(&chat, &user, &t).await);
    })
}

#[test]
fn acquire_user_takes_over_a_turn_lock_older_than_the_ttl() {
    run(async {
        let h = shared().await;
        let (chat, user, t, c) = (
            h.db.insert_chat().await,
            new_uuid(),
            new_turn_ref(),
            new_click_ref(),
        );
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::User, &user, TTL - SLACK as i64).await;
        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::TurnInFlight
        );

        h.db.backdate(Table::User, &user, SLACK as i64 + 1).await;

        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );
        assert_eq!(h.db.user(&user).await.holder(), Some(c.as_str()));
        assert!(!h.held(&chat, &user, &t).await);
    })
}

// -------------------------------------------------------------- keep_user

#[test]
fn keep_user_redates_the_click_lock_while_the_click_holds_it() {
    run(async {
        let h = shared().await;
        let (user, c) = (new_uuid(), new_click_ref());
        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );
        h.db.backdate(Table::User, &user, 8).await;
        assert_age(h.db.user(&user).await.age(), (TTL - 2) as f64);

        assert!(h.keep_user(&user, &c, TTL, 10).await);

        let lock = h.db.user(&user).await;
        assert_eq!(lock.holder(), Some(c.as_str()));
        assert_age(lock.age(), (TTL - 10) as f64);
    })
}

#[test]
fn keep_user_is_false_once_the_click_lock_was_released() {
    run(async {
        let h = shared().await;
        let (user, c) = (new_uuid(), new_click_ref());
        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );
        h.release_user(&user, &c).await;

        assert!(!h.keep_user(&user, &c, TTL, 10).await);
        assert!(h.db.user(&user).await.is_free());
    })
}

#[test]
fn keep_user_is_false_once_a_turn_took_the_lock_over() {
    run(async {
        let h = shared().await;
        let (chat, user, c, t) = (
            h.db.insert_chat().await,
            new_uuid(),
            new_click_ref(),
            new_turn_ref(),
        );
        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );
        h.db.backdate(Table::User, &user, 11).await;
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);

        assert!(!h.keep_user(&user, &c, TTL, 10).await);

        let lock = h.db.user(&user).await;
        assert_eq!(lock.holder(), Some(t.as_str()));
        assert_age(lock.age(), 0.0);
    })
}

#[test]
fn keep_user_of_a_user_without_a_row_is_false_and_creates_none() {
    run(async {
        let h = shared().await;
        let user = new_uuid();

        assert!(!h.keep_user(&user, &new_click_ref(), TTL, 10).await);
        assert_eq!(h.db.lock(Table::User, &user).await, None);
    })
}

// ---------------------------------------------------------------- release

#[test]
fn release_frees_both_locks_of_the_holder() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (h.db.insert_chat().await, new_uuid(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);

        h.release(&chat, &user, &t).await;

        assert!(h.db.chat(&chat).await.is_free());
        assert!(h.db.user(&user).await.is_free());
        assert!(!h.held(&chat, &user, &t).await);
        assert_eq!(
            h.acquire(&chat, &new_uuid(), &new_turn_ref(), TTL).await,
            Acquire::Acquired
        );
    })
}

#[test]
fn release_by_another_ref_frees_nothing() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (h.db.insert_chat().await, new_uuid(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);

        h.release(&chat, &user, &new_turn_ref()).await;

        assert!(h.held(&chat, &user, &t).await);
    })
}

#[test]
fn a_late_release_does_not_free_the_turn_that_took_over() {
    run(async {
        let h = shared().await;
        let (chat, user) = (h.db.insert_chat().await, new_uuid());
        let (late, next) = (new_turn_ref(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &late, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::Chat, &chat, TTL + 1).await;
        h.db.backdate(Table::User, &user, TTL + 1).await;
        assert_eq!(h.acquire(&chat, &user, &next, TTL).await, Acquire::Acquired);

        h.release(&chat, &user, &late).await;

        assert!(h.held(&chat, &user, &next).await);
    })
}

#[test]
fn release_frees_the_user_lock_the_turn_still_holds_when_its_chat_was_taken_over() {
    run(async {
        let h = shared().await;
        let chat = h.db.insert_chat().await;
        let (user, late) = (new_uuid(), new_turn_ref());
        let (other_user, next) = (new_uuid(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &late, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::Chat, &chat, TTL + 1).await;
        assert_eq!(
            h.acquire(&chat, &other_user, &next, TTL).await,
            Acquire::Acquired
        );

        h.release(&chat, &user, &late).await;

        assert!(h.db.user(&user).await.is_free());
        assert_eq!(h.db.chat(&chat).await.holder(), Some(next.as_str()));
        assert!(h.held(&chat, &other_user, &next).await);
    })
}

// ---------------------------------------------------------- release_stale

#[test]
fn release_stale_frees_a_stale_turn_exactly_once() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (h.db.insert_chat().await, new_uuid(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::Chat, &chat, TTL + 1).await;

        assert!(h.release_stale(&chat, &user, &t, TTL).await);
        assert!(!h.release_stale(&chat, &user, &t, TTL).await);

        assert!(h.db.chat(&chat).await.is_free());
        assert!(h.db.user(&user).await.is_free());
    })
}

#[test]
fn release_stale_leaves_a_turn_younger_than_the_ttl_alone() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (h.db.insert_chat().await, new_uuid(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::Chat, &chat, TTL - SLACK as i64).await;

        assert!(!h.release_stale(&chat, &user, &t, TTL).await);

        assert!(h.held(&chat, &user, &t).await);
    })
}

#[test]
fn release_stale_of_a_turn_that_was_taken_over_frees_nothing() {
    run(async {
        let h = shared().await;
        let (chat, user) = (h.db.insert_chat().await, new_uuid());
        let (lost, next) = (new_turn_ref(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &lost, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::Chat, &chat, TTL + 1).await;
        h.db.backdate(Table::User, &user, TTL + 1).await;
        assert_eq!(h.acquire(&chat, &user, &next, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::Chat, &chat, TTL + 1).await;

        // `next` is stale too, but `lost` no longer holds the chat.
        assert!(!h.release_stale(&chat, &user, &lost, TTL).await);

        assert!(h.held(&chat, &user, &next).await);
    })
}

#[test]
fn release_stale_frees_the_chat_but_not_a_user_lock_held_by_someone_else() {
    run(async {
        let h = shared().await;
        let (chat, user, t, c) = (
            h.db.insert_chat().await,
            new_uuid(),
            new_turn_ref(),
            new_click_ref(),
        );
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::Chat, &chat, TTL + 1).await;
        h.db.backdate(Table::User, &user, TTL + 1).await;
        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );

        assert!(h.release_stale(&chat, &user, &t, TTL).await);

        assert!(h.db.chat(&chat).await.is_free());
        assert_eq!(h.db.user(&user).await.holder(), Some(c.as_str()));
    })
}

// ----------------------------------------------------------- release_user

#[test]
fn release_user_frees_the_click_lock_of_its_holder() {
    run(async {
        let h = shared().await;
        let (user, c) = (new_uuid(), new_click_ref());
        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );

        h.release_user(&user, &c).await;

        assert!(h.db.user(&user).await.is_free());
        assert_eq!(
            h.acquire_user(&user, &new_click_ref(), TTL, 10).await,
            AcquireUser::Acquired
        );
    })
}

#[test]
fn release_user_by_another_click_frees_nothing() {
    run(async {
        let h = shared().await;
        let (user, c) = (new_uuid(), new_click_ref());
        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );

        h.release_user(&user, &new_click_ref()).await;

        assert_eq!(h.db.user(&user).await.holder(), Some(c.as_str()));
    })
}

// ------------------------------------------------------------------ held

#[test]
fn held_is_false_once_either_lock_is_lost() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (h.db.insert_chat().await, new_uuid(), new_turn_ref());
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);
        assert!(h.held(&chat, &user, &t).await);
        assert!(!h.held(&chat, &user, &new_turn_ref()).await);
        assert!(!h.held(&chat, &new_uuid(), &t).await);
        assert!(!h.held(&new_uuid(), &user, &t).await);

        // The user's lock alone taken over by a click: the chat is still `t`'s.
        h.db.backdate(Table::User, &user, TTL + 1).await;
        assert_eq!(
            h.acquire_user(&user, &new_click_ref(), TTL, 10).await,
            AcquireUser::Acquired
        );

        assert_eq!(h.db.chat(&chat).await.holder(), Some(t.as_str()));
        assert!(!h.held(&chat, &user, &t).await);
    })
}

// ----------------------------------------------------------------- fresh

#[test]
fn fresh_is_true_only_for_the_holder_of_a_chat_lock_younger_than_the_ttl() {
    run(async {
        let h = shared().await;
        let (chat, user, t) = (h.db.insert_chat().await, new_uuid(), new_turn_ref());
        assert!(!h.fresh(&chat, &t, TTL).await);
        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);

        assert!(h.fresh(&chat, &t, TTL).await);
        assert!(!h.fresh(&chat, &new_turn_ref(), TTL).await);
        assert!(!h.fresh(&new_uuid(), &t, TTL).await);

        h.db.backdate(Table::Chat, &chat, TTL - SLACK as i64).await;
        assert!(h.fresh(&chat, &t, TTL).await);

        h.db.backdate(Table::Chat, &chat, SLACK as i64 + 1).await;
        assert!(!h.fresh(&chat, &t, TTL).await);
    })
}

// ------------------------------------------------------------ updated_at

#[test]
fn no_call_changes_updated_at_of_a_user_settings_row() {
    run(async {
        let h = shared().await;
        let (chat, user, t, c) = (
            h.db.insert_chat().await,
            h.db.insert_user().await,
            new_turn_ref(),
            new_click_ref(),
        );
        // A time no statement could write by accident (not now(), not NULL).
        h.db.set_updated_at(&user, "2001-02-03 04:05:06.789+00")
            .await;
        let before = h.db.updated_at(&user).await;

        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);
        assert_eq!(h.db.updated_at(&user).await, before, "after acquire");
        assert!(h.held(&chat, &user, &t).await);
        h.release(&chat, &user, &t).await;
        assert_eq!(h.db.updated_at(&user).await, before, "after release");

        assert_eq!(h.acquire(&chat, &user, &t, TTL).await, Acquire::Acquired);
        h.db.backdate(Table::Chat, &chat, TTL + 1).await;
        assert!(h.release_stale(&chat, &user, &t, TTL).await);
        assert_eq!(h.db.updated_at(&user).await, before, "after release_stale");

        assert_eq!(
            h.acquire_user(&user, &c, TTL, 10).await,
            AcquireUser::Acquired
        );
        assert_eq!(h.db.updated_at(&user).await, before, "after acquire_user");
        assert_eq!(
            h.acquire(&chat, &user, &new_turn_ref(), TTL).await,
            Acquire::ClickInFlight
        );
        assert_eq!(
            h.db.updated_at(&user).await,
            before,
            "after a refused acquire"
        );
        assert!(h.keep_user(&user, &c, TTL, 10).await);
        assert_eq!(h.db.updated_at(&user).await, before, "after keep_user");
        h.release_user(&user, &c).await;
        assert_eq!(h.db.updated_at(&user).await, before, "after release_user");
    })
}
