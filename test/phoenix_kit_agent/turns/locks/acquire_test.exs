defmodule PhoenixKitAgent.Turns.Locks.AcquireTest do
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60

  describe "acquire/4" do
    test "takes the chat's and the user's lock for the turn, whatever the letter case of the uuids" do
      chat = insert_chat!()
      user = new_user()
      turn = turn_ref()

      assert Locks.acquire(String.upcase(chat), String.upcase(user), turn, @ttl) == :ok
      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {turn, 0})
    end

    test "takes the lock of a user whose settings row exists and is free" do
      chat = insert_chat!()
      user = new_user()
      insert_settings!(user, "2001-02-03T04:05:06Z")
      turn = turn_ref()

      assert Locks.acquire(chat, user, turn, @ttl) == :ok
      assert_lock(:user, user, {turn, 0})
      assert settings_rows(user) == 1
    end

    test "answers :conversation_busy for a second turn in the same chat, and creates no settings row" do
      {chat, user1, turn1} = held_turn!(@ttl)
      user2 = new_user()

      assert Locks.acquire(chat, user2, turn_ref(), @ttl) == {:error, :conversation_busy}

      assert_locks([chat: chat, user: user1, user: user2],
        chat: {turn1, 0},
        user: {turn1, 0},
        user: nil
      )
    end

    test "tries the chat first: a busy chat leaves the user's row untouched, even a stale lock" do
      # The user's lock is stale (it could be taken over), the chat is busy.
      {_other_chat, user, old_turn} = held_turn!(@ttl)
      backdate!([user: user], @ttl + 10)
      {chat, _other_user, _turn} = held_turn!(@ttl)
      [user: before] = rows(user: user)

      assert Locks.acquire(chat, user, turn_ref(), @ttl) == {:error, :conversation_busy}
      # Same lock, same busy_since to the microsecond, same row version.
      assert rows(user: user) == [user: before]
      assert_lock(:user, user, {old_turn, @ttl + 10})
    end

    test "answers :turn_in_flight while a turn of the same user runs in another chat, and leaves that chat free" do
      {chat1, user, turn1} = held_turn!(@ttl)
      chat2 = insert_chat!()

      assert Locks.acquire(chat2, user, turn_ref(), @ttl) == {:error, :turn_in_flight}

      assert_locks([chat: chat2, chat: chat1, user: user],
        chat: {nil, nil},
        chat: {turn1, 0},
        user: {turn1, 0}
      )
    end

    test "answers :click_in_flight while a click holds the user's lock, and leaves the chat free" do
      {user, click} = held_click!(@ttl, 30)
      chat = insert_chat!()

      assert Locks.acquire(chat, user, turn_ref(), @ttl) == {:error, :click_in_flight}
      assert_locks([chat: chat, user: user], chat: {nil, nil}, user: {click, @ttl - 30})
    end

    test "takes neither lock when the user's is refused: a stale chat lock stays as it was" do
      # The chat's lock was left by a turn whose node went down; the user has
      # a turn running elsewhere.
      {chat, _lost_user, lost} = held_turn!(@ttl, label: "lost")
      backdate!([chat: chat], @ttl + 5)
      {_other_chat, user, running} = held_turn!(@ttl, label: "running")
      [chat: before] = rows(chat: chat)

      assert Locks.acquire(chat, user, turn_ref(), @ttl) == {:error, :turn_in_flight}
      assert [chat: %{ref: ^lost, since: since}] = rows(chat: chat)
      assert since == before.since
      assert_lock(:user, user, {running, 0})
    end

    test "takes over a chat lock as soon as it is older than its TTL" do
      {chat, user1, lost} = held_turn!(@ttl, label: "lost")
      {user2, turn} = {new_user(), turn_ref()}
      # Exactly @ttl back: older than the TTL by the time this call runs.
      backdate!([chat: chat], @ttl)

      assert Locks.acquire(chat, user2, turn, @ttl) == :ok
      assert_locks([chat: chat, user: user2], chat: {turn, 0}, user: {turn, 0})
      # The lost turn's user lock is another row: it stays the lost turn's.
      assert_lock(:user, user1, {lost, 0})
    end

    test "does not take over a chat lock short of its TTL" do
      {chat, _user1, turn1} = held_turn!(@ttl, age: @ttl - slack())
      user2 = new_user()

      assert Locks.acquire(chat, user2, turn_ref(), @ttl) == {:error, :conversation_busy}
      assert_locks([chat: chat, user: user2], chat: {turn1, @ttl - slack()}, user: nil)
    end

    test "takes over a user lock as soon as it is older than its TTL, left by a turn in another chat" do
      {chat1, user, lost} = held_turn!(@ttl, label: "lost")
      {chat2, turn} = {insert_chat!(), turn_ref()}
      backdate!([user: user], @ttl)

      assert Locks.acquire(chat2, user, turn, @ttl) == :ok

      assert_locks([chat: chat2, user: user, chat: chat1],
        chat: {turn, 0},
        user: {turn, 0},
        chat: {lost, 0}
      )
    end

    test "does not take over a user lock short of its TTL" do
      {_chat1, user, turn1} = held_turn!(@ttl)
      chat2 = insert_chat!()
      backdate!([user: user], @ttl - slack())

      assert Locks.acquire(chat2, user, turn_ref(), @ttl) == {:error, :turn_in_flight}
      assert_locks([chat: chat2, user: user], chat: {nil, nil}, user: {turn1, @ttl - slack()})
    end

    test "measures age against the caller's ttl_s" do
      {chat, _user1, _turn1} = held_turn!(@ttl)
      {user2, turn} = {new_user(), turn_ref()}
      backdate!([chat: chat], 30)

      assert Locks.acquire(chat, user2, turn_ref(), 31) == {:error, :conversation_busy}
      assert Locks.acquire(chat, user2, turn, 29) == :ok
      assert_lock(:chat, chat, {turn, 0})
    end

    test "answers :conversation_busy for a conversation uuid with no row, and creates no settings row" do
      user = new_user()

      assert Locks.acquire(TestDB.uuid(), user, turn_ref(), @ttl) ==
               {:error, :conversation_busy}

      assert_lock(:user, user, nil)
    end

    test "taking the locks again with the ref that holds them succeeds and re-dates both" do
      {chat, user, turn} = held_turn!(@ttl)
      backdate!([chat: chat, user: user], 30)
      assert_locks([chat: chat, user: user], chat: {turn, 30}, user: {turn, 30})

      assert Locks.acquire(chat, user, turn, @ttl) == :ok
      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {turn, 0})
    end

    test "holds no connection, transaction or advisory lock for a running turn" do
      # More running turns than pooled connections (10 by default): were a
      # turn's lock a session or an open transaction, the eleventh would wait
      # for a connection and fail. The library's connections are the ones
      # named after it (DATABASE_URL sets no application_name here).
      chats = insert_chats!(25)
      for chat <- chats, do: assert(Locks.acquire(chat, new_user(), turn_ref(), @ttl) == :ok)

      assert TestDB.query!("""
             SELECT count(DISTINCT a.pid) > 0,
                    count(*) FILTER (WHERE a.state LIKE 'idle in transaction%'),
                    count(l.pid)
             FROM pg_stat_activity a
             LEFT JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory'
             WHERE a.application_name = 'phoenix_kit_agent_locks'
             """) == [["t", "0", "0"]]
    end
  end
end
