defmodule PhoenixKitAgent.Turns.Robustness.BadInputTest do
  # Bad input at the boundary: thousands of generated bad arguments (seeded,
  # Robust.Junk) through every lock function of the API and through the NIF
  # directly. Every call must raise ArgumentError (or FunctionClauseError)
  # and run no SQL.
  #
  # "No SQL" is measured where nothing else runs: a node of its own on a
  # database of its own. Its pool connects lazily, so a library that sent
  # nothing has not even opened a connection; pg_stat_statements (per
  # database) must not count a single library statement either.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Native, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.{Junk, Node, Pg, Race}

  @moduletag :robustness

  @seed {20_240, 6, 1}
  @chat "6f1c4f9e-8a53-4a77-9b1e-3f0c2d8e5a10"

  defp snapshot(url) do
    TestDB.query!(
      """
      SELECT (SELECT md5(string_agg(c::text, ',' ORDER BY uuid)) FROM phoenix_kit_agent_conversations c),
             (SELECT md5(string_agg(u::text, ',' ORDER BY user_uuid)) FROM phoenix_kit_agent_user_settings u)
      """,
      url
    )
  end

  # The library's statements as the server counted them in database `db`.
  # (Its texts carry `$n::uuid` casts; psql's own queries here do not.)
  defp library_statements(db, url) do
    [[calls]] =
      TestDB.query!(
        """
        SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements
        WHERE dbid = (SELECT oid FROM pg_database WHERE datname = '#{db}')
          AND query LIKE '%::uuid%'
        """,
        url
      )

    String.to_integer(calls)
  end

  defp library_connections(db) do
    [[n]] =
      TestDB.query!("""
      SELECT count(*) FROM pg_stat_activity
      WHERE datname = '#{db}' AND application_name = 'phoenix_kit_agent_locks'
      """)

    String.to_integer(n)
  end

  describe "a node of its own on an otherwise idle database" do
    @tag :slow
    test "8,000 bad calls (API and NIF) raise ArgumentError, run no SQL, panic nowhere; " <>
           "the tables, the VM and the pool are fine afterwards" do
      {db, url} =
        Pg.create_database!("junk",
          sql: """
          CREATE EXTENSION IF NOT EXISTS pg_stat_statements;
          INSERT INTO phoenix_kit_agent_conversations VALUES ('#{@chat}', now(), 'turn-1');
          INSERT INTO phoenix_kit_agent_user_settings (user_uuid, busy_since, busy_turn_ref)
            VALUES ('#{@chat}', now(), 'turn-1')
          """
        )

      node = Node.start!(app_env: [url: url, pool_size: 3])
      assert {_pid, {:ok, _}} = Node.hello(node)
      tables = snapshot(url)
      statements = library_statements(db, url)
      vm = Node.call(node, :erlang, :system_info, [:process_count])

      {counts, unexpected} = Node.call(node, Junk, :run_seeded, [@seed, 8_000])

      assert unexpected == [],
             "#{length(unexpected)} calls, e.g. #{inspect(Enum.take(unexpected, 5))}"

      assert Map.keys(counts) -- [ArgumentError, FunctionClauseError] == []
      assert counts[ArgumentError] == 8_000

      # No SQL: no connection was ever opened, no library statement counted.
      assert library_connections(db) == 0
      assert library_statements(db, url) == statements
      assert snapshot(url) == tables

      # The VM is fine: no process left behind, the NIF still answers.
      assert_in_delta Node.call(node, :erlang, :system_info, [:process_count]), vm, 10
      assert Node.call(node, Locks, :held?, [@chat, @chat, "turn-1"])

      # The measure works: that one valid call is seen by both counters.
      assert library_connections(db) == 1
      assert library_statements(db, url) == statements + 1

      # Bad options for Native.start/1 raise, and leave the running pool alone.
      outcomes = Node.call(node, Junk, :start_junk, [])

      expected = [:argument_error, :decode_error, {:locks_error, :config}]
      assert Enum.all?(outcomes, &(&1 in expected)), inspect(outcomes)

      assert Node.call(node, Locks, :held?, [@chat, @chat, "turn-1"])
      assert snapshot(url) == tables
    end
  end

  describe "in the test VM" do
    test "5,000 bad calls raise ArgumentError; the shared tables are still there" do
      {counts, unexpected} = Junk.run(Junk.calls({7, 7, 7}, 5_000))

      assert unexpected == [],
             "#{length(unexpected)} calls, e.g. #{inspect(Enum.take(unexpected, 5))}"

      assert Map.keys(counts) -- [ArgumentError, FunctionClauseError] == []

      assert TestDB.query!(
               "SELECT to_regclass('phoenix_kit_agent_conversations') IS NOT NULL, to_regclass('phoenix_kit_agent_user_settings') IS NOT NULL"
             ) ==
               [["t", "t"]]

      chat = TestDB.insert_chat!()
      assert Locks.acquire(chat, TestDB.uuid(), "after-junk", 60) == :ok
    end

    test "SQL text as a turn ref is a plain value: stored verbatim, nothing else runs" do
      chat = TestDB.insert_chat!()
      user = TestDB.uuid()

      for ref <- [
            "'; DROP TABLE phoenix_kit_agent_conversations; --",
            "x' OR '1'='1",
            "$1",
            "\\'; SELECT pg_sleep(10); --",
            "é🔒\u200b"
          ] do
        assert Locks.acquire(chat, user, ref, 60) == :ok
        assert {^ref, _age} = TestDB.lock(:chat, chat)
        assert Locks.held?(chat, user, ref)
        assert Locks.release(chat, user, ref) == :ok
        assert TestDB.lock(:chat, chat) == {nil, nil}
      end
    end

    test "boundary values that are valid are taken" do
      chat = TestDB.insert_chat!()
      user = TestDB.uuid()
      ref = String.duplicate("r", 255)
      assert Locks.acquire(String.upcase(chat), String.upcase(user), ref, 315_360_000) == :ok
      assert Locks.held?(chat, user, ref)
      assert Locks.fresh?(chat, ref, 315_360_000)
      assert is_boolean(Locks.fresh?(chat, ref, 1))
      assert Locks.release(chat, user, ref) == :ok

      click = "click:"
      assert Locks.acquire_user(user, click, 1, 1) == :ok
      assert Locks.keep_user(user, click, 315_360_000, 315_360_000)
      assert Locks.release_user(user, click) == :ok
      assert TestDB.lock(:user, user) == {nil, nil}
    end
  end

  describe "configuration" do
    test "a setting too large for the native side is refused as a config error naming it" do
      node =
        Node.start!(
          app_env: [url: "postgres://u:pw@127.0.0.1:1/db", checkout_timeout: 2 ** 64],
          env: [{"DATABASE_URL", nil}]
        )

      assert {_pid, {:error, reason}} = Node.hello(node)
      # Not "Could not decode field :checkout_timeout on %{}" (an ErlangError
      # from the NIF's map decoder, as when Config.read/1 let any integer
      # through): named like every other bad setting.
      assert inspect(reason) =~ "invalid configuration: checkout_timeout"
    end
  end

  describe "the schema functions" do
    test "a bad kind or prefix raises before any SQL, and no prefix reaches the DDL unquoted" do
      for kind <- [:drop, "tables", nil, 1] do
        assert_raise FunctionClauseError, fn -> PhoenixKitAgent.Turns.Locks.Schema.sql(kind) end

        assert_raise FunctionClauseError, fn ->
          PhoenixKitAgent.Turns.Locks.Schema.setup!(kind)
        end

        assert_raise ArgumentError, fn -> Native.ddl(kind, nil) end
      end

      for prefix <-
            ["'; DROP TABLE x; --", "a b", "a\"b", "", String.duplicate("a", 64), "é"] ++
              [1, :x, ~c"x"] do
        assert_raise ArgumentError, ~r/\Ainvalid prefix: /, fn ->
          PhoenixKitAgent.Turns.Locks.Schema.sql(:tables, prefix)
        end
      end
    end

    test "Native.setup/1 with an unknown kind raises ArgumentError and runs no DDL" do
      {db, url} =
        Pg.create_database!("setup_junk", sql: "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")

      node = Node.start!(app_env: [url: url, pool_size: 1])

      answer = Node.call(node, Race, :attempt_in, [Native, :setup, [:drop_everything]])
      assert {:raised, %ArgumentError{}} = answer
      assert library_connections(db) == 0
    end
  end
end
