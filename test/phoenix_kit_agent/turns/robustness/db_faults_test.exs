defmodule PhoenixKitAgent.Turns.Robustness.DbFaultsTest do
  # Database faults, against a SECOND cluster of this module's own
  # (_build/pg-faults; the shared first cluster is never stopped), seen from
  # a separate BEAM OS process configured for it with small timeouts:
  # a crash (`pg_ctl stop -m immediate`) under load, a database that is down
  # when the application starts, and a row held by another transaction past
  # the call's deadline. (A frozen server: freeze_test.exs.)
  #
  # The tests of one module run one after another, so they share the cluster.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Error, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.{Node, Pg, Race}
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Faults

  @moduletag :robustness
  @moduletag timeout: 180_000

  # Every call is cut off after checkout + connect + statement timeouts.
  @timeouts [connect_timeout: 1_000, checkout_timeout: 1_000, statement_timeout: 1_000]
  @call_timeout_ms 3_000
  # What the brief allows on top: none may take longer than timeout + 1 s.
  @bound_ms @call_timeout_ms + 1_000
  # The longest a normal scheduler may be unavailable to the probe. A call
  # blocking a normal scheduler would hold it for its whole wait (3 s); the
  # margin below that absorbs the OS scheduling of a shared 2-core machine.
  @probe_bound_ms 1_000

  setup_all do
    {dir, url} = Pg.take_faults_cluster!()
    # The shared cluster runs with synchronous_commit = off (speed); here a
    # commit must survive `-m immediate`, or "every lock committed before
    # the crash is still there" would test the server's settings instead.
    TestDB.query!("ALTER SYSTEM SET synchronous_commit = on", url)
    TestDB.query!("SELECT pg_reload_conf()", url)
    TestDB.query!(PhoenixKitAgent.Turns.Locks.Native.ddl(:tables, nil), url)
    %{dir: dir, url: url}
  end

  setup %{dir: dir} do
    # Every test starts with the cluster up (a failed test may have left it down).
    :ok = Pg.ensure_running!(dir)
  end

  defp start_node(url, extra \\ []) do
    Node.start!(app_env: [url: url, pool_size: 10] ++ @timeouts ++ extra)
  end

  defp locks_error?({:raised, %Error{}}), do: true
  defp locks_error?(_), do: false

  # Calls that must all succeed, at once, from the node: the pool serves.
  defp assert_serves(node, chats, users, tag) do
    calls =
      for {{chat, user}, i} <- Enum.with_index(Enum.zip(chats, users)),
          do: {:held?, [chat, user, "#{tag}-#{i}"]}

    answers = Node.call(node, Faults, :timed_many, [calls])
    assert Enum.all?(answers, &match?({{:ok, false}, _}, &1)), inspect(answers, limit: 10)
  end

  describe "PostgreSQL crashes (pg_ctl stop -m immediate) during a load" do
    @tag :slow
    test "every call in flight and after raises Locks.Error within the timeout; schedulers " <>
           "stay responsive; after a restart the same pool serves and committed locks are there",
         %{dir: dir, url: url} do
      node = start_node(url)
      assert {_pid, {:ok, _}} = Node.hello(node)
      {pre_chats, load_chats} = Enum.split(TestDB.insert_chats!(20, url), 10)
      pre_users = for _ <- pre_chats, do: TestDB.uuid()
      load_users = for _ <- load_chats, do: TestDB.uuid()

      # Locks committed before the crash, and never touched again.
      for {{chat, user}, i} <- Enum.with_index(Enum.zip(pre_chats, pre_users)) do
        assert Node.call(node, Locks, :acquire, [chat, user, "pre-#{i}", 3600]) == :ok
      end

      result =
        Node.call(node, Faults, :run, [
          %{
            chats: load_chats,
            users: load_users,
            fault: Pg.crash_command(dir),
            warm: 300,
            after_ms: @call_timeout_ms + 1_500
          }
        ])

      {t0, t1, status, output} = result.fault
      assert status == 0, output
      records = result.records
      refute Enum.any?(records, &match?({:worker_crashed, _}, &1)), inspect(records, limit: 5)

      # No call hung: each ended within the timeout + 1 s, before or after the crash.
      slow = for {s, e, fun, answer} <- records, e - s > @bound_ms, do: {fun, e - s, answer}
      assert slow == []

      # Every answer is a normal one or Locks.Error: nothing else is raised, no panic.
      odd =
        for {_, _, fun, answer} <- records,
            not match?({:ok, _}, answer),
            not locks_error?(answer),
            do: {fun, answer}

      assert odd == []

      # Every call that started once the server was gone raised Locks.Error.
      after_crash = for {s, _, _, _} = r <- records, s >= t1, do: r
      assert length(after_crash) > 50, "the load went on after the crash"
      assert Enum.all?(after_crash, fn {_, _, _, answer} -> locks_error?(answer) end)

      reasons =
        for {_, _, _, {:raised, %Error{reason: r}}} <- after_crash, into: MapSet.new(), do: r

      assert MapSet.subset?(
               reasons,
               MapSet.new([:connect, :disconnected, :timeout, :pool_timeout])
             ),
             inspect(reasons)

      # The calls in flight during the crash ended one way or the other.
      in_flight = for {s, e, _, _} = r <- records, s < t1, e > t0, do: r
      assert Enum.all?(in_flight, fn {_, _, _, a} -> match?({:ok, _}, a) or locks_error?(a) end)
      assert Enum.count(records, &match?({_, _, _, {:ok, _}}, &1)) >= 300

      # Normal schedulers were never blocked; the bystanders live on.
      assert result.probe_max_ms < @probe_bound_ms,
             "a normal scheduler was unavailable for #{result.probe_max_ms} ms"

      assert result.bystanders_alive

      # Back up: the same node (no application restart) serves every call,
      # once the connect back-off's pause (2 s at most) has run out.
      :ok = Pg.restart!(dir)
      probe = [hd(load_chats), hd(load_users), "probe"]
      serving? = fn -> Node.call(node, Race, :attempt, [:held?, probe]) == {:ok, false} end
      assert Faults.until(serving?, 5_000) == :ok
      assert_serves(node, load_chats, load_users, "after")

      # Every lock committed before the crash is still there, and still held.
      for {{chat, user}, i} <- Enum.with_index(Enum.zip(pre_chats, pre_users)) do
        assert Node.call(node, Locks, :held?, [chat, user, "pre-#{i}"])
      end

      # The load's own chats are free or their worker's: nothing else.
      for {chat, w} <- Enum.with_index(load_chats) do
        [[ref]] =
          TestDB.query!(
            "SELECT busy_turn_ref FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}'",
            url
          )

        assert ref in [nil, "load-#{w}"]
      end
    end
  end

  describe "a database that is down when the application starts" do
    @tag :slow
    test "the application starts, calls raise Locks.Error :connect at once, and serve " <>
           "once PostgreSQL is up, without a restart",
         %{dir: dir, url: url} do
      chats = TestDB.insert_chats!(20, url)
      users = for _ <- chats, do: TestDB.uuid()
      {_, 0} = Pg.run(Pg.crash_command(dir))
      on_exit(fn -> Pg.ensure_running!(dir) end)

      node = start_node(url)
      assert {_pid, {:ok, _}} = Node.hello(node)

      calls = for {c, u} <- Enum.zip(chats, users), do: {:acquire, [c, u, "down", 60]}
      answers = Node.call(node, Faults, :timed_many, [calls])

      for {answer, ms} <- answers do
        assert {:raised, %Error{reason: :connect, message: message}} = answer
        assert message =~ "database connection failed"
        assert ms <= @bound_ms
      end

      :ok = Pg.restart!(dir)

      # Within the back-off after the last refused connect (at most 2 s)
      # calls still fail at once, as documented; then the pool connects.
      probe = [{:held?, [hd(chats), hd(users), "probe"]}]

      ready? = fn ->
        match?([{{:ok, false}, _}], Node.call(node, Faults, :timed_many, [probe]))
      end

      assert :ok = Faults.until(ready?, 2_000 + @bound_ms)

      answers = Node.call(node, Faults, :timed_many, [calls])
      assert Enum.map(answers, &elem(&1, 0)) == List.duplicate({:ok, :ok}, 20)
    end
  end

  describe "a call kept running at the server past its deadline" do
    test "acquire/4 raises Locks.Error :timeout at the call's deadline, its statement is " <>
           "cancelled (it never takes the lock later), and the next one takes it",
         %{url: url} do
      [chat] = TestDB.insert_chats!(1, url)
      user = TestDB.uuid()
      node = start_node(url)
      stall = TestDB.stall!(user, url)

      [{answer, ms}] = Node.call(node, Faults, :timed_many, [[{:acquire, [chat, user, "t", 60]}]])
      assert {:raised, %Error{reason: :timeout}} = answer
      assert ms >= @call_timeout_ms - 100 and ms <= @bound_ms
      # A read is not held up by it.
      refute Node.call(node, Locks, :held?, [chat, user, "t"])

      # The cancel request stops the statement: no backend of the library
      # runs it any more. Were it left to run, it would take the lock the
      # moment it is let go, for a call that has already raised.
      assert :ok =
               Faults.until(
                 fn -> TestDB.stalled_backends("phoenix_kit_agent_locks", url) == [] end,
                 5_000
               )

      TestDB.unstall!(stall)

      assert TestDB.query!(
               "SELECT busy_turn_ref FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}'",
               url
             ) == [[nil]]

      assert Node.call(node, Locks, :acquire, [chat, user, "t", 60]) == :ok
    end
  end

  # Not a fault: this module's cluster is the one whose socket directory the
  # suite knows wherever DATABASE_URL points, and the `locks` role may log in
  # over it (scripts/pg).
  describe "a Unix socket directory (socket_dir)" do
    test "a call connects through the cluster's socket and takes its lock", %{dir: dir, url: url} do
      [chat] = TestDB.insert_chats!(1, url)
      %URI{port: port, path: "/" <> database} = URI.parse(url)
      socket = [socket_dir: Path.join(dir, "sock"), port: port, username: "locks"]
      node = Node.start!(app_env: [database: database] ++ socket ++ @timeouts)
      assert Node.call(node, Locks, :acquire, [chat, TestDB.uuid(), "over-the-socket", 60]) == :ok

      assert TestDB.query!(
               "SELECT busy_turn_ref FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}'",
               url
             ) == [["over-the-socket"]]
    end
  end
end
