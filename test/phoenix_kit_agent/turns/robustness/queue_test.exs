defmodule PhoenixKitAgent.Turns.Robustness.QueueTest do
  # The queue (native/locks_core/src/queue.rs), with a pool of one
  # connection in a child node: the first call is kept running at the
  # server (TestDB.stall!/1), and the next ones wait in line behind it. The calls in
  # line run in order: a call that ends runs the next RUN_NEXT from the line
  # on its slot, then hands the slot to the first in line; a caller that
  # dies leaves the line, or gives back the slot it held, at once; a stop
  # tells the line at once; and no caller is left a message.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Error, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.{Junk, Node}
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.{Faults, Queue}

  @moduletag :robustness

  setup do
    chats = for _ <- 1..4, do: TestDB.uuid()
    TestDB.query!(TestDB.insert_chats_sql(chats))
    %{chats: chats, app: "queue-test-#{System.unique_integer([:positive])}"}
  end

  defp node!(app, timeouts) do
    env = [url: TestDB.url(), pool_size: 1, application_name: app] ++ timeouts
    node = Node.start!(app_env: env)
    assert {_pid, {:ok, _}} = Node.hello(node)
    node
  end

  defp status(node), do: Node.call(node, Locks, :status, []).pool

  defp until!(node, key, n), do: assert(Node.call(node, Queue, :until, [key, n]) == :ok)

  # Kills `holder`, which holds a slot it has not started: the slot is free at once.
  defp kill_frees_slot!(node, holder) do
    assert Node.call(node, Process, :exit, [holder, :kill])
    until!(node, :running, 0)
  end

  # The first of `calls` (an acquire of a user with no row) is kept running
  # at the server until `TestDB.unstall!(stall)`; the others wait in line
  # behind it, in order. The stall.
  defp line!(node, [{:acquire, [chat, user | _]} | _] = calls) do
    # Opens the pool's connection first, so the first call does not connect.
    assert Node.call(node, Locks, :held?, [chat, TestDB.uuid(), "warm"]) == false
    stall = TestDB.stall!(user)
    :ok = Node.call(node, Queue, :start, [calls])
    stall
  end

  # The node's connections to the database, by its application_name.
  defp connections(app) do
    "SELECT count(*) FROM pg_stat_activity WHERE application_name = '#{app}'"
    |> TestDB.query!()
    |> hd()
    |> hd()
    |> String.to_integer()
  end

  defp answers(node, n), do: Node.call(node, Queue, :answers, [n])

  # How many calls from the line one call runs after its own, read from where
  # it is defined.
  @run_next "native/locks_core/src/queue.rs"
            |> File.read!()
            |> then(&Regex.run(~r/pub const RUN_NEXT: usize = (\d+);/, &1))
            |> List.last()
            |> String.to_integer()

  defp chat_ref(chat),
    do:
      TestDB.value!(
        "SELECT busy_turn_ref FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}'"
      )

  test "calls in line run in order when the slot frees, the first ones by the call that " <>
         "frees it, each answering its documented term, with nothing left in the mailboxes",
       %{chats: [x, y | _], app: app} do
    node = node!(app, checkout_timeout: 10_000)
    [ua, ub, uc] = for _ <- 1..3, do: TestDB.uuid()
    click = "click:" <> TestDB.uuid()

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

    blocker = line!(node, calls)
    assert %{size: 1, running: 1, waiting: 7} = status(node)

    TestDB.unstall!(blocker)
    answers = answers(node, length(calls))

    assert Enum.map(answers, &elem(&1, 0)) == [
             {:ok, :ok},
             {:ok, :ok},
             {:ok, {:error, :conversation_busy}},
             {:ok, true},
             {:ok, {:error, :turn_in_flight}},
             {:ok, true},
             {:ok, :ok},
             {:ok, false}
           ]

    # The answers above hold only in this order: that is the order the calls
    # ran in. With one slot, and no more in line than RUN_NEXT, the first
    # call ran them all: each caller made one enter/3 and none was sent a go.
    # Two used a dirty-I/O scheduler (run/3): the first, and the second, which
    # found the slot taken there; every caller after it waited in line
    # without one (enter/3 looks while the last call had to wait).
    # (When each caller read its answer is no proof: a caller woken 43 µs
    # before the first call returned was once scheduled after it.)
    assert length(calls) <= @run_next + 1
    assert Node.call(node, Queue, :runs, []) == %{enter: length(calls), run: 2}
    assert Enum.all?(answers, &(elem(&1, 1) == [])), inspect(answers)
    assert %{running: 0, waiting: 0} = status(node)
  end

  test "a caller killed in line leaves it at once, and the one behind it gets the slot",
       %{chats: [x, y, z | _], app: app} do
    node = node!(app, checkout_timeout: 10_000)
    [ua, ub, uc] = for _ <- 1..3, do: TestDB.uuid()

    calls = [
      {:acquire, [x, ua, "a", 60]},
      {:acquire, [y, ub, "b", 60]},
      {:acquire, [z, uc, "c", 60]}
    ]

    blocker = line!(node, calls)
    :ok = Node.call(node, Queue, :kill, [1])
    until!(node, :waiting, 1)

    started = System.monotonic_time(:millisecond)
    TestDB.unstall!(blocker)

    assert [{{:ok, :ok}, []}, {:killed, _}, {{:ok, :ok}, []}] = answers(node, 3)
    # Long before c's checkout deadline (10 s): it was not stuck behind b.
    assert System.monotonic_time(:millisecond) - started < 5_000
    assert chat_ref(y) == nil
  end

  test "a caller killed holding a slot it was handed and never started frees it at once",
       %{chats: [x | _], app: app} do
    node = node!(app, checkout_timeout: 10_000)
    # The first call runs the next RUN_NEXT from the line, then hands its slot on.
    ran = for _ <- 1..@run_next, do: {:held?, [TestDB.uuid(), TestDB.uuid(), "r"]}
    blocker = line!(node, [{:acquire, [x, TestDB.uuid(), "a", 60]} | ran])
    holder = Node.call(node, Queue, :hold_slot, [])
    assert %{running: 1, waiting: waiting} = status(node)
    assert waiting == @run_next + 1

    TestDB.unstall!(blocker)
    assert [{{:ok, :ok}, []} | ran] = answers(node, @run_next + 1)
    assert Enum.all?(ran, &match?({{:ok, false}, []}, &1)), inspect(ran)

    # The slot is the holder's, handed and not started.
    until!(node, :waiting, 0)
    assert %{running: 1, waiting: 0} = status(node)

    kill_frees_slot!(node, holder)
    assert Node.call(node, Locks, :held?, [TestDB.uuid(), TestDB.uuid(), "t"]) == false
  end

  test "a caller whose stamp is from the future waits in line no longer than checkout_timeout",
       %{chats: [x | _], app: app} do
    node = node!(app, checkout_timeout: 100)
    # The one slot runs a call kept running at the server.
    blocker = line!(node, [{:acquire, [x, TestDB.uuid(), "a", 60]}])

    assert {%Error{reason: :pool_timeout}, {:messages, []}} =
             Node.call(node, Queue, :future_call, [])

    assert %{running: 1, waiting: 0} = status(node)
    TestDB.unstall!(blocker)
    assert [{{:ok, :ok}, []}] = answers(node, 1)
  end

  test "a call whose caller is killed while it runs ends, and the callers in line behind it " <>
         "get their answers (a dead caller's call hands its slot on by a thread of its own)",
       %{chats: [x, y | _], app: app} do
    node = node!(app, checkout_timeout: 10_000)
    [ua, ub, uc] = for _ <- 1..3, do: TestDB.uuid()

    calls = [
      {:acquire, [x, ua, "a", 60]},
      {:acquire, [y, ub, "b", 60]},
      {:acquire, [y, uc, "c", 60]}
    ]

    blocker = line!(node, calls)
    # The first call's process dies; its dirty-scheduler call runs on.
    :ok = Node.call(node, Queue, :kill, [0])
    TestDB.unstall!(blocker)

    assert [{:killed, _}, {{:ok, :ok}, []}, {{:ok, {:error, :conversation_busy}}, []}] =
             answers(node, 3)

    # a's call ran none from the line (an answer it could not send would need
    # that thread): b, in line by its run/3, was sent go and ran its own
    # (enter/3 and run/3 again), then ran c's; c waited with no run/3.
    assert Node.call(node, Queue, :runs, []) == %{enter: 4, run: 3}
    assert Node.call(node, Locks, :held?, [x, ua, "a"]) == true
  end

  test "at its checkout deadline a caller in line raises :pool_timeout with nothing left " <>
         "in its mailbox, and the slot still goes to the next",
       %{chats: [x, y, z | _], app: app} do
    node = node!(app, checkout_timeout: 1_000, connect_timeout: 5_000, statement_timeout: 5_000)
    [ua, ub, uc] = for _ <- 1..3, do: TestDB.uuid()

    calls = [{:acquire, [x, ua, "a", 60]}, {:acquire, [y, ub, "b", 60]}]
    blocker = line!(node, calls)

    assert [{:ok, :ok}, {{:raised, %Error{reason: :pool_timeout}}, []}] =
             answers_after(node, blocker, 2)

    assert %{running: 0, waiting: 0} = status(node)
    assert Node.call(node, Locks, :acquire, [z, uc, "c", 60]) == :ok
    assert Node.call(node, Locks, :held?, [y, ub, "b"]) == false
  end

  test "a caller whose checkout deadline passes while its call runs from the line gets " <>
         "that call's answer, with nothing left in its mailbox",
       %{chats: [x, y | _], app: app} do
    node = node!(app, checkout_timeout: 1_000, connect_timeout: 5_000, statement_timeout: 5_000)
    [ua, ub] = for _ <- 1..2, do: TestDB.uuid()
    second = TestDB.stall!(ub)
    blocker = line!(node, [{:acquire, [x, ua, "a", 60]}, {:acquire, [y, ub, "b", 60]}])
    :ok = Node.call(node, Queue, :watch_call, [1, :leave])

    # a's call ends and runs b's, which is kept running past b's checkout deadline.
    TestDB.unstall!(blocker)
    assert Node.call(node, Queue, :until_called, []) == :ok
    TestDB.unstall!(second)

    assert [{{:ok, :ok}, []}, {{:ok, :ok}, []}] = answers(node, 2)
    assert %{running: 0, waiting: 0} = status(node)
    assert Node.call(node, Locks, :held?, [y, ub, "b"]) == true
  end

  test "a call that fails runs nothing from the line: the next caller runs its own call",
       %{chats: [x, y | _], app: app} do
    node = node!(app, checkout_timeout: 10_000)
    [ua, ub] = for _ <- 1..2, do: TestDB.uuid()
    blocker = line!(node, [{:acquire, [x, ua, "a", 60]}, {:acquire, [y, ub, "b", 60]}])
    :ok = Node.call(node, Queue, :watch_call, [1, :run])

    # a's backend, kept running, is terminated: a fails (:disconnected).
    backend = blocked_by!(app, blocker)
    assert TestDB.query!("SELECT pg_terminate_backend(#{backend})") == [["t"]]

    assert [{{:raised, %Error{reason: :disconnected}}, []}, {{:ok, :ok}, []}] = answers(node, 2)

    # b ran its own call (Native.run/3 after its go): a's failed one ran nothing for it.
    assert Node.call(node, Queue, :called?, []), "b's call was run by a's failed one"
    TestDB.unstall!(blocker)
  end

  test "a call run from the line that fails stops the taking: the next caller runs its own " <>
         "call",
       %{chats: [x, y | _], app: app} do
    node = node!(app, checkout_timeout: 10_000)
    [ua, ub] = for _ <- 1..2, do: TestDB.uuid()
    second = TestDB.stall!(ub)

    calls = [{:acquire, [x, ua, "a", 60]}, {:acquire, [y, ub, "b", 60]}, {:held?, [x, ua, "a"]}]
    blocker = line!(node, calls)
    :ok = Node.call(node, Queue, :watch_call, [2, :run])
    TestDB.unstall!(blocker)

    # a's call ends and runs b's, kept running; its backend is terminated.
    backend = blocked_by!(app, second)
    assert TestDB.query!("SELECT pg_terminate_backend(#{backend})") == [["t"]]

    assert [
             {{:ok, :ok}, []},
             {{:raised, %Error{reason: :disconnected}}, []},
             {{:ok, true}, []}
           ] = answers(node, 3)

    # c ran its own call (Native.run/3 after its go): a's ran nothing after b's failed.
    assert Node.call(node, Queue, :called?, []), "a's call ran c's after b's had failed"
    TestDB.unstall!(second)
  end

  # The backend of `app` that a stall keeps waiting (5 s at most); with one
  # connection, the one stalled at the time.
  defp blocked_by!(app, _stall, tries \\ 500) do
    case TestDB.stalled_backends(app) do
      [[backend]] ->
        backend

      [] when tries > 0 ->
        Process.sleep(10)
        blocked_by!(app, nil, tries - 1)
    end
  end

  # Lets the blocker go once every caller but the first has answered.
  defp answers_after(node, blocker, n) do
    until!(node, :waiting, 0)
    TestDB.unstall!(blocker)
    [{first, _} | rest] = answers(node, n)
    [first | rest]
  end

  test "Application.stop/1 tells every caller in line :not_started at once, lets the " <>
         "running call end, then closes every connection",
       %{chats: [x, y | _], app: app} do
    node = node!(app, checkout_timeout: 10_000)
    [ua, ub, uc] = for _ <- 1..3, do: TestDB.uuid()

    calls = [
      {:acquire, [x, ua, "a", 60]},
      {:acquire, [y, ub, "b", 60]},
      {:acquire, [y, uc, "c", 60]}
    ]

    blocker = line!(node, calls)
    assert Node.call(node, Application, :stop, [:phoenix_kit_agent_locks]) == :ok

    # The line is told at once, while the running call still runs.
    until!(node, :answered, 2)
    TestDB.unstall!(blocker)

    assert [
             {{:ok, :ok}, []},
             {{:raised, %Error{reason: :not_started}}, []},
             {{:raised, %Error{reason: :not_started}}, []}
           ] = answers(node, 3)

    # Its statement ran; then its connection closed, as the idle ones did.
    assert chat_ref(x) == "a"
    assert :ok == Faults.until(fn -> connections(app) == 0 end, 5_000), "#{connections(app)} open"
  end

  test "a refused Native.start/1 leaves the running pool's slots as they were",
       %{chats: [x | _], app: app} do
    node = node!(app, checkout_timeout: 10_000)
    # Configurations no pool can be built from, with the default pool_size: refused.
    refused = Node.call(node, Junk, :start_junk, [])
    assert Enum.all?(refused, &(&1 in [:argument_error, :decode_error, {:locks_error, :config}]))

    # Four calls of x, the first kept running: one slot, so one runs and three wait.
    calls = for i <- 1..4, do: {:acquire, [x, TestDB.uuid(), "r#{i}", 60]}
    blocker = line!(node, calls)
    assert %{size: 1, running: 1, waiting: 3} = status(node)

    TestDB.unstall!(blocker)
    busy = {{:ok, {:error, :conversation_busy}}, []}
    assert [{{:ok, :ok}, []}, ^busy, ^busy, ^busy] = answers(node, 4)
  end

  test "after a stop and a start that come before the line reads its go, the new pool's " <>
         "slots still bound what runs, and every caller is answered",
       %{chats: [x | _], app: app} do
    node = node!(app, checkout_timeout: 10_000)
    calls = for i <- 1..4, do: {:acquire, [x, TestDB.uuid(), "r#{i}", 60]}
    blocker = line!(node, calls)

    # The stop hands each caller in line a slot and its go, read after the start:
    # with the first call still running, one slot, so the three wait again.
    :ok = Node.call(node, Queue, :restart_suspended, [[1, 2, 3]])
    until!(node, :waiting, 3)
    assert %{size: 1, running: 1, waiting: 3} = status(node)

    TestDB.unstall!(blocker)
    busy = {{:ok, {:error, :conversation_busy}}, []}
    assert [{{:ok, :ok}, []}, ^busy, ^busy, ^busy] = answers(node, 4)
  end
end
