//! The lock calls as terms: the name of an Elixir function (an atom) and its
//! argument list become a `locks_core::Job`, and the job's `Answer` becomes
//! the term the function documents.

use locks_core::{Acquire, AcquireUser, Answer, ClickRef, Hold, Job, Ttl, TurnRef, Uuid};
use rustler::{Atom, Binary, Encoder, Env, Error, NifResult, Term};

use crate::atoms;

pub fn job(function: Term<'_>, args: Term<'_>) -> NifResult<Job> {
    let f: Atom = function.decode()?;
    // An improper list is a bad argument: rustler's list decoding would panic.
    args.list_length()?;
    let args: Vec<Term<'_>> = args.decode()?;
    // Arguments named by their first letter: chat, user, turn or click ref,
    // seconds of the TTL, hold (checked against the TTL).
    let click = |u, r, s, h| -> NifResult<_> {
        let ttl = ttl(s)?;
        Ok((uuid(u)?, click_ref(r)?, ttl, hold(h, ttl)?))
    };
    // A turn's lock with a hold (acquire/5, keep/5).
    let lease = |c, u, t, s, h| -> NifResult<_> {
        let ttl = ttl(s)?;
        Ok((uuid(c)?, uuid(u)?, turn_ref(t)?, ttl, hold(h, ttl)?))
    };
    Ok(match args[..] {
        // acquire/4: the whole TTL as the hold, its locks dated now.
        [c, u, t, s] if f == atoms::acquire() => {
            let ttl = ttl(s)?;
            Job::Acquire {
                chat: uuid(c)?,
                user: uuid(u)?,
                turn: turn_ref(t)?,
                ttl,
                hold: Hold::full(ttl),
            }
        }
        [c, u, t, s, h] if f == atoms::acquire() => {
            let (chat, user, turn, ttl, hold) = lease(c, u, t, s, h)?;
            Job::Acquire { chat, user, turn, ttl, hold }
        }
        [c, u, t, s, h] if f == atoms::keep() => {
            let (chat, user, turn, ttl, hold) = lease(c, u, t, s, h)?;
            Job::Keep { chat, user, turn, ttl, hold }
        }
        [c, u, t, s] if f == atoms::release_stale() => {
            Job::ReleaseStale { chat: uuid(c)?, user: uuid(u)?, turn: turn_ref(t)?, ttl: ttl(s)? }
        }
        [u, r, s, h] if f == atoms::acquire_user() => {
            let (user, click, ttl, hold) = click(u, r, s, h)?;
            Job::AcquireUser { user, click, ttl, hold }
        }
        [u, r, s, h] if f == atoms::keep_user() => {
            let (user, click, ttl, hold) = click(u, r, s, h)?;
            Job::KeepUser { user, click, ttl, hold }
        }
        [c, u, t] if f == atoms::held() => {
            Job::Held { chat: uuid(c)?, user: uuid(u)?, turn: turn_ref(t)? }
        }
        [c, u, t] if f == atoms::release() => {
            Job::Release { chat: uuid(c)?, user: uuid(u)?, turn: turn_ref(t)? }
        }
        [c, t, s] if f == atoms::fresh() => {
            Job::Fresh { chat: uuid(c)?, turn: turn_ref(t)?, ttl: ttl(s)? }
        }
        [s] if f == atoms::held_locks() => Job::HeldLocks { ttl: ttl(s)? },
        [u, r] if f == atoms::release_user() => {
            Job::ReleaseUser { user: uuid(u)?, click: click_ref(r)? }
        }
        _ => return Err(Error::BadArg),
    })
}

pub fn encode<'a>(env: Env<'a>, answer: &Answer) -> Term<'a> {
    let refused = |reason: Atom| (atoms::error(), reason).encode(env);
    match answer {
        Answer::Acquire(Acquire::Acquired)
        | Answer::AcquireUser(AcquireUser::Acquired)
        | Answer::Done => atoms::ok().encode(env),
        Answer::Acquire(Acquire::ConversationBusy) => refused(atoms::conversation_busy()),
        Answer::Acquire(Acquire::TurnInFlight) | Answer::AcquireUser(AcquireUser::TurnInFlight) => {
            refused(atoms::turn_in_flight())
        }
        Answer::Acquire(Acquire::ClickInFlight)
        | Answer::AcquireUser(AcquireUser::ClickInFlight) => refused(atoms::click_in_flight()),
        Answer::Yes(yes) => yes.encode(env),
        Answer::Locks(locks) => locks
            .iter()
            .map(|lock| {
                let kind = if lock.chat { atoms::chat() } else { atoms::user() };
                (kind, &lock.id, &lock.holder, lock.since_us, lock.age_s, lock.stale)
            })
            .collect::<Vec<_>>()
            .encode(env),
    }
}

// The arguments. The Elixir API has checked and worded each one (and made
// uuids their 16 bytes); a term that still does not fit (or any other
// function or argument list) is a bad argument, and nothing is sent for it.

fn uuid(term: Term<'_>) -> NifResult<Uuid> {
    Uuid::from_bytes(term.decode::<Binary>()?.as_slice()).ok_or(Error::BadArg)
}

fn turn_ref(term: Term<'_>) -> NifResult<TurnRef> {
    TurnRef::new(term.decode()?).ok_or(Error::BadArg)
}

fn click_ref(term: Term<'_>) -> NifResult<ClickRef> {
    ClickRef::new(term.decode()?).ok_or(Error::BadArg)
}

fn ttl(term: Term<'_>) -> NifResult<Ttl> {
    Ttl::new(term.decode()?).ok_or(Error::BadArg)
}

fn hold(term: Term<'_>, ttl: Ttl) -> NifResult<Hold> {
    Hold::new(term.decode()?, ttl).ok_or(Error::BadArg)
}
