defmodule Mix.Tasks.Locks.Bench do
  @shortdoc "Times the lock calls against pgbench (and Postgrex) on the same statements"
  @moduledoc """
  Times the library's public calls from N Elixir processes against
  `pgbench -M prepared` running the very same statements (read off the
  wire as the library's pool sends them) and, with `--peer postgrex`,
  against Postgrex (prepared once, `Postgrex.execute/4` from the same N
  processes, a pool of the same size), in alternated rounds: each round
  runs every point (a workload at N callers) through the library, then
  Postgrex, then pgbench. It reports each side's throughput and the VM's
  CPU per statement as the median (min–max) over the rounds, and the
  ratios round by round, with the server's durability, the machine and
  the command line. See README.md.

      mix locks.bench
      mix locks.bench --rounds 10 --workloads cycle --callers 10,50
      LOCKS_BENCH_PEERS=… mix locks.bench --peer postgrex

  It connects with `DATABASE_URL` (or the library's configuration), in a
  schema of its own (`phoenix_kit_agent_locks_bench`, made if missing),
  and needs `psql` and `pgbench` on the PATH and Linux's /proc.

  ## Options

    * `--rounds` - alternated rounds. Defaults to 5.
    * `--workloads` - comma-separated: `cycle` (`acquire/4` then
      `release/3`), `reads` (`held?/3` then `fresh?/3` on locks the caller
      holds), `held` (`held?/3` alone). Defaults to `cycle,reads`.
    * `--callers` - comma-separated caller counts, 1 to 50. Defaults to `1,10,50`.
    * `--duration` - timed seconds a run. Defaults to 3.
    * `--warmup` - untimed milliseconds before each library and Postgrex run. Defaults to 1000.
    * `--pool-size` - the pool size of the library and of Postgrex. Defaults to the configured one.
    * `--peer` - `postgrex`: also run Postgrex; it must be in the build
      (`LOCKS_BENCH_PEERS`, README.md).
    * `--out` - the markdown report, also printed. Defaults to `results.md`.
  """

  use Mix.Task

  alias LocksBench.{Peer, Workload}
  alias PhoenixKitAgent.Turns.Locks.{Config, Error}

  @switches [
    rounds: :integer,
    workloads: :string,
    callers: :string,
    duration: :integer,
    warmup: :integer,
    pool_size: :integer,
    peer: :string,
    out: :string
  ]

  @impl true
  def run(args) do
    {opts, rest} = OptionParser.parse!(args, strict: @switches)
    if rest != [], do: fail("unexpected arguments #{Enum.join(rest, " ")}")
    opts = options(opts) ++ [command: Enum.join(["mix locks.bench" | args], " ")]
    Mix.Task.run("app.start")
    LocksBench.run(opts)
    :ok
  end

  @doc false
  # The options checked, with their defaults; raises a Mix error.
  def options(opts) do
    workloads = list(opts[:workloads] || "cycle,reads")

    if (bad = workloads -- Workload.names()) != [],
      do:
        fail(
          "unknown workloads #{Enum.join(bad, ",")}; known: #{Enum.join(Workload.names(), ",")}"
        )

    callers =
      for word <- list(opts[:callers] || "1,10,50") do
        case Integer.parse(word) do
          {n, ""} when n in 1..50 -> n
          _ -> fail("--callers takes numbers from 1 to 50, got #{word}")
        end
      end

    [
      rounds: positive(opts, :rounds, 5),
      workloads: workloads,
      callers: callers,
      duration: positive(opts, :duration, 3),
      warmup: Keyword.get(opts, :warmup, 1000) |> max(0),
      pool_size: opts[:pool_size] && pool_size(opts[:pool_size]),
      peer: peer(opts[:peer]),
      out: opts[:out] || "results.md"
    ]
  end

  defp peer(nil), do: false

  defp peer("postgrex") do
    Peer.loaded?() ||
      fail(
        "--peer postgrex: Postgrex is not in this build: set LOCKS_BENCH_PEERS to a " <>
          "folder that holds postgrex/ and its dependencies by path (bench/README.md)"
      )
  end

  defp peer(other), do: fail("--peer: unknown peer #{other}; known: postgrex")

  defp list(text), do: text |> String.split(",", trim: true) |> Enum.map(&String.trim/1)

  defp positive(opts, key, default) do
    case Keyword.get(opts, key, default) do
      n when n > 0 -> n
      _ -> fail("--#{key} must be a positive integer")
    end
  end

  defp pool_size(n) do
    Config.check!(:pool_size, n, "--pool-size")
  rescue
    e in Error -> fail(Exception.message(e))
  end

  defp fail(message), do: Mix.raise("locks.bench: " <> message)
end
