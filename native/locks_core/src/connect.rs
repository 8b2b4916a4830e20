//! Opening connections: the socket, TLS, the login, and the pause between
//! failed attempts.
//!
//! Connections are opened on sockets of our own rather than by
//! tokio-postgres' `connect`, for what a pool of a long-lived VM needs:
//!
//! * **TCP keepalive** after [`KEEPALIVE_IDLE`] idle (tokio-postgres' default
//!   is the kernel's two hours) and a `TCP_USER_TIMEOUT` of
//!   [`USER_TIMEOUT`], so a peer that went silent (a black-holed path, a NAT
//!   or load balancer that dropped the flow, a failover) is noticed and the
//!   connection replaced;
//! * **`SO_LINGER` 0**: a closed connection is *reset*, not shut down. The
//!   kernel then drops whatever it still holds unsent. A statement of a call
//!   that timed out on a silent path could otherwise be delivered when the
//!   path comes back, seconds after its caller gave up and released its
//!   locks, and take them for a ref nobody holds any more (a ghost lock).
//!   Nothing is lost by it: a connection is only closed when it is
//!   discarded or the pool closes, with nothing in flight worth delivering.
//!
//! No startup options are sent (PgBouncer refuses them by default) and no
//! session setting is assumed: the statements are correct under any
//! `TimeZone` and isolation level (see `sql.rs`).
//!
//! While connections fail (the server is down or full: connection refused,
//! 53300), new attempts are spaced by a capped, jittered back-off
//! ([`Backoff`]); a call that would open one meanwhile fails at once with
//! the last error, instead of each call hammering the server.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use socket2::{SockRef, TcpKeepalive};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio::task::JoinHandle;
use tokio_postgres::tls::{MakeTlsConnect, NoTls};
use tokio_postgres::{CancelToken, Client};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, Result};
use crate::settings::{Location, Settings, SslMode};
use crate::tls;

/// Idle time before the first keepalive probe.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
/// Time between unanswered keepalive probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before the connection is given up: a silent idle
/// connection is closed after 15 + 3 × 5 = 30 s.
pub const KEEPALIVE_RETRIES: u32 = 3;
/// How long sent data may stay unacknowledged before the kernel gives the
/// connection up (Linux).
pub const USER_TIMEOUT: Duration = Duration::from_secs(30);

/// The first pause after a failed attempt; it doubles with each failure.
pub const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// The longest pause between attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Opens connections for one pool.
#[derive(Clone)]
pub(crate) struct Connector {
    location: Location,
    port: u16,
    /// The login: user, password, database, application name, sslmode.
    login: tokio_postgres::Config,
    /// `None` when TLS is disabled (and over a Unix socket, which never uses it).
    tls: Option<MakeRustlsConnect>,
    timeout: Duration,
    backoff: Arc<Mutex<Backoff>>,
}

