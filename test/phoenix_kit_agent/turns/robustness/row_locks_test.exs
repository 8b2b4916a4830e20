defmodule PhoenixKitAgent.Turns.Robustness.RowLocksTest do
  # No lock call waits long on another session's row lock (sql.rs, the
  # module doc): a row held by another transaction is the lock being busy
  # right now. Takers answer busy at once, a holder's own writes raise
  # :row_locked after ROW_WAIT a row, and a fenced transaction whose node
  # stalls is ended by the server a lease after it stalled. Real processes:
  # psql sessions holding rows, a second VM stopped with SIGSTOP.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Native, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.{Fenced, Node}
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Faults

  @moduletag :robustness
  @moduletag timeout: 120_000

  # The most any call may take while rows are held: far below a call's
  # timeout (checkout + connect + statement, below), whatever it waits for.
  @bound_ms 1_000
  @timeouts [checkout_timeout: 500, connect_timeout: 1_000, statement_timeout: 1_500]
  @call_timeout_ms 3_000

  setup_all do
    TestDB.query!(
      "CREATE TABLE IF NOT EXISTS #{Fenced.messages_table()} (chat uuid NOT NULL, turn text NOT NULL)",
      TestDB.url()
    )

    :ok
  end

  defp now, do: System.monotonic_time(:millisecond)

  defp start_node(app_env) do
    node = Node.start!(app_env: [url: TestDB.url()] ++ app_env)
    assert {_pid, {:ok, _}} = Node.hello(node)
    node
  end

  # Each of `calls` at once in `node`; asserts every one answered (no raise)
  # within @bound_ms; their values.
  defp all_within_bound(node, calls) do
    timed = Node.call(node, Faults, :timed_many, [calls])

    for {answer, ms} <- timed do
      assert ms < @bound_ms, "answered after #{ms} ms: #{inspect(answer)}"
      assert {:ok, _value} = answer
    end

    {Enum.map(timed, fn {{:ok, value}, _ms} -> value end), Enum.map(timed, &elem(&1, 1))}
  end

  # Rounds of `calls` until the row has been held longer than a call's
  # timeout: the last round's values, the rounds, and the slowest call's ms.
  defp rounds_past_call_timeout(node, calls, held_since, rounds \\ 0, slowest \\ 0) do
    {values, ms} = all_within_bound(node, calls)
    slowest = Enum.max([slowest | ms])

    if now() - held_since > @call_timeout_ms,
      do: {values, rounds + 1, slowest},
      else: rounds_past_call_timeout(node, calls, held_since, rounds + 1, slowest)
  end

  defp hold_row!(sql) do
    psql = TestDB.session!(TestDB.url())
    TestDB.query!("BEGIN; " <> sql <> " FOR UPDATE", psql)
    {psql, now()}
  end

  defp let_go!(psql) do
    TestDB.query!("ROLLBACK", psql)
    TestDB.close(psql)
  end

  test "a chat row, then a user row, held FOR UPDATE by another session for longer than a " <>
         "call's timeout: every acquire answers busy within the bound, the holder's own " <>
         "writes raise :row_locked, and unrelated calls on the same pool answer" do
    # A pool of 2 with 12 calls at once: one call holding a slot long would
    # time the others out (:pool_timeout after 500 ms).
    node = start_node([pool_size: 2] ++ @timeouts)
    [chat, other_chat | unrelated] = TestDB.insert_chats!(8)
    user = TestDB.uuid()
    :ok = Locks.acquire(other_chat, user, "turn-u", 60)

    takers = for i <- 1..6, do: {:acquire, [chat, TestDB.uuid(), "taker-#{i}", 60]}
    bystanders = for c <- unrelated, do: {:held?, [c, TestDB.uuid(), "nobody"]}

    {psql, since} =
      hold_row!("SELECT 1 FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}'")

    {values, rounds, slowest_chat} = rounds_past_call_timeout(node, takers ++ bystanders, since)
    let_go!(psql)
    assert values == List.duplicate({:error, :conversation_busy}, 6) ++ List.duplicate(false, 6)
    assert rounds >= 3
    assert Node.call(node, Locks, :acquire, [chat, TestDB.uuid(), "after", 60]) == :ok

    # The user's row: turn-u holds the user's lock, committed.
    click = Locks.click_ref()
    chats = TestDB.insert_chats!(4)

    takers = [
      {:acquire_user, [user, click, 60, 10]} | for(c <- chats, do: {:acquire, [c, user, "t", 60]})
    ]

    {psql, since} =
      hold_row!("SELECT 1 FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}'")

    {values, _rounds, slowest_user} = rounds_past_call_timeout(node, takers ++ bystanders, since)
    assert values == List.duplicate({:error, :turn_in_flight}, 5) ++ List.duplicate(false, 6)

    IO.puts(
      "\n[row_locks] slowest call while a row was held: #{slowest_chat} ms (chat's row), #{slowest_user} ms (user's row)"
    )

    # The holder's renewal and release: refused after ROW_WAIT, nothing changed.
    row_wait_ms = Native.rules().row_wait_ms

    for {fun, args} <- [
          keep: [other_chat, user, "turn-u", 60, 60],
          release: [other_chat, user, "turn-u"]
        ] do
      [{{:raised, %Locks.Error{reason: :row_locked, message: message}}, ms}] =
        Node.call(node, Faults, :timed_many, [[{fun, args}]])

      assert message =~ "stayed locked by another transaction for #{row_wait_ms} ms", message
      assert ms >= row_wait_ms and ms < @bound_ms, "#{fun} answered after #{ms} ms"
    end

    let_go!(psql)
    assert {"turn-u", _age} = TestDB.lock(:user, user)
    assert Node.call(node, Locks, :release, [other_chat, user, "turn-u"]) == :ok
    assert Node.call(node, Locks, :acquire_user, [user, click, 60, 10]) == :ok
  end

  test "a new settings row another transaction is inserting: acquire/4 and acquire_user/4 " <>
         "wait ROW_WAIT for it and answer :turn_in_flight" do
    node = start_node(@timeouts)
    chat = TestDB.insert_chat!()
    user = TestDB.uuid()
    psql = TestDB.session!(TestDB.url())

    TestDB.query!(
      "BEGIN; INSERT INTO phoenix_kit_agent_user_settings (user_uuid) VALUES ('#{user}')",
      psql
    )

    row_wait_ms = Native.rules().row_wait_ms

    calls = [
      {:acquire, [chat, user, "t", 60]},
      {:acquire_user, [user, Locks.click_ref(), 60, 10]}
    ]

    for {answer, ms} <- Node.call(node, Faults, :timed_many, [calls]) do
      assert answer == {:ok, {:error, :turn_in_flight}}
      assert ms >= row_wait_ms and ms < @bound_ms, "answered after #{ms} ms"
    end

    let_go!(psql)
    assert TestDB.lock(:chat, chat) == {nil, nil}
    assert Node.call(node, Locks, :acquire, [chat, user, "t", 60]) == :ok
  end

  test "a transaction inserting a row that references the chat (a foreign key's FOR KEY " <>
         "SHARE) leaves the chat free to take" do
    node = start_node(@timeouts)
    chat = TestDB.insert_chat!()

    TestDB.query!(
      "CREATE TABLE IF NOT EXISTS locks_test_chat_messages (chat uuid REFERENCES phoenix_kit_agent_conversations (uuid))",
      TestDB.url()
    )

    psql = TestDB.session!(TestDB.url())
    TestDB.query!("BEGIN; INSERT INTO locks_test_chat_messages VALUES ('#{chat}')", psql)
    assert Node.call(node, Locks, :acquire, [chat, TestDB.uuid(), "t", 60]) == :ok
    assert Node.call(node, Locks, :keep, [chat, TestDB.uuid(), "t", 60, 60]) == false
    let_go!(psql)
  end

  test "a VM stopped (SIGSTOP) inside its fenced write: its transaction ends a lease later, " <>
         "the chat and the user are taken over within two leases of its last renewal, no " <>
         "call waits past the bound or raises, and its write never commits" do
    ttl_s = 60
    lease_s = 3
    node = start_node([])
    {os_pid, _} = Node.hello(node)
    [chat, other_chat] = TestDB.insert_chats!(2)
    user = TestDB.uuid()

    id = Node.async(node, Fenced, :write_then_wait, [chat, user, ttl_s, lease_s])

    assert Faults.until(fn -> Enum.any?(Node.log(node), &(&1 =~ "FENCED_WRITE_DONE")) end, 30_000) ==
             :ok

    {_, 0} = System.cmd("kill", ["-STOP", Integer.to_string(os_pid)])
    stopped = now()
    # Quiet: by the end the VM is resumed and usually gone.
    on_exit(fn ->
      System.cmd("kill", ["-CONT", Integer.to_string(os_pid)], stderr_to_stdout: true)
    end)

    {ref, _age} = TestDB.lock(:chat, chat)

    # The last renewal, by the database's clock: busy_since is dated back
    # by ttl_s - lease_s (frozen while the VM is stopped).
    renewed =
      "SELECT busy_since + interval '#{ttl_s - lease_s} seconds' FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}'"

    [[renewed_at]] = TestDB.query!(renewed)

    # Takers every 50 ms, the chat's then the user's, each answering within the bound.
    take = fn chat, user, turn ->
      Stream.repeatedly(fn ->
        started = now()
        answer = Locks.acquire(chat, user, turn, ttl_s)
        assert now() - started < @bound_ms
        assert answer in [:ok, {:error, :conversation_busy}, {:error, :turn_in_flight}]
        answer == :ok or receive(do: (:never -> nil), after: (50 -> false))
      end)
      |> Enum.find(&(&1 == true))
    end

    take.(chat, TestDB.uuid(), "taker-chat")
    chat_taken = now() - stopped
    take.(other_chat, user, "taker-user")
    user_taken = now() - stopped

    # The take-over, by the database's clock, within two leases of the last renewal.
    [[gap]] =
      TestDB.query!(
        "SELECT extract(epoch FROM busy_since - '#{renewed_at}'::timestamptz) FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}'"
      )

    assert String.to_float(gap) <= 2 * lease_s, "taken over #{gap} s after the last renewal"

    IO.puts(
      "\n[row_locks] taken over #{chat_taken} ms (chat), #{user_taken} ms (user) after SIGSTOP; #{gap} s after the last renewal"
    )

    # Resumed: its commit fails (the server ended its session), nothing of it commits.
    {_, 0} = System.cmd("kill", ["-CONT", Integer.to_string(os_pid)])
    Node.call(node, :erlang, :send, [:fenced_writer, :commit])
    error = assert_raise RuntimeError, fn -> Node.await(node, id, 30_000) end
    # 25P03 (idle-in-transaction timeout), or from PostgreSQL 17 25P04
    # (transaction timeout): the server ended the session, and its transaction.
    assert error.message =~ "transaction timeout"

    assert TestDB.query!("SELECT turn FROM #{Fenced.messages_table()} WHERE chat = '#{chat}'") ==
             []

    assert {"taker-chat", _} = TestDB.lock(:chat, chat)
    assert {"taker-user", _} = TestDB.lock(:user, user)
    refute ref == "taker-chat"
  end
end
