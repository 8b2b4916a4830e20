defmodule PhoenixKitAgent.Turns.Locks.Robust.Scenarios do
  @moduledoc false
  # Functions the robustness tests run inside a child node (Robust.Node):
  # test modules are compiled in the test VM only, support modules are in
  # the build's ebin that the child loads.

  alias PhoenixKitAgent.Turns.Locks

  @doc "A running turn: checks its locks round after round, until it is not held or killed."
  def run_turn(chat, user, turn) do
    if Locks.held?(chat, user, turn), do: run_turn(chat, user, turn), else: :lost
  end

  @doc "What a failed call of Locks looks like when formatted with its stacktrace, as a log would."
  def formatted_failure(fun, args) do
    apply(Locks, fun, args)
    :no_failure
  rescue
    e -> Exception.format(:error, e, __STACKTRACE__)
  end

  @doc "`n` calls of `fun` one after another: `{microseconds in all, distinct answers}`."
  def sequential(fun, args, n) do
    {us, answers} =
      :timer.tc(fn ->
        for _ <- 1..n, do: PhoenixKitAgent.Turns.Locks.Robust.Race.attempt(fun, args)
      end)

    {us, Enum.uniq(answers)}
  end
end

defmodule PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Faults do
  @moduledoc false
  # A load of lock calls in a child node while the test breaks the database
  # under it, with a probe of the normal schedulers and bystander processes.
  #
  # `run/1` starts `workers` processes, each calling the library in a loop
  # on a chat of its own (acquire, held?, fresh?, release) and recording
  # `{started_ms, ended_ms, answer}` for every call (monotonic, this node's);
  # once `warm` calls have succeeded it runs `fault` (a command, e.g.
  # `pg_ctl stop -m immediate`), keeps the load going for `after_ms`, stops
  # it and returns everything the test asserts on.

  alias PhoenixKitAgent.Turns.Locks.Robust.Probe
  alias PhoenixKitAgent.Turns.Locks.Robust.Race

  def run(%{chats: chats, users: users, fault: fault, warm: warm, after_ms: after_ms}) do
    successes = :counters.new(1, [])
    probe = start_probe()
    bystanders = for _ <- 1..5, do: spawn(fn -> receive do: (:never -> :ok) end)

    workers =
      for {{chat, user}, w} <- Enum.with_index(Enum.zip(chats, users)) do
        spawn(fn -> work(chat, user, "load-#{w}", successes, 0, []) end)
      end

    :ok = until(fn -> :counters.get(successes, 1) >= warm end, 60_000)

    t0 = now()
    {fault_output, fault_status} = PhoenixKitAgent.Turns.Locks.Robust.Pg.run(fault)
    t1 = now()

    # The load runs on against the broken database for `after_ms`.
    receive do
    after
      after_ms -> :ok
    end

    records =
      Enum.flat_map(workers, fn pid ->
        ref = Process.monitor(pid)
        send(pid, {:stop, self()})

        receive do
          {:records, ^pid, records} -> records
          {:DOWN, ^ref, _, _, reason} -> [{:worker_crashed, reason}]
        end
      end)

    %{
      records: records,
      fault: {t0, t1, fault_status, fault_output},
      probe_max_ms: stop_probe(probe),
      bystanders_alive: Enum.all?(bystanders, &Process.alive?/1)
    }
  end

  defp work(chat, user, turn, successes, n, acc) do
    receive do
      {:stop, from} -> send(from, {:records, self(), acc})
    after
      0 ->
        {fun, args} =
          case rem(n, 4) do
            0 -> {:acquire, [chat, user, turn, 3600]}
            1 -> {:held?, [chat, user, turn]}
            2 -> {:fresh?, [chat, turn, 3600]}
            3 -> {:release, [chat, user, turn]}
          end

        started = now()
        answer = Race.attempt(fun, args)
        record = {started, now(), fun, answer}
        if match?({:ok, _}, answer), do: :counters.add(successes, 1, 1)
        work(chat, user, turn, successes, n + 1, [record | acc])
    end
  end

  @doc "Calls `fun` until it returns true, for at most `ms` (polling a real event)."
  def until(fun, ms) do
    deadline = now() + ms

    Stream.repeatedly(fn ->
      cond do
        fun.() -> :ok
        now() > deadline -> :timeout
        true -> receive(do: (:never -> :ok), after: (10 -> nil))
      end
    end)
    |> Enum.find(& &1)
  end

  @doc "Runs `calls` (`{fun, args}` of Locks) at once in this node: `[{answer, ms}]`, in order."
  def timed_many(calls) do
    me = self()

    for {{fun, args}, i} <- Enum.with_index(calls) do
      spawn(fn ->
        started = now()
        answer = Race.attempt(fun, args)
        send(me, {:timed, i, {answer, now() - started}})
      end)
    end

    for i <- 0..(length(calls) - 1)//1 do
      receive do
        {:timed, ^i, result} -> result
      end
    end
  end

  @doc """
  Starts the probe of the normal schedulers (Robust.Probe): every 5 ms, a
  message round trip to another process. `stop_probe/1` gives the longest
  delay in ms, a round trip or a wake-up later than asked: how long the
  normal schedulers were unavailable.
  """
  def start_probe, do: Probe.start(interval_ms: 5)

  def stop_probe(probe), do: Probe.stop(probe).worst / 1000

  defp now, do: System.monotonic_time(:millisecond)
