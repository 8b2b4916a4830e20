defmodule PhoenixKitAgent.Turns.Locks.QueuedDeadlineTest do
  # A NIF call can wait for a free dirty-I/O scheduler before it runs (ten of
  # them, all held while the database is frozen). That wait counts against
  # the call's timeout: the Native module stamps each call with the OS clock,
  # and a call whose whole budget went by in the queue fails at once, sending
  # nothing. Stamps in the past stand for a long queue here.
  use PhoenixKitAgent.Turns.LockCase, async: true

  alias PhoenixKitAgent.Turns.Locks.Error

  # The test configuration's timeouts are the defaults: 5 s each, 15 s a call.
  @call_timeout_us 15_000_000

  defp queued_for(us), do: System.os_time(:microsecond) - us

  test "a call whose whole timeout passed in the queue raises :timeout and takes no lock" do
    chat = insert_chat!()
    user = new_user()
    turn = turn_ref()

    error =
      assert_raise Error, fn ->
        Native.acquire(chat, user, turn, 60, queued_for(@call_timeout_us + 1_000))
      end

    assert {error.reason, error.message} ==
             {:timeout, "timed out after 15000 ms waiting for the database"}

    assert locks(chat: chat, user: user) == [chat: {nil, nil}, user: nil]
  end

  test "every lock call counts its queueing against the timeout" do
    [chat, user, turn, click] = [insert_chat!(), new_user(), turn_ref(), Locks.click_ref()]
    late = queued_for(@call_timeout_us + 1_000)

    for call <- [
          fn -> Native.acquire_user(user, click, 60, 10, late) end,
          fn -> Native.fresh(chat, turn, 60, late) end,
          fn -> Native.held(chat, user, turn, late) end,
          fn -> Native.keep_user(user, click, 60, 10, late) end,
          fn -> Native.release(chat, user, turn, late) end,
          fn -> Native.release_stale(chat, user, turn, 60, late) end,
          fn -> Native.release_user(user, click, late) end
        ] do
      assert %Error{reason: :timeout} = catch_error(call.())
    end
  end

  test "a call that queued for part of its timeout still runs" do
    chat = insert_chat!()
    user = new_user()
    turn = turn_ref()

    assert Native.acquire(chat, user, turn, 60, queued_for(@call_timeout_us - 5_000_000)) == :ok
    assert locks(chat: chat) == [chat: {turn, 0}]
  end

  test "a stamp from the future (a clock that stepped back) counts as no wait" do
    chat = insert_chat!()
    user = new_user()
    turn = turn_ref()

    assert Native.acquire(chat, user, turn, 60, queued_for(-3_600_000_000)) == :ok
  end

  test "a stamp that is not an integer is refused before any SQL runs" do
    chat = insert_chat!()

    assert_raise ArgumentError,
                 "invalid queued_at: must be the caller's System.os_time(:microsecond)",
                 fn -> Native.acquire(chat, new_user(), turn_ref(), 60, :now) end
  end
end
