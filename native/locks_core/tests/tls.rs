//! TLS against a real server: a second private cluster of its own
//! (`_build/pg-tls`, started by `scripts/pg` with `LOCKS_PG_DIR`), with a
//! certificate made here by `openssl` and a `pg_hba.conf` that refuses every
//! TCP connection without TLS, so a call that succeeds went over TLS.
//!
//! The shared cluster of the other tests (`_build/pg`) is never touched. The
//! TLS cluster is set up once (certificates, `ssl = on`, a restart) and left
//! running for the next run, like the shared one; `LOCKS_PG_DIR=$PWD/_build/pg-tls
//! scripts/pg stop` stops it.
//!
//! The server certificate is for `localhost` and `127.0.0.1`; `wrong.example`
//! reaches the same server through `hostaddr`, to show what `verify-full`
//! checks that `verify-ca` does not.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use locks_core::config::Options;
use locks_core::{Config, Error, Locks, SslMode, TurnRef, Uuid};

/// The cluster's URL (no TLS parameters) and the certificates' directory.
struct Cluster {
    url: String,
    port: String,
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
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
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

/// Makes a CA, a server certificate it signs (for `localhost` and
/// `127.0.0.1`) and an unrelated CA, in `dir`.
fn make_certificates(dir: &Path) {
    fs::create_dir_all(dir).expect("certificate directory");
    let openssl = |args: &[&str]| run(Command::new("openssl").current_dir(dir).args(args));
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    for (name, subject) in [
        ("ca", "/CN=locks test CA"),
        ("wrong-ca", "/CN=locks wrong CA"),
    ] {
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
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
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
            let out = run(Command::new(root.join("scripts/pg"))
                .arg("start")
                .env("LOCKS_PG_DIR", &dir));
            out.split('\'')
                .nth(1)
                .unwrap_or_else(|| panic!("scripts/pg printed no URL: {out}"))
                .to_owned()
        };
        let mut url = start();
        let certs = dir.join("tls");
        let data = dir.join("data");
        if !certs.join("ready").exists() {
            make_certificates(&certs);
            if is_root() {
                run(Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&certs));
            }
            run(Command::new("chmod")
                .arg("600")
                .arg(certs.join("server.key")));
            // Each edit is skipped when a run that stopped half-way made it.
            let conf = data.join("postgresql.conf");
            let mut text = fs::read_to_string(&conf).expect("postgresql.conf");
            let marker = "# TLS, for native/locks_core/tests/tls.rs";
            if !text.contains(marker) {
                text.push_str(&format!(
                    "\n{marker}\nssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
                    certs.join("server.crt").display(),
                    certs.join("server.key").display()
                ));
                fs::write(&conf, text).expect("postgresql.conf is writable");
            }
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
        let port = fs::read_to_string(dir.join("port"))
            .expect("the cluster's port file")
            .trim()
            .to_owned();
        // The tables, once: `held` reads both. On a thread of its own: this
        // runs inside a test's runtime, which cannot block on another.
        let ddl_url = url.clone();
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime")
                .block_on(async {
                    let config = Config::new(&options(&ddl_url, "require"))?;
                    Locks::new(config)?
                        .run_ddl(&locks_core::schema::tables(None))
                        .await
                })
        })
        .join()
        .expect("the DDL thread ends")
        .expect("the tables can be created over TLS");
        Cluster { url, port, certs }
    })
}

fn options<'a>(url: &'a str, sslmode: &'a str) -> Options<'a> {
    Options {
        url,
        sslmode: Some(sslmode),
        connect_timeout_ms: Some(5_000),
        ..Options::default()
    }
}

/// One lock call (`held`) on a fresh pool: a connection, TLS included, and a
/// statement.
async fn call(options: &Options<'_>) -> Result<bool, Error> {
    let locks = Locks::new(Config::new(options)?)?;
    let id = Uuid::parse("uuid", "6f1c4f9e-8a53-4a77-9b1e-3f0c2d8e5a10")?;
    locks
        .held(&id, &id, TurnRef::parse("turn_ref", "turn-tls")?)
        .await
}

#[tokio::test]
async fn require_encrypts_without_checking_the_certificate() {
    let cluster = cluster();
    assert_eq!(
        call(&options(&cluster.url, "require")).await.ok(),
        Some(false)
    );
    // prefer takes the TLS the server offers.
    assert_eq!(
        call(&options(&cluster.url, "prefer")).await.ok(),
        Some(false)
    );
}

#[tokio::test]
async fn disable_is_refused_by_this_server_so_success_above_means_tls() {
    let cluster = cluster();
    let err = call(&options(&cluster.url, "disable"))
        .await
        .expect_err("the server refuses plain TCP")
        .to_string();
    assert!(err.contains("no encryption"), "{err}");
}

#[tokio::test]
async fn verify_full_with_the_right_ca_succeeds() {
    let cluster = cluster();
    let ca = cluster.ca();
    let options = Options {
        ssl_ca_file: Some(&ca),
        ..options(&cluster.url, "verify-full")
    };
    assert_eq!(call(&options).await.ok(), Some(false));
}

#[tokio::test]
async fn verify_full_and_its_ca_file_can_come_from_the_url() {
    let cluster = cluster();
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        cluster.url,
        cluster.ca().replace('/', "%2F")
    );
    let options = Options {
        url: &url,
        ..Options::default()
    };
    assert_eq!(
        Config::new(&options).expect("valid").sslmode(),
        SslMode::VerifyFull
    );
    assert_eq!(call(&options).await.ok(), Some(false));
}

#[tokio::test]
async fn verify_full_with_a_wrong_ca_fails_naming_the_certificate() {
    let cluster = cluster();
    let wrong = cluster.wrong_ca();
    for mode in ["verify-full", "verify-ca"] {
        let options = Options {
            ssl_ca_file: Some(&wrong),
            ..options(&cluster.url, mode)
        };
        let err = call(&options).await.expect_err("an unknown issuer");
        assert!(matches!(err, Error::Connect(_)), "{err:?}");
        assert_eq!(
            err.to_string(),
            "database connection failed: error performing TLS handshake: \
             invalid peer certificate: UnknownIssuer",
            "{mode}"
        );
    }
}

#[tokio::test]
async fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    let cluster = cluster();
    let ca = cluster.ca();
    // The same server, reached as a name its certificate is not for.
    let url = format!(
        "postgres://locks:locks-test-pw@wrong.example:{}/locks?hostaddr=127.0.0.1",
        cluster.port
    );
    let full = Options {
        ssl_ca_file: Some(&ca),
        ..options(&url, "verify-full")
    };
    let err = call(&full)
        .await
        .expect_err("a certificate for another name")
        .to_string();
    assert_eq!(
        err,
        "database connection failed: error performing TLS handshake: invalid peer certificate: \
         certificate not valid for name \"wrong.example\"; certificate is only valid for \
         DnsName(\"localhost\") or IpAddress(127.0.0.1)"
    );

    let ca_only = Options {
        ssl_ca_file: Some(&ca),
        ..options(&url, "verify-ca")
    };
    assert_eq!(call(&ca_only).await.ok(), Some(false));
}
