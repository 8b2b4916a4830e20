//! A connect error names the server first, whatever the cause, and never the
//! password: the first call of a pool whose server cannot be reached.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;

use locks_core::{Job, LockPool, Settings, SslMode, TurnRef, Uuid};

/// The message of the first call of a pool on `settings`.
fn refusal(settings: Settings) -> String {
    let pool = LockPool::new(settings.clone()).expect("a pool");
    let id = Uuid::from_bytes(&[7; 16]).expect("16 bytes");
    let job = Job::Held(id, id, TurnRef::new("turn-connect").expect("a turn ref"));
    match pool.run(common::now(&settings), &job) {
        Ok(answer) => panic!("answered {answer:?}"),
        Err(err) => err.to_string(),
    }
}

/// A local listener whose connections get `reply`, then are closed.
fn peer(reply: &'static [u8]) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let _ = stream.read(&mut [0; 1024]);
            let _ = stream.write_all(reply);
        }
    });
    port
}

/// Settings for 127.0.0.1:`port`, and what connect errors name.
fn local(port: u16, sslmode: SslMode) -> (Settings, String) {
    let settings = common::settings(&format!("postgres://locks:secret-pw@127.0.0.1:{port}/locks"));
    (Settings { sslmode, connect_timeout: 300, ..settings }, format!("127.0.0.1:{port}"))
}

// A peer that never answers the login (the connect timeout) is
// test/phoenix_kit_agent/turns/network_test.exs's.
#[test]
fn connect_errors_name_the_host_and_port_or_the_socket() {
    // Not PostgreSQL: an HTTP server's answer to the startup message.
    let http = local(peer(b"HTTP/1.1 400 Bad Request\r\n\r\n"), SslMode::Disable);
    let closed = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr());
    let closed = closed.expect("a free port").port();
    let (mut socket, _) = local(5432, SslMode::Prefer);
    socket.socket_dir = Some("/nonexistent".into());
    for ((settings, peer), cause) in [
        (http, "error communicating with the server: bytes remaining on stream"),
        (local(closed, SslMode::Prefer), "Connection refused (os error 111)"),
        ((socket, "/nonexistent/.s.PGSQL.5432".into()), "No such file or directory (os error 2)"),
    ] {
        let message = refusal(settings);
        assert_eq!(message, format!("database connection failed: {peer}: {cause}"));
        assert!(!message.contains("secret-pw"), "{message}");
    }

    let (mut v6, _) = local(closed, SslMode::Prefer);
    v6.hostname = Some("::1".into());
    let v6 = refusal(v6);
    assert!(v6.starts_with(&format!("database connection failed: [::1]:{closed}: ")), "{v6}");
}
