defmodule PhoenixKitAgent.Turns.Robustness.TurnRestartTest do
  # with_turn/4's ending across a database restart (`pg_ctl stop -m fast`,
  # then start), against the fault cluster of the robustness suite
  # (_build/pg-faults, taken in turn with the other modules that stop it):
  # the answer stays the truth, the release is tried again within the
  # lease, and what finally cannot be released is logged and reported.
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{AppEnv, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.Pg
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Faults

  @moduletag :robustness
  @moduletag timeout: 180_000

  @ttl 60
  @timeouts [connect_timeout: 500, checkout_timeout: 500, statement_timeout: 500]

  setup_all do
    {dir, url} = Pg.take_faults_cluster!()
    TestDB.query!(PhoenixKitAgent.Turns.Locks.Native.ddl(:tables, nil), url)
    %{dir: dir, url: url}
  end

  setup %{dir: dir, url: url} do
    # Every test starts with the cluster up (a failed test may have left it down).
    :ok = Pg.ensure_running!(dir)
    AppEnv.restore_on_exit()
    :ok = AppEnv.restart([url: url, pool_size: 2] ++ @timeouts)
    :telemetry.attach()
    on_exit(fn -> :telemetry.detach() end)
    %{chat: TestDB.insert_chat!(url), user: TestDB.uuid()}
  end

  # The chat's lock: [ref, whether a taker with the TTL may take it over].
  defp chat_lock(chat, url) do
    TestDB.query!(
      "SELECT busy_turn_ref, busy_since < now() - #{@ttl} * interval '1 second' " <>
        "FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}'",
      url
    )
  end

  test "the database restarts as the turn ends: {:ok, _}, and the release goes through once " <>
         "it is back, within the lease",
       %{dir: dir, url: url, chat: chat, user: user} do
    {result, log} =
      with_log(fn ->
        Locks.with_turn(chat, user, [ttl_s: @ttl, lease_s: 10], fn turn ->
          :ok = Pg.stop_fast!(dir)
          # Down for a second, then back: while the ending tries its release.
          Task.start(fn -> Process.sleep(1_000) && Pg.restart!(dir) end)
          turn.ref
        end)
      end)

    # fun returned within its lease, and nothing answered that it was lost.
    assert {:ok, "turn-" <> _} = result
    assert chat_lock(chat, url) == [[nil, nil]]
    refute log =~ "could not release"
    refute_received {:turn_lock_lost, _}
  end

  test "the database stays down past the lease: {:ok, _}, a warning and an event; the lock " <>
         "is then free for a taker with the TTL",
       %{dir: dir, url: url, chat: chat, user: user} do
    {result, log} =
      with_log(fn ->
        Locks.with_turn(chat, user, [ttl_s: @ttl, lease_s: 2], fn turn ->
          :ok = Pg.stop_fast!(dir)
          turn.ref
        end)
      end)

    assert {:ok, ref} = result
    assert log =~ "could not release the locks of #{ref} (conversation #{chat}, user #{user})"
    refute log =~ "postgres://"

    assert_received {:telemetry, [:phoenix_kit_agent_locks, :turn, :release_failed], %{},
                     %{ref: ^ref, conversation_uuid: ^chat, reason: :connect}}

    refute_received {:turn_lock_lost, _}
    :ok = Pg.restart!(dir)
    # Still the turn's, and stale for a taker with the TTL once lease_s (2 s)
    # has passed since its acquire: at once when the restart took that long.
    assert :ok == Faults.until(fn -> chat_lock(chat, url) == [[ref, "t"]] end, 3_000)
    assert once_connected(fn -> Locks.acquire(chat, TestDB.uuid(), "taker", @ttl) end) == :ok
  end

  # `fun`'s answer once the pool connects again: its back-off after failed
  # connections (up to 2 s) fails calls at once with :connect meanwhile.
  defp once_connected(fun, tries \\ 100) do
    fun.()
  rescue
    error in Locks.Error ->
      if error.reason == :connect and tries > 0 do
        Process.sleep(50)
        once_connected(fun, tries - 1)
      else
        reraise error, __STACKTRACE__
      end
  end
end
