defmodule PhoenixKitAgent.Turns.Robustness.FreezeTest do
  # A database that hangs (a failover, a black-holed path, a long lock wait)
  # must not freeze the VM. Every lock call waits on a dirty-I/O scheduler
  # for as long as its statement takes; at most pool_size of them run (8 of
  # the VM's 10 by default), the rest wait their turn on a normal scheduler.
  # So with the database frozen (SIGSTOP of every process of the test's own
  # second cluster, _build/pg-faults) and 50 callers in a child node of
  # default settings but short timeouts:
  #
  #   * a process that has nothing to do with the locks reads and writes a
  #     file as fast as ever (two dirty-I/O schedulers stay free);
  #   * the normal schedulers answer as fast as ever (the probe's p99);
  #   * every call ends within its timeout + 1 s, with its documented
  #     reason: the 8 running ones :timeout, the 42 waiting ones :pool_timeout,
  #     also with a pool_size of 10 or 1000 (cut to 8: Config);
  #   * Application.stop/1 returns at once;
  #   * once the database thaws, the next call succeeds.
  #
  # Not async: the probe and the file I/O time this VM's schedulers, which
  # other test modules' CPU-bound work would slow (a CI run saw the probe
  # take 586 samples instead of over 1,000 while async modules ran beside it).
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Config, Error, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.{Node, Pg}
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.{Faults, Freeze}

  @moduletag :robustness
  @moduletag timeout: 180_000

  @timeouts [checkout_timeout: 1_000, connect_timeout: 1_000, statement_timeout: 2_000]
  @call_ms 4_000
  @checkout_ms 1_000
  @callers 50

  setup_all do
    {dir, url} = Pg.take_faults_cluster!()
    TestDB.query!(PhoenixKitAgent.Turns.Locks.Native.ddl(:tables, nil), url)
    %{dir: dir, url: url}
  end

  setup %{dir: dir, url: url} = context do
    :ok = Pg.ensure_running!(dir)
    chats = TestDB.insert_chats!(@callers, url)
    name = "locks_freeze_#{System.unique_integer([:positive])}"
    size = if context[:pool_size], do: [pool_size: context[:pool_size]], else: []
    node = Node.start!(app_env: [url: url, application_name: name] ++ size ++ @timeouts)
    assert {_pid, {:ok, _}} = Node.hello(node)
    warm!(node, url, name, hd(chats))
    on_exit(fn -> Pg.signal!(dir, "CONT") end)
    %{node: node, chats: chats}
  end

  # Opens every connection of the pool: pool_size calls kept running together
  # (TestDB.stall!/2), so each needs a connection of its own. Then the frozen
  # calls reach the server on them instead of trying to connect.
  defp warm!(node, url, name, _chat) do
    pool_size = Config.default_pool_size()
    chats = TestDB.insert_chats!(pool_size, url)
    users = for _ <- 1..pool_size, do: TestDB.uuid()
    stalls = for user <- users, do: TestDB.stall!(user, url)
    calls = for {chat, user} <- Enum.zip(chats, users), do: {:acquire, [chat, user, "warm", 60]}
    waiting = Node.async(node, Faults, :timed_many, [calls])

    assert :ok =
             Faults.until(
               fn -> length(TestDB.stalled_backends(name, url)) == pool_size end,
               10_000
             )

    Enum.each(stalls, &TestDB.unstall!/1)
    assert length(Node.await(node, waiting)) == pool_size
  end

  defp freeze!(dir, node, chats, opts) do
    Pg.signal!(dir, "STOP")
    calls = for chat <- chats, do: {:acquire, [chat, TestDB.uuid(), "frozen", 60]}
    result = Node.call(node, Freeze, :run, [calls, [after_ms: 200] ++ opts])
    Pg.signal!(dir, "CONT")
    result
  end

  # The default pool_size, every Phoenix repo's (10, all of the VM's dirty-I/O
  # schedulers), and the largest accepted: at most 8 calls run at once.
  for size <- [nil, 10, 1_000] do
    @tag pool_size: size
    test "50 callers, pool_size #{size || "by default"}: file I/O and the normal schedulers " <>
           "stay fast, every call ends in time with its reason, and the next call after the " <>
           "thaw succeeds",
         %{dir: dir, url: url, node: node, chats: chats} do
      result = freeze!(dir, node, chats, [])

      assert result.read_ms < 50, "File.read! took #{result.read_ms} ms"
      assert result.write_ms < 50, "File.write! took #{result.write_ms} ms"
      assert result.probe.rtt.n > 1_000
      assert result.probe.rtt.p99 < 1_000, "probe p99 #{result.probe.rtt.p99} µs"

      reasons =
        Enum.frequencies_by(result.answers, fn {{:raised, %Error{reason: r}}, _ms} -> r end)

      pool_size = Config.default_pool_size()
      assert reasons == %{timeout: pool_size, pool_timeout: @callers - pool_size}

      for {{:raised, %Error{reason: reason}}, ms} <- result.answers do
        bound = if reason == :timeout, do: @call_ms, else: @checkout_ms
        assert ms >= bound - 100 and ms <= bound + 1_000, "#{reason} after #{ms} ms"
      end

      chat = hd(chats)

      assert :ok =
               Faults.until(
                 fn -> Node.call(node, Locks, :held?, [chat, chat, "x"]) == false end,
                 10_000
               )

      # A chat of its own: the frozen acquires the server had received ran
      # when it thawed (see the README's "Limits").
      [fresh] = TestDB.insert_chats!(1, url)
      assert Node.call(node, Locks, :acquire, [fresh, TestDB.uuid(), "thawed", 60]) == :ok
    end
  end

  test "Application.stop/1 returns within a second while 50 callers wait on the frozen database",
       %{dir: dir, url: url, node: node, chats: chats} do
    result = freeze!(dir, node, chats, stop_app: true)

    assert result.stop_ms < 1_000, "Application.stop took #{result.stop_ms} ms"

    for {{:raised, %Error{reason: reason}}, ms} <- result.answers do
      assert reason in [:timeout, :pool_timeout, :not_started]
      assert ms <= @call_ms + 1_000
    end

    {:ok, _} = Node.call(node, Application, :ensure_all_started, [:phoenix_kit_agent_locks])

    [fresh] = TestDB.insert_chats!(1, url)
    assert Node.call(node, Locks, :acquire, [fresh, TestDB.uuid(), "restarted", 60]) == :ok
  end
end
