defmodule PhoenixKitAgent.Turns.Robustness.RacesTest do
  # Races inside one node: hundreds of processes on the same rows at the same
  # instant (Robust.Race spawns them all first, then lets them go together).
  # Every answer is asserted exactly; a raise of any kind (a serialization
  # failure, a deadlock, a pool error, a panic) is an answer like any other
  # and fails the test through `assert_no_raise/1`.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.TestDB
  alias PhoenixKitAgent.Turns.Locks.Robust.{Psql, Race}

  @moduletag :robustness

  setup do
    psql = Psql.open!(TestDB.url())
    on_exit(fn -> Psql.close(psql) end)
    %{psql: psql}
  end

  defp assert_no_raise(answers) do
    raised = for {:raised, _} = r <- answers, do: r
    assert raised == [], "#{length(raised)} calls raised, e.g. #{inspect(Enum.take(raised, 3))}"
    Enum.map(answers, fn {:ok, value} -> value end)
  end

  defp winners(values, winning), do: for({v, i} <- Enum.with_index(values), v == winning, do: i)

  defp uuid_array(ids), do: "'{" <> Enum.join(ids, ",") <> "}'::uuid[]"

  # Rows of `ids` (chats or users) that carry any lock column: {id, ref, since?}.
  defp locked_rows(psql, :chat, ids),
    do: locked_rows(psql, "phoenix_kit_agent_conversations", "uuid", ids)

  defp locked_rows(psql, :user, ids),
    do: locked_rows(psql, "phoenix_kit_agent_user_settings", "user_uuid", ids)

  defp locked_rows(psql, table, key, ids) do
    Psql.query!(psql, """
    SELECT #{key}::text, busy_turn_ref, (busy_since IS NOT NULL)::text FROM #{table}
    WHERE #{key} = ANY(#{uuid_array(ids)})
      AND (busy_turn_ref IS NOT NULL OR busy_since IS NOT NULL)
    ORDER BY 1
    """)
  end

  describe "500 turns of distinct users on one chat" do
    test "exactly one gets :ok, the 499 others {:error, :conversation_busy}", %{psql: psql} do
      chat = TestDB.insert_chat!()
      users = for _ <- 1..500, do: TestDB.uuid()
      calls = for {user, i} <- Enum.with_index(users), do: {:acquire, [chat, user, "r1-#{i}", 60]}

      values = calls |> Race.run() |> assert_no_raise()

      assert [w] = winners(values, :ok)
      assert Enum.frequencies(values) == %{:ok => 1, {:error, :conversation_busy} => 499}
      assert locked_rows(psql, :chat, [chat]) == [[chat, "r1-#{w}", "true"]]
      # The refused turns never touched their user's row.
      assert locked_rows(psql, :user, users) == [[Enum.at(users, w), "r1-#{w}", "true"]]
      assert Locks.held?(chat, Enum.at(users, w), "r1-#{w}")
    end
  end

  describe "500 turns of one user on 500 chats" do
    for existing? <- [false, true] do
      @tag existing_user_row: existing?
      test "exactly one gets :ok, 499 {:error, :turn_in_flight}, their chats stay free " <>
             "(user row #{if existing?, do: "exists", else: "is created by the race"})",
           %{psql: psql, existing_user_row: existing?} do
        user = TestDB.uuid()
        chats = TestDB.insert_chats!(500)

        if existing? do
          Psql.query!(
            psql,
            "INSERT INTO phoenix_kit_agent_user_settings (user_uuid) VALUES ('#{user}')"
          )
        end

        calls =
          for {chat, i} <- Enum.with_index(chats), do: {:acquire, [chat, user, "r2-#{i}", 60]}

        values = calls |> Race.run() |> assert_no_raise()

        assert [w] = winners(values, :ok)
        assert Enum.frequencies(values) == %{:ok => 1, {:error, :turn_in_flight} => 499}
        # Every losing chat is exactly as it was: no ref, no busy_since.
        assert locked_rows(psql, :chat, chats) == [[Enum.at(chats, w), "r2-#{w}", "true"]]
        assert locked_rows(psql, :user, [user]) == [[user, "r2-#{w}", "true"]]

        assert Psql.value!(
                 psql,
                 "SELECT count(*) FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}'"
               ) == "1"
      end
    end

    test "250 turns and 250 clicks: one wins, every loser names the winner's kind", %{psql: psql} do
      user = TestDB.uuid()
      chats = TestDB.insert_chats!(250)
      clicks = for _ <- 1..250, do: Locks.click_ref()

      calls =
        Enum.zip_with([chats, clicks, 0..249], fn [chat, click, i] ->
          [{:acquire, [chat, user, "r3-#{i}", 60]}, {:acquire_user, [user, click, 60, 30]}]
        end)
        |> List.flatten()

      values = calls |> Race.run() |> assert_no_raise()

      assert [w] = winners(values, :ok)
      {fun, args} = Enum.at(calls, w)
      holder = if fun == :acquire, do: Enum.at(args, 2), else: Enum.at(args, 1)
      loser_reason = if fun == :acquire, do: :turn_in_flight, else: :click_in_flight
      assert Enum.frequencies(values) == %{:ok => 1, {:error, loser_reason} => 499}
      assert [[^user, ^holder, "true"]] = locked_rows(psql, :user, [user])
      expected_chats = if fun == :acquire, do: [[hd(args), holder, "true"]], else: []
      assert locked_rows(psql, :chat, chats) == expected_chats
    end
  end

  describe "release_stale/4 by two processes" do
    test "of the same stale turn, 200 times: exactly one true each time", %{psql: psql} do
      chat = TestDB.insert_chat!()
      user = TestDB.uuid()

      for round <- 1..200 do
        turn = "stale-#{round}"
        assert Locks.acquire(chat, user, turn, 60) == :ok
        # The turn's node went down two minutes ago (backdated, not slept).
        Psql.query!(psql, """
        UPDATE phoenix_kit_agent_conversations SET busy_since = busy_since - interval '120 s' WHERE uuid = '#{chat}';
        UPDATE phoenix_kit_agent_user_settings SET busy_since = busy_since - interval '120 s' WHERE user_uuid = '#{user}'
        """)

        values =
          [{:release_stale, [chat, user, turn, 60]}, {:release_stale, [chat, user, turn, 60]}]
          |> Race.run()
          |> assert_no_raise()

        assert Enum.sort(values) == [false, true], "round #{round}: #{inspect(values)}"
        assert locked_rows(psql, :chat, [chat]) == [], "round #{round}"
        assert locked_rows(psql, :user, [user]) == [], "round #{round}"
      end
    end

    test "racing a take-over of the same stale turn: the new turn always wins, " <>
           "at most one cleanup answers true",
         %{psql: psql} do
      chat = TestDB.insert_chat!()

      for round <- 1..100 do
        {old_user, new_user} = {TestDB.uuid(), TestDB.uuid()}
        {old, new} = {"old-#{round}", "new-#{round}"}
        assert Locks.acquire(chat, old_user, old, 60) == :ok

        Psql.query!(psql, """
        UPDATE phoenix_kit_agent_conversations SET busy_since = busy_since - interval '120 s' WHERE uuid = '#{chat}';
        UPDATE phoenix_kit_agent_user_settings SET busy_since = busy_since - interval '120 s' WHERE user_uuid = '#{old_user}'
        """)

        values =
          [
            {:release_stale, [chat, old_user, old, 60]},
            {:acquire, [chat, new_user, new, 60]},
            {:release_stale, [chat, old_user, old, 60]}
          ]
          |> Race.run()
          |> assert_no_raise()

        assert [stale1, :ok, stale2] = values, "round #{round}: #{inspect(values)}"
        assert Enum.count([stale1, stale2], & &1) <= 1, "round #{round}: #{inspect(values)}"
        assert locked_rows(psql, :chat, [chat]) == [[chat, new, "true"]]
        assert locked_rows(psql, :user, [new_user]) == [[new_user, new, "true"]]
        refute Locks.held?(chat, old_user, old)
        # The old turn's user lock went with the cleanup, or stays its own (stale).
        assert locked_rows(psql, :user, [old_user]) in [[], [[old_user, old, "true"]]]
        assert Locks.release(chat, new_user, new) == :ok
      end
    end
  end

  describe "crossing chats and users" do
    test "2,000 mixed calls on 2 chats x 2 users raise nothing (no deadlock, no serialization failure)",
         %{psql: psql} do
      chats = TestDB.insert_chats!(2)
      users = for _ <- 1..2, do: TestDB.uuid()
      :rand.seed(:exsss, {7, 7, 7})

      calls =
        for i <- 1..2_000 do
          chat = Enum.random(chats)
          user = Enum.random(users)
          turn = "x-#{rem(i, 8)}"

          case rem(i, 5) do
            0 -> {:acquire, [chat, user, turn, 1]}
            1 -> {:release, [chat, user, turn]}
            2 -> {:release_stale, [chat, user, turn, 1]}
            3 -> {:held?, [chat, user, turn]}
            4 -> {:acquire, [chat, user, turn, 60]}
          end
        end

      values = calls |> Race.run() |> assert_no_raise()

      for {{fun, _}, value} <- Enum.zip(calls, values) do
        case fun do
          :acquire ->
            assert value in [
                     :ok,
                     {:error, :conversation_busy},
                     {:error, :turn_in_flight}
                   ]

          :release ->
            assert value == :ok

          _boolean ->
            assert is_boolean(value)
        end
      end

      # Whatever is left locked is held by one of the racing refs.
      for [_id, ref, "true"] <- locked_rows(psql, :chat, chats) ++ locked_rows(psql, :user, users) do
        assert ref =~ ~r/^x-[0-7]$/
      end
    end
  end
end
