defmodule Mix.Tasks.Locks.Compare do
  @shortdoc "Measures two commits of the library in turn, a few seconds apart"
  @moduledoc """
  Is a change slower? Measures the lock calls of two commits of this
  repository in turn, against `DATABASE_URL`:

      mix locks.compare d228b89
      mix locks.compare d228b89 --head main --rounds 20 --workloads cycle --cycle-callers 10

  Each commit is checked out in a git worktree under `_build/compare/`
  (kept, so the next comparison does not build it again) and compiled
  there in `:dev`, its NIF with cargo. Then three VMs run side by side: the
  base twice, the head once, each running this checkout's
  `bench/compare_arm.exs`, which uses the public lock calls only (so it
  measures any commit). A round runs each point in each VM in turn, which
  goes first rotating; the runs of a round's point are a few seconds
  apart, so a machine whose load drifts moves them alike. The second VM of
  the base is the control: base′ ÷ base is what chance alone gives.

  What `mix locks.bench` measures against pgbench and Postgrex, this
  measures against another commit: throughput and the VM's CPU per op (an
  op is two calls: `cycle` `acquire/4` then `release/3`, `reads` `held?/3`
  then `fresh?/3`), each caller on its own chat and user, in the bench's
  schema. The report gives each VM's medians and, per round, the ratios
  head ÷ base, head ÷ base′ and base′ ÷ base: their median, range and the
  90 % bootstrap interval of the median. It is printed and written to
  `--out`.

  The arms' VMs take `ERL_FLAGS` from the environment: with
  `ERL_FLAGS="+sbwt none +sbwtdcpu none +sbwtdio none"` the schedulers do
  not spin while they wait, so a VM's CPU is its work (`bench/README.md`
  says why that matters at one caller).

  ## Options

    * `--head` - the commit measured against the base. Defaults to `HEAD`.
    * `--rounds` - rounds. Defaults to 10.
    * `--workloads` - `cycle`, `reads` or both. Defaults to both.
    * `--cycle-callers` - callers of `cycle`. Defaults to `1,10,50`.
    * `--read-callers` - callers of `reads`. Defaults to `10,50`.
    * `--duration` - seconds timed a run. Defaults to 3.
    * `--warmup` - milliseconds of untimed ops before each. Defaults to 1000.
    * `--pool-size` - every arm's pool size, at most the default (dirty-I/O
      schedulers − 2). Defaults to the configuration's.
    * `--out` - the markdown file. Defaults to `bench/compare.md`.
  """

  use Mix.Task

  alias PhoenixKitAgent.Turns.Locks.Bench.{Compare, Options}

  @task "locks.compare"

  @switches [
    head: :string,
    rounds: :integer,
    workloads: :string,
    cycle_callers: :string,
    read_callers: :string,
    duration: :integer,
    warmup: :integer,
    pool_size: :integer,
    out: :string
  ]

  @impl true
  def run(args) do
    {parsed, base} =
      case OptionParser.parse!(args, strict: @switches) do
        {parsed, [base]} -> {parsed, base}
        _ -> Mix.raise("locks.compare: name one base commit, as in `mix locks.compare d228b89`")
      end

    opts = [
      base: base,
      head: parsed[:head] || "HEAD",
      rounds: Options.positive(@task, parsed, :rounds, 10),
      points: points(parsed),
      duration: Options.positive(@task, parsed, :duration, 3),
      warmup: Options.positive(@task, parsed, :warmup, 1000),
      pool_size: parsed[:pool_size] && Options.pool_size(@task, parsed[:pool_size]),
      out: parsed[:out] || "bench/compare.md"
    ]

    Mix.Task.run("app.start")

    case Compare.run(opts) do
      {:ok, _report} -> :ok
      {:error, message} -> Mix.raise("locks.compare: " <> message)
    end
  end

  defp points(opts) do
    workloads = Options.list(opts[:workloads], ~w(cycle reads))

    case workloads -- ~w(cycle reads) do
      [] -> :ok
      bad -> Mix.raise("locks.compare: unknown workloads #{inspect(bad)}; known: cycle,reads")
    end

    for workload <- workloads,
        n <- callers(opts, workload),
        do: {workload, n}
  end

  defp callers(opts, "cycle"),
    do: Options.callers(@task, opts[:cycle_callers], ~w(1 10 50), "--cycle-callers")

  defp callers(opts, "reads"),
    do: Options.callers(@task, opts[:read_callers], ~w(10 50), "--read-callers")
end
