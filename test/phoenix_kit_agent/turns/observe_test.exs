defmodule PhoenixKitAgent.Turns.ObserveTest do
  # What an operator sees: held_locks/1 (and `mix locks.held`), status/0,
  # and the :telemetry events (test/support/telemetry.ex stands in for the
  # library). On a database of its own, so the listing holds this module's
  # locks only; async: false, so the counters move by this module's calls.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{AppEnv, Error, Observe, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.Pg

  @ttl 60

  setup do
    AppEnv.restore_on_exit()
    {_db, url} = Pg.create_database!("observe")
    :ok = AppEnv.restart(url: url, pool_size: 3)
    :telemetry.attach()
    on_exit(fn -> :telemetry.detach() end)
    %{url: url}
  end

  describe "held_locks/1" do
    test "lists every lock taken, the oldest first, with its holder, age and staleness", %{
      url: url
    } do
      assert Locks.held_locks(@ttl) == []

      {chat, user, other_user, click} =
        {TestDB.insert_chat!(url), TestDB.uuid(), TestDB.uuid(), Locks.click_ref()}

      :ok = Locks.acquire(chat, user, "turn-1", @ttl)
      :ok = Locks.acquire_user(other_user, click, @ttl, @ttl)
      TestDB.backdate!([chat: chat], @ttl + 5, url)
      before = DateTime.utc_now()

      assert [
               %{kind: :chat, uuid: ^chat, ref: "turn-1", stale: true} = stale_chat,
               %{kind: :user, uuid: ^user, ref: "turn-1", stale: false} = turn_user,
               %{kind: :user, uuid: ^other_user, ref: ^click, stale: false} = click_user
             ] = Enum.sort_by(Locks.held_locks(@ttl), &{-&1.age_s, &1.kind})

      assert stale_chat.age_s >= @ttl + 5 and stale_chat.age_s < @ttl + 15
      assert turn_user.age_s >= 0 and turn_user.age_s < 10
      assert DateTime.diff(before, turn_user.since, :second) in 0..10
      assert DateTime.diff(before, stale_chat.since, :second) in (@ttl + 5)..(@ttl + 15)
      assert click_user.age_s < 10

      # The same locks under a longer TTL are not stale; once released, gone.
      assert Enum.map(Locks.held_locks(@ttl + 20), & &1.stale) == [false, false, false]
      :ok = Locks.release(chat, user, "turn-1")
      assert [%{uuid: ^other_user}] = Locks.held_locks(@ttl)
    end

    test "mix locks.held prints them as a table", %{url: url} do
      {chat, user} = {TestDB.insert_chat!(url), TestDB.uuid()}
      :ok = Locks.acquire(chat, user, "turn-table", @ttl)
      Mix.shell(Mix.Shell.Process)
      on_exit(fn -> Mix.shell(Mix.Shell.IO) end)

      Mix.Tasks.Locks.Held.run(["--ttl", "60"])
      assert_received {:mix_shell, :info, [table]}

      assert [
               ["kind", "uuid", "ref", "since", "(UTC)", "age", "stale"],
               ["chat", ^chat, "turn-table", _since, _age, "s"],
               ["user", ^user, "turn-table", _, _, "s"]
             ] = table |> String.split("\n") |> Enum.map(&String.split/1) |> sort_rows()
    end
  end

  defp sort_rows([header | rows]), do: [header | Enum.sort(rows)]

  describe "status/0" do
    test "counts the calls of each function by outcome, and their latency", %{url: url} do
      {chat, user} = {TestDB.insert_chat!(url), TestDB.uuid()}
      before = Locks.status()
      :ok = Locks.acquire(chat, user, "turn-1", @ttl)
      {:error, :conversation_busy} = Locks.acquire(chat, TestDB.uuid(), "turn-2", @ttl)
      true = Locks.held?(chat, user, "turn-1")
      true = Locks.keep(chat, user, "turn-1", @ttl, @ttl)
      false = Locks.keep(chat, user, "turn-2", @ttl, @ttl)
      false = Locks.keep(chat, user, "turn-3", @ttl, @ttl)
      after_ = Locks.status()

      delta = fn function, outcome ->
        get_in(after_, [:calls, function, outcome]) -
          (get_in(before, [:calls, function, outcome]) || 0)
      end

      assert {delta.(:acquire, :ok), delta.(:acquire, :conversation_busy), delta.(:held?, true)} ==
               {1, 1, 1}

      # A boolean answer is counted by its value: a keep/5 that lost its lease shows.
      assert {delta.(:keep, true), delta.(:keep, false)} == {1, 2}
      assert get_in(after_, [:calls, :keep, :ok]) == nil

      assert %{calls: calls, p50_us: p50, p99_us: p99, max_us: max} = after_.latency.acquire
      assert calls == Enum.sum(Map.values(after_.calls.acquire))
      assert p50 <= p99 and p99 <= max and max < 60_000_000

      assert %{size: 3, running: 0, waiting: 0, connections: connections, idle: idle} =
               after_.pool

      assert connections in 1..3 and idle <= connections
    end

    test "counts :row_locked as its own reason, as every reason of Locks.Error", %{url: url} do
      {chat, user} = {TestDB.insert_chat!(url), TestDB.uuid()}
      :ok = Locks.acquire(chat, user, "turn-held", @ttl)
      before = get_in(Locks.status(), [:calls, :release, :row_locked]) || 0
      psql = TestDB.session!(url)
      TestDB.query!("BEGIN", psql)

      TestDB.query!(
        "SELECT 1 FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}' FOR UPDATE",
        psql
      )

      assert %Error{reason: :row_locked} = catch_error(Locks.release(chat, user, "turn-held"))
      TestDB.close(psql)
      assert get_in(Locks.status(), [:calls, :release, :row_locked]) == before + 1
      assert :ok = Locks.release(chat, user, "turn-held")
    end

    test "counts an error by its reason" do
      before = get_in(Locks.status(), [:calls, :held?, :not_started]) || 0
      :ok = AppEnv.stop()
      assert_raise Error, fn -> Locks.held?(TestDB.uuid(), TestDB.uuid(), "t") end
      assert_raise Error, fn -> Locks.status() end
      {:ok, _} = Application.ensure_all_started(:phoenix_kit_agent_locks)
      assert get_in(Locks.status(), [:calls, :held?, :not_started]) == before + 1
    end
  end

  describe "telemetry" do
    # The next span of `function` received: its :start and :stop (or
    # :exception) metadata, after checking what :telemetry.span/3 would: the
    # measurements, and one span context in both.
    defp span!(function, ending \\ :stop) do
      assert_received {:telemetry, [:phoenix_kit_agent_locks, ^function, :start],
                       %{monotonic_time: t0, system_time: system}, start}

      assert_received {:telemetry, [:phoenix_kit_agent_locks, ^function, ^ending],
                       %{duration: duration, monotonic_time: t1}, stop}

      assert is_integer(system) and duration > 0 and t1 - t0 >= duration
      assert %{telemetry_span_context: context} = start
      assert is_reference(context) and stop.telemetry_span_context == context
      {Map.delete(start, :telemetry_span_context), Map.delete(stop, :telemetry_span_context)}
    end

    test "each call is a span: :start carries the function and its arguments as passed, :stop " <>
           "the same and the exact result",
         %{url: url} do
      {chat, user, click} = {TestDB.insert_chat!(url), TestDB.uuid(), Locks.click_ref()}
      # As the caller passed them: an upper-case uuid stays so.
      chat_arg = String.upcase(chat)
      turn = %{conversation_uuid: chat_arg, user_uuid: user, turn_ref: "turn-1"}
      other = %{turn | user_uuid: TestDB.uuid(), turn_ref: "turn-2"}

      calls = [
        {:acquire, Map.put(turn, :ttl_s, @ttl), :ok},
        {:acquire, Map.put(other, :ttl_s, @ttl), {:error, :conversation_busy}},
        {:fresh?, %{conversation_uuid: chat_arg, turn_ref: "turn-2", ttl_s: @ttl}, false},
        {:held?, turn, true},
        {:keep, Map.merge(turn, %{ttl_s: @ttl, lease_s: 10}), true},
        {:keep, Map.merge(other, %{ttl_s: @ttl, lease_s: 10}), false},
        {:release_stale, Map.put(turn, :ttl_s, @ttl), false},
        {:release, turn, :ok},
        {:acquire_user, %{user_uuid: user, ref: click, ttl_s: @ttl, hold_s: 10}, :ok},
        {:keep_user, %{user_uuid: user, ref: click, ttl_s: @ttl, hold_s: 10}, true},
        {:release_user, %{user_uuid: user, ref: click}, :ok}
      ]

      for {function, arguments, result} <- calls do
        args = Enum.map(arguments_of(function), &Map.fetch!(arguments, &1))
        assert apply(Locks, function, args) == result
        start = Map.put(arguments, :function, function)
        assert span!(function) == {start, Map.put(start, :result, result)}
      end

      :ok = Locks.acquire(chat, user, "turn-3", @ttl)
      [%{kind: :chat}, %{kind: :user}] = held = Locks.held_locks(@ttl)
      _ = span!(:acquire)
      start = %{function: :held_locks, ttl_s: @ttl}
      assert span!(:held_locks) == {start, Map.put(start, :result, held)}
    end

    test "a call that fails is a span ending in :exception: the start metadata, and the kind, " <>
           "the exception and its stacktrace" do
      :ok = AppEnv.stop()
      {chat, user} = {TestDB.uuid(), TestDB.uuid()}
      error = assert_raise Error, fn -> Locks.held?(chat, user, "t") end
      start = %{function: :held?, conversation_uuid: chat, user_uuid: user, turn_ref: "t"}

      assert {^start, %{stacktrace: [_ | _] = stacktrace} = exception} = span!(:held?, :exception)

      assert exception ==
               Map.merge(start, %{kind: :error, reason: error, stacktrace: stacktrace})

      assert %Error{reason: :not_started} = error
      {:ok, _} = Application.ensure_all_started(:phoenix_kit_agent_locks)
    end

    test "a bad argument raises before the span starts" do
      assert_raise ArgumentError, fn -> Locks.held?("x", TestDB.uuid(), "t") end
      refute_received {:telemetry, _, _, _}
    end

    test "without :telemetry, nothing is emitted and the calls answer the same", %{url: url} do
      :persistent_term.put({Observe, :telemetry}, false)
      on_exit(fn -> Observe.setup() end)
      {chat, user} = {TestDB.insert_chat!(url), TestDB.uuid()}

      assert Locks.acquire(chat, user, "turn-1", @ttl) == :ok
      refute_received {:telemetry, _, _, _}
    end
  end

  # The public function's argument names, in order: the keys of its metadata.
  defp arguments_of(function) do
    %{
      acquire: [:conversation_uuid, :user_uuid, :turn_ref, :ttl_s],
      fresh?: [:conversation_uuid, :turn_ref, :ttl_s],
      held?: [:conversation_uuid, :user_uuid, :turn_ref],
      keep: [:conversation_uuid, :user_uuid, :turn_ref, :ttl_s, :lease_s],
      release_stale: [:conversation_uuid, :user_uuid, :turn_ref, :ttl_s],
      release: [:conversation_uuid, :user_uuid, :turn_ref],
      acquire_user: [:user_uuid, :ref, :ttl_s, :hold_s],
      keep_user: [:user_uuid, :ref, :ttl_s, :hold_s],
      release_user: [:user_uuid, :ref]
    }[function]
  end
end