/// An open connection: its client, the task that drives its socket, the
/// statements prepared on it, and when it last wrote and heard back.
pub(crate) struct Conn {
    pub client: Client,
    /// Aborted on drop, which drops the socket: the connection is reset.
    task: JoinHandle<()>,
    /// Named prepared statements, by the name of the call that runs them.
    pub prepared: Vec<(&'static str, tokio_postgres::Statement)>,
    /// When a statement was last sent on it.
    pub sent: Instant,
    /// When the server last answered on it (the login, at first): the last
    /// time its network path is known to have worked.
    pub answered: Instant,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Connector {
    /// Checks what can be checked without connecting (the CA file is read).
    pub fn new(settings: &Settings) -> Result<Self> {
        let mut login = tokio_postgres::Config::new();
        login
            .user(&settings.username)
            .dbname(&settings.database)
            .application_name(&settings.application_name);
        if let Some(password) = &settings.password {
            login.password(password);
        }
        let tls = match (&settings.location, settings.sslmode) {
            (Location::SocketDir(_), _) | (_, SslMode::Disable) => {
                login.ssl_mode(tls::wire(SslMode::Disable));
                None
            }
            (Location::Host(_), mode) => {
                login.ssl_mode(tls::wire(mode));
                Some(tls::connector(mode, settings.ssl_ca_file.as_deref())?)
            }
        };
        Ok(Connector {
            location: settings.location.clone(),
            port: settings.port,
            login,
            tls,
            timeout: settings.connect_timeout,
            backoff: Arc::default(),
        })
    }

    /// Opens a connection within the connect timeout, or fails at once while
    /// the back-off after a failed attempt lasts.
    pub async fn open(&self) -> Result<Conn> {
        let now = Instant::now();
        if let Some(refusal) = self.lock_backoff().refusal(now) {
            return Err(refusal);
        }
        let result = match tokio::time::timeout(self.timeout, self.login()).await {
            Ok(result) => result,
            Err(_) => Err(Error::Connect(format!(
                "no connection within {} ms",
                self.timeout.as_millis()
            ))),
        };
        let mut backoff = self.lock_backoff();
        match &result {
            Ok(_) => backoff.succeeded(),
            Err(err) => backoff.failed(Instant::now(), err),
        }
        result
    }

    fn lock_backoff(&self) -> std::sync::MutexGuard<'_, Backoff> {
        self.backoff
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    async fn login(&self) -> Result<Conn> {
        let socket = self
            .socket()
            .await
            .map_err(|e| Error::Connect(format!("{}: {e}", self.describe_location())))?;
        let (client, task) = match (&self.tls, socket, &self.location) {
            (Some(tls), socket, Location::Host(host)) => {
                let mut tls = tls.clone();
                let tls = match MakeTlsConnect::<Socket>::make_tls_connect(&mut tls, host) {
                    Ok(tls) => tls,
                    Err(never) => match never {},
                };
                let (client, connection) = self
                    .login
                    .connect_raw(socket, tls)
                    .await
                    .map_err(|e| Error::connect(&e))?;
                (client, tokio::spawn(async move { drop(connection.await) }))
            }
            (_, socket, _) => {
                let (client, connection) = self
                    .login
                    .connect_raw(socket, NoTls)
                    .await
                    .map_err(|e| Error::connect(&e))?;
                (client, tokio::spawn(async move { drop(connection.await) }))
            }
        };
        let now = Instant::now();
        Ok(Conn {
            client,
            task,
            prepared: Vec::new(),
            sent: now,
            answered: now,
        })
    }

    fn describe_location(&self) -> String {
        match &self.location {
            Location::Host(host) => format!("{host}:{}", self.port),
            Location::SocketDir(dir) => format!("{dir}/.s.PGSQL.{}", self.port),
        }
    }

    /// A socket to the server, tuned (see the module doc).
    async fn socket(&self) -> io::Result<Socket> {
        match &self.location {
            Location::SocketDir(dir) => {
                let path = format!("{dir}/.s.PGSQL.{}", self.port);
                Ok(Socket::Unix(UnixStream::connect(path).await?))
            }
            Location::Host(host) => {
                let mut last = None;
                for addr in tokio::net::lookup_host((host.as_str(), self.port)).await? {
                    match TcpStream::connect(addr).await {
                        Ok(stream) => {
                            tune(&stream)?;
                            return Ok(Socket::Tcp(stream));
                        }
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| {
                    io::Error::new(io::ErrorKind::NotFound, "the host name has no address")
                }))
            }
        }
    }

    /// Asks the server to stop the statement running on the connection of
    /// `token`, over a connection of its own, on a thread of its own: the
    /// caller has already been answered, and the shared runtime runs only
    /// while some call drives it. Bounded by the connect timeout. A
    /// statement that has not reached the server cannot be cancelled; the
    /// reset of its connection drops it instead (see the module doc).
    pub fn cancel_in_background(&self, token: CancelToken) {
        let connector = self.clone();
        let spawned = std::thread::Builder::new()
            .name("phoenix_kit_agent_locks-cancel".into())
            .spawn(move || {
                let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                runtime.block_on(async {
                    let cancel = async {
                        let socket = connector.socket().await.ok()?;
                        match (&connector.tls, &connector.location) {
                            (Some(tls), Location::Host(host)) => {
                                let mut tls = tls.clone();
                                let tls =
                                    MakeTlsConnect::<Socket>::make_tls_connect(&mut tls, host)
                                        .ok()?;
                                token.cancel_query_raw(socket, tls).await.ok()
                            }
                            _ => token.cancel_query_raw(socket, NoTls).await.ok(),
                        }
                    };
                    let _ = tokio::time::timeout(connector.timeout, cancel).await;
                });
            });
        // No thread, no cancel: the statement ends with the server's own
        // statement limits, or when it notices its connection is gone.
        drop(spawned);
    }
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
/// many nodes do not retry in step. Reset by a success.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    failures: u32,
    retry_at: Option<Instant>,
    last: Option<String>,
}

impl Backoff {
    /// The error to fail with instead of connecting, while a pause lasts.
    /// The time left is rounded up: a refusal never says "0 ms".
    fn refusal(&self, now: Instant) -> Option<Error> {
        let retry_at = self.retry_at.filter(|at| *at > now)?;
        Some(Error::Connect(format!(
            "{} (not retried for {} ms)",
            self.last.as_deref().unwrap_or("the last attempt failed"),
            retry_at.duration_since(now).as_nanos().div_ceil(1_000_000)
        )))
    }

    fn failed(&mut self, now: Instant, err: &Error) {
        self.failures = self.failures.saturating_add(1);
        let pause = BACKOFF_MIN
            .saturating_mul(1 << self.failures.saturating_sub(1).min(16))
            .min(BACKOFF_MAX);
        let jitter = pause.mul_f64(f64::from(random_u32() % 250) / 1000.0);
        self.retry_at = Some(now + pause - jitter);
        self.last = Some(match err {
            Error::Connect(message) => message.clone(),
            other => other.to_string(),
        });
    }

    fn succeeded(&mut self) {
        *self = Backoff::default();
    }
}

/// A random number for jitter, from the standard library's hash keys.
fn random_u32() -> u32 {
    (RandomState::new().build_hasher().finish() & u64::from(u32::MAX)) as u32
}

/// A TCP or Unix socket, as one type for tokio-postgres.
pub(crate) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Socket::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Socket::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_flush(cx),
            Socket::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Socket::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_spaced_by_a_doubling_capped_pause_and_a_success_resets_it() {
        let start = Instant::now();
        let mut backoff = Backoff::default();
        assert!(backoff.refusal(start).is_none());

        let refused = Error::Connect("connection refused".into());
        let mut pauses = Vec::new();
        for _ in 0..8 {
            backoff.failed(start, &refused);
            pauses.push(backoff.retry_at.map(|at| at - start).unwrap_or_default());
        }
        // Each pause is its nominal length minus at most a quarter.
        for (pause, nominal_ms) in pauses
            .iter()
            .zip([50, 100, 200, 400, 800, 1600, 2000, 2000])
        {
            let nominal = Duration::from_millis(nominal_ms);
            assert!(
                *pause <= nominal && *pause >= nominal * 3 / 4,
                "{pause:?} for {nominal:?}"
            );
        }
        let message = backoff.refusal(start).map(|e| e.to_string());
        assert!(
            message.as_deref().is_some_and(|m| m
                .starts_with("database connection failed: connection refused (not retried for ")),
            "{message:?}"
        );
        assert!(backoff.refusal(start + BACKOFF_MAX).is_none());
        let last_moment = backoff.retry_at.map(|at| at - Duration::from_nanos(1));
        let message = last_moment
            .and_then(|now| backoff.refusal(now))
            .map(|e| e.to_string());
        assert!(
            message
                .as_deref()
                .is_some_and(|m| m.ends_with("(not retried for 1 ms)")),
            "{message:?}"
        );

        backoff.succeeded();
        assert!(backoff.refusal(start).is_none());
        backoff.failed(start, &refused);
        assert!(backoff.retry_at.is_some_and(|at| at - start <= BACKOFF_MIN));
    }

    #[tokio::test]
    async fn sockets_reset_on_close_and_probe_an_idle_peer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("listen");
        let addr = listener.local_addr().expect("address");
        let stream = TcpStream::connect(addr).await.expect("connect");
        tune(&stream).expect("tuned");
        let socket = SockRef::from(&stream);
        assert_eq!(socket.linger().ok(), Some(Some(Duration::ZERO)));
        assert_eq!(socket.keepalive().ok(), Some(true));
        assert_eq!(socket.tcp_keepalive_time().ok(), Some(KEEPALIVE_IDLE));
        assert_eq!(
            socket.tcp_keepalive_interval().ok(),
            Some(KEEPALIVE_INTERVAL)
        );
        assert_eq!(socket.tcp_keepalive_retries().ok(), Some(KEEPALIVE_RETRIES));
        #[cfg(target_os = "linux")]
        assert_eq!(socket.tcp_user_timeout().ok(), Some(Some(USER_TIMEOUT)));
        assert_eq!(stream.nodelay().ok(), Some(true));
    }
}
