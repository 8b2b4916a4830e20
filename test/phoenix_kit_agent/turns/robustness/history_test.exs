defmodule PhoenixKitAgent.Turns.Robustness.HistoryTest do
  # A history checker (Robust.History): random calls by many processes, every
  # change of a lock logged by a trigger with the database's time, and the
  # guarantees checked afterwards against what each caller was answered.
  # Plus the ShedLock-style counter: increments done only under the chat's
  # lock lose no update.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.TestDB
  alias PhoenixKitAgent.Turns.Locks.Robust.{History, Node}

  @moduletag :robustness

  defp random_name(prefix),
    do: prefix <> Integer.to_string(:erlang.unique_integer([:positive])) <> "_" <> hex(4)

  defp hex(n), do: Base.encode16(:crypto.strong_rand_bytes(n), case: :lower)

  describe "a random history over 5 chats and 5 users with TTLs of 1-2 s" do
    setup do
      # A schema of this test's own: the trigger never sits on the shared tables.
      schema = random_name("robust_hist_")
      chats = for _ <- 1..5, do: TestDB.uuid()
      users = for _ <- 1..5, do: TestDB.uuid()
      psql = TestDB.session!(TestDB.url())
      TestDB.query!(History.setup_sql(schema, chats), psql)
      on_exit(fn -> TestDB.query!("DROP SCHEMA IF EXISTS #{schema} CASCADE", TestDB.url()) end)
      %{schema: schema, chats: chats, users: users, psql: psql}
    end

    @tag :slow
    test "no lock is ever held by two refs but through a TTL take-over, and every answer " <>
           "(held?, fresh?, keep_user, release_stale) matches the history",
         %{schema: schema, chats: chats, users: users, psql: psql} do
      node = Node.start!(app_env: [url: TestDB.url(), prefix: schema, pool_size: 10])
      assert {_pid, {:ok, _}} = Node.hello(node)

      workload = %{chats: chats, users: users, workers: 12, ms: 8_000, seed: 20_240_601}
      records = Node.call(node, History, :workload, [workload])
      events = History.history_sql(schema) |> TestDB.query!(psql) |> History.events()

      violations = History.check(records, events)

      assert violations == [],
             "#{length(violations)} violations, the first ones:\n" <>
               Enum.map_join(Enum.take(violations, 5), "\n", &inspect(&1, limit: 20))

      # The run exercised what it checks: take-overs happened by themselves,
      # held? and release_stale/4 answered both ways, clicks got in.
      answers = Enum.frequencies(for {op, _, _, _, {:ok, a}} <- records, do: {op, a})
      seen = &Map.get(answers, &1, 0)
      assert History.take_over_count(events) > 0

      for answer <- [
            {:acquire, :ok},
            {:acquire, {:error, :conversation_busy}},
            {:acquire, {:error, :turn_in_flight}},
            {:acquire, {:error, :click_in_flight}},
            {:acquire_user, :ok},
            {:held?, true},
            {:held?, false},
            {:fresh?, true},
            {:fresh?, false},
            {:release_stale, true},
            {:release_stale, false},
            {:keep_user, true}
          ] do
        assert seen.(answer) > 0, "never answered #{inspect(answer)}: #{inspect(answers)}"
      end
    end
  end

  describe "the checker itself" do
    # Synthetic histories with one broken guarantee each: the checker must
    # name it, or a passing history test would prove nothing.
    @chat "00000000-0000-4000-8000-000000000001"
    @user "00000000-0000-4000-8000-000000000002"
    @user_b "00000000-0000-4000-8000-000000000003"
    @s 1_000_000

    defp ev(kind, key, old_ref, new_ref, old_since, new_since, ts, txid) do
      %{
        kind: kind,
        key: key,
        old_ref: old_ref,
        new_ref: new_ref,
        old_since: old_since,
        new_since: new_since,
        now: ts,
        ts: ts,
        txid: txid
      }
    end

    defp acquired(chat, user, ref, ttl, at),
      do: {:acquire, {chat, user, ref, ttl}, at - 5, at + 5, {:ok, :ok}}

    # Turn "a" takes both locks at 10 s (TTL 60); turn "b" of another user
    # takes the chat over at `b_at`.
    defp base(b_at) do
      events = [
        ev(:chat, @chat, nil, nil, nil, nil, 0, 1),
        ev(:chat, @chat, nil, "a", nil, 10 * @s, 10 * @s, 2),
        ev(:user, @user, nil, "a", nil, 10 * @s, 10 * @s, 2),
        ev(:chat, @chat, "a", "b", 10 * @s, b_at, b_at, 3),
        ev(:user, @user_b, nil, "b", nil, b_at, b_at, 3)
      ]

      {[acquired(@chat, @user, "a", 60, 10 * @s), acquired(@chat, @user_b, "b", 60, b_at)],
       events}
    end

    test "passes a history with a take-over after the TTL" do
      {records, events} = base(71 * @s)
      held = {:held?, {@chat, @user_b, "b"}, 72 * @s, 72 * @s + 10, {:ok, true}}
      not_held = {:held?, {@chat, @user, "a"}, 72 * @s, 72 * @s + 10, {:ok, false}}
      assert History.check([held, not_held | records], events) == []
    end

    test "reports a take-over before the TTL" do
      {records, events} = base(30 * @s)
      assert [{:taken_over_before_ttl, _}] = History.check(records, events)
    end

    test "reports held? answering true after the user's lock was taken over" do
      {records, events} = base(71 * @s)
      stolen = ev(:user, @user, "a", "c", 10 * @s, 80 * @s, 80 * @s, 4)
      stolen_chat = ev(:chat, "c-chat", nil, "c", nil, 80 * @s, 80 * @s, 4)
      held = {:held?, {@chat, @user, "a"}, 70 * @s, 70 * @s + 10, {:ok, true}}
      too_late = {:held?, {@chat, @user, "a"}, 90 * @s, 90 * @s + 10, {:ok, true}}
      records = [held, too_late, acquired("c-chat", @user, "c", 60, 80 * @s) | records]

      assert [{:"held?_true_while_not_so", {{@chat, @user, "a"}, _, _}}] =
               History.check(records, events ++ [stolen, stolen_chat])
    end

    test "reports a lock freed by a release of another ref" do
      {records, events} = base(71 * @s)
      freed = ev(:chat, @chat, "b", nil, 71 * @s, nil, 75 * @s, 5)
      late = {:release, {@chat, @user, "a"}, 75 * @s - 5, 75 * @s + 5, {:ok, :ok}}

      assert [{:freed_by_no_release_of_its_ref, _}] =
               History.check([late | records], events ++ [freed])
    end

    test "passes a release that raised :row_locked, unless the lock was freed" do
      {records, events} = base(71 * @s)
      error = %Locks.Error{reason: :row_locked, message: "held"}
      late = {:release, {@chat, @user_b, "b"}, 75 * @s - 5, 75 * @s + 5, {:raised, error}}
      assert History.check([late | records], events) == []

      freed = ev(:chat, @chat, "b", nil, 71 * @s, nil, 75 * @s, 5)

      assert [{:freed_by_no_release_of_its_ref, _}] =
               History.check([late | records], events ++ [freed])
    end

    test "reports a lock re-dated by a call that did not hold it" do
      {records, events} = base(71 * @s)
      redated = ev(:user, @user_b, "b", "b", 71 * @s, 75 * @s, 75 * @s, 6)

      refused =
        {:acquire, {"c-chat", @user_b, "c", 60}, 75 * @s - 5, 75 * @s + 5,
         {:ok, {:error, :turn_in_flight}}}

      assert [{:lock_redated_by_another_call, _}] =
               History.check([refused | records], events ++ [redated])
    end

    test "reports an :ok acquire whose two locks were not one transaction, and a raise" do
      {records, events} = base(71 * @s)
      events = List.replace_at(events, 2, %{Enum.at(events, 2) | txid: 99})
      raised = {:held?, {@chat, @user, "a"}, 0, 1, {:raised, %RuntimeError{message: "x"}}}

      assert [{:raised, _}, {:acquire_ok_without_both_locks_in_one_transaction, _}] =
               History.check([raised | records], events)
    end
  end

  describe "a counter incremented only under the chat's lock (ShedLock's test)" do
    @tag :slow
    test "8 processes x 25 read-then-write increments lose no update" do
      table = random_name("robust_counter_")

      TestDB.query!(
        "CREATE TABLE #{table} (id int PRIMARY KEY, n int NOT NULL); INSERT INTO #{table} VALUES (1, 0)"
      )

      on_exit(fn -> TestDB.query!("DROP TABLE IF EXISTS #{table}") end)
      chat = TestDB.insert_chat!()

      tasks =
        for w <- 1..8 do
          Task.async(fn ->
            # psql's own connection: the read and the write are two statements,
            # so without the lock two workers would read the same n.
            psql = TestDB.session!(TestDB.url())
            busy = increment(psql, table, chat, TestDB.uuid(), w, 25, 0)
            TestDB.close(psql)
            busy
          end)
        end

      busy = tasks |> Task.await_many(120_000) |> Enum.sum()

      assert TestDB.query!("SELECT n FROM #{table}") == [["200"]]
      # The workers did contend (else the lock protected nothing).
      assert busy > 0
      assert TestDB.lock(:chat, chat) == {nil, nil}
    end
  end

  defp increment(_psql, _table, _chat, _user, _w, 0, busy), do: busy

  defp increment(psql, table, chat, user, w, left, busy) do
    turn = "counter-#{w}-#{left}-#{busy}"

    case Locks.acquire(chat, user, turn, 60) do
      :ok ->
        true = Locks.held?(chat, user, turn)
        n = "SELECT n FROM #{table} WHERE id = 1" |> TestDB.value!(psql) |> String.to_integer()
        TestDB.query!("UPDATE #{table} SET n = #{n + 1} WHERE id = 1", psql)
        :ok = Locks.release(chat, user, turn)
        increment(psql, table, chat, user, w, left - 1, busy)

      {:error, :conversation_busy} ->
        increment(psql, table, chat, user, w, left, busy + 1)
    end
  end
end
