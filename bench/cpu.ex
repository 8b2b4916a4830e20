defmodule PhoenixKitAgent.Turns.Locks.Bench.CPU do
  @moduledoc false
  # The CPU time this VM has used, for "µs of CPU per call": every thread
  # of the BEAM counts (normal and dirty schedulers, their spinning while
  # they wait for work, the async threads), as the machine pays for them.
  #
  # Linux only: the sum over /proc/self/task/*/stat of utime and stime
  # (fields 14 and 15), in clock ticks (`getconf CLK_TCK`, usually 100 a
  # second). Each thread's figure is rounded down to a tick, so a
  # difference is exact to a tick per busy thread: read it around a timed
  # part of a few seconds, not around a single call.
  #
  # When the server runs on this machine, its processes' CPU time too: the
  # VM and the server share the cores, so what the server spends per
  # statement bounds the throughput any client can reach.

  @doc "The VM's CPU time so far, in clock ticks; `nil` without /proc."
  @spec ticks() :: non_neg_integer() | nil
  def ticks do
    case File.ls("/proc/self/task") do
      {:ok, tasks} -> Enum.reduce(tasks, 0, &(&2 + stat_ticks("/proc/self/task/#{&1}/stat")))
      {:error, _} -> nil
    end
  end

  @doc """
  The postmaster of the PostgreSQL process `pid` (a backend or a background
  process of the server), when that process runs on this machine; `nil`
  otherwise (a remote server, PgBouncer's pids, no /proc).
  """
  @spec postmaster(pos_integer()) :: pos_integer() | nil
  def postmaster(pid) do
    with {:ok, stat} <- File.read("/proc/#{pid}/stat"),
         [_, "postgres"] <- Regex.run(~r/\((.*)\)/, stat),
         {ppid, ""} <- Integer.parse(Enum.at(fields(stat), 4 - 3, "")) do
      ppid
    else
      _ -> nil
    end
  end

  @doc """
  The server's CPU time so far, in clock ticks: its postmaster's and every
  child's (backends, the WAL writer, the checkpointer, autovacuum); `nil`
  without a postmaster. A child that ended in between is not counted.
  """
  @spec server_ticks(pos_integer() | nil) :: non_neg_integer() | nil
  def server_ticks(nil), do: nil

  def server_ticks(postmaster) do
    for entry <- File.ls!("/proc"),
        {pid, ""} <- [Integer.parse(entry)],
        {:ok, stat} <- [File.read("/proc/#{pid}/stat")],
        pid == postmaster or Enum.at(fields(stat), 4 - 3) == "#{postmaster}",
        reduce: 0 do
      acc -> acc + ticks_of(stat)
    end
  end

  # A thread that ended between the listing and the read counts as 0.
  defp stat_ticks(path) do
    case File.read(path) do
      {:ok, stat} -> ticks_of(stat)
      {:error, _} -> 0
    end
  end

  defp ticks_of(stat) do
    with fields = fields(stat),
         {utime, ""} <- Integer.parse(Enum.at(fields, 14 - 3, "")),
         {stime, ""} <- Integer.parse(Enum.at(fields, 15 - 3, "")) do
      utime + stime
    else
      _ -> 0
    end
  end

  # The command name (field 2) is in parentheses and may hold spaces or
  # parentheses: fields are counted from the last ")", after which comes
  # field 3.
  defp fields(stat), do: stat |> String.split(")") |> List.last() |> String.split()

  @doc "Clock ticks per second (`getconf CLK_TCK`; 100 when it cannot be asked)."
  @spec hz() :: pos_integer()
  def hz do
    case :persistent_term.get({__MODULE__, :hz}, nil) do
      nil ->
        hz = clk_tck()
        :persistent_term.put({__MODULE__, :hz}, hz)
        hz

      hz ->
        hz
    end
  end

  defp clk_tck do
    with exe when is_binary(exe) <- System.find_executable("getconf"),
         {out, 0} <- System.cmd(exe, ["CLK_TCK"]),
         {n, ""} when n > 0 <- Integer.parse(String.trim(out)) do
      n
    else
      _ -> 100
    end
  end

  @doc "µs of CPU per call: `ticks` spent over `calls` calls (`nil` when either is missing)."
  @spec per_call_us(non_neg_integer() | nil, non_neg_integer()) :: float() | nil
  def per_call_us(nil, _calls), do: nil
  def per_call_us(_ticks, 0), do: nil
  def per_call_us(ticks, calls), do: ticks * 1.0e6 / hz() / calls
end
