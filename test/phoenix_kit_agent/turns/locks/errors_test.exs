defmodule PhoenixKitAgent.Turns.Locks.ErrorsTest do
  # The NIF refuses, on its own, every term it cannot use, for a caller that
  # skips the Elixir module: ArgumentError, never a panic, never a statement
  # sent. (The documented limits of the arguments, and their wording, are
  # the Elixir module's: see arguments_test.exs.)
  use PhoenixKitAgent.Turns.LockCase, async: true

  # Only the Elixir module refuses these: the NIF can run them.
  @limits_only ["256 bytes", "256 bytes in 128 characters", "above ten years"]

  defp assert_refused(fun, args, name, what) do
    answer = native(fun, args)
    flunk("Native.#{fun} with #{name} #{what} answered #{inspect(answer)} instead of raising")
  rescue
    ArgumentError -> :ok
  end

  for {fun, arguments} <- arguments() do
    describe "Native.#{fun}/#{length(arguments) + 2}" do
      for {{name, kind}, position} <- Enum.with_index(arguments) do
        test "raises ArgumentError for #{name} terms it cannot use, and changes no row" do
          {args, ids} = call_that_would_write(unquote(fun))
          before = rows(ids)

          for {what, bad} <- invalid(unquote(kind)), what not in @limits_only do
            args = List.replace_at(args, unquote(position), bad)
            assert_refused(unquote(fun), args, unquote(name), what)
          end

          assert rows(ids) == before
        end
      end
    end
  end

  describe "Native" do
    test "answers the documented terms for valid arguments" do
      [chat1, chat2] = insert_chats!(2)
      user = new_user()
      turn = turn_ref()
      click = Locks.click_ref()

      assert native(:acquire, [chat1, user, turn, 60]) == :ok
      assert native(:acquire, [chat1, new_user(), turn_ref(), 60]) == {:error, :conversation_busy}
      assert native(:acquire, [chat2, user, turn_ref(), 60]) == {:error, :turn_in_flight}
      assert native(:acquire_user, [user, click, 60, 10]) == {:error, :turn_in_flight}

      assert {native(:held?, [chat1, user, turn]), native(:fresh?, [chat1, turn, 60])} ==
               {true, true}

      assert native(:release_stale, [chat1, user, turn, 60]) == false
      assert native(:release, [chat1, user, turn]) == :ok
      assert native(:acquire_user, [user, click, 60, 10]) == :ok
      assert native(:keep_user, [user, click, 60, 10]) == true
      assert native(:release_user, [user, click]) == :ok
      assert_locks([chat: chat1, user: user], chat: {nil, nil}, user: {nil, nil})
    end

    test "a term that is not a turn's token or a stamp is refused before anything else" do
      chat = insert_chat!()
      user = new_user()
      [c, u] = Enum.map([chat, user], &uuid_bytes/1)
      start = System.monotonic_time(:nanosecond)

      assert_raise ArgumentError, fn -> Native.held?(:token, start, c, u, "t") end
      assert_raise ArgumentError, fn -> Native.held?(Locks.turn!(start), :now, c, u, "t") end
    end
  end
end
