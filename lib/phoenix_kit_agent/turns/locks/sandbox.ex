defmodule PhoenixKitAgent.Turns.Locks.Sandbox do
  @moduledoc false
  # `testing: :sandbox` (guides/testing.md): every lock call
  # runs its statement through the host repo's query/3 in the calling
  # process, so an Ecto SQL Sandbox's ownership, allowances and rollback
  # apply to it. The NIF hands over the statement (the pool's text, filled
  # for the host's tables: native/locks_nif/src/repo.rs) and reads the rows
  # back into the call's answer, by the pool's own code. No pool, no gate:
  # the sandbox's connection serializes the calls of a test.

  alias PhoenixKitAgent.Turns.Locks.{Error, Native}

  @key {__MODULE__, :repo}

  # Installs the mode of `Config.testing/0`'s answer (or clears it); that answer.
  def start({:sandbox, repo, prefix} = testing) do
    :ok = Native.repo_start(prefix)
    :persistent_term.put(@key, repo)
    testing
  end

  def start(:disabled) do
    :persistent_term.erase(@key)
    :disabled
  end

  # The host's repo under `testing: :sandbox`, else nil (one read of a persistent term).
  def repo, do: :persistent_term.get(@key, nil)

  # The answer of lock call `function` with its checked `args`, from `repo`.
  def call(repo, function, args) do
    case Native.repo_step(function, args) do
      {:columns, sql, params} ->
        :ok = Native.repo_columns(rows!(repo, sql, params))
        call(repo, function, args)

      {:run, sql, params} ->
        Native.repo_answer(function, args, rows!(repo, sql, params))
    end
  end

  # Lets a process that runs lock calls for `caller` (with_turn/4's keeper)
  # use `caller`'s sandbox connection, as a Task does: it joins `caller`'s
  # `$callers`, so no Ecto.Adapters.SQL.Sandbox.allow/3 is needed.
  def allow(caller) do
    if repo() do
      {:dictionary, dictionary} = Process.info(caller, :dictionary) || {:dictionary, []}
      Process.put(:"$callers", [caller | Keyword.get(dictionary, :"$callers", [])])
    end

    :ok
  end

  # Postgrex answers `rows: nil` to a statement that returns none (release/3).
  defp rows!(repo, sql, params) do
    case repo.query(sql, params, []) do
      {:ok, %{rows: rows}} -> rows || []
      {:error, exception} -> raise error(exception)
    end
  end

  # The Locks.Error of a repo's error (also of Locks.transaction/4's fence, in
  # either mode), by the fields of Postgrex's and DBConnection's exceptions;
  # any other exception as it is. Told apart and worded as the pool's
  # (locks_core/src/error.rs): a FATAL error or a shutdown ended the session
  # with the statement in flight; a cancel (57014) is the repo's `:timeout`
  # (the sandbox cancels a query that outlasts it) or the server's
  # statement_timeout; a lock_timeout (55P03: the fence's bound in the
  # pool's mode, or a host's own lock_timeout) is `:row_locked`; any other
  # refused it.
  def error(%{postgres: %{pg_code: sqlstate} = postgres}) when is_binary(sqlstate) do
    cause = "#{postgres[:message]} (#{sqlstate})"
    fatal? = postgres[:severity] in ["FATAL", "PANIC"] or sqlstate in ["57P01", "57P02", "57P03"]

    {reason, message} =
      cond do
        fatal? ->
          {:disconnected, "connection lost while the statement was in flight: " <> cause}

        sqlstate == "57014" ->
          {:timeout, "timed out: " <> cause}

        sqlstate == "55P03" ->
          {:row_locked, "a lock row stayed locked by another transaction: " <> cause}

        true ->
          {:statement, "statement failed: #{sqlstate}: #{postgres[:message]}"}
      end

    %Error{reason: reason, message: message, sqlstate: if(reason == :statement, do: sqlstate)}
  end

  def error(%{__struct__: DBConnection.ConnectionError, message: message} = error) do
    reason =
      cond do
        error.reason == :queue_timeout -> :pool_timeout
        message =~ "timed out" -> :timeout
        true -> :disconnected
      end

    %Error{reason: reason, message: message}
  end

  # No connection for this process: nothing was sent (the message says what to do).
  def error(%{__struct__: DBConnection.OwnershipError, message: message}),
    do: %Error{reason: :connect, message: message}

  def error(exception), do: exception
end
