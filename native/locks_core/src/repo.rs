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
//! [`sql::COLUMNS`] before its own statement); the parameters are the job's
//! own ([`Job::params`]), in their order. The answer is read by
//! [`Job::answer`], the pool's own reading, from [`Value`] rows.

use bytes::BytesMut;
use once_cell::sync::OnceCell;
use std::sync::Arc;
use tokio_postgres::types::{IsNull, ToSql, Type};

use crate::error::{Error, Result};
use crate::job::{Answer, Job};
use crate::row::Value;
use crate::schema::{self, Catalog, Tables};
use crate::sql::{self, Statements};

/// The lock statements of one host repo, built at its first call.
#[derive(Debug)]
pub struct Repo {
    prefix: Option<String>,
    statements: OnceCell<Arc<Statements>>,
}

/// A statement to run through the repo: its text and its parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Query {
    /// The statement's text, `$1`… for its parameters.
    pub text: String,
    /// The parameters, in the order of their `$n`.
    pub params: Vec<Param>,
}

/// A parameter, as Postgrex takes it for its column type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Param {
    /// `uuid`: its 16 bytes (Postgrex takes no other form).
    Uuid([u8; 16]),
    /// `text`.
    Text(String),
    /// `int4`.
    Int(i32),
}

/// What the repo must run next for a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The tables' columns ([`Repo::columns`] takes its rows); then the call again.
    Columns(Query),
    /// The call's own statement ([`Repo::answer`] reads its rows).
    Run(Query),
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
            let text = sql::COLUMNS.text.to_owned();
            return Ok(Step::Columns(Query {
                text,
                params: vec![Param::Text(chats), Param::Text(users)],
            }));
        };
        let def = job.statement();
        let statement = statements.get(def)?;
        let params = job
            .params()
            .into_iter()
            .zip(statement.def.params)
            .map(|(value, ty)| param(value, ty))
            .collect::<Result<_>>()?;
        Ok(Step::Run(Query { text: statement.text.clone(), params }))
    }

    /// Builds the statements from the rows of [`Step::Columns`]' query; a
    /// table that cannot be used is the pool's `Config` error.
    pub fn columns(&self, rows: &[Vec<Value>]) -> Result<()> {
        let tables = Tables::from_catalog(self.prefix.as_deref(), &Catalog::from_rows(rows)?)?;
        let _ = self.statements.set(Arc::new(Statements::new(&tables)));
        Ok(())
    }

    /// `job`'s answer in the rows its [`Step::Run`] statement returned.
    pub fn answer(&self, job: &Job, rows: &[Vec<Value>]) -> Result<Answer> {
        job.answer(rows)
    }
}

/// A parameter as the pool sends it (its binary encoding for `ty`), read
/// back: the same value, whichever way the statement goes.
fn param(value: &(dyn ToSql + Sync), ty: &Type) -> Result<Param> {
    let mut bytes = BytesMut::new();
    let encoded =
        value.to_sql_checked(ty, &mut bytes).map_err(|e| Error::unexpected(e.to_string()))?;
    let odd = || Error::unexpected(format!("a parameter of type {ty} the repo cannot be given"));
    if matches!(encoded, IsNull::Yes) {
        return Err(odd());
    }
    if *ty == Type::UUID {
        <[u8; 16]>::try_from(&bytes[..]).map(Param::Uuid).map_err(|_| odd())
    } else if *ty == Type::TEXT {
        String::from_utf8(bytes.to_vec()).map(Param::Text).map_err(|_| odd())
    } else if *ty == Type::INT4 {
        <[u8; 4]>::try_from(&bytes[..])
            .map(|b| Param::Int(i32::from_be_bytes(b)))
            .map_err(|_| odd())
    } else {
        Err(odd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Busy;

    #[test]
    fn the_repo_runs_the_pools_statement_text_with_the_jobs_parameters() {
        let repo = Repo::new(Some("phoenix_kit".into()));
        let [job, _, _, _, _, keep_user, ..] = sql::tests::every_job();
        let columns = repo.step(&job).ok();
        let names = vec![
            Param::Text("\"phoenix_kit\".phoenix_kit_agent_conversations".into()),
            Param::Text("\"phoenix_kit\".phoenix_kit_agent_user_settings".into()),
        ];
        assert_eq!(
            columns,
            Some(Step::Columns(Query { text: sql::COLUMNS.text.into(), params: names }))
        );

        assert!(repo.columns(&schema::tests::shipped_rows()).is_ok());
        let tables = Tables::from_catalog(Some("phoenix_kit"), &schema::tests::shipped()).ok();
        let text = tables.map(|tables| sql::ACQUIRE.fill(&tables).text);
        let params = vec![
            Param::Uuid([1; 16]),
            Param::Uuid([2; 16]),
            Param::Text("turn".into()),
            Param::Int(60),
            Param::Int(10),
        ];
        assert_eq!(repo.step(&job).ok(), text.map(|text| Step::Run(Query { text, params })));

        let rows = vec![vec![Value::Bool(false), Value::Text("click:1".into())]];
        assert_eq!(repo.answer(&job, &rows).ok(), Some(Answer::Busy(Busy::ClickInFlight)));
        assert_eq!(repo.answer(&keep_user, &[]).ok(), Some(Answer::Yes(false)));
    }

    #[test]
    fn tables_the_statements_cannot_use_are_the_pools_config_error() {
        let repo = Repo::new(None);
        let mut columns = schema::tests::shipped_rows();
        columns.retain(|c| c.get(2) != Some(&Value::Text("busy_turn_ref".into())));
        let err = repo.columns(&columns).err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.starts_with(
                "invalid configuration: phoenix_kit_agent_conversations: has no column busy_turn_ref"
            )),
            "{err:?}"
        );
    }
}
