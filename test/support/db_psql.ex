defmodule PhoenixKitAgent.Turns.Locks.TestDB.Psql do
  @moduledoc false
  # The transport of TestDB's sessions: a long-lived `psql` driven through a
  # port. One query costs a fraction of a millisecond instead of the ~30 ms
  # of a fresh `psql` process, which is what tests need to backdate rows
  # inside a race, sample `pg_stat_activity` while a load runs, or increment
  # a counter (hex is unreachable: there is no Postgrex). Use TestDB.
  #
  # The session belongs to the process that opened it (the port's owner).
  # Every query ends with `\echo` of a marker, so the answer is the lines
  # before the marker; psql prints errors as `ERROR:  …` lines, which raise.

  defstruct [:port, :url]

  @marker "__test_db_psql_end__"
  @exited "psql exited with"
  @silent "psql: no answer within the deadline"

  @doc "Opens a session on `url` (psql's own connection, not the library's)."
  def open!(url, env \\ []) do
    psql = System.find_executable("psql") || raise "psql not found"

    port =
      Port.open({:spawn_executable, psql}, [
        :binary,
        :exit_status,
        :use_stdio,
        :stderr_to_stdout,
        {:line, 1_048_576},
        {:env, Enum.map([{"PGCONNECT_TIMEOUT", "10"} | env], &charlists/1)},
        args: ["-X", "-q", "-A", "-t", "-F", "\t", "-P", "null=\\N", "-d", url]
      ])

    session = %__MODULE__{port: port, url: url}
    # NOTICEs would come back as rows. A `timestamp without time zone`
    # holds UTC (Ecto's convention), whatever the database's TimeZone.
    [] = query!(session, "SET client_min_messages = warning; SET TimeZone = 'UTC'")
    session
  end

  defp charlists({k, v}),
    do: {String.to_charlist(k), if(v, do: String.to_charlist(v), else: false)}

  @doc "Runs `sql` (one or more statements) and returns the rows as lists of strings."
  def query!(%__MODULE__{port: port} = session, sql, timeout \\ 30_000) do
    Port.command(port, [sql, ";\n\\echo ", @marker, "\n"])
    lines = collect(session, [], [], System.monotonic_time(:millisecond) + timeout)

    case Enum.find(lines, &(&1 =~ ~r/^(psql:.*)?(ERROR|FATAL|PANIC):/)) do
      nil ->
        Enum.map(lines, fn line ->
          line |> String.split("\t") |> Enum.map(&if(&1 == "\\N", do: nil, else: &1))
        end)

      _error ->
        raise "psql: #{Enum.join(lines, "\n")}\n-- in: #{sql}"
    end
  end

  defp collect(%{port: port} = session, partial, acc, deadline) do
    wait = max(deadline - System.monotonic_time(:millisecond), 0)

    receive do
      {^port, {:data, {:noeol, chunk}}} ->
        collect(session, [partial, chunk], acc, deadline)

      {^port, {:data, {:eol, chunk}}} ->
        case IO.iodata_to_binary([partial, chunk]) do
          @marker -> Enum.reverse(acc)
          line -> collect(session, [], [line | acc], deadline)
        end

      {^port, {:exit_status, status}} ->
        raise "#{@exited} #{status}: #{Enum.join(Enum.reverse(acc), "\n")}"
    after
      wait -> raise @silent
    end
  end

  @doc """
  Whether `error` (raised by `query!/3`) means the session is of no more
  use: its psql exited, or did not answer in time (its answer may still
  come, and would be read as the next statement's).
  """
  def broken?(%RuntimeError{message: message}),
    do: String.starts_with?(message, [@exited, @silent])

  @doc "Ends the session."
  def close(%__MODULE__{port: port}) do
    if Port.info(port), do: Port.close(port)
    :ok
  catch
    :error, _ -> :ok
  end
end
