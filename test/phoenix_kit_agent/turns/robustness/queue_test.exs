defmodule PhoenixKitAgent.Turns.Robustness.QueueTest do
  # The admission gate's queue, with a pool of one connection in a child
  # node: the first call waits for a row another session holds, and the
  # next ones queue behind it (native/locks_nif/src/call.rs). When it ends,
  # it runs their jobs in its own turn, in order, and its caller sends their
  # answers; if that caller was killed meanwhile, the answers are sent all
  # the same.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks.{Error, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.Node
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Queue

  @moduletag :robustness

  setup do
    chats = for _ <- 1..4, do: TestDB.uuid()
    TestDB.query!(TestDB.insert_chats_sql(chats))
    %{chats: chats}
  end

  defp node!(timeouts) do
    node = Node.start!(app_env: [url: TestDB.url(), pool_size: 1] ++ timeouts)
    assert {_pid, {:ok, _}} = Node.hello(node)
    node
  end

  # A session of its own holds the row of `chat` until `TestDB.query!("COMMIT", s)`.
  defp hold_row!(chat) do
    session = TestDB.session!(TestDB.url())

    TestDB.query!(
      """
      BEGIN; SELECT 1 FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}' FOR UPDATE
      """,
      session
    )

    session
  end

  test "queued calls run in the turn of the call before them, in order, each answering " <>
         "its documented term",
       %{chats: [x, y | _]} do
    node = node!(checkout_timeout: 10_000)
    [ua, ub, uc] = for _ <- 1..3, do: TestDB.uuid()
    click = "click:" <> TestDB.uuid()
    assert Node.call(node, PhoenixKitAgent.Turns.Locks, :held?, [x, ua, "warm"]) == false
    blocker = hold_row!(x)

    calls = [
      {:acquire, [x, ua, "a", 60]},
      {:acquire, [y, ub, "b", 60]},
      {:acquire, [y, uc, "c", 60]},
      {:held?, [y, ub, "b"]},
      {:acquire_user, [ub, click, 60, 10]},
      {:fresh?, [y, "b", 60]},
      {:release, [y, ub, "b"]},
      {:held?, [y, ub, "b"]}
    ]

    :ok = Node.call(node, Queue, :start, [calls])

    # A caller that must wait and whose arguments the NIF cannot use is
    # refused at once, and takes no place in the queue.
    assert {:raised, %ArgumentError{}} = Node.call(node, Queue, :admit, [:held?, [:bad]])
    assert {:raised, %ArgumentError{}} = Node.call(node, Queue, :admit, [:nope, []])

    assert %{waiting: 7, served: 0} =
             Node.call(node, PhoenixKitAgent.Turns.Locks, :status, []).pool

    TestDB.query!("COMMIT", blocker)
    [{first, _} | queued] = Node.call(node, Queue, :answers, [length(calls)])

    assert first == {:ok, :ok}

    assert Enum.map(queued, &elem(&1, 0)) == [
             {:ok, :ok},
             {:ok, {:error, :conversation_busy}},
             {:ok, true},
             {:ok, {:error, :turn_in_flight}},
             {:ok, true},
             {:ok, :ok},
             {:ok, false}
           ]

    # Seven in the first call's turn (at most 8: SERVE_AT_MOST), none waited
    # for a turn of its own.
    assert %{waiting: 0, served: 7} =
             Node.call(node, PhoenixKitAgent.Turns.Locks, :status, []).pool
  end

  test "the answers of queued calls are not lost when the call that runs them is killed",
       %{chats: [x, y | _]} do
    node = node!(checkout_timeout: 1_000)
    [ua, ub, uc] = for _ <- 1..3, do: TestDB.uuid()
    assert Node.call(node, PhoenixKitAgent.Turns.Locks, :held?, [x, ua, "warm"]) == false
    blocker = hold_row!(x)

    calls = [
      {:acquire, [x, ua, "a", 60]},
      {:acquire, [y, ub, "b", 60]},
      {:acquire, [y, uc, "c", 60]}
    ]

    started = System.monotonic_time(:millisecond)
    :ok = Node.call(node, Queue, :start, [calls])
    # The first call's process dies; its dirty-scheduler call runs on.
    :ok = Node.call(node, Queue, :kill_first, [])
    TestDB.query!("COMMIT", blocker)
    answers = Node.call(node, Queue, :answers, [3])
    elapsed = System.monotonic_time(:millisecond) - started

    assert Enum.map(answers, &elem(&1, 0)) ==
             [:killed, {:ok, :ok}, {:ok, {:error, :conversation_busy}}]

    # b and c ran in a's turn: served, at their checkout deadline at the latest.
    assert %{served: 2} = Node.call(node, PhoenixKitAgent.Turns.Locks, :status, []).pool
    assert elapsed < 1_000 + 1_000, "#{elapsed} ms"
    assert Node.call(node, PhoenixKitAgent.Turns.Locks, :held?, [x, ua, "a"]) == true
  end

  test "a queued job that fails raises in its own caller; the call that ran it stops " <>
         "serving, ends within its own deadline, and the next caller gives up at its checkout",
       %{chats: [x, _y, z, w]} do
    # One call: 1 s checkout + 1 s connect + 1 s statement.
    node = node!(checkout_timeout: 1_000, connect_timeout: 1_000, statement_timeout: 1_000)
    assert Node.call(node, PhoenixKitAgent.Turns.Locks, :held?, [x, TestDB.uuid(), "w"]) == false
    [blocker, keeper] = [hold_row!(x), hold_row!(z)]
    [ua, ub, uc] = for _ <- 1..3, do: TestDB.uuid()

    calls = [
      {:acquire, [x, ua, "a", 60]},
      # Run in a's turn, on a row held until the test ends: a's deadline ends it.
      {:acquire, [z, ub, "b", 60]},
      # Still queued when its checkout timeout passes.
      {:acquire, [w, uc, "c", 60]}
    ]

    started = System.monotonic_time(:millisecond)
    :ok = Node.call(node, Queue, :start, [calls])
    TestDB.query!("COMMIT", blocker)
    [{a, _}, {b, _}, {c, _}] = Node.call(node, Queue, :answers, [3])
    elapsed = System.monotonic_time(:millisecond) - started

    assert a == {:ok, :ok}
    assert {:raised, %Error{reason: :timeout}} = b
    assert {:raised, %Error{reason: :pool_timeout}} = c
    assert elapsed < 3_000 + 1_000, "#{elapsed} ms"
    # b ran in a's turn; c never ran.
    assert %{served: 1} = Node.call(node, PhoenixKitAgent.Turns.Locks, :status, []).pool

    # c's job never ran, and the pool carries on. (Whether b's statement
    # still runs once the row is free depends on when its cancel request
    # lands: a timeout cannot recall a statement that reached the server.)
    TestDB.query!("COMMIT", keeper)
    locks = PhoenixKitAgent.Turns.Locks

    assert Node.call(node, locks, :acquire, [w, TestDB.uuid(), "d", 60]) == :ok
    assert Node.call(node, locks, :held?, [x, ua, "a"]) == true
  end
end
