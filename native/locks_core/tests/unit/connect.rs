//! The unit test of `src/connect.rs` (its `tests` module, by `#[path]`):
//! the socket options that `tune` sets can only be read on a socket it
//! tuned, which the public API never hands out.

use super::*;

/// Every connection's socket resets on close (`SO_LINGER` 0), probes an
/// idle peer (keepalive) and gives up on unacknowledged data (Linux).
#[tokio::test]
async fn sockets_reset_on_close_and_probe_an_idle_peer() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("listen");
    let addr = listener.local_addr().expect("address");
    let stream = TcpStream::connect(addr).await.expect("connect");
    tune(&stream).expect("tuned");
    let socket = SockRef::from(&stream);
    assert_eq!(socket.linger().ok(), Some(Some(Duration::ZERO)));
    assert_eq!(socket.keepalive().ok(), Some(true));
    assert_eq!(socket.tcp_keepalive_time().ok(), Some(KEEPALIVE_IDLE));
    assert_eq!(socket.tcp_keepalive_interval().ok(), Some(KEEPALIVE_INTERVAL));
    assert_eq!(socket.tcp_keepalive_retries().ok(), Some(KEEPALIVE_RETRIES));
    #[cfg(target_os = "linux")]
    assert_eq!(socket.tcp_user_timeout().ok(), Some(Some(USER_TIMEOUT)));
    assert_eq!(stream.nodelay().ok(), Some(true));
}
