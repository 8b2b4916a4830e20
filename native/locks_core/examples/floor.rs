//! The design's floor: the core crate's [`LockPool`] (tokio-postgres, one
//! statement per call, driven on the calling thread) from plain OS threads,
//! with no BEAM, no NIF and no queue of the library's around it. A dirty-I/O
//! scheduler thread is an OS thread running blocking code; this is what the
//! library's calls would cost if the VM added nothing.
//!
//! ```sh
//! cargo run --release --example floor -- --workload cycle --threads 10 --pool-size 8 --duration 3
//! ```
//!
//! `--threads N` threads each run the workload in a loop on rows of their
//! own, at most `--pool-size` of them in a call at once (a slot each, the
//! others wait for one, as the library's callers do): `cycle` (acquire then
//! release), `reads` (held? then fresh? on locks the thread holds) or `held`
//! (held? alone). After `--warmup` ms of untimed calls (the pool connects,
//! each connection prepares), every thread runs for `--duration` seconds
//! from the same instant. Printed: `floor timed` as the timed part starts,
//! then one line as it ends, the ops a second and the process's CPU time
//! (utime + stime of /proc/self/stat, every thread's) per statement over
//! the timed part.
//!
//! Connects with `DATABASE_URL` (`postgres://user:password@host:port/db`)
//! or, without it, libpq's PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE,
//! PGSSLMODE (as `mix locks.bench` passes them). Works on the tables of
//! schema `--prefix` (default the bench's, `phoenix_kit_agent_locks_bench`,
//! which `mix locks.bench` creates; `--prefix ''` for the search_path), in
//! rows of its own that it inserts if missing.

use std::sync::{Barrier, Condvar, Mutex};
use std::time::{Duration, Instant};

use locks_core::{
    Answer, Deadline, Hold, Job, LockPool, Prepare, Settings, SslMode, TargetServerType, Ttl,
    TurnRef, Uuid,
};

const TTL_S: i64 = 120;

struct Options {
    workload: String,
    threads: usize,
    pool_size: usize,
    duration: Duration,
    warmup: Duration,
    prefix: Option<String>,
}

