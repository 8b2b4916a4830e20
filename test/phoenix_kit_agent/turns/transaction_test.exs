defmodule PhoenixKitAgent.Turns.TransactionTest do
  # Locks.transaction/4, the fence, in production's mode: the host's repo
  # (SandboxRepo outside the sandbox: a transaction on a psql connection of
  # its own) runs the transaction, the library's pool runs the lock calls
  # that race it. Each race is made to happen in one order or the other:
  #
  #   * the racer first: it has committed before the transaction starts, and
  #     the transaction answers {:error, :lost} with nothing written;
  #   * the transaction first: it is open (its write made) when the racer is
  #     sent, and the racer answers while it is still open, without waiting
  #     for it: a taker is refused at once, release_stale/4 frees nothing, a
  #     release raises :row_locked after ROW_WAIT; the same call after the
  #     commit does what it does on a free row.
  #
  # Stale locks are made by backdating busy_since, never by sleeping.
  use PhoenixKitAgent.Turns.LockCase, async: true

  alias PhoenixKitAgent.Turns.Locks.{Native, SandboxRepo}
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Faults

  @ttl 60

  defmodule RefusingRepo do
    @moduledoc false
    # A repo in whose transaction PostgreSQL refuses every query, as under
    # REPEATABLE READ when a take-over races the fence (Postgrex.Error's fields).
    def transaction(fun, _opts), do: {:ok, fun.()}
    def rollback(value), do: throw({__MODULE__, value})

    def query(_sql, _params, _opts) do
      message = "could not serialize access due to concurrent update"
      {:error, %{postgres: %{pg_code: "40001", message: message, severity: "ERROR"}}}
    end
  end

  @messages "locks_test_messages"

  setup_all do
    TestDB.query!(
      "CREATE TABLE IF NOT EXISTS #{@messages} (chat uuid NOT NULL, turn text NOT NULL)",
      TestDB.url()
    )

    :ok
  end

  # A turn's write: one message row in its chat, through `repo`, inside the transaction.
  defp write!(repo, {chat, _user, turn}) do
    {:ok, _} =
      repo.query(
        "INSERT INTO #{@messages} (chat, turn) VALUES ($1::uuid, $2::text)",
        [uuid_bytes(chat), turn],
        []
      )

    :written
  end

  # The messages committed in `chat`, by turn.
  defp messages(chat),
    do: TestDB.query!("SELECT turn FROM #{@messages} WHERE chat = '#{chat}' ORDER BY turn")

  # Opens a fenced transaction for `ids` in a process of its own, which
  # writes its message, waits for :commit, runs `last` (the repo) and
  # commits. Returns its pid and the backend of its transaction.
  defp open_fenced!(ids, last) do
    test = self()

    pid =
      spawn_link(fn ->
        result =
          Locks.transaction(SandboxRepo, ids, fn repo ->
            write!(repo, ids)
            {:ok, %{rows: [[backend]]}} = repo.query("SELECT pg_backend_pid()", [], [])
            send(test, {:open, self(), backend})
            receive(do: (:commit -> last.(repo)))
            :written
          end)

        send(test, {:ended, self(), result})
      end)

    assert_receive {:open, ^pid, backend}, 10_000
    {pid, backend}
  end

  # Runs `racer` while a fenced transaction of `ids` is open (its write
  # made), then commits it; the racer's answer, asserted to have come within
  # twice ROW_WAIT (the most a statement waits for rows) with the
  # transaction still open.
  defp while_open(ids, racer, last \\ fn _repo -> :ok end) do
    {fenced, _backend} = open_fenced!(ids, last)
    started = System.monotonic_time(:millisecond)
    answer = racer.()
    took = System.monotonic_time(:millisecond) - started
    assert took < 2 * row_wait_ms() + 500, "the racer answered after #{took} ms"
    refute_received {:ended, ^fenced, _}
    send(fenced, :commit)
    assert_receive {:ended, ^fenced, {:ok, :written}}, 10_000
    {chat, _user, turn} = ids
    assert messages(chat) == [[turn]]
    answer
  end

  defp row_wait_ms, do: Native.rules().row_wait_ms

  defp pg17?, do: String.to_integer(TestDB.value!("SHOW server_version_num")) >= 170_000

  # `fun`'s exception's reason, after `fun` raised Locks.Error.
  defp raised(fun), do: assert_raise(Locks.Error, fun).reason

  # The turn holds both locks, taken `age` seconds ago (older than @ttl: stale).
  defp turn!(age \\ 0) do
    {chat, user, turn} = held_turn!(@ttl, age: age)
    {chat, user, turn}
  end

  describe "transaction/4" do
    test "commits fun's writes while the turn holds both locks, and answers its value" do
      {chat, user, turn} = ids = turn!()

      assert Locks.transaction(SandboxRepo, ids, fn repo -> write!(repo, ids) end) ==
               {:ok, :written}

      assert Locks.transaction(SandboxRepo, ids, fn -> :no_write end) == {:ok, :no_write}
      assert messages(chat) == [[turn]]
      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {turn, 0})
    end

    test "a turn that holds neither lock, or only one, runs nothing: {:error, :lost}" do
      {chat, user, turn} = turn!()
      other_user = new_user()

      for ids <- [{chat, user, "never-held"}, {chat, other_user, turn}] do
        assert Locks.transaction(SandboxRepo, ids, fn -> flunk("fun ran") end) ==
                 {:error, :lost}
      end

      assert messages(chat) == []
    end

    test "a turn suspended past its lease while another turn takes the chat over writes nothing" do
      {chat, user} = {insert_chat!(), new_user()}
      test = self()

      spawn_link(fn ->
        ended =
          Locks.with_turn(chat, user, [ttl_s: @ttl, lease_s: 3], fn turn ->
            send(test, {:turn, turn})
            receive(do: (:write -> :ok))
            # No lost?/1 first: the fence alone decides.
            ids = {chat, user, turn.ref}
            Locks.transaction(SandboxRepo, turn, fn repo -> write!(repo, ids) end)
          end)

        send(test, {:ended, ended})
      end)

      assert_receive {:turn, turn}, 10_000
      # A stalled VM: neither the caller nor its keeper runs.
      for pid <- [turn.caller, turn.keeper], do: true = :erlang.suspend_process(pid)
      # Its lease runs out (backdated past the TTL) and another turn takes the chat.
      backdate!([chat: chat, user: user], @ttl)
      assert Locks.acquire(chat, user, "turn-2", @ttl) == :ok
      for pid <- [turn.keeper, turn.caller], do: true = :erlang.resume_process(pid)

      send(turn.caller, :write)
      assert_receive {:ended, {_ok_or_lost, {:error, :lost}}}, 10_000
      assert messages(chat) == []
      assert_locks([chat: chat, user: user], chat: {"turn-2", 0}, user: {"turn-2", 0})
    end

    test "a take-over while the transaction is open is refused at once, even when fun writes " <>
           "the chat row; after the commit it takes the locks" do
      {chat, user, _turn} = ids = turn!(2 * @ttl)
      other_user = new_user()
      {chats, _key} = TestDB.table(:chat)

      # The fence's FOR SHARE becomes the row lock of an UPDATE.
      touch_chat = fn repo ->
        {:ok, _} =
          repo.query(
            "UPDATE #{chats} SET busy_turn_ref = busy_turn_ref WHERE uuid = $1::uuid",
            [uuid_bytes(chat)],
            []
          )
      end

      take = fn -> Locks.acquire(chat, other_user, "turn-2", @ttl) end
      assert while_open(ids, take, touch_chat) == {:error, :conversation_busy}
      assert take.() == :ok
      assert_locks([chat: chat, user: other_user], chat: {"turn-2", 0}, user: {"turn-2", 0})
      assert Locks.transaction(SandboxRepo, ids, fn -> flunk("fun ran") end) == {:error, :lost}
      assert lock(:user, user) |> elem(0) == elem(ids, 2)
    end

    test "release/3 while the transaction is open raises :row_locked and frees nothing; " <>
           "after the commit it frees both" do
      {chat, user, turn} = ids = turn!()
      release = fn -> Locks.release(chat, user, turn) end
      assert while_open(ids, fn -> raised(release) end) == :row_locked
      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {turn, 0})
      assert release.() == :ok
      assert locks(chat: chat, user: user) == [chat: {nil, nil}, user: {nil, nil}]
    end

    test "release_stale/4 while the transaction is open answers false; after the commit, true" do
      {chat, user, turn} = ids = turn!(2 * @ttl)
      release_stale = fn -> Locks.release_stale(chat, user, turn, @ttl) end
      assert while_open(ids, release_stale) == false
      assert release_stale.() == true
      assert locks(chat: chat, user: user) == [chat: {nil, nil}, user: {nil, nil}]
    end

    test "a click while the transaction is open is refused at once (:turn_in_flight, the " <>
           "committed holder); after the commit it takes the user's lock" do
      {chat, user, turn} = ids = turn!()
      backdate!([user: user], 2 * @ttl)
      click = Locks.click_ref()
      take = fn -> Locks.acquire_user(user, click, @ttl, 30) end
      assert while_open(ids, take) == {:error, :turn_in_flight}
      assert take.() == :ok
      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {click, @ttl - 30})
    end

    test "a transaction left open past its lease is ended by the server: its write rolls back, " <>
           "and the locks can be taken over" do
      {chat, user, turn} = ids = turn!(2 * @ttl)
      test = self()

      pid =
        spawn(fn ->
          # psql's session ends with its connection, and would take this process with it.
          Process.flag(:trap_exit, true)

          result =
            try do
              Locks.transaction(
                SandboxRepo,
                ids,
                fn repo ->
                  write!(repo, ids)
                  send(test, :written)
                  receive(do: (:commit -> :written))
                end,
                lease_s: 1
              )
            rescue
              error -> {:raised, Exception.message(error)}
            catch
              :exit, reason -> {:raised, inspect(reason)}
            end

          send(test, {:ended, result})
        end)

      assert_receive :written, 10_000
      # Refused while the transaction is open, taken once the server ended it.
      assert Faults.until(
               fn -> Locks.acquire(chat, new_user(), "turn-2", @ttl) == :ok end,
               10_000
             ) ==
               :ok

      send(pid, :commit)
      # The repo's error for its lost connection (psql's, here; Postgrex's
      # names the code too), raised at the commit: idle-in-transaction
      # timeout (25P03), or from PostgreSQL 17 transaction timeout (25P04).
      assert_receive {:ended, {:raised, error}}, 10_000
      assert error =~ if(pg17?(), do: "25P04", else: "25P03")
      assert error =~ "transaction timeout"
      assert messages(chat) == []
      assert lock(:chat, chat) |> elem(0) == "turn-2"
      assert lock(:user, user) |> elem(0) == turn
    end

    test "the fence gives up after a lease on a row another session holds: :row_locked, fun " <>
           "not run" do
      {chat, _user, _turn} = ids = turn!()
      psql = TestDB.session!(TestDB.url())
      {chats, _key} = TestDB.table(:chat)
      TestDB.query!("BEGIN; SELECT 1 FROM #{chats} WHERE uuid = '#{chat}' FOR UPDATE", psql)
      started = System.monotonic_time(:millisecond)

      error =
        assert_raise Locks.Error, fn ->
          Locks.transaction(SandboxRepo, ids, fn -> flunk("fun ran") end, lease_s: 1)
        end

      took = System.monotonic_time(:millisecond) - started
      TestDB.query!("ROLLBACK", psql)
      TestDB.close(psql)
      assert {error.reason, error.sqlstate} == {:row_locked, nil}
      assert took >= 1_000 and took < 5_000, "gave up after #{took} ms"
    end

    test "a statement of fun that runs longer than the lease is cancelled (before " <>
           "PostgreSQL 17), or the transaction ended (from 17, its transaction_timeout)" do
      {chat, _user, _turn} = ids = turn!()
      sleep = fn repo -> {write!(repo, ids), repo.query("SELECT pg_sleep(30)", [], [])} end

      if pg17?() do
        error = catch_exit(Locks.transaction(SandboxRepo, ids, sleep, lease_s: 1))
        assert inspect(error) =~ "noproc" or inspect(error) =~ "25P04"
      else
        assert {:ok, {:written, {:error, %SandboxRepo.Error{postgres: %{pg_code: "57014"}}}}} =
                 Locks.transaction(SandboxRepo, ids, sleep, lease_s: 1)
      end

      # Before 17 the cancelled statement alone was rolled back (the repo's
      # savepoint); from 17 the write went with the transaction.
      assert messages(chat) == if(pg17?(), do: [], else: [[elem(ids, 2)]])
    end

    test "transaction/4's :lease_s is whole seconds" do
      ids = turn!()

      for bad <- [0, 1.5, :infinity] do
        assert_raise ArgumentError, ~r/^invalid lease_s/, fn ->
          Locks.transaction(SandboxRepo, ids, fn -> flunk("fun ran") end, lease_s: bad)
        end
      end
    end

    test "after release/3, release_stale/4 or a click took a lock, the transaction writes nothing" do
      {chat1, user1, turn1} = released = turn!()
      :ok = Locks.release(chat1, user1, turn1)
      {chat2, user2, turn2} = stale = turn!(2 * @ttl)
      true = Locks.release_stale(chat2, user2, turn2, @ttl)
      {chat3, user3, _turn3} = clicked = turn!()
      backdate!([user: user3], 2 * @ttl)
      :ok = Locks.acquire_user(user3, Locks.click_ref(), @ttl, 30)

      for ids <- [released, stale, clicked] do
        assert Locks.transaction(SandboxRepo, ids, fn repo -> write!(repo, ids) end) ==
                 {:error, :lost}
      end

      assert Enum.flat_map([chat1, chat2, chat3], &messages/1) == []
    end

    test "repo.rollback/1 in fun answers {:error, value}; nothing is written or left locked" do
      {chat, user, _turn} = ids = turn!(2 * @ttl)

      assert Locks.transaction(SandboxRepo, ids, fn repo ->
               write!(repo, ids)
               repo.rollback(:changed_my_mind)
             end) == {:error, :changed_my_mind}

      assert messages(chat) == []
      # No row lock outlives it: a take-over answers at once.
      assert Locks.acquire(chat, user, "turn-2", @ttl) == :ok
    end

    test "an exception in fun rolls back and is raised again; nothing is written or left locked" do
      {chat, user, _turn} = ids = turn!(2 * @ttl)

      assert_raise RuntimeError, "boom", fn ->
        Locks.transaction(SandboxRepo, ids, fn repo ->
          write!(repo, ids)
          raise "boom"
        end)
      end

      assert messages(chat) == []
      assert Locks.acquire(chat, user, "turn-2", @ttl) == :ok
    end

    test "a fence the repo's transaction cannot run raises Locks.Error with its SQLSTATE" do
      ids = turn!()

      error =
        assert_raise Locks.Error, fn ->
          Locks.transaction(__MODULE__.RefusingRepo, ids, fn -> flunk("fun ran") end)
        end

      assert {error.reason, error.sqlstate, error.message} ==
               {:statement, "40001",
                "statement failed: 40001: could not serialize access due to concurrent update"}
    end

    test "a turn that is neither with_turn/4's nor a tuple of ids is an ArgumentError" do
      assert_raise ArgumentError, ~r/^invalid turn: expected with_turn\/4's turn/, fn ->
        Locks.transaction(SandboxRepo, "turn-1", fn -> :ok end)
      end

      assert_raise ArgumentError, ~r/^invalid conversation_uuid/, fn ->
        Locks.transaction(SandboxRepo, {"nope", new_user(), "turn-1"}, fn -> :ok end)
      end
    end
  end
end
