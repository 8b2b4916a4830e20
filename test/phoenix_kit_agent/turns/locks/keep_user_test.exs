defmodule PhoenixKitAgent.Turns.Locks.KeepUserTest do
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60
  @hold 10

  describe "keep_user/4" do
    test "re-dates the click's lock as if taken now and answers true, whatever the letter case of the uuid" do
      {user, click} = held_click!(@ttl, @hold)
      backdate!([user: user], @hold - slack())
      assert_lock(:user, user, {click, @ttl - slack()})

      assert Locks.keep_user(String.upcase(user), click, @ttl, @hold) == true
      assert_lock(:user, user, {click, @ttl - @hold})
    end

    test "dates the lock with the ttl_s and hold_s it is given" do
      {user, click} = held_click!(@ttl, @hold)

      assert Locks.keep_user(user, click, @ttl, 45) == true
      assert_lock(:user, user, {click, @ttl - 45})
    end

    test "keeps blocking a turn for hold_s after each keep" do
      {user, click} = held_click!(@ttl, @hold)
      {chat, turn} = {insert_chat!(), turn_ref()}
      backdate!([user: user], @hold - slack())

      assert Locks.keep_user(user, click, @ttl, @hold) == true
      # Without the keep the lock would now be @ttl + @hold - 2 × slack() seconds old.
      backdate!([user: user], @hold - slack())
      assert Locks.acquire(chat, user, turn, @ttl) == {:error, :click_in_flight}

      backdate!([user: user], slack())
      assert Locks.acquire(chat, user, turn, @ttl) == :ok
    end

    test "answers false after the click released its lock, and does not lock the row again" do
      {user, click} = held_click!(@ttl, @hold)
      :ok = Locks.release_user(user, click)

      assert Locks.keep_user(user, click, @ttl, @hold) == false
      assert_lock(:user, user, {nil, nil})
    end

    test "answers false after a turn took the lock over, and leaves the turn's lock as it is" do
      {_chat, user, click, turn} = click_taken_over!(@ttl, @hold)
      backdate!([user: user], 3)
      [user: before] = rows(user: user)

      assert Locks.keep_user(user, click, @ttl, @hold) == false
      assert rows(user: user) == [user: before]
      assert_lock(:user, user, {turn, 3})
    end

    test "answers false after another click took the lock over, and leaves its lock as it is" do
      {user, click1} = held_click!(@ttl, @hold)
      backdate!([user: user], @hold + 1)
      {user, click2} = held_click!(@ttl, @hold, user)
      [user: before] = rows(user: user)

      assert Locks.keep_user(user, click1, @ttl, @hold) == false
      assert rows(user: user) == [user: before]
      assert before.ref == click2
    end

    test "never touches a lock its click does not hold: a running turn's" do
      {_chat, user, _turn} = held_turn!(@ttl)
      backdate!([user: user], 7)
      [user: before] = rows(user: user)

      assert Locks.keep_user(user, Locks.click_ref(), @ttl, @hold) == false
      assert rows(user: user) == [user: before]
    end

    test "answers false and creates no row for a user with no settings row" do
      user = new_user()

      assert Locks.keep_user(user, Locks.click_ref(), @ttl, @hold) == false
      assert_lock(:user, user, nil)
    end
  end
end
