//! What the integration tests share: settings for a server given as
//! `postgres://user:password@host:port/database` (the test cluster's own
//! URLs, nothing else), and the time a call may take.

#![allow(dead_code)]

use std::time::Instant;

use locks_core::{Deadline, Prepare, Settings, SslMode, TargetServerType};

/// Settings for `url`, with short timeouts and two connections.
pub fn settings(url: &str) -> Settings {
    let rest =
        url.strip_prefix("postgres://").unwrap_or_else(|| panic!("a postgres:// URL: {url}"));
    let (userinfo, rest) = rest.split_once('@').expect("user@host");
    let (username, password) = userinfo.split_once(':').expect("user:password");
    let (hostport, database) = rest.split_once('/').expect("host/database");
    let (host, port) = hostport.split_once(':').expect("host:port");
    Settings {
        hostname: Some(host.to_owned()),
        socket_dir: None,
        port: port.parse().expect("a port"),
        endpoints: Vec::new(),
        target_server_type: TargetServerType::Primary,
        username: username.to_owned(),
        password: Some(password.to_owned()),
        database: database.to_owned(),
        sslmode: SslMode::Prefer,
        ssl_ca_file: None,
        ssl_cacerts: None,
        ssl_cert_file: None,
        ssl_key_file: None,
        ssl_cert: None,
        ssl_key: None,
        ssl_server_name: None,
        application_name: "locks_core_tests".to_owned(),
        prefix: None,
        pool_size: 2,
        connect_timeout: 5_000,
        checkout_timeout: 5_000,
        statement_timeout: 5_000,
        prepare: Prepare::Named,
    }
}

/// The deadline of a call made now.
pub fn now(settings: &Settings) -> Deadline {
    Deadline::new(Instant::now(), settings)
}
