defmodule PhoenixKitAgent.Turns.Locks.Bench do
  @moduledoc false
  # The body of `mix locks.bench` (see lib/mix/tasks/locks.bench.ex for the
  # options). For each workload it times the public calls from Elixir
  # processes, then has `pgbench -M prepared` run the very statement texts the
  # pool runs (`Native.statements/0`) at the same concurrency for the same
  # time: the floor, a client that adds nothing but libpq. It also counts, on
  # the server, the statements and transactions one call costs, and probes how
  # late a normal scheduler answers a message while 50 callers run.
  #
  # Everything happens in a schema of its own (@schema): the bench never
  # touches a host's rows, and its schema-qualified statements are its own
  # entries in pg_stat_statements.
  #
  # Rows are picked by index with deterministic uuids, md5("bench/<ns>/chat/<k>")
  # as a uuid, which both sides compute: caller k of the library and pgbench's
  # client k (`:client_id`) use the same chat, user and ref. pgbench cannot
  # build strings, so each client fetches its values once with `\gset` in its
  # first transaction (skipped from the latency figures).

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Config, Native, Schema}

  @schema "phoenix_kit_agent_locks_bench"
  @ttl 120
  @hold 30
  @rows_per_ns 50
  @namespaces ~w(cycle hot reads click stmts)
  @workloads ~w(statements overhead cycle hot reads click)
  @statement_rounds 200

  # Parameters of each statement, in `$n` order, as pgbench variable names.
  @params %{
    "acquire" => ~w(chat usr ref ttl),
    "acquire_user" => ~w(usr click ttl hold),
    "fresh?" => ~w(chat ref ttl),
    "held?" => ~w(chat usr ref),
    "keep_user" => ~w(usr click ttl hold),
    "release" => ~w(chat usr ref),
    "release_stale" => ~w(chat usr ref ttl),
    "release_user" => ~w(usr click)
  }

  @doc "The workload names `--workloads` accepts."
  def workloads, do: @workloads

  @doc """
  Runs the benchmark. `opts`: `:duration` (s), `:warmup` (ms), `:workloads`
  (names), `:runs`, `:out` (markdown path), `:cycle_callers`.
  """
  def run(opts) do
    ctx = setup(opts)

    statements = if "statements" in ctx.workloads, do: statements_check(ctx)

    overhead = if "overhead" in ctx.workloads, do: overhead(ctx)

    runs =
      for run <- 1..ctx.runs do
        info(ctx, "run #{run}/#{ctx.runs}")
        # Alternate which side goes first, so neither always meets the
        # other's dead tuples or a warmer cache.
        order = if rem(run, 2) == 1, do: [:library, :pgbench], else: [:pgbench, :library]
        for spec <- cases(ctx), do: run_case(ctx, spec, order)
      end

    report = report(ctx, runs, statements, overhead)
    IO.puts(report)
    File.mkdir_p!(Path.dirname(ctx.out))
    File.write!(ctx.out, report)
    info(ctx, "written to #{ctx.out}")
    File.rm_rf!(ctx.tmp)
    report
  end

  ## Setup

  defp setup(opts) do
    base = Config.read()
    url = base.url || Mix.raise("locks.bench: set DATABASE_URL (or config :url)")
    options = %{base | prefix: @schema}
    :ok = Native.start(options)
    :ok = Schema.setup!(:tables)

    ctx = %{
      url: url,
      options: options,
      duration: opts[:duration],
      warmup_ms: opts[:warmup],
      runs: opts[:runs],
      out: opts[:out],
      workloads: opts[:workloads],
      cycle_callers: opts[:cycle_callers],
      pgbench: System.find_executable("pgbench") || Mix.raise("locks.bench: pgbench not on PATH"),
      tmp: Path.join(System.tmp_dir!(), "locks_bench_#{System.unique_integer([:positive])}"),
      stmts: Map.new(raise("the statement texts: next commit")),
      chats: qualified("phoenix_kit_agent_conversations"),
      users: qualified("phoenix_kit_agent_user_settings"),
      started: DateTime.utc_now() |> DateTime.truncate(:second),
      loadavg_start: loadavg()
    }

    File.mkdir_p!(ctx.tmp)

    values = fn kind ->
      for ns <- @namespaces,
          k <- 0..(@rows_per_ns - 1),
          do: "('#{uuid("bench/#{ns}/#{kind}/#{k}")}')"
    end

    psql!(ctx, [
      "INSERT INTO #{ctx.chats} (uuid) VALUES #{Enum.join(values.("chat"), ",")} ON CONFLICT DO NOTHING",
      "INSERT INTO #{ctx.users} (user_uuid) VALUES #{Enum.join(values.("user"), ",")} ON CONFLICT DO NOTHING"
    ])

    Map.put(ctx, :server, psql!(ctx, ["SHOW server_version"]) |> hd() |> hd())
  end

  defp qualified(name), do: ~s("#{@schema}".#{name})

  # Frees every bench lock and vacuums, so each run starts from the same state.
  defp reset!(ctx) do
    psql!(ctx, [
      "UPDATE #{ctx.chats} SET busy_since = NULL, busy_turn_ref = NULL WHERE busy_turn_ref IS NOT NULL",
      "UPDATE #{ctx.users} SET busy_since = NULL, busy_turn_ref = NULL WHERE busy_turn_ref IS NOT NULL",
      "VACUUM ANALYZE #{ctx.chats}",
      "VACUUM ANALYZE #{ctx.users}"
    ])
  end

  ## The rows of caller k (the same on both sides)

  defp chat(ns, k), do: uuid("bench/#{ns}/chat/#{k}")
  defp user(ns, k), do: uuid("bench/#{ns}/user/#{k}")
  defp ref(ns, k), do: "bench-#{ns}-#{k}"
  defp click(ns, k), do: "click:" <> md5("bench/#{ns}/click/#{k}")

  defp md5(text), do: Base.encode16(:crypto.hash(:md5, text), case: :lower)

  # md5(text)::uuid, as PostgreSQL spells it.
  defp uuid(text) do
    <<a::binary-8, b::binary-4, c::binary-4, d::binary-4, e::binary-12>> = md5(text)
    Enum.join([a, b, c, d, e], "-")
  end

  # pgbench's side: each client sets :chat :usr :ref :click once. A `:name`
  # inside a string literal would be taken for a variable, hence the slashes.
  defp pg_init(ns, chat_index) do
    """
    \\if :inited = 0
    SELECT md5('bench/#{ns}/chat/' || #{chat_index})::uuid AS chat,
           md5('bench/#{ns}/user/' || :client_id)::uuid AS usr,
           'bench-#{ns}-' || :client_id AS ref,
           'click:' || md5('bench/#{ns}/click/' || :client_id) AS click \\gset
    \\set inited 1
    \\endif
    """
  end

  # A library statement with its `$n` bound to pgbench variables. pgbench
  # sends each occurrence of a variable as a parameter of its own, so
  # `$3 … $3` becomes `$3 … $5`: the same plan, a few more bytes to bind.
  defp pg_sql(ctx, name, terminator \\ ";") do
    vars = Map.fetch!(@params, name)

    sql =
      Regex.replace(~r/\$(\d+)/, Map.fetch!(ctx.stmts, name), fn _, i ->
        ":" <> Enum.at(vars, String.to_integer(i) - 1)
      end)

    String.trim(sql) <> terminator <> "\n"
  end

  ## Workloads

  defp cases(ctx) do
    cycle =
      if "cycle" in ctx.workloads do
        for n <- ctx.cycle_callers do
          %{
            id: "cycle",
            callers: n,
            unit: "acquire + release",
            op: fn k ->
              {c, u, r} = {chat("cycle", k), user("cycle", k), ref("cycle", k)}

              fn ->
                :ok = Locks.acquire(c, u, r, @ttl)
                :ok = Locks.release(c, u, r)
              end
            end,
            script:
              pg_init("cycle", ":client_id") <> pg_sql(ctx, "acquire") <> pg_sql(ctx, "release"),
            reference: pg_init("cycle", ":client_id") <> transaction_cycle(ctx)
          }
        end
      else
        []
      end

    hot =
      if "hot" in ctx.workloads do
        [
          %{
            id: "hot",
            callers: 50,
            unit: "acquire (+ release if won)",
            op: fn k ->
              {c, u, r} = {chat("hot", 0), user("hot", k), ref("hot", k)}

              fn ->
                case Locks.acquire(c, u, r, @ttl) do
                  :ok -> :ok = Locks.release(c, u, r)
                  {:error, :conversation_busy} -> :ok
                end
              end
            end,
            script:
              pg_init("hot", "'0'") <>
                pg_sql(ctx, "acquire", " \\gset\n") <>
                "\\if :acquired\n" <> pg_sql(ctx, "release") <> "\\endif\n"
          }
        ]
      else
        []
      end

    reads =
      if "reads" in ctx.workloads do
        [
          %{
            id: "reads",
            callers: 10,
            unit: "held? + fresh?",
            # Each caller's locks are held, so both answers are true.
            before: fn ->
              for k <- 0..9,
                  do:
                    :ok = Locks.acquire(chat("reads", k), user("reads", k), ref("reads", k), @ttl)
            end,
            op: fn k ->
              {c, u, r} = {chat("reads", k), user("reads", k), ref("reads", k)}

              fn ->
                true = Locks.held?(c, u, r)
                true = Locks.fresh?(c, r, @ttl)
              end
            end,
            script:
              pg_init("reads", ":client_id") <> pg_sql(ctx, "held?") <> pg_sql(ctx, "fresh?")
          }
        ]
      else
        []
      end

    click =
      if "click" in ctx.workloads do
        [
          %{
            id: "click",
            callers: 10,
            unit: "acquire_user + keep_user + release_user",
            op: fn k ->
              {u, cl} = {user("click", k), click("click", k)}

              fn ->
                :ok = Locks.acquire_user(u, cl, @ttl, @hold)
                true = Locks.keep_user(u, cl, @ttl, @hold)
                :ok = Locks.release_user(u, cl)
              end
            end,
            script:
              pg_init("click", ":client_id") <>
                pg_sql(ctx, "acquire_user") <>
                pg_sql(ctx, "keep_user") <> pg_sql(ctx, "release_user")
          }
        ]
      else
        []
      end

    cycle ++ hot ++ reads ++ click
  end

  # What a caller would otherwise write: two transactions of two statements.
  # The happy path only (a real caller would also have to ROLLBACK when the
  # user's row is not taken); 8 statements and 4 round trips more than ours.
  defp transaction_cycle(ctx) do
    free = fn t ->
      "(#{t}.busy_turn_ref IS NULL OR #{t}.busy_turn_ref = :ref::text OR #{t}.busy_since IS NULL
       OR #{t}.busy_since < now() - :ttl::int4 * interval '1 second')"
    end

    """
    BEGIN;
    UPDATE #{ctx.chats} c SET busy_since = now(), busy_turn_ref = :ref::text
     WHERE c.uuid = :chat::uuid AND #{free.("c")};
    INSERT INTO #{ctx.users} AS u (user_uuid, busy_since, busy_turn_ref)
     VALUES (:usr::uuid, now(), :ref::text)
     ON CONFLICT (user_uuid) DO UPDATE SET busy_since = now(), busy_turn_ref = EXCLUDED.busy_turn_ref
     WHERE #{free.("u")};
    COMMIT;
    BEGIN;
    UPDATE #{ctx.chats} SET busy_since = NULL, busy_turn_ref = NULL
     WHERE uuid = :chat::uuid AND busy_turn_ref = :ref::text;
    UPDATE #{ctx.users} SET busy_since = NULL, busy_turn_ref = NULL
     WHERE user_uuid = :usr::uuid AND busy_turn_ref = :ref::text;
    COMMIT;
    """
  end

  defp run_case(ctx, spec, order) do
    label = "#{spec.id} ×#{spec.callers}"

    results =
      Map.new(order, fn
        :library ->
          reset!(ctx)
          if spec[:before], do: spec.before.()
          info(ctx, "  #{label}: library")
          {:library, run_library(ctx, spec)}

        :pgbench ->
          reset!(ctx)
          if spec[:before], do: spec.before.()
          info(ctx, "  #{label}: pgbench")
          {:pgbench, run_pgbench(ctx, spec.script, spec.callers)}
      end)

    reference =
      if spec[:reference] do
        reset!(ctx)
        info(ctx, "  #{label}: pgbench, BEGIN … COMMIT ×2")
        run_pgbench(ctx, spec.reference, spec.callers)
      end

    Map.merge(spec, results)
    |> Map.put(:reference, reference)
    |> Map.drop([:op, :before, :script])
  end

  ## The library side

  # `callers` processes run `op` in a loop: first for the warm-up (the pool
  # opens its connections, each connection prepares its statements), then,
  # all from the same instant, for `duration` seconds, timing each op with
  # :erlang.monotonic_time into a shared histogram (a list of every latency
  # would grow the callers' heaps, and its garbage collections would show up
  # as latency). A probe measures message round trips meanwhile.
  defp run_library(ctx, spec) do
    parent = self()
    hist = hist_new()

    pids =
      for k <- 0..(spec.callers - 1) do
        spawn_link(fn ->
          op = spec.op.(k)
          send(parent, {:ready, self()})

          receive do
            {:go, measure_at, end_at} ->
              warm(op, measure_at)
              send(parent, {:done, self(), measure(op, end_at, hist, 0, 0)})
          end
        end)
      end

    for pid <- pids, do: receive(do: ({:ready, ^pid} -> :ok))
    measure_at = :erlang.monotonic_time() + ms(ctx.warmup_ms)
    end_at = measure_at + ms(ctx.duration * 1000)
    probe = spawn_link(fn -> probe(parent, measure_at, end_at) end)
    for pid <- pids, do: send(pid, {:go, measure_at, end_at})

    {count, max, last} =
      Enum.reduce(pids, {0, 0, measure_at}, fn pid, {c, m, t} ->
        receive do
          {:done, ^pid, {count, max, last}} -> {c + count, max(m, max), max(t, last)}
        end
      end)

    probe = receive(do: ({:probe, ^probe, figures} -> figures))

    hist
    |> hist_stats(max)
    |> Map.put(:ops, count / seconds(last - measure_at))
    |> Map.put(:probe, probe)
  end

  defp ms(ms), do: System.convert_time_unit(ms, :millisecond, :native)
  defp us(native), do: System.convert_time_unit(native, :native, :microsecond)
  defp seconds(native), do: System.convert_time_unit(native, :native, :microsecond) / 1.0e6

  defp warm(op, until) do
    if :erlang.monotonic_time() < until do
      op.()
      warm(op, until)
    end
  end

  # {ops, the slowest in µs, when the last ended}
  defp measure(op, end_at, hist, count, slowest) do
    t0 = :erlang.monotonic_time()
    op.()
    t1 = :erlang.monotonic_time()
    lat = us(t1 - t0)
    hist_add(hist, lat)
    {count, slowest} = {count + 1, max(slowest, lat)}
    if t1 >= end_at, do: {count, slowest, t1}, else: measure(op, end_at, hist, count, slowest)
  end

  # On a normal scheduler (it never calls a NIF): a message to a second
  # process and back, every millisecond. Its round trip is what any other
  # process of the host waits for a scheduler while the lock calls run.
  defp probe(parent, measure_at, end_at) do
    echo = spawn_link(fn -> echo() end)
    hist = hist_new()
    sleep_until(measure_at)
    slowest = ping(echo, end_at, hist, 0)
    send(parent, {:probe, self(), hist_stats(hist, slowest)})
    Process.exit(echo, :kill)
  end

  defp echo do
    receive do
      {:ping, from} -> send(from, :pong)
    end

    echo()
  end

  defp ping(echo, end_at, hist, slowest) do
    t0 = :erlang.monotonic_time()

    if t0 >= end_at do
      slowest
    else
      send(echo, {:ping, self()})
      receive(do: (:pong -> :ok))
      rtt = us(:erlang.monotonic_time() - t0)
      hist_add(hist, rtt)
      Process.sleep(1)
      ping(echo, end_at, hist, max(slowest, rtt))
    end
  end

  defp sleep_until(t) do
    left = System.convert_time_unit(t - :erlang.monotonic_time(), :native, :millisecond)
    if left > 0, do: Process.sleep(left)
  end

  ## Latency histogram

  # Whole microseconds in :counters: exact below 1 ms, 10 µs wide to 100 ms,
  # 1 ms wide to 10 s, then one overflow bucket. Lock-free for concurrent
  # callers, and the same for both sides.
  @hist_buckets 1_000 + 9_900 + 9_900 + 1

  defp hist_new, do: :counters.new(@hist_buckets, [:write_concurrency])

  defp hist_add(hist, us), do: :counters.add(hist, bucket(us) + 1, 1)

  defp bucket(us) when us < 1_000, do: us
  defp bucket(us) when us < 100_000, do: 1_000 + div(us - 1_000, 10)
  defp bucket(us) when us < 10_000_000, do: 10_900 + div(us - 100_000, 1_000)
  defp bucket(_us), do: @hist_buckets - 1

  # The lowest latency of bucket `i` (what the percentiles report).
  defp bucket_us(i) when i < 1_000, do: i
  defp bucket_us(i) when i < 10_900, do: 1_000 + (i - 1_000) * 10
  defp bucket_us(i), do: 100_000 + (i - 10_900) * 1_000

  # p50/p99 from the histogram, max as measured; `ops` left to the caller.
  defp hist_stats(hist, slowest) do
    counts = for i <- 1..@hist_buckets, do: :counters.get(hist, i)
    n = Enum.sum(counts)

    if n == 0 do
      %{ops: nil, n: 0, p50: nil, p99: nil, max: nil}
    else
      at = fn p -> rank_us(counts, max(1, ceil(p * n))) end
      %{ops: nil, n: n, p50: at.(0.5), p99: at.(0.99), max: slowest}
    end
  end

  defp rank_us(counts, rank) do
    Enum.reduce_while(counts, {0, 0}, fn c, {i, seen} ->
      if seen + c >= rank, do: {:halt, {:found, i}}, else: {:cont, {i + 1, seen + c}}
    end)
    |> case do
      {:found, i} -> bucket_us(i)
      _ -> nil
    end
  end

  ## The pgbench side

  defp run_pgbench(ctx, script, clients) do
    dir = Path.join(ctx.tmp, "run#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    File.write!(Path.join(dir, "script.sql"), script)

    args =
      ~w(-M prepared -n -D inited=0 -D ttl=#{@ttl} -D hold=#{@hold} -f script.sql) ++
        ~w(-c #{clients} -j #{clients} -T #{ctx.duration} -l --log-prefix=lat) ++ [ctx.url]

    {out, status} = System.cmd(ctx.pgbench, args, cd: dir, stderr_to_stdout: true)

    tps =
      case Regex.run(~r/tps = ([\d.]+) \(without initial connection time\)/, out) do
        [_, tps] when status == 0 ->
          String.to_float(tps)

        _ ->
          Mix.raise("locks.bench: pgbench failed (exit #{status}):\n#{out}\nscript:\n#{script}")
      end

    if out =~ ~r/number of failed transactions: [1-9]/,
      do: Mix.raise("locks.bench: pgbench transactions failed:\n#{out}")

    # client_id transaction_no latency_us script_no epoch_s epoch_us; each
    # client's first transaction also ran the \gset and the PREPAREs.
    hist = hist_new()

    slowest =
      for file <- File.ls!(dir),
          String.starts_with?(file, "lat."),
          line <- File.stream!(Path.join(dir, file)),
          [_client, no, us | _] = String.split(line),
          no != "1",
          reduce: 0 do
        slowest ->
          us = String.to_integer(us)
          hist_add(hist, us)
          max(slowest, us)
      end

    File.rm_rf!(dir)
    %{hist_stats(hist, slowest) | ops: tps}
  end

  ## Statements and transactions per call, from the server's counters

  # Each public function runs @statement_rounds times, alone, on a pool that
  # logs in as a role of its own, created for this: pg_stat_statements counts
  # per role, so the statements this role ran are exactly the library's, never
  # another session's (tests of others may run the same SQL meanwhile).
  # BEGIN/COMMIT/SAVEPOINT are counted too (pg_stat_statements.track_utility),
  # so "no transaction control" proves each statement was its own transaction.
  defp statements_check(ctx) do
    info(ctx, "statements per call")

    with :ok <- pg_stat_statements(ctx),
         {:ok, role, url} <- bench_role(ctx) do
      try do
        :ok = Native.start(%{ctx.options | url: url, pool_size: 1})
        steps = statement_steps()
        # Prepare every statement first: PREPARE is not an execution.
        Enum.each(steps, fn {_, fun} -> fun.() end)

        rows =
          for {name, fun} <- steps do
            {s0, t0} = role_counts(ctx, role)
            for _ <- 1..@statement_rounds, do: fun.()
            {s1, t1} = role_counts(ctx, role)
            {name, @statement_rounds, s1 - s0, t1 - t0}
          end

        %{method: :pg_stat_statements, rows: rows}
      after
        :ok = Native.start(ctx.options)
        drop_role(ctx, role)
      end
    else
      {:error, why} ->
        info(
          ctx,
          "  pg_stat_statements or a role of its own unavailable (#{why}); xact_commit deltas"
        )

        xact_check(ctx)
    end
  end

  defp statement_steps do
    {c, u, r} = {chat("stmts", 0), user("stmts", 0), ref("stmts", 0)}
    {u2, cl} = {user("stmts", 1), click("stmts", 1)}

    [
      {"acquire/4", fn -> :ok = Locks.acquire(c, u, r, @ttl) end},
      {"held?/3", fn -> true = Locks.held?(c, u, r) end},
      {"fresh?/3", fn -> true = Locks.fresh?(c, r, @ttl) end},
      {"release_stale/4", fn -> false = Locks.release_stale(c, u, r, @ttl) end},
      {"release/3", fn -> :ok = Locks.release(c, u, r) end},
      {"acquire_user/4", fn -> :ok = Locks.acquire_user(u2, cl, @ttl, @hold) end},
      {"keep_user/4", fn -> true = Locks.keep_user(u2, cl, @ttl, @hold) end},
      {"release_user/2", fn -> :ok = Locks.release_user(u2, cl) end}
    ]
  end

  defp pg_stat_statements(ctx) do
    psql!(ctx, ["CREATE EXTENSION IF NOT EXISTS pg_stat_statements"])
    psql!(ctx, ["SELECT count(*) FROM pg_stat_statements WHERE false"])
    :ok
  rescue
    e -> {:error, Exception.message(e) |> String.split("\n") |> hd()}
  end

  defp bench_role(ctx) do
    role = "locks_bench_" <> binary_part(md5("#{System.unique_integer()}#{:os.getpid()}"), 0, 10)
    password = md5(:crypto.strong_rand_bytes(16))
    uri = URI.parse(ctx.url)

    if uri.scheme in ["postgres", "postgresql"] and uri.host do
      psql!(ctx, [
        "CREATE ROLE #{role} LOGIN PASSWORD '#{password}'",
        "GRANT USAGE ON SCHEMA \"#{@schema}\" TO #{role}",
        "GRANT SELECT, INSERT, UPDATE ON #{ctx.chats}, #{ctx.users} TO #{role}"
      ])

      {:ok, role, URI.to_string(%{uri | userinfo: "#{role}:#{password}"})}
    else
      {:error, "DATABASE_URL is not a postgres:// URL"}
    end
  rescue
    e -> {:error, Exception.message(e) |> String.split("\n") |> hd()}
  end

  defp drop_role(ctx, role) do
    # The pool that logged in as `role` was just replaced: wait for its
    # backends to go, then drop the role and its grants.
    Enum.reduce_while(1..50, nil, fn _, _ ->
      case psql!(ctx, ["SELECT count(*) FROM pg_stat_activity WHERE usename = '#{role}'"]) do
        [["0"]] ->
          {:halt, :ok}

        _ ->
          Process.sleep(100)
          {:cont, nil}
      end
    end)

    psql!(ctx, ["DROP OWNED BY #{role}", "DROP ROLE #{role}"])
  end

  @transaction_control "^\\s*(BEGIN|START|COMMIT|END|ROLLBACK|ABORT|SAVEPOINT|RELEASE|PREPARE\\s+TRANSACTION)"

  # {statements, of which transaction control} the role ran in this database.
  defp role_counts(ctx, role) do
    [[all, tc]] =
      psql!(ctx, [
        """
        SELECT coalesce(sum(calls), 0), coalesce(sum(calls) FILTER (WHERE query ~* '#{@transaction_control}'), 0)
        FROM pg_stat_statements
        WHERE userid = (SELECT oid FROM pg_roles WHERE rolname = '#{role}')
          AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
        """
      ])

    {String.to_integer(all), String.to_integer(tc)}
  end

  # Without pg_stat_statements: the database's committed transactions, which
  # count every session's. Backends report them when idle for a while or on
  # exit, so the pool is restarted (its connections close) before reading.
  defp xact_check(ctx) do
    rows =
      for {name, fun} <- statement_steps() do
        fun.()
        :ok = Native.start(ctx.options)
        Process.sleep(1500)
        x0 = xact_commit(ctx)
        for _ <- 1..@statement_rounds, do: fun.()
        :ok = Native.start(ctx.options)
        Process.sleep(1500)
        {name, @statement_rounds, nil, xact_commit(ctx) - x0}
      end

    %{method: :xact_commit, rows: rows}
  end

  defp xact_commit(ctx) do
    [[n]] =
      psql!(ctx, [
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
      ])

    String.to_integer(n)
  end

  ## Where the time of one call goes (1 caller, no concurrency)

  defp overhead(ctx) do
    info(ctx, "overhead of one held?/3, step by step")
    reset!(ctx)
    {c, u, r} = {chat("reads", 0), user("reads", 0), ref("reads", 0)}
    :ok = Locks.acquire(c, u, r, @ttl)
    n = 5_000

    time = fn fun ->
      for _ <- 1..200, do: fun.()

      lats =
        for _ <- 1..n do
          t0 = :erlang.monotonic_time()
          fun.()
          :erlang.monotonic_time() - t0
        end

      stats(lats)
    end

    bytes = fn uuid -> Base.decode16!(String.replace(uuid, "-", ""), case: :mixed) end
    {cb, ub} = {bytes.(c), bytes.(u)}

    # A turn and the call's stamp, as Locks takes them (no one waits here).
    turn = fn ->
      start = System.monotonic_time(:nanosecond)
      {Native.admit(start), start}
    end

    bad_arg = fn ->
      {token, start} = turn.()

      try do
        Native.held?(token, start, "not-a-uuid", ub, r)
      rescue
        ArgumentError -> :ok
      end
    end

    rows = [
      {"normal-scheduler NIF, no work (Native.loaded/0)", time.(fn -> Native.loaded() end)},
      {"a turn: Native.admit/1 (normal scheduler)", time.(turn)},
      {"dirty-I/O NIF, rejected argument (no tokio, no I/O)", time.(bad_arg)},
      {"Native.held/5 (a turn, then the NIF: decode, pool, statement, reply)",
       time.(fn ->
         {token, start} = turn.()
         true = Native.held?(token, start, cb, ub, r)
       end)},
      {"Locks.held?/3 (adds the Elixir argument checks)",
       time.(fn -> true = Locks.held?(c, u, r) end)}
    ]

    script = pg_init("reads", "0") <> pg_sql(ctx, "held?")
    rows ++ [{"pgbench -c 1, the same held? statement", run_pgbench(ctx, script, 1)}]
  end

  ## Figures

  # p50/p99/max of a list of latencies in native units, in µs with decimals
  # (the overhead steps are a few µs: finer than the histogram).
  defp stats(lats) do
    sorted = lats |> Enum.sort() |> List.to_tuple()
    n = tuple_size(sorted)
    us = fn i -> System.convert_time_unit(elem(sorted, i), :native, :nanosecond) / 1000 end
    at = fn p -> us.(max(0, min(n - 1, ceil(p * n) - 1))) end
    %{n: n, p50: at.(0.5), p99: at.(0.99), max: us.(n - 1)}
  end

  ## Report

  defp report(ctx, runs, statements, overhead) do
    header = """
    # phoenix_kit_agent_locks: benchmark

    #{ctx.started} · #{:erlang.system_info(:logical_processors)} cores · OTP #{:erlang.system_info(:otp_release)} · \
    #{:erlang.system_info(:dirty_io_schedulers)} dirty-I/O schedulers · pool_size #{pool_size(ctx)} · \
    PostgreSQL #{ctx.server} · #{ctx.duration} s per run, #{ctx.warmup_ms} ms warm-up (library) · \
    load average #{ctx.loadavg_start} → #{loadavg()}

    Library: the public calls from N Elixir processes, each op timed with
    `:erlang.monotonic_time`. pgbench: `pgbench -M prepared -c N -j N -T #{ctx.duration}`
    running the same statement texts (`Native.statements/0`), latencies from its
    `-l` log. An op is the unit in the table (two or three calls for most
    workloads). ratio = library ops/s ÷ pgbench ops/s; Δp50 = library p50 −
    pgbench p50. "BEGIN … COMMIT ×2" is the cycle as two multi-statement
    transactions through pgbench (what a caller would otherwise run); its row
    compares the library's cycle with it. probe p99: round trip of a message
    between two processes on normal schedulers while the library side ran.
    """

    tables =
      case runs do
        [] ->
          []

        [one] ->
          ["## Results\n\n" <> table(one)]

        _ ->
          per_run =
            runs
            |> Enum.with_index(1)
            |> Enum.map(fn {r, i} -> "### Run #{i}\n\n" <> table(r) end)

          ["## Median of #{length(runs)} runs\n\n" <> table(median(runs)) | per_run]
      end

    Enum.join(
      [header] ++
        tables ++
        targets(if(runs == [], do: [], else: median(runs)), statements) ++
        statements_section(statements) ++ overhead_section(overhead),
      "\n"
    )
  end

  defp pool_size(ctx), do: ctx.options.pool_size || 10

  defp table(cases) do
    head =
      "| workload | callers | op | library ops/s | p50 µs | p99 µs | max µs | pgbench ops/s | p50 µs | p99 µs | max µs | ratio | Δp50 µs | probe p99 µs |\n" <>
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n"

    rows =
      Enum.flat_map(cases, fn c ->
        lib = c[:library]
        main = row(c.id, c.callers, c.unit, lib, c[:pgbench], lib && lib.probe)

        ref =
          if c[:reference],
            do: [
              row(
                "#{c.id} vs BEGIN … COMMIT ×2",
                c.callers,
                "2 transactions",
                lib,
                c.reference,
                nil
              )
            ],
            else: []

        [main | ref]
      end)

    head <> Enum.join(rows, "\n") <> "\n"
  end

  defp row(id, callers, unit, lib, pg, probe) do
    cells =
      [id, callers, unit] ++
        figures(lib) ++
        figures(pg) ++
        [ratio(lib, pg), delta(lib, pg), fmt(probe && probe.p99)]

    "| " <> Enum.join(cells, " | ") <> " |"
  end

  defp figures(nil), do: ["–", "–", "–", "–"]
  defp figures(s), do: [fmt(s.ops, 0), fmt(s.p50), fmt(s.p99), fmt(s.max)]

  defp ratio(%{ops: a}, %{ops: b}) when is_number(a) and is_number(b) and b > 0,
    do: :erlang.float_to_binary(a / b, decimals: 2)

  defp ratio(_, _), do: "–"

  defp delta(%{p50: a}, %{p50: b}) when is_number(a) and is_number(b) do
    d = round(a - b)
    if d > 0, do: "+#{d}", else: "#{d}"
  end

  defp delta(_, _), do: "–"

  defp fmt(value, decimals \\ 0)
  defp fmt(nil, _), do: "–"
  defp fmt(v, 0), do: v |> round() |> Integer.to_string() |> group()
  defp fmt(v, d), do: :erlang.float_to_binary(v / 1, decimals: d)

  defp group(digits) do
    digits
    |> String.reverse()
    |> String.replace(~r/(\d{3})(?=\d)/, "\\1,")
    |> String.reverse()
  end

  # The median of every figure of each case across runs.
  defp median(runs) do
    runs
    |> Enum.zip()
    |> Enum.map(fn cases ->
      cases = Tuple.to_list(cases)
      first = hd(cases)

      Enum.reduce([:library, :pgbench, :reference], first, fn side, acc ->
        if first[side] do
          sides = Enum.map(cases, & &1[side])

          merged =
            Map.new([:ops, :p50, :p99, :max], fn k -> {k, med(Enum.map(sides, & &1[k]))} end)

          merged =
            if side == :library,
              do: Map.put(merged, :probe, %{p99: med(Enum.map(sides, & &1.probe.p99))}),
              else: merged

          Map.put(acc, side, merged)
        else
          acc
        end
      end)
    end)
  end

  defp med(values) do
    sorted = values |> Enum.reject(&is_nil/1) |> Enum.sort()

    case length(sorted) do
      0 -> nil
      n when rem(n, 2) == 1 -> Enum.at(sorted, div(n, 2))
      n -> (Enum.at(sorted, div(n, 2) - 1) + Enum.at(sorted, div(n, 2))) / 2
    end
  end

  defp targets(cases, statements) do
    find = fn id, n -> Enum.find(cases, &(&1.id == id and &1.callers == n)) end
    check = fn ok, text -> "| #{text} | #{if ok, do: "met", else: "**missed**"} |" end

    lines =
      [
        (c = find.("cycle", 10)) &&
          check.(r(c) >= 0.90, "cycle ×10 throughput ≥ 0.90 of pgbench: #{fmt(r(c), 2)}"),
        (c = find.("cycle", 1)) &&
          check.(d(c) <= 50, "cycle ×1 p50 within 50 µs of pgbench: #{fmt(d(c), 0)} µs"),
        (c = find.("reads", 10)) &&
          check.(r(c) >= 0.80, "reads ×10 throughput ≥ 0.80 of pgbench: #{fmt(r(c), 2)}")
      ] ++
        for c <- cases, c.callers == 50, c[:library] do
          p = c.library.probe.p99
          check.(p < 1000, "#{c.id} ×50: probe p99 under 1 ms: #{fmt(p, 0)} µs")
        end ++
        [
          statements && statements.method == :pg_stat_statements &&
            check.(
              Enum.all?(statements.rows, fn {_, n, s, tc} -> s == n and tc == 0 end),
              "1 statement and 1 transaction per call (pg_stat_statements)"
            )
        ]

    case Enum.filter(lines, & &1) do
      [] ->
        []

      lines ->
        ["## Targets (medians)\n\n| target | |\n|---|---|\n" <> Enum.join(lines, "\n") <> "\n"]
    end
  end

  defp r(c), do: c.library.ops / c.pgbench.ops
  defp d(c), do: c.library.p50 - c.pgbench.p50

  defp statements_section(nil), do: []

  defp statements_section(%{method: :pg_stat_statements, rows: rows}) do
    lines =
      for {name, calls, stmts, tc} <- rows do
        per = stmts / calls
        tx = if tc == 0, do: fmt(per, 2), else: "#{tc} transaction-control statements"
        "| #{name} | #{calls} | #{stmts} | #{tc} | #{fmt(per, 2)} | #{tx} |"
      end

    [
      """
      ## Statements per call

      Each function called #{@statement_rounds} times in a row by a pool that logs in as a
      role of its own; the role's statements counted by pg_stat_statements (which
      also counts BEGIN/COMMIT/SAVEPOINT). With no transaction control, every
      statement is its own autocommit transaction.

      | call | calls | statements | BEGIN/COMMIT/… | statements per call | transactions per call |
      |---|--:|--:|--:|--:|--:|
      #{Enum.join(lines, "\n")}
      """
    ]
  end

  defp statements_section(%{method: :xact_commit, rows: rows}) do
    lines =
      for {name, calls, _, tx} <- rows,
          do: "| #{name} | #{calls} | #{tx} | #{fmt(tx / calls, 2)} |"

    [
      """
      ## Transactions per call (pg_stat_database.xact_commit, database-wide)

      pg_stat_statements was not available: these deltas count every session of
      the database (and the bench's own psql queries), so they are an upper bound.

      | call | calls | committed transactions | per call |
      |---|--:|--:|--:|
      #{Enum.join(lines, "\n")}
      """
    ]
  end

  defp overhead_section(nil), do: []

  defp overhead_section(rows) do
    lines =
      for {name, s} <- rows,
          do: "| #{name} | #{fmt(s.p50, 1)} | #{fmt(s.p99, 1)} |"

    [
      """
      ## One held?/3, step by step (1 caller, serial)

      | step | p50 µs | p99 µs |
      |---|--:|--:|
      #{Enum.join(lines, "\n")}
      """
    ]
  end

  ## Helpers

  defp psql!(ctx, commands) do
    args =
      ["-X", "-q", "-A", "-t", "-F", "\t", "-v", "ON_ERROR_STOP=1", "-d", ctx.url] ++
        Enum.flat_map(commands, &["-c", &1])

    case System.cmd("psql", args, stderr_to_stdout: true, env: [{"PGCONNECT_TIMEOUT", "10"}]) do
      {out, 0} -> out |> String.split("\n", trim: true) |> Enum.map(&String.split(&1, "\t"))
      {out, status} -> raise "psql exited #{status}: #{out}"
    end
  end

  defp loadavg do
    case File.read("/proc/loadavg") do
      {:ok, text} -> text |> String.split() |> Enum.take(3) |> Enum.join(" ")
      _ -> "?"
    end
  end

  defp info(_ctx, text), do: IO.puts(:stderr, "locks.bench: " <> text)
end
