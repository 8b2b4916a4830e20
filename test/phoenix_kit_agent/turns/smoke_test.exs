defmodule PhoenixKitAgent.Turns.SmokeTest do
  use ExUnit.Case, async: true
  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.TestDB

  test "a turn takes and releases both locks" do
    chat = TestDB.insert_chat!()
    user = TestDB.uuid()
    assert Locks.acquire(chat, user, "turn-a", 60) == :ok
    assert TestDB.lock(:chat, chat) == {"turn-a", 0}
    assert Locks.release(chat, user, "turn-a") == :ok
    assert TestDB.lock(:user, user) == {nil, nil}
  end
end
