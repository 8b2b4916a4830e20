defmodule Mix.Tasks.Locks.Bench do
  @shortdoc "Benchmarks the lock calls against pgbench running the same SQL"
  @moduledoc """
  Measures the lock calls from Elixir and compares them with `pgbench`
  running the library's own statements, in one run, against the database
  the library is configured for: `config :phoenix_kit_agent_locks` with
  `url:`, `repo:` or discrete settings, or `DATABASE_URL`, resolved as the
  application resolves it. `psql` and `pgbench` are given that connection
  through libpq's environment (`PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`,
  `PGDATABASE`, `PGSSLMODE`), so a `repo:` configuration needs no URL.

      mix locks.bench
      mix locks.bench --duration 10 --runs 3 --out bench/results.md
      mix locks.bench --quick --workloads cycle,reads
      mix locks.bench --workloads cycle --cycle-callers 50 --pool-size 6
      mix locks.bench --peer postgrex --workloads cycle,reads --runs 5
      mix locks.bench --peer postgrex --alternate 5 --workloads cycle,reads --cycle-callers 10,50

  With `--peer postgrex` the same statements also run through Postgrex
  (statements prepared once, `Postgrex.execute/4` from the same N
  processes, a pool of the same size) in the same runs, and the report
  adds library ÷ Postgrex ratios of throughput and of the VM's CPU per
  statement, with the targets of issue 20. The project has no hex
  dependency, so Postgrex is there only when the bench runs from a host
  app that has it, with this library as a dependency compiled in :dev
  (`{:phoenix_kit_agent_locks, path: "…", env: :dev}`); without it the task
  says so and measures nothing.

  ## A busy VM (`--busy K`) and the floor (`--floor`)

  Both in `--alternate` mode only.

  With `--busy K`, `K` CPU-bound processes run on the normal schedulers
  during every run of every side, each counting units of pure work, as a
  loaded node's processes keep its schedulers busy; each run starts with
  the load alone for as long as a side's timed part (the baseline). The
  report's "Busy VM" section gives each side's throughput and the load's
  work lost per statement: the baseline's units a second less those during
  the side's run, over the side's statements a second, in µs of one load
  process's time.

  With `--floor`, each run of `cycle`, `reads` and `held` also runs the
  design's floor after pgbench: the core crate's pool from plain OS threads,
  no VM (`native/locks_core/examples/floor.rs`, built once with
  `cargo build --release --example floor`; cargo must be on the PATH), at
  the same callers (threads) and pool size.

      mix locks.bench --alternate 5 --busy 2 --floor --workloads held --read-callers 10

  ## Alternated runs (`--alternate N`)

  The mode whose figures `bench/README.md` quotes. Each point (a workload
  at a number of callers) is run `N` times in a row (at least 5), each time
  the library, then Postgrex, then pgbench, so the library and Postgrex
  alternate (library, Postgrex, library, …) and each library run has its
  Postgrex run beside it, a pair. The report gives, per point, the median
  and the range (min–max) of each side's throughput and of the VM's CPU
  per statement, the median and the range of the per-pair ratios library ÷
  Postgrex, the server's `fsync`, `synchronous_commit` and
  `full_page_writes`, the commit, and the machine (cores, the 1-minute
  load average before the run). The cycle's `BEGIN … COMMIT ×2` reference
  is left out, and `--runs` does not apply.

  Postgrex is used when it is loaded (`--peer postgrex` is then implied);
  without it the mode runs the library and pgbench alone and the report
  says that Postgrex is absent, so the same command works in this project
  and from a host app.

  The task is the project's own: it lives in `bench/`, compiled in `:dev`
  and `:test` only, never into a host's release.

  Workloads, each timed from Elixir processes and then through
  `pgbench -M prepared -c N -j N -T duration` at the same concurrency:

    * `cycle`: `acquire/4` then `release/3`, each caller on its own chat and
      user, at 1, 10 and 50 callers; also the same cycle as two
      `BEGIN … COMMIT` transactions through pgbench, the reference a caller
      would otherwise have;
    * `hot`: 50 callers race for one chat, the winner releases;
    * `reads`: `held?/3` and `fresh?/3`, at 10 and 50 callers
      (`--read-callers`);
    * `held`: `held?/3` alone, at the same callers as `reads`;
    * `click`: `acquire_user/4`, `keep_user/4`, `release_user/2`, 10 callers;
    * `statements`: how many statements and transactions one call of each
      function costs, from `pg_stat_statements` under a role created for
      the count and dropped after it (the extension must exist in the
      database: the bench does not create it); without it, or without the
      right to create a role, `pg_stat_database.xact_commit` deltas, an
      upper bound;
    * `overhead`: the steps of one `held?/3`, serially: a normal-scheduler
      NIF, a dirty-I/O NIF that takes a slot and does no I/O, the whole
      call.

  For each: ops/s and the p50/p99/max latency a caller sees, the same for
  pgbench, their ratio and the p50 difference; the VM's CPU time per op and
  per call (every BEAM thread's utime + stime, `/proc/self/task/*/stat`,
  over the timed part) and pgbench's per transaction; and, during the
  library runs, the p99 of a message round trip between two processes on
  normal schedulers and of a 1-byte file read (which waits for a dirty-I/O
  scheduler, as the lock calls do). One markdown report is printed and
  written to `--out`.

  The statement texts pgbench runs are those the pool sends, read off the
  wire by a proxy the bench puts in front of a pool of its own: the NIF
  exports nothing for the bench.

  The bench works in a schema of its own, `phoenix_kit_agent_locks_bench`
  (created, with its tables and rows, if missing), and never touches other
  rows. It needs `pgbench`, `psql` and, for pgbench's CPU time, `bash` on
  the PATH; the VM's CPU time needs Linux's `/proc`.

  ## Options

    * `--duration` - seconds per run of each side. Defaults to 5.
    * `--warmup` - milliseconds of untimed calls before each library run
      (the pool connects, each connection prepares). Defaults to 1000.
    * `--runs` - repeat every comparison this many times and report the
      medians too. Defaults to 1.
    * `--workloads` - a comma-separated subset of
      `statements,overhead,cycle,hot,reads,click`. Defaults to all.
    * `--cycle-callers` - comma-separated caller counts for `cycle`.
      Defaults to `1,10,50`.
    * `--read-callers` - comma-separated caller counts for `reads` and
      `held`. Defaults to `10,50`.
    * `--pool-size` - the pool's size (and so the most calls that run at
      once) for this run, instead of the configured one. Defaults to the
      configuration's (dirty-I/O schedulers − 2 unless set).
    * `--peer` - `postgrex`: also run the statements through Postgrex (see
      above).
    * `--alternate` - the alternated mode (above), with this many runs a
      point; at least 5.
    * `--busy` - `K`: a busy VM, in `--alternate` mode (below).
    * `--floor` - also run the design's floor, in `--alternate` mode (below).
    * `--order` - shifts which side goes first in each run (they take
      turns), for runs alternated across invocations. Defaults to 0.
    * `--quick` - 1 second per run and 300 ms of warm-up, for a smoke run.
    * `--out` - the markdown file. Defaults to `bench/results.md`.
  """

  use Mix.Task

  alias PhoenixKitAgent.Turns.Locks.Bench
  alias PhoenixKitAgent.Turns.Locks.Bench.{Options, Peer}

  @task "locks.bench"

  @switches [
    duration: :integer,
    warmup: :integer,
    runs: :integer,
    workloads: :string,
    cycle_callers: :string,
    pool_size: :integer,
    peer: :string,
    alternate: :integer,
    read_callers: :string,
    busy: :integer,
    floor: :boolean,
    order: :integer,
    quick: :boolean,
    out: :string
  ]

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: @switches)
    quick = opts[:quick] || false
    workloads = Options.list(opts[:workloads], Bench.workloads())

    case workloads -- Bench.workloads() do
      [] ->
        :ok

      bad ->
        Mix.raise(
          "locks.bench: unknown workloads #{inspect(bad)}; known: #{Enum.join(Bench.workloads(), ",")}"
        )
    end

    pool_size = if opts[:pool_size], do: Options.pool_size(@task, opts[:pool_size])

    alternate = alternate(opts[:alternate])

    busy =
      case opts[:busy] do
        nil -> nil
        k when k < 1 -> Mix.raise("locks.bench: --busy takes at least 1 load process, got #{k}")
        _ when alternate == nil -> Mix.raise("locks.bench: --busy runs in --alternate mode only")
        k -> k
      end

    if opts[:floor] && alternate == nil,
      do: Mix.raise("locks.bench: --floor runs in --alternate mode only")

    peer =
      case {alternate, opts[:peer]} do
        # The alternated mode runs without Postgrex too, and says so.
        {n, peer} when is_integer(n) and peer in [nil, "postgrex"] ->
          if Peer.loaded?(), do: :postgrex

        {_, peer} ->
          case Peer.check(peer) do
            {:ok, peer} -> peer
            {:error, message} -> Mix.raise("locks.bench: --peer: " <> message)
          end
      end

    opts = [
      duration: Options.positive(@task, opts, :duration, if(quick, do: 1, else: 5)),
      warmup: Options.positive(@task, opts, :warmup, if(quick, do: 300, else: 1000)),
      runs: Options.positive(@task, opts, :runs, 1),
      workloads: workloads,
      cycle_callers:
        Options.callers(@task, opts[:cycle_callers], ~w(1 10 50), "--cycle-callers"),
      read_callers:
        Options.callers(@task, opts[:read_callers], ~w(10 50), "--read-callers"),
      busy: busy,
      floor: opts[:floor] || false,
      pool_size: pool_size,
      peer: peer,
      alternate: alternate,
      order: opts[:order] || 0,
      out: opts[:out] || "bench/results.md"
    ]

    Mix.Task.run("app.start")

    case Bench.run(opts) do
      {:ok, _report} -> :ok
      {:error, message} -> Mix.raise("locks.bench: " <> message)
    end
  end

  defp alternate(nil), do: nil
  defp alternate(n) when n >= 5, do: n

  defp alternate(n),
    do: Mix.raise("locks.bench: --alternate takes at least 5 runs a point, got #{n}")
end
