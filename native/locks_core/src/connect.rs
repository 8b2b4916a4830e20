//! Opening connections: the socket, TLS, the login, the server that takes
//! writes among several, and the pause between failed attempts.
//!
//! Sockets are our own rather than tokio-postgres' `connect`'s, tuned for a
//! pool that lives as long as the VM ([`tune`]):
//!
//! * **TCP keepalive** after [`KEEPALIVE_IDLE`] and a `TCP_USER_TIMEOUT` of
//!   [`USER_TIMEOUT`], so a peer that went silent (a black-holed path, a
//!   dropped NAT flow, a failover) is noticed and the connection replaced;
//! * **`SO_LINGER` 0**: a closed connection is *reset*, and the kernel drops
//!   what it still holds unsent. Otherwise the statement of a call that
//!   timed out on a silent path could be delivered when the path comes
//!   back, after its caller gave up, and take a lock for a ref nobody holds
//!   (a ghost lock). A connection is only closed when it is discarded or
//!   the pool closes, with nothing in flight worth delivering.
//!
//! With several servers (`endpoints`), they are tried in order, each within
//! the connect timeout and all within the call's deadline, and under
//! [`TargetServerType::Primary`] a server is taken only once its login
//! answers `SHOW transaction_read_only` with `off` (libpq's
//! `target_session_attrs=read-write`, Postgrex's `target_server_type:
//! :primary`). tokio-postgres' own `Config::connect` tries several hosts and
//! asks the same question, but on sockets of its own, without `SO_LINGER`
//! or the duplicate a checkout peeks at ([`Conn::quiet`]): the loop over the
//! servers is ours, the login and the question are tokio-postgres'.
//!
//! No startup options are sent (PgBouncer refuses them) and no session
//! setting is assumed (see `sql.rs`). Every connect error names the server
//! first (`database connection failed: 127.0.0.1:5432: …`, or the socket's
//! path), whatever the cause: the socket, TLS, the login, the connect
//! timeout (a black-holed peer), or a read-only server; with several, each
//! server tried, in order, separated by `; `. While connections fail,
//! attempts are spaced by a capped, jittered [`Backoff`]: a call that would
//! open one meanwhile fails at once with the last error.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use socket2::{SockRef, TcpKeepalive};
use tokio::net::{TcpStream, UnixStream};
use tokio::task::JoinHandle;
use tokio_postgres::{CancelToken, Client, SimpleQueryMessage};
use tokio_util::either::Either;

use crate::error::{describe, Error, Result};
use crate::settings::{Settings, SslMode, TargetServerType};
use crate::tls;

/// Idle time before the first keepalive probe.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
/// Time between unanswered keepalive probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before a silent idle connection is given up (after 30 s).
pub const KEEPALIVE_RETRIES: u32 = 3;
/// How long sent data may stay unacknowledged before the kernel gives the
/// connection up (Linux).
pub const USER_TIMEOUT: Duration = Duration::from_secs(30);
/// The first pause after a failed attempt; it doubles with each failure.
pub const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// The longest pause between attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// A TCP (`Left`) or Unix (`Right`) socket, as one type for tokio-postgres.
pub(crate) type Socket = Either<TcpStream, UnixStream>;

/// Opens connections for one pool.
#[derive(Clone)]
pub(crate) struct Connector {
    /// The servers, in the order they are tried: one Unix socket, or the
    /// TCP `endpoints` (at least one).
    servers: Vec<Server>,
    target: TargetServerType,
    /// The login: user, password, database, application name, and whether
    /// to ask for TLS (never over a Unix socket, where the server refuses it).
    login: tokio_postgres::Config,
    tls: tls::MakeTls,
    /// The longest one server's attempt may take.
    timeout: Duration,
    backoff: Arc<Mutex<Backoff>>,
}

/// One server a connection may be opened to.
#[derive(Clone)]
struct Server {
    /// The host name or IP address; `None` for the Unix socket at `peer`.
    host: Option<String>,
    port: u16,
    /// What connect errors name: `host:port` (`[::1]:5432` for an IPv6
    /// address), or the socket's path.
    peer: String,
}

