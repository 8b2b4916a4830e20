//! The lock calls (`click_ref/0` is pure Elixir): take the turn, decode,
//! call the core on the dirty-I/O scheduler thread, encode the documented
//! term. Each takes the turn's token and the caller's stamp first (see
//! `call.rs`), then the arguments of the Elixir function.

use locks_core::{Acquire, AcquireUser, HeldLock};
use rustler::{Atom, Encoder, Env, NifResult, Term};

use crate::args::{click_ref, hold, ttl, turn_ref, uuid};
use crate::atoms;
use crate::call::Call;

fn refused(env: Env<'_>, reason: Atom) -> Term<'_> {
    (atoms::error(), reason).encode(env)
}

#[rustler::nif(schedule = "DirtyIo")]
fn acquire<'a>(
    env: Env<'a>,
    token: Term<'a>,
    start: Term<'a>,
    chat: Term<'a>,
    user: Term<'a>,
    turn: Term<'a>,
    ttl_s: Term<'a>,
) -> NifResult<Term<'a>> {
    let call = Call::enter(env, token, start)?;
    let (chat, user, turn, ttl) = (uuid(chat)?, uuid(user)?, turn_ref(turn)?, ttl(ttl_s)?);
    Ok(
        match call.run(|pool, deadline| pool.acquire(deadline, &chat, &user, turn, ttl))? {
            Acquire::Acquired => atoms::ok().encode(env),
            Acquire::ConversationBusy => refused(env, atoms::conversation_busy()),
            Acquire::TurnInFlight => refused(env, atoms::turn_in_flight()),
            Acquire::ClickInFlight => refused(env, atoms::click_in_flight()),
        },
    )
}

#[rustler::nif(schedule = "DirtyIo")]
fn acquire_user<'a>(
    env: Env<'a>,
    token: Term<'a>,
    start: Term<'a>,
    user: Term<'a>,
    click: Term<'a>,
    ttl_s: Term<'a>,
    hold_s: Term<'a>,
) -> NifResult<Term<'a>> {
    let call = Call::enter(env, token, start)?;
    let (user, click, ttl) = (uuid(user)?, click_ref(click)?, ttl(ttl_s)?);
    let hold = hold(hold_s, ttl)?;
    Ok(
        match call.run(|pool, deadline| pool.acquire_user(deadline, &user, click, ttl, hold))? {
            AcquireUser::Acquired => atoms::ok().encode(env),
            AcquireUser::TurnInFlight => refused(env, atoms::turn_in_flight()),
            AcquireUser::ClickInFlight => refused(env, atoms::click_in_flight()),
        },
    )
}

#[rustler::nif(schedule = "DirtyIo", name = "fresh?")]
fn fresh<'a>(
    env: Env<'a>,
    token: Term<'a>,
    start: Term<'a>,
    chat: Term<'a>,
    turn: Term<'a>,
    ttl_s: Term<'a>,
) -> NifResult<bool> {
    let call = Call::enter(env, token, start)?;
    let (chat, turn, ttl) = (uuid(chat)?, turn_ref(turn)?, ttl(ttl_s)?);
    call.run(|pool, deadline| pool.fresh(deadline, &chat, turn, ttl))
}

#[rustler::nif(schedule = "DirtyIo", name = "held?")]
fn held<'a>(
    env: Env<'a>,
    token: Term<'a>,
    start: Term<'a>,
    chat: Term<'a>,
    user: Term<'a>,
    turn: Term<'a>,
) -> NifResult<bool> {
    let call = Call::enter(env, token, start)?;
    let (chat, user, turn) = (uuid(chat)?, uuid(user)?, turn_ref(turn)?);
    call.run(|pool, deadline| pool.held(deadline, &chat, &user, turn))
}

#[rustler::nif(schedule = "DirtyIo")]
fn keep<'a>(
    env: Env<'a>,
    token: Term<'a>,
    start: Term<'a>,
    chat: Term<'a>,
    user: Term<'a>,
    turn: Term<'a>,
    ttl_s: Term<'a>,
) -> NifResult<bool> {
    let call = Call::enter(env, token, start)?;
    let (chat, user, turn, ttl) = (uuid(chat)?, uuid(user)?, turn_ref(turn)?, ttl(ttl_s)?);
    call.run(|pool, deadline| pool.keep(deadline, &chat, &user, turn, ttl))
}

/// Every lock taken: `[{:chat | :user, uuid, ref, since_us, age_s, stale}]`.
#[rustler::nif(schedule = "DirtyIo")]
fn held_locks<'a>(
    env: Env<'a>,
    token: Term<'a>,
    start: Term<'a>,
    ttl_s: Term<'a>,
) -> NifResult<Term<'a>> {
    let call = Call::enter(env, token, start)?;
    let ttl = ttl(ttl_s)?;
    let locks = call.run(|pool, deadline| pool.held_locks(deadline, ttl))?;
    Ok(locks
        .iter()
        .map(|lock: &HeldLock| {
            let kind = if lock.chat { atoms::chat() } else { atoms::user() };
            (kind, &lock.id, &lock.holder, lock.since_us, lock.age_s, lock.stale)
        })
        .collect::<Vec<_>>()
        .encode(env))
}

#[rustler::nif(schedule = "DirtyIo")]
fn keep_user<'a>(
    env: Env<'a>,
    token: Term<'a>,
    start: Term<'a>,
    user: Term<'a>,
    click: Term<'a>,
    ttl_s: Term<'a>,
    hold_s: Term<'a>,
) -> NifResult<bool> {
    let call = Call::enter(env, token, start)?;
    let (user, click, ttl) = (uuid(user)?, click_ref(click)?, ttl(ttl_s)?);
    let hold = hold(hold_s, ttl)?;
    call.run(|pool, deadline| pool.keep_user(deadline, &user, click, ttl, hold))
}

#[rustler::nif(schedule = "DirtyIo")]
fn release<'a>(
    env: Env<'a>,
    token: Term<'a>,
    start: Term<'a>,
    chat: Term<'a>,
    user: Term<'a>,
    turn: Term<'a>,
) -> NifResult<Atom> {
    let call = Call::enter(env, token, start)?;
    let (chat, user, turn) = (uuid(chat)?, uuid(user)?, turn_ref(turn)?);
    call.run(|pool, deadline| pool.release(deadline, &chat, &user, turn))?;
    Ok(atoms::ok())
}

#[rustler::nif(schedule = "DirtyIo")]
fn release_stale<'a>(
    env: Env<'a>,
    token: Term<'a>,
    start: Term<'a>,
    chat: Term<'a>,
    user: Term<'a>,
    turn: Term<'a>,
    ttl_s: Term<'a>,
) -> NifResult<bool> {
    let call = Call::enter(env, token, start)?;
    let (chat, user, turn, ttl) = (uuid(chat)?, uuid(user)?, turn_ref(turn)?, ttl(ttl_s)?);
    call.run(|pool, deadline| pool.release_stale(deadline, &chat, &user, turn, ttl))
}

#[rustler::nif(schedule = "DirtyIo")]
fn release_user<'a>(
    env: Env<'a>,
    token: Term<'a>,
    start: Term<'a>,
    user: Term<'a>,
    click: Term<'a>,
) -> NifResult<Atom> {
    let call = Call::enter(env, token, start)?;
    let (user, click) = (uuid(user)?, click_ref(click)?);
    call.run(|pool, deadline| pool.release_user(deadline, &user, click))?;
    Ok(atoms::ok())
}
