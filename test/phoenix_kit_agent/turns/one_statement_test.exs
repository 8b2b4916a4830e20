defmodule PhoenixKitAgent.Turns.OneStatementTest do
  # One statement, in its own transaction, per public call: the design's
  # promise (it more than halves a caller's latency), counted on the server
  # by StatementCounter (test/support/statement_counter.ex): the pool is
  # restarted logged in as a role made for this module alone, whose
  # statements pg_stat_statements counts, BEGIN/COMMIT/SAVEPOINT… included.
  # async: false, since the pool is global.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Config, StatementCounter, TestDB}

  @rounds 20

  setup_all do
    ensure_pg_stat_statements!()
    {:ok, config} = Config.read()
    counter = StatementCounter.open(config)
    on_exit(fn -> :ok = StatementCounter.close(counter) end)
    %{counter: counter}
  end

  test "every public call, a refusal too, is one statement and no BEGIN/COMMIT on the server", %{
    counter: counter
  } do
    [chat, other_chat] = TestDB.insert_chats!(2)
    {user, click_user, click} = {TestDB.uuid(), TestDB.uuid(), Locks.click_ref()}

    calls = [
      {"acquire/4", fn -> :ok = Locks.acquire(chat, user, "one-stmt", 60) end},
      {"held?/3", fn -> true = Locks.held?(chat, user, "one-stmt") end},
      {"fresh?/3", fn -> true = Locks.fresh?(chat, "one-stmt", 60) end},
      {"release_stale/4", fn -> false = Locks.release_stale(chat, user, "one-stmt", 60) end},
      {"release/3", fn -> :ok = Locks.release(chat, user, "one-stmt") end},
      # A refusal is one statement too.
      {"acquire/4 refused",
       fn -> {:error, :conversation_busy} = Locks.acquire(other_chat, user, "one-stmt", 60) end},
      {"acquire_user/4", fn -> :ok = Locks.acquire_user(click_user, click, 60, 10) end},
      {"keep_user/4", fn -> true = Locks.keep_user(click_user, click, 60, 10) end},
      {"release_user/2", fn -> :ok = Locks.release_user(click_user, click) end}
    ]

    # other_chat is busy: another turn holds it.
    :ok = Locks.acquire(other_chat, TestDB.uuid(), "another-turn", 60)

    # A connection prepares each statement the first time it runs it; a
    # PREPARE is not an execution, but keep it out of the counted rounds.
    Enum.each(calls, fn {_, call} -> call.() end)

    counted =
      for {name, call} <- calls do
        {name, StatementCounter.count(counter, fn -> for _ <- 1..@rounds, do: call.() end)}
      end

    assert counted ==
             for({name, _} <- calls, do: {name, %{statements: @rounds, transaction_control: 0}})
  end

  # The server preloads pg_stat_statements (scripts/pg does); the view is
  # this test database's to create. The counter itself creates nothing but
  # its role.
  defp ensure_pg_stat_statements! do
    TestDB.query!("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    TestDB.query!("SELECT 1 FROM pg_stat_statements LIMIT 1")
  rescue
    e ->
      # Another test run may be creating it at the same moment.
      if Exception.message(e) =~ "already exists" do
        TestDB.query!("SELECT 1 FROM pg_stat_statements LIMIT 1")
      else
        reraise RuntimeError,
                [
                  message:
                    "this test counts statements with pg_stat_statements, which the " <>
                      "server must preload (shared_preload_libraries; scripts/pg does): " <>
                      Exception.message(e)
                ],
                __STACKTRACE__
      end
  end
end
