defmodule PhoenixKitAgent.Turns.SandboxTest do
  # `testing: :sandbox`: a host's test written the usual way, against a
  # stand-in of an Ecto repo under Ecto.Adapters.SQL.Sandbox (SandboxRepo:
  # a real PostgreSQL session inside a transaction that the test owns).
  # Checkout, rows inserted in the test's transaction, lock calls, rollback;
  # nothing is left behind. `async: false`: the application is restarted in
  # the mode, which replaces the pool every other test uses.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{AppEnv, Config, Error, FakeRepo, SandboxRepo, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Faults

  setup do
    AppEnv.restore_on_exit()
    :ok = AppEnv.restart(repo: SandboxRepo, testing: :sandbox)
    test = self()
    session = SandboxRepo.checkout()
    on_exit(fn -> if Process.alive?(session), do: SandboxRepo.checkin(test) end)
    %{session: session}
  end

  # A host's own rows, inserted in the test's transaction.
  defp insert_rows!(session) do
    [chat, user] = [TestDB.uuid(), TestDB.uuid()]
    TestDB.query!(TestDB.insert_chats_sql([chat]) <> ";\n" <> insert_settings_sql(user), session)
    {chat, user}
  end

  # Ecto-made tables give the settings row's uuid key no default.
  defp insert_settings_sql(user) do
    {key, value} =
      if TestDB.tables() == :ecto, do: {"uuid, ", "gen_random_uuid(), "}, else: {"", ""}

    "INSERT INTO phoenix_kit_agent_user_settings (#{key}user_uuid, inserted_at, updated_at) " <>
      "VALUES (#{value}'#{user}', now(), now())"
  end

  defp lock_in(session, kind, id) do
    {table, key} = TestDB.table(kind)
    TestDB.query!("SELECT busy_turn_ref FROM #{table} WHERE #{key} = '#{id}'", session)
  end

  # The locks' ages in whole seconds, in the test's transaction (whose now()
  # is its start: only a backdate or a renewal changes them).
  defp ages(session, chat, user) do
    [[chat_age, user_age]] =
      TestDB.query!(
        "SELECT (SELECT floor(extract(epoch FROM now() - busy_since))::int FROM " <>
          "phoenix_kit_agent_conversations WHERE uuid = '#{chat}'), " <>
          "(SELECT floor(extract(epoch FROM now() - busy_since))::int FROM " <>
          "phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}')",
        session
      )

    Enum.map([chat_age, user_age], &String.to_integer/1)
  end

  defp rows_outside(chat, user) do
    TestDB.value!(
      "SELECT (SELECT count(*) FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}') + " <>
        "(SELECT count(*) FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}')"
    )
  end

  test "the lock calls see the rows of the test's transaction, and nothing outlives its rollback",
       %{session: session} do
    {chat, user} = insert_rows!(session)
    {other_chat, other_user} = insert_rows!(session)
    # Neither row exists outside the transaction: no other connection could
    # lock them. And the library has no connection of its own: no pool.
    assert rows_outside(chat, user) == "0"
    assert %Error{reason: :not_started} = catch_error(Locks.status())

    # Without the mode: :conversation_busy (the chat is not committed), and a
    # click would wait on the settings row's unique index until :timeout.
    assert Locks.acquire(chat, user, "turn-1", 60) == :ok
    click = Locks.click_ref()
    assert Locks.acquire_user(other_user, click, 60, 30) == :ok
    assert Locks.acquire(other_chat, other_user, "turn-2", 60) == {:error, :click_in_flight}
    assert Locks.acquire(chat, other_user, "turn-3", 60) == {:error, :conversation_busy}

    assert Locks.held?(chat, user, "turn-1") == true
    assert Locks.fresh?(chat, "turn-1", 60) == true
    assert Locks.keep(chat, user, "turn-1", 60, 60) == true
    assert Locks.keep_user(other_user, click, 60, 30) == true

    # held_locks/1 lists the 1000 oldest: the locks earlier tests left (this
    # module runs alone, async: false) are freed in the test's transaction.
    TestDB.query!(
      """
      UPDATE phoenix_kit_agent_conversations SET busy_turn_ref = NULL
      WHERE busy_turn_ref IS NOT NULL AND uuid <> '#{chat}';
      UPDATE phoenix_kit_agent_user_settings SET busy_turn_ref = NULL
      WHERE busy_turn_ref IS NOT NULL AND user_uuid NOT IN ('#{user}', '#{other_user}')
      """,
      session
    )

    held = Locks.held_locks(60)

    assert held |> Enum.map(&{&1.kind, &1.uuid, &1.ref, &1.stale}) |> Enum.sort() ==
             Enum.sort([
               {:chat, chat, "turn-1", false},
               {:user, user, "turn-1", false},
               {:user, other_user, click, false}
             ])

    assert Enum.all?(held, &(is_float(&1.age_s) and match?(%DateTime{}, &1.since)))

    assert Locks.release_user(other_user, click) == :ok
    assert lock_in(session, :user, other_user) == [[nil]]
    assert Locks.release_stale(chat, user, "turn-1", 60) == false
    assert Locks.release(chat, user, "turn-1") == :ok
    assert lock_in(session, :chat, chat) == [[nil]]
    assert lock_in(session, :user, user) == [[nil]]

    # Left locked at the end of the test: the rollback takes it away with the rows.
    assert Locks.acquire(chat, user, "turn-4", 60) == :ok
    SandboxRepo.checkin()
    assert rows_outside(chat, user) == "0"
    assert rows_outside(other_chat, other_user) == "0"
  end

  test "with_turn/4's keeper renews and releases on the test's connection, with no allowance",
       %{session: session} do
    {chat, user} = insert_rows!(session)

    result =
      Locks.with_turn(chat, user, [ttl_s: 60], fn turn ->
        # Its locks 10 s old, then the keeper's renewal (due after ttl_s / 3) now.
        :ok = TestDB.backdate!([chat: chat, user: user], 10, session)
        send(turn.keeper, :keep)
        # The renewal runs in a process of the keeper's: until it is seen.
        renewed = Faults.until(fn -> ages(session, chat, user) == [0, 0] end, 5_000)
        {Locks.lost?(turn), renewed}
      end)

    # Without the allowance the keeper finds no connection: its renewal fails
    # (the ages stay 10), it answers {:lost, _} and the locks stay taken.
    assert result == {:ok, {false, :ok}}
    assert lock_in(session, :chat, chat) == [[nil]]
    assert lock_in(session, :user, user) == [[nil]]
  end

  test "transaction/4 writes in the test's transaction while the turn holds its chat, not after",
       %{session: session} do
    {chat, user} = insert_rows!(session)
    TestDB.query!("CREATE TABLE sandbox_test_messages (turn text NOT NULL)", session)

    write = fn text ->
      fn repo ->
        {:ok, _} = repo.query("INSERT INTO sandbox_test_messages VALUES ($1::text)", [text], [])
        text
      end
    end

    turn = {chat, user, "turn-1"}
    assert Locks.acquire(chat, user, "turn-1", 60) == :ok
    assert Locks.transaction(SandboxRepo, turn, write.("first")) == {:ok, "first"}

    assert Locks.transaction(SandboxRepo, turn, fn repo ->
             write.("rolled back").(repo)
             SandboxRepo.rollback(:no)
           end) == {:error, :no}

    # Its lease runs out (backdated) and another turn takes the chat over.
    :ok = TestDB.backdate!([chat: chat, user: user], 120, session)
    assert Locks.acquire(chat, user, "turn-2", 60) == :ok
    assert Locks.transaction(SandboxRepo, turn, write.("late")) == {:error, :lost}
    assert TestDB.query!("SELECT turn FROM sandbox_test_messages", session) == [["first"]]

    SandboxRepo.checkin()
    assert rows_outside(chat, user) == "0"
  end

  test "a process that is not allowed on a sandbox connection gets a :connect error" do
    parent = self()

    spawn(fn ->
      try do
        Locks.held?(TestDB.uuid(), TestDB.uuid(), "turn-1")
      rescue
        error in Error -> send(parent, {error.reason, error.message})
      end
    end)

    assert_receive {:connect, message}, 5_000
    assert message =~ "cannot find ownership process for #PID<"
  end

  test "a statement PostgreSQL refuses is a :statement error with its SQLSTATE, and the test goes on",
       %{session: session} do
    {chat, user} = insert_rows!(session)

    # In the test's transaction: a trigger that refuses the ref "refused".
    TestDB.query!(
      """
      CREATE FUNCTION sandbox_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN
        IF NEW.busy_turn_ref = 'refused' THEN
          RAISE EXCEPTION 'refused by the test' USING ERRCODE = '23514';
        END IF;
        RETURN NEW;
      END $$;
      CREATE TRIGGER sandbox_test_refuse BEFORE UPDATE ON phoenix_kit_agent_conversations
        FOR EACH ROW EXECUTE FUNCTION sandbox_test_refuse()
      """,
      session
    )

    error = assert_raise Error, fn -> Locks.acquire(chat, user, "refused", 60) end

    assert {error.reason, error.sqlstate, error.message} ==
             {:statement, "23514", "statement failed: 23514: refused by the test"}

    # Rolled back alone, as Ecto's sandbox rolls a failed query back to its savepoint.
    assert Locks.acquire(chat, user, "turn-1", 60) == :ok
    assert lock_in(session, :user, user) == [["turn-1"]]
  end

  test "a statement cancelled by a timeout is :timeout", %{session: session} do
    {chat, _user} = insert_rows!(session)
    user = TestDB.uuid()
    # Another transaction inserts the user's settings row and stays open: the
    # lock's upsert waits on the unique index until the test's statement_timeout.
    other = TestDB.session!()
    TestDB.query!("BEGIN;\n" <> insert_settings_sql(user), other)
    TestDB.query!("SET LOCAL statement_timeout = '200ms'", session)

    error = assert_raise Error, fn -> Locks.acquire(chat, user, "turn-1", 60) end

    assert {error.reason, error.sqlstate, error.message} ==
             {:timeout, nil, "timed out: canceling statement due to statement timeout (57014)"}

    TestDB.close(other)
  end

  test "a connection lost with the statement in flight is :disconnected", %{session: session} do
    {chat, user} = insert_rows!(session)
    backend = TestDB.value!("SELECT pg_backend_pid()", session)
    TestDB.query!("SELECT pg_terminate_backend(#{backend})")

    error = assert_raise Error, fn -> Locks.held?(chat, user, "turn-1") end
    assert error.reason == :disconnected
  end

  describe "the testing setting" do
    # A repo with query/3 (never called here) whose config/0 is `config`.
    defp sandbox_repo(config) do
      name = Module.concat(SandboxRepo, "Config#{System.unique_integer([:positive])}")

      body =
        quote do
          def config, do: unquote(config)
          def query(_sql, _params, _opts), do: {:ok, %{rows: []}}
        end

      Module.create(name, body, Macro.Env.location(__ENV__))
      name
    end

    test "takes :sandbox with a repo that has query/3, or :disabled" do
      assert Config.testing(repo: SandboxRepo, testing: :sandbox) == {:sandbox, SandboxRepo, nil}

      assert Config.testing(repo: SandboxRepo, testing: :sandbox, prefix: "p") ==
               {:sandbox, SandboxRepo, "p"}

      assert Config.testing(repo: SandboxRepo) == :disabled
      assert Config.testing([]) == :disabled
    end

    test "takes the repo's prefix, checked, unless the library sets one" do
      repo = sandbox_repo(prefix: "kit")
      assert Config.testing(repo: repo, testing: :sandbox) == {:sandbox, repo, "kit"}
      assert Config.testing(repo: repo, testing: :sandbox, prefix: "p") == {:sandbox, repo, "p"}

      repo = sandbox_repo(prefix: "a b")
      error = assert_raise Error, fn -> Config.testing(repo: repo, testing: :sandbox) end
      assert error.message =~ "#{inspect(repo)}.config()[:prefix]: must be an identifier"
    end

    test "refuses anything else, naming the fix" do
      for {env, message} <- [
            {[testing: :inline], "testing: must be :sandbox or :disabled, got: :inline"},
            {[testing: :sandbox],
             "testing: :sandbox needs repo: the host's Ecto repo (or PhoenixKit's)"},
            {[testing: :sandbox, repo: FakeRepo],
             "repo: PhoenixKitAgent.Turns.Locks.FakeRepo has no query/3 (an Ecto SQL repo), " <>
               "which testing: :sandbox runs"}
          ] do
        error = assert_raise Error, fn -> Config.testing(env) end
        assert {error.reason, error.message} == {:config, "invalid configuration: " <> message}
      end
    end
  end
end
