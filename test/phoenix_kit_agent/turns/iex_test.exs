defmodule PhoenixKitAgent.Turns.IexTest do
  # What a newcomer sees in IEx: the docs (`h`), and a .iex.exs that only
  # binds the samples of scripts/iex and is harmless without them.
  use ExUnit.Case, async: true

  import ExUnit.CaptureIO

  require IEx.Helpers

  test "h PhoenixKitAgent.Turns.Locks.acquire shows its doc" do
    shown = capture_io(fn -> IEx.Helpers.h(PhoenixKitAgent.Turns.Locks.acquire()) end)
    assert shown =~ "def acquire(conversation_uuid, user_uuid, turn_ref, ttl_s)"
    assert shown =~ "Takes both locks for"
    assert shown =~ "{:error, :conversation_busy}"
  end

  test ".iex.exs without the samples of scripts/iex binds them to nil and prints nothing" do
    if System.get_env("LOCKS_IEX_CHATS") == nil and System.get_env("LOCKS_IEX_USERS") == nil do
      shown = capture_io(fn -> send(self(), Code.eval_file(".iex.exs")) end)
      assert_received {_result, binding}

      assert Keyword.take(binding, [:chat, :chat2, :user, :user2]) |> Enum.sort() ==
               [chat: nil, chat2: nil, user: nil, user2: nil]

      assert shown == ""
    end
  end
end
