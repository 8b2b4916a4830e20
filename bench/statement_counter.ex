defmodule PhoenixKitAgent.Turns.Locks.Bench.StatementCounter do
  @moduledoc false
  # How many statements the library's pool runs on the server, and how many
  # of them are transaction control: the design's "one statement, in its own
  # transaction, per call", counted where it happens. Shared by `mix
  # locks.bench` (its "statements per call") and
  # test/phoenix_kit_agent/turns/one_statement_test.exs.
  #
  # pg_stat_statements counts executions per role, and counts BEGIN, COMMIT,
  # SAVEPOINT… too (pg_stat_statements.track_utility, on by default). So
  # `open/2` creates a login role for this counter alone and restarts the
  # pool logged in as it: the role's statements are exactly the library's,
  # whatever else runs on the database meanwhile (other tests, other runs of
  # the same SQL), and a role that ran no transaction control ran every
  # statement in autocommit, one transaction each.
  # (`pg_stat_database.xact_commit` would count the whole database's.)
  #
  # Needs: the pg_stat_statements view in the configured database (the
  # server preloads the module and someone ran `CREATE EXTENSION
  # pg_stat_statements`; this module creates nothing but its role), a
  # configured user that may create roles, and a server that lets a role with
  # a password log in the way the pool connects (not `peer` on a socket).
  # `close/1` puts the configured pool back and drops the role.

  alias PhoenixKitAgent.Turns.Locks.Bench.Psql
  alias PhoenixKitAgent.Turns.Locks.{Config, Native}

  @enforce_keys [:config, :role]
  defstruct [:config, :role]

  @type t :: %__MODULE__{config: Config.t(), role: String.t()}

  @typedoc "What a role ran: statements in all, and of them transaction control."
  @type counts :: %{statements: non_neg_integer(), transaction_control: non_neg_integer()}

  @transaction_control "^\\s*(BEGIN|START|COMMIT|END|ROLLBACK|ABORT|SAVEPOINT|RELEASE|PREPARE\\s+TRANSACTION)"

  @doc """
  Creates the counter's role and restarts the pool as it, with `config`'s
  settings otherwise (`pool_size:` in `opts` replaces its size). `config`
  is also the pool `close/1` puts back.
  """
  @spec open(Config.t(), keyword()) :: {:ok, t()} | {:error, String.t()}
  def open(%Config{} = config, opts \\ []) do
    hex = fn -> Base.encode16(:crypto.strong_rand_bytes(6), case: :lower) end
    {role, password} = {"locks_count_" <> hex.(), hex.()}
    counter = %__MODULE__{config: config, role: role}

    with {:ok, _} <-
           Psql.query(config, ["SELECT 1 FROM pg_stat_statements LIMIT 1"])
           |> explain("pg_stat_statements cannot be read"),
         # One command, so one transaction: no role is left without its grants.
         {:ok, _} <-
           Psql.query(config, [
             Enum.join(["CREATE ROLE #{role} LOGIN PASSWORD '#{password}'" | grants(config, role)], "; ")
           ])
           |> explain("cannot create a role to count as") do
      pool = %{
        config
        | username: role,
          password: password,
          pool_size: Keyword.get(opts, :pool_size, config.pool_size)
      }

      :ok = Native.start(pool)
      {:ok, counter}
    end
  end

  # The role may use the two tables where the pool finds them.
  defp grants(%Config{prefix: nil}, role), do: [table_grant(nil, role)]

  defp grants(%Config{prefix: prefix}, role),
    do: [~s(GRANT USAGE ON SCHEMA "#{prefix}" TO #{role}), table_grant(prefix, role)]

  defp table_grant(prefix, role) do
    tables =
      Enum.map_join(~w(phoenix_kit_agent_conversations phoenix_kit_agent_user_settings), ", ", fn
        table when prefix == nil -> table
        table -> ~s("#{prefix}".#{table})
      end)

    "GRANT SELECT, INSERT, UPDATE ON #{tables} TO #{role}"
  end

  defp explain({:error, why}, what), do: {:error, "#{what}: #{why}"}
  defp explain(ok, _what), do: ok

  @doc "What the counter's role has run in the configured database so far."
  @spec counts(t()) :: {:ok, counts()} | {:error, String.t()}
  def counts(%__MODULE__{config: config, role: role}) do
    sql = """
    SELECT coalesce(sum(calls), 0),
           coalesce(sum(calls) FILTER (WHERE query ~* '#{@transaction_control}'), 0)
    FROM pg_stat_statements
    WHERE userid = (SELECT oid FROM pg_roles WHERE rolname = '#{role}')
      AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
    """

    with {:ok, [[statements, control]]} <- Psql.query(config, [sql]) do
      {:ok,
       %{
         statements: String.to_integer(statements),
         transaction_control: String.to_integer(control)
       }}
    end
  end

  @doc "What `fun` made the pool run: the counts after it, less those before."
  @spec count(t(), (-> any())) :: {:ok, counts()} | {:error, String.t()}
  def count(counter, fun) do
    with {:ok, before} <- counts(counter),
         _ = fun.(),
         {:ok, later} <- counts(counter) do
      {:ok, Map.new(later, fn {key, n} -> {key, n - Map.fetch!(before, key)} end)}
    end
  end

  @doc """
  Puts the configured pool back (the role's connections close with the
  old one), waits for the role's sessions to end, and drops the role.
  """
  @spec close(t()) :: :ok | {:error, String.t()}
  def close(%__MODULE__{config: config, role: role}) do
    :ok = Native.start(config)
    wait_until_gone(config, role, 50)

    case Psql.query(config, ["DROP OWNED BY #{role}", "DROP ROLE #{role}"]) do
      {:ok, _} -> :ok
      error -> explain(error, "cannot drop the role #{role}")
    end
  end

  # A role with live sessions cannot be dropped.
  defp wait_until_gone(config, role, tries) do
    case Psql.query(config, ["SELECT count(*) FROM pg_stat_activity WHERE usename = '#{role}'"]) do
      {:ok, [["0"]]} ->
        :ok

      _ when tries > 0 ->
        Process.sleep(100)
        wait_until_gone(config, role, tries - 1)

      _ ->
        :ok
    end
  end
end
