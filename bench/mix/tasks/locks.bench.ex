defmodule Mix.Tasks.Locks.Bench do
  @shortdoc "Benchmarks the lock calls against pgbench running the same SQL"
  @moduledoc """
  Measures the lock calls from Elixir and compares them with `pgbench`
  running the library's own statements, in one run, against the configured
  database (`:url` or `DATABASE_URL`).

      mix locks.bench
      mix locks.bench --duration 10 --runs 3 --out bench/results.md
      mix locks.bench --quick --workloads cycle,reads

  Workloads, each timed from Elixir processes and then through
  `pgbench -M prepared -c N -j N -T duration` at the same concurrency:

    * `cycle`: `acquire/4` then `release/3`, each caller on its own chat and
      user, at 1, 10 and 50 callers; also the same cycle as two
      `BEGIN … COMMIT` transactions through pgbench, the reference a caller
      would otherwise have;
    * `hot`: 50 callers race for one chat, the winner releases;
    * `reads`: `held?/3` and `fresh?/3`, 10 callers;
    * `click`: `acquire_user/4`, `keep_user/4`, `release_user/2`, 10 callers;
    * `statements`: how many statements and transactions one call of each
      function costs, read from `pg_stat_statements` (created if missing;
      falls back to `pg_stat_database.xact_commit`);
    * `overhead`: the steps of one `held?/3`, serially.

  For each: ops/s and the p50/p99/max latency a caller sees, the same for
  pgbench, their ratio and the p50 difference; during the library runs, a
  probe on a normal scheduler times message round trips (its p99). One
  markdown table is printed and written to `--out`.

  The bench works in a schema of its own, `phoenix_kit_agent_locks_bench`
  (created, with its rows, if missing), and never touches other rows. It
  needs `pgbench` and `psql` on the PATH, and for the statement count a role
  that may create a role (the private cluster's `locks` is a superuser).

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
    * `--quick` - 1 second per run and 300 ms of warm-up, for a smoke run.
    * `--out` - the markdown file. Defaults to `bench/results.md`.
  """

  use Mix.Task

  alias PhoenixKitAgent.Turns.Locks.Bench

  @switches [
    duration: :integer,
    warmup: :integer,
    runs: :integer,
    workloads: :string,
    cycle_callers: :string,
    quick: :boolean,
    out: :string
  ]

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: @switches)
    quick = opts[:quick] || false
    workloads = list(opts[:workloads], Bench.workloads())

    case workloads -- Bench.workloads() do
      [] ->
        :ok

      bad ->
        Mix.raise(
          "locks.bench: unknown workloads #{inspect(bad)}; known: #{Enum.join(Bench.workloads(), ",")}"
        )
    end

    opts = [
      duration: positive(opts, :duration, if(quick, do: 1, else: 5)),
      warmup: positive(opts, :warmup, if(quick, do: 300, else: 1000)),
      runs: positive(opts, :runs, 1),
      workloads: workloads,
      cycle_callers: opts[:cycle_callers] |> list(~w(1 10 50)) |> Enum.map(&String.to_integer/1),
      out: opts[:out] || "bench/results.md"
    ]

    Mix.Task.run("app.start")
    Bench.run(opts)
  end

  defp list(nil, default), do: default
  defp list(text, _default), do: text |> String.split(",", trim: true) |> Enum.map(&String.trim/1)

  defp positive(opts, key, default) do
    case Keyword.get(opts, key, default) do
      n when is_integer(n) and n > 0 ->
        n

      _ ->
        Mix.raise(
          "locks.bench: --#{String.replace(to_string(key), "_", "-")} must be a positive integer"
        )
    end
  end
end
