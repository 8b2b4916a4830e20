//! The harness of the integration tests: a [`Locks`] over the database named
//! by `DATABASE_URL`, and a plain `tokio_postgres` client that sets the scene
//! (inserts chats, reads a lock back, backdates it).
//!
//! Tests run in parallel threads against one shared database, and other
//! test suites may use it at the same time, so every test works on rows of
//! its own: fresh random uuids and refs, never a fixed id, never a `TRUNCATE`.
//!
//! A lock is made stale by *backdating* its `busy_since` in SQL rather than by
//! sleeping through a TTL: the tests stay fast, and the comparison still runs
//! on the database's clock, as it does in production.
//!
//! The tests are plain `#[test]` functions that [`run`] their body on one
//! runtime per test binary, as the NIF runs every call on one process-wide
//! runtime. That lets them share one pool ([`shared`]): a pooled connection
//! lives on the runtime that opened it, so a pool per `#[tokio::test]`
//! runtime would open (and SCRAM-authenticate, slow in a debug build) new
//! connections for every test.
//!
//! Each test binary uses only part of this module.
#![allow(dead_code)]

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use locks_core::config::Options;
use locks_core::{schema, Acquire, AcquireUser, ClickRef, Config, Hold, Locks, Ttl, TurnRef, Uuid};
use tokio::runtime::Runtime;
use tokio::sync::OnceCell;
use tokio_postgres::{Client, NoTls};

/// The TTL most tests use, in seconds: long enough that no lock goes stale
/// while a test runs unless the test backdates it.
pub const TTL: i64 = 60;

/// The URL of the test database. Panics, rather than letting the tests pass
/// without a database, when `DATABASE_URL` is unset.
pub fn database_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "DATABASE_URL is not set: these tests need PostgreSQL. From the repository root run \
             `eval \"$(scripts/pg start)\"` (it prints `export DATABASE_URL=…`), then \
             `cargo test -p locks_core`."
        ),
    })
}

/// Options for the test database with every other setting at its default.
pub fn options() -> Options<'static> {
    Options {
        url: database_url(),
        ..Options::default()
    }
}

/// Runs a test's body on the runtime of this test binary.
pub fn run<F: Future>(body: F) -> F::Output {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(4)
                .enable_all()
                .build()
                .expect("the test runtime starts")
        })
        .block_on(body)
}

/// Connections in the [`shared`] pool. Enough for a race's calls to overlap
/// on the server (the machines this runs on have two cores), few enough to
/// open quickly: in a debug build each connection's SCRAM login costs tens
/// of milliseconds of CPU. Connections open only when calls need them.
pub const SHARED_POOL_SIZE: i64 = 20;

/// The harness most tests share, built once per test binary (the tables are
/// created first). Its timeouts are generous: a race opens many connections
/// at once, a test may keep calls waiting on a row lock on purpose, and a
/// busy machine must not turn a test about lock outcomes into a timeout.
pub async fn shared() -> &'static Harness {
    static SHARED: OnceCell<Harness> = OnceCell::const_new();
    SHARED
        .get_or_init(|| {
            harness_with(Options {
                pool_size: Some(SHARED_POOL_SIZE),
                connect_timeout_ms: Some(30_000),
                checkout_timeout_ms: Some(30_000),
                statement_timeout_ms: Some(30_000),
                ..options()
            })
        })
        .await
}

/// Creates the two tables once per test binary (idempotent DDL, but running
/// it concurrently on a fresh database could race on the catalog).
pub async fn setup() {
    static DDL: OnceCell<()> = OnceCell::const_new();
    DDL.get_or_init(|| async {
        let locks = Locks::new(Config::new(&options()).expect("the test config is valid"))
            .expect("a pool can be built");
        locks
            .run_ddl(&schema::tables(None))
            .await
            .expect("the tables can be created");
    })
    .await;
}

/// A new random (version 4) UUID, lower case and hyphenated.
///
/// No `uuid` or `rand` crate: std's `RandomState` is seeded from the OS per
/// thread, and hashing a process-wide counter and the time with it gives
/// ids that never repeat across the parallel tests or across runs.
pub fn new_uuid() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let word = || {
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        hasher.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default(),
        );
        hasher.finish()
    };
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&word().to_be_bytes());
    bytes[8..].copy_from_slice(&word().to_be_bytes());
    bytes[6] = (bytes[6] & 0x0f) | 0x40; // version 4
    bytes[8] = (bytes[8] & 0x3f) | 0x80; // RFC 4122 variant
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// A new turn ref (anything that is not a click's).
pub fn new_turn_ref() -> String {
    format!("turn-{}", new_uuid())
}

/// A new click ref, as `click_ref/0` makes them (`click:` prefix).
pub fn new_click_ref() -> String {
    format!("click:{}", new_uuid())
}

/// A uuid argument; the test's own text, so it must parse.
pub fn uuid(text: &str) -> Uuid {
    Uuid::parse("uuid", text).expect("the test's uuid is valid")
}

