//! [`LockPool`]: a pool of connections and the statements; [`LockPool::run`] sends a job's one statement.

use std::future::Future;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use once_cell::sync::OnceCell;
use tokio::runtime::Runtime;
use tokio_postgres::types::ToSql;

use crate::connect::{Conn, Connector};
use crate::error::{Error, Result};
use crate::job::{Answer, Job};
use crate::row::{values, Value};
use crate::schema::{self, Catalog, Tables};
use crate::settings::{Prepare, Settings, TargetServerType};
use crate::sql::{self, Def, Statements};

/// The one deadline of a call: its caller's start plus the longest it may
/// take, the checkout, connect and statement timeouts together. Every wait
/// of the call (its place in line, the connection, the statement, retries)
/// ends by it.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    at: Instant,
    budget: Duration,
}

impl Deadline {
    /// The deadline of a call its caller made at `started`.
    pub fn new(started: Instant, settings: &Settings) -> Self {
        let ms = settings.checkout_timeout.saturating_add(settings.connect_timeout);
        let budget = Duration::from_millis(ms.saturating_add(settings.statement_timeout));
        Deadline { at: started + budget, budget }
    }

    /// Whether it has passed.
    pub fn passed(&self) -> bool {
        Instant::now() >= self.at
    }

    /// Whichever of the two comes first: a call run for another caller
    /// ends by that caller's deadline and by the running one's.
    pub fn earlier(self, other: Deadline) -> Deadline {
        std::cmp::min_by_key(self, other, |deadline| deadline.at)
    }

    /// `future`'s result, or [`Error::Timeout`] if the deadline passes
    /// first. Polled inside a runtime, whose timer it needs.
    async fn bound<T>(self, future: impl Future<Output = Result<T>>) -> Result<T> {
        let answer = tokio::time::timeout_at(self.at.into(), future).await;
        answer.unwrap_or(Err(Error::Timeout(self.budget)))
    }
}

/// The lock calls, over a pool of PostgreSQL connections.
///
/// Building one connects nothing; calls open connections as they need them.
/// The first call of a pool reads the tables' columns (see `schema.rs`) and
/// builds the statements; from then on a call is one round trip. A call
/// that times out or loses its connection never hands it on (`discard`).
///
/// Each connection has a current-thread tokio runtime of its own, which
/// only the call holding the connection drives, on the calling thread (a
/// dirty-I/O scheduler's): it writes the statement, waits in `epoll` and
/// reads the answer there, as libpq would, and no thread waits for another
/// or wakes another. Between calls nobody drives a connection, so what
/// happened to it meanwhile (the server closed it) is caught up at its
/// next checkout, and it is replaced; one peek at its socket tells whether
/// there is anything to catch up (see `Conn::quiet`). The pool waits for
/// nothing: the queue (`queue.rs`) lets in at most `pool_size` calls, so a
/// call finds an idle connection or room for a new one; the queue is the
/// one line.
pub struct LockPool {
    conns: Mutex<Conns>,
    connector: Connector,
    settings: Settings,
    statements: OnceCell<Statements>,
}

/// The pool's connections: the idle ones, how many are open (idle or in a
/// call), and whether the pool was closed.
#[derive(Default)]
struct Conns {
    idle: Vec<Pooled>,
    open: usize,
    closed: bool,
}

impl LockPool {
    /// Builds the pool (reading the CA file, if one is set, unless TLS is off). Does not connect.
    pub fn new(settings: Settings) -> Result<Self> {
        let connector = Connector::new(&settings)?;
        Ok(LockPool { conns: Mutex::default(), connector, settings, statements: OnceCell::new() })
    }

