defmodule PhoenixKitAgent.Turns.Locks.HeldFreshTest do
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60

  describe "held?/3" do
    test "is true while the turn holds both locks" do
      {chat, user, turn} = held_turn!(@ttl)

      assert Locks.held?(chat, user, turn) == true
      assert Locks.held?(String.upcase(chat), String.upcase(user), turn) == true
    end

    test "is false for another ref" do
      chat = insert_chat!()
      user = new_user()
      :ok = Locks.acquire(chat, user, turn_ref(), @ttl)

      assert Locks.held?(chat, user, turn_ref()) == false
    end

    test "is false after the turn released its locks" do
      {chat, user, turn} = held_turn!(@ttl)
      :ok = Locks.release(chat, user, turn)

      assert Locks.held?(chat, user, turn) == false
    end

    test "is false once the user's lock was taken over, though the chat's is still the turn's" do
      {chat, other_chat, user, lost, turn} = user_taken_over!(@ttl)
      assert_lock(:chat, chat, {lost, 0})

      assert Locks.held?(chat, user, lost) == false
      assert Locks.held?(other_chat, user, turn) == true
    end

    test "is false once the chat's lock was taken over, though the user's is still the turn's" do
      {chat, user, other_user, lost, turn} = chat_taken_over!(@ttl)
      assert_lock(:user, user, {lost, 0})

      assert Locks.held?(chat, user, lost) == false
      assert Locks.held?(chat, other_user, turn) == true
    end

    test "is false for a pair of locks the turn holds in two different turns' rows" do
      [chat1, chat2] = insert_chats!(2)
      [user1, user2] = [new_user(), new_user()]
      turn = turn_ref()
      :ok = Locks.acquire(chat1, user1, turn, @ttl)

      assert Locks.held?(chat1, user2, turn) == false
      assert Locks.held?(chat2, user1, turn) == false
    end

    test "stays true for locks older than the TTL until another turn takes one over" do
      {chat, user, turn} = held_turn!(@ttl)
      backdate!([chat: chat, user: user], @ttl * 10)

      assert Locks.held?(chat, user, turn) == true
    end

    test "is false when neither row exists" do
      assert Locks.held?(TestDB.uuid(), new_user(), turn_ref()) == false
    end
  end

  describe "fresh?/3" do
    test "is true right after the turn took its locks" do
      chat = insert_chat!()
      turn = turn_ref()
      :ok = Locks.acquire(chat, new_user(), turn, @ttl)

      assert Locks.fresh?(chat, turn, @ttl) == true
      assert Locks.fresh?(String.upcase(chat), turn, @ttl) == true
    end

    test "measures age against the caller's ttl_s" do
      chat = insert_chat!()
      turn = turn_ref()
      :ok = Locks.acquire(chat, new_user(), turn, @ttl)
      backdate!([chat: chat], 30)

      assert Locks.fresh?(chat, turn, 31) == true
      assert Locks.fresh?(chat, turn, 29) == false
    end

    test "is false when the chat's lock is another turn's" do
      chat = insert_chat!()
      :ok = Locks.acquire(chat, new_user(), turn_ref(), @ttl)

      assert Locks.fresh?(chat, turn_ref(), @ttl) == false
    end

    test "looks only at the chat's lock: true though the user's was taken over" do
      [chat, other_chat] = insert_chats!(2)
      user = new_user()
      lost = turn_ref("lost")
      :ok = Locks.acquire(chat, user, lost, @ttl)
      backdate!([user: user], @ttl + 1)
      :ok = Locks.acquire(other_chat, user, turn_ref(), @ttl)

      assert Locks.fresh?(chat, lost, @ttl) == true
    end

    test "is false after the turn released its locks" do
      {chat, user, turn} = held_turn!(@ttl)
      :ok = Locks.release(chat, user, turn)

      assert Locks.fresh?(chat, turn, @ttl) == false
    end

    test "is false for a conversation uuid with no row" do
      assert Locks.fresh?(TestDB.uuid(), turn_ref(), @ttl) == false
    end

    test "is true one second short of ttl_s and false as soon as the chat's lock is older: " <>
           "the opposite of a take-over" do
      chat = insert_chat!()
      lost = turn_ref("lost")
      :ok = Locks.acquire(chat, new_user(), lost, @ttl)

      backdate!([chat: chat], @ttl - 1)

      assert {Locks.fresh?(chat, lost, @ttl), Locks.acquire(chat, new_user(), turn_ref(), @ttl)} ==
               {true, {:error, :conversation_busy}}

      backdate!([chat: chat], 1)

      assert {Locks.fresh?(chat, lost, @ttl), Locks.acquire(chat, new_user(), turn_ref(), @ttl)} ==
               {false, :ok}
    end
  end
end
