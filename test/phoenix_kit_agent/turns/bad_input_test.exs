defmodule PhoenixKitAgent.Turns.BadInputTest do
  # The one bad-input suite. Every argument of every function is checked
  # before anything reaches the database:
  #
  #   * the Elixir API raises ArgumentError naming the argument, for any value
  #     but what it documents, and changes no row; valid values at the limits
  #     are taken;
  #   * the NIF alone (a caller that skips the Elixir module) refuses every
  #     term the API refuses, by the same rules and limits, with ArgumentError,
  #     never a panic, never a statement sent (the wording is the Elixir
  #     module's);
  #   * thousands of generated bad arguments (seeded, Robust.Junk) through
  #     both run no SQL, on a node and a database of their own;
  #   * bad configurations and schema arguments raise before any SQL.
  use PhoenixKitAgent.Turns.LockCase, async: true

  alias PhoenixKitAgent.Turns.Locks.Robust.{Junk, Node, Pg, Race}

  @moduletag :robustness

  # Calls fun(args) through the API or the NIF alone and asserts it raised
  # ArgumentError; the API's message names the argument.
  defp assert_refused(caller, fun, args, name, what) do
    answer = if caller == :api, do: apply(Locks, fun, args), else: native(fun, args)
    flunk("#{caller}: #{fun} with #{name} #{what} answered #{inspect(answer)} instead of raising")
  rescue
    error in ArgumentError ->
      if caller == :api do
        assert error.message =~ ~r/\Ainvalid #{name}: /,
               "#{fun} with #{name} #{what}: #{inspect(error.message)} does not name #{name}"
      end
  end

  # The API refuses any value but what it documents, and so does the NIF
  # alone (a caller that skips the API): the rules are one.
  for {caller, title} <- [api: "the API:", nif: "the NIF alone: Native.run/3 of"],
      {fun, arguments} <- arguments() do
    describe "#{title} #{fun}/#{length(arguments)}" do
      for {{name, kind}, position} <- Enum.with_index(arguments) do
        test "raises ArgumentError for any #{name} but #{valid(kind)}, and changes no row" do
          {args, ids} = call_that_would_write(unquote(fun))
          before = rows(ids)

          for {what, bad} <- invalid(unquote(kind)) do
            args = List.replace_at(args, unquote(position), bad)
            assert_refused(unquote(caller), unquote(fun), args, unquote(name), what)
          end

          assert rows(ids) == before
        end
      end
    end
  end

  # The setups above are not vacuous: with valid arguments, every writing
  # call changes the rows it was refused (fresh? and held? only read).
  describe "the calls refused above, with valid arguments" do
    test "change the rows they were set up to change" do
      for fun <- [
            :acquire,
            :acquire_user,
            :keep,
            :keep_user,
            :release,
            :release_stale,
            :release_user
          ] do
        {args, ids} = call_that_would_write(fun)
        before = rows(ids)

        assert apply(Locks, fun, args) in [:ok, true], "#{fun} did not succeed"
        assert rows(ids) != before, "#{fun} changed no row"
      end
    end
  end

  describe "the limits of each argument" do
    test "a turn_ref of 255 bytes is a turn's ref, also in multi-byte characters" do
      for turn <- [String.duplicate("t", 255), String.duplicate("é", 127) <> "t"] do
        chat = insert_chat!()
        user = new_user()

        assert Locks.acquire(chat, user, turn, 60) == :ok
        assert_lock(:chat, chat, {turn, 0})
        assert Locks.held?(chat, user, turn) == true
        assert Locks.release(chat, user, turn) == :ok
      end
    end

    test "a turn_ref that merely contains \"click:\" after its start is a turn's ref" do
      chat = insert_chat!()
      turn = "turn-click:" <> turn_ref()

      assert Locks.acquire(chat, new_user(), turn, 60) == :ok
      assert_lock(:chat, chat, {turn, 0})
    end

    test "a click ref of 255 bytes is accepted" do
      user = new_user()
      click = "click:" <> String.duplicate("0", 249)

      assert Locks.acquire_user(user, click, 60, 60) == :ok
      assert_lock(:user, user, {click, 0})
      assert Locks.release_user(user, click) == :ok
    end

    test "ttl_s of 1 second and of ten years (315_360_000) are accepted and hold to the second" do
      [chat1, chat2] = insert_chats!(2)
      [turn1, turn2] = [turn_ref(), turn_ref()]

      assert Locks.acquire(chat1, new_user(), turn_ref(), 1) == :ok
      backdate!([chat: chat1], 1)
      assert Locks.acquire(chat1, new_user(), turn1, 1) == :ok

      assert Locks.acquire(chat2, new_user(), turn2, 315_360_000) == :ok
      backdate!([chat: chat2], 315_360_000 - 1)
      assert Locks.fresh?(chat2, turn2, 315_360_000) == true

      assert Locks.acquire(chat2, new_user(), turn_ref(), 315_360_000) ==
               {:error, :conversation_busy}

      backdate!([chat: chat2], 1)
      assert Locks.fresh?(chat2, turn2, 315_360_000) == false
      assert Locks.release_stale(chat2, new_user(), turn2, 315_360_000) == true
    end

    test "hold_s of 1 second and of ttl_s are accepted, the longest dating the lock ten years back" do
      user = new_user()
      click = Locks.click_ref()

      assert Locks.acquire_user(user, click, 60, 60) == :ok
      assert Locks.keep_user(user, click, 60, 1) == true
      assert_lock(:user, user, {click, 59})

      assert Locks.keep_user(user, click, 315_360_000, 1) == true
      assert_lock(:user, user, {click, 315_359_999})
    end
  end

  describe "the NIF alone" do
    test "answers the documented terms for valid arguments" do
      [chat1, chat2] = insert_chats!(2)
      user = new_user()
      turn = turn_ref()
      click = Locks.click_ref()

      assert native(:acquire, [chat1, user, turn, 60]) == :ok
      assert native(:acquire, [chat1, new_user(), turn_ref(), 60]) == {:error, :conversation_busy}
      assert native(:acquire, [chat2, user, turn_ref(), 60]) == {:error, :turn_in_flight}
      assert native(:acquire_user, [user, click, 60, 10]) == {:error, :turn_in_flight}

      assert {native(:held?, [chat1, user, turn]), native(:fresh?, [chat1, turn, 60])} ==
               {true, true}

      assert native(:release_stale, [chat1, user, turn, 60]) == false
      assert native(:release, [chat1, user, turn]) == :ok
      assert native(:acquire_user, [user, click, 60, 10]) == :ok
      assert native(:keep_user, [user, click, 60, 10]) == true
      assert native(:release_user, [user, click]) == :ok
      assert_locks([chat: chat1, user: user], chat: {nil, nil}, user: {nil, nil})
    end

    test "a term that is not a stamp or a lock call is refused before anything is sent, " <>
           "and gives its slot back" do
      chat = insert_chat!()
      user = new_user()
      args = Enum.map([chat, user], &uuid_bytes/1) ++ ["t"]
      start = System.monotonic_time(:nanosecond)

      # Not a stamp, not a lock function, not its arity, not a proper list;
      # three times over, more calls than the pool has slots: a slot kept
      # by any would leave the last calls none.
      for _ <- 1..3,
          {stamp, function, args} <- [
            {:now, :held?, args},
            {start, :held, args},
            {start, :held?, tl(args)},
            {start, :held?, :args},
            {start, :held?, [hd(args) | :improper]},
            {start, :held?, [hd(args), hd(tl(args)) | "t"]}
          ] do
        assert_raise ArgumentError, fn -> Locks.call(function, stamp, args) end
      end

      assert native(:held?, [chat, user, "t"]) == false
    end

    test "no term given to any NIF panics" do
      junk = [
        nil,
        -1,
        2 ** 70,
        1.5,
        "",
        <<0, 255>>,
        [1 | 2],
        [:a, [:b | :c]],
        {:a, 1},
        %{a: 1},
        self(),
        make_ref(),
        fn -> :ok end
      ]

      for arity <- 0..4,
          {function, ^arity} <- Native.__info__(:functions),
          function not in [:load_nif, :start, :stop],
          args <- junk_args(junk, arity) do
        try do
          # A place in line taken by junk is left at once.
          with answer when is_tuple(answer) and elem(answer, 0) == :wait <-
                 apply(Native, function, args) do
            Native.leave()
            receive do: ({:phoenix_kit_agent_locks, _} -> :ok), after: (0 -> :ok)
          end
        rescue
          ArgumentError -> :ok
          PhoenixKitAgent.Turns.Locks.Error -> :ok
        catch
          kind, reason ->
            flunk("Native.#{function}#{inspect(args)}: #{kind} #{inspect(reason)}")
        end
      end

      # Every slot the junk took went back: calls still find one.
      assert native(:held?, [insert_chat!(), new_user(), "t"]) == false
    end
  end

  # Every argument list of `arity` made of `junk`, each position in turn.
  defp junk_args(_junk, 0), do: [[]]

  defp junk_args(junk, arity) do
    for position <- 0..(arity - 1), bad <- junk do
      List.replace_at(List.duplicate(:junk, arity), position, bad)
    end
  end

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
      TestDB.need_pg_stat_statements!()

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
            ["'; DROP TABLE x; --", "a b", "a\"b", "", "1x", String.duplicate("a", 64), "é"] ++
              [1, :x, ~c"x"] do
        error =
          assert_raise ArgumentError, fn ->
            PhoenixKitAgent.Turns.Locks.Schema.sql(:tables, prefix)
          end

        assert error.message ==
                 "invalid prefix: must be an identifier: a letter or _, then letters, digits, " <>
                   "_ or $ (at most 63), got: #{inspect(prefix)}"
      end
    end

    test "Native.setup/1 with an unknown kind raises ArgumentError and runs no DDL" do
      TestDB.need_pg_stat_statements!()
      extension = "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"
      {db, url} = Pg.create_database!("setup_junk", sql: extension)

      node = Node.start!(app_env: [url: url, pool_size: 1])

      answer = Node.call(node, Race, :attempt_in, [Native, :setup, [:drop_everything]])
      assert {:raised, %ArgumentError{}} = answer
      assert library_connections(db) == 0
    end
  end
end
