defmodule PhoenixKitAgent.Turns.Locks.ReleaseStaleTest do
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60

  describe "release_stale/4" do
    test "answers false short of ttl_s" do
      {chat, user, turn} = held_turn!(@ttl, age: @ttl - slack(), label: "lost")

      assert Locks.release_stale(chat, user, turn, @ttl) == false
      age = @ttl - slack()
      assert_locks([chat: chat, user: user], chat: {turn, age}, user: {turn, age})
    end

    test "frees both locks as soon as the chat's is older than ttl_s, and answers true only once, " <>
           "whatever the letter case of the uuids" do
      {chat, user, turn} = held_turn!(@ttl, age: @ttl, label: "lost")

      assert Locks.release_stale(String.upcase(chat), String.upcase(user), turn, @ttl) == true
      assert Locks.release_stale(chat, user, turn, @ttl) == false
      assert_locks([chat: chat, user: user], chat: {nil, nil}, user: {nil, nil})
    end

    test "measures age against the caller's ttl_s" do
      {chat, user, turn} = held_turn!(@ttl, age: 30, label: "lost")

      assert Locks.release_stale(chat, user, turn, 31) == false
      assert Locks.release_stale(chat, user, turn, 29) == true
    end

    test "answers false and frees nothing when the stale chat lock is another turn's" do
      {chat, user, _turn} = held_turn!(@ttl, age: @ttl + 1, label: "lost")
      before = rows(chat: chat, user: user)

      assert Locks.release_stale(chat, user, turn_ref(), @ttl) == false
      assert rows(chat: chat, user: user) == before
    end

    test "frees the chat but leaves the user's lock to the turn that took it over" do
      {chat, user, lost} = held_turn!(@ttl, age: @ttl + 1, label: "lost")
      {_other_chat, user, turn} = held_turn!(@ttl, user: user)

      assert Locks.release_stale(chat, user, lost, @ttl) == true
      assert_locks([chat: chat, user: user], chat: {nil, nil}, user: {turn, 0})
    end

    test "frees nothing while the chat's lock is fresh, even when the user's is stale" do
      {chat, user, turn} = held_turn!(@ttl, label: "lost")
      backdate!([user: user], @ttl + 1)
      before = rows(chat: chat, user: user)

      assert Locks.release_stale(chat, user, turn, @ttl) == false
      assert rows(chat: chat, user: user) == before
    end

    test "answers true for a stale chat lock whose user has no settings row, and creates none" do
      {chat, _user, lost} = held_turn!(@ttl, age: @ttl + 1, label: "lost")
      stranger = new_user()

      assert Locks.release_stale(chat, stranger, lost, @ttl) == true
      assert_locks([chat: chat, user: stranger], chat: {nil, nil}, user: nil)
    end

    test "answers false for a conversation uuid with no row" do
      assert Locks.release_stale(TestDB.uuid(), new_user(), turn_ref(), @ttl) == false
    end
  end
end