fn main() {
    if let Err(message) = run() {
        eprintln!("floor: {message}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let options = options()?;
    let settings = settings(&options)?;
    let pool = LockPool::new(settings.clone()).map_err(|e| e.to_string())?;
    let deadline = || Deadline::new(Instant::now(), &settings);
    let ns: u8 = match options.workload.as_str() {
        "cycle" => 1,
        "reads" => 2,
        "held" => 3,
        other => return Err(format!("unknown workload {other:?}: cycle, reads or held")),
    };
    let ttl = Ttl::new(TTL_S).ok_or("ttl")?;
    let hold = Hold::new(TTL_S, ttl).ok_or("hold")?;
    let rows: Vec<(Uuid, Uuid, TurnRef)> = (0..options.threads)
        .map(|k| {
            let turn = TurnRef::new(&format!("floor-{}-{k}", options.workload)).ok_or("ref")?;
            Ok((row(ns, 0, k), row(ns, 1, k), turn))
        })
        .collect::<Result<_, &str>>()?;

    // The rows, and for the reads the locks they read, before any timing.
    let table = |name: &str| match &options.prefix {
        Some(schema) => format!("\"{schema}\".{name}"),
        None => name.to_owned(),
    };
    let values = |i: usize| {
        rows.iter()
            .map(|r| format!("('{:?}')", if i == 0 { r.0 } else { r.1 }))
            .collect::<Vec<_>>()
            .join(",")
    };
    let ddl = format!(
        "INSERT INTO {} (uuid) VALUES {} ON CONFLICT DO NOTHING; \
         INSERT INTO {} (user_uuid) VALUES {} ON CONFLICT DO NOTHING",
        table("phoenix_kit_agent_conversations"),
        values(0),
        table("phoenix_kit_agent_user_settings"),
        values(1)
    );
    pool.run_ddl(deadline(), &ddl).map_err(|e| e.to_string())?;
    if ns != 1 {
        for (chat, user, turn) in &rows {
            let job = Job::Acquire(*chat, *user, turn.clone(), ttl, hold);
            match pool.run(deadline(), &job).map_err(|e| e.to_string())? {
                Answer::Ok => {}
                other => return Err(format!("the reads' lock was not taken: {other:?}")),
            }
        }
    }

    // Each thread's op: its statements, built once, each of which must
    // answer as expected.
    let ops: Vec<Vec<(Job, Answer)>> = rows
        .iter()
        .map(|(chat, user, turn)| match ns {
            1 => vec![
                (Job::Acquire(*chat, *user, turn.clone(), ttl, hold), Answer::Ok),
                (Job::Release(*chat, *user, turn.clone()), Answer::Ok),
            ],
            2 => vec![
                (Job::Held(*chat, *user, turn.clone()), Answer::Yes(true)),
                (Job::Fresh(*chat, turn.clone(), ttl), Answer::Yes(true)),
            ],
            _ => vec![(Job::Held(*chat, *user, turn.clone()), Answer::Yes(true))],
        })
        .collect();
    let op = |jobs: &[(Job, Answer)]| -> Result<u64, String> {
        for (job, expected) in jobs {
            let _slot = Slot::take(&SLOTS, options.pool_size);
            let answer = pool.run(deadline(), job).map_err(|e| e.to_string())?;
            if &answer != expected {
                return Err(format!("{job:?} answered {answer:?}"));
            }
        }
        Ok(jobs.len() as u64)
    };

    let start = Barrier::new(options.threads + 1);
    let timed = Barrier::new(options.threads + 1);
    let (cpu, elapsed, ops, statements) = std::thread::scope(|scope| {
        let threads: Vec<_> = ops
            .iter()
            .map(|row| {
                let (start, timed, op) = (&start, &timed, &op);
                scope.spawn(move || -> Result<(u64, u64, Instant), String> {
                    start.wait();
                    let warm_until = Instant::now() + options.warmup;
                    while Instant::now() < warm_until {
                        op(row)?;
                    }
                    timed.wait();
                    let end = Instant::now() + options.duration;
                    let (mut ops, mut statements) = (0, 0);
                    loop {
                        statements += op(row)?;
                        ops += 1;
                        let now = Instant::now();
                        if now >= end {
                            return Ok((ops, statements, now));
                        }
                    }
                })
            })
            .collect();
        start.wait();
        // Every thread is past its warm-up: the timed part starts now.
        timed.wait();
        let (cpu0, t0) = (cpu_ticks(), Instant::now());
        // For a reader that times something else over the same part.
        println!("floor timed");
        let (mut ops, mut statements, mut last) = (0, 0, t0);
        for thread in threads {
            let (o, s, t) = thread.join().map_err(|_| "a thread panicked".to_owned())??;
            ops += o;
            statements += s;
            last = last.max(t);
        }
        Ok::<_, String>((cpu_ticks()? - cpu0?, last - t0, ops, statements))
    })?;

    let seconds = elapsed.as_secs_f64();
    let hz = clock_ticks_per_second();
    println!(
        "floor workload={} threads={} pool_size={} seconds={seconds:.3} ops={ops} statements={statements} \
         ops_per_s={:.1} cpu_us_per_statement={:.2}",
        options.workload,
        options.threads,
        options.pool_size,
        ops as f64 / seconds,
        cpu as f64 * 1e6 / hz / statements.max(1) as f64
    );
    pool.close();
    Ok(())
}

/// The uuid of thread `k`'s chat (`kind` 0) or user (1) for workload `ns`:
/// `f100f100-00<ns>0-40<kind>0-8000-0000000000<k>`, apart from the bench's.
fn row(ns: u8, kind: u8, k: usize) -> Uuid {
    let mut bytes = [0xf1, 0x00, 0xf1, 0x00, 0, ns, 0x40, kind, 0x80, 0, 0, 0, 0, 0, 0, 0];
    bytes[12..].copy_from_slice(&(k as u32).to_be_bytes());
    Uuid::from_bytes(&bytes).expect("16 bytes")
}

/// At most `pool_size` calls at once: a slot each, the others wait.
static SLOTS: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

struct Slot(&'static (Mutex<usize>, Condvar));

impl Slot {
    fn take(slots: &'static (Mutex<usize>, Condvar), limit: usize) -> Slot {
        let (busy, freed) = slots;
        let mut busy = busy.lock().unwrap_or_else(|e| e.into_inner());
        while *busy >= limit {
            busy = freed.wait(busy).unwrap_or_else(|e| e.into_inner());
        }
        *busy += 1;
        Slot(slots)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let (busy, freed) = self.0;
        *busy.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        freed.notify_one();
    }
}

/// This process's CPU time so far (every thread's utime + stime), in ticks.
fn cpu_ticks() -> Result<u64, String> {
    let stat =
        std::fs::read_to_string("/proc/self/stat").map_err(|e| format!("/proc/self/stat: {e}"))?;
    // Fields after the command name (in parentheses) start at field 3.
    let fields: Vec<&str> =
        stat.rsplit_once(')').ok_or("/proc/self/stat")?.1.split_whitespace().collect();
    let field =
        |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok()).ok_or("/proc/self/stat");
    Ok(field(14)? + field(15)?)
}

/// `getconf CLK_TCK`: 100 on Linux, whatever the kernel's HZ.
fn clock_ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(100.0)
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        workload: "cycle".to_owned(),
        threads: 10,
        pool_size: 8,
        duration: Duration::from_secs(3),
        warmup: Duration::from_millis(1000),
        prefix: Some("phoenix_kit_agent_locks_bench".to_owned()),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || value.parse::<u64>().map_err(|_| format!("{flag}: not a number: {value}"));
        match flag.as_str() {
            "--workload" => options.workload = value.clone(),
            "--threads" => options.threads = number()?.max(1) as usize,
            "--pool-size" => options.pool_size = number()?.max(1) as usize,
            "--duration" => options.duration = Duration::from_secs(number()?.max(1)),
            "--warmup" => options.warmup = Duration::from_millis(number()?),
            "--prefix" => options.prefix = Some(value.clone()).filter(|p| !p.is_empty()),
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(options)
}

/// The pool's settings, from DATABASE_URL or libpq's variables.
fn settings(options: &Options) -> Result<Settings, String> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let (host, port, username, password, database, sslmode) = match env("DATABASE_URL") {
        Some(url) => {
            let rest = url
                .strip_prefix("postgres://")
                .or_else(|| url.strip_prefix("postgresql://"))
                .ok_or("DATABASE_URL: postgres://user:password@host:port/database")?;
            let rest = rest.split('?').next().unwrap_or(rest);
            let (userinfo, rest) = rest.split_once('@').ok_or("DATABASE_URL: no user@")?;
            let (user, password) = match userinfo.split_once(':') {
                Some((u, p)) => (u.to_owned(), Some(p.to_owned())),
                None => (userinfo.to_owned(), None),
            };
            let (hostport, database) = rest.split_once('/').ok_or("DATABASE_URL: no /database")?;
            let (host, port) = hostport.split_once(':').unwrap_or((hostport, "5432"));
            (
                host.to_owned(),
                port.to_owned(),
                user,
                password,
                database.to_owned(),
                "prefer".to_owned(),
            )
        }
        None => (
            env("PGHOST").unwrap_or_else(|| "localhost".to_owned()),
            env("PGPORT").unwrap_or_else(|| "5432".to_owned()),
            env("PGUSER").ok_or("neither DATABASE_URL nor PGUSER is set")?,
            env("PGPASSWORD"),
            env("PGDATABASE").ok_or("neither DATABASE_URL nor PGDATABASE is set")?,
            env("PGSSLMODE").unwrap_or_else(|| "prefer".to_owned()),
        ),
    };
    let sslmode = match sslmode.as_str() {
        "disable" => SslMode::Disable,
        "prefer" | "allow" => SslMode::Prefer,
        "require" => SslMode::Require,
        "verify-ca" => SslMode::VerifyCa,
        "verify-full" => SslMode::VerifyFull,
        other => return Err(format!("unknown sslmode {other}")),
    };
    // libpq takes a directory as a host: its socket.
    let socket = host.starts_with('/');
    Ok(Settings {
        hostname: (!socket).then(|| host.clone()),
        socket_dir: socket.then_some(host),
        port: port.parse().map_err(|_| format!("port: {port}"))?,
        endpoints: Vec::new(),
        target_server_type: TargetServerType::Primary,
        username,
        password,
        database,
        sslmode,
        ssl_ca_file: env("PGSSLROOTCERT"),
        ssl_cacerts: None,
        ssl_cert_file: env("PGSSLCERT"),
        ssl_key_file: env("PGSSLKEY"),
        ssl_cert: None,
        ssl_key: None,
        ssl_server_name: None,
        application_name: "phoenix_kit_agent_locks floor".to_owned(),
        prefix: options.prefix.clone(),
        pool_size: options.pool_size,
        connect_timeout: 10_000,
        checkout_timeout: 5_000,
        statement_timeout: 15_000,
        prepare: Prepare::Named,
    })
}
