defmodule PhoenixKitAgent.Turns.Locks.ConcurrencyTest do
  # Racing callers, each on its own pooled connection: the guarantees of one
  # atomic statement per call must hold when the statements really overlap.
  use PhoenixKitAgent.Turns.LockCase, async: true

  @ttl 60
  # Racers wait holding a pooled connection each: stay well under the 10.
  @racers 6

  # Runs `fun.(i)` for i in 1..n, all at once (with no gate: see
  # race_at_row/3); the answers in order of i.
  defp race(n, fun) do
    1..n
    |> Task.async_stream(fun, max_concurrency: n, ordered: true, timeout: 30_000)
    |> Enum.map(fn {:ok, answer} -> answer end)
  end

  defp count(answers, answer), do: Enum.count(answers, &(&1 == answer))

  describe "racing acquire/4" do
    test "of turns in one chat: exactly one takes it, the others' users are never locked" do
      chat = insert_chat!()
      users = for _ <- 1..@racers, do: new_user()
      turns = for _ <- 1..@racers, do: turn_ref()

      answers =
        race_at_row({:chat, chat}, @racers, fn i ->
          Locks.acquire(chat, Enum.at(users, i - 1), Enum.at(turns, i - 1), @ttl)
        end)

      assert Enum.sort(answers) == [
               :ok | List.duplicate({:error, :conversation_busy}, @racers - 1)
             ]

      winner = Enum.find_index(answers, &(&1 == :ok))
      assert_lock(:chat, chat, {Enum.at(turns, winner), 0})

      assert_locks(
        Enum.map(users, &{:user, &1}),
        for(i <- 0..(@racers - 1), do: {:user, if(i == winner, do: {Enum.at(turns, i), 0})})
      )
    end

    test "of turns of one user in different chats: exactly one runs, every other chat stays free" do
      chats = insert_chats!(@racers)
      user = new_user()
      insert_settings!(user, "2001-02-03T04:05:06Z")
      turns = for _ <- 1..@racers, do: turn_ref()

      answers =
        race_at_row({:user, user}, @racers, fn i ->
          Locks.acquire(Enum.at(chats, i - 1), user, Enum.at(turns, i - 1), @ttl)
        end)

      assert Enum.sort(answers) == [:ok | List.duplicate({:error, :turn_in_flight}, @racers - 1)]
      winner = Enum.find_index(answers, &(&1 == :ok))
      assert_lock(:user, user, {Enum.at(turns, winner), 0})

      assert_locks(
        Enum.map(chats, &{:chat, &1}),
        for(
          i <- 0..(@racers - 1),
          do: {:chat, if(i == winner, do: {Enum.at(turns, i), 0}, else: {nil, nil})}
        )
      )
    end

    test "of turns and clicks of one user: exactly one gets the user's lock, the others learn what holds it" do
      chats = insert_chats!(@racers)
      user = new_user()
      insert_settings!(user, "2001-02-03T04:05:06Z")

      answers =
        race_at_row({:user, user}, @racers, fn i ->
          if rem(i, 2) == 0,
            do: Locks.acquire(Enum.at(chats, i - 1), user, turn_ref(), @ttl),
            else: Locks.acquire_user(user, Locks.click_ref(), @ttl, @ttl)
        end)

      winner = Enum.find_index(answers, &(&1 == :ok))
      assert winner != nil and count(answers, :ok) == 1

      {holder, _age} = lock(:user, user)

      reason =
        if String.starts_with?(holder, "click:"), do: :click_in_flight, else: :turn_in_flight

      assert rem(winner + 1, 2) == if(reason == :click_in_flight, do: 1, else: 0)
      assert count(answers, {:error, reason}) == @racers - 1
    end
  end

  describe "racing release_stale/4" do
    test "exactly one caller releases a lost turn's locks" do
      chat = insert_chat!()
      user = new_user()
      lost = turn_ref("lost")
      :ok = Locks.acquire(chat, user, lost, @ttl)
      backdate!([chat: chat, user: user], @ttl + 1)

      answers =
        race_at_row({:chat, chat}, @racers, fn _ ->
          Locks.release_stale(chat, user, lost, @ttl)
        end)

      assert Enum.sort(answers) == List.duplicate(false, @racers - 1) ++ [true]
      assert_locks([chat: chat, user: user], chat: {nil, nil}, user: {nil, nil})
    end

    test "racing a new turn's take-over: the new turn's locks are never freed" do
      chat = insert_chat!()
      user = new_user()
      lost = turn_ref("lost")
      turn = turn_ref()
      :ok = Locks.acquire(chat, user, lost, @ttl)
      backdate!([chat: chat, user: user], @ttl + 1)

      answers =
        race_at_row({:chat, chat}, @racers, fn
          1 -> Locks.acquire(chat, user, turn, @ttl)
          _ -> Locks.release_stale(chat, user, lost, @ttl)
        end)

      assert hd(answers) == :ok
      assert count(tl(answers), true) <= 1
      assert_locks([chat: chat, user: user], chat: {turn, 0}, user: {turn, 0})
    end
  end

  describe "many turns and clicks at once" do
    test "never deadlock, hold both locks whenever acquire/4 answers :ok, and leave every lock free" do
      chats = insert_chats!(3)
      users = for _ <- 1..3, do: new_user()

      # Crossing pairs of chat and user, so statements lock rows in every
      # combination: a deadlock would raise Locks.Error (SQLSTATE 40P01).
      answers =
        race(@racers, fn i ->
          for round <- 1..20 do
            chat = Enum.at(chats, rem(i + round, 3))
            user = Enum.at(users, rem(i * round, 3))

            if rem(i + round, 4) == 0 do
              click = Locks.click_ref()

              case Locks.acquire_user(user, click, @ttl, @ttl) do
                :ok -> {Locks.keep_user(user, click, @ttl, @ttl), Locks.release_user(user, click)}
                {:error, reason} -> reason
              end
            else
              turn = turn_ref()

              case Locks.acquire(chat, user, turn, @ttl) do
                :ok -> {Locks.held?(chat, user, turn), Locks.release(chat, user, turn)}
                {:error, reason} -> reason
              end
            end
          end
        end)
        |> List.flatten()

      assert Enum.all?(
               answers,
               &(&1 in [{true, :ok}, :conversation_busy, :turn_in_flight, :click_in_flight])
             )

      assert Enum.count(answers, &(&1 == {true, :ok})) > 0

      assert locks(Enum.map(chats, &{:chat, &1}) ++ Enum.map(users, &{:user, &1}))
             |> Keyword.values()
             |> Enum.uniq()
             |> Enum.reject(&is_nil/1) == [{nil, nil}]
    end
  end
end
