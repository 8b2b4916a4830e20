defmodule PhoenixKitAgent.Turns.Locks.ArgumentsTest do
  # Every argument of every function is checked before anything reaches the
  # database: a bad one raises ArgumentError naming it, and no row changes.
  use PhoenixKitAgent.Turns.LockCase, async: true

  # Calls Locks.fun(args) and asserts it raised ArgumentError naming `name`.
  defp assert_refused(fun, args, name, what) do
    answer = apply(Locks, fun, args)
    flunk("#{fun} with #{name} #{what} answered #{inspect(answer)} instead of raising")
  rescue
    error in ArgumentError ->
      assert error.message =~ ~r/\Ainvalid #{name}: /,
             "#{fun} with #{name} #{what}: #{inspect(error.message)} does not name #{name}"
  end

  for {fun, arguments} <- arguments() do
    describe "#{fun}/#{length(arguments)}" do
      for {{name, kind}, position} <- Enum.with_index(arguments) do
        test "raises ArgumentError naming #{name} for any value but #{valid(kind)}, and changes no row" do
          {args, ids} = call_that_would_write(unquote(fun))
          before = rows(ids)

          for {what, bad} <- invalid(unquote(kind)) do
            args = List.replace_at(args, unquote(position), bad)
            assert_refused(unquote(fun), args, unquote(name), what)
          end

          assert rows(ids) == before
        end
      end
    end
  end

  # The setups above are not vacuous: with valid arguments, every writing
  # call changes the rows it was refused (fresh? and held? only read).
  describe "the calls refused above, with valid arguments" do
    test "change the rows they were set up to change" do
      for fun <- [
            :acquire,
            :acquire_user,
            :keep,
            :keep_user,
            :release,
            :release_stale,
            :release_user
          ] do
        {args, ids} = call_that_would_write(fun)
        before = rows(ids)

        assert apply(Locks, fun, args) in [:ok, true], "#{fun} did not succeed"
        assert rows(ids) != before, "#{fun} changed no row"
      end
    end
  end

  describe "the limits of each argument" do
    test "a turn_ref of 255 bytes is a turn's ref, also in multi-byte characters" do
      for turn <- [String.duplicate("t", 255), String.duplicate("é", 127) <> "t"] do
        chat = insert_chat!()
        user = new_user()

        assert Locks.acquire(chat, user, turn, 60) == :ok
        assert_lock(:chat, chat, {turn, 0})
        assert Locks.held?(chat, user, turn) == true
        assert Locks.release(chat, user, turn) == :ok
      end
    end

    test "a turn_ref that merely contains \"click:\" after its start is a turn's ref" do
      chat = insert_chat!()
      turn = "turn-click:" <> turn_ref()

      assert Locks.acquire(chat, new_user(), turn, 60) == :ok
      assert_lock(:chat, chat, {turn, 0})
    end

    test "a click ref of 255 bytes is accepted" do
      user = new_user()
      click = "click:" <> String.duplicate("0", 249)

      assert Locks.acquire_user(user, click, 60, 60) == :ok
      assert_lock(:user, user, {click, 0})
      assert Locks.release_user(user, click) == :ok
    end

    test "ttl_s of 1 second and of ten years (315_360_000) are accepted and hold to the second" do
      [chat1, chat2] = insert_chats!(2)
      [turn1, turn2] = [turn_ref(), turn_ref()]

      assert Locks.acquire(chat1, new_user(), turn_ref(), 1) == :ok
      backdate!([chat: chat1], 1)
      assert Locks.acquire(chat1, new_user(), turn1, 1) == :ok

      assert Locks.acquire(chat2, new_user(), turn2, 315_360_000) == :ok
      backdate!([chat: chat2], 315_360_000 - 1)
      assert Locks.fresh?(chat2, turn2, 315_360_000) == true

      assert Locks.acquire(chat2, new_user(), turn_ref(), 315_360_000) ==
               {:error, :conversation_busy}

      backdate!([chat: chat2], 1)
      assert Locks.fresh?(chat2, turn2, 315_360_000) == false
      assert Locks.release_stale(chat2, new_user(), turn2, 315_360_000) == true
    end

    test "hold_s of 1 second and of ttl_s are accepted, the longest dating the lock ten years back" do
      user = new_user()
      click = Locks.click_ref()

      assert Locks.acquire_user(user, click, 60, 60) == :ok
      assert Locks.keep_user(user, click, 60, 1) == true
      assert_lock(:user, user, {click, 59})

      assert Locks.keep_user(user, click, 315_360_000, 1) == true
      assert_lock(:user, user, {click, 315_359_999})
    end
  end
end
