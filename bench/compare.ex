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
         {:ok, head_dir} <- worktree(head) do
      callers = prepare(config, opts[:points] |> Enum.map(&elem(&1, 1)) |> Enum.max())
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

  @doc false
  # The arms are checkouts of their own, with no host configuration: they
  # read DATABASE_URL, and so does this VM.
  def config(pool_size) do
    case {System.get_env("DATABASE_URL"), Config.read()} do
      {url, {:ok, config}} when is_binary(url) ->
        # A size above the default is cut to it, as the arms' configuration would.
        size = min(pool_size || config.pool_size, Config.default_pool_size())
        {:ok, %{config | prefix: Bench.schema(), pool_size: size}}

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

  @doc false
  # The rows of `callers` callers, made if missing and freed: each caller's
  # "chat,user" as an arm takes them. This VM's pool is the configured one
  # again after it.
  def prepare(config, callers) do
    pairs = for k <- 0..(callers - 1), do: {Bench.uuid("bench/compare/chat/#{k}"), Bench.uuid("bench/compare/user/#{k}")}
    :ok = Native.start(config)
    :ok = Schema.setup!(:tables)
    {chats, users} = Enum.unzip(pairs)
    psql!(config, Bench.rows_statements(chats, users) ++ Bench.free_statements())

    with {:ok, configured} <- Config.read(), do: Native.start(configured)
    Enum.map(pairs, fn {chat, user} -> chat <> "," <> user end)
  end

  defp settings(config) do
    names = Bench.durability_settings()
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

  @doc false
  # A VM of the checkout in `dir`, compiled in `env`, ready for measure/4.
  def start_arm(dir, config, env \\ "dev") do
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
           {~c"MIX_ENV", String.to_charlist(env)},
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

  @doc false
  def close(port) do
    if Port.info(port), do: Port.close(port)
  catch
    :error, :badarg -> :ok
  end

  @doc false
  # One run of `{workload, n}` in the arm `port` by the first n of
  # `callers`: `%{ops_s, cpu, dirty_io, schedulers}`, CPU in µs per op, and
  # `ticks`, the arm's CPU as it counted it (clock ticks, exact).
  def measure(port, {workload, n}, callers, opts) do
    pairs = callers |> Enum.take(n) |> Enum.join(" ")
    Port.command(port, "run #{workload} #{opts[:warmup]} #{opts[:duration] * 1000} #{pairs}\n")
    line = answer(port, opts[:warmup] + opts[:duration] * 1000 + 60_000)

    figures =
      for field <- String.split(line), into: %{} do
        [key, value] = String.split(field, "=")
        {String.to_existing_atom(key), String.to_integer(value)}
      end

    per_op = fn ticks -> ticks * 1.0e6 / Bench.CPU.hz() / max(figures.ops, 1) end

    %{
      ops_s: figures.ops * 1.0e6 / figures.us,
      cpu: per_op.(figures.cpu),
      dirty_io: per_op.(figures.dirty_io),
      schedulers: per_op.(figures.schedulers),
      ticks: Map.take(figures, [:cpu, :dirty_io, :schedulers])
    }
  end

  ## The rounds

  # [%{round, point, arm, ops_s, cpu, dirty_io, schedulers}].
  defp rounds(arms, callers, opts) do
    for round <- 1..opts[:rounds], {workload, n} = point <- opts[:points], reduce: [] do
      done ->
        runs = for arm <- turn(round), do: Map.merge(measure(arms[arm], point, callers, opts), %{round: round, point: point, arm: arm})
        info("round #{round}/#{opts[:rounds]}: #{workload} x#{n}")
        done ++ runs
    end
  end

  defp turn(round) do
    shift = rem(round - 1, length(@arms))
    Enum.drop(@arms, shift) ++ Enum.take(@arms, shift)
  end

  ## The report

  @figures [ops_s: "throughput", cpu: "CPU", dirty_io: "dirty-I/O CPU", schedulers: "schedulers' CPU"]

  defp report(runs, opts, meta) do
    by_point = Enum.group_by(runs, & &1.point)
    of = fn point, arm, key -> for r <- by_point[point], r.arm == arm, do: r[key] end

    arms =
      for {workload, n} = point <- opts[:points] do
        ops = Enum.map_join(@arms, " | ", &Bench.spread(of.(point, &1, :ops_s), 0))
        cpu = Enum.map_join(@arms, " | ", &Bench.spread(of.(point, &1, :cpu), 1))
        "| #{workload} | #{n} | #{ops} | #{cpu} |"
      end

    ratios =
      for {workload, n} = point <- opts[:points], {key, name} <- @figures do
        cells = for {a, b} <- [head: :base, head: :base2, base2: :base], do: by_point[point] |> ratios(a, b, key) |> interval()
        "| #{workload} | #{n} | #{name} | #{Enum.join(cells, " | ")} |"
      end

    each =
      for r <- Enum.sort_by(runs, &{&1.round, elem(&1.point, 0), elem(&1.point, 1)}) do
        {workload, n} = r.point
        figures = Enum.map_join([:cpu, :dirty_io, :schedulers], " | ", &Bench.fmt(r[&1], 1))
        "| #{r.round} | #{workload} | #{n} | #{label(r.arm)} | #{Bench.fmt(r.ops_s)} | #{figures} |"
      end

    """
    # mix locks.compare

    * base: `#{meta.base}`; head: `#{meta.head}`
    * #{opts[:rounds]} rounds, #{opts[:duration]} s a run after #{opts[:warmup]} ms of warm-up, pool size #{meta.pool_size}
    * server: #{meta.settings}
    * machine: #{System.schedulers_online()} schedulers online, #{:erlang.system_info(:logical_processors)} logical processors, #{:erlang.system_info(:dirty_io_schedulers)} dirty-I/O schedulers; the arms' ERL_FLAGS: `#{System.get_env("ERL_FLAGS", "")}`
    * 1-minute load average before: #{meta.before}; after: #{Bench.loadavg()}

    base′ is the base's second VM: base′ ÷ base is what chance alone gives.
    An op is two calls; CPU is the VM's, µs per op, every thread (dirty-I/O
    and normal schedulers' threads apart too).

    ## Each VM: median (min–max) over the rounds

    | workload | callers | base ops/s | base′ ops/s | head ops/s | base CPU | base′ CPU | head CPU |
    |---|--:|--:|--:|--:|--:|--:|--:|
    #{Enum.join(arms, "\n")}

    ## Ratios, round by round: median (min–max) [the median's 90 % bootstrap interval]

    | workload | callers | figure | head ÷ base | head ÷ base′ | base′ ÷ base |
    |---|--:|---|--:|--:|--:|
    #{Enum.join(ratios, "\n")}

    ## Every run

    | round | workload | callers | VM | ops/s | CPU | dirty-I/O CPU | schedulers' CPU |
    |--:|---|--:|---|--:|--:|--:|--:|
    #{Enum.join(each, "\n")}
    """
  end

  defp label(:base2), do: "base′"
  defp label(arm), do: Atom.to_string(arm)

  @doc false
  # Arm a's figure ÷ arm b's, round by round, of one point's runs.
  def ratios(runs, a, b, key) do
    by = Map.new(runs, &{{&1.round, &1.arm}, &1[key]})
    for {round, ^a} <- Map.keys(by) |> Enum.sort(), do: by[{round, a}] / by[{round, b}]
  end

  @doc false
  # "median (min–max) [lo–hi]", [lo–hi] the 90 % percentile-bootstrap
  # interval of the median.
  def interval(ratios) do
    n = length(ratios)
    tuple = List.to_tuple(ratios)
    # A seeded state of its own: the caller's random numbers stay its own.
    pick = fn _, state -> :rand.uniform_s(n, state) |> then(fn {i, s} -> {elem(tuple, i - 1), s} end) end

    {medians, _} =
      Enum.map_reduce(1..@resamples, :rand.seed_s(:exsss, {26, 6, 2026}), fn _, state ->
        {sample, state} = Enum.map_reduce(1..n, state, pick)
        {Bench.med(sample), state}
      end)

    medians = medians |> Enum.sort() |> List.to_tuple()

    lo = elem(medians, round(0.05 * (@resamples - 1)))
    hi = elem(medians, round(0.95 * (@resamples - 1)))
    "#{Bench.spread(ratios)} [#{Bench.fmt(lo, 2)}–#{Bench.fmt(hi, 2)}]"
  end

  defp info(text), do: IO.puts(:stderr, "locks.compare: " <> text)
end
