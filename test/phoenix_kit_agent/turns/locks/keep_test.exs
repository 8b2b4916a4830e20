defmodule PhoenixKitAgent.Turns.Locks.KeepTest do
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 15

  describe "keep/5" do
    test "re-dates both locks to the database's now and answers true, whatever the letter case of the uuids" do
      {chat, user, turn} = held_turn!(@ttl, age: @ttl - 5)

      assert Locks.keep(String.upcase(chat), String.upcase(user), turn, @ttl, @ttl) == true
      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {turn, 0})
    end

    test "does not revive an expired lease: false, and neither lock is re-dated" do
      {chat, user, turn} = held_turn!(@ttl, age: @ttl + 1)
      before = rows(chat: chat, user: user)

      assert Locks.keep(chat, user, turn, @ttl, @ttl) == false
      assert rows(chat: chat, user: user) == before
    end

    test "keeps neither lock when one of them expired" do
      {chat, user, turn} = held_turn!(@ttl)
      backdate!([user: user], @ttl + 1)
      before = rows(chat: chat, user: user)

      assert Locks.keep(chat, user, turn, @ttl, @ttl) == false
      assert rows(chat: chat, user: user) == before
    end

    test "answers false to a turn that lost its chat to another, and changes nothing" do
      {chat, user, _other_user, lost, _turn} = chat_taken_over!(@ttl)
      before = rows(chat: chat, user: user)

      assert Locks.keep(chat, user, lost, @ttl, @ttl) == false
      assert rows(chat: chat, user: user) == before
    end

    test "answers false to a turn that lost its user's lock to a click, and changes nothing" do
      {chat, user, turn} = held_turn!(@ttl)
      backdate!([user: user], @ttl + 1)
      held_click!(@ttl, @ttl, user)
      before = rows(chat: chat, user: user)

      assert Locks.keep(chat, user, turn, @ttl, @ttl) == false
      assert rows(chat: chat, user: user) == before
    end

    test "answers false once released, and takes nothing" do
      {chat, user, turn} = held_turn!(@ttl)
      :ok = Locks.release(chat, user, turn)

      assert Locks.keep(chat, user, turn, @ttl, @ttl) == false
      assert_locks([chat: chat, user: user], chat: {nil, nil}, user: {nil, nil})
    end

    test "a lease that expires while keep/5 waits for its row is not revived; a take-over then wins" do
      {chat, user, turn} = held_turn!(@ttl)
      user_since = fn -> user_since(user) end
      kept_since = user_since.()
      # Another session makes the lease stale and holds the row until keep/5
      # waits for it: keep/5 re-checks its predicate on the row it then gets.
      gate = TestDB.session!()

      TestDB.query!(
        """
        BEGIN;
        UPDATE phoenix_kit_agent_conversations
        SET busy_since = busy_since - #{@ttl + 1} * interval '1 second' WHERE uuid = '#{chat}'
        """,
        gate
      )

      keeping = Task.async(fn -> Locks.keep(chat, user, turn, @ttl, @ttl) end)

      waiting = """
      SELECT count(*) FROM pg_stat_activity
      WHERE application_name = 'phoenix_kit_agent_locks' AND wait_event_type = 'Lock'
        AND query LIKE '%busy_since >= %' AND query LIKE '%FOR NO KEY UPDATE%'
      """

      assert Enum.any?(1..1_000, fn _ -> TestDB.query!(waiting) != [["0"]] end)
      TestDB.query!("COMMIT", gate)
      TestDB.close(gate)

      assert Task.await(keeping) == false
      # The user's lock is still the turn's, and was not re-dated.
      assert {TestDB.lock(:user, user) |> elem(0), user_since.()} == {turn, kept_since}
      successor = turn_ref("successor")
      assert Locks.acquire(chat, new_user(), successor, @ttl) == :ok
      assert_lock(:chat, chat, {successor, 0})
    end
  end

  describe "a lease shorter than the TTL (acquire/5, keep/5)" do
    # The takers' TTL is @ttl; the lease is 5 s: the locks are dated 10 s back.
    @lease 5

    defp leased_turn! do
      {chat, user, turn} = {insert_chat!(), new_user(), turn_ref()}
      assert Locks.acquire(chat, user, turn, @ttl, @lease) == :ok
      {chat, user, turn}
    end

    test "acquire/5 dates both locks ttl_s - lease_s back, keep/5 again after each renewal" do
      {chat, user, turn} = leased_turn!()

      assert_locks([chat: chat, user: user],
        chat: {turn, @ttl - @lease},
        user: {turn, @ttl - @lease}
      )

      backdate!([chat: chat, user: user], @lease - slack())
      assert Locks.keep(chat, user, turn, @ttl, @lease) == true

      assert_locks([chat: chat, user: user],
        chat: {turn, @ttl - @lease},
        user: {turn, @ttl - @lease}
      )
    end

    test "takers with the common TTL see the locks fresh until lease_s after the last keep, " <>
           "then free: acquire/4, fresh?/3, release_stale/4 (held_locks/1: turn_test.exs)" do
      {chat, user, turn} = leased_turn!()
      assert Locks.keep(chat, user, turn, @ttl, @lease) == true

      # Inside the lease.
      backdate!([chat: chat, user: user], @lease - slack())

      assert Locks.acquire(chat, new_user(), turn_ref("taker"), @ttl) ==
               {:error, :conversation_busy}

      assert Locks.fresh?(chat, turn, @ttl) == true
      assert Locks.release_stale(chat, user, turn, @ttl) == false

      # Past it: stale under the common TTL, and never renewed again.
      backdate!([chat: chat, user: user], slack() + 1)
      assert Locks.fresh?(chat, turn, @ttl) == false
      assert Locks.keep(chat, user, turn, @ttl, @lease) == false
      taker = turn_ref("taker")
      assert Locks.acquire(chat, user, taker, @ttl) == :ok
      assert_locks([chat: chat, user: user], chat: {taker, 0}, user: {taker, 0})
    end

    test "acquire/5 refuses a lease_s longer than ttl_s, naming it" do
      assert_raise ArgumentError, ~r/\Ainvalid lease_s: /, fn ->
        Locks.acquire(insert_chat!(), new_user(), turn_ref(), @ttl, @ttl + 1)
      end

      assert_raise ArgumentError, ~r/\Ainvalid lease_s: /, fn ->
        Locks.acquire(insert_chat!(), new_user(), turn_ref(), @ttl, 0)
      end
    end
  end

  defp user_since(user),
    do:
      TestDB.value!(
        "SELECT busy_since::text FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}'"
      )
end