/// An open connection: its client, the task that drives its socket, the
/// statements prepared on it, and when it last wrote and heard back.
pub(crate) struct Conn {
    pub client: Client,
    /// Aborted on drop, which drops the socket: the connection is reset.
    task: JoinHandle<()>,
    /// The same socket, duplicated, to look at without driving the task
    /// ([`Conn::quiet`]); the reset comes when both are closed.
    probe: socket2::Socket,
    /// Named prepared statements, by the name of the call that runs them.
    pub prepared: Vec<(&'static str, tokio_postgres::Statement)>,
    /// When a statement was last sent on it.
    pub sent: Instant,
    /// When the server last answered on it (the login, at first).
    pub answered: Instant,
    /// Which of the connector's servers it is open to.
    pub server: usize,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Conn {
    /// Whether the server sent nothing since the connection was last used:
    /// one non-blocking peek at its socket. Anything there (an end of file,
    /// a notice, an error before closing) is for its task to read first.
    pub fn quiet(&self) -> bool {
        let mut byte = [MaybeUninit::uninit()];
        matches!(self.probe.peek(&mut byte), Err(err) if err.kind() == io::ErrorKind::WouldBlock)
    }
}

impl Connector {
    /// Checks what can be checked without connecting (the CA file is read).
    pub fn new(settings: &Settings) -> Result<Self> {
        // A socket directory wins over host names, as in Postgrex.
        let servers = match &settings.socket_dir {
            Some(dir) => {
                let port = settings.port()?;
                vec![Server { host: None, port, peer: format!("{dir}/.s.PGSQL.{port}") }]
            }
            None => settings.servers()?.into_iter().map(Server::tcp).collect(),
        };
        let mode = if settings.socket_dir.is_none() { settings.sslmode } else { SslMode::Disable };
        let mut login = tokio_postgres::Config::new();
        login
            .user(&settings.username)
            .dbname(&settings.database)
            .application_name(&settings.application_name)
            .ssl_mode(tls::wire(mode));
        if let Some(password) = &settings.password {
            login.password(password);
        }
        Ok(Connector {
            servers,
            target: settings.target_server_type,
            login,
            tls: tls::connector(mode, settings)?,
            timeout: Duration::from_millis(settings.connect_timeout),
            backoff: Arc::default(),
        })
    }

    /// Opens a connection to the first server that takes it (and, under
    /// [`TargetServerType::Primary`], takes writes), each within the connect
    /// timeout and all by `until`; or fails at once while the back-off
    /// after a failed attempt lasts. The error names every server: why each
    /// one tried was passed over, and those `until` left no time for.
    pub async fn open(&self, until: Instant) -> Result<Conn> {
        if let Some(refusal) = self.backoff().refusal(Instant::now()) {
            return Err(refusal);
        }
        let mut failures = Vec::new();
        for (index, server) in self.servers.iter().enumerate() {
            let limit = self.timeout.min(until.saturating_duration_since(Instant::now()));
            // Every cause (the socket, TLS, the login, the timeout, a
            // read-only server) names the peer.
            let cause = if limit.is_zero() {
                "not tried: the call's time was up".to_owned()
            } else {
                match tokio::time::timeout(limit, self.login(index, server)).await {
                    Ok(Ok(conn)) => {
                        *self.backoff() = Backoff::default();
                        return Ok(conn);
                    }
                    Ok(Err(cause)) => cause,
                    Err(_) => format!("no connection within {} ms", limit.as_millis()),
                }
            };
            failures.push(format!("{}: {cause}", server.peer));
        }
        let message = failures.join("; ");
        self.backoff().failed(Instant::now(), message.clone());
        Err(Error::Connect(message))
    }

    fn backoff(&self) -> MutexGuard<'_, Backoff> {
        self.backoff.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connection to `server` (the `index`th), or what failed.
    async fn login(&self, index: usize, server: &Server) -> Result<Conn, String> {
        let (socket, tls) = self.socket(server).await?;
        let probe = match &socket {
            Either::Left(tcp) => SockRef::from(tcp).try_clone(),
            Either::Right(unix) => SockRef::from(unix).try_clone(),
        }
        .map_err(|e| e.to_string())?;
        // Non-blocking already (tokio's): set again, so that a peek never waits.
        probe.set_nonblocking(true).map_err(|e| e.to_string())?;
        let connected = self.login.connect_raw(socket, tls).await;
        let (client, connection) =
            connected.map_err(|e| format!("{}{}", describe(&e), tls::hint(&e)))?;
        let now = Instant::now();
        let conn = Conn {
            client,
            task: tokio::spawn(async move { drop(connection.await) }),
            probe,
            prepared: Vec::new(),
            sent: now,
            answered: now,
            server: index,
        };
        if self.target == TargetServerType::Primary {
            // Dropped on a refusal: its socket is reset.
            writable(&conn.client).await?;
        }
        Ok(conn)
    }

    /// A tuned socket to the server, and its TLS (used only when the login
    /// asks for it).
    async fn socket(&self, server: &Server) -> Result<(Socket, tls::Tls), String> {
        let (socket, server) = match &server.host {
            None => (UnixStream::connect(&server.peer).await.map(Either::Right), "localhost"),
            Some(host) => (tcp(host, server.port).await, host.as_str()),
        };
        let socket = socket.map_err(|e| e.to_string())?;
        Ok((socket, self.tls.for_host(server)))
    }

    /// Asks the server (the `server`th) to stop the statement running on the
    /// connection of `token`, over a connection of its own, on a thread of its own (the
    /// caller has been answered, and a runtime runs only while a call
    /// drives it); bounded by the connect timeout. A statement that has
    /// not reached the server cannot be cancelled: the reset of its
    /// connection drops it instead. No thread, no cancel: the statement ends
    /// with the server's own limits, or when it sees its connection gone.
    pub fn cancel_in_background(&self, token: CancelToken, server: usize) {
        let Some(server) = self.servers.get(server).cloned() else { return };
        let connector = self.clone();
        let thread = std::thread::Builder::new().name("phoenix_kit_agent_locks-cancel".into());
        let _ = thread.spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            let Ok(runtime) = runtime else { return };
            runtime.block_on(async {
                let cancel = async {
                    let (socket, tls) = connector.socket(&server).await.ok()?;
                    token.cancel_query_raw(socket, tls).await.ok()
                };
                let _ = tokio::time::timeout(connector.timeout, cancel).await;
            });
        });
    }
}