end

defmodule PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Clocks do
  @moduledoc false
  # One scenario of TTL boundaries, run by a child node against a database
  # of its own (a `busy_since` column type, a server TimeZone) with the
  # node's own TZ set far off. It returns what happened as a list of
  # `{step, outcome}`: the test runs it on every variant and compares the
  # lists, which must be identical and equal to the expected one.
  #
  # The SQL side (backdating, reading ages) goes through a psql session
  # pinned to UTC, so that `extract(epoch FROM busy_since)` is the same
  # instant for both column types when the library stores UTC.

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.TestDB

  def run(url) do
    psql = TestDB.session!(url)
    [chat, chat2, chat3, chat4] = for _ <- 1..4, do: insert_chat(psql)
    [user, user2, user3, user4, user5] = for _ <- 1..5, do: TestDB.uuid()
    back = fn kind, id, s -> TestDB.backdate!([{kind, id}], s, psql) end
    age = fn kind, id, expected -> age(psql, kind, id, expected) end

    steps = [
      # The stored busy_since is the database's now() as UTC, for either type.
      {:stored_since,
       fn -> stored_since(psql, fn -> Locks.acquire(chat, user, "t1", 60) end, chat, user) end},
      {:second_turn_same_chat, fn -> Locks.acquire(chat, user2, "t2", 60) end},
      # 50 s old: ten seconds short of the TTL (a time zone error is hours).
      {:backdated_50_s_still_busy,
       fn ->
         back.(:chat, chat, 50)
         back.(:user, user, 50)

         {Locks.acquire(chat, user2, "t2", 60), Locks.fresh?(chat, "t1", 60),
          Locks.release_stale(chat, user, "t1", 60)}
       end},
      {:age_seen_by_the_db, fn -> age.(:chat, chat, 50) end},
      {:backdated_61_s_taken_over,
       fn ->
         back.(:chat, chat, 11)
         back.(:user, user, 11)
         {Locks.fresh?(chat, "t1", 60), Locks.acquire(chat, user2, "t3", 60)}
       end},
      {:after_take_over,
       fn ->
         {Locks.held?(chat, user, "t1"), Locks.held?(chat, user2, "t3"),
          Locks.release(chat, user, "t1"), Locks.held?(chat, user2, "t3")}
       end},
      {:stale_cleanup,
       fn ->
         back.(:chat, chat, 61)
         back.(:user, user2, 61)

         {Locks.release_stale(chat, user2, "t3", 60), Locks.release_stale(chat, user2, "t3", 60),
          lock(psql, :chat, chat), lock(psql, :user, user2)}
       end},
      {:click_dated_back_by_ttl_minus_hold,
       fn -> {Locks.acquire_user(user3, Locks.click_ref(), 60, 10), age.(:user, user3, 50)} end},
      {:turn_refused_by_the_click, fn -> Locks.acquire(chat2, user3, "t4", 60) end},
      {:turn_takes_over_after_hold,
       fn ->
         back.(:user, user3, 11)
         Locks.acquire(chat2, user3, "t4", 60)
       end},
      {:keep_user_redates,
       fn ->
         click = Locks.click_ref()
         :ok = Locks.acquire_user(user4, click, 60, 10)
         back.(:user, user4, 30)

         {Locks.keep_user(user4, click, 60, 10), age.(:user, user4, 50),
          Locks.acquire(chat3, user4, "t5", 60)}
       end},
      {:host_wrote_a_lock_30_s_ago,
       fn ->
         # As a host would (Ecto :utc_datetime): UTC, 30 s before the DB's now.
         TestDB.query!(
           """
           UPDATE phoenix_kit_agent_conversations
           SET busy_turn_ref = 'host', busy_since = now() - interval '30 s' WHERE uuid = '#{chat4}'
           """,
           psql
         )

         {Locks.fresh?(chat4, "host", 60), Locks.fresh?(chat4, "host", 20),
          Locks.acquire(chat4, user5, "t6", 60), Locks.acquire(chat4, user5, "t7", 20)}
       end}
    ]

    outcomes = for {name, step} <- steps, do: {name, step.()}
    TestDB.close(psql)
    %{outcomes: outcomes, node_utc_offset_s: node_utc_offset_s(), db_timezone: db_timezone(url)}
  end

  defp insert_chat(psql) do
    id = TestDB.uuid()
    TestDB.query!("INSERT INTO phoenix_kit_agent_conversations (uuid) VALUES ('#{id}')", psql)
    id
  end

  # Whole seconds between the DB's now() and busy_since, both read as UTC
  # instants: `{:about, expected}` when within 3 s above `expected` (the
  # scenario's own run time), else the age itself.
  defp age(psql, kind, id, expected) do
    {table, key} = TestDB.table(kind)

    age =
      """
      SELECT floor(extract(epoch FROM now()) - extract(epoch FROM busy_since))::int
      FROM #{table} WHERE #{key} = '#{id}'
      """
      |> TestDB.value!(psql)
      |> String.to_integer()

    if age in expected..(expected + 3), do: {:about, expected}, else: {:age, age}
  end

  defp lock(psql, kind, id) do
    {table, key} = TestDB.table(kind)

    [row] =
      TestDB.query!("SELECT busy_turn_ref, busy_since FROM #{table} WHERE #{key} = '#{id}'", psql)

    row
  end

  # busy_since (read as a UTC instant) lies between the DB's clock read just
  # before and just after the call: it is the DB's now(), not shifted by a
  # time zone (a shift would be hours off).
  defp stored_since(psql, call, chat, user) do
    clock = fn ->
      "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
      |> TestDB.value!(psql)
      |> String.to_integer()
    end

    before = clock.()
    answer = call.()
    after_ = clock.()

    since = fn {table, key}, id ->
      "SELECT (extract(epoch FROM busy_since) * 1000000)::bigint FROM #{table} WHERE #{key} = '#{id}'"
      |> TestDB.value!(psql)
      |> String.to_integer()
    end

    verdict = fn us ->
      if us >= before and us <= after_,
        do: :db_now_utc,
        else: {:off_by_s, div(us - before, 1_000_000)}
    end

    {answer, verdict.(since.(TestDB.table(:chat), chat)),
     verdict.(since.(TestDB.table(:user), user))}
  end

  defp node_utc_offset_s do
    utc = :calendar.universal_time()
    local = :calendar.universal_time_to_local_time(utc)
    :calendar.datetime_to_gregorian_seconds(local) - :calendar.datetime_to_gregorian_seconds(utc)
  end

  # The database's own TimeZone (what a connection gets when its client
  # asks for none: TestDB's psql asks for UTC), and the column's type.
  defp db_timezone(url) do
    [[tz, type]] =
      TestDB.query!(
        """
        SELECT (SELECT split_part(c, '=', 2)
                FROM pg_db_role_setting, unnest(setconfig) AS c
                WHERE setrole = 0 AND c ILIKE 'timezone=%'
                  AND setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())),
               (SELECT data_type FROM information_schema.columns
                WHERE table_name = 'phoenix_kit_agent_conversations' AND column_name = 'busy_since')
        """,
        url
      )

    {tz, type}
  end
