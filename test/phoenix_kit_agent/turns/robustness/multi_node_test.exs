defmodule PhoenixKitAgent.Turns.Robustness.MultiNodeTest do
  # Several nodes on one database: separate BEAM OS processes (Robust.Node),
  # each with its own pool, racing on the same rows, and one of them killed
  # with SIGKILL while it holds a chat's lock.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.TestDB
  alias PhoenixKitAgent.Turns.Locks.Robust.{Node, Race, Scenarios}

  @moduletag :robustness

  defp start_nodes(n) do
    nodes = for _ <- 1..n, do: Node.start!(app_env: [url: TestDB.url(), pool_size: 10])
    for node <- nodes, do: assert({_pid, {:ok, _}} = Node.hello(node))
    nodes
  end

  # Splits `calls` over `nodes`, prepares every caller on every node, then
  # fires all nodes together; the answers in the order of `calls`.
  defp race_across(nodes, calls) do
    name = :"race_#{System.unique_integer([:positive])}"
    chunks = Enum.chunk_every(calls, div(length(calls) + length(nodes) - 1, length(nodes)))
    pairs = Enum.zip(nodes, chunks)
    for {node, chunk} <- pairs, do: :ready = Node.call(node, Race, :prepare, [name, chunk])
    ids = for {node, _} <- pairs, do: {node, Node.async(node, Race, :fire, [name])}
    Enum.flat_map(ids, fn {node, id} -> Node.await(node, id) end)
  end

  defp assert_no_raise(answers) do
    raised = for {:raised, _} = r <- answers, do: r
    assert raised == [], "#{length(raised)} calls raised, e.g. #{inspect(Enum.take(raised, 3))}"
    Enum.map(answers, fn {:ok, value} -> value end)
  end

  describe "three nodes racing" do
    setup do
      %{nodes: start_nodes(3)}
    end

    @tag :slow
    test "500 turns of distinct users on one chat: one :ok, 499 :conversation_busy",
         %{nodes: nodes} do
      chat = TestDB.insert_chat!()
      users = for _ <- 1..500, do: TestDB.uuid()
      calls = for {user, i} <- Enum.with_index(users), do: {:acquire, [chat, user, "n1-#{i}", 60]}

      values = nodes |> race_across(calls) |> assert_no_raise()

      assert Enum.frequencies(values) == %{:ok => 1, {:error, :conversation_busy} => 499}
      w = Enum.find_index(values, &(&1 == :ok))
      assert elem(TestDB.lock(:chat, chat), 0) == "n1-#{w}"
      assert Locks.held?(chat, Enum.at(users, w), "n1-#{w}")

      # The same race on the next turn: the first winner releases, then again.
      assert Locks.release(chat, Enum.at(users, w), "n1-#{w}") == :ok

      calls =
        for {user, i} <- Enum.with_index(users), do: {:acquire, [chat, user, "n1b-#{i}", 60]}

      values = nodes |> race_across(calls) |> assert_no_raise()
      assert Enum.frequencies(values) == %{:ok => 1, {:error, :conversation_busy} => 499}
    end

    @tag :slow
    test "500 turns of one user on 500 chats: one :ok, 499 :turn_in_flight, their chats free",
         %{nodes: nodes} do
      user = TestDB.uuid()
      chats = TestDB.insert_chats!(500)
      calls = for {chat, i} <- Enum.with_index(chats), do: {:acquire, [chat, user, "n2-#{i}", 60]}

      values = nodes |> race_across(calls) |> assert_no_raise()

      assert Enum.frequencies(values) == %{:ok => 1, {:error, :turn_in_flight} => 499}
      w = Enum.find_index(values, &(&1 == :ok))

      assert TestDB.locked(:chat, chats) == [[Enum.at(chats, w), "n2-#{w}"]]
      assert elem(TestDB.lock(:user, user), 0) == "n2-#{w}"
    end

    @tag :slow
    test "two processes on two nodes release_stale/4 the same stale turn 200 times: one true each",
         %{nodes: [a, b | _]} do
      chat = TestDB.insert_chat!()
      user = TestDB.uuid()

      for round <- 1..200 do
        turn = "n3-#{round}"
        assert Locks.acquire(chat, user, turn, 60) == :ok
        TestDB.backdate!([chat: chat, user: user], 120)

        call = {:release_stale, [chat, user, turn, 60]}
        values = [a, b] |> race_across([call, call]) |> assert_no_raise()
        assert Enum.sort(values) == [false, true], "round #{round}"
        assert TestDB.locks(chat: chat, user: user) == [chat: {nil, nil}, user: {nil, nil}]
      end
    end
  end

  describe "a node killed with SIGKILL while it holds a chat's lock" do
    @tag :slow
    test "the other node is refused until the TTL passes, then takes over; the dead " <>
           "turn's release/3, replayed later, frees nothing" do
      [a, b] = start_nodes(2)
      chat = TestDB.insert_chat!()
      user = TestDB.uuid()
      dead = "turn-of-the-dead-node"

      assert Node.call(a, Locks, :acquire, [chat, user, dead, 60]) == :ok
      # The turn is running on A (checking its locks in a loop) when A dies.
      _ = Node.async(a, Scenarios, :run_turn, [chat, user, dead])
      assert Node.kill9!(a) == 137

      # Until the TTL passes, the lock is the dead turn's for everyone.
      assert Node.call(b, Locks, :acquire, [chat, TestDB.uuid(), "b-1", 60]) ==
               {:error, :conversation_busy}

      assert Node.call(b, Locks, :acquire, [chat, user, "b-2", 60]) ==
               {:error, :conversation_busy}

      assert Node.call(b, Locks, :acquire, [TestDB.insert_chat!(), user, "b-3", 60]) ==
               {:error, :turn_in_flight}

      assert Node.call(b, Locks, :held?, [chat, user, dead])
      assert Node.call(b, Locks, :fresh?, [chat, dead, 60])
      refute Node.call(b, Locks, :release_stale, [chat, user, dead, 60])
      assert TestDB.lock(:chat, chat) |> elem(0) == dead

      # The TTL passes (the rows are backdated, nobody sleeps).
      TestDB.backdate!([chat: chat, user: user], 61)
      refute Node.call(b, Locks, :fresh?, [chat, dead, 60])
      assert Node.call(b, Locks, :acquire, [chat, user, "b-4", 60]) == :ok
      refute Node.call(b, Locks, :held?, [chat, user, dead])

      # The dead turn's calls, replayed late (from B and from a new node C).
      [c] = start_nodes(1)
      assert Node.call(b, Locks, :release, [chat, user, dead]) == :ok
      assert Node.call(c, Locks, :release, [chat, user, dead]) == :ok
      refute Node.call(c, Locks, :release_stale, [chat, user, dead, 60])
      assert Node.call(c, Locks, :acquire, [chat, user, dead, 60]) == {:error, :conversation_busy}

      assert TestDB.lock(:chat, chat) |> elem(0) == "b-4"
      assert TestDB.lock(:user, user) |> elem(0) == "b-4"
      assert Node.call(c, Locks, :held?, [chat, user, "b-4"])
    end
  end
end