/// A TTL argument.
pub fn ttl(seconds: i64) -> Ttl {
    Ttl::new("ttl_s", seconds).expect("the test's ttl is valid")
}

/// A hold argument, checked against its TTL.
pub fn hold(seconds: i64, ttl_s: i64) -> Hold {
    Hold::new("hold_s", seconds, ttl(ttl_s)).expect("the test's hold is valid")
}

/// A turn ref argument.
pub fn turn(text: &str) -> TurnRef<'_> {
    TurnRef::parse("turn_ref", text).expect("the test's turn ref is valid")
}

/// A click ref argument.
pub fn click(text: &str) -> ClickRef<'_> {
    ClickRef::parse("ref", text).expect("the test's click ref is valid")
}

/// The lock columns of one row, as the database sees them now.
#[derive(Debug, Clone, PartialEq)]
pub struct Lock {
    /// `busy_turn_ref`.
    pub holder: Option<String>,
    /// Seconds since `busy_since`, by the database's clock (`None` when NULL).
    pub age: Option<f64>,
}

impl Lock {
    /// The holder's ref, if any.
    pub fn holder(&self) -> Option<&str> {
        self.holder.as_deref()
    }

    /// Free: no holder and no date.
    pub fn is_free(&self) -> bool {
        self.holder.is_none() && self.age.is_none()
    }

    /// The age; panics when `busy_since` is NULL.
    pub fn age(&self) -> f64 {
        self.age.expect("the lock has a busy_since")
    }
}

/// Which table a lock lives in.
#[derive(Clone, Copy, Debug)]
pub enum Table {
    /// `phoenix_kit_agent_conversations`, keyed by `uuid`.
    Chat,
    /// `phoenix_kit_agent_user_settings`, keyed by `user_uuid`.
    User,
}

impl Table {
    fn name_and_key(self) -> (&'static str, &'static str) {
        match self {
            Table::Chat => (schema::CHATS, "uuid"),
            Table::User => (schema::USERS, "user_uuid"),
        }
    }
}

/// A plain client for setting up and inspecting rows, outside the library.
pub struct Db {
    /// The client, for SQL the helpers do not cover (e.g. a transaction that
    /// holds a row lock).
    pub client: Client,
    /// The quoted schema of the tables (`None`: the search path's).
    schema: Option<String>,
}

impl Db {
    /// Connects to the test database; the tables are unqualified.
    pub async fn connect() -> Db {
        Db::connect_in(None).await
    }

    /// Connects to the test database; the tables are in `schema` (quoted).
    pub async fn connect_in(schema: Option<&str>) -> Db {
        let (client, connection) = tokio_postgres::connect(database_url(), NoTls)
            .await
            .expect("the test database accepts a plain connection");
        // The connection task runs on the runtime of `run`.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Db {
            client,
            schema: schema.map(str::to_owned),
        }
    }

    /// The (qualified) name of `table`, and its key column.
    pub fn table(&self, table: Table) -> (String, &'static str) {
        let (name, key) = table.name_and_key();
        match &self.schema {
            Some(s) => (format!("{s}.{name}"), key),
            None => (name.to_owned(), key),
        }
    }

    /// Inserts a new, free chat and returns its uuid.
    pub async fn insert_chat(&self) -> String {
        let id = new_uuid();
        let (chats, _) = self.table(Table::Chat);
        self.client
            .execute(
                &format!("INSERT INTO {chats} (uuid) VALUES ($1::text::uuid)"),
                &[&id],
            )
            .await
            .expect("a chat row can be inserted");
        id
    }

    /// Inserts `n` new, free chats and returns their uuids.
    pub async fn insert_chats(&self, n: usize) -> Vec<String> {
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            ids.push(self.insert_chat().await);
        }
        ids
    }

    /// Inserts a new user settings row with a free lock and returns its uuid.
    pub async fn insert_user(&self) -> String {
        let id = new_uuid();
        let (users, _) = self.table(Table::User);
        self.client
            .execute(
                &format!("INSERT INTO {users} (user_uuid) VALUES ($1::text::uuid)"),
                &[&id],
            )
            .await
            .expect("a user settings row can be inserted");
        id
    }

    /// The lock columns of a row, or `None` when there is no row.
    pub async fn lock(&self, table: Table, id: &str) -> Option<Lock> {
        let (name, key) = self.table(table);
        let row = self
            .client
            .query_opt(
                &format!(
                    "SELECT busy_turn_ref, extract(epoch FROM now() - busy_since)::float8
                     FROM {name} WHERE {key} = $1::text::uuid"
                ),
                &[&id],
            )
            .await
            .expect("a lock can be read back")?;
        Some(Lock {
            holder: row.get(0),
            age: row.get(1),
        })
    }

    /// The chat's lock; panics when the chat has no row.
    pub async fn chat(&self, id: &str) -> Lock {
        self.lock(Table::Chat, id)
            .await
            .expect("the chat has a row")
    }

    /// The user's lock; panics when the user has no settings row.
    pub async fn user(&self, id: &str) -> Lock {
        self.lock(Table::User, id)
            .await
            .expect("the user has a settings row")
    }

    /// Makes a lock `seconds` older than it is, as if its node had gone down
    /// that long ago: the TTL passes without the test sleeping through it,
    /// and the library still compares on the database's clock.
    pub async fn backdate(&self, table: Table, id: &str, seconds: i64) {
        let (name, key) = self.table(table);
        let changed = self
            .client
            .execute(
                &format!(
                    "UPDATE {name} SET busy_since = busy_since - $2::int8 * interval '1 second'
                     WHERE {key} = $1::text::uuid"
                ),
                &[&id, &seconds],
            )
            .await
            .expect("a lock can be backdated");
        assert_eq!(changed, 1, "backdated a row that exists");
    }

    /// Sets `updated_at` of a user settings row (a `timestamptz` literal).
    pub async fn set_updated_at(&self, user: &str, at: &str) {
        let (users, _) = self.table(Table::User);
        let changed = self
            .client
            .execute(
                &format!(
                    "UPDATE {users} SET updated_at = $2::text::timestamptz
                     WHERE user_uuid = $1::text::uuid"
                ),
                &[&user, &at],
            )
            .await
            .expect("updated_at can be set");
        assert_eq!(changed, 1, "the user has a settings row");
    }

    /// `updated_at` of a user settings row, as text (exact to the microsecond).
    pub async fn updated_at(&self, user: &str) -> String {
        let (users, _) = self.table(Table::User);
        self.client
            .query_one(
                &format!("SELECT updated_at::text FROM {users} WHERE user_uuid = $1::text::uuid"),
                &[&user],
            )
            .await
            .expect("the user has a settings row")
            .get(0)
    }
}

