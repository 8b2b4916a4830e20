defmodule PhoenixKitAgent.Turns.Locks.ReleaseUserTest do
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60
  @hold 10

  describe "release_user/2" do
    test "frees the user's lock of the click that holds it, whatever the letter case of the uuid" do
      {user, click} = held_click!(@ttl, @hold)

      assert Locks.release_user(String.upcase(user), click) == :ok
      assert_lock(:user, user, {nil, nil})
    end

    test "frees nothing of another click's lock" do
      {user, _click} = held_click!(@ttl, @hold)
      before = rows(user: user)

      assert Locks.release_user(user, Locks.click_ref()) == :ok
      assert rows(user: user) == before
    end

    test "frees nothing of a turn's lock" do
      {chat, user, _turn} = held_turn!(@ttl)
      before = rows(user: user, chat: chat)

      assert Locks.release_user(user, Locks.click_ref()) == :ok
      assert rows(user: user, chat: chat) == before
    end

    test "a late release by a click that was taken over frees nothing of the new holder" do
      {chat, user, click, turn} = click_taken_over!(@ttl, @hold)

      assert Locks.release_user(user, click) == :ok
      assert_locks([user: user, chat: chat], user: {turn, 0}, chat: {turn, 0})
    end

    test "answers :ok and creates no row for a user with no settings row" do
      user = new_user()

      assert Locks.release_user(user, Locks.click_ref()) == :ok
      assert_lock(:user, user, nil)
    end
  end
end
