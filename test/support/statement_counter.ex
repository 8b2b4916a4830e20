defmodule PhoenixKitAgent.Turns.Locks.StatementCounter do
  @moduledoc false
  # How many statements the library's pool runs on the server, and how many
  # of them are transaction control: the design's "one statement, in its own
  # transaction, per call", counted where it happens
  # (test/phoenix_kit_agent/turns/one_statement_test.exs).
  #
  # pg_stat_statements counts executions per role, BEGIN, COMMIT,
  # SAVEPOINT… too (pg_stat_statements.track_utility, on by default). So
  # `open/1` creates a login role for this counter alone and restarts the
  # pool logged in as it: the role's statements are exactly the library's,
  # whatever else runs on the database meanwhile, and a role that ran no
  # transaction control ran every statement in autocommit, one transaction
  # each. Needs the pg_stat_statements view in the test database, and a
  # configured user that may create roles; `close/1` puts the configured
  # pool back and drops the role. Through TestDB (psql), as the configured user.

  alias PhoenixKitAgent.Turns.Locks.{Config, Native, TestDB}

  defstruct [:config, :role]

  @transaction_control "^\\s*(BEGIN|START|COMMIT|END|ROLLBACK|ABORT|SAVEPOINT|RELEASE|PREPARE\\s+TRANSACTION)"
  @tables ~w(phoenix_kit_agent_conversations phoenix_kit_agent_user_settings)

  @doc "Creates the counter's role and restarts the pool as it; `config` is the pool `close/1` puts back."
  def open(%Config{} = config) do
    hex = fn -> Base.encode16(:crypto.strong_rand_bytes(6), case: :lower) end
    {role, password} = {"locks_count_" <> hex.(), hex.()}

    # The role may use the two tables where the pool finds them. One
    # request, so one transaction: no role is left without its grants.
    {schema, tables} =
      case config.prefix do
        nil ->
          {[], Enum.join(@tables, ", ")}

        p ->
          {[~s(GRANT USAGE ON SCHEMA "#{p}" TO #{role})],
           Enum.map_join(@tables, ", ", &~s("#{p}".#{&1}))}
      end

    grants = schema ++ ["GRANT SELECT, INSERT, UPDATE ON #{tables} TO #{role}"]

    TestDB.query!(
      Enum.join(["CREATE ROLE #{role} LOGIN PASSWORD '#{password}'" | grants], "; "),
      TestDB.url()
    )

    :ok = Native.start(%{config | username: role, password: password})
    %__MODULE__{config: config, role: role}
  end

  @doc "What `fun` made the pool run: `%{statements:, transaction_control:}`."
  def count(counter, fun) do
    before = counts(counter)
    fun.()
    Map.merge(counts(counter), before, fn _key, later, earlier -> later - earlier end)
  end

  defp counts(%__MODULE__{role: role}) do
    [[statements, control]] =
      TestDB.query!("""
      SELECT coalesce(sum(calls), 0),
             coalesce(sum(calls) FILTER (WHERE query ~* '#{@transaction_control}'), 0)
      FROM pg_stat_statements
      WHERE userid = (SELECT oid FROM pg_roles WHERE rolname = '#{role}')
        AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
      """)

    %{statements: String.to_integer(statements), transaction_control: String.to_integer(control)}
  end

  @doc "Puts the configured pool back, waits for the role's sessions to end, drops the role."
  def close(%__MODULE__{config: config, role: role}) do
    :ok = Native.start(config)
    sessions = "SELECT count(*) FROM pg_stat_activity WHERE usename = '#{role}'"

    Enum.reduce_while(1..50, nil, fn _, _ ->
      if TestDB.value!(sessions) == "0", do: {:halt, :ok}, else: {:cont, Process.sleep(100)}
    end)

    TestDB.query!("DROP OWNED BY #{role}; DROP ROLE #{role}", TestDB.url())
    :ok
  end
end
