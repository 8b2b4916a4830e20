//! TLS against a real server: a second private cluster of its own
//! (`_build/pg-tls`, started by `scripts/pg` with `LOCKS_PG_DIR`), with a
//! certificate made here by `openssl` and a `pg_hba.conf` that refuses every
//! TCP connection without TLS, so a call that succeeds went over TLS.
//!
//! The shared cluster of the other tests (`_build/pg`) is never touched. The
//! TLS cluster is set up once (certificates, `ssl = on`, a restart) and, run
//! alone, left running for the next run, like the shared one
//! (`LOCKS_PG_DIR=$PWD/_build/pg-tls scripts/pg stop` stops it); `scripts/test`
//! stops it at its end with every other cluster of its run (`scripts/servers`).
//!
//! The server certificate is for `localhost` only: reached as `127.0.0.1`,
//! the same server shows what `verify_full` checks that `verify_ca` does not.
//! The role `locks_cert` logs in with a client certificate alone
//! (`hostssl … cert`: its CN, signed by the same CA, is the user).
//!
//! One test needs no server (it never calls `cluster()`): a CA file is read
//! when the pool is built, before any connection (moved from the unit test
//! of tls.rs, through `LockPool::new`).

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use locks_core::{Answer, Der, Error, Job, KeyFormat, LockPool, Settings, SslMode, TurnRef, Uuid};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The cluster's URL (no TLS parameters) and the certificates' directory.
struct Cluster {
    url: String,
    certs: PathBuf,
}

impl Cluster {
    fn ca(&self) -> String {
        self.certs.join("ca.crt").display().to_string()
    }

