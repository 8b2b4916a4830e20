defmodule PhoenixKitAgent.Turns.Robustness.StormTest do
  # Storms on the queue (native/locks_core/src/queue.rs) in a child node with
  # a pool of two (Robust.Scenarios.Storm): whatever happens around a call
  # (its caller killed in line, right as its slot arrives or while it runs,
  # the application stopped and started again, a checkout deadline gone
  # before the caller even asks), the queue ends idle, no caller is left a
  # message, and no call that released its locks leaves a row locked.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks.TestDB
  alias PhoenixKitAgent.Turns.Locks.Robust.Node
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Storm

  @moduletag :robustness

  defp node!(timeouts) do
    app = "storm-test-#{System.unique_integer([:positive])}"

    node =
      Node.start!(app_env: [url: TestDB.url(), application_name: app, pool_size: 2] ++ timeouts)

    assert {_pid, {:ok, _}} = Node.hello(node)
    node
  end

  # A stamp goes stale before run/3 when the caller is descheduled, or a
  # handler of the call's :start event takes longer than the checkout
  # timeout; the scenario makes it certain with a stamp an hour old.
  @tag :slow
  test "a caller whose checkout deadline passed before it asked for a slot is left no " <>
         "message, even when a slot frees as it asks" do
    node = node!(checkout_timeout: 5_000)
    counts = Node.call(node, Storm, :stale, [[ms: 4_000, callers: 20]])

    assert counts.pool_timeout > 1_000, inspect(counts)
    assert %{stray: 0, pool: %{running: 0, waiting: 0}} = counts
  end

  # The end of a call whose caller was killed while it ran hands the slot on
  # from a dead process: its `:go` is sent by the NIF's own thread (call.rs,
  # `later/1`). When that `:go` comes late,
  # after the waiter it was for has left at its deadline and taken a slot
  # again, it must not announce the old one. (A timing race: it showed in
  # most 10 s runs, 1-9 strays in ~90,000 calls; never without the kills.)
  @tag :slow
  test "callers killed while their call runs hand the slot on with no message left to " <>
         "the waiter it goes to" do
    node = node!(checkout_timeout: 1, connect_timeout: 2_000, statement_timeout: 2_000)
    counts = Node.call(node, Storm, :killed_in_run, [[ms: 12_000, callers: 30]])

    assert counts.kills > 1_000, inspect(counts)
    assert counts.ok > 1_000, inspect(counts)
    assert [] == for({{:stray, _} = stray, n} <- counts, do: {stray, n})
    assert %{running: 0, waiting: 0} = counts.pool
  end

  @tag :slow
  test "2,000 callers on a pool of two, random kills (also right as a slot or an answer " <>
         "arrives), five stops and starts, a 20 ms checkout timeout: the queue ends idle, " <>
         "no mailbox holds a message, no released lock is left" do
    chats = for _ <- 1..2_000, do: TestDB.uuid()
    for part <- Enum.chunk_every(chats, 500), do: TestDB.query!(TestDB.insert_chats_sql(part))
    calls = for chat <- chats, do: {chat, TestDB.uuid(), "storm-" <> chat}
    node = node!(checkout_timeout: 20, connect_timeout: 2_000, statement_timeout: 2_000)

    storm =
      Node.call(node, Storm, :run, [
        [calls: calls, kills: 300, kill_on_answer: 0.3, cycles: 5, spread_ms: 3_000]
      ])

    refute Map.has_key?(storm.results, :stuck), inspect(storm.results[:stuck])
    assert storm.cycles == 5
    assert %{go: go, answer: answer} = storm.arrival_kills
    assert go > 2 and answer > 5, inspect(storm.arrival_kills)
    assert %{running: 0, waiting: 0} = storm.pool

    outcomes =
      Enum.frequencies_by(storm.results, fn
        {_, {:killed, _}} -> :killed
        {_, {_, {acquire, release, _}}} -> {acquire, release}
      end)

    allowed = [{:ok, :ok}, {:raised, :pool_timeout}, {:raised, :not_started}]

    for {{acquire, release}, _} <- outcomes do
      assert acquire in allowed, inspect(outcomes)
      assert release == nil or release in allowed, inspect(outcomes)
    end

    assert outcomes[{{:ok, :ok}, {:ok, :ok}}] > 100, inspect(outcomes)
    assert outcomes[:killed] > 100, inspect(outcomes)

    assert [] == for({i, {_, {_, _, [_ | _] = left}}} <- storm.results, do: {i, left})
    refute Map.has_key?(storm.mailboxes, :stuck)
    assert [] == for({i, [_ | _] = left} <- storm.mailboxes, do: {i, left})

    released = for {i, {_, {{:ok, :ok}, {:ok, :ok}, _}}} <- storm.results, do: Enum.at(chats, i)
    ids = Enum.map_join(released, ",", &"'#{&1}'")

    assert [] ==
             TestDB.query!("""
             SELECT uuid, busy_turn_ref FROM phoenix_kit_agent_conversations
             WHERE uuid IN (#{ids}) AND busy_turn_ref IS NOT NULL
             """)
  end
end
