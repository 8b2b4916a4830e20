defmodule PhoenixKitAgent.Turns.TransactionTest do
  # Locks.transaction/4, the fence, in production's mode: the host's repo
  # (SandboxRepo outside the sandbox: a transaction on a psql connection of
  # its own) runs the transaction, the library's pool runs the lock calls
  # that race it. Each race is made to happen in one order or the other:
  #
  #   * the racer first: it has committed before the transaction starts, and
  #     the transaction answers {:error, :lost} with nothing written;
  #   * the transaction first: it is open (its write made) when the racer is
  #     sent, the racer is seen waiting for the transaction's backend
  #     (pg_blocking_pids, polled), has not answered, and answers only once
  #     the transaction committed its write.
  #
  # Stale locks are made by backdating busy_since, never by sleeping.
  use PhoenixKitAgent.Turns.LockCase, async: true

  alias PhoenixKitAgent.Turns.Locks.SandboxRepo

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

  # Polls, bounded, until some backend waits for `backend` (a row lock it holds).
  defp assert_blocked_by!(backend) do
    blocked =
      "SELECT count(*) FROM pg_stat_activity WHERE #{backend} = ANY(pg_blocking_pids(pid))"

    assert Enum.any?(1..10_000, fn _ -> TestDB.value!(blocked) != "0" end),
           "nothing waited for the fenced transaction"
  end

  # Sends `racer` while a fenced transaction of `ids` is open, and returns
  # its answer, asserting that it came only after the transaction's commit.
  defp race_open_transaction(ids, racer, last \\ fn _repo -> :ok end) do
    {fenced, backend} = open_fenced!(ids, last)
    task = Task.async(racer)
    assert_blocked_by!(backend)
    # Still waiting: the transaction has not ended.
    assert Task.yield(task, 0) == nil
    send(fenced, :commit)
    assert_receive {:ended, ^fenced, {:ok, :written}}, 10_000
    {chat, _user, turn} = ids
    assert messages(chat) == [[turn]]
    Task.await(task, 10_000)
  end

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

    test "a take-over sent while the transaction is open waits for its commit, even when fun writes the chat row" do
      {chat, user, _turn} = ids = turn!(2 * @ttl)
      other_user = new_user()
      {chats, _key} = TestDB.table(:chat)

      # The fence's FOR SHARE becomes the row lock of an UPDATE, with the taker
      # waiting for the row: the transaction does not wait for the taker.
      touch_chat = fn repo ->
        {:ok, _} =
          repo.query(
            "UPDATE #{chats} SET busy_turn_ref = busy_turn_ref WHERE uuid = $1::uuid",
            [uuid_bytes(chat)],
            []
          )
      end

      assert race_open_transaction(
               ids,
               fn -> Locks.acquire(chat, other_user, "turn-2", @ttl) end,
               touch_chat
             ) == :ok

      assert_locks([chat: chat, user: other_user], chat: {"turn-2", 0}, user: {"turn-2", 0})
      assert Locks.transaction(SandboxRepo, ids, fn -> flunk("fun ran") end) == {:error, :lost}
      assert lock(:user, user) |> elem(0) == elem(ids, 2)
    end

    test "release/3 sent while the transaction is open waits for its commit" do
      {chat, user, turn} = ids = turn!()
      assert race_open_transaction(ids, fn -> Locks.release(chat, user, turn) end) == :ok
      assert locks(chat: chat, user: user) == [chat: {nil, nil}, user: {nil, nil}]
    end

    test "release_stale/4 sent while the transaction is open waits for its commit" do
      {chat, user, turn} = ids = turn!(2 * @ttl)

      assert race_open_transaction(ids, fn -> Locks.release_stale(chat, user, turn, @ttl) end) ==
               true

      assert locks(chat: chat, user: user) == [chat: {nil, nil}, user: {nil, nil}]
    end

    test "a click sent while the transaction is open waits for its commit" do
      {chat, user, turn} = ids = turn!()
      backdate!([user: user], 2 * @ttl)
      click = Locks.click_ref()

      assert race_open_transaction(ids, fn -> Locks.acquire_user(user, click, @ttl, 30) end) ==
               :ok

      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {click, @ttl - 30})
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
