defmodule PhoenixKitAgent.Turns.Locks.ErrorsTest do
  # The NIF checks its arguments on its own, for a caller that skips the
  # Elixir module: bad terms raise ArgumentError naming the argument (never a
  # panic, never a statement sent), with the same names as the Elixir checks.
  use PhoenixKitAgent.Turns.LockCase, async: true

  @native %{fresh?: :fresh, held?: :held}

  defp assert_refused(fun, args, name, what) do
    answer = apply(Native, fun, args)
    flunk("Native.#{fun} with #{name} #{what} answered #{inspect(answer)} instead of raising")
  rescue
    error in ArgumentError ->
      assert error.message =~ ~r/\Ainvalid #{name}: /,
             "Native.#{fun} with #{name} #{what}: #{inspect(error.message)} does not name #{name}"
  end

  for {fun, arguments} <- arguments(), native = Map.get(@native, fun, fun) do
    describe "Native.#{native}/#{length(arguments)}" do
      for {{name, kind}, position} <- Enum.with_index(arguments) do
        test "raises ArgumentError naming #{name} for any term but #{valid(kind)}, and changes no row" do
          {args, ids} = call_that_would_write(unquote(fun))
          before = rows(ids)

          for {what, bad} <- invalid(unquote(kind)) do
            args = List.replace_at(args, unquote(position), bad)
            assert_refused(unquote(native), args, unquote(name), what)
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

      assert Native.acquire(chat1, user, turn, 60) == :ok
      assert Native.acquire(chat1, new_user(), turn_ref(), 60) == {:error, :conversation_busy}
      assert Native.acquire(chat2, user, turn_ref(), 60) == {:error, :turn_in_flight}
      assert Native.acquire_user(user, click, 60, 10) == {:error, :turn_in_flight}
      assert {Native.held(chat1, user, turn), Native.fresh(chat1, turn, 60)} == {true, true}
      assert Native.release_stale(chat1, user, turn, 60) == false
      assert Native.release(chat1, user, turn) == :ok
      assert Native.acquire_user(user, click, 60, 10) == :ok
      assert Native.keep_user(user, click, 60, 10) == true
      assert Native.release_user(user, click) == :ok
      assert locks(chat: chat1, user: user) == [chat: {nil, nil}, user: {nil, nil}]
    end

    test "checks the arguments in order: the first bad one is named" do
      assert_raise ArgumentError, ~r/\Ainvalid conversation_uuid: /, fn ->
        Native.acquire(nil, nil, nil, nil)
      end

      assert_raise ArgumentError, ~r/\Ainvalid ttl_s: /, fn ->
        Native.acquire_user(new_user(), Locks.click_ref(), 0, 0)
      end
    end
  end
end
