# A PhoenixKit host most likely has `busy_since` as `timestamp without time
# zone` (what Ecto's :utc_datetime makes: `timestamp(0)`, whole seconds), and
# its server may run in any TimeZone. The locks must behave as on the shipped
# `timestamptz` schema: written and compared as UTC.
#
# Each module below restarts the application on its own schema (config
# `:prefix`) as a role whose sessions start in Asia/Tokyo (UTC+9), so a
# lock call that relied on the session's TimeZone would store a wall-clock
# time nine hours off. They are not async: while they run, every lock call of
# the VM goes to their schema; on_exit puts the configuration back.
for {suffix, column, whole_seconds?} <- [
      {Microseconds, "timestamp without time zone", false},
      {WholeSeconds, "timestamp(0) without time zone", true}
    ] do
  defmodule Module.concat(PhoenixKitAgent.Turns.Locks.NaiveTimestampTest, suffix) do
    use PhoenixKitAgent.Turns.LockCase, async: false

    @app :phoenix_kit_agent_locks
    @schema "h_unit_naive_" <> String.downcase(inspect(suffix))
    @column column
    # A `timestamp(0)` rounds now() to the nearest second: an age read back
    # may be up to one second less than it would be with microseconds.
    @slack if whole_seconds?, do: 1, else: 0
    @ttl 60

    setup_all do
      TestDB.bare_tables!(
        @schema,
        @column,
        "updated_at #{@column} NOT NULL DEFAULT (now() AT TIME ZONE 'UTC')"
      )

      TestDB.query!("""
      DO $$ BEGIN
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'locks_tokyo') THEN
          CREATE ROLE locks_tokyo LOGIN SUPERUSER PASSWORD 'locks-test-pw';
        END IF;
      END $$;
      ALTER ROLE locks_tokyo SET timezone = 'Asia/Tokyo';
      """)

      saved = Application.get_all_env(@app)
      tokyo = TestDB.url() |> URI.parse() |> Map.put(:userinfo, "locks_tokyo:locks-test-pw")
      tokyo = URI.to_string(tokyo)

      restart!(url: tokyo, prefix: @schema)

      on_exit(fn ->
        restart!(url: saved[:url], prefix: saved[:prefix])
        TestDB.query!("DROP SCHEMA IF EXISTS #{@schema} CASCADE", TestDB.url())
      end)
    end

    # setup_all and on_exit run outside the tests' log capture: the notice
    # of the stopped application is captured here.
    defp restart!(config) do
      ExUnit.CaptureLog.capture_log(fn ->
        :ok = Application.stop(@app)

        for {key, value} <- config do
          if value == nil,
            do: Application.delete_env(@app, key),
            else: Application.put_env(@app, key, value)
        end

        {:ok, _} = Application.ensure_all_started(@app)
      end)
    end

    defp insert_chat do
      chat = TestDB.uuid()

      TestDB.query!(
        "INSERT INTO #{@schema}.phoenix_kit_agent_conversations (uuid) VALUES ('#{chat}')"
      )

      chat
    end

    # {ref, whole seconds old}, reading busy_since as UTC whatever this
    # session's TimeZone.
    defp lock_of(table, key, id) do
      [[ref, age]] =
        TestDB.query!("""
        SELECT busy_turn_ref,
               floor(extract(epoch FROM (now() AT TIME ZONE 'UTC') - busy_since))::int
        FROM #{@schema}.#{table} WHERE #{key} = '#{id}'
        """)

      {ref, age && String.to_integer(age)}
    end

    defp chat_lock(chat), do: lock_of("phoenix_kit_agent_conversations", "uuid", chat)
    defp user_lock(user), do: lock_of("phoenix_kit_agent_user_settings", "user_uuid", user)

    # As LockCase.assert_lock/3 (a lock may be read up to 2 s after the call
    # that dated it), on this module's schema, less the rounding of a
    # whole-seconds column.
    defp assert_naive_lock({ref, age}, expected_ref, expected_age) do
      assert ref == expected_ref
      assert age in (expected_age - @slack)..(expected_age + 2)
    end

    defp backdate(table, key, id, seconds) do
      TestDB.query!("""
      UPDATE #{@schema}.#{table} SET busy_since = busy_since - #{seconds} * interval '1 second'
      WHERE #{key} = '#{id}'
      """)
    end

    defp backdate_chat(chat, s), do: backdate("phoenix_kit_agent_conversations", "uuid", chat, s)

    defp backdate_user(user, s),
      do: backdate("phoenix_kit_agent_user_settings", "user_uuid", user, s)

    describe "on #{column} columns, with connections starting in Asia/Tokyo" do
      test "acquire/4 stores both locks at the database's now() in UTC" do
        chat = insert_chat()
        user = new_user()
        turn = turn_ref()

        assert Locks.acquire(chat, user, turn, @ttl) == :ok
        assert_naive_lock(chat_lock(chat), turn, 0)
        assert_naive_lock(user_lock(user), turn, 0)
        assert Locks.held?(chat, user, turn) == true
        assert Locks.fresh?(chat, turn, @ttl) == true
      end

      test "acquire/4 takes over a lock older than the TTL, not one a second short of it" do
        chat = insert_chat()
        turn = turn_ref()
        :ok = Locks.acquire(chat, new_user(), turn_ref(), @ttl)

        backdate_chat(chat, @ttl - 2)
        assert Locks.acquire(chat, new_user(), turn, @ttl) == {:error, :conversation_busy}
        assert Locks.fresh?(chat, turn, @ttl) == false

        backdate_chat(chat, 3)
        assert Locks.acquire(chat, new_user(), turn, @ttl) == :ok
        assert_naive_lock(chat_lock(chat), turn, 0)
      end

      test "acquire_user/4 dates the click's lock ttl_s - hold_s back, and a turn takes it after hold_s" do
        chat = insert_chat()
        user = new_user()
        click = Locks.click_ref()
        turn = turn_ref()

        assert Locks.acquire_user(user, click, @ttl, 10) == :ok
        assert_naive_lock(user_lock(user), click, @ttl - 10)
        assert Locks.acquire(chat, user, turn, @ttl) == {:error, :click_in_flight}

        assert Locks.keep_user(user, click, @ttl, 10) == true
        backdate_user(user, 11)
        assert Locks.acquire(chat, user, turn, @ttl) == :ok
      end

      test "release_stale/4 frees a lock once older than the TTL, and release/3 frees a fresh one" do
        [chat1, chat2] = [insert_chat(), insert_chat()]
        [user1, user2] = [new_user(), new_user()]
        [lost, turn] = [turn_ref("lost"), turn_ref()]
        :ok = Locks.acquire(chat1, user1, lost, @ttl)
        :ok = Locks.acquire(chat2, user2, turn, @ttl)

        backdate_chat(chat1, @ttl - 2)
        assert Locks.release_stale(chat1, user1, lost, @ttl) == false
        backdate_chat(chat1, 3)
        assert Locks.release_stale(chat1, user1, lost, @ttl) == true
        assert {chat_lock(chat1), user_lock(user1)} == {{nil, nil}, {nil, nil}}

        assert Locks.release(chat2, user2, turn) == :ok
        assert {chat_lock(chat2), user_lock(user2)} == {{nil, nil}, {nil, nil}}
      end
    end
  end
end
