//! The nine lock calls (`click_ref/0` is pure Elixir): decode, call the core
//! on the dirty-I/O scheduler thread, encode the documented term.

use locks_core::{global, Acquire, AcquireUser};
use rustler::{Atom, Encoder, Env, NifResult, Term};

use crate::args::{click_ref, hold, queued_at_us, ttl, turn_ref, uuid};
use crate::atoms;
use crate::error::raise;

/// Runs one core call on the installed pool, within what is left of the
/// caller's timeout since `queued_at` (see `global::call`), mapping every
/// error once.
macro_rules! call {
    ($queued_at:expr, |$locks:ident| $body:expr) => {{
        let queued_at = queued_at_us($queued_at)?;
        let $locks = global::current().map_err(raise)?;
        global::call(&$locks, queued_at, $body).map_err(raise)?
    }};
}

fn refused(reason: Atom) -> (Atom, Atom) {
    (atoms::error(), reason)
}

#[rustler::nif(schedule = "DirtyIo")]
fn acquire<'a>(
    env: Env<'a>,
    chat: Term<'a>,
    user: Term<'a>,
    turn: Term<'a>,
    ttl_s: Term<'a>,
    queued_at: Term<'a>,
) -> NifResult<Term<'a>> {
    let (chat, user) = (uuid("conversation_uuid", chat)?, uuid("user_uuid", user)?);
    let (turn, ttl) = (turn_ref(turn)?, ttl(ttl_s)?);
    Ok(
        match call!(queued_at, |locks| locks.acquire(&chat, &user, turn, ttl)) {
            Acquire::Acquired => atoms::ok().encode(env),
            Acquire::ConversationBusy => refused(atoms::conversation_busy()).encode(env),
            Acquire::TurnInFlight => refused(atoms::turn_in_flight()).encode(env),
            Acquire::ClickInFlight => refused(atoms::click_in_flight()).encode(env),
        },
    )
}

#[rustler::nif(schedule = "DirtyIo")]
fn acquire_user<'a>(
    env: Env<'a>,
    user: Term<'a>,
    click: Term<'a>,
    ttl_s: Term<'a>,
    hold_s: Term<'a>,
    queued_at: Term<'a>,
) -> NifResult<Term<'a>> {
    let (user, click) = (uuid("user_uuid", user)?, click_ref(click)?);
    let ttl = ttl(ttl_s)?;
    let hold = hold(hold_s, ttl)?;
    Ok(
        match call!(queued_at, |locks| locks
            .acquire_user(&user, click, ttl, hold))
        {
            AcquireUser::Acquired => atoms::ok().encode(env),
            AcquireUser::TurnInFlight => refused(atoms::turn_in_flight()).encode(env),
            AcquireUser::ClickInFlight => refused(atoms::click_in_flight()).encode(env),
        },
    )
}

#[rustler::nif(schedule = "DirtyIo")]
fn fresh(chat: Term<'_>, turn: Term<'_>, ttl_s: Term<'_>, queued_at: Term<'_>) -> NifResult<bool> {
    let chat = uuid("conversation_uuid", chat)?;
    let (turn, ttl) = (turn_ref(turn)?, ttl(ttl_s)?);
    Ok(call!(queued_at, |locks| locks.fresh(&chat, turn, ttl)))
}

#[rustler::nif(schedule = "DirtyIo")]
fn held(chat: Term<'_>, user: Term<'_>, turn: Term<'_>, queued_at: Term<'_>) -> NifResult<bool> {
    let (chat, user) = (uuid("conversation_uuid", chat)?, uuid("user_uuid", user)?);
    let turn = turn_ref(turn)?;
    Ok(call!(queued_at, |locks| locks.held(&chat, &user, turn)))
}

#[rustler::nif(schedule = "DirtyIo")]
fn keep_user(
    user: Term<'_>,
    click: Term<'_>,
    ttl_s: Term<'_>,
    hold_s: Term<'_>,
    queued_at: Term<'_>,
) -> NifResult<bool> {
    let (user, click) = (uuid("user_uuid", user)?, click_ref(click)?);
    let ttl = ttl(ttl_s)?;
    let hold = hold(hold_s, ttl)?;
    Ok(call!(queued_at, |locks| locks.keep_user(&user, click, ttl, hold)))
}

#[rustler::nif(schedule = "DirtyIo")]
fn release(chat: Term<'_>, user: Term<'_>, turn: Term<'_>, queued_at: Term<'_>) -> NifResult<Atom> {
    let (chat, user) = (uuid("conversation_uuid", chat)?, uuid("user_uuid", user)?);
    let turn = turn_ref(turn)?;
    call!(queued_at, |locks| locks.release(&chat, &user, turn));
    Ok(atoms::ok())
}

#[rustler::nif(schedule = "DirtyIo")]
fn release_stale(
    chat: Term<'_>,
    user: Term<'_>,
    turn: Term<'_>,
    ttl_s: Term<'_>,
    queued_at: Term<'_>,
) -> NifResult<bool> {
    let (chat, user) = (uuid("conversation_uuid", chat)?, uuid("user_uuid", user)?);
    let (turn, ttl) = (turn_ref(turn)?, ttl(ttl_s)?);
    Ok(call!(queued_at, |locks| locks
        .release_stale(&chat, &user, turn, ttl)))
}

#[rustler::nif(schedule = "DirtyIo")]
fn release_user(user: Term<'_>, click: Term<'_>, queued_at: Term<'_>) -> NifResult<Atom> {
    let (user, click) = (uuid("user_uuid", user)?, click_ref(click)?);
    call!(queued_at, |locks| locks.release_user(&user, click));
    Ok(atoms::ok())
}
