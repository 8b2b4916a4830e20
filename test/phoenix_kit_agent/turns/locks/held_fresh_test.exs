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
      {chat, user, _turn} = held_turn!(@ttl)

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
      {chat1, user1, turn} = held_turn!(@ttl)
      {chat2, user2} = {insert_chat!(), new_user()}

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
      {chat, _user, turn} = held_turn!(@ttl)

      assert Locks.fresh?(chat, turn, @ttl) == true
      assert Locks.fresh?(String.upcase(chat), turn, @ttl) == true
    end

    test "measures age against the caller's ttl_s" do
      {chat, _user, turn} = held_turn!(@ttl)
      backdate!([chat: chat], 30)

      assert Locks.fresh?(chat, turn, 31) == true
      assert Locks.fresh?(chat, turn, 29) == false
    end

    test "is false when the chat's lock is another turn's" do
      {chat, _user, _turn} = held_turn!(@ttl)

      assert Locks.fresh?(chat, turn_ref(), @ttl) == false
    end

    test "looks only at the chat's lock: true though the user's was taken over" do
      {chat, _other_chat, _user, lost, _turn} = user_taken_over!(@ttl)

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

    test "is true short of ttl_s and false as soon as the chat's lock is older: " <>
           "the opposite of a take-over" do
      {chat, _user, lost} = held_turn!(@ttl, label: "lost")
      backdate!([chat: chat], @ttl - slack())

      assert {Locks.fresh?(chat, lost, @ttl), Locks.acquire(chat, new_user(), turn_ref(), @ttl)} ==
               {true, {:error, :conversation_busy}}

      backdate!([chat: chat], slack())

      assert {Locks.fresh?(chat, lost, @ttl), Locks.acquire(chat, new_user(), turn_ref(), @ttl)} ==
               {false, :ok}
    end
  end
end
