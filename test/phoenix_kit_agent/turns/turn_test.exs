defmodule PhoenixKitAgent.Turns.TurnTest do
  # with_turn/4: a turn on a short lease, kept alive by a keeper process,
  # released however it ends; a turn whose lease is lost is told so. The
  # keeper's renewals are watched through the :telemetry stand-in
  # (test/support/telemetry.ex), never by sleeping. async: false: some tests
  # restart the application (short timeouts, a graceful stop).
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{AppEnv, TestDB, Turn}
  alias PhoenixKitAgent.Turns.Locks.Robust.Pg
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Faults

  # A 3-second lease: the keeper renews it every second.
  @ttl 3

  setup do
    AppEnv.restore_on_exit()
    :telemetry.attach()
    on_exit(fn -> :telemetry.detach() end)
    %{chat: TestDB.insert_chat!(), user: TestDB.uuid()}
  end

  defp keepers, do: DynamicSupervisor.count_children(Locks.Keepers).active

  defp free?(chat, user),
    do: {TestDB.lock(:chat, chat), TestDB.lock(:user, user)} == {{nil, nil}, {nil, nil}}

  # Waits for the keeper's next renewal (a keep/5 call) and its result.
  # A process running a turn that never ends on its own, once it runs: the
  # process and the turn's ref.
  defp turn_running!(chat, user) do
    me = self()

    caller =
      spawn(fn ->
        Locks.with_turn(chat, user, [ttl_s: 60], fn turn ->
          send(me, {:running, self(), turn.ref})
          Process.sleep(:infinity)
        end)
      end)

    assert_receive {:running, ^caller, ref}, 5_000
    {caller, ref}
  end

  defp next_keep(timeout \\ 5_000) do
    receive do
      {:telemetry, [:phoenix_kit_agent_locks, :keep, :stop], _, %{result: true}} ->
        :kept

      {:telemetry, [:phoenix_kit_agent_locks, :keep, :exception], _,
       %{reason: %Locks.Error{reason: reason}}} ->
        {:failed, reason}
    after
      timeout -> flunk("no keep/5 within #{timeout} ms")
    end
  end

  test "runs fun holding both locks under a new turn ref, and releases them when it returns",
       %{chat: chat, user: user} do
    assert {:ok, {ref, true}} =
             Locks.with_turn(chat, user, [ttl_s: @ttl], fn %Turn{ref: ref} = turn ->
               assert {turn.conversation_uuid, turn.user_uuid, turn.ttl_s} == {chat, user, @ttl}
               assert "turn-" <> _ = ref
               {ref, Locks.held?(chat, user, ref)}
             end)

    assert free?(chat, user)
    refute Locks.held?(chat, user, ref)
    assert keepers() == 0
  end

  test "renews the lease every ttl_s / 3 while fun runs", %{chat: chat, user: user} do
    {:ok, ages} =
      Locks.with_turn(chat, user, [ttl_s: @ttl], fn turn ->
        for _ <- 1..2 do
          assert next_keep() == :kept
          {_ref, age} = TestDB.lock(:chat, chat)
          refute Locks.lost?(turn)
          age
        end
      end)

    assert ages == [0, 0]
  end

  test "answers acquire/4's refusal without running fun", %{chat: chat, user: user} do
    :ok = Locks.acquire(chat, TestDB.uuid(), "other-turn", 60)

    assert Locks.with_turn(chat, user, [ttl_s: @ttl], fn _ -> flunk("ran") end) ==
             {:error, :conversation_busy}

    :ok = Locks.acquire(TestDB.insert_chat!(), user, "users-other-turn", 60)

    assert Locks.with_turn(TestDB.insert_chat!(), user, [ttl_s: @ttl], fn _ -> flunk("ran") end) ==
             {:error, :turn_in_flight}
  end

  test "with wait_ms, tries again while refused, and runs once the chat is free", %{
    chat: chat,
    user: user
  } do
    holder = TestDB.uuid()
    :ok = Locks.acquire(chat, holder, "holder", 60)
    me = self()

    runner =
      Task.async(fn ->
        :telemetry.attach()
        send(me, :attached)
        Locks.with_turn(chat, user, [ttl_s: @ttl, wait_ms: 10_000], fn turn -> turn.ref end)
      end)

    assert_receive :attached
    # The runner's first try was refused: now the holder releases.
    assert_receive {:telemetry, [:phoenix_kit_agent_locks, :acquire, :stop], _,
                    %{result: {:error, :conversation_busy}}},
                   5_000

    :ok = Locks.release(chat, holder, "holder")

    assert {:ok, "turn-" <> _} = Task.await(runner, 15_000)
    assert free?(chat, user)
  end

  test "wait_ms passes: the last refusal is the answer", %{chat: chat, user: user} do
    :ok = Locks.acquire(chat, TestDB.uuid(), "holder", 60)

    assert Locks.with_turn(chat, user, [ttl_s: @ttl, wait_ms: 200], fn _ -> :ran end) ==
             {:error, :conversation_busy}
  end

  test "releases both locks when fun raises, throws or exits, and lets it go on", %{
    chat: chat,
    user: user
  } do
    assert_raise RuntimeError, "boom", fn ->
      Locks.with_turn(chat, user, [ttl_s: @ttl], fn _ -> raise "boom" end)
    end

    assert free?(chat, user)

    assert catch_throw(Locks.with_turn(chat, user, [ttl_s: @ttl], fn _ -> throw(:out) end)) ==
             :out

    assert free?(chat, user)

    assert catch_exit(Locks.with_turn(chat, user, [ttl_s: @ttl], fn _ -> exit(:gone) end)) ==
             :gone

    assert free?(chat, user)
    assert keepers() == 0
  end

  test "a lease taken over is lost: the caller is told, lost?/1 is true, the result says so",
       %{chat: chat, user: user} do
    {:lost, ref} =
      Locks.with_turn(chat, user, [ttl_s: @ttl], fn turn ->
        # As if this node had stalled past its lease: another turn takes over.
        TestDB.backdate!([chat: chat, user: user], @ttl + 1)
        :ok = Locks.acquire(chat, user, "successor", @ttl)

        assert_receive {:turn_lock_lost, ref}, 5_000
        assert ref == turn.ref
        assert Locks.lost?(turn)
        ref
      end)

    assert_received {:telemetry, [:phoenix_kit_agent_locks, :turn, :lost], %{},
                     %{ref: ^ref, conversation_uuid: ^chat}}

    # The successor's locks are left alone.
    assert {"successor", _age} = TestDB.lock(:chat, chat)
    assert {"successor", _age} = TestDB.lock(:user, user)
  end

  test "a renewal that meets a row another transaction holds is tried again within the " <>
         "lease, and the turn goes on",
       %{chat: chat, user: user} do
    # A 12-second lease, renewed every 4 s, retried with the back-off after a failure.
    psql = TestDB.session!(TestDB.url())

    assert {:ok, :kept_after_a_held_row} =
             Locks.with_turn(chat, user, [ttl_s: 12], fn turn ->
               # The user's row is held by another session (as by the turn's
               # own fenced write): the next renewal waits ROW_WAIT for it
               # and fails, having changed nothing.
               TestDB.query!(
                 "BEGIN; SELECT 1 FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}' FOR UPDATE",
                 psql
               )

               assert next_keep(8_000) == {:failed, :row_locked}
               refute Locks.lost?(turn)
               TestDB.query!("ROLLBACK", psql)
               # Tried again until it renews, well within the lease.
               assert Enum.find(1..5, fn _ -> next_keep(8_000) == :kept end)
               refute Locks.lost?(turn)
               :kept_after_a_held_row
             end)

    TestDB.close(psql)
    assert free?(chat, user)
  end

  test "a killed caller leaves no keeper running and no lock", %{chat: chat, user: user} do
    {caller, ref} = turn_running!(chat, user)
    assert Locks.held?(chat, user, ref)
    assert [{_, keeper, _, _}] = DynamicSupervisor.which_children(Locks.Keepers)
    watch = Process.monitor(keeper)
    Process.exit(caller, :kill)

    # The keeper ends once it has released (a count of tries would pass in
    # microseconds while the release is still on its way).
    assert_receive {:DOWN, ^watch, :process, ^keeper, _}, 5_000
    assert keepers() == 0
    assert free?(chat, user)
  end

  test "a graceful stop of the application releases the running turns' locks", %{
    chat: chat,
    user: user
  } do
    {_caller, ref} = turn_running!(chat, user)
    assert Locks.held?(chat, user, ref)
    :ok = AppEnv.stop()

    assert free?(chat, user)
  end

  test "bad options raise ArgumentError" do
    for opts <- [
          [],
          [ttl_s: 0],
          [ttl_s: 3, wait_ms: -1],
          [ttl_s: 3, tll: 1],
          [ttl_s: 3, lease_s: 4]
        ] do
      assert_raise ArgumentError, fn ->
        Locks.with_turn(TestDB.uuid(), TestDB.uuid(), opts, fn _ -> :ok end)
      end
    end
  end

  describe "a keeper that stops before its turn ends" do
    # These use only :ttl_s (the lease is the TTL, 60 s), as before leases
    # existed: nothing frees the chat before the turn is told.

    defp running_turn!(chat, user) do
      me = self()

      caller =
        spawn(fn ->
          Locks.with_turn(chat, user, [ttl_s: 60], fn turn ->
            send(me, {:running, turn})
            Process.sleep(:infinity)
          end)
        end)

      assert_receive {:running, turn}, 5_000
      {caller, turn}
    end

    # Another turn tries the chat until it gets it (at most 5 s): at that
    # moment the first turn must already know (lost?/1, its message).
    defp taken_over_after_told!(chat, caller, turn) do
      successor = "successor-#{System.unique_integer([:positive])}"

      assert Enum.find(1..500, fn _ ->
               Locks.acquire(chat, TestDB.uuid(), successor, 60) == :ok or
                 (Process.sleep(10) && false)
             end),
             "the chat was never freed"

      assert Locks.lost?(turn) == true
      assert Process.info(caller, :messages) == {:messages, [{:turn_lock_lost, turn.ref}]}
      assert {^successor, _age} = TestDB.lock(:chat, chat)
    end

    test "the application restarted: the turn is told before its chat can be taken", %{
      chat: chat,
      user: user
    } do
      {caller, turn} = running_turn!(chat, user)
      :ok = AppEnv.stop()
      {:ok, _} = Application.ensure_all_started(:phoenix_kit_agent_locks)

      taken_over_after_told!(chat, caller, turn)
      ref = turn.ref
      assert_received {:telemetry, [:phoenix_kit_agent_locks, :turn, :lost], %{}, %{ref: ^ref}}
    end

    test "the keeper killed: the turn is told, its locks released, before its chat can be taken",
         %{chat: chat, user: user} do
      {caller, turn} = running_turn!(chat, user)
      Process.exit(turn.keeper, :kill)

      taken_over_after_told!(chat, caller, turn)
      assert {nil, nil} = TestDB.lock(:user, user)
      ref = turn.ref
      assert_received {:telemetry, [:phoenix_kit_agent_locks, :turn, :lost], %{}, %{ref: ^ref}}
    end

    test "the keeper killed during its acquire: :not_started, nobody told, and the locks " <>
           "released once the acquire returned, though the keeper started in its place ended first",
         %{chat: chat, user: user} do
      # The acquire is kept running at the server (TestDB.stall!/1), holding
      # the chat's row and not the user's. Nothing else waits.
      stall = TestDB.stall!(user)

      me = self()

      spawn(fn ->
        result =
          try do
            Locks.with_turn(chat, user, [ttl_s: 60], fn _ -> flunk("ran") end)
          rescue
            error in Locks.Error -> {:raised, error.reason}
          end

        send(me, {:result, result, Process.info(self(), :messages)})
      end)

      stalled = fn -> length(TestDB.stalled_backends("phoenix_kit_agent_locks")) end
      assert Faults.until(fn -> stalled.() == 1 end, 5_000) == :ok
      [{_, keeper, _, _}] = DynamicSupervisor.which_children(Locks.Keepers)
      Process.exit(keeper, :kill)
      # The keeper started again releases and ends while the acquire still
      # waits; the acquire's own process releases once it returned.
      assert Faults.until(fn -> keepers() == 0 end, 5_000) == :ok
      assert stalled.() == 1
      TestDB.unstall!(stall)

      assert_receive {:result, {:raised, :not_started}, {:messages, []}}, 5_000
      assert Faults.until(fn -> free?(chat, user) end, 5_000) == :ok
    end

    test "with no keeper supervisor (the application stopped), with_turn/4 raises :not_started " <>
           "and takes nothing",
         %{chat: chat, user: user} do
      :ok = AppEnv.stop()

      assert_raise Locks.Error, ~r/\Anot started: /, fn ->
        Locks.with_turn(chat, user, [ttl_s: 60], fn _ -> flunk("ran") end)
      end

      assert {TestDB.lock(:chat, chat), TestDB.lock(:user, user)} == {{nil, nil}, nil}
      assert Process.info(self(), :messages) == {:messages, []}
    end
  end

  describe "a lease shorter than the takers' TTL" do
    test "takers with the common TTL see the locks taken until lease_s after the last " <>
           "renewal, then free and listed stale; the turn then learns it lost them" do
      # A database of its own: held_locks/1 lists this test's locks only.
      {_db, url} = Pg.create_database!("turn_lease")
      :ok = AppEnv.restart(url: url)
      {chat, user} = {TestDB.insert_chat!(url), TestDB.uuid()}

      assert {:lost, ref} =
               Locks.with_turn(chat, user, [ttl_s: 60, lease_s: 5], fn turn ->
                 assert turn.lease_s == 5
                 assert next_keep() == :kept
                 # Right after a renewal (the next one is 5/3 s away), as if
                 # 4 s, then 6 s, had passed since it.
                 TestDB.backdate!([chat: chat, user: user], 4, url)

                 assert Locks.acquire(chat, TestDB.uuid(), "taker", 60) ==
                          {:error, :conversation_busy}

                 assert Locks.fresh?(chat, turn.ref, 60) == true

                 assert [%{ref: ref, stale: false}, %{ref: ref, stale: false}] =
                          Locks.held_locks(60)

                 TestDB.backdate!([chat: chat, user: user], 2, url)

                 assert [%{ref: ref, stale: true}, %{ref: ref, stale: true}] =
                          Locks.held_locks(60)

                 assert Locks.fresh?(chat, turn.ref, 60) == false
                 assert Locks.acquire(chat, TestDB.uuid(), "taker", 60) == :ok
                 # The next renewal answers false: an expired lease is not revived.
                 assert_receive {:turn_lock_lost, ref}, 5_000
                 assert Locks.lost?(turn)
                 ref
               end)

      assert "turn-" <> _ = ref

      assert [%{ref: "taker", kind: :chat}] =
               Locks.held_locks(60) |> Enum.filter(&(&1.kind == :chat))
    end

    test "bad leases raise ArgumentError naming lease_s" do
      for lease_s <- [0, 61, 1.5, "5"] do
        assert_raise ArgumentError, ~r/\Ainvalid lease_s: /, fn ->
          Locks.with_turn(TestDB.uuid(), TestDB.uuid(), [ttl_s: 60, lease_s: lease_s], fn _ ->
            :ok
          end)
        end
      end
    end
  end
end
