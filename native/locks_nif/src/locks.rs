//! The lock calls as terms: the name of an Elixir function (an atom) and its
//! argument list become a `locks_core::Job`, decoded by its derive, and the
//! job's `Answer` becomes the term the function documents.

use std::sync::OnceLock;

use locks_core::{Answer, Job};
use rustler::types::tuple::make_tuple;
use rustler::{Atom, Decoder, Encoder, Env, Error, NifResult, Term};

use crate::atoms;

/// The job of `function` (one of `Job::functions`) with `args`, each
/// argument decoded by its rule (`locks_core::args`); anything else (another
/// function or arity, an improper list, an argument that breaks its rule) is
/// a bad argument, and nothing is sent for it.
pub fn job<'a>(env: Env<'a>, function: Term<'a>, args: Term<'a>) -> NifResult<Job> {
    Ok(job_and_terms(env, function, args)?.0)
}

/// The job, and the terms it was decoded from: its tag, then its fields in
/// their order, which from the second on are its statement's parameters
/// (`testing: :sandbox` sends them through the repo).
pub fn job_and_terms<'a>(
    env: Env<'a>,
    function: Term<'a>,
    args: Term<'a>,
) -> NifResult<(Job, Vec<Term<'a>>)> {
    let function: Atom = function.decode()?;
    let known = tags(env)?.iter().find(|(atom, ..)| *atom == function);
    let &(_, name, tag) = known.ok_or(Error::BadArg)?;
    // An improper list is a bad argument: rustler's list decoding would panic.
    let mut terms = Vec::with_capacity(args.list_length()? + 2);
    terms.push(tag.encode(env));
    terms.extend(args.into_list_iterator()?);
    // acquire/4: the whole TTL as the hold, its locks dated now.
    if name == "acquire" && terms.len() == 5 {
        terms.push(terms[4]);
    }
    let job = Job::decode(make_tuple(env, &terms)).ok().and_then(Job::checked);
    Ok((job.ok_or(Error::BadArg)?, terms))
}

/// Each lock function's atom, its name and its job's tag (the name without
/// its `?`), made once: a call compares atoms, and neither copies a name
/// nor looks one up in the VM's atom table.
fn tags(env: Env<'_>) -> NifResult<&'static [(Atom, &'static str, Atom)]> {
    static TAGS: OnceLock<Vec<(Atom, &'static str, Atom)>> = OnceLock::new();
    if let Some(tags) = TAGS.get() {
        return Ok(tags);
    }
    let atom = |name: &str| Atom::from_str(env, name);
    let tags = Job::functions()
        .map(|name| Ok((atom(name)?, name, atom(name.trim_end_matches('?'))?)))
        .collect::<NifResult<Vec<_>>>()?;
    Ok(TAGS.get_or_init(|| tags))
}

pub fn encode<'a>(env: Env<'a>, answer: &Answer) -> Term<'a> {
    match answer {
        Answer::Ok => atoms::ok().encode(env),
        Answer::Busy(busy) => (atoms::error(), busy).encode(env),
        Answer::Yes(yes) => yes.encode(env),
        Answer::Locks(locks) => locks.encode(env),
    }
}