end

defmodule PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Queue do
  @moduledoc false
  # Callers in the queue's line, in a child node: `start/1` starts each call
  # in a process of its own, one after the other, and returns once the first
  # runs its NIF call and every other one waits in line, in the order given
  # (so the test knows the order the slots are handed in); `answers/1`
  # collects, for each, `{answer, mailbox}`: `Race.attempt/2`'s value and
  # what was left in the caller's mailbox; `runs/0` counts the NIF calls of each kind.
  # Any caller can be killed (`kill/1`): its answer is then `:killed`. `hold_slot/0` waits in line for a slot (with `Native.run/3`,
  # which puts a caller that finds none in line too), and never starts one it is handed.

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.Robust.Race
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Faults

  def start([first | queued]) do
    collector = self_collector()
    # Counts the NIF calls from here on, in any process (`runs/0`).
    for nif <- [:enter, :run],
        do: 1 = :erlang.trace_pattern({Locks.Native, nif, 3}, true, [:call_count])

    first = call(collector, 0, first)
    # Its statement sent: it runs on a dirty-I/O scheduler, not just holds a slot.
    running = {:current_function, {Locks.Native, :run, 3}}
    :ok = Faults.until(fn -> Process.info(first, :current_function) == running end, 10_000)

    for {call, i} <- Enum.with_index(queued, 1) do
      call(collector, i, call)
      :ok = Faults.until(fn -> Locks.status().pool.waiting == i end, 10_000)
    end

    :ok
  end

  @doc "How many times `Native.enter/3` and `Native.run/3` were called since `start/1`."
  def runs do
    Map.new([:enter, :run], fn nif ->
      {:call_count, n} = :erlang.trace_info({Locks.Native, nif, 3}, :call_count)
      {nif, n}
    end)
  end

  @doc "Stops and starts the application while the callers `is` are suspended, then resumes them."
  def restart_suspended(is) do
    pids = Enum.map(is, &Process.whereis(name(&1)))
    Enum.each(pids, &(true = :erlang.suspend_process(&1)))
    :ok = Application.stop(:phoenix_kit_agent_locks)
    {:ok, _} = Application.ensure_all_started(:phoenix_kit_agent_locks)
    Enum.each(pids, &(true = :erlang.resume_process(&1)))
  end

  def kill(i) do
    Process.exit(Process.whereis(name(i)), :kill)
    send(__MODULE__, {:answer, i, {:killed, []}})
    :ok
  end

  # A call stamped far in the future (by `Locks.call/3` itself), while the
  # slots are held: what it raised, and what is left in this mailbox.
  def future_call do
    raised =
      try do
        stamp = System.monotonic_time(:nanosecond) + 10 ** 17
        Locks.call(:held?, stamp, [<<1::128>>, <<2::128>>, "f"])
      rescue
        e -> e
      end

    {raised, Process.info(self(), :messages)}
  end

  def hold_slot,
    do: park(fn stamp -> {:wait, _ms} = Locks.Native.run(stamp, :held?, held_args()) end)

  defp held_args, do: [<<1::128>>, <<2::128>>, "parked"]

  # A process that makes the first NIF call of a lock call (`first`, given a
  # fresh stamp) and never the next: its pid, once that call has answered.
  defp park(first) do
    me = self()

    pid =
      spawn(fn ->
        first.(System.monotonic_time(:nanosecond))
        send(me, {:parked, self()})
        Process.sleep(:infinity)
      end)

    receive do
      {:parked, ^pid} -> pid
    end
  end

  @doc "Waits (10 s at most) until `Locks.status().pool[key]`, or the answers collected, number `n`."
  def until(:answered, n), do: Faults.until(fn -> answered() == n end, 10_000)
  def until(key, n), do: Faults.until(fn -> Locks.status().pool[key] == n end, 10_000)

  def answered do
    send(__MODULE__, {:count, self()})

    receive do
      {:count, n} -> n
    end
  end

  def answers(n) do
    send(__MODULE__, {:answers, self(), n})

    receive do
      {:answers, answers} -> answers
    after
      60_000 -> :no_answers
    end
  end

  # A registered process that outlives the node call which started it.
  defp self_collector do
    pid = spawn(fn -> collect(%{}, nil) end)
    Process.register(pid, __MODULE__)
    pid
  end

  defp collect(answers, {from, n}) when map_size(answers) == n,
    do: send(from, {:answers, for(i <- 0..(n - 1), do: answers[i])})

  defp collect(answers, asker) do
    receive do
      {:answer, i, answer} -> collect(Map.put(answers, i, answer), asker)
      {:answers, from, n} -> collect(answers, {from, n})
      {:count, from} -> send(from, {:count, map_size(answers)}) && collect(answers, asker)
    end
  end

  # From now on, records whether caller `i` calls `Native.function` (`:leave`:
  # its checkout deadline passed; `:run`: it ran its own call);
  # `until_called/0` waits (10 s at most) until it has, `called?/0` tells.
  def watch_call(i, function) do
    watcher = spawn(fn -> call_watch(false) end)
    Process.register(watcher, Module.concat(__MODULE__, CallWatch))
    :erlang.trace_pattern({Locks.Native, function, :_}, true, [:global])
    1 = :erlang.trace(Process.whereis(name(i)), true, [:call, {:tracer, watcher}])
    :ok
  end

  defp call_watch(called) do
    receive do
      {:trace, _, :call, {Locks.Native, _, _}} -> call_watch(true)
      {:called?, from} -> send(from, {:called?, called}) && call_watch(called)
    end
  end

  def called? do
    send(Module.concat(__MODULE__, CallWatch), {:called?, self()})
    receive do: ({:called?, called} -> called)
  end

  def until_called, do: Faults.until(&called?/0, 10_000)

  defp name(i), do: Module.concat(__MODULE__, "Caller#{i}")

  defp call(collector, i, {fun, args}) do
    spawn(fn ->
      Process.register(self(), name(i))
      answer = Race.attempt(fun, args)
      {:messages, left} = Process.info(self(), :messages)
      send(collector, {:answer, i, {answer, left}})
    end)
  end
end
