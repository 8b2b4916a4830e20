//! [`LockPool`]: a pool of connections and the statements; [`LockPool::run`] sends a job's one statement.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool::managed::{self, Metrics, Object, PoolError, RecycleError, RecycleResult};
use once_cell::sync::OnceCell;
use tokio_postgres::types::{FromSql, ToSql};
use tokio_postgres::Row;

use crate::connect::{Conn, Connector};
use crate::error::{Error, Result};
use crate::job::{Answer, Job};

use crate::schema::{self, Column, Tables};
use crate::settings::{Prepare, Settings};
use crate::sql::{self, Def, Statement, Statements};

/// The one deadline of a call: its caller's start plus
/// [`Settings::call_timeout`]. Every wait of the call (its turn, the
/// connection, the statement, retries) ends by it.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    at: Instant,
    budget: Duration,
}

impl Deadline {
    /// The deadline of a call its caller made at `started`.
    pub fn new(started: Instant, settings: &Settings) -> Self {
        let budget = settings.call_timeout();
        Deadline { at: started + budget, budget }
    }

    /// The earlier of two deadlines.
    pub fn min(self, other: Deadline) -> Deadline {
        std::cmp::min_by_key(self, other, |deadline| deadline.at)
    }
}

/// The lock calls, over a pool of PostgreSQL connections.
///
/// Building one connects nothing; calls open connections as they need them.
/// The first call of a pool reads the tables' columns (see `schema.rs`) and
/// builds the statements; from then on a call is one round trip. A call
/// that times out or loses its connection never hands it on (`discard`).
pub struct LockPool {
    pool: managed::Pool<Manager>,
    connector: Connector,
    settings: Settings,
    statements: OnceCell<Arc<Statements>>,
}

/// Opens and checks connections for deadpool.
struct Manager {
    connector: Connector,
}

impl managed::Manager for Manager {
    type Type = Conn;
    type Error = Error;

    async fn create(&self) -> Result<Conn> {
        self.connector.open().await
    }

    /// A checkout costs no round trip: a connection whose socket ended is
    /// known to be closed (its task saw the end) and is replaced.
    async fn recycle(&self, conn: &mut Conn, _: &Metrics) -> RecycleResult<Error> {
        if conn.client.is_closed() {
            Err(RecycleError::message("closed"))
        } else {
            Ok(())
        }
    }
}

impl LockPool {
    /// Builds the pool (reading the CA file, if one is set, unless TLS is off). Does not connect.
    pub fn new(settings: Settings) -> Result<Self> {
        let connector = Connector::new(&settings)?;
        let pool = managed::Pool::builder(Manager { connector: connector.clone() })
            .max_size(settings.pool_size)
            .build()
            .map_err(|e| Error::config("pool_size", e.to_string()))?;
        Ok(LockPool { pool, connector, settings, statements: OnceCell::new() })
    }

    /// The settings this pool was built from.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Closes the pool: connections are dropped as they come back, and every
    /// later call fails with [`Error::NotStarted`].
    pub fn close(&self) {
        self.pool.close();
    }