impl Server {
    fn tcp((host, port): (String, u16)) -> Self {
        let peer =
            if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
        Server { host: Some(host), port, peer }
    }
}

/// Whether the server takes writes, asked as libpq's
/// `target_session_attrs=read-write` and Postgrex's `target_server_type:
/// :primary` ask it: `transaction_read_only` is `off` on a primary, `on` on
/// a standby (hot standby) and on a server set read-only
/// (`default_transaction_read_only`, as some failovers fence the old primary).
async fn writable(client: &Client) -> Result<(), String> {
    let answer = client.simple_query("SHOW transaction_read_only").await;
    let messages = answer.map_err(|e| describe(&e))?;
    let value = messages.iter().find_map(|message| match message {
        SimpleQueryMessage::Row(row) => row.get(0),
        _ => None,
    });
    match value {
        Some("off") => Ok(()),
        Some("on") => Err("read-only (transaction_read_only is on): not the primary".to_owned()),
        other => Err(format!("SHOW transaction_read_only answered {other:?}")),
    }
}

/// The first address of `host` that accepts a connection, tuned.
async fn tcp(host: &str, port: u16) -> io::Result<Socket> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the host name has no address");
    for addr in tokio::net::lookup_host((host, port)).await? {
        match TcpStream::connect(addr).await {
            Ok(stream) => {
                tune(&stream)?;
                return Ok(Either::Left(stream));
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Keepalive, `TCP_USER_TIMEOUT`, `SO_LINGER` 0 and no Nagle delay.
fn tune(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let socket = SockRef::from(stream);
    socket.set_linger(Some(Duration::ZERO))?;
    socket.set_tcp_keepalive(
        &TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_RETRIES),
    )?;
    #[cfg(target_os = "linux")]
    socket.set_tcp_user_timeout(Some(USER_TIMEOUT))?;
    Ok(())
}

/// Spaces attempts after a failure: [`BACKOFF_MIN`], doubling to
/// [`BACKOFF_MAX`], each pause shortened by up to a quarter at random so that
/// many nodes do not retry in step. Reset by a success (a new one).
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    failures: u32,
    /// Until when attempts pause, and the last one's error.
    paused: Option<(Instant, String)>,
}

impl Backoff {
    /// The error to fail with instead of connecting, while a pause lasts
    /// (the time left rounded up: never "0 ms").
    fn refusal(&self, now: Instant) -> Option<Error> {
        let (until, last) = self.paused.as_ref().filter(|(until, _)| *until > now)?;
        let left = until.duration_since(now).as_nanos().div_ceil(1_000_000);
        Some(Error::Connect(format!("{last} (not retried for {left} ms)")))
    }

    fn failed(&mut self, now: Instant, last: String) {
        self.failures = self.failures.saturating_add(1);
        let pause = BACKOFF_MIN
            .saturating_mul(1 << self.failures.saturating_sub(1).min(16))
            .min(BACKOFF_MAX);
        // Jitter from the standard library's random hash keys.
        let random = RandomState::new().build_hasher().finish() % 250;
        self.paused = Some((now + pause - pause.mul_f64(random as f64 / 1000.0), last));
    }
}

// What `tune` sets is private to the socket: its test is a unit test, kept
// with the others under tests/.
#[cfg(test)]
#[path = "../tests/unit/connect.rs"]
mod tests;
