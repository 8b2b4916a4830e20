defmodule PhoenixKitAgent.Turns.Locks.SandboxRepo do
  @moduledoc false
  # Stands in for a host's Ecto repo under Ecto.Adapters.SQL.Sandbox (hex is
  # unreachable: no Ecto, Postgrex or DBConnection here), for what
  # `testing: :sandbox` uses of one: `query/3` in the calling process.
  #
  # As the sandbox: `checkout/0` gives the calling process a connection of
  # its own (a psql session, TestDB.session!/0) inside a transaction
  # (BEGIN), `allow/2` lets another process use it, `checkin/0` rolls it back.
  # A process finds its connection as DBConnection's ownership does: its
  # own, else the first of its `$callers` that has one; with none, the
  # error is the OwnershipError's (a map with its struct name, no module).
  #
  # As Postgrex: `query/3` runs the very text it is given with its
  # parameters bound by the server (PREPARE, then EXECUTE with literals of
  # the types PREPARE inferred: `pg_prepared_statements`), takes a uuid
  # parameter only as its 16 bytes, and answers `{:ok, %{rows: rows}}` with
  # each column decoded by its type (`boolean`, `text`, `bigint`, `integer`,
  # `double precision`; NULL as nil; `rows: nil` for a statement that
  # returns none) or `{:error, %SandboxRepo.Error{postgres: %{pg_code: …}}}`,
  # Postgrex.Error's fields. Each query runs in a savepoint, as Ecto's
  # sandbox runs it (Postgrex's `mode: :savepoint`): a failed one is rolled
  # back alone and the test's transaction goes on. Values must not hold a
  # tab or a newline (psql's
  # output is read line by line): no lock statement returns one here.
  #
  # As Ecto's `transaction/2` and `rollback/1` (Locks.transaction/4): inside
  # the sandbox (the caller has a connection) a transaction is a savepoint of
  # the test's transaction, as the sandbox makes it; outside it, a
  # transaction (BEGIN … COMMIT) on a connection of its own, the caller's for
  # its length, as a pooled repo checks one out: a host in production.

  alias PhoenixKitAgent.Turns.Locks.TestDB

  defmodule Error do
    @moduledoc false
    defexception [:message, :postgres]
  end

  @doc "The repo's settings, as `MyApp.Repo.config()` returns them (nothing the mode needs)."
  def config, do: []

  @doc "The calling process's connection, in a new transaction."
  def checkout do
    session = TestDB.session!()
    # Ended by checkin/1 alone (from the test's on_exit), not with the test
    # process: ExUnit ends that before on_exit runs, and a linked session
    # could die under the ROLLBACK (seen on Elixir 1.18).
    Process.unlink(session)
    # SQLSTATEs in error messages (`ERROR:  42P01: …`).
    [] = TestDB.query!("\\set VERBOSITY verbose\nBEGIN", session)
    owner = self()
    Agent.update(owners(), &Map.put(&1, owner, session))
    session
  end

  @doc "Lets `pid` use the connection of `owner`."
  def allow(owner, pid) do
    Agent.update(owners(), &Map.put(&1, pid, Map.fetch!(&1, owner)))
  end

  @doc "Rolls the transaction of `owner` back and ends its connection."
  def checkin(owner \\ self()) do
    session = Agent.get_and_update(owners(), &{Map.fetch!(&1, owner), drop(&1, owner)})
    TestDB.query!("ROLLBACK", session)
    TestDB.close(session)
  end

  defp drop(owners, owner) do
    session = owners[owner]
    Map.reject(owners, fn {_pid, s} -> s == session end)
  end

  def query(sql, params, _opts) do
    case connection([self() | Process.get(:"$callers", [])]) do
      nil ->
        message = "cannot find ownership process for #{inspect(self())} (SandboxRepo)"

        {:error,
         %{__struct__: DBConnection.OwnershipError, __exception__: true, message: message}}

      session ->
        run(session, sql, params)
    end
  end

  @doc """
  Runs `fun` in a transaction: `{:ok, value}`; `{:error, value}` after
  `rollback(value)`; an exception (or a throw, an exit) rolls back and is
  raised again.
  """
  def transaction(fun, _opts \\ []) when is_function(fun, 0) do
    case connection([self() | Process.get(:"$callers", [])]) do
      nil ->
        session = TestDB.session!()
        [] = TestDB.query!("\\set VERBOSITY verbose\nBEGIN", session)
        owner = self()
        Agent.update(owners(), &Map.put(&1, owner, session))

        try do
          in_transaction(fun, session, "COMMIT", "ROLLBACK")
        after
          Agent.update(owners(), &Map.delete(&1, owner))
          # Gone already when the server ended the connection (psql exits).
          if Process.alive?(session), do: TestDB.close(session)
        end

      session ->
        name = "sandbox_repo_tx_#{System.unique_integer([:positive])}"
        [] = TestDB.query!("SAVEPOINT #{name}", session)

        in_transaction(
          fun,
          session,
          "RELEASE SAVEPOINT #{name}",
          "ROLLBACK TO SAVEPOINT #{name};\nRELEASE SAVEPOINT #{name}"
        )
    end
  end

  @doc "Ends the transaction it is called in: `transaction/2` answers `{:error, value}`."
  def rollback(value), do: throw({__MODULE__, :rollback, value})

  defp in_transaction(fun, session, commit, undo) do
    value = fun.()
    [] = TestDB.query!(commit, session)
    {:ok, value}
  catch
    :throw, {__MODULE__, :rollback, value} ->
      [] = TestDB.query!(undo, session)
      {:error, value}

    kind, reason ->
      # As Postgrex after a lost connection: the first error is raised, not the undo's.
      stacktrace = __STACKTRACE__

      try do
        TestDB.query!(undo, session)
      rescue
        _ -> :ok
      catch
        :exit, _ -> :ok
      end

      :erlang.raise(kind, reason, stacktrace)
  end

  defp connection(callers) do
    owners = Agent.get(owners(), & &1)
    Enum.find_value(callers, &owners[&1])
  end

  @types_end "sandbox_repo_types_end"
  # What Postgrex does after a failed query in Ecto's sandbox (mode: :savepoint).
  @undo "ROLLBACK TO SAVEPOINT sandbox_repo;\nRELEASE SAVEPOINT sandbox_repo;\nDEALLOCATE ALL"

  defp run(session, sql, params) do
    name = "sandbox_repo_#{System.unique_integer([:positive])}"

    [[param_types]] =
      TestDB.query!(
        "SAVEPOINT sandbox_repo;\nPREPARE #{name} AS #{sql};\n" <>
          "SELECT parameter_types::text FROM pg_prepared_statements WHERE name = '#{name}'",
        session
      )

    literals = Enum.zip_with(types(param_types), params, &literal/2)

    execute =
      "EXECUTE #{name}" <> if(literals == [], do: "", else: "(#{Enum.join(literals, ", ")})")

    # psql's \gdesc describes the result (name and type of each column) without running it.
    lines =
      TestDB.query!(
        "#{execute} \\gdesc\n\\echo #{@types_end}\n#{execute};\n" <>
          "DEALLOCATE #{name};\nRELEASE SAVEPOINT sandbox_repo",
        session
      )

    {described, [[@types_end] | rows]} = Enum.split_while(lines, &(&1 != [@types_end]))

    case described do
      [["The command has no result" <> _]] ->
        {:ok, %{rows: nil}}

      columns ->
        types = Enum.map(columns, fn [_name, type] -> type end)
        {:ok, %{rows: Enum.map(rows, &Enum.zip_with(types, &1, fn t, v -> decode(t, v) end))}}
    end
  rescue
    e in RuntimeError ->
      # The session goes on after PostgreSQL's error, not after a lost connection.
      error = error(e.message)
      if is_struct(error, Error), do: TestDB.query!(@undo, session)
      {:error, error}
  end

  # `{uuid,text,integer}` as a list.
  defp types(array) do
    array
    |> String.trim_leading("{")
    |> String.trim_trailing("}")
    |> String.split(",", trim: true)
    |> Enum.map(&String.trim(&1, "\""))
  end

  defp literal("uuid", <<uuid::binary-16>>) do
    <<a::binary-4, b::binary-2, c::binary-2, d::binary-2, e::binary-6>> = uuid
    "'" <> Enum.map_join([a, b, c, d, e], "-", &Base.encode16(&1, case: :lower)) <> "'"
  end

  defp literal("uuid", value),
    do: raise(ArgumentError, "Postgrex expected a binary of 16 bytes, got #{inspect(value)}")

  defp literal("text", value) when is_binary(value),
    do: "'" <> String.replace(value, "'", "''") <> "'"

  defp literal("integer", value) when is_integer(value), do: Integer.to_string(value)

  defp decode(_type, nil), do: nil
  defp decode("boolean", "t"), do: true
  defp decode("boolean", "f"), do: false
  defp decode("text", value), do: value
  defp decode(int, value) when int in ["bigint", "integer"], do: String.to_integer(value)

  defp decode("double precision", value) do
    {float, ""} = Float.parse(value)
    float
  end

  # Not Postgrex's error but DBConnection's: the connection itself is gone
  # (TestDB.Psql: psql exited, or stopped answering).
  defp error("psql failed: psql exited with" <> _ = message), do: lost(message)
  defp error("psql failed: psql: no answer" <> _ = message), do: lost(message)

  # psql's `ERROR:  42P01: relation "x" does not exist`.
  defp error(message) do
    case Regex.run(~r/(ERROR|FATAL|PANIC):\s+([0-9A-Z]{5}): ([^\n]*)/, message) do
      [_, severity, code, text] ->
        %Error{message: text, postgres: %{pg_code: code, message: text, severity: severity}}

      nil ->
        raise message
    end
  end

  defp lost(message) do
    %{__struct__: DBConnection.ConnectionError, __exception__: true, message: message}
    |> Map.merge(%{reason: :error, severity: :error})
  end

  defp owners do
    case Agent.start(fn -> %{} end, name: __MODULE__.Owners) do
      {:ok, pid} -> pid
      {:error, {:already_started, pid}} -> pid
    end
  end
end
