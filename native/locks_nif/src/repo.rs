//! `testing: :sandbox` (`locks_core::repo`): the statement of a lock call and
//! its parameters handed to the Elixir side (`Locks.Sandbox`), which runs
//! them through the host's repo in the calling process, and the repo's rows
//! read back into the call's answer. Nothing here waits: normal schedulers.

use std::sync::{Arc, PoisonError, RwLock};

use locks_core::repo::{Repo, Step};
use locks_core::{Error, Value};
use rustler::types::atom;
use rustler::{Atom, Encoder, Env, NifResult, Term, TermType};

use crate::atoms;
use crate::error::raise;
use crate::locks::{encode, job, job_and_terms};

/// The installed repo mode, replaced by each `repo_start/1`.
static REPO: RwLock<Option<Arc<Repo>>> = RwLock::new(None);

fn current() -> NifResult<Arc<Repo>> {
    let repo = REPO.read().unwrap_or_else(PoisonError::into_inner).clone();
    repo.ok_or_else(|| raise(Error::NotStarted))
}

/// Installs the repo mode for the tables under `prefix`; their columns are
/// read again at the next call.
#[rustler::nif]
fn repo_start(prefix: Option<String>) -> Atom {
    *REPO.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(Repo::new(prefix)));
    atoms::ok()
}

/// The fence of `Locks.transaction/4` for the repo mode's tables
/// (`locks_core::fence`).
#[rustler::nif]
fn repo_fence_sql() -> NifResult<String> {
    Ok(locks_core::fence(current()?.prefix(), false))
}

/// `{:columns, sql, params}` (run it, give its rows to `repo_columns/1`, ask
/// again) or `{:run, sql, params}` (run it, give its rows to `repo_answer/3`).
#[rustler::nif]
fn repo_step<'a>(env: Env<'a>, function: Term<'a>, args: Term<'a>) -> NifResult<Term<'a>> {
    let (job, terms) = job_and_terms(env, function, args)?;
    Ok(match current()?.step(&job).map_err(raise)? {
        Step::Columns(text, tables) => (atoms::columns(), text, &tables[..]).encode(env),
        Step::Run(text) => (atoms::run(), text, &terms[1..]).encode(env),
    })
}

#[rustler::nif]
fn repo_columns(rows: Vec<Vec<Term<'_>>>) -> NifResult<Atom> {
    current()?.columns(&values(rows)).map_err(raise)?;
    Ok(atoms::ok())
}

#[rustler::nif]
fn repo_answer<'a>(
    env: Env<'a>,
    function: Term<'a>,
    // Not `args`: rustler's macro reads its own `args` after this parameter.
    arguments: Term<'a>,
    rows: Vec<Vec<Term<'a>>>,
) -> NifResult<Term<'a>> {
    // :not_started without the repo mode, as every repo_* call.
    current()?;
    let answer = job(env, function, arguments)?.answer(&values(rows)).map_err(raise)?;
    Ok(encode(env, &answer))
}

fn values(rows: Vec<Vec<Term<'_>>>) -> Vec<Vec<Value>> {
    rows.into_iter().map(|row| row.into_iter().map(value).collect()).collect()
}

/// A column of a repo's row, as Postgrex decodes the types the statements
/// return (`boolean`, `text`, `int8`, `float8`, NULL as `nil`).
fn value(term: Term<'_>) -> Value {
    let other = || Value::Other(format!("{term:?}"));
    match term.get_type() {
        TermType::Atom if term == atom::nil().to_term(term.get_env()) => Value::Null,
        TermType::Atom => term.decode().map(Value::Bool).unwrap_or_else(|_| other()),
        TermType::Integer => term.decode().map(Value::Int).unwrap_or_else(|_| other()),
        TermType::Float => term.decode().map(Value::Float).unwrap_or_else(|_| other()),
        TermType::Binary => term.decode().map(Value::Text).unwrap_or_else(|_| other()),
        _ => other(),
    }
}
