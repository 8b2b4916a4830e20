defmodule PhoenixKitAgent.Turns.Robustness.IsolationTest do
  # A host database whose default isolation level is not READ COMMITTED
  # (`ALTER DATABASE … SET default_transaction_isolation`). The lock
  # statements rely on READ COMMITTED re-checking a predicate on the newest
  # row version after waiting; under REPEATABLE READ or SERIALIZABLE the
  # loser of a race gets a serialization failure (40001) instead, which must
  # not reach the caller: the races must end exactly as in the default case.
  # (They did reach it, until every connection pinned READ COMMITTED.)
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks.TestDB
  alias PhoenixKitAgent.Turns.Locks.Robust.{Node, Pg, Race}

  @moduletag :robustness

  for level <- ["repeatable read", "serializable"] do
    @tag level: level
    test "default_transaction_isolation = '#{level}': ten races of 200 turns on a chat: one :ok, " <>
           "199 :conversation_busy, nothing raised",
         %{level: level} do
      chats = for _ <- 1..10, do: TestDB.uuid()

      {_db, url} =
        Pg.create_database!(String.replace(level, " ", "_"),
          settings: ["default_transaction_isolation = '#{level}'"],
          sql:
            "INSERT INTO phoenix_kit_agent_conversations (uuid) VALUES " <>
              Enum.map_join(chats, ",", &"('#{&1}')")
        )

      node = Node.start!(app_env: [url: url, pool_size: 10])
      # A warm pool, so that the racing statements really overlap on the server.
      warm = for _ <- 1..50, do: {:held?, [hd(chats), hd(chats), "warm"]}
      assert Enum.uniq(Node.call(node, Race, :run, [warm])) == [{:ok, false}]

      for chat <- chats do
        calls = for i <- 1..200, do: {:acquire, [chat, TestDB.uuid(), "iso-#{i}", 60]}
        answers = Node.call(node, Race, :run, [calls])

        raised = for {:raised, e} <- answers, do: e
        assert raised == [], "#{length(raised)} raised, e.g. #{inspect(Enum.take(raised, 2))}"

        assert Enum.frequencies(answers) ==
                 %{{:ok, :ok} => 1, {:ok, {:error, :conversation_busy}} => 199}
      end
    end
  end
end