    /// Runs the statement of `def` with `params` on a pooled connection; its rows.
    async fn query(
        &self,
        deadline: Deadline,
        def: &Def,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>> {
        let mut held = None;
        let answer = tokio::time::timeout_at(deadline.at.into(), async {
            let conn = held.insert(self.checkout().await?);
            let statements = self.statements(conn).await?;
            // Every job's statement is one of sql::LOCKS (a test of sql.rs holds it).
            let statement = statements.get(def).ok_or_else(|| unexpected(def.name.into()))?;
            loop {
                match run(conn, self.settings.prepare, statement, params).await {
                    Err(err) if err.is_retryable() => continue,
                    answer => return answer,
                }
            }
        })
        .await;
        match answer {
            Ok(Err(err)) if err.lost_connection() => {
                if let Some(conn) = held {
                    self.discard(conn, false).await;
                }
                Err(err)
            }
            Ok(answer) => answer,
            Err(_elapsed) => {
                if let Some(conn) = held {
                    self.discard(conn, true).await;
                }
                Err(Error::Timeout(deadline.budget))
            }
        }
    }

    async fn checkout(&self) -> Result<Object<Manager>> {
        self.pool.get().await.map_err(|err| match err {
            PoolError::Backend(err) => err,
            PoolError::Closed => Error::NotStarted,
            other => Error::Connect(other.to_string()),
        })
    }

    /// Takes a connection out of the pool for good, in an unknown state (its
    /// statement may still be running, or be on its way): closes it, asks
    /// the server to cancel the statement when `cancel`, and closes the idle
    /// connections that have not heard from the server since the statement
    /// was sent: their path is in doubt too, whenever they were opened (one
    /// opened just before the path went silent is as dead), while one that
    /// answered since (a login, another call) has shown its path works.
    async fn discard(&self, conn: Object<Manager>, cancel: bool) {
        let conn = Object::take(conn);
        let sent = conn.sent;
        if cancel {
            self.connector.cancel_in_background(conn.client.cancel_token());
        }
        drop(conn);
        let _ = self.pool.retain(|idle, _| idle.answered > sent);
        // Let the runtime drop the aborted connection tasks now, which
        // resets their sockets, rather than at the next call.
        crate::global::catch_up().await;
    }

    /// The statements, built on the first call from the tables' columns.
    async fn statements(&self, conn: &mut Conn) -> Result<Arc<Statements>> {
        if let Some(statements) = self.statements.get() {
            return Ok(statements.clone());
        }
        let prefix = self.settings.prefix.as_deref();
        let (chats, users) = schema::table_names(prefix);
        let columns = Statement {
            name: sql::COLUMNS.name,
            text: sql::COLUMNS.text.to_owned(),
            params: sql::COLUMNS.params,
        };
        let columns = run(conn, self.settings.prepare, &columns, &[&chats, &users])
            .await?
            .iter()
            .map(|row| {
                Ok(Column {
                    chats: get(row, 0)?,
                    name: get(row, 1)?,
                    type_name: get(row, 2)?,
                    not_null: get(row, 3)?,
                    has_default: get(row, 4)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let statements = Arc::new(Statements::new(&Tables::from_columns(prefix, &columns)?));
        Ok(self.statements.get_or_init(|| statements).clone())
    }

    /// Runs `job`'s one statement within `deadline` (see [`Job`] for what
    /// each one does, `sql.rs` for how); its answer.
    pub async fn run(&self, deadline: Deadline, job: &Job) -> Result<Answer> {
        let rows = self.query(deadline, job.statement(), &job.params()).await?;
        job.answer(&rows)
    }

    /// Connections in the pool, and those of them idle.
    pub fn connections(&self) -> (usize, usize) {
        let status = self.pool.status();
        (status.size, status.available)
    }

    /// Runs DDL text (from [`crate::schema`]) as one simple-protocol batch.
    pub async fn run_ddl(&self, deadline: Deadline, ddl: &str) -> Result<()> {
        let answer = tokio::time::timeout_at(deadline.at.into(), async {
            let conn = self.checkout().await?;
            conn.client.batch_execute(ddl).await.map_err(|e| Error::in_flight(&e))
        })
        .await;
        answer.unwrap_or(Err(Error::Timeout(deadline.budget)))
    }
}

/// Sends `statement` on `conn`: by name (prepared on the connection the first
/// time) or unnamed with its parameters' types, in one round trip. Notes
/// when it was sent and, unless the connection was lost, when the server
/// answered (see `discard`).
async fn run(
    conn: &mut Conn,
    prepare: Prepare,
    statement: &Statement,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>> {
    conn.sent = Instant::now();
    let rows = async {
        if prepare == Prepare::Unnamed {
            let typed: Vec<_> = params
                .iter()
                .zip(statement.params)
                .map(|(value, ty)| (*value, ty.clone()))
                .collect();
            return conn.client.query_typed(&statement.text, &typed).await;
        }
        let prepared = match conn.prepared.iter().find(|(name, _)| *name == statement.name) {
            Some((_, prepared)) => prepared.clone(),
            None => {
                let prepared = conn.client.prepare_typed(&statement.text, statement.params).await?;
                conn.prepared.push((statement.name, prepared.clone()));
                prepared
            }
        };
        conn.client.query(&prepared, params).await
    }
    .await
    .map_err(|e| Error::in_flight(&e));
    if !matches!(rows, Err(Error::Disconnected(_))) {
        conn.answered = Instant::now();
    }
    rows
}

/// The only row of a statement that returns exactly one.
pub(crate) fn only(rows: &[Row]) -> Result<&Row> {
    match rows {
        [row] => Ok(row),
        _ => Err(unexpected(format!("{} rows where one was expected", rows.len()))),
    }
}

/// Column `i` of `row`.
pub(crate) fn get<'a, T: FromSql<'a>>(row: &'a Row, i: usize) -> Result<T> {
    row.try_get(i).map_err(|e| unexpected(e.to_string()))
}

/// An answer the statement should not have given: the tables are not what
/// the statements were built for (they changed under a running pool).
fn unexpected(reason: String) -> Error {
    Error::config("tables", format!("unexpected answer ({reason}); restart the application"))
}