/// A pool of the library and a plain client: one test's ([`harness_with`])
/// or every test's of a binary ([`shared`]).
pub struct Harness {
    /// The library under test.
    pub locks: Locks,
    /// The plain client that sets the scene. The shared one serves tests in
    /// parallel, so it never opens a transaction: a test that needs one
    /// connects a [`Db`] of its own.
    pub db: Db,
}

/// A harness of its own, with the given options (the unprefixed tables are
/// created first). Must be called, and used, within [`run`].
pub async fn harness_with(options: Options<'_>) -> Harness {
    setup().await;
    let config = Config::new(&options).expect("the test config is valid");
    let schema = config.schema().map(str::to_owned);
    Harness {
        locks: Locks::new(config).expect("a pool can be built"),
        db: Db::connect_in(schema.as_deref()).await,
    }
}

/// The calls of [`Locks`] with string arguments and the error unwrapped: a
/// test about outcomes fails loudly if the database errs instead.
impl Harness {
    /// `acquire`.
    pub async fn acquire(&self, chat: &str, user: &str, turn_ref: &str, ttl_s: i64) -> Acquire {
        self.locks
            .acquire(&uuid(chat), &uuid(user), turn(turn_ref), ttl(ttl_s))
            .await
            .expect("acquire answers")
    }

    /// `acquire_user`.
    pub async fn acquire_user(
        &self,
        user: &str,
        click_ref: &str,
        ttl_s: i64,
        hold_s: i64,
    ) -> AcquireUser {
        self.locks
            .acquire_user(
                &uuid(user),
                click(click_ref),
                ttl(ttl_s),
                hold(hold_s, ttl_s),
            )
            .await
            .expect("acquire_user answers")
    }

    /// `keep_user`.
    pub async fn keep_user(&self, user: &str, click_ref: &str, ttl_s: i64, hold_s: i64) -> bool {
        self.locks
            .keep_user(
                &uuid(user),
                click(click_ref),
                ttl(ttl_s),
                hold(hold_s, ttl_s),
            )
            .await
            .expect("keep_user answers")
    }

    /// `fresh`.
    pub async fn fresh(&self, chat: &str, turn_ref: &str, ttl_s: i64) -> bool {
        self.locks
            .fresh(&uuid(chat), turn(turn_ref), ttl(ttl_s))
            .await
            .expect("fresh answers")
    }

    /// `held`.
    pub async fn held(&self, chat: &str, user: &str, turn_ref: &str) -> bool {
        self.locks
            .held(&uuid(chat), &uuid(user), turn(turn_ref))
            .await
            .expect("held answers")
    }

    /// `release`.
    pub async fn release(&self, chat: &str, user: &str, turn_ref: &str) {
        self.locks
            .release(&uuid(chat), &uuid(user), turn(turn_ref))
            .await
            .expect("release answers")
    }

    /// `release_stale`.
    pub async fn release_stale(&self, chat: &str, user: &str, turn_ref: &str, ttl_s: i64) -> bool {
        self.locks
            .release_stale(&uuid(chat), &uuid(user), turn(turn_ref), ttl(ttl_s))
            .await
            .expect("release_stale answers")
    }

    /// `release_user`.
    pub async fn release_user(&self, user: &str, click_ref: &str) {
        self.locks
            .release_user(&uuid(user), click(click_ref))
            .await
            .expect("release_user answers")
    }
}
