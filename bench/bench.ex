defmodule PhoenixKitAgent.Turns.Locks.Bench do
  @moduledoc """
  The body of `mix locks.bench` (options in `Mix.Tasks.Locks.Bench`):
  the public lock calls timed from Elixir processes against `pgbench -M
  prepared` running the very same SQL, in the same run, at the same
  concurrency and for the same time; pgbench is the floor, a client that
  adds nothing but libpq.

  Where and as whom it connects is the library's own configuration, as
  `PhoenixKitAgent.Turns.Locks.Config.read/0` resolves it (a `url:`, the
  host's `repo:`, discrete settings or `DATABASE_URL`); `psql` and `pgbench`
  get it through libpq's environment (`PGHOST`, `PGPORT`, `PGUSER`,
  `PGPASSWORD`, `PGDATABASE`, `PGSSLMODE`, …), never as a URL. Everything
  happens in a schema of its own (`phoenix_kit_agent_locks_bench`),
  created with its tables if missing: the bench never touches a host's rows.

  What it measures, per workload:

    * ops/s and the p50/p99/max latency a caller sees, the same for pgbench,
      their ratio and the p50 difference;
    * the VM's CPU time per call (`Bench.CPU`: every BEAM thread's utime +
      stime over the timed part, divided by the calls made in it) and
      pgbench's own CPU time per transaction (its `times` as a child of a
      shell);
    * how late a normal scheduler answers meanwhile (`Bench.Probe`: the p99
      of a message round trip between two processes, one every millisecond),
      and how long a 1-byte file read waits for a dirty-I/O scheduler, the
      kind the lock calls run on (what the pool size leaves to the rest of
      the VM), with more than one caller;
    * with `--peer postgrex` and the server on this machine, the server's
      CPU time per statement too (`Bench.CPU.server_ticks/1`).

  Besides the workloads: `statements` counts the statements and the
  transaction control one call of each function costs on the server
  (`Bench.StatementCounter`, pg_stat_statements under a role of its own;
  without it, `pg_stat_database.xact_commit` deltas), and `overhead` times
  the steps of one `held?/3` serially (the NIF's `run/3` refusing a bad
  argument, then a whole call's NIF, then the public call).

  The statement texts pgbench runs are read off the wire (`Bench.Wire`):
  a pool of the bench's own runs each public call once through a proxy that
  keeps the text of every Parse message. The NIF carries nothing for the
  bench.

  Rows are picked by index with deterministic uuids, `md5("bench/<ns>/chat/<k>")`
  as a uuid, which both sides compute: caller k of the library and
  pgbench's client k (`:client_id`) use the same chat, user and ref. pgbench
  cannot build strings, so each client fetches its values once with
  `\\gset` in its first transaction (left out of the latency figures).

  With `peer: :postgrex` (`--peer postgrex`, from a host app that has
  Postgrex: `Bench.Peer`) the same statements also run through Postgrex,
  with the same pool size, statements prepared once and
  `Postgrex.execute/4` from the same N processes, timed as the library is,
  in the same runs; the report then has library ÷ Postgrex ratios of
  throughput and of the VM's CPU per statement.

  In the alternated mode (`:alternate`), `:floor` adds the design's floor
  as a side (`examples/floor.rs` of the core crate: its pool from plain OS
  threads, no VM) and `:busy` runs K CPU-bound processes (`Bench.Load`)
  during every side's run, with a baseline of the load alone, for the work
  each side takes from them per statement.

  `run/1` returns `{:ok, report}` (the markdown it also prints and writes)
  or `{:error, message}`; raising is the Mix task's business.
  """

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Config, Native, Schema}

  alias PhoenixKitAgent.Turns.Locks.Bench.{
    CPU,
    Histogram,
    Load,
    Peer,
    Probe,
    Psql,
    StatementCounter,
    Wire
  }

  defmodule Failure do
    @moduledoc false
    # Why a run stopped: raised inside the bench, returned by `run/1`.
    defexception [:message]
  end

  @schema "phoenix_kit_agent_locks_bench"
  @chats "phoenix_kit_agent_conversations"
  @users "phoenix_kit_agent_user_settings"
  # The library's root: its git checkout (the report's commit) and its
  # cargo workspace (the floor).
  @root Path.expand("..", __DIR__)
  @ttl 120
  @hold 30
  @rows_per_ns 50
  @namespaces ~w(cycle hot reads held click stmts)
  @workloads ~w(statements overhead cycle hot reads held click)
  @statement_rounds 200

  # Parameters of each statement, in `$n` order, as pgbench variable names.
  @params %{
    # acquire/4 passes the TTL as the hold ($5).
    "acquire" => ~w(chat usr ref ttl ttl),
    "acquire_user" => ~w(usr click ttl hold),
    "fresh?" => ~w(chat ref ttl),
    "held?" => ~w(chat usr ref),
    "keep_user" => ~w(usr click ttl hold),
    "release" => ~w(chat usr ref),
    "release_stale" => ~w(chat usr ref ttl),
    "release_user" => ~w(usr click)
  }

  @doc false
  def schema, do: @schema

  @doc "The workload names `--workloads` accepts."
  def workloads, do: @workloads

  @doc """
  Runs the benchmark. `opts`: `:duration` (s), `:warmup` (ms), `:workloads`
  (names), `:runs`, `:out` (markdown path), `:cycle_callers` (list),
  `:pool_size` (nil: the configured one), `:peer` (`nil` or `:postgrex`),
  `:alternate` (`nil`, or the runs a point of the alternated mode),
  `:read_callers` (list, for `reads` and `held`), `:busy` (`nil`, or the
  load processes of a busy VM) and `:floor` (boolean): both alternated only.
  """
  @spec run(keyword()) :: {:ok, String.t()} | {:error, String.t()}
  def run(opts) do
    with {:ok, config} <- configured(),
         {:ok, pgbench} <- executable("pgbench"),
         {:ok, _psql} <- executable("psql") do
      tmp = Path.join(System.tmp_dir!(), "locks_bench_#{System.unique_integer([:positive])}")

      try do
        {:ok, bench(config, pgbench, tmp, opts)}
      rescue
        e in [Failure, Locks.Error] -> {:error, Exception.message(e)}
      after
        with %{} = peer <- Process.delete(:locks_bench_peer), do: Peer.stop(peer)
        File.rm_rf(tmp)
        # The configured pool back, as the application started it.
        Native.start(config)
      end
    end
  end

  defp configured do
    case Config.read() do
      {:ok, config} ->
        {:ok, config}

      :unconfigured ->
        {:error,
         "no database configured: set config :phoenix_kit_agent_locks, url: … or repo: …, " <>
           "or DATABASE_URL"}
    end
  rescue
    e in Locks.Error -> {:error, Exception.message(e)}
  end

  defp executable(name) do
    case System.find_executable(name) do
      nil -> {:error, "#{name} is not on the PATH (PostgreSQL's client programs)"}
      path -> {:ok, path}
    end
  end

  defp fail(message), do: raise(Failure, message: message)

  defp bench(config, pgbench, tmp, opts) do
    ctx = setup(config, pgbench, tmp, opts)

    statements = if "statements" in ctx.workloads, do: statements_check(ctx)

    overhead = if "overhead" in ctx.workloads, do: overhead(ctx)

    report =
      if ctx.alternate do
        alternated_report(ctx, alternated(ctx), statements, overhead)
      else
        runs =
          for run <- 1..ctx.runs do
            info("run #{run}/#{ctx.runs}")
            for spec <- cases(ctx), do: run_case(ctx, spec, order(ctx, run))
          end

        report(ctx, runs, statements, overhead)
      end

    IO.puts(report)
    File.mkdir_p!(Path.dirname(ctx.out))
    File.write!(ctx.out, report)
    info("written to #{ctx.out}")
    report
  end

  # Alternate which side goes first, so neither always meets the other's
  # dead tuples or a warmer cache; with a peer, each side goes first in turn.
  # `--order` shifts the turn, for runs alternated across invocations.
  defp order(%{peer: nil} = ctx, run),
    do: if(rem(run + ctx.order, 2) == 1, do: [:library, :pgbench], else: [:pgbench, :library])

  defp order(ctx, run) do
    sides = [:library, :postgrex, :pgbench]
    shift = rem(run - 1 + ctx.order, 3)
    Enum.drop(sides, shift) ++ Enum.take(sides, shift)
  end

  ## Setup

  defp setup(config, pgbench, tmp, opts) do
    options = %{config | prefix: @schema, pool_size: opts[:pool_size] || config.pool_size}
    :ok = Native.start(options)
    :ok = Schema.setup!(:tables)
    File.mkdir_p!(tmp)

    ctx = %{
      options: options,
      duration: opts[:duration],
      warmup_ms: opts[:warmup],
      runs: opts[:runs],
      out: opts[:out],
      workloads: opts[:workloads],
      cycle_callers: opts[:cycle_callers],
      order: opts[:order] || 0,
      alternate: opts[:alternate],
      read_callers: opts[:read_callers] || [10, 50],
      busy: opts[:busy],
      floor: if(opts[:floor], do: floor_executable()),
      pgbench: pgbench,
      shell: System.find_executable("bash"),
      tmp: tmp,
      chats: qualified(@chats),
      users: qualified(@users),
      started: DateTime.utc_now() |> DateTime.truncate(:second),
      loadavg_start: loadavg()
    }

    uuids = fn kind ->
      for ns <- @namespaces, k <- 0..(@rows_per_ns - 1), do: uuid("bench/#{ns}/#{kind}/#{k}")
    end

    psql!(ctx, rows_statements(uuids.("chat"), uuids.("user")))

    ctx =
      ctx
      |> Map.put(:server, psql!(ctx, ["SHOW server_version"]) |> hd() |> hd())
      |> Map.put(:settings, settings(ctx))
      |> Map.put(:postmaster, postmaster(ctx))
      |> Map.put(:stmts, statement_texts(ctx))

    Map.put(ctx, :peer, peer(ctx, opts[:peer]))
  end

  @doc false
  # What makes a commit durable, and so what a write costs: a production
  # server has all three on; the private cluster of scripts/pg all off
  # (`mix locks.compare` reports them too).
  def durability_settings, do: ~w(fsync synchronous_commit full_page_writes)

  defp settings(ctx) do
    names = durability_settings()
    values = psql!(ctx, Enum.map(names, &"SHOW #{&1}"))
    Enum.zip(names, Enum.map(values, &hd/1))
  end

  # The server's postmaster when it runs on this machine (its CPU time is
  # then read around each run), from its checkpointer's pid; else nil.
  defp postmaster(ctx) do
    case psql!(ctx, ["SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'"]) do
      [[pid]] -> CPU.postmaster(String.to_integer(pid))
      _ -> nil
    end
  end

  # The peer's pool, kept in the process dictionary for run/1 to stop.
  defp peer(_ctx, nil), do: nil

  defp peer(ctx, :postgrex) do
    info("Postgrex: pool of #{ctx.options.pool_size}, statements prepared once")

    case Peer.start(ctx.options, ctx.options.pool_size, ctx.stmts) do
      {:ok, peer} ->
        Process.put(:locks_bench_peer, peer)
        peer

      {:error, why} ->
        fail(why)
    end
  end

  defp qualified(name), do: ~s("#{@schema}".#{name})

  @doc false
  # The rows of chats and users (uuids) in the bench's schema, made if
  # missing (`mix locks.compare`'s too).
  def rows_statements(chats, users) do
    values = &Enum.map_join(&1, ",", fn uuid -> "('#{uuid}')" end)

    [
      "INSERT INTO #{qualified(@chats)} (uuid) VALUES #{values.(chats)} ON CONFLICT DO NOTHING",
      "INSERT INTO #{qualified(@users)} (user_uuid) VALUES #{values.(users)} ON CONFLICT DO NOTHING"
    ]
  end

  @doc false
  # Frees every lock in the bench's schema (`mix locks.compare` too).
  def free_statements do
    for table <- [@chats, @users],
        do: "UPDATE #{qualified(table)} SET busy_since = NULL, busy_turn_ref = NULL WHERE busy_turn_ref IS NOT NULL"
  end

  # Frees every bench lock and vacuums, so each run starts from the same state.
  defp reset!(ctx),
    do: psql!(ctx, free_statements() ++ ["VACUUM ANALYZE #{ctx.chats}", "VACUUM ANALYZE #{ctx.users}"])

  ## The statement texts, as the pool sends them

  # Each public call once, on a pool of one connection that goes through
  # Bench.Wire: the lock statement among the Parse messages of a call is
  # its text (the first call also sends the pool's query of the tables'
  # columns, which names no lock table). With `prepare: :named` a statement
  # is parsed the first time a connection runs it; unnamed, every time.
  defp statement_texts(ctx) do
    info("statement texts, from the wire")
    reset!(ctx)

    case Wire.start(ctx.options) do
      {:ok, wire, pool} ->
        try do
          :ok = Native.start(pool)

          Map.new(statement_steps(), fn {name, fun} ->
            fun.()
            key = name |> String.split("/") |> hd()

            case Enum.filter(Wire.texts(wire), &(&1 =~ "phoenix_kit_agent_")) do
              [text] -> {key, text}
              other -> fail("#{name} sent #{length(other)} lock statements, one expected")
            end
          end)
        after
          :ok = Native.start(ctx.options)
          Wire.stop(wire)
        end

      {:error, why} ->
        fail("cannot read the statement texts: #{why}")
    end
  end

  ## The rows of caller k (the same on both sides)

  defp chat(ns, k), do: uuid("bench/#{ns}/chat/#{k}")
  defp user(ns, k), do: uuid("bench/#{ns}/user/#{k}")
  defp ref(ns, k), do: "bench-#{ns}-#{k}"
  defp click(ns, k), do: "click:" <> md5("bench/#{ns}/click/#{k}")

  # A uuid as Postgrex takes it: its 16 bytes.
  defp bin(uuid), do: Base.decode16!(String.replace(uuid, "-", ""), case: :lower)

  defp md5(text), do: Base.encode16(:crypto.hash(:md5, text), case: :lower)

  @doc false
  # md5(text)::uuid, as PostgreSQL spells it (`mix locks.compare` too).
  def uuid(text) do
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
  #
  # Each `op` returns how many calls it made, for the CPU time per call.

  # Takes the locks of callers 0..n-1 of namespace `ns`, for workloads that read them.
  defp hold_all(ns, n) do
    for k <- 0..(n - 1), do: :ok = Locks.acquire(chat(ns, k), user(ns, k), ref(ns, k), @ttl)
  end

  defp cases(ctx) do
    cycle =
      if "cycle" in ctx.workloads do
        for n <- ctx.cycle_callers do
          %{
            id: "cycle",
            callers: n,
            unit: "acquire + release",
            statements: 2,
            floor: "cycle",
            op: fn k ->
              {c, u, r} = {chat("cycle", k), user("cycle", k), ref("cycle", k)}

              fn ->
                :ok = Locks.acquire(c, u, r, @ttl)
                :ok = Locks.release(c, u, r)
                2
              end
            end,
            peer: fn p, k ->
              {c, u, r} = {bin(chat("cycle", k)), bin(user("cycle", k)), ref("cycle", k)}

              fn ->
                [[true, _]] = Peer.execute(p, "acquire", [c, u, r, @ttl, @ttl])
                _ = Peer.execute(p, "release", [c, u, r])
                2
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
                  :ok ->
                    :ok = Locks.release(c, u, r)
                    2

                  {:error, :conversation_busy} ->
                    1
                end
              end
            end,
            peer: fn p, k ->
              {c, u, r} = {bin(chat("hot", 0)), bin(user("hot", k)), ref("hot", k)}

              fn ->
                case Peer.execute(p, "acquire", [c, u, r, @ttl, @ttl]) do
                  [[true, _]] ->
                    _ = Peer.execute(p, "release", [c, u, r])
                    2

                  [[false, _]] ->
                    1
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
        for n <- ctx.read_callers do
          %{
            id: "reads",
            callers: n,
            unit: "held? + fresh?",
            statements: 2,
            floor: "reads",
            # Each caller's locks are held, so both answers are true.
            before: fn -> hold_all("reads", n) end,
            op: fn k ->
              {c, u, r} = {chat("reads", k), user("reads", k), ref("reads", k)}

              fn ->
                true = Locks.held?(c, u, r)
                true = Locks.fresh?(c, r, @ttl)
                2
              end
            end,
            peer: fn p, k ->
              {c, u, r} = {bin(chat("reads", k)), bin(user("reads", k)), ref("reads", k)}

              fn ->
                [[true]] = Peer.execute(p, "held?", [c, u, r])
                [[true]] = Peer.execute(p, "fresh?", [c, r, @ttl])
                2
              end
            end,
            script:
              pg_init("reads", ":client_id") <> pg_sql(ctx, "held?") <> pg_sql(ctx, "fresh?")
          }
        end
      else
        []
      end

    held =
      if "held" in ctx.workloads do
        for n <- ctx.read_callers do
          %{
            id: "held",
            callers: n,
            unit: "held?",
            statements: 1,
            floor: "held",
            # Each caller's locks are held, so every answer is true.
            before: fn -> hold_all("held", n) end,
            op: fn k ->
              {c, u, r} = {chat("held", k), user("held", k), ref("held", k)}

              fn ->
                true = Locks.held?(c, u, r)
                1
              end
            end,
            peer: fn p, k ->
              {c, u, r} = {bin(chat("held", k)), bin(user("held", k)), ref("held", k)}

              fn ->
                [[true]] = Peer.execute(p, "held?", [c, u, r])
                1
              end
            end,
            script: pg_init("held", ":client_id") <> pg_sql(ctx, "held?")
          }
        end
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
                3
              end
            end,
            peer: fn p, k ->
              {u, cl} = {bin(user("click", k)), click("click", k)}

              fn ->
                [[^cl]] = Peer.execute(p, "acquire_user", [u, cl, @ttl, @hold])
                [_] = Peer.execute(p, "keep_user", [u, cl, @ttl, @hold])
                _ = Peer.execute(p, "release_user", [u, cl])
                3
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

    cycle ++ hot ++ reads ++ held ++ click
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
        :baseline ->
          info("  #{label}: the load alone")
          {:baseline, baseline(ctx)}

        :library ->
          reset!(ctx)
          if spec[:before], do: spec.before.()
          info("  #{label}: library")
          {:library, loaded(ctx, &run_library(&1, spec))}

        :pgbench ->
          reset!(ctx)
          if spec[:before], do: spec.before.()
          info("  #{label}: pgbench")
          result = loaded(ctx, &run_pgbench(&1, spec.script, spec.callers))
          {:pgbench, Map.put(result, :statements_per_s, spec[:statements] && result.ops * spec.statements)}

        :postgrex ->
          reset!(ctx)
          if spec[:before], do: spec.before.()
          info("  #{label}: Postgrex")
          peer = %{spec | op: &spec.peer.(ctx.peer, &1)}
          {:postgrex, loaded(ctx, &run_library(&1, peer))}

        :floor ->
          reset!(ctx)
          info("  #{label}: floor")
          {:floor, loaded(ctx, &run_floor(&1, spec))}
      end)

    reference =
      if spec[:reference] do
        reset!(ctx)
        info("  #{label}: pgbench, BEGIN … COMMIT ×2")
        run_pgbench(ctx, spec.reference, spec.callers)
      end

    Map.merge(spec, results)
    |> Map.put(:reference, reference)
    |> Map.drop([:op, :peer, :before, :script])
  end

  ## A busy VM (`--busy K`)

  # `run` (a side's run, given the context) with `ctx.busy` load processes
  # running throughout, the load's units a second over the timed part put in
  # its result as `:load_rate`: the library's, Postgrex's and the floor's
  # timed part is read by `run_library/2` and `run_floor/2` (`ctx.load`);
  # pgbench's is its whole program's run, its connections included.
  # Without `--busy`, just `run`.
  defp loaded(%{busy: nil} = ctx, run), do: run.(ctx)

  defp loaded(ctx, run) do
    load = Load.start(ctx.busy)

    try do
      before = Load.count(load)
      result = run.(Map.put(ctx, :load, load))
      rate = result[:load_rate] || Load.rate(before, Load.count(load))
      Map.put(result, :load_rate, rate)
    after
      Load.stop(load)
    end
  end

  # The load alone, no client running: its units a second over a timed part
  # as long as a side's, after the same warm-up.
  defp baseline(ctx) do
    load = Load.start(ctx.busy)

    try do
      Process.sleep(ctx.warmup_ms)
      before = Load.count(load)
      Process.sleep(ctx.duration * 1000)
      %{load_rate: Load.rate(before, Load.count(load))}
    after
      Load.stop(load)
    end
  end

  # The µs of one load process's time lost per statement of a side: the
  # units a second the load lost (the baseline's less the side's) over the
  # side's statements a second, a unit being worth K ÷ baseline seconds of
  # one load process.
  defp lost_us(k, %{load_rate: base}, %{load_rate: rate, statements_per_s: sps})
       when is_number(base) and base > 0 and is_number(sps) and sps > 0,
       do: (base - rate) / sps * 1.0e6 * k / base

  defp lost_us(_k, _baseline, _side), do: nil

  ## The floor (`--floor`)

  # `examples/floor.rs` of the core crate, built once in release mode: the
  # pool from plain OS threads, no VM around it.
  defp floor_executable do
    cargo =
      System.find_executable("cargo") ||
        Enum.find([Path.expand("~/.cargo/bin/cargo")], &File.exists?/1) ||
        fail("--floor: cargo is not on the PATH (the floor is a cargo example)")

    info("floor: cargo build --release --example floor")

    case System.cmd(cargo, ~w(build --release --example floor -p locks_core),
           cd: @root,
           stderr_to_stdout: true
         ) do
      {_, 0} -> :ok
      {out, status} -> fail("--floor: cargo build failed (exit #{status}):\n#{out}")
    end

    target = Path.expand(System.get_env("CARGO_TARGET_DIR") || "target", @root)
    Path.join([target, "release", "examples", "floor"])
  end

  # One run of the floor at the spec's callers (its threads), with the
  # bench's pool size, duration and warm-up, on the bench's tables (rows of
  # its own); connected as psql and pgbench are, through libpq's variables.
  # Under `--busy`, the load is read when the floor says its timed part
  # starts (`floor timed`) and when it prints its figures.
  defp run_floor(ctx, spec) do
    args =
      ~w(--workload #{spec.floor} --threads #{spec.callers} --pool-size #{pool_size(ctx)}) ++
        ~w(--duration #{ctx.duration} --warmup #{ctx.warmup_ms} --prefix #{@schema})

    env =
      for {name, value} <- [
            {"DATABASE_URL", nil}
            | Psql.env(ctx.options, "phoenix_kit_agent_locks bench floor")
          ],
          do: {String.to_charlist(name), if(value, do: String.to_charlist(value), else: false)}

    port =
      Port.open({:spawn_executable, ctx.floor}, [
        :binary,
        :exit_status,
        :stderr_to_stdout,
        {:line, 65_536},
        args: args,
        env: env
      ])

    {out, status, window} = floor_output(port, ctx[:load], [], [])
    out = Enum.join(out, "\n")

    if status != 0, do: fail("the floor failed (exit #{status}):\n#{out}")

    figure = fn key ->
      case Regex.run(~r/\b#{key}=([\d.]+)/, out) do
        [_, value] -> elem(Float.parse(value), 0)
        nil -> fail("the floor printed no #{key}:\n#{out}")
      end
    end

    load_rate =
      case window do
        [finish, start] -> Load.rate(start, finish)
        _ -> nil
      end

    %{
      ops: figure.("ops_per_s"),
      statements_per_s: figure.("statements") / figure.("seconds"),
      cpu_call: figure.("cpu_us_per_statement"),
      load_rate: load_rate
    }
  end

  # The floor's lines until it exits, and the load's readings at `floor
  # timed` and at its figures (latest first).
  defp floor_output(port, load, lines, window) do
    receive do
      {^port, {:data, {_, line}}} ->
        window =
          if load && (line == "floor timed" or String.starts_with?(line, "floor workload=")),
            do: [Load.count(load) | window],
            else: window

        floor_output(port, load, [line | lines], window)

      {^port, {:exit_status, status}} ->
        {Enum.reverse(lines), status, window}
    end
  end

  ## Alternated runs (`--alternate`)

  # Each point `ctx.alternate` times in a row: the library, Postgrex (when
  # loaded), then pgbench, so that the library and Postgrex alternate and
  # each library run has its Postgrex run beside it, a pair whose ratio is
  # taken. The cycle's BEGIN … COMMIT reference is not what this mode
  # compares: it is left out. `[{spec, runs}]`, one per point.
  defp alternated(ctx) do
    for spec <- cases(ctx) do
      spec = Map.delete(spec, :reference)
      sides = if ctx.busy, do: [:baseline | sides(ctx, spec)], else: sides(ctx, spec)

      runs =
        for run <- 1..ctx.alternate do
          info("#{spec.id} ×#{spec.callers}: run #{run}/#{ctx.alternate}")
          run_case(ctx, spec, sides)
        end

      {spec, runs}
    end
  end

  # The clients of a point, in the order each run runs them: the floor
  # only with `--floor`, for the workloads it has.
  defp sides(ctx, spec) do
    [:library] ++
      if(ctx.peer, do: [:postgrex], else: []) ++
      [:pgbench] ++ if(ctx.floor && spec[:floor], do: [:floor], else: [])
  end

  defp alternated_report(ctx, points, statements, overhead) do
    n = ctx.alternate
    settings = Enum.map_join(ctx.settings, " · ", fn {name, value} -> "#{name} #{value}" end)
    load_before = ctx.loadavg_start |> String.split() |> hd()
    load_after = loadavg() |> String.split() |> hd()

    peer =
      if ctx.peer do
        "Postgrex #{vsn(:postgrex)} (DBConnection #{vsn(:db_connection)}): the same " <>
          "statements prepared once, `Postgrex.execute/4` from the same N processes, " <>
          "a pool of the same size."
      else
        "Postgrex: absent (not loaded in this VM; run the bench from a host app that " <>
          "has it, see `mix help locks.bench`): the library and pgbench only, no ratios."
      end

    sides =
      [:library] ++
        if(ctx.peer, do: [:postgrex], else: []) ++
        [:pgbench] ++ if(ctx.floor, do: [:floor], else: [])

    sides = if ctx.busy, do: [:baseline | sides], else: sides

    rows =
      for {spec, runs} <- points, side <- sides(ctx, spec) do
        values = Enum.map(runs, & &1[side])
        ops = Enum.map(values, & &1.ops)
        # pgbench is another process: the VM's CPU is not its. The floor's
        # is its own process's.
        cpu = if side == :pgbench, do: [], else: Enum.map(values, & &1[:cpu_call])

        "| #{spec.id} | #{spec.callers} | #{spec.unit} | #{side_name(side)} | #{length(runs)} " <>
          "| #{fmt(med(ops))} | #{range(ops, 0)} | #{fmt(med(cpu), 1)} | #{range(cpu, 1)} |"
      end

    ratios =
      for {spec, runs} <- points, ctx.peer do
        ops = Enum.map(runs, &(&1.library.ops / &1.postgrex.ops))
        cpu = Enum.map(runs, &cpu_ratio(&1.library.cpu_call, &1.postgrex.cpu_call))

        "| #{spec.id} | #{spec.callers} | #{length(runs)} | #{fmt(med(ops), 2)} | #{range(ops, 2)} " <>
          "| #{fmt(med(cpu), 2)} | #{range(cpu, 2)} |"
      end

    ratio_section =
      if ctx.peer do
        """
        ## Library ÷ Postgrex, pair by pair

        | workload | callers | pairs | throughput ratio median | throughput ratio range | CPU ratio median | CPU ratio range |
        |---|--:|--:|--:|--:|--:|--:|
        #{Enum.join(ratios, "\n")}
        """
      else
        "## Library ÷ Postgrex\n\nNo ratios: Postgrex is absent.\n"
      end

    report = """
    # phoenix_kit_agent_locks: alternated runs

    #{ctx.started} · commit #{commit()} · #{n} runs a point, #{ctx.duration} s each, \
    #{ctx.warmup_ms} ms of warm-up before each library and Postgrex run · pool_size #{pool_size(ctx)}

    server: PostgreSQL #{ctx.server} · #{settings}

    machine: #{System.schedulers_online()} schedulers online · \
    #{:erlang.system_info(:logical_processors)} logical processors · \
    #{:erlang.system_info(:dirty_io_schedulers)} dirty-I/O schedulers · \
    OTP #{:erlang.system_info(:otp_release)} · load average (1 min) #{load_before} before the run, \
    #{load_after} after

    #{peer}
    #{floor_text(ctx)}
    Each point is run #{n} times in a row, each time in this order: \
    #{Enum.map_join(sides, ", ", &side_name/1)}; \
    every side from the same state (locks freed, tables vacuumed). Throughput: ops/s, an op \
    being the unit in the table. CPU: the VM's (every BEAM thread's utime + stime from \
    /proc/self/task/*/stat over the timed part, #{CPU.hz()} ticks a second) per statement \
    (the floor's: its own process's); the server's is not in it.#{busy_cpu_text(ctx)} Median, \
    and range (min–max), over the runs; the ratios are \
    taken pair by pair (a library run and the Postgrex run after it), then their median and \
    range.

    ## Each side

    | workload | callers | op | side | runs | ops/s median | ops/s range | VM CPU µs/statement median | VM CPU µs/statement range |
    |---|--:|---|---|--:|--:|--:|--:|--:|
    #{Enum.join(rows, "\n")}

    #{ratio_section}
    """

    Enum.join(
      [report] ++
        busy_section(ctx, points) ++ statements_section(statements) ++ overhead_section(overhead),
      "\n"
    )
  end

  defp side_name(:library), do: "library"
  defp side_name(:postgrex), do: "Postgrex"
  defp side_name(:pgbench), do: "pgbench"
  defp side_name(:floor), do: "floor"
  defp side_name(:baseline), do: "the load alone"

  defp floor_text(%{floor: nil}), do: ""

  defp floor_text(_ctx) do
    "\nThe floor: the core crate's pool from plain OS threads, no VM " <>
      "(`native/locks_core/examples/floor.rs`, a release build): the same N callers as " <>
      "threads, the same pool size, rows of its own; for cycle, reads and held.\n"
  end

  defp busy_cpu_text(%{busy: nil}), do: ""

  defp busy_cpu_text(ctx),
    do: " With `--busy #{ctx.busy}` the VM's CPU includes the load's (see Busy VM)."

  # Each side's throughput and the load's work it took, per statement.
  defp busy_section(%{busy: nil}, _points), do: []

  defp busy_section(ctx, points) do
    k = ctx.busy

    rows =
      for {spec, runs} <- points, side <- [:baseline | sides(ctx, spec)] do
        rates = Enum.map(runs, & &1[side].load_rate)

        case side do
          :baseline ->
            unit = Enum.map(rates, &(k * 1.0e6 / &1))

            "| #{spec.id} | #{spec.callers} | the load alone | – | #{fmt(med(rates))} (#{range(rates, 0)}) " <>
              "| – | one unit: #{fmt(med(unit), 2)} µs (#{range(unit, 2)}) of one load process |"

          side ->
            ops = Enum.map(runs, & &1[side].ops)
            lost = Enum.map(runs, &lost_us(k, &1.baseline, &1[side]))

            "| #{spec.id} | #{spec.callers} | #{side_name(side)} | #{fmt(med(ops))} (#{range(ops, 0)}) " <>
              "| #{fmt(med(rates))} (#{range(rates, 0)}) | #{fmt(med(lost), 1)} (#{range(lost, 1)}) | |"
        end
      end

    [
      """
      ## Busy VM (`--busy #{k}`)

      During every run of every side (and alone, before them, for as long as a
      side's timed part: the baseline), #{k} CPU-bound process(es) ran on the normal
      schedulers, each doing units of pure work (#{Load.unit_steps()} steps of integer
      arithmetic) in a loop, as a loaded node's processes keep its schedulers busy.
      The load's work is its units a second over the timed part (for pgbench, over
      its whole program's run, its connections included).
      Work lost per statement: (the baseline's units a second − the units a second
      during the side's run) ÷ the side's statements a second, in µs of one load
      process's time (a unit is worth #{k} ÷ the baseline's units a second); each
      run's side against that run's baseline. Whatever else the side's statements
      make run on these cores counts too (the server's backends, when it runs on
      this machine). Median (min–max) over the runs.

      | workload | callers | side | ops/s | load's units/s | load's work lost, µs of one load process per statement | |
      |---|--:|---|--:|--:|--:|---|
      #{Enum.join(rows, "\n")}
      """
    ]
  end

  # "min–max" of a list of figures.
  defp range(values, decimals) do
    case Enum.reject(values, &is_nil/1) do
      [] -> "–"
      vs -> "#{fmt(Enum.min(vs), decimals)}–#{fmt(Enum.max(vs), decimals)}"
    end
  end

  defp vsn(app) do
    case Application.spec(app, :vsn) do
      nil -> "(version unknown)"
      vsn -> to_string(vsn)
    end
  end

  # The library's commit, when its source is a git checkout (this project,
  # or a host's path dependency); `-dirty` when it has uncommitted changes.
  defp commit do
    with git when is_binary(git) <- System.find_executable("git"),
         {out, 0} <-
           System.cmd(git, ["-C", @root, "describe", "--always", "--dirty", "--abbrev=10"],
             stderr_to_stdout: true
           ) do
      String.trim(out)
    else
      _ -> "unknown"
    end
  end

  ## The library side

  # `callers` processes run `op` in a loop: first for the warm-up (the pool
  # opens its connections, each connection prepares its statements), then,
  # all from the same instant, for `duration` seconds, timing each op with
  # :erlang.monotonic_time into a shared histogram. Meanwhile a probe times
  # message round trips on the normal schedulers and a small file read (a
  # dirty-I/O scheduler), and the VM's CPU time is read when the timed part
  # starts and once every caller is done.
  defp run_library(ctx, spec) do
    parent = self()
    hist = Histogram.new()

    pids =
      for k <- 0..(spec.callers - 1) do
        spawn_link(fn ->
          op = spec.op.(k)
          send(parent, {:ready, self()})

          receive do
            {:go, measure_at, end_at} ->
              warm(op, measure_at)
              send(parent, {:done, self(), measure(op, end_at, hist, {0, 0, 0})})
          end
        end)
      end

    for pid <- pids, do: receive(do: ({:ready, ^pid} -> :ok))
    measure_at = :erlang.monotonic_time() + ms(ctx.warmup_ms)
    end_at = measure_at + ms(ctx.duration * 1000)
    probe = spec.callers > 1 && start_probe(ctx, measure_at)
    for pid <- pids, do: send(pid, {:go, measure_at, end_at})
    sleep_until(measure_at)
    cpu_before = CPU.ticks()
    server_before = CPU.server_ticks(ctx.postmaster)
    load_before = ctx[:load] && Load.count(ctx.load)

    {ops, calls, slowest, last} =
      Enum.reduce(pids, {0, 0, 0, measure_at}, fn pid, {o, c, m, t} ->
        receive do
          {:done, ^pid, {{ops, calls, slowest}, last}} ->
            {o + ops, c + calls, max(m, slowest), max(t, last)}
        end
      end)

    cpu_after = CPU.ticks()
    server_after = CPU.server_ticks(ctx.postmaster)
    load_rate = ctx[:load] && Load.rate(load_before, Load.count(ctx.load))
    probe = if probe, do: Probe.stop(probe), else: %{rtt: %{p99: nil}, file_io: nil}
    cpu_call = CPU.per_call_us(cpu_after && cpu_after - cpu_before, calls)

    hist
    |> Histogram.stats(slowest)
    |> Map.merge(%{
      ops: ops / seconds(last - measure_at),
      statements_per_s: calls / seconds(last - measure_at),
      load_rate: load_rate,
      cpu_call: cpu_call,
      cpu_op: cpu_call && cpu_call * calls / ops,
      cpu_server_call: CPU.per_call_us(server_after && server_after - server_before, calls),
      probe: probe.rtt,
      file_io: probe.file_io
    })
  end

  # The probe runs where callers share the VM: at one caller its thousand
  # round trips and file reads a second would be a load of their own on a
  # VM that otherwise waits, one pgbench does not have.
  defp start_probe(ctx, from) do
    file = Path.join(ctx.tmp, "probe")
    File.write!(file, "x")
    Probe.start(interval_ms: 1, from: from, file_io: file)
  end

  defp ms(ms), do: System.convert_time_unit(ms, :millisecond, :native)
  defp us(native), do: System.convert_time_unit(native, :native, :microsecond)
  defp seconds(native), do: System.convert_time_unit(native, :native, :microsecond) / 1.0e6

  defp sleep_until(t) do
    left = System.convert_time_unit(t - :erlang.monotonic_time(), :native, :millisecond)
    if left > 0, do: Process.sleep(left)
  end

  defp warm(op, until) do
    if :erlang.monotonic_time() < until do
      op.()
      warm(op, until)
    end
  end

  # {{ops, calls, the slowest op in µs}, when the last op ended}
  defp measure(op, end_at, hist, {ops, calls, slowest}) do
    t0 = :erlang.monotonic_time()
    n = op.()
    t1 = :erlang.monotonic_time()
    lat = us(t1 - t0)
    Histogram.add(hist, lat)
    acc = {ops + 1, calls + n, max(slowest, lat)}
    if t1 >= end_at, do: {acc, t1}, else: measure(op, end_at, hist, acc)
  end

  ## The pgbench side

  # pgbench runs as the child of a shell whose `times` then reports its
  # CPU time (all its threads'); without bash, no CPU figure.
  defp run_pgbench(ctx, script, clients) do
    dir = Path.join(ctx.tmp, "run#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    File.write!(Path.join(dir, "script.sql"), script)

    args =
      ~w(-M prepared -n -D inited=0 -D ttl=#{@ttl} -D hold=#{@hold} -f script.sql) ++
        ~w(-c #{clients} -j #{clients} -T #{ctx.duration} -l --log-prefix=lat)

    {exe, args} =
      case ctx.shell do
        nil -> {ctx.pgbench, args}
        bash -> {bash, ["-c", ~s("$0" "$@"; status=$?; times; exit $status), ctx.pgbench | args]}
      end

    {out, status} =
      System.cmd(exe, args,
        cd: dir,
        stderr_to_stdout: true,
        env: Psql.env(ctx.options, "phoenix_kit_agent_locks bench pgbench")
      )

    tps =
      case Regex.run(~r/tps = ([\d.]+) \(without initial connection time\)/, out) do
        [_, tps] when status == 0 -> String.to_float(tps)
        _ -> fail("pgbench failed (exit #{status}):\n#{out}\nscript:\n#{script}")
      end

    if out =~ ~r/number of failed transactions: [1-9]/,
      do: fail("pgbench transactions failed:\n#{out}")

    transactions =
      case Regex.run(~r/number of transactions actually processed: (\d+)/, out) do
        [_, n] -> String.to_integer(n)
        nil -> nil
      end

    # client_id transaction_no latency_us script_no epoch_s epoch_us; each
    # client's first transaction also ran the \gset and the PREPAREs.
    hist = Histogram.new()

    slowest =
      for file <- File.ls!(dir),
          String.starts_with?(file, "lat."),
          line <- File.stream!(Path.join(dir, file)),
          [_client, no, us | _] = String.split(line),
          no != "1",
          reduce: 0 do
        slowest ->
          us = String.to_integer(us)
          Histogram.add(hist, us)
          max(slowest, us)
      end

    File.rm_rf!(dir)

    hist
    |> Histogram.stats(slowest)
    |> Map.merge(%{ops: tps, cpu_op: pgbench_cpu_us(out, transactions)})
  end

  # bash's `times`: the shell's own user and system time, then its
  # children's, each as `XmY.YYYs`.
  defp pgbench_cpu_us(_out, n) when n in [nil, 0], do: nil

  defp pgbench_cpu_us(out, transactions) do
    case Regex.scan(~r/^(\d+)m([\d.]+)s (\d+)m([\d.]+)s$/m, out) do
      [_shell, [_, um, us, sm, ss]] ->
        seconds = fn m, s -> String.to_integer(m) * 60 + String.to_float(s) end
        (seconds.(um, us) + seconds.(sm, ss)) * 1.0e6 / transactions

      _ ->
        nil
    end
  end

  ## Statements and transactions per call, from the server's counters

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

  # Each public function @statement_rounds times in a row, on a pool of one
  # connection counted by Bench.StatementCounter (a role of its own, its
  # statements and transaction control in pg_stat_statements).
  defp statements_check(ctx) do
    info("statements per call")
    reset!(ctx)

    case counted_statements(ctx) do
      {:ok, counted} ->
        counted

      {:error, why} ->
        info("  #{why}")
        info("  counting pg_stat_database.xact_commit deltas instead")
        xact_check(ctx)
    end
  end

  defp counted_statements(ctx) do
    with {:ok, counter} <- StatementCounter.open(ctx.options, pool_size: 1) do
      try do
        {:ok, count_statements(counter)}
      rescue
        e in Locks.Error ->
          {:error, "the counter's role cannot run the calls (#{Exception.message(e)})"}
      after
        with {:error, why} <- StatementCounter.close(counter), do: info("  #{why}")
      end
    end
  end

  defp count_statements(counter) do
    steps = statement_steps()
    # Prepare every statement first: a PREPARE is not an execution.
    Enum.each(steps, fn {_, fun} -> fun.() end)

    rows =
      for {name, fun} <- steps do
        case StatementCounter.count(counter, fn -> for _ <- 1..@statement_rounds, do: fun.() end) do
          {:ok, %{statements: s, transaction_control: tc}} -> {name, @statement_rounds, s, tc}
          {:error, why} -> fail(why)
        end
      end

    %{method: :pg_stat_statements, rows: rows}
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
    info("overhead of one held?/3, step by step")
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

    # The steps: a NIF call that does nothing; run/3 refusing its argument
    # (decoding, no slot); a whole call's NIF; the public call.
    rows = [
      {"normal-scheduler NIF, no work (Native.loaded/0)", time.(fn -> Native.loaded() end)},
      {"Native.run/3 that rejects its argument (a dirty-I/O NIF, no slot taken)",
       time.(fn ->
         try do
           Native.run(System.monotonic_time(:nanosecond), :held?, ["not-a-uuid", ub, r])
         rescue
           ArgumentError -> :ok
         end
       end)},
      {"Locks.call/3 of held? (run/3: the slot, pool, statement, reply)",
       time.(fn -> true = Locks.call(:held?, System.monotonic_time(:nanosecond), [cb, ub, r]) end)},
      {"Locks.held?/3 (adds the Elixir argument checks and the span)",
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
    running the same statement texts (read off the wire as the pool sends
    them), latencies from its `-l` log. An op is the unit in the table (two or
    three calls for most workloads). ratio = library ops/s ÷ pgbench ops/s;
    Δp50 = library p50 − pgbench p50. "BEGIN … COMMIT ×2" is the cycle as two
    multi-statement transactions through pgbench (what a caller would
    otherwise run); its row compares the library's cycle with it. CPU: the
    VM's (every BEAM thread's utime + stime from /proc/self/task/*/stat over
    the timed part, #{CPU.hz()} ticks a second) per op and per call, and
    pgbench's own per transaction (an op); the server's is in neither. While
    the library side ran with more than one caller, every millisecond: probe
    p99, the round trip of a message between two processes on normal
    schedulers; file read p99, a 1-byte `File.read/1`, which needs a
    dirty-I/O scheduler as the lock calls do. At one caller no probe runs: it
    would be a load pgbench does not have.
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
        peer_section(ctx, runs) ++
        statements_section(statements) ++ overhead_section(overhead),
      "\n"
    )
  end

  defp pool_size(ctx), do: ctx.options.pool_size

  defp table(cases) do
    head =
      "| workload | callers | op | library ops/s | p50 µs | p99 µs | max µs | CPU µs/op | CPU µs/call " <>
        "| pgbench ops/s | p50 µs | p99 µs | max µs | CPU µs/op | ratio | Δp50 µs | probe p99 µs " <>
        "| file read p99 µs |\n" <>
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n"

    rows =
      Enum.flat_map(cases, fn c ->
        lib = c[:library]
        main = row(c.id, c.callers, c.unit, lib, c[:pgbench], lib)

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

  # `probes`: the library side, whose probes ran (nil on a reference row).
  defp row(id, callers, unit, lib, pg, probes) do
    cells =
      [id, callers, unit] ++
        figures(lib) ++
        [cpu(lib, :cpu_op), cpu(lib, :cpu_call)] ++
        figures(pg) ++
        [cpu(pg, :cpu_op), ratio(lib, pg), delta(lib, pg)] ++
        [fmt(probes && probes.probe.p99), fmt(probes && probes.file_io && probes.file_io.p99)]

    "| " <> Enum.join(cells, " | ") <> " |"
  end

  defp figures(nil), do: ["–", "–", "–", "–"]
  defp figures(s), do: [fmt(s.ops, 0), fmt(s.p50), fmt(s.p99), fmt(s.max)]

  defp cpu(nil, _key), do: "–"
  defp cpu(s, key), do: fmt(s[key], 1)

  defp ratio(%{ops: a}, %{ops: b}) when is_number(a) and is_number(b) and b > 0,
    do: :erlang.float_to_binary(a / b, decimals: 2)

  defp ratio(_, _), do: "–"

  defp delta(%{p50: a}, %{p50: b}) when is_number(a) and is_number(b) do
    d = round(a - b)
    if d > 0, do: "+#{d}", else: "#{d}"
  end

  defp delta(_, _), do: "–"

  @doc false
  def fmt(value, decimals \\ 0)
  def fmt(nil, _), do: "–"
  def fmt(v, 0), do: v |> round() |> Integer.to_string() |> group()
  def fmt(v, d), do: :erlang.float_to_binary(v / 1, decimals: d)

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

      Enum.reduce([:library, :postgrex, :pgbench, :reference], first, fn side, acc ->
        if first[side] do
          sides = Enum.map(cases, & &1[side])

          merged =
            Map.new([:ops, :p50, :p99, :max, :cpu_op, :cpu_call, :cpu_server_call], fn k ->
              {k, med(Enum.map(sides, & &1[k]))}
            end)

          merged =
            if side in [:library, :postgrex],
              do:
                Map.merge(merged, %{
                  probe: %{p99: med(Enum.map(sides, & &1.probe.p99))},
                  file_io: %{p99: med(Enum.map(sides, &(&1.file_io && &1.file_io.p99)))}
                }),
              else: merged

          Map.put(acc, side, merged)
        else
          acc
        end
      end)
    end)
  end

  @doc false
  def med(values) do
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

  # Library ÷ Postgrex, run by run: the median and the range of each ratio,
  # and the targets of issue 20.
  defp peer_section(%{peer: nil}, _runs), do: []
  defp peer_section(_ctx, []), do: []

  defp peer_section(_ctx, runs) do
    per_case = runs |> Enum.zip() |> Enum.map(&Tuple.to_list/1)

    ratios =
      for cases <- per_case do
        c = hd(cases)

        %{
          id: c.id,
          callers: c.callers,
          ops: Enum.map(cases, &(&1.library.ops / &1.postgrex.ops)),
          cpu: Enum.map(cases, &cpu_ratio(&1.library.cpu_call, &1.postgrex.cpu_call)),
          lib_cpu: med(Enum.map(cases, & &1.library.cpu_call)),
          peer_cpu: med(Enum.map(cases, & &1.postgrex.cpu_call)),
          lib_ops: med(Enum.map(cases, & &1.library.ops)),
          peer_ops: med(Enum.map(cases, & &1.postgrex.ops)),
          server:
            Enum.map([:library, :postgrex], fn s ->
              med(Enum.map(cases, & &1[s].cpu_server_call))
            end),
          p50:
            Enum.map([:library, :postgrex, :pgbench], fn s ->
              med(Enum.map(cases, & &1[s].p50))
            end),
          dp50: Enum.map(cases, &(&1.library.p50 - &1.pgbench.p50))
        }
      end

    rows =
      for r <- ratios do
        [lp, pp, gp] = r.p50
        [ls, ps] = r.server

        "| #{r.id} | #{r.callers} | #{fmt(r.lib_ops)} | #{fmt(r.peer_ops)} | #{spread(r.ops)} " <>
          "| #{fmt(r.lib_cpu, 1)} | #{fmt(r.peer_cpu, 1)} | #{spread(r.cpu)} " <>
          "| #{fmt(ls, 1)} / #{fmt(ps, 1)} " <>
          "| #{fmt(lp)} / #{fmt(pp)} / #{fmt(gp)} | #{spread(r.dp50, 0)} |"
      end

    find = fn id, n -> Enum.find(ratios, &(&1.id == id and &1.callers == n)) end

    targets =
      for {id, n} <- [{"cycle", 10}, {"cycle", 50}, {"reads", 10}, {"reads", 50}],
          r = find.(id, n),
          {ok, text} <- [
            {med(r.ops) >= 1.3,
             "#{id} ×#{n} throughput ≥ 1.3× Postgrex's: #{fmt(med(r.ops), 2)}"},
            {med(r.cpu) && med(r.cpu) <= 0.6,
             "#{id} ×#{n} VM CPU per statement ≤ 0.6× Postgrex's: #{fmt(med(r.cpu), 2)}"}
          ],
          do: "| #{text} | #{if ok, do: "met", else: "**missed**"} |"

    p50_target =
      case find.("cycle", 1) do
        nil ->
          []

        r ->
          d = med(r.dp50)

          [
            "| cycle ×1 p50 within 20 µs of pgbench: #{fmt(d)} µs | #{if d <= 20, do: "met", else: "**missed**"} |"
          ]
      end

    [
      """
      ## Against Postgrex

      The same statements through Postgrex (statements prepared once,
      `Postgrex.execute/4` from the same N processes, a pool of the same size),
      timed as the library is, in the same runs. Ratios are library ÷ Postgrex,
      run by run: the median, then the range over #{length(runs)} run(s). CPU is
      the VM's per statement (every BEAM thread's utime + stime); the server's
      (its postmaster's and every child's, when it runs on this machine) is
      apart. p50 is of an op.

      | workload | callers | library ops/s | Postgrex ops/s | throughput ratio | library CPU µs/statement | Postgrex CPU µs/statement | CPU ratio | server CPU µs/statement library / Postgrex | p50 µs library / Postgrex / pgbench | Δp50 library − pgbench µs |
      |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|
      #{Enum.join(rows, "\n")}

      | target (issue 20, medians) | |
      |---|---|
      #{Enum.join(targets ++ p50_target, "\n")}
      """
    ]
  end

  defp cpu_ratio(a, b) when is_number(a) and is_number(b) and b > 0, do: a / b
  defp cpu_ratio(_, _), do: nil

  @doc false
  # "median (min–max)" of a list of figures.
  def spread(values, decimals \\ 2) do
    case Enum.reject(values, &is_nil/1) do
      [] ->
        "–"

      [one] ->
        fmt(one, decimals)

      vs ->
        "#{fmt(med(vs), decimals)} (#{fmt(Enum.min(vs), decimals)}–#{fmt(Enum.max(vs), decimals)})"
    end
  end

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
    case Psql.query(ctx.options, commands) do
      {:ok, rows} -> rows
      {:error, why} -> fail(why)
    end
  end

  @doc false
  def loadavg do
    case File.read("/proc/loadavg") do
      {:ok, text} -> text |> String.split() |> Enum.take(3) |> Enum.join(" ")
      _ -> "?"
    end
  end

  defp info(text), do: IO.puts(:stderr, "locks.bench: " <> text)
end
