defmodule PhoenixKitAgent.Turns.Locks.RacesTest do
  # The one race suite: the guarantees of one atomic statement per call when
  # the statements really overlap: Robust.Race spawns the racers first, then
  # lets them go at once. (The takers skip a row another statement holds;
  # the holder's own writes wait for it, at most the row wait.)
  #
  # Every answer is asserted exactly; a raise of any kind (a serialization
  # failure, a deadlock, a pool error, a panic) is an answer like any other,
  # and fails the test, but for the row wait's documented `:row_locked` where
  # hundreds of writes queue on one row and a stalled one may outlast it.
  use PhoenixKitAgent.Turns.LockCase, async: true

  alias PhoenixKitAgent.Turns.Locks.Robust.Race

  @ttl 60

  defp race(calls) do
    answers = Race.run(calls)
    raised = for {:raised, _} = r <- answers, do: r
    assert raised == [], "#{length(raised)} calls raised, e.g. #{inspect(Enum.take(raised, 3))}"
    Enum.map(answers, fn {:ok, value} -> value end)
  end

  defp winners(values, winning), do: for({v, i} <- Enum.with_index(values), v == winning, do: i)

  describe "acquire/4" do
    test "turns of distinct users meeting on one chat: exactly one takes it, no loser's user is touched" do
      chat = insert_chat!()
      users = for _ <- 1..6, do: new_user()
      turns = for _ <- 1..6, do: turn_ref()

      answers =
        race(for {user, turn} <- Enum.zip(users, turns), do: {:acquire, [chat, user, turn, @ttl]})

      assert Enum.sort(answers) == [:ok | List.duplicate({:error, :conversation_busy}, 5)]
      [w] = winners(answers, :ok)
      assert locked(:chat, [chat]) == [[chat, Enum.at(turns, w)]]
      assert locked(:user, users) == [[Enum.at(users, w), Enum.at(turns, w)]]
    end

    for existing? <- [false, true] do
      @tag existing_user_row: existing?
      test "500 turns of one user on 500 chats: one runs, 499 :turn_in_flight, their chats stay free " <>
             "(the user's row #{if existing?, do: "exists", else: "is created by the race"})",
           %{existing_user_row: existing?} do
        user = new_user()
        chats = insert_chats!(500)
        if existing?, do: insert_settings!(user, "2001-02-03T04:05:06Z")

        calls =
          for {chat, i} <- Enum.with_index(chats), do: {:acquire, [chat, user, "r2-#{i}", @ttl]}

        values = race(calls)

        assert [w] = winners(values, :ok)
        assert Enum.frequencies(values) == %{:ok => 1, {:error, :turn_in_flight} => 499}
        assert locked(:chat, chats) == [[Enum.at(chats, w), "r2-#{w}"]]
        assert locked(:user, [user]) == [[user, "r2-#{w}"]]
        assert settings_rows(user) == 1
      end
    end

    test "250 turns and 250 clicks of one user: one wins, every loser names the winner's kind" do
      user = new_user()
      chats = insert_chats!(250)
      clicks = for _ <- 1..250, do: Locks.click_ref()

      calls =
        Enum.zip_with([chats, clicks, 0..249], fn [chat, click, i] ->
          [{:acquire, [chat, user, "r3-#{i}", @ttl]}, {:acquire_user, [user, click, @ttl, 30]}]
        end)
        |> List.flatten()

      values = race(calls)

      assert [w] = winners(values, :ok)
      {fun, args} = Enum.at(calls, w)
      holder = if fun == :acquire, do: Enum.at(args, 2), else: Enum.at(args, 1)
      loser_reason = if fun == :acquire, do: :turn_in_flight, else: :click_in_flight
      assert Enum.frequencies(values) == %{:ok => 1, {:error, loser_reason} => 499}
      assert locked(:user, [user]) == [[user, holder]]
      assert locked(:chat, chats) == if(fun == :acquire, do: [[hd(args), holder]], else: [])
    end
  end

  describe "release_stale/4" do
    test "by two callers of the same stale turn, 200 times: exactly one true each time" do
      chat = insert_chat!()
      user = new_user()

      for round <- 1..200 do
        turn = "stale-#{round}"
        assert Locks.acquire(chat, user, turn, @ttl) == :ok
        backdate!([chat: chat, user: user], 120)

        values = race(List.duplicate({:release_stale, [chat, user, turn, @ttl]}, 2))

        assert Enum.sort(values) == [false, true], "round #{round}: #{inspect(values)}"
        assert locked(:chat, [chat]) ++ locked(:user, [user]) == [], "round #{round}"
      end
    end

    test "racing a take-over of the same stale turn, 100 times: the new turn wins or is told " <>
           "busy by a cleanup under way, its locks are never freed, at most one cleanup answers true" do
      chat = insert_chat!()

      for round <- 1..100 do
        {old_user, new_user} = {new_user(), new_user()}
        {old, new} = {"old-#{round}", "new-#{round}"}
        assert Locks.acquire(chat, old_user, old, @ttl) == :ok
        backdate!([chat: chat, user: old_user], 120)

        values =
          race([
            {:release_stale, [chat, old_user, old, @ttl]},
            {:acquire, [chat, new_user, new, @ttl]},
            {:release_stale, [chat, old_user, old, @ttl]}
          ])

        assert [stale1, taken, stale2] = values, "round #{round}: #{inspect(values)}"
        assert Enum.count([stale1, stale2], & &1) <= 1, "round #{round}: #{inspect(values)}"
        # The old turn's user lock went with the cleanup, or stays its own (stale).
        assert locked(:user, [old_user]) in [[], [[old_user, old]]]

        case taken do
          :ok ->
            assert locked(:chat, [chat]) == [[chat, new]]
            assert locked(:user, [new_user]) == [[new_user, new]]
            assert Locks.release(chat, new_user, new) == :ok

          # A cleanup held the chat's row as the take-over came: busy right
          # now (no wait for another session's row), and that cleanup freed it.
          {:error, :conversation_busy} ->
            assert [stale1, stale2] |> Enum.count(& &1) == 1, "round #{round}"
            assert locked(:chat, [chat]) ++ locked(:user, [new_user]) == []
        end
      end
    end
  end

  describe "keep/5" do
    test "keeps of the holder at once, each waiting for the others' row locks: every one renews the lease" do
      {chat, user, turn} = held_turn!(@ttl, age: 5)

      assert race(List.duplicate({:keep, [chat, user, turn, @ttl, @ttl]}, 3)) ==
               [true, true, true]

      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {turn, 0})
    end
  end

  describe "every call at once" do
    test "2,000 mixed calls crossing 2 chats and 2 users: no deadlock, no serialization failure, " <>
           "every answer a documented one, nothing locked but by a racer" do
      chats = insert_chats!(2)
      users = for _ <- 1..2, do: new_user()
      :rand.seed(:exsss, {7, 7, 7})

      calls =
        for i <- 1..2_000 do
          {chat, user, turn} = {Enum.random(chats), Enum.random(users), "x-#{rem(i, 8)}"}

          case rem(i, 6) do
            0 -> {:acquire, [chat, user, turn, 1]}
            1 -> {:release, [chat, user, turn]}
            2 -> {:release_stale, [chat, user, turn, 1]}
            3 -> {:held?, [chat, user, turn]}
            4 -> {:keep, [chat, user, turn, 1, 1]}
            5 -> {:acquire, [chat, user, turn, @ttl]}
          end
        end

      for {{fun, _}, answer} <- Enum.zip(calls, Race.run(calls)) do
        case {fun, answer} do
          {:acquire, {:ok, value}} ->
            assert value in [:ok, {:error, :conversation_busy}, {:error, :turn_in_flight}]

          {:release, {:ok, value}} ->
            assert value == :ok

          {writer, {:raised, %Locks.Error{reason: :row_locked}}} ->
            assert writer in [:release, :keep]

          {_boolean, {:ok, value}} ->
            assert is_boolean(value)
        end
      end

      for [_id, ref] <- locked(:chat, chats) ++ locked(:user, users),
          do: assert(ref =~ ~r/^x-[0-7]$/)
    end
  end
end
