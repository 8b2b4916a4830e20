defmodule PhoenixKitAgent.Turns.Locks.ReleaseTest do
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60

  describe "release/3" do
    test "frees both locks of the turn that holds them, whatever the letter case of the uuids" do
      {chat, user, turn} = held_turn!(@ttl)

      assert Locks.release(String.upcase(chat), String.upcase(user), turn) == :ok
      assert_locks([chat: chat, user: user], chat: {nil, nil}, user: {nil, nil})
    end

    test "frees the chat's lock when the user's was taken over by a turn in another chat" do
      {chat, other_chat, user, lost, turn} = user_taken_over!(@ttl)

      assert Locks.release(chat, user, lost) == :ok

      assert_locks([chat: chat, user: user, chat: other_chat],
        chat: {nil, nil},
        user: {turn, 0},
        chat: {turn, 0}
      )
    end

    test "frees the user's lock when the chat's was taken over by a turn of another user" do
      {chat, user, other_user, lost, turn} = chat_taken_over!(@ttl)

      assert Locks.release(chat, user, lost) == :ok

      assert_locks([chat: chat, user: user, user: other_user],
        chat: {turn, 0},
        user: {nil, nil},
        user: {turn, 0}
      )
    end

    test "frees nothing of another turn's locks" do
      {chat, user, _turn} = held_turn!(@ttl)
      before = rows(chat: chat, user: user)

      assert Locks.release(chat, user, turn_ref()) == :ok
      assert rows(chat: chat, user: user) == before
    end

    test "does not free a click's lock of the user" do
      {user, click} = held_click!(@ttl, @ttl)
      chat = insert_chat!()

      assert Locks.release(chat, user, turn_ref()) == :ok
      assert_lock(:user, user, {click, 0})
    end

    test "answers :ok and creates no row when nothing is locked" do
      user = new_user()

      assert Locks.release(TestDB.uuid(), user, turn_ref()) == :ok
      assert_lock(:user, user, nil)
    end

    test "frees a lock older than the TTL that nobody took over" do
      {chat, user, turn} = held_turn!(@ttl)
      backdate!([chat: chat, user: user], @ttl * 10)

      assert Locks.release(chat, user, turn) == :ok
      assert_locks([chat: chat, user: user], chat: {nil, nil}, user: {nil, nil})
    end
  end
end
