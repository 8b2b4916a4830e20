defmodule PhoenixKitAgent.Turns.NetworkTest do
  # The network between the library and PostgreSQL, through a proxy of the
  # suite's own (test/support/proxy.ex): paths that go silent for old
  # connections or for all, answers that come too late or never, servers that
  # end sessions or refuse new ones. Each test restarts the application on
  # the proxy's URL with an application_name of its own (so its backends can
  # be found in pg_stat_activity) and small timeouts: every call is cut off
  # after checkout + connect + statement timeouts, 5 s. (The checkout and
  # connect timeouts are 2 s rather than 1 s: on a loaded 2-core machine a
  # dirty scheduler or a login through the proxy has been seen to wait
  # about a second, which would fail a test before it tested anything.)
  #
  # What they prove: a connection in an unknown state is never used again
  # (the proxy shows no bytes on it after the failure), a timed-out
  # statement cannot come back as a ghost lock, the reason of an error says
  # whether the statement may have run, and a refusing server is not
  # hammered.
  use PhoenixKitAgent.Turns.LockCase, async: false

  alias PhoenixKitAgent.Turns.Locks.{AppEnv, Error, Proxy}

  @moduletag :network

  @timeouts [connect_timeout: 2_000, checkout_timeout: 2_000, statement_timeout: 1_000]
  @call_ms 5_000
  # What a timed-out call may take beyond its deadline on a noisy 2-core machine.
  @slack_ms 1_000
  @timeout_message "timed out after #{@call_ms} ms waiting for the database"
  @lost "connection lost while the statement was in flight: "
  # The back-off's longest pause (connect.rs BACKOFF_MAX).
  @backoff_max_ms 2_000

  setup do
    AppEnv.restore_on_exit()
    proxy = start_supervised!({Proxy, TestDB.url()})
    %{proxy: proxy, app: "locks_network_#{System.unique_integer([:positive])}"}
  end

  defp start_app!(url, app, pool_size) do
    env = [url: url, application_name: app, pool_size: pool_size] ++ @timeouts
    :ok = AppEnv.restart(env)
  end

  # `{milliseconds, {:ok, answer} | {:error, %Error{}}}` of one call.
  defp timed(fun) do
    start = System.monotonic_time(:millisecond)

    answer =
      try do
        {:ok, fun.()}
      rescue
        e in Error -> {:error, e}
      end

    {System.monotonic_time(:millisecond) - start, answer}
  end

  # Asserts that `fun`'s call raised :timeout after the call's whole budget.
  defp assert_times_out(fun) do
    {ms, answer} = timed(fun)
    assert {:error, %Error{reason: :timeout, message: @timeout_message, sqlstate: nil}} = answer
    assert ms in @call_ms..(@call_ms + @slack_ms)
  end

  # Polls `fun` until it returns a truthy value, for at most `ms`; that
  # value, or the last falsy one.
  defp eventually(ms, fun), do: eventually(System.monotonic_time(:millisecond) + ms, fun, nil)

  defp eventually(deadline, fun, _last) do
    value = fun.()

    cond do
      value -> value
      System.monotonic_time(:millisecond) > deadline -> value
      true -> receive(after: (10 -> eventually(deadline, fun, value)))
    end
  end

  # The backends of this test's pool, by pid.
  defp backends(app) do
    for [pid] <-
          TestDB.query!("SELECT pid FROM pg_stat_activity WHERE application_name = '#{app}'"),
        do: String.to_integer(pid)
  end

  # Waits until the backend `pid` has exited: it has read all its input,
  # so whatever the proxy delivered to it has run.
  defp await_exit!(pid) do
    assert eventually(5_000, fn ->
             TestDB.query!("SELECT count(*) FROM pg_stat_activity WHERE pid = #{pid}") == [["0"]]
           end)
  end

  # The backend of `app` that a TestDB.stall!/1 keeps running, if any.
  defp waiting_backend(app) do
    case TestDB.stalled_backends(app) do
      [[pid]] -> String.to_integer(pid)
      [] -> nil
    end
  end

  # Runs every statement the tests use once, on a chat of its own, so that
  # the pool's connection has them prepared: a call on it is then one round
  # trip whose request is the statement itself (not a Parse that a silent
  # path would keep from ever executing).
  defp warm! do
    [chat] = insert_chats!(1)
    {user, turn} = {new_user(), turn_ref("warm")}
    :ok = Locks.acquire(chat, user, turn, 60)
    true = Locks.held?(chat, user, turn)
    false = Locks.release_stale(chat, user, turn, 60)
    :ok = Locks.release(chat, user, turn)
  end

  # The app on `proxy` with `pool_size` warm connections, and a new chat,
  # user and turn ref.
  defp turn_through!(proxy, app, pool_size) do
    start_app!(Proxy.url(proxy), app, pool_size)
    [chat] = insert_chats!(1)
    {user, turn} = {new_user(), turn_ref()}
    warm!()
    {chat, user, turn}
  end

  defp old?(since), do: &(&1.accepted_at < since)

  describe "a path that goes silent for the pool's connections" do
    test "the first call times out, the next ones run at once on new connections, and no " <>
           "byte is ever sent again on an old one",
         %{proxy: proxy, app: app} do
      start_app!(Proxy.url(proxy), app, 3)
      [chat] = insert_chats!(1)
      users = for _ <- 1..3, do: new_user()

      # Three calls kept running together (TestDB.stall!/1): three connections.
      chats = [chat | insert_chats!(2)]
      stalls = Enum.map(users, &TestDB.stall!/1)

      calls =
        for {c, u} <- Enum.zip(chats, users), do: Task.async(Locks, :acquire, [c, u, "w", 60])

      assert eventually(5_000, fn -> length(TestDB.stalled_backends(app)) == 3 end)
      Enum.each(stalls, &TestDB.unstall!/1)
      assert Task.await_many(calls) == [:ok, :ok, :ok]

      assert [1, 2, 3] == Enum.map(Proxy.connections(proxy), & &1.id)

      switched = System.monotonic_time()
      :ok = Proxy.mode(proxy, :blackhole_old)

      assert_times_out(fn -> Locks.held?(chat, hd(users), "probe") end)
      failed = System.monotonic_time()

      # The next call opens a connection and answers at once: the whole
      # recovery took about one timeout.
      {ms, answer} = timed(fn -> Locks.held?(chat, hd(users), "probe") end)
      assert answer == {:ok, false}
      assert ms < @slack_ms

      recovered_ms =
        System.convert_time_unit(System.monotonic_time() - switched, :native, :millisecond)

      assert recovered_ms in @call_ms..(@call_ms + @slack_ms)

      for _ <- 1..5, do: assert(Locks.held?(chat, hd(users), "probe") == false)

      # The client reset all three old connections: the one whose request
      # was buffered in the black hole (dropping it), and the idle ones.
      :ok =
        Proxy.await(
          proxy,
          fn conns -> Enum.all?(Enum.take(conns, 3), &(&1.client != :open)) end,
          2_000
        )

      {old, new} = Enum.split_with(Proxy.connections(proxy), old?(switched))
      assert Enum.map(old, & &1.client) == [:reset, :reset, :reset]

      # One old connection got the timed-out request, and it is what the
      # reset dropped; after the failure not one byte went to any of them.
      sent_after_switch = for c <- old, do: Proxy.bytes(c, :received, switched)
      assert [request] = Enum.reject(sent_after_switch, &(&1 == 0))
      assert Enum.map(old, & &1.dropped) == Enum.map(sent_after_switch, & &1)
      assert request > 0
      assert Enum.map(old, &Proxy.bytes(&1, :received, failed)) == [0, 0, 0]

      # So the calls after the failure ran on connections opened after the switch.
      assert new != []
      assert Enum.sum(Enum.map(new, &Proxy.bytes(&1, :forwarded, failed))) > 0
    end

    test "a timed-out acquire/4, then release/3 under its ref, leave no ghost lock when " <>
           "the path returns",
         %{proxy: proxy, app: app} do
      {chat, user, turn} = turn_through!(proxy, app, 2)
      [backend] = backends(app)

      :ok = Proxy.mode(proxy, :blackhole_old)
      assert_times_out(fn -> Locks.acquire(chat, user, turn, 60) end)

      # The documented way out, on a new connection.
      failed = System.monotonic_time()
      assert Locks.release(chat, user, turn) == :ok
      assert [first | _new] = Proxy.connections(proxy)
      assert Proxy.bytes(first, :received, failed) == 0

      # The path returns once the client has closed the old connection.
      :ok = Proxy.await(proxy, fn [first | _] -> first.client != :open end, 2_000)
      :ok = Proxy.restore(proxy)
      :ok = Proxy.await(proxy, fn [first | _] -> first.done end, 2_000)
      await_exit!(backend)

      assert locks(chat: chat, user: user) == [chat: {nil, nil}, user: nil]
      # Because the client reset the connection: its buffered request was dropped.
      assert [%{client: :reset, dropped: dropped} | _] = Proxy.connections(proxy)
      assert dropped > 0
    end

    test "a timed-out acquire/4 kept running at the server is cancelled there: letting it " <>
           "go on does not let it run",
         %{proxy: proxy, app: app} do
      {chat, user, turn} = turn_through!(proxy, app, 2)
      [backend] = backends(app)
      stall = TestDB.stall!(user)

      assert_times_out(fn -> Locks.acquire(chat, user, turn, 60) end)

      # Cancelled, the backend stops (and ends: its client reset the
      # connection) while it would still be kept.
      stopped_waiting = eventually(2_000, fn -> waiting_backend(app) == nil end)
      TestDB.unstall!(stall)
      await_exit!(backend)

      assert locks(chat: chat, user: user) == [chat: {nil, nil}, user: nil]
      assert stopped_waiting
    end
  end

  describe "answers that come late" do
    test "a reply held past the deadline: :timeout, the statement ran, and release/3 " <>
           "under the same ref frees both locks",
         %{proxy: proxy, app: app} do
      {chat, user, turn} = turn_through!(proxy, app, 2)

      :ok = Proxy.mode(proxy, {:delay_replies, @call_ms + 2_000})
      assert_times_out(fn -> Locks.acquire(chat, user, turn, 60) end)
      # :timeout means "may have run": here it did.
      assert [chat: {^turn, _}, user: {^turn, _}] = locks(chat: chat, user: user)

      :ok = Proxy.restore(proxy)
      assert Locks.release(chat, user, turn) == :ok
      assert locks(chat: chat, user: user) == [chat: {nil, nil}, user: {nil, nil}]
      assert [%{client: :reset} | _] = Proxy.connections(proxy)
    end
  end

  describe "a connection lost while the statement is in flight" do
    test "a backend terminated while acquire/4 runs: :disconnected naming 57P01, and the " <>
           "next call runs on a new connection",
         %{proxy: proxy, app: app} do
      {chat, user, turn} = turn_through!(proxy, app, 1)
      stall = TestDB.stall!(user)

      task = Task.async(fn -> timed(fn -> Locks.acquire(chat, user, turn, 60) end) end)
      backend = eventually(2_000, fn -> waiting_backend(app) end)
      assert TestDB.query!("SELECT pg_terminate_backend(#{backend})") == [["t"]]
      {ms, answer} = Task.await(task)
      TestDB.unstall!(stall)

      assert answer ==
               {:error,
                %Error{
                  reason: :disconnected,
                  message: @lost <> "terminating connection due to administrator command (57P01)",
                  sqlstate: nil
                }}

      assert ms < @call_ms
      failed = System.monotonic_time()
      assert Locks.acquire(chat, user, turn, 60) == :ok
      assert [chat: {^turn, 0}, user: {^turn, 0}] = locks(chat: chat, user: user)
      assert [%{id: 1} = first, %{id: 2} = second] = Proxy.connections(proxy)
      assert Proxy.bytes(first, :received, failed) == 0
      assert Proxy.bytes(second, :forwarded, failed) > 0
    end

    test "a connection cut after acquire/4's request went through: :disconnected, and " <>
           "the lock was taken",
         %{proxy: proxy, app: app} do
      {chat, user, turn} = turn_through!(proxy, app, 1)

      {ms, answer} =
        cut_after_request(proxy, fn -> Locks.acquire(chat, user, turn, 60) end, fn ->
          match?([chat: {^turn, _}, user: {^turn, _}], locks(chat: chat, user: user))
        end)

      assert answer == {:error, reset_error()}
      assert ms < @call_ms
      assert [chat: {^turn, _}, user: {^turn, _}] = locks(chat: chat, user: user)

      :ok = Proxy.restore(proxy)
      assert Locks.release(chat, user, turn) == :ok
      assert locks(chat: chat, user: user) == [chat: {nil, nil}, user: {nil, nil}]
    end

    test "release_stale/4 whose answer is lost: :disconnected; called again it answers " <>
           "false and the locks are free",
         %{proxy: proxy, app: app} do
      {chat, user, turn} = turn_through!(proxy, app, 1)
      assert Locks.acquire(chat, user, turn, 60) == :ok
      backdate!([chat: chat, user: user], 61)

      {_ms, answer} =
        cut_after_request(proxy, fn -> Locks.release_stale(chat, user, turn, 60) end, fn ->
          locks(chat: chat, user: user) == [chat: {nil, nil}, user: {nil, nil}]
        end)

      assert answer == {:error, reset_error()}

      :ok = Proxy.restore(proxy)
      assert Locks.release_stale(chat, user, turn, 60) == false
      assert locks(chat: chat, user: user) == [chat: {nil, nil}, user: {nil, nil}]
    end
  end

  # Runs `fun` with its reply held by the proxy; once its statement has
  # gone through to the server and run (`ran?`, read with psql), cuts
  # (resets) its connection: the answer is lost. What `fun` got.
  defp cut_after_request(proxy, fun, ran?) do
    :ok = Proxy.mode(proxy, {:delay_replies, 60_000})
    since = System.monotonic_time()
    task = Task.async(fn -> timed(fun) end)
    through? = &Enum.filter(&1, fn c -> Proxy.bytes(c, :forwarded, since) > 0 end)
    :ok = Proxy.await(proxy, &(through?.(&1) != []), 2_000)
    [%{id: id}] = through?.(Proxy.connections(proxy))
    assert eventually(2_000, ran?)
    :ok = Proxy.cut(proxy, id)
    Task.await(task)
  end

  # What a reset connection looks like to tokio-postgres' client: its
  # connection task ended, whatever the socket error was.
  defp reset_error,
    do: %Error{reason: :disconnected, message: @lost <> "connection closed", sqlstate: nil}

  describe "a server that refuses connections" do
    setup do
      role = "locks_network_full_#{System.unique_integer([:positive])}"

      TestDB.query!("""
      CREATE ROLE #{role} LOGIN PASSWORD 'pw' CONNECTION LIMIT 0;
      GRANT SELECT ON phoenix_kit_agent_conversations, phoenix_kit_agent_user_settings TO #{role}
      """)

      on_exit(fn ->
        TestDB.query!("""
        SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '#{role}';
        DROP OWNED BY #{role};
        DROP ROLE #{role}
        """)
      end)

      %{role: role}
    end

    test "53300: attempts are spaced by the back-off, calls in between fail at once with " <>
           "the last error, and calls succeed once the server accepts again",
         %{proxy: proxy, app: app, role: role} do
      url = TestDB.url() |> URI.parse() |> Map.put(:userinfo, "#{role}:pw") |> URI.to_string()
      start_app!(Proxy.url(proxy, url), app, 2)
      [chat] = insert_chats!(1)
      {user, turn} = {new_user(), turn_ref()}
      call = fn -> Locks.held?(chat, user, turn) end

      refusal =
        ~s{database connection failed: 127.0.0.1:#{Proxy.port(proxy)}: } <>
          ~s{too many connections for role "#{role}" (53300)}

      answers = hammer(1_000, call)
      attempts = Proxy.connections(proxy)
      assert_backed_off(answers, attempts, 3..6)

      assert Enum.uniq(
               for {_, {:error, e}} <- answers,
                   do: e.message |> String.split(" (not retried") |> hd()
             ) == [refusal]

      TestDB.query!("ALTER ROLE #{role} CONNECTION LIMIT -1")
      assert_recovers(call)
    end

    test "connections closed at once: the same back-off, and a success resets it",
         %{proxy: proxy, app: app} do
      :ok = Proxy.mode(proxy, :refuse)
      start_app!(Proxy.url(proxy), app, 2)
      [chat] = insert_chats!(1)
      {user, turn} = {new_user(), turn_ref()}
      call = fn -> Locks.held?(chat, user, turn) end

      answers = hammer(1_000, call)
      attempts = Proxy.connections(proxy)
      assert Enum.all?(attempts, &(&1.client == :refused))
      assert_backed_off(answers, attempts, 3..6)

      :ok = Proxy.restore(proxy)
      assert_recovers(call)

      # The pool's connection is cut and new ones are refused again: the
      # attempts start over 50 ms apart, not where the last failures left off.
      :ok = Proxy.mode(proxy, :refuse)
      since = System.monotonic_time()
      open = for %{client: :open, done: false, id: id} <- Proxy.connections(proxy), do: id
      for id <- open, do: :ok = Proxy.cut(proxy, id)
      :ok = Proxy.await(proxy, &Enum.all?(&1, fn c -> c.id not in open or c.done end), 2_000)

      answers = hammer(400, call)
      attempts = Enum.filter(Proxy.connections(proxy), &(&1.accepted_at >= since))
      assert_backed_off(answers, attempts, 2..5)
    end
  end

  describe "a peer that never answers the login" do
    test "the connect error names the host and port after the connect timeout", %{
      proxy: proxy,
      app: app
    } do
      :ok = Proxy.mode(proxy, :blackhole_all)
      start_app!(Proxy.url(proxy), app, 1)

      error = assert_raise Error, fn -> Locks.held?(TestDB.uuid(), TestDB.uuid(), turn_ref()) end

      assert {error.reason, error.message} ==
               {:connect,
                "database connection failed: 127.0.0.1:#{Proxy.port(proxy)}: no connection within 2000 ms"}
    end
  end

  # Calls `fun` in a tight loop for `ms`: `[{milliseconds, answer}]`, every
  # call started within the time (the last one too, even if it ends after).
  defp hammer(ms, fun), do: hammer(System.monotonic_time(:millisecond) + ms, fun, [])

  defp hammer(until, fun, acc) do
    if System.monotonic_time(:millisecond) < until,
      do: hammer(until, fun, [timed(fun) | acc]),
      else: Enum.reverse(acc)
  end

  # Every call failed with :connect, fast (well within the connect timeout
  # it would wait on a hung attempt). The calls that made an attempt are the
  # connections the proxy saw: `expected` of them, spaced by the doubling
  # back-off, among many calls. (In a 1 s loop that is 5 at most, at 0, 50,
  # 150, 350 and 750 ms, less the jitter; a 6th when the last call, started
  # in time, ran late on a loaded machine.) Every other call carries the
  # message of the attempt before it and the time left until the next.
  defp assert_backed_off(answers, attempts, expected) do
    messages =
      for {ms, answer} <- answers do
        assert {:error, %Error{reason: :connect, message: message, sqlstate: nil}} = answer
        assert ms < @slack_ms
        message
      end

    {tried, _last} =
      Enum.reduce(messages, {0, nil}, fn message, {tried, last} ->
        case Regex.run(~r/\A(.*) \(not retried for (\d+) ms\)\z/, message) do
          [_, previous, left] ->
            assert previous == last
            assert String.to_integer(left) in 1..@backoff_max_ms
            {tried, last}

          nil ->
            assert String.starts_with?(message, "database connection failed: ")
            {tried + 1, message}
        end
      end)

    assert tried == length(attempts)
    assert tried in expected
    assert length(answers) >= 10 * tried

    # Each pause doubles from 50 ms, less up to a quarter of it at random.
    gaps =
      attempts
      |> Enum.map(&System.convert_time_unit(&1.accepted_at, :native, :millisecond))
      |> Enum.chunk_every(2, 1, :discard)
      |> Enum.map(fn [a, b] -> b - a end)

    for {gap, i} <- Enum.with_index(gaps) do
      nominal = min(50 * 2 ** i, @backoff_max_ms)
      assert gap in div(nominal * 3, 4)..(nominal + @slack_ms), inspect(gaps)
    end
  end

  # Calls succeed again at the latest once the longest pause has passed.
  defp assert_recovers(call) do
    start = System.monotonic_time(:millisecond)
    answer = eventually(@backoff_max_ms + @slack_ms, fn -> match?({_, {:ok, _}}, timed(call)) end)
    assert answer
    assert System.monotonic_time(:millisecond) - start <= @backoff_max_ms + @slack_ms
    assert call.() == false
  end
end
