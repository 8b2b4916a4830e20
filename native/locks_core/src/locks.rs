//! [`Locks`]: a pool of connections and the statements, one method per call.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Statement};

use crate::args::{ClickRef, Hold, Ttl, TurnRef, Uuid};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::outcome::{Acquire, AcquireUser};
use crate::sql::Statements;

/// The lock calls, over a pool of PostgreSQL connections.
///
/// Building one connects nothing; calls open connections as they need them.
/// Each connection prepares a statement the first time it runs it and keeps
/// it (`prepare_cached`), so from then on a call is one round trip. Every
/// call checks a connection out, runs one prepared statement and gives it
/// back, all within [`Config::call_timeout`]. A connection that broke (the server restarted,
/// the network dropped) is noticed when it is next checked out and replaced.
pub struct Locks {
    pool: Pool,
    sql: Statements,
    config: Config,
}

impl Locks {
    /// Builds the pool. Does not connect.
    pub fn new(config: Config) -> Result<Self> {
        let sql = Statements::new(config.schema());
        let manager = Manager::from_config(
            config.pg.clone(),
            crate::tls::connector(&config),
            // Fast: a checkout costs no round trip; a closed connection is
            // still detected (tokio-postgres marks it closed when its socket
            // ends) and replaced.
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(config.checkout_timeout))
            .create_timeout(Some(config.connect_timeout))
            .recycle_timeout(Some(config.connect_timeout))
            .build()
            .map_err(|e| Error::config("pool_size", e.to_string()))?;
        Ok(Locks { pool, sql, config })
    }

    /// The text of every statement as this pool runs it (table names filled
    /// in), named after the Elixir function that runs it: what a benchmark
    /// sends to `pgbench` to compare against.
    pub fn statements(&self) -> [(&'static str, &str); 8] {
        self.sql.all()
    }

    /// The configuration this pool was built from.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Closes the pool: connections are dropped as they come back, and every
    /// later call fails with [`Error::NotStarted`].
    pub fn close(&self) {
        self.pool.close();
    }

    /// Runs one prepared statement and returns its only row, within the deadline.
    async fn query_one(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Row> {
        self.within_deadline(async {
            let (client, statement) = self.prepared(sql).await?;
            Ok(client.query_one(&statement, params).await?)
        })
        .await
    }

    /// Runs one prepared statement that returns no rows; the rows it changed.
    async fn execute(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        self.within_deadline(async {
            let (client, statement) = self.prepared(sql).await?;
            Ok(client.execute(&statement, params).await?)
        })
        .await
    }

    /// A pooled connection and `sql` prepared on it (once per connection).
    async fn prepared(&self, sql: &str) -> Result<(Object, Statement)> {
        let client = self.checkout().await?;
        let statement = client.prepare_cached(sql).await?;
        Ok((client, statement))
    }

    async fn checkout(&self) -> Result<Object> {
        self.pool.get().await.map_err(|e| {
            Error::from_pool(e, self.config.checkout_timeout, self.config.connect_timeout)
        })
    }

    async fn within_deadline<T>(
        &self,
        call: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let deadline: Duration = self.config.call_timeout();
        tokio::time::timeout(deadline, call)
            .await
            .unwrap_or(Err(Error::Timeout(deadline)))
    }

    /// Takes the chat's and the user's lock for `turn`, or neither ([`crate::sql`]'s `ACQUIRE`).
    pub async fn acquire(
        &self,
        chat: &Uuid,
        user: &Uuid,
        turn: TurnRef<'_>,
        ttl: Ttl,
    ) -> Result<Acquire> {
        let row = self
            .query_one(
                &self.sql.acquire,
                &[chat, user, &turn.as_str(), &ttl.seconds()],
            )
            .await?;
        let acquired: bool = row.try_get(0)?;
        let holder: Option<&str> = row.try_get(1)?;
        Ok(match (acquired, holder) {
            (true, _) => Acquire::Acquired,
            (false, None) => Acquire::ConversationBusy,
            (false, Some(holder)) => match AcquireUser::from_holder(holder, turn.as_str()) {
                AcquireUser::ClickInFlight => Acquire::ClickInFlight,
                // The user's lock was ours but the chat could not be written:
                // impossible while the chat row is locked, but never report
                // an acquisition that did not happen.
                AcquireUser::Acquired => Acquire::ConversationBusy,
                AcquireUser::TurnInFlight => Acquire::TurnInFlight,
            },
        })
    }

    /// Takes the user's lock alone for a click, dated back by `ttl - hold`.
    pub async fn acquire_user(
        &self,
        user: &Uuid,
        click: ClickRef<'_>,
        ttl: Ttl,
        hold: Hold,
    ) -> Result<AcquireUser> {
        let row = self
            .query_one(
                &self.sql.acquire_user,
                &[user, &click.as_str(), &ttl.seconds(), &hold.seconds()],
            )
            .await?;
        let holder: &str = row.try_get(0)?;
        Ok(AcquireUser::from_holder(holder, click.as_str()))
    }

    /// Whether the chat's lock is `turn`'s and not older than `ttl`.
    pub async fn fresh(&self, chat: &Uuid, turn: TurnRef<'_>, ttl: Ttl) -> Result<bool> {
        let row = self
            .query_one(&self.sql.fresh, &[chat, &turn.as_str(), &ttl.seconds()])
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Whether `turn` holds both locks.
    pub async fn held(&self, chat: &Uuid, user: &Uuid, turn: TurnRef<'_>) -> Result<bool> {
        let row = self
            .query_one(&self.sql.held, &[chat, user, &turn.as_str()])
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Re-dates the click's lock as if taken now; `true` when `click` held it.
    pub async fn keep_user(
        &self,
        user: &Uuid,
        click: ClickRef<'_>,
        ttl: Ttl,
        hold: Hold,
    ) -> Result<bool> {
        let changed = self
            .execute(
                &self.sql.keep_user,
                &[user, &click.as_str(), &ttl.seconds(), &hold.seconds()],
            )
            .await?;
        Ok(changed == 1)
    }

    /// Frees whichever of the two locks `turn` still holds.
    pub async fn release(&self, chat: &Uuid, user: &Uuid, turn: TurnRef<'_>) -> Result<()> {
        self.execute(&self.sql.release, &[chat, user, &turn.as_str()])
            .await?;
        Ok(())
    }

    /// Frees a lost turn's locks while the chat's is still its and older than
    /// `ttl`; `true` when this call freed it.
    pub async fn release_stale(
        &self,
        chat: &Uuid,
        user: &Uuid,
        turn: TurnRef<'_>,
        ttl: Ttl,
    ) -> Result<bool> {
        let row = self
            .query_one(
                &self.sql.release_stale,
                &[chat, user, &turn.as_str(), &ttl.seconds()],
            )
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Frees the user's lock if `click` still holds it.
    pub async fn release_user(&self, user: &Uuid, click: ClickRef<'_>) -> Result<()> {
        self.execute(&self.sql.release_user, &[user, &click.as_str()])
            .await?;
        Ok(())
    }

    /// Runs DDL text (from [`crate::schema`]) as one simple-protocol batch.
    pub async fn run_ddl(&self, ddl: &str) -> Result<()> {
        self.within_deadline(async {
            let client = self.checkout().await?;
            Ok(client.batch_execute(ddl).await?)
        })
        .await
    }
}
