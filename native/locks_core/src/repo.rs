//! `testing: :sandbox`: the lock statements run through the host's Ecto repo
//! (its `query/3`, in the calling process) instead of on the pool's
//! connections, so that a host's tests see them inside their Ecto SQL
//! Sandbox transaction and they roll back with it.
//!
//! Nothing here connects or runs anything: [`Repo`] hands out what to send
//! and reads what came back, and the Elixir side (`Locks.Sandbox`) runs it.
//! What is sent is what the pool sends: the statement texts of `sql.rs`,
//! filled for the host's tables by [`Statements`], which are built from the
//! tables' columns read through the repo too (the first call sends
//! [`sql::COLUMNS`] before its own statement). Its parameters are the call's
//! own arguments, as the NIF decoded the [`Job`] from them: the job's fields
//! in their order, which is its statement's (see [`Job`]). The answer is read
//! by [`Job::answer`], the pool's own reading, from [`Value`] rows.

use once_cell::sync::OnceCell;

use crate::error::Result;
use crate::job::Job;
use crate::row::Value;
use crate::schema::{self, Catalog, Tables};
use crate::sql::{self, Statements};

/// The lock statements of one host repo, built at its first call.
#[derive(Debug)]
pub struct Repo {
    prefix: Option<String>,
    statements: OnceCell<Statements>,
}

/// What the repo must run next for a call: a statement's text, `$1`… for
/// its parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The tables' columns, with the two tables' names as the parameters
    /// ([`Repo::columns`] takes its rows); then the call again.
    Columns(String, [String; 2]),
    /// The call's own statement, with the call's arguments as the parameters
    /// ([`Job::answer`] reads its rows).
    Run(String),
}

impl Repo {
    /// The statements of the tables under `prefix` (the repo's, or the
    /// `prefix` setting), read at the first call.
    pub fn new(prefix: Option<String>) -> Self {
        Repo { prefix, statements: OnceCell::new() }
    }

    /// The schema of the tables, as given to [`Repo::new`].
    pub fn prefix(&self) -> Option<&str> {
        self.prefix.as_deref()
    }

    /// What to run for `job`: the tables' columns while they have not been
    /// read, then the job's statement.
    pub fn step(&self, job: &Job) -> Result<Step> {
        let Some(statements) = self.statements.get() else {
            let (chats, users) = schema::table_names(self.prefix.as_deref());
            return Ok(Step::Columns(sql::COLUMNS.text.to_owned(), [chats, users]));
        };
        Ok(Step::Run(statements.get(job.statement().0)?.to_owned()))
    }

    /// Builds the statements from the rows of [`Step::Columns`]' query; a
    /// table that cannot be used is the pool's `Config` error.
    pub fn columns(&self, rows: &[Vec<Value>]) -> Result<()> {
        let tables = Tables::from_catalog(self.prefix.as_deref(), &Catalog::from_rows(rows)?)?;
        let _ = self.statements.set(Statements::new(&tables, false));
        Ok(())
    }
}