    fn wrong_ca(&self) -> String {
        self.certs.join("wrong-ca.crt").display().to_string()
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `program` and returns its stdout; panics with its output on failure.
fn run(command: &mut Command) -> String {
    let out = command.output().unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn is_root() -> bool {
    run(Command::new("id").arg("-u")).trim() == "0"
}

/// A command run as the cluster's owner (`postgres` when we are root, as
/// `scripts/pg` does: initdb and the server refuse to run as root).
fn as_pg(program: &str) -> Command {
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--", program]);
        command
    } else {
        Command::new(program)
    }
}

fn pg_bin() -> PathBuf {
    let mut versions: Vec<PathBuf> = fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql (scripts/setup)")
        .filter_map(|entry| entry.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("pg_ctl").exists())
        .collect();
    versions.sort_by_key(|bin| {
        bin.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    versions.pop().expect("a PostgreSQL server version")
}

/// Makes a CA, a server certificate it signs (for `localhost` only), a
/// client certificate it signs (for the user `locks_cert`) and an unrelated
/// CA, in `dir`.
fn make_certificates(dir: &Path) {
    fs::create_dir_all(dir).expect("certificate directory");
    let openssl = |args: &[&str]| run(Command::new("openssl").current_dir(dir).args(args));
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    for (name, subject) in [("ca", "/CN=locks test CA"), ("wrong-ca", "/CN=locks wrong CA")] {
        let (key, crt) = (format!("{name}.key"), format!("{name}.crt"));
        let mut args = vec!["req", "-x509", "-days", "3650", "-subj", subject];
        args.extend(ec);
        args.extend(["-keyout", &key, "-out", &crt]);
        args.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
        args.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
        openssl(&args);
    }
    let mut args = vec!["req", "-subj", "/CN=localhost"];
    args.extend(ec);
    args.extend(["-keyout", "server.key", "-out", "server.csr"]);
    openssl(&args);
    fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n\
         keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .expect("extension file");
    let mut args = vec!["req", "-subj", "/CN=locks_cert"];
    args.extend(ec);
    args.extend(["-keyout", "client.key", "-out", "client.csr"]);
    openssl(&args);
    fs::write(dir.join("client.ext"), "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
        .expect("extension file");
    // Each certificate signed by the CA, with its own extensions.
    for name in ["client", "server"] {
        let (csr, ext, crt) = (format!("{name}.csr"), format!("{name}.ext"), format!("{name}.crt"));
        let ca = ["-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "3650"];
        let mut args = vec!["x509", "-req", "-in", &csr];
        args.extend(ca);
        args.extend(["-extfile", &ext, "-out", &crt]);
        openssl(&args);
    }
}

/// Starts (the first time: creates) the TLS cluster and returns it.
fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let root = root();
        let dir = root.join("_build/pg-tls");
        let start = || {
            let out =
                run(Command::new(root.join("scripts/pg")).arg("start").env("LOCKS_PG_DIR", &dir));
            out.split('\'')
                .nth(1)
                .unwrap_or_else(|| panic!("scripts/pg printed no URL: {out}"))
                .to_owned()
        };
        let mut url = start();
        // Under a private checkout `_build/pg-tls` is a link to /var/tmp
        // (see scripts/pg): the postgres user is given the link's target.
        let dir = fs::canonicalize(&dir).expect("the cluster's directory");
        let certs = dir.join("tls");
        let data = dir.join("data");
        // "ready-2": made with the client certificate and its user.
        if !certs.join("ready-2").exists() {
            make_certificates(&certs);
            if is_root() {
                run(Command::new("chown").args(["-R", "postgres:postgres"]).arg(&certs));
            }
            run(Command::new("chmod").arg("600").arg(certs.join("server.key")));
            // The TLS block goes last, replacing one a run that stopped
            // half-way wrote; the pg_hba edit is skipped when made already.
            let conf = data.join("postgresql.conf");
            let text = fs::read_to_string(&conf).expect("postgresql.conf");
            let marker = "# TLS, for native/locks_core/tests/tls.rs";
            let mut text = text.split(marker).next().unwrap_or_default().to_owned();
            text.push_str(&format!(
                "{marker}\nssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n\
                 ssl_ca_file = '{}'\n",
                certs.join("server.crt").display(),
                certs.join("server.key").display(),
                certs.join("ca.crt").display()
            ));
            fs::write(&conf, text).expect("postgresql.conf is writable");
            // Refuse every TCP connection without TLS: a call that succeeds
            // below went over TLS.
            let hba = data.join("pg_hba.conf");
            let text = fs::read_to_string(&hba).expect("pg_hba.conf");
            // locks_cert logs in with its certificate alone.
            if !text.contains("locks_cert") {
                fs::write(
                    &hba,
                    format!(
                        "hostnossl all all 0.0.0.0/0 reject\nhostnossl all all ::/0 reject\n\
                         hostssl all locks_cert 127.0.0.1/32 cert\n{}",
                        text.replace("hostnossl all all 0.0.0.0/0 reject\n", "")
                            .replace("hostnossl all all ::/0 reject\n", "")
                    ),
                )
                .expect("pg_hba.conf is writable");
            }
            run(as_pg(&pg_bin().join("pg_ctl").display().to_string())
                // Not the crate's directory: the postgres user may not reach it.
                .current_dir("/")
                .arg("-D")
                .arg(&data)
                // A log file of its own, or the server would hold this
                // command's output pipe open and `run` would never return.
                .arg("-l")
                .arg(dir.join("server.log"))
                .args(["-w", "-t", "60", "restart"]));
            // A member of locks, so that it reads the tables locks owns.
            run(as_pg(&pg_bin().join("psql").display().to_string())
                .current_dir("/")
                .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-U", "postgres", "-d", "locks"])
                .arg("-h")
                .arg(dir.join("sock"))
                .arg("-p")
                .arg(fs::read_to_string(dir.join("port")).expect("port").trim())
                .arg("-c")
                .arg(
                    "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'locks_cert') \
                     THEN CREATE ROLE locks_cert LOGIN IN ROLE locks; END IF; END $$",
                ));
            fs::write(certs.join("ready-2"), "").expect("marker");
            url = start();
        }
        // The tables, once: `held` reads both.
        let settings = with(&url, SslMode::Require, None);
        LockPool::new(settings.clone())
            .and_then(|pool| {
                pool.run_ddl(common::now(&settings), &locks_core::schema::tables(None))
            })
            .expect("the tables can be created over TLS");
        Cluster { url, certs }
    })
}

/// Settings for `url` in `mode`, trusting `ca_file`.
fn with(url: &str, mode: SslMode, ca_file: Option<String>) -> Settings {
    Settings { sslmode: mode, ssl_ca_file: ca_file, ..common::settings(url) }
}

/// The same settings, reaching the server by another name.
fn at_host(mut settings: Settings, host: &str) -> Settings {
    settings.hostname = Some(host.to_owned());
    settings
}

/// One lock call (`held`) on a fresh pool: a connection, TLS included, and a
/// statement.
fn call(settings: Settings) -> Result<bool, Error> {
    let pool = LockPool::new(settings.clone())?;
    let id = Uuid::from_bytes(&[7; 16]).expect("16 bytes");
    let turn = TurnRef::new("turn-tls").expect("a turn ref");
    let job = Job::Held(id, id, turn);
    match pool.run(common::now(&settings), &job)? {
        Answer::Yes(held) => Ok(held),
        other => panic!("held answered {other:?}"),
    }
}

#[test]
fn require_and_prefer_encrypt_without_checking_the_certificate() {
    let cluster = cluster();
    for mode in [SslMode::Require, SslMode::Prefer] {
        assert_eq!(call(with(&cluster.url, mode, None)).ok(), Some(false), "{mode:?}");
    }
}

#[test]
fn disable_is_refused_by_this_server_so_success_above_means_tls() {
    let cluster = cluster();
    let err = call(with(&cluster.url, SslMode::Disable, None))
        .expect_err("the server refuses plain TCP")
        .to_string();
    assert!(err.contains("no encryption"), "{err}");
}

#[test]
fn verify_full_with_the_right_ca_and_name_succeeds() {
    let cluster = cluster();
    let settings =
        at_host(with(&cluster.url, SslMode::VerifyFull, Some(cluster.ca())), "localhost");
    assert_eq!(call(settings).ok(), Some(false));
}

#[test]
fn a_wrong_ca_fails_naming_the_certificate() {
    let cluster = cluster();
    for mode in [SslMode::VerifyFull, SslMode::VerifyCa] {
        let settings = at_host(with(&cluster.url, mode, Some(cluster.wrong_ca())), "localhost");
        let port = settings.port;
        let err = call(settings).expect_err("an unknown issuer");
        assert!(matches!(err, Error::Connect(_)), "{err:?}");
        assert_eq!(err.to_string(), refused("localhost", port, "UnknownIssuer"), "{mode:?}");
    }
}

#[test]
fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    let cluster = cluster();
    // The same server, reached as an address its certificate is not for.
    let full = at_host(with(&cluster.url, SslMode::VerifyFull, Some(cluster.ca())), "127.0.0.1");
    let port = full.port;
    let err = call(full).expect_err("a certificate for another name").to_string();
    assert_eq!(
        err,
        refused(
            "127.0.0.1",
            port,
            "certificate not valid for name \"127.0.0.1\"; certificate is only valid for \
             DnsName(\"localhost\")"
        )
    );

    let ca_only = at_host(with(&cluster.url, SslMode::VerifyCa, Some(cluster.ca())), "127.0.0.1");
    assert_eq!(call(ca_only).ok(), Some(false));
}

/// A PEM file of the certificates' directory, as DER.
fn der(cluster: &Cluster, file: &str) -> Der {
    let pem = cluster.certs.join(file);
    let cert = CertificateDer::from_pem_file(&pem).unwrap_or_else(|e| panic!("{pem:?}: {e}"));
    Der(cert.to_vec())
}

/// The refusal of a certificate, as every verifying mode words it.
fn refused(host: &str, port: u32, why: &str) -> String {
    format!(
        "database connection failed: {host}:{port}: error performing TLS handshake: \
         invalid peer certificate: {why} (checked as Postgrex 0.18 and later check it: name its \
         CA with the repo's cacerts:/cacertfile: or ssl_ca_file; verify: :verify_none in the \
         repo's ssl options, or sslmode: :require, connects without checking it, as older \
         Postgrex did)"
    )
}

#[test]
fn der_certificates_are_trusted_as_the_ca_file_is() {
    let cluster = cluster();
    let settings = |ca: &str| Settings {
        ssl_cacerts: Some(vec![der(cluster, ca)]),
        ..at_host(with(&cluster.url, SslMode::VerifyFull, None), "localhost")
    };
    assert_eq!(call(settings("ca.crt")).ok(), Some(false));
    let wrong = settings("wrong-ca.crt");
    let port = wrong.port;
    let err = call(wrong).expect_err("an unknown issuer").to_string();
    assert_eq!(err, refused("localhost", port, "UnknownIssuer"));
}

#[test]
fn the_server_name_is_the_name_checked_whatever_the_host() {
    let cluster = cluster();
    let named = |name: &str| Settings {
        ssl_server_name: Some(name.to_owned()),
        ..at_host(with(&cluster.url, SslMode::VerifyFull, Some(cluster.ca())), "127.0.0.1")
    };
    assert_eq!(call(named("localhost")).ok(), Some(false));
    let other = named("db.example");
    let port = other.port;
    assert_eq!(
        call(other).expect_err("another name").to_string(),
        refused(
            "127.0.0.1",
            port,
            "certificate not valid for name \"db.example\"; certificate is only valid for \
             DnsName(\"localhost\")"
        )
    );
}

#[test]
fn a_client_certificate_logs_in_the_user_that_needs_one() {
    let cluster = cluster();
    let user = |settings: Settings| Settings {
        username: "locks_cert".to_owned(),
        password: None,
        ..at_host(settings, "localhost")
    };
    let bare = user(with(&cluster.url, SslMode::VerifyFull, Some(cluster.ca())));
    let port = bare.port;
    assert_eq!(
        call(bare.clone()).expect_err("no certificate").to_string(),
        format!(
            "database connection failed: localhost:{port}: connection requires a valid client \
             certificate (28000)"
        )
    );

    let files = Settings {
        ssl_cert_file: Some(cluster.certs.join("client.crt").display().to_string()),
        ssl_key_file: Some(cluster.certs.join("client.key").display().to_string()),
        ..bare.clone()
    };
    assert_eq!(call(files).ok(), Some(false));

    let key = PrivateKeyDer::from_pem_file(cluster.certs.join("client.key")).expect("the key");
    let format = match &key {
        PrivateKeyDer::Pkcs1(_) => KeyFormat::Pkcs1,
        PrivateKeyDer::Sec1(_) => KeyFormat::Sec1,
        _ => KeyFormat::Pkcs8,
    };
    let ders = Settings {
        ssl_cert: Some(vec![der(cluster, "client.crt")]),
        ssl_key: Some((format, Der(key.secret_der().to_vec()))),
        ..bare
    };
    assert_eq!(call(ders).ok(), Some(false));
}

/// Why a pool (for a server it never reaches) in `mode`, trusting
/// `ca_file`, cannot be built; `None` when it is.
fn refusal(mode: SslMode, ca_file: Option<&str>) -> Option<String> {
    let settings = with("postgres://u:p@localhost:5432/d", mode, ca_file.map(str::to_owned));
    LockPool::new(settings).err().map(|e| e.to_string())
}

/// A CA file that holds no certificate stops the pool from being built,
/// named in the message; with `disable` no file is read at all (a CA, a
/// client certificate or key that does not exist passes). No server:
/// building a pool connects to none.
#[test]
fn a_ca_file_is_refused_when_it_holds_no_certificate_and_not_read_with_disable() {
    assert_eq!(refusal(SslMode::Disable, Some("/nonexistent/ca.pem")), None);
    let url = "postgres://u:p@localhost:5432/d";
    let missing = Some("/nonexistent/client.pem".to_owned());
    let client = Settings {
        ssl_cert_file: missing.clone(),
        ssl_key_file: missing,
        ..with(url, SslMode::Disable, None)
    };
    assert!(LockPool::new(client.clone()).is_ok());
    let required = LockPool::new(Settings { sslmode: SslMode::Require, ..client });
    assert!(required.is_err(), "require reads the client certificate");
    let empty = std::env::temp_dir().join(format!("locks-empty-ca-{}.pem", std::process::id()));
    fs::write(&empty, "not a certificate\n").expect("temp file");
    let err = refusal(SslMode::VerifyCa, empty.to_str());
    let _ = fs::remove_file(&empty);
    let expected =
        format!("invalid configuration: ssl_ca_file: {empty:?} holds no PEM certificate");
    assert_eq!(err, Some(expected));
}
