defmodule PhoenixKitAgent.Turns.Locks.SettingsRowTest do
  # The user's lock lives in the user's settings row, whose `updated_at` must
  # keep saying when the settings themselves last changed.
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60
  @hold 10
  # Whole seconds: Ecto's timestamps() are timestamp(0) (TestDB.ecto_tables/2).
  @long_ago "2001-02-03T04:05:06.000000Z"

  # A user whose settings row was last changed long ago.
  defp settled_user do
    user = new_user()
    insert_settings!(user, @long_ago)
    user
  end

  describe "updated_at of a settings row" do
    test "is not changed by acquire/4 taking the user's lock" do
      {_chat, user, _turn} = held_turn!(@ttl, user: settled_user())

      assert updated_at(user) == @long_ago
    end

    test "is not changed by acquire/4 refused the user's lock" do
      {_chat, user, _turn} = held_turn!(@ttl, user: settled_user())

      assert Locks.acquire(insert_chat!(), user, turn_ref(), @ttl) == {:error, :turn_in_flight}
      assert updated_at(user) == @long_ago
    end

    test "is not changed by acquire/4 taking over a stale user lock" do
      {_chat, user, _turn} = held_turn!(@ttl, user: settled_user())
      backdate!([user: user], @ttl + 1)

      assert Locks.acquire(insert_chat!(), user, turn_ref(), @ttl) == :ok
      assert updated_at(user) == @long_ago
    end

    test "is not changed by acquire_user/4, taken or refused" do
      {user, _click} = held_click!(@ttl, @hold, settled_user())

      assert Locks.acquire_user(user, Locks.click_ref(), @ttl, @hold) ==
               {:error, :click_in_flight}

      assert updated_at(user) == @long_ago
    end

    test "is not changed by keep_user/4" do
      {user, click} = held_click!(@ttl, @hold, settled_user())

      assert Locks.keep_user(user, click, @ttl, @hold) == true
      assert updated_at(user) == @long_ago
    end

    test "is not changed by release/3" do
      {chat, user, turn} = held_turn!(@ttl, user: settled_user())

      assert Locks.release(chat, user, turn) == :ok
      assert_lock(:user, user, {nil, nil})
      assert updated_at(user) == @long_ago
    end

    test "is not changed by release_stale/4" do
      {chat, user, turn} = held_turn!(@ttl, user: settled_user(), age: @ttl + 1)

      assert Locks.release_stale(chat, user, turn, @ttl) == true
      assert_lock(:user, user, {nil, nil})
      assert updated_at(user) == @long_ago
    end

    test "is not changed by release_user/2" do
      {user, click} = held_click!(@ttl, @hold, settled_user())

      assert Locks.release_user(user, click) == :ok
      assert_lock(:user, user, {nil, nil})
      assert updated_at(user) == @long_ago
    end
  end

  describe "the user's settings row" do
    test "is created once, by the first lock of a user who has none, and kept after release" do
      user = new_user()
      assert settings_rows(user) == 0

      {chat, user, turn} = held_turn!(@ttl, user: user)
      :ok = Locks.release(chat, user, turn)
      assert_lock(:user, user, {nil, nil})

      held_turn!(@ttl, user: user)
      assert settings_rows(user) == 1
    end

    test "is created empty: only the lock; the timestamps are the database's now, " <>
           "every other column at its default (a key without one gets a uuid)" do
      user = new_user()
      [[before]] = TestDB.query!("SELECT now()::text")
      :ok = Locks.acquire(insert_chat!(), user, turn_ref(), @ttl)

      # A timestamp(0) rounds to the second, to either side.
      assert TestDB.query!("""
             SELECT inserted_at = updated_at,
                    inserted_at >= '#{before}'::timestamptz - interval '1 second',
                    updated_at <= now() + interval '1 second'
             FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}'
             """) == [["t", "t", "t"]]

      if TestDB.tables() == :ecto do
        assert TestDB.query!("""
               SELECT uuid IS NOT NULL, settings = '{}'
               FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}'
               """) == [["t", "t"]]
      end
    end
  end
end
