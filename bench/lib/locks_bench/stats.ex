defmodule LocksBench.Stats do
  @moduledoc false
  # The figures: the VM's CPU time from /proc, medians and ranges, and how
  # they are printed.

  @doc """
  The CPU time this VM has used so far, in clock ticks: every BEAM thread's
  utime + stime (fields 14 and 15 of /proc/self/task/*/stat: the normal
  and dirty schedulers, their spinning, the async threads); `nil` without
  /proc (Linux only). A thread's figure is rounded down to a tick, so read
  it around seconds of work, not around one call.
  """
  @spec ticks() :: non_neg_integer() | nil
  def ticks do
    case File.ls("/proc/self/task") do
      {:ok, tasks} -> Enum.reduce(tasks, 0, &(&2 + task_ticks("/proc/self/task/#{&1}/stat")))
      {:error, _} -> nil
    end
  end

  # The command name (field 2) may hold spaces and parentheses: fields are
  # counted from the last ")", after which comes field 3. A thread that
  # ended meanwhile counts 0.
  defp task_ticks(path) do
    with {:ok, stat} <- File.read(path),
         fields = stat |> String.split(")") |> List.last() |> String.split(),
         {utime, ""} <- Integer.parse(Enum.at(fields, 14 - 3, "")),
         {stime, ""} <- Integer.parse(Enum.at(fields, 15 - 3, "")) do
      utime + stime
    else
      _ -> 0
    end
  end

  @doc "Clock ticks a second (`getconf CLK_TCK`, else 100)."
  @spec hz() :: pos_integer()
  def hz do
    with exe when is_binary(exe) <- System.find_executable("getconf"),
         {out, 0} <- System.cmd(exe, ["CLK_TCK"]),
         {n, ""} when n > 0 <- Integer.parse(String.trim(out)) do
      n
    else
      _ -> 100
    end
  end

  @doc "µs of CPU per statement: `ticks` over `statements` (nil when either is missing)."
  def per_statement_us(ticks, statements, hz) when is_integer(ticks) and statements > 0,
    do: ticks * 1.0e6 / hz / statements

  def per_statement_us(_ticks, _statements, _hz), do: nil

  @doc "The median of the numbers in `values` (nils left out); nil when there are none."
  def median(values) do
    case values |> Enum.reject(&is_nil/1) |> Enum.sort() do
      [] -> nil
      vs when rem(length(vs), 2) == 1 -> Enum.at(vs, div(length(vs), 2))
      vs -> (Enum.at(vs, div(length(vs), 2) - 1) + Enum.at(vs, div(length(vs), 2))) / 2
    end
  end

  @doc "`median (min–max)` of `values`, each with `decimals`; `–` when there are none."
  def summary(values, decimals) do
    case Enum.reject(values, &is_nil/1) do
      [] ->
        "–"

      [v] ->
        fmt(v, decimals)

      vs ->
        "#{fmt(median(vs), decimals)} (#{fmt(Enum.min(vs), decimals)}–#{fmt(Enum.max(vs), decimals)})"
    end
  end

  @doc "A number as the report prints it: thousands grouped when whole."
  def fmt(nil, _decimals), do: "–"

  def fmt(v, 0) do
    v
    |> round()
    |> Integer.to_string()
    |> String.reverse()
    |> String.graphemes()
    |> Enum.chunk_every(3)
    |> Enum.join(",")
    |> String.reverse()
  end

  def fmt(v, decimals), do: :erlang.float_to_binary(v / 1, decimals: decimals)

  @doc "`a ÷ b`, nil when either is missing or b is 0."
  def ratio(a, b) when is_number(a) and is_number(b) and b > 0, do: a / b
  def ratio(_a, _b), do: nil
end
