defmodule PhoenixKitAgent.Turns.Locks.ClickRefTest do
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60

  doctest PhoenixKitAgent.Turns.Locks, only: [click_ref: 0]

  describe "click_ref/0" do
    test "starts with \"click:\" followed by 32 lower-case hex digits" do
      assert Locks.click_ref() =~ ~r/\Aclick:[0-9a-f]{32}\z/
    end

    test "is a new ref on every call" do
      refs = for _ <- 1..1_000, do: Locks.click_ref()
      assert refs |> Enum.uniq() |> length() == 1_000
    end

    test "is accepted as a click's ref and refused as a turn's" do
      user = new_user()
      click = Locks.click_ref()

      assert Locks.acquire_user(user, click, @ttl, @ttl) == :ok

      assert_raise ArgumentError, ~r/\Ainvalid turn_ref: /, fn ->
        Locks.acquire(insert_chat!(), new_user(), click, @ttl)
      end
    end

    test "a lock taken with it is reported as :click_in_flight to a turn and to another click" do
      {user, _click} = held_click!(@ttl, @ttl)
      chat = insert_chat!()

      assert Locks.acquire(chat, user, turn_ref(), @ttl) == {:error, :click_in_flight}
      assert Locks.acquire_user(user, Locks.click_ref(), @ttl, @ttl) == {:error, :click_in_flight}
    end

    test "a turn's ref is reported as :turn_in_flight, even one that merely looks like a click's" do
      [chat1, chat2] = insert_chats!(2)
      user = new_user()

      :ok =
        Locks.acquire(chat1, user, "CLICK:" <> Base.encode16(:crypto.strong_rand_bytes(16)), @ttl)

      assert Locks.acquire(chat2, user, turn_ref(), @ttl) == {:error, :turn_in_flight}
      assert Locks.acquire_user(user, Locks.click_ref(), @ttl, @ttl) == {:error, :turn_in_flight}
    end
  end
end
