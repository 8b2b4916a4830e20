defmodule PhoenixKitAgent.Turns.Locks.Bench.Compare do
  @moduledoc """
  The body of `mix locks.compare` (options in `Mix.Tasks.Locks.Compare`):
  two commits of the library measured in turn, a few seconds apart, so that
  what the machine does meanwhile moves both alike.

  Each commit gets a git worktree under `_build/compare/` (kept for the next
  run), compiled there in `:dev`. Three VMs then run side by side for the
  whole comparison, each `bench/compare_arm.exs` of this checkout in a
  worktree: the base commit twice (two VMs of the same build: how far a
  point moves by chance alone) and the head once. A round runs every point
  (a workload at a number of callers) in each VM in turn, which one goes
  first rotating from round to round; a run is `warmup` ms of untimed ops,
  then `duration` s timed, while the other two VMs are idle. Nothing else
  runs between two runs: the rows are freed by the runs themselves, and
  nothing is vacuumed (the server's autovacuum keeps the tables as it
  would in production).

  Per point and round, the ratios head ÷ base, head ÷ base's second VM and
  base's second VM ÷ base of throughput and of the VM's CPU per op; the
  report gives each ratio's median, range and the 90 % interval of the
  median (a percentile bootstrap, seeded, so the same runs give the same
  report).

  `run/1` returns `{:ok, report}` (also printed and written to `:out`) or
  `{:error, message}`.
  """

  alias PhoenixKitAgent.Turns.Locks.{Bench, Config, Native, Schema}
  alias PhoenixKitAgent.Turns.Locks.Bench.Psql

  @root Path.expand("..", __DIR__)
  @arm Path.join(__DIR__, "compare_arm.exs")
  @arms [:base, :base2, :head]
  @resamples 2000

  @doc """
  Runs the comparison. `opts`: `:base` and `:head` (git revisions),
  `:rounds`, `:points` (`[{"cycle" | "reads", callers}]`), `:duration` (s),
  `:warmup` (ms), `:pool_size`, `:out`.
  """
  @spec run(keyword()) :: {:ok, String.t()} | {:error, String.t()}
  def run(opts) do
    with {:ok, config} <- config(opts[:pool_size]),
         {:ok, base} <- commit(opts[:base]),
         {:ok, head} <- commit(opts[:head]),
         {:ok, base_dir} <- worktree(base),
         {:ok, head_dir} <- worktree(head),
         {:ok, callers} <- rows(config, opts[:points]) do
      dirs = %{base: base_dir, base2: base_dir, head: head_dir}
      before = Bench.loadavg()
      settings = settings(config)
      arms = Map.new(@arms, &{&1, start_arm(dirs[&1], config)})

      try do
        runs = rounds(arms, callers, opts)
        meta = %{base: base, head: head, settings: settings, before: before, pool_size: config.pool_size}
        report = report(runs, opts, meta)
        IO.puts(report)
        File.write!(opts[:out], report)
        {:ok, report}
      after
        Enum.each(arms, fn {_, port} -> close(port) end)
      end
    end
  catch
    {:compare_failed, message} -> {:error, message}
  end

  # The arms are checkouts of their own, with no host configuration: they
  # read DATABASE_URL, and so does this VM.
  defp config(pool_size) do
    case {System.get_env("DATABASE_URL"), Config.read()} do
      {url, {:ok, config}} when is_binary(url) ->
        {:ok, %{config | prefix: Bench.schema(), pool_size: pool_size || config.pool_size}}

      _ ->
        {:error, "set DATABASE_URL: every arm connects with it"}
    end
  end

  ## The two builds

  defp commit(rev) do
    case git(["rev-parse", "--verify", "--quiet", rev <> "^{commit}"]) do
      {:ok, sha} -> {:ok, sha}
      {:error, _} -> {:error, "#{inspect(rev)} names no commit of #{@root}"}
    end
  end

  # A worktree of `sha` under _build/compare, made once and compiled (its
  # NIF with cargo, as this repository's :dev builds are).
  defp worktree(sha) do
    dir = Path.join([@root, "_build", "compare", String.slice(sha, 0, 12)])

    with {:ok, _} <- if(File.dir?(dir), do: {:ok, dir}, else: git(["worktree", "add", "--detach", dir, sha])) do
      info("compiling #{String.slice(sha, 0, 12)} in #{Path.relative_to_cwd(dir)}")

      case System.cmd(mix(), ["compile"], cd: dir, env: [{"MIX_ENV", "dev"}], stderr_to_stdout: true) do
        {_, 0} -> {:ok, dir}
        {out, status} -> {:error, "mix compile in #{dir} exited with #{status}:\n#{out}"}
      end
    end
  end

  defp git(args) do
    case System.cmd("git", ["-C", @root | args], stderr_to_stdout: true) do
      {out, 0} -> {:ok, String.trim(out)}
      {out, status} -> {:error, "git #{Enum.join(args, " ")} exited with #{status}: #{out}"}
    end
  end

  defp mix, do: System.find_executable("mix") || throw({:compare_failed, "mix is not on the PATH"})

  ## The rows: caller k of every point uses chat and user k

  defp rows(config, points) do
    callers = points |> Enum.map(&elem(&1, 1)) |> Enum.max()
    pairs = for k <- 0..(callers - 1), do: {Bench.uuid("bench/compare/chat/#{k}"), Bench.uuid("bench/compare/user/#{k}")}
    :ok = Native.start(config)
    :ok = Schema.setup!(:tables)
    values = fn pick -> Enum.map_join(pairs, ",", &"('#{pick.(&1)}')") end
    schema = ~s("#{Bench.schema()}")

    psql!(config, [
      "INSERT INTO #{schema}.phoenix_kit_agent_conversations (uuid) VALUES #{values.(&elem(&1, 0))} ON CONFLICT DO NOTHING",
      "INSERT INTO #{schema}.phoenix_kit_agent_user_settings (user_uuid) VALUES #{values.(&elem(&1, 1))} ON CONFLICT DO NOTHING",
      "UPDATE #{schema}.phoenix_kit_agent_conversations SET busy_since = NULL, busy_turn_ref = NULL WHERE busy_turn_ref IS NOT NULL",
      "UPDATE #{schema}.phoenix_kit_agent_user_settings SET busy_since = NULL, busy_turn_ref = NULL WHERE busy_turn_ref IS NOT NULL"
    ])

    # This VM's pool is not needed again: the arms have their own.
    :ok = Native.stop()
    {:ok, Enum.map(pairs, fn {chat, user} -> chat <> "," <> user end)}
  end

  defp settings(config) do
    names = ~w(fsync synchronous_commit full_page_writes)
    values = psql!(config, Enum.map(names, &"SHOW #{&1}"))
    Enum.zip_with(names, values, fn name, [value] -> "#{name} #{value}" end) |> Enum.join(", ")
  end

  defp psql!(config, commands) do
    case Psql.query(config, commands) do
      {:ok, rows} -> rows
      {:error, why} -> throw({:compare_failed, why})
    end
  end

  ## The arms

  defp start_arm(dir, config) do
    port =
      Port.open({:spawn_executable, mix()}, [
        :binary,
        :exit_status,
        :stderr_to_stdout,
        {:line, 1_000_000},
        {:cd, dir},
        {:args, ["run", "--no-compile", "--no-deps-check", "--no-start", @arm]},
        {:env,
         [
           {~c"MIX_ENV", ~c"dev"},
           {~c"LOCKS_COMPARE_PREFIX", String.to_charlist(config.prefix)},
           {~c"LOCKS_COMPARE_POOL_SIZE", ~c"#{config.pool_size}"}
         ]}
      ])

    "ready" = answer(port, 300_000)
    port
  end

  # The arm's next `compare: ` line; its other output is passed on.
  defp answer(port, timeout) do
    receive do
      {^port, {:data, {:eol, "compare: error " <> why}}} -> throw({:compare_failed, "an arm failed: " <> why})
      {^port, {:data, {:eol, "compare: " <> line}}} -> line
      {^port, {:data, {_, line}}} -> passed_on(line) && answer(port, timeout)
      {^port, {:exit_status, status}} -> throw({:compare_failed, "an arm's VM exited with #{status}"})
    after
      timeout -> throw({:compare_failed, "an arm did not answer in #{timeout} ms"})
    end
  end

  defp passed_on(line), do: IO.puts(:stderr, "  arm: " <> line) == :ok

  defp close(port) do
    if Port.info(port), do: Port.close(port)
  catch
    :error, :badarg -> :ok
  end

  ## The rounds

  # [%{round, point, arm, ops_s, cpu, dirty_io, schedulers}]; CPU in µs per op.
  defp rounds(arms, callers, opts) do
    hz = Bench.CPU.hz()

    for round <- 1..opts[:rounds], {workload, n} = point <- opts[:points], arm <- turn(round) do
      pairs = callers |> Enum.take(n) |> Enum.join(" ")
      Port.command(arms[arm], "run #{workload} #{opts[:warmup]} #{opts[:duration] * 1000} #{pairs}\n")
      line = answer(arms[arm], opts[:warmup] + opts[:duration] * 1000 + 60_000)

      figures =
        for field <- String.split(line), into: %{} do
          [key, value] = String.split(field, "=")
          {String.to_atom(key), String.to_integer(value)}
        end

      per_op = fn ticks -> ticks * 1.0e6 / hz / max(figures.ops, 1) end
      if arm == List.last(turn(round)), do: info("round #{round}/#{opts[:rounds]}: #{workload} x#{n}")

      %{
        round: round,
        point: point,
        arm: arm,
        ops_s: figures.ops * 1.0e6 / figures.us,
        cpu: per_op.(figures.cpu),
        dirty_io: per_op.(figures.dirty_io),
        schedulers: per_op.(figures.schedulers)
      }
    end
  end

  defp turn(round) do
    shift = rem(round - 1, length(@arms))
    Enum.drop(@arms, shift) ++ Enum.take(@arms, shift)
  end

  ## The report

  defp report(runs, opts, meta) do
    by_point = Enum.group_by(runs, & &1.point)

    rows =
      for {workload, n} = point <- opts[:points] do
        runs = by_point[point]
        arm = fn a, key -> for r <- runs, r.arm == a, do: r[key] end

        ratio = fn a, b, key ->
          Map.new(runs, &{{&1.round, &1.arm}, &1[key]})
          |> then(fn m -> for r <- 1..opts[:rounds], do: m[{r, a}] / m[{r, b}] end)
          |> interval()
        end

        "| #{workload} | #{n} | #{Bench.spread(arm.(:base, :ops_s), 0)} | #{Bench.spread(arm.(:head, :ops_s), 0)} | " <>
          "#{Bench.spread(arm.(:base, :cpu), 1)} | #{Bench.spread(arm.(:head, :cpu), 1)} | " <>
          "#{ratio.(:head, :base, :ops_s)} | #{ratio.(:head, :base, :cpu)} | #{ratio.(:head, :base2, :cpu)} | " <>
          "#{ratio.(:base2, :base, :cpu)} | #{ratio.(:head, :base, :dirty_io)} | #{ratio.(:head, :base, :schedulers)} |"
      end

    """
    # mix locks.compare

    * base: `#{meta.base}`; head: `#{meta.head}`
    * #{opts[:rounds]} rounds, #{opts[:duration]} s a run after #{opts[:warmup]} ms of warm-up, pool size #{meta.pool_size}
    * server: #{meta.settings}
    * machine: #{System.schedulers_online()} schedulers online, #{:erlang.system_info(:logical_processors)} logical processors, #{:erlang.system_info(:dirty_io_schedulers)} dirty-I/O schedulers; the arms' ERL_FLAGS: `#{System.get_env("ERL_FLAGS", "")}`
    * 1-minute load average before: #{meta.before}; after: #{Bench.loadavg()}

    Each VM's figures: median (min–max) over the rounds. Ratios per round,
    then their median (min–max) [the median's 90 % bootstrap interval]; base′
    is the base's second VM, so base′ ÷ base is chance alone. CPU is the VM's,
    µs per op (an op is two calls), all threads; dirty-I/O and normal
    schedulers' threads apart in the last two columns.

    | workload | callers | base ops/s | head ops/s | base CPU | head CPU | throughput head ÷ base | CPU head ÷ base | CPU head ÷ base′ | CPU base′ ÷ base | dirty-I/O CPU head ÷ base | schedulers' CPU head ÷ base |
    |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|
    #{Enum.join(rows, "\n")}
    """
  end

  # "median (min–max) [lo–hi]", [lo–hi] the 90 % percentile-bootstrap
  # interval of the median.
  defp interval(ratios) do
    :rand.seed(:exsss, {26, 6, 2026})
    n = length(ratios)
    tuple = List.to_tuple(ratios)

    medians =
      for _ <- 1..@resamples do
        Bench.med(for _ <- 1..n, do: elem(tuple, :rand.uniform(n) - 1))
      end
      |> Enum.sort()
      |> List.to_tuple()

    lo = elem(medians, round(0.05 * (@resamples - 1)))
    hi = elem(medians, round(0.95 * (@resamples - 1)))
    "#{Bench.spread(ratios)} [#{Bench.fmt(lo, 2)}–#{Bench.fmt(hi, 2)}]"
  end

  defp info(text), do: IO.puts(:stderr, "locks.compare: " <> text)
end
