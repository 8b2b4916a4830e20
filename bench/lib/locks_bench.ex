defmodule LocksBench do
  @moduledoc """
  The body of `mix locks.bench` (options and method: `Mix.Tasks.Locks.Bench`
  and README.md): the library's public calls timed from N Elixir
  processes, in alternated rounds with pgbench running the very same
  statements (and Postgrex, with `peer: true`), on rows of a schema of its
  own, `phoenix_kit_agent_locks_bench`.

  `run/1` returns the markdown report it also prints and writes to `:out`.
  """

  alias LocksBench.{Peer, Psql, Stats, Wire, Workload}
  alias PhoenixKitAgent.Turns.Locks.{Config, Native, Schema}

  @schema "phoenix_kit_agent_locks_bench"
  @tables ~w(phoenix_kit_agent_conversations phoenix_kit_agent_user_settings)
  # The library's checkout, for the report's commit.
  @root Path.expand("../..", __DIR__)

  def schema, do: @schema

  @doc """
  Runs the benchmark. `opts`: `:rounds`, `:workloads`, `:callers`,
  `:duration` (s), `:warmup` (ms), `:pool_size` (nil: the configured one),
  `:peer` (boolean), `:out`, `:command` (the command line, for the report).
  """
  def run(opts) do
    config =
      case Config.read() do
        {:ok, config} -> config
        :unconfigured -> raise "no database: set DATABASE_URL (or configure the library)"
      end

    # Postgrex's :telemetry, when in the build: the library reports through it once loaded.
    if Code.ensure_loaded?(:telemetry), do: {:ok, _} = Application.ensure_all_started(:telemetry)
    ctx = setup(config, opts)

    try do
      results =
        for round <- 1..opts[:rounds],
            w <- opts[:workloads],
            n <- opts[:callers],
            side <- ctx.sides,
            into: %{} do
          info("round #{round}/#{opts[:rounds]}: #{w} ×#{n}: #{side_name(side)}")
          {{round, w, n, side}, run_side(ctx, side, w, n)}
        end

      report = report(ctx, results, busy(ctx.ticks_before, cpu_ticks()))
      IO.puts(report)
      File.write!(opts[:out], report)
      info("written to #{opts[:out]}")
      report
    after
      if ctx.peer, do: Peer.stop(ctx.peer)
      # The configured pool back, as the application started it.
      Native.start(config)
    end
  end

  defp setup(config, opts) do
    options = %{config | prefix: @schema, pool_size: opts[:pool_size] || config.pool_size}
    # The machine's CPU in the second before the run, then over the run.
    second_ago = cpu_ticks()
    Process.sleep(1_000)
    ticks_before = cpu_ticks()
    :ok = Native.start(options)
    :ok = Schema.setup!(:tables)

    ctx = %{
      opts: Map.new(opts),
      options: options,
      pgbench: Psql.executable!("pgbench"),
      busy_before: busy(second_ago, ticks_before),
      ticks_before: ticks_before
    }

    {chats, users} =
      for w <- Workload.names(), k <- 0..49, reduce: {[], []} do
        {cs, us} ->
          {["('#{Workload.row(w, k)["chat"]}')" | cs], ["('#{Workload.row(w, k)["usr"]}')" | us]}
      end

    [chat_table, user_table] = Enum.map(@tables, &~s("#{@schema}".#{&1}))

    psql!(ctx, [
      "INSERT INTO #{chat_table} (uuid) VALUES #{Enum.join(chats, ",")} ON CONFLICT DO NOTHING",
      "INSERT INTO #{user_table} (user_uuid) VALUES #{Enum.join(users, ",")} ON CONFLICT DO NOTHING"
    ])

    settings = ~w(server_version fsync synchronous_commit full_page_writes)
    values = psql!(ctx, Enum.map(settings, &"SHOW #{&1}")) |> Enum.map(&hd/1)
    texts = statement_texts(ctx)
    peer = if opts[:peer], do: Peer.start(options, options.pool_size, texts)
    sides = [:library] ++ if(peer, do: [:postgrex], else: []) ++ [:pgbench]

    Map.merge(ctx, %{
      settings: Map.new(Enum.zip(settings, values)),
      texts: texts,
      peer: peer,
      sides: sides,
      started: DateTime.utc_now() |> DateTime.truncate(:second)
    })
  end

  # Frees every lock of the bench's schema and vacuums: each run starts from the same state.
  defp reset!(ctx) do
    psql!(
      ctx,
      Enum.flat_map(@tables, fn t ->
        table = ~s("#{@schema}".#{t})

        [
          "UPDATE #{table} SET busy_since = NULL, busy_turn_ref = NULL WHERE busy_turn_ref IS NOT NULL",
          "VACUUM ANALYZE #{table}"
        ]
      end)
    )
  end

  defp psql!(ctx, commands), do: Psql.query!(ctx.options, commands)

  # Each statement as the pool sends it: each call once on a pool of one
  # connection through the Wire proxy, the lock statement among its Parse
  # messages (with prepare: :named a connection parses a statement the
  # first time it runs it; its first call also reads the tables' columns,
  # a query that names no lock table).
  defp statement_texts(ctx) do
    reset!(ctx)
    {wire, pool} = Wire.start(ctx.options)

    try do
      :ok = Native.start(pool)

      Map.new(Workload.statements(), fn name ->
        Workload.call(name, Workload.row("cycle", 0))

        case Enum.filter(Wire.texts(wire), &(&1 =~ "phoenix_kit_agent_")) do
          [text] -> {name, text}
          other -> raise "#{name} sent #{length(other)} lock statements, one expected"
        end
      end)
    after
      :ok = Native.start(ctx.options)
      Wire.stop(wire)
    end
  end

  defp run_side(ctx, side, w, n) do
    reset!(ctx)
    if Workload.holds?(w), do: Workload.hold!(w, n)

    case side do
      :library -> timed(ctx, n, &Workload.library_op(w, &1))
      :postgrex -> timed(ctx, n, &Workload.peer_op(ctx.peer, w, &1))
      :pgbench -> pgbench(ctx, Workload.script(w, ctx.texts), n)
    end
  end

  # `n` processes run their op in a loop: untimed for the warm-up (the
  # pools connect, each connection prepares), then, all from the same
  # instant, for the duration. The VM's CPU is read as the timed part
  # starts and once every caller is done.
  defp timed(ctx, n, make_op) do
    parent = self()

    pids =
      for k <- 0..(n - 1) do
        spawn_link(fn ->
          op = make_op.(k)
          send(parent, {:ready, self()})

          receive do
            {:go, measure_at, end_at} ->
              loop(op, measure_at, {0, 0})
              send(parent, {:done, self(), loop(op, end_at, {0, 0}), :erlang.monotonic_time()})
          end
        end)
      end

    for pid <- pids, do: receive(do: ({:ready, ^pid} -> :ok))
    measure_at = :erlang.monotonic_time() + ms(ctx.opts.warmup)
    end_at = measure_at + ms(ctx.opts.duration * 1000)
    for pid <- pids, do: send(pid, {:go, measure_at, end_at})

    Process.sleep(
      max(
        System.convert_time_unit(measure_at - :erlang.monotonic_time(), :native, :millisecond),
        0
      )
    )

    ticks = Stats.ticks()

    {ops, statements, last} =
      Enum.reduce(pids, {0, 0, measure_at}, fn pid, {o, s, t} ->
        receive(do: ({:done, ^pid, {ops, stmts}, at} -> {o + ops, s + stmts, max(t, at)}))
      end)

    ticks = with t when is_integer(t) <- Stats.ticks(), do: ticks && t - ticks
    seconds = System.convert_time_unit(last - measure_at, :native, :microsecond) / 1.0e6
    %{ops: ops / seconds, cpu: Stats.per_statement_us(ticks, statements, Stats.hz())}
  end

  # {ops, statements} run until `until`.
  defp loop(op, until, {ops, statements}) do
    if :erlang.monotonic_time() < until,
      do: loop(op, until, {ops + 1, statements + op.()}),
      else: {ops, statements}
  end

  defp ms(ms), do: System.convert_time_unit(ms, :millisecond, :native)

  defp pgbench(ctx, script, n) do
    file = Path.join(System.tmp_dir!(), "locks_bench_#{System.unique_integer([:positive])}.sql")
    File.write!(file, script)

    args =
      ~w(-M prepared -n -D inited=0 -D ttl=#{Workload.ttl()} -f #{file}) ++
        ~w(-c #{n} -j #{n} -T #{ctx.opts.duration})

    {out, status} =
      try do
        System.cmd(ctx.pgbench, args,
          stderr_to_stdout: true,
          env: Psql.env(ctx.options, "phoenix_kit_agent_locks bench pgbench")
        )
      after
        File.rm(file)
      end

    case Regex.run(~r/tps = ([\d.]+) \(without initial connection time\)/, out) do
      [_, tps] when status == 0 ->
        if(out =~ ~r/failed transactions: [1-9]/,
          do: raise("pgbench: failed transactions:\n" <> out)
        )

        %{ops: String.to_float(tps), cpu: nil}

      _ ->
        raise "pgbench failed (exit #{status}):\n#{out}\nscript:\n#{script}"
    end
  end

  defp report(ctx, results, busy_during) do
    %{opts: opts, settings: s} = ctx
    figures = fn w, n, side, key -> for r <- 1..opts.rounds, do: results[{r, w, n, side}][key] end

    rows =
      for w <- opts.workloads, n <- opts.callers, side <- ctx.sides do
        cpu =
          if side == :pgbench,
            do: "– (not the VM)",
            else: Stats.summary(figures.(w, n, side, :cpu), 0)

        "| #{w} | #{Workload.unit(w)} | #{n} | #{side_name(side)} | #{Stats.summary(figures.(w, n, side, :ops), 0)} | #{cpu} |"
      end

    pair = fn w, n, a, b, key ->
      Enum.zip_with(figures.(w, n, a, key), figures.(w, n, b, key), &Stats.ratio/2)
      |> Stats.summary(2)
    end

    ratios =
      for w <- opts.workloads, n <- opts.callers do
        peer =
          if ctx.peer,
            do:
              "#{pair.(w, n, :library, :postgrex, :ops)} | #{pair.(w, n, :library, :postgrex, :cpu)} | ",
            else: ""

        "| #{w} | #{n} | #{peer}#{pair.(w, n, :library, :pgbench, :ops)} |"
      end

    durable? = s["fsync"] == "on" and s["synchronous_commit"] != "off"

    peer_line =
      if ctx.peer,
        do: "#{Peer.versions()}, pool_size #{ctx.options.pool_size}, statements prepared once",
        else: "Postgrex not run (`--peer postgrex` with LOCKS_BENCH_PEERS: README.md)"

    """
    # phoenix_kit_agent_locks: mix locks.bench

        #{opts.command}

    * **when**: #{ctx.started}, library commit `#{commit()}`
    * **server**: PostgreSQL #{s["server_version"]}; fsync #{s["fsync"]}, synchronous_commit #{s["synchronous_commit"]}, full_page_writes #{s["full_page_writes"]}: #{if durable?, do: "durable (each commit waits for its WAL on disk)", else: "not durable (commits do not wait for the disk)"}
    * **machine**: #{:erlang.system_info(:logical_processors)} logical processors, #{System.schedulers_online()} schedulers online, #{:erlang.system_info(:dirty_io_schedulers)} dirty-I/O schedulers; OTP #{:erlang.system_info(:otp_release)}, Elixir #{System.version()}; CPU busy #{ctx.busy_before} in the second before the run, #{busy_during} over it (all processors; waiting on the disk counts as idle)
    * **clients**: the library, pool_size #{ctx.options.pool_size}; #{peer_line}; pgbench -M prepared -c N -j N
    * **method**: #{opts.rounds} round(s); in each, every point (a workload at N callers) runs #{Enum.map_join(ctx.sides, ", then ", &side_name/1)}, each from the same state (locks freed, tables vacuumed), #{opts.warmup} ms untimed, then #{opts.duration} s timed. Median (min–max) over the rounds. CPU: the VM's (every BEAM thread's utime + stime, /proc/self/task/*/stat) over the timed part, per statement. Ratios: round by round, then median (min–max).

    | workload | op | callers | side | ops/s | VM CPU µs/statement |
    |---|---|--:|---|--:|--:|
    #{Enum.join(rows, "\n")}

    | workload | callers | #{if ctx.peer, do: "throughput library ÷ Postgrex | CPU library ÷ Postgrex | ", else: ""}throughput library ÷ pgbench |
    |---|--:|#{if ctx.peer, do: "--:|--:|", else: ""}--:|
    #{Enum.join(ratios, "\n")}
    """
  end

  defp side_name(:library), do: "library"
  defp side_name(:postgrex), do: "Postgrex"
  defp side_name(:pgbench), do: "pgbench"

  defp commit do
    case System.cmd("git", ~w(-C #{@root} describe --always --dirty --abbrev=10),
           stderr_to_stdout: true
         ) do
      {out, 0} -> String.trim(out)
      _ -> "unknown"
    end
  rescue
    _ -> "unknown"
  end

  # {busy, total} clock ticks of all processors since boot (/proc/stat's
  # first eight: user nice system idle iowait irq softirq steal). I/O wait
  # is idle: a durable server's fsyncs leave the CPUs free (the load average
  # counts them, and read 11 on an idle 2-core machine after a run).
  defp cpu_ticks do
    with {:ok, text} <- File.read("/proc/stat"),
         ["cpu" | fields] <- text |> String.split("\n", parts: 2) |> hd() |> String.split(),
         [_, _, _, idle, iowait, _, _, _] = ticks <-
           fields |> Enum.take(8) |> Enum.map(&String.to_integer/1) do
      total = Enum.sum(ticks)
      {total - idle - iowait, total}
    else
      _ -> nil
    end
  end

  defp busy({b0, t0}, {b1, t1}) when t1 > t0, do: "#{round(100 * (b1 - b0) / (t1 - t0))} %"
  defp busy(_, _), do: "?"

  defp info(text), do: IO.puts(:stderr, "locks.bench: " <> text)
end
