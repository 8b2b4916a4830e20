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

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use locks_core::{Answer, Error, Job, LockPool, Settings, SslMode, TurnRef, Uuid};

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

/// Makes a CA, a server certificate it signs (for `localhost` only) and an unrelated CA, in `dir`.
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
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-extfile",
        "server.ext",
        "-out",
        "server.crt",
    ]);
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
        if !certs.join("ready").exists() {
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
                "{marker}\nssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
                certs.join("server.crt").display(),
                certs.join("server.key").display()
            ));
            fs::write(&conf, text).expect("postgresql.conf is writable");
            // Refuse every TCP connection without TLS: a call that succeeds
            // below went over TLS.
            let hba = data.join("pg_hba.conf");
            let text = fs::read_to_string(&hba).expect("pg_hba.conf");
            if !text.starts_with("hostnossl") {
                fs::write(
                    &hba,
                    format!(
                        "hostnossl all all 0.0.0.0/0 reject\nhostnossl all all ::/0 reject\n{text}"
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
            fs::write(certs.join("ready"), "").expect("marker");
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
        assert_eq!(
            err.to_string(),
            format!(
                "database connection failed: localhost:{port}: error performing TLS handshake: \
                 invalid peer certificate: UnknownIssuer"
            ),
            "{mode:?}"
        );
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
        format!(
            "database connection failed: 127.0.0.1:{port}: error performing TLS handshake: \
             invalid peer certificate: certificate not valid for name \"127.0.0.1\"; \
             certificate is only valid for DnsName(\"localhost\")"
        )
    );

    let ca_only = at_host(with(&cluster.url, SslMode::VerifyCa, Some(cluster.ca())), "127.0.0.1");
    assert_eq!(call(ca_only).ok(), Some(false));
}
