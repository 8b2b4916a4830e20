defmodule PhoenixKitAgent.Turns.Locks.ClockTest do
  # Every time is the database's now(): the lock statements send no time of
  # their own, so the TTL does not depend on the clocks of the app nodes.
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60

  # `busy_since` of the chat and user rows and the database's now(), as epoch
  # microseconds, read in one statement.
  defp busy_since(chat, user) do
    [[c, u, now]] =
      TestDB.query!("""
      SELECT (extract(epoch FROM c.busy_since) * 1000000)::bigint,
             (extract(epoch FROM u.busy_since) * 1000000)::bigint,
             (extract(epoch FROM now()) * 1000000)::bigint
      FROM phoenix_kit_agent_conversations c, phoenix_kit_agent_user_settings u
      WHERE c.uuid = '#{chat}' AND u.user_uuid = '#{user}'
      """)

    Enum.map([c, u, now], &String.to_integer/1)
  end

  defp db_now_us do
    [[now]] = TestDB.query!("SELECT (extract(epoch FROM now()) * 1000000)::bigint")
    String.to_integer(now)
  end

  describe "the time of a lock" do
    test "acquire/4 dates both locks with the now() of its one statement" do
      chat = insert_chat!()
      user = new_user()
      turn = turn_ref()
      before = db_now_us()

      :ok = Locks.acquire(chat, user, turn, @ttl)
      [chat_since, user_since, now] = busy_since(chat, user)

      # One statement, one now(): both rows carry the same microsecond,
      # which lies between the database's clock before and after the call.
      assert chat_since == user_since
      assert before < chat_since and chat_since < now

      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {turn, 0})
    end

    test "acquire_user/4 dates the lock exactly ttl_s - hold_s before the database's now()" do
      user = new_user()
      before = db_now_us()

      :ok = Locks.acquire_user(user, Locks.click_ref(), @ttl, 15)

      [[since, now]] =
        TestDB.query!("""
        SELECT (extract(epoch FROM busy_since) * 1000000)::bigint,
               (extract(epoch FROM now()) * 1000000)::bigint
        FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}'
        """)

      taken_at = String.to_integer(since) + (@ttl - 15) * 1_000_000
      assert before < taken_at and taken_at < String.to_integer(now)
    end

    test "a lock made stale in the database is stale to every call, whatever the node's clock says" do
      {chat, user, turn} = held_turn!(@ttl)
      # Only the database's clock knows this lock is old: the node's clock
      # saw it taken a moment ago.
      backdate!([chat: chat, user: user], @ttl + 1)

      assert Locks.fresh?(chat, turn, @ttl) == false
      assert Locks.release_stale(chat, user, turn, @ttl) == true
    end
  end
end
