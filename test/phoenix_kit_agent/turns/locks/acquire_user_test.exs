defmodule PhoenixKitAgent.Turns.Locks.AcquireUserTest do
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60
  @hold 10

  describe "acquire_user/4" do
    test "takes the user's lock for the click, dated back by ttl_s - hold_s, whatever the letter case of the uuid" do
      user = new_user()
      click = Locks.click_ref()

      assert Locks.acquire_user(String.upcase(user), click, @ttl, @hold) == :ok
      assert_lock(:user, user, {click, @ttl - @hold})
    end

    test "dates the lock as taken now when hold_s equals ttl_s" do
      user = new_user()
      click = Locks.click_ref()

      assert Locks.acquire_user(user, click, @ttl, @ttl) == :ok
      assert_lock(:user, user, {click, 0})
    end

    test "takes the lock in an existing free settings row" do
      user = new_user()
      insert_settings!(user, "2001-02-03T04:05:06Z")
      click = Locks.click_ref()

      assert Locks.acquire_user(user, click, @ttl, @hold) == :ok
      assert_lock(:user, user, {click, @ttl - @hold})
    end

    test "is refused with :turn_in_flight while a turn of the user runs, and changes nothing" do
      {chat, user, turn} = held_turn!(@ttl)

      assert Locks.acquire_user(user, Locks.click_ref(), @ttl, @hold) ==
               {:error, :turn_in_flight}

      assert_locks([user: user, chat: chat], user: {turn, 0}, chat: {turn, 0})
    end

    test "never takes over a turn's lock before the TTL, however short the hold" do
      {_chat, user, turn} = held_turn!(@ttl)
      backdate!([user: user], @ttl - slack())

      assert Locks.acquire_user(user, Locks.click_ref(), @ttl, 1) == {:error, :turn_in_flight}
      assert_lock(:user, user, {turn, @ttl - slack()})
    end

    test "takes over a turn's lock older than the TTL (its node went down)" do
      {_chat, user, _turn} = held_turn!(@ttl)
      click = Locks.click_ref()
      backdate!([user: user], @ttl + 1)

      assert Locks.acquire_user(user, click, @ttl, @hold) == :ok
      assert_lock(:user, user, {click, @ttl - @hold})
    end

    test "is refused with :click_in_flight while another click holds the lock, and changes nothing" do
      {user, click1} = held_click!(@ttl, @hold)
      [user: before] = rows(user: user)

      assert Locks.acquire_user(user, Locks.click_ref(), @ttl, @hold) ==
               {:error, :click_in_flight}

      assert [user: %{ref: ^click1, since: since}] = rows(user: user)
      assert since == before.since
    end

    test "takes over another click's lock once that click's hold has passed" do
      {user, _click1} = held_click!(@ttl, @hold)
      click2 = Locks.click_ref()
      backdate!([user: user], @hold - slack())
      assert Locks.acquire_user(user, click2, @ttl, @hold) == {:error, :click_in_flight}

      backdate!([user: user], slack())
      assert Locks.acquire_user(user, click2, @ttl, @hold) == :ok
      assert_lock(:user, user, {click2, @ttl - @hold})
    end

    test "blocks a turn for hold_s seconds, after which the turn takes the lock over" do
      {user, _click} = held_click!(@ttl, @hold)
      {chat, turn} = {insert_chat!(), turn_ref()}

      assert Locks.acquire(chat, user, turn, @ttl) == {:error, :click_in_flight}
      backdate!([user: user], @hold - slack())
      assert Locks.acquire(chat, user, turn, @ttl) == {:error, :click_in_flight}
      assert_lock(:chat, chat, {nil, nil})

      backdate!([user: user], slack())
      assert Locks.acquire(chat, user, turn, @ttl) == :ok
      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {turn, 0})
    end

    test "taking the lock again with the click that holds it succeeds and re-dates it" do
      {user, click} = held_click!(@ttl, @hold)
      backdate!([user: user], 5)
      assert_lock(:user, user, {click, @ttl - @hold + 5})

      assert Locks.acquire_user(user, click, @ttl, @hold) == :ok
      assert_lock(:user, user, {click, @ttl - @hold})
    end

    test "takes the lock in a row freed by release_user/2" do
      {user, click1} = held_click!(@ttl, @hold)
      click2 = Locks.click_ref()
      :ok = Locks.release_user(user, click1)

      assert Locks.acquire_user(user, click2, @ttl, @hold) == :ok
      assert_lock(:user, user, {click2, @ttl - @hold})
    end
  end
end