    fn conns(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The settings this pool was built from.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Closes the pool: the idle connections now (their sockets are reset),
    /// the others as their calls end; every later call fails with
    /// [`Error::NotStarted`].
    pub fn close(&self) {
        drop({
            let mut conns = self.conns();
            conns.closed = true;
            conns.open -= conns.idle.len();
            std::mem::take(&mut conns.idle)
        });
    }

    /// Runs `job`'s one statement within `deadline` on a pooled connection,
    /// driving it on this thread (see [`Job`] for what each one does,
    /// `sql.rs` for how); its answer. Blocks: never call it inside a tokio
    /// runtime.
    pub fn run(&self, deadline: Deadline, job: &Job) -> Result<Answer> {
        let (def, params) = job.statement();
        loop {
            let mut pooled = self.checkout(deadline)?;
            let Pooled { conn, runtime } = &mut pooled;
            let answer = runtime.block_on(deadline.bound(async {
                let text = self.statements(conn).await?.get(def)?;
                loop {
                    match run(conn, self.settings.prepare, def, text, &params).await {
                        Err(err) if err.is_retryable() => continue,
                        answer => return answer,
                    }
                }
            }));
            // A `Timeout` is the deadline's (the statement's own failures are
            // `Statement` or `Disconnected`): the statement may still be running.
            match answer {
                Err(err @ (Error::Disconnected(_) | Error::Timeout(_))) => {
                    self.discard(pooled, matches!(err, Error::Timeout(_)));
                    return Err(err);
                }
                // Its server is no longer the primary: none of its
                // connections is kept. Under `Primary` the call tries the
                // servers again (each login asks, so this one is passed
                // over), as long as its deadline lasts; every round consumes
                // a connection or opens one.
                Err(err) if err.is_read_only() => {
                    self.leave(pooled);
                    if self.settings.target_server_type == TargetServerType::Any {
                        return Err(err);
                    }
                }
                rows => {
                    self.checkin(pooled);
                    return match rows {
                        Err(err) if err.is_row_locked() => job.locked(),
                        rows => job.answer(&rows?),
                    };
                }
            }
        }
    }

    /// An idle connection that the server has not closed (one whose socket
    /// holds something is caught up first), or a new one within `deadline`.
    fn checkout(&self, deadline: Deadline) -> Result<Pooled> {
        loop {
            let idle = {
                let mut conns = self.conns();
                if conns.closed {
                    return Err(Error::NotStarted);
                }
                let idle = conns.idle.pop();
                if idle.is_none() {
                    conns.open += 1;
                }
                idle
            };
            let Some(pooled) = idle else {
                // Counted open above; uncounted if it fails.
                let opened = Pooled::open(&self.connector, deadline);
                if opened.is_err() {
                    self.conns().open -= 1;
                }
                return opened;
            };
            if !pooled.conn.quiet() {
                pooled.runtime.block_on(catch_up());
            }
            if !pooled.conn.client.is_closed() {
                return Ok(pooled);
            }
            self.conns().open -= 1;
        }
    }

    /// A connection back from a call that answered: idle again, or closed
    /// when the pool was closed meanwhile.
    fn checkin(&self, conn: Pooled) {
        let mut conns = self.conns();
        if !conns.closed {
            return conns.idle.push(conn);
        }
        // Closed after the lock is released: `conns` is dropped before `conn`.
        conns.open -= 1;
    }

    /// Takes a connection out of the pool for good, in an unknown state (its
    /// statement may still be running, or be on its way): closes it, asks
    /// the server to cancel the statement when `cancel`, and closes the idle
    /// connections that have not heard from the server since the statement
    /// was sent: their path is in doubt too, whenever they were opened (one
    /// opened just before the path went silent is as dead), while one that
    /// answered since (a login, another call) has shown its path works.
    fn discard(&self, conn: Pooled, cancel: bool) {
        let sent = conn.conn.sent;
        if cancel {
            let token = conn.conn.client.cancel_token();
            self.connector.cancel_in_background(token, conn.conn.server);
        }
        self.close_with(conn, |idle| idle.conn.answered <= sent);
    }

    /// Takes a connection whose server refused a write (`25006`: a standby,
    /// or a primary demoted or fenced) out of the pool, with the idle
    /// connections to that server: none of them can serve a lock call.
    /// Postgrex's `disconnect_on_error_codes: [:read_only_sql_transaction]`,
    /// always on. Nothing is in flight on it: it is closed.
    fn leave(&self, conn: Pooled) {
        let server = conn.conn.server;
        self.close_with(conn, |idle| idle.conn.server == server);
    }

    /// Closes `conn`, taken out of a call, and the idle connections that
    /// `doomed` picks, after the pool's lock is released.
    fn close_with(&self, conn: Pooled, doomed: impl FnMut(&mut Pooled) -> bool) {
        let mut conns = self.conns();
        let closed: Vec<_> = conns.idle.extract_if(.., doomed).collect();
        conns.open -= 1 + closed.len();
        drop(conns);
        drop((conn, closed));
    }

    /// The statements, built on the first call from what the catalog says
    /// of the tables (checked by `schema.rs`: until they pass, every call
    /// reads it again).
    async fn statements(&self, conn: &mut Conn) -> Result<&Statements> {
        if let Some(statements) = self.statements.get() {
            return Ok(statements);
        }
        let prefix = self.settings.prefix.as_deref();
        let (chats, users) = schema::table_names(prefix);
        let columns = &sql::COLUMNS;
        let rows =
            run(conn, self.settings.prepare, columns, columns.text, &[&chats, &users]).await?;
        let tables = Tables::from_catalog(prefix, &Catalog::from_rows(&rows)?)?;
        Ok(self.statements.get_or_init(|| Statements::new(&tables, true)))
    }

    /// Connections in the pool, and those of them idle.
    pub fn connections(&self) -> (usize, usize) {
        let conns = self.conns();
        (conns.open, conns.idle.len())
    }

    /// Runs DDL text (from [`crate::schema`]) as one simple-protocol batch,
    /// on a connection of its own, closed after: `mix locks.setup` runs
    /// outside the queue and takes none of its connections. Blocks, as [`LockPool::run`].
    pub fn run_ddl(&self, deadline: Deadline, ddl: &str) -> Result<()> {
        let Pooled { conn, runtime } = Pooled::open(&self.connector, deadline)?;
        runtime.block_on(deadline.bound(async {
            conn.client.batch_execute(ddl).await.map_err(|e| Error::in_flight(&e))
        }))
    }
}

/// A connection and the runtime that drives it, its own (see [`LockPool`]).
/// Dropped, the connection's task is aborted, then dropped with the runtime,
/// which resets its socket.
struct Pooled {
    conn: Conn,
    runtime: Runtime,
}

impl Pooled {
    /// Opens a connection within `deadline`, on a new current-thread
    /// runtime; past it, a [`Error::Connect`] that names the servers not
    /// tried (nothing was sent).
    fn open(connector: &Connector, deadline: Deadline) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Connect(format!("cannot start a tokio runtime: {e}")))?;
        match runtime.block_on(connector.open(deadline.at)) {
            Ok(conn) => Ok(Pooled { conn, runtime }),
            Err(err) => {
                // Without waiting for a host-name lookup still running on
                // the runtime's blocking thread.
                runtime.shutdown_background();
                Err(err)
            }
        }
    }
}

