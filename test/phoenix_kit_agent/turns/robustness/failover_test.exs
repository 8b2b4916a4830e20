defmodule PhoenixKitAgent.Turns.Robustness.FailoverTest do
  # A primary (A) and its streaming standby (B), made anew for each test
  # (Robust.Replica), seen from a separate BEAM whose repo names both the way
  # Postgrex does: `endpoints: [B, A]` (the standby first), `target_server_type:
  # :primary`. The failover is the one an operator or a tool runs: the primary
  # stops, the standby is promoted (`pg_ctl promote`), the old primary comes
  # back as a standby of the new one.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks.{Error, FakeRepo, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.{Node, Pg, Race, Replica}

  @moduletag :robustness
  @moduletag timeout: 180_000

  # Every call is cut off after checkout + connect + statement timeouts.
  @timeouts [connect_timeout: 1_000, checkout_timeout: 1_000, statement_timeout: 1_000]
  # How soon after the promotion calls answer again: the back-off's longest
  # pause (2 s, connect.rs's BACKOFF_MAX), which the calls made while there
  # was no primary have grown to, and one call's time (3 s).
  @failover_bound_ms 2_000 + 3_000

  setup do
    %{pair: Replica.pair!()}
  end

  # A node whose repo (a FakeRepo made in it) has `repo_config` and the
  # role's login, started with it; and the application_name its connections
  # show in pg_stat_activity.
  defp start_node(repo_config) do
    app = "locks_failover_#{System.unique_integer([:positive])}"

    node =
      Node.start!(app_env: [application_name: app, pool_size: 2] ++ @timeouts, start_app: false)

    login = [username: "locks", password: Replica.password(), database: "locks"]
    repo = Node.call(node, FakeRepo, :new, [repo_config ++ login])
    :ok = Node.call(node, Application, :put_env, [:phoenix_kit_agent_locks, :repo, repo])
    {:ok, _} = Node.call(node, Application, :ensure_all_started, [:phoenix_kit_agent_locks])
    {node, app}
  end

  defp now, do: System.monotonic_time(:millisecond)

  defp call(node, fun, args), do: Node.call(node, Race, :attempt, [fun, args])

  # Makes the call until it answers {:ok, :ok}, or until `deadline` (on the
  # monotonic clock, ms) has passed; every answer, in order.
  defp until_ok(node, [fun, args], deadline, answers \\ []) do
    answers = [call(node, fun, args) | answers]

    cond do
      hd(answers) == {:ok, :ok} ->
        Enum.reverse(answers)

      now() > deadline ->
        Enum.reverse(answers)

      true ->
        receive(
          do: (:never -> nil),
          after: (10 -> until_ok(node, [fun, args], deadline, answers))
        )
    end
  end

  defp endpoints(%{a: a, b: b}), do: [{"127.0.0.1", b.port}, {"127.0.0.1", a.port}]

  # A node on both servers, the standby (B) listed first, whose pool took a
  # lock ("before") on the primary (A), its one connection there; and a
  # second chat and user, free.
  defp locked_on_primary!(%{a: a} = pair) do
    [chat, chat2] = TestDB.insert_chats!(2, a.url)
    {user, user2} = {TestDB.uuid(), TestDB.uuid()}
    {node, app} = start_node(endpoints: endpoints(pair), target_server_type: :primary)
    assert call(node, :acquire, [chat, user, "before", 600]) == {:ok, :ok}
    assert Replica.connections(a.url, app) == 1
    {node, app, {chat, user}, {chat2, user2}}
  end

  test "after the primary stops and the standby is promoted, calls answer again within the " <>
         "bound, the lock taken before is still held, no call answers :statement, and the old " <>
         "primary back as a standby is passed over",
       %{pair: %{a: a, b: b} = pair} do
    {node, app, {chat, user}, {chat2, user2}} = locked_on_primary!(pair)
    assert Replica.connections(b.url, app) == 0

    # What the standby has not replayed, the failover loses (asynchronous replication).
    Replica.caught_up!(a.url, b.url)
    :ok = Pg.stop_fast!(a.dir)

    # No primary: a call answers :connect at once, naming each server and why.
    assert {:raised, %Error{reason: :connect, message: message}} =
             call(node, :acquire, [chat2, user2, "during", 600])

    assert message =~
             ~r/\Adatabase connection failed: 127\.0\.0\.1:#{b.port}: read-only \(transaction_read_only is on\): not the primary; 127\.0\.0\.1:#{a.port}: .*[Cc]onnection refused/

    # Calls go on while there is no primary, for a second: each one answers
    # :connect (at once, within the back-off, which they grow).
    window = until_ok(node, [:acquire, [chat2, user2, "during", 600]], now() + 1_000)
    assert Enum.all?(window, &match?({:raised, %Error{reason: :connect}}, &1)), inspect(window)

    promoting = now()
    :ok = Replica.promote!(b.dir)
    promoted = now()

    answers = until_ok(node, [:acquire, [chat2, user2, "after", 600]], promoted + 30_000)
    answered = now()

    IO.puts(
      "failover: #{length(window) + 1} calls while there was no primary; " <>
        "promote took #{promoted - promoting} ms; calls answered again " <>
        "#{answered - promoted} ms after it, #{length(answers)} calls"
    )

    assert List.last(answers) == {:ok, :ok}
    assert answered - promoted <= @failover_bound_ms

    for answer <- Enum.drop(answers, -1),
        do: assert({:raised, %Error{reason: :connect}} = answer)

    # The lock taken before the failover is held on the new primary.
    assert call(node, :held?, [chat, user, "before"]) == {:ok, true}

    assert call(node, :acquire, [chat, user2, "taker", 600]) ==
             {:ok, {:error, :conversation_busy}}

    assert Replica.connections(b.url, app) >= 1

    # The old primary comes back as a standby of the new one: a node that
    # lists it first (a multi-host URL) passes over it.
    :ok = Replica.standby_of!(a.dir, b.dir, a.port)
    Replica.until!(fn -> TestDB.query!("SELECT pg_is_in_recovery()", a.url) == [["t"]] end)

    url =
      "postgres://locks:#{Replica.password()}@127.0.0.1:#{a.port},127.0.0.1:#{b.port}/locks" <>
        "?target_session_attrs=read-write"

    app2 = "locks_failover_url_#{System.unique_integer([:positive])}"
    node2 = Node.start!(app_env: [url: url, application_name: app2, pool_size: 2] ++ @timeouts)
    assert {_pid, {:ok, _}} = Node.hello(node2)
    assert call(node2, :held?, [chat, user, "before"]) == {:ok, true}
    assert call(node2, :release, [chat, user, "before"]) == {:ok, :ok}
    assert Replica.connections(a.url, app2) == 0
    assert Replica.connections(b.url, app2) == 1
  end

  test "a connection whose server turns read-only (25006) is closed, not reused, and the call " <>
         "goes on to the new primary within its deadline",
       %{pair: %{a: a, b: b} = pair} do
    {node, app, {chat, user}, {chat2, user2}} = locked_on_primary!(pair)

    # The old primary is fenced read-only, as some failovers do, and keeps its
    # connections; the standby is promoted.
    TestDB.query!("ALTER SYSTEM SET default_transaction_read_only = on", a.url)
    TestDB.query!("SELECT pg_reload_conf()", a.url)
    Replica.caught_up!(a.url, b.url)
    :ok = Replica.promote!(b.dir)

    # The pool's idle connection is to A: its write meets 25006, the
    # connection is closed, and the call is answered by B.
    assert call(node, :acquire, [chat2, user2, "after", 600]) == {:ok, :ok}
    Replica.until!(fn -> Replica.connections(a.url, app) == 0 end, 5_000)
    assert Replica.connections(b.url, app) == 1
    assert call(node, :held?, [chat, user, "before"]) == {:ok, true}
  end
end
