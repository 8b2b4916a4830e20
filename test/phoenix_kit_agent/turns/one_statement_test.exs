defmodule PhoenixKitAgent.Turns.OneStatementTest do
  # One statement, in its own transaction, per public call: the design's
  # promise (it more than halves a caller's latency), counted on the server.
  #
  # pg_stat_statements counts executions per role, and counts BEGIN, COMMIT,
  # SAVEPOINT… too. So the pool is restarted logged in as a role made for this
  # module alone: the role's statements are exactly the library's, whatever
  # else runs on the database meanwhile (other tests, other test runs), and a
  # role that ran no transaction control ran every statement in autocommit,
  # one transaction each. (`pg_stat_database.xact_commit` would count the
  # whole database's transactions.) async: false, since the pool is global.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Config, Native, TestDB}

  @rounds 20

  setup_all do
    ensure_pg_stat_statements!()
    hex = fn -> Base.encode16(:crypto.strong_rand_bytes(6), case: :lower) end
    {role, password} = {"locks_one_stmt_" <> hex.(), hex.()}

    TestDB.query!("CREATE ROLE #{role} LOGIN PASSWORD '#{password}'")

    TestDB.query!(
      "GRANT SELECT, INSERT, UPDATE ON phoenix_kit_agent_conversations, " <>
        "phoenix_kit_agent_user_settings TO #{role}"
    )

    {:ok, config} = Config.read()
    :ok = Native.start(%{config | username: role, password: password})

    on_exit(fn ->
      # Back to the configured pool; the role's connections close with the
      # old one, and a role with live sessions cannot be dropped.
      :ok = Native.start(config)
      wait_until_gone(role, 50)
      TestDB.query!("DROP OWNED BY #{role}; DROP ROLE #{role}")
    end)

    %{role: role}
  end

  test "every public call, a refusal too, is one statement and no BEGIN/COMMIT on the server", %{
    role: role
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
        {statements, control} = counts(role)
        for _ <- 1..@rounds, do: call.()
        {statements_after, control_after} = counts(role)
        {name, statements: statements_after - statements, begin_commit: control_after - control}
      end

    assert counted == for({name, _} <- calls, do: {name, statements: @rounds, begin_commit: 0})
  end

  # {statements run, of which transaction control} by `role` in this database.
  defp counts(role) do
    [[statements, control]] =
      TestDB.query!("""
      SELECT coalesce(sum(calls), 0),
             coalesce(sum(calls) FILTER (WHERE query ~* '^\\s*(BEGIN|START|COMMIT|END|ROLLBACK|ABORT|SAVEPOINT|RELEASE|PREPARE\\s+TRANSACTION)'), 0)
      FROM pg_stat_statements
      WHERE userid = (SELECT oid FROM pg_roles WHERE rolname = '#{role}')
        AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
      """)

    {String.to_integer(statements), String.to_integer(control)}
  end

  defp ensure_pg_stat_statements! do
    TestDB.query!("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    TestDB.query!("SELECT 1 FROM pg_stat_statements LIMIT 1")
  rescue
    e ->
      # Another test run may be creating it at the same moment.
      if e.message =~ "already exists" do
        TestDB.query!("SELECT 1 FROM pg_stat_statements LIMIT 1")
      else
        reraise RuntimeError,
                [
                  message:
                    "this test counts statements with pg_stat_statements, which the " <>
                      "server must preload (shared_preload_libraries; scripts/pg does): " <>
                      e.message
                ],
                __STACKTRACE__
      end
  end

  defp wait_until_gone(role, tries) do
    case TestDB.query!("SELECT count(*) FROM pg_stat_activity WHERE usename = '#{role}'") do
      [["0"]] ->
        :ok

      _ when tries > 0 ->
        Process.sleep(100)
        wait_until_gone(role, tries - 1)

      _ ->
        :ok
    end
  end
end