/// Lets the runtime poll its I/O driver and run every task that became
/// ready: the first yield collects pending socket events (an end of file on
/// an idle connection) and schedules their tasks, the second runs them, so
/// a dead connection's client reports `is_closed()`. Two non-blocking
/// `epoll_wait`s.
async fn catch_up() {
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
}

/// Sends the statement of `def`, its `text` filled in, on `conn`: by name
/// (prepared on the connection the first time) or unnamed with its
/// parameters' types, in one round trip. Notes when it was sent and, unless
/// the connection was lost, when the server answered (see `discard`).
async fn run(
    conn: &mut Conn,
    prepare: Prepare,
    def: &Def,
    text: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Vec<Value>>> {
    conn.sent = Instant::now();
    let rows = async {
        if prepare == Prepare::Unnamed {
            let typed: Vec<_> =
                params.iter().zip(def.params).map(|(value, ty)| (*value, ty.clone())).collect();
            return conn.client.query_typed(text, &typed).await;
        }
        let prepared = match conn.prepared.iter().find(|(name, _)| *name == def.name) {
            Some((_, prepared)) => prepared.clone(),
            None => {
                let prepared = conn.client.prepare_typed(text, def.params).await?;
                conn.prepared.push((def.name, prepared.clone()));
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
    rows?.iter().map(values).collect()
}
