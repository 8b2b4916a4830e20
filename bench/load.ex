defmodule PhoenixKitAgent.Turns.Locks.Bench.Load do
  @moduledoc false
  # A busy VM (`mix locks.bench --busy K`): K CPU-bound processes on the
  # normal schedulers, as a loaded Phoenix node's are, each doing units of
  # pure work in a loop and counting them. What a client takes from that
  # load is the work it no longer does: its units a second while nothing
  # else runs (a baseline) less its units a second while the client runs.
  #
  # A unit is `spin/2` over 1,000 steps of integer arithmetic, a few µs of
  # one scheduler: small enough that the count is fine-grained; each step is
  # a function call and so a reduction, so the processes are preempted as
  # any Elixir code is. They are linked to the caller (a bench that crashes
  # takes them with it) and unlinked before `stop/1` kills them.

  @unit_steps 1_000

  @doc "Starts `k` load processes; the handle for `count/1` and `stop/1`."
  @spec start(pos_integer()) :: %{counters: :counters.counters_ref(), pids: [pid()]}
  def start(k) do
    counters = :counters.new(k, [:write_concurrency])

    pids =
      for i <- 1..k do
        spawn_link(fn -> loop(counters, i) end)
      end

    %{counters: counters, pids: pids}
  end

  @doc "`{units done so far by all of them, :erlang.monotonic_time() of the reading}`."
  @spec count(map()) :: {non_neg_integer(), integer()}
  def count(%{counters: counters, pids: pids}) do
    units = Enum.reduce(1..length(pids), 0, &(&2 + :counters.get(counters, &1)))
    {units, :erlang.monotonic_time()}
  end

  @doc "Units a second between two readings of `count/1`."
  @spec rate({integer(), integer()}, {integer(), integer()}) :: float()
  def rate({u0, t0}, {u1, t1}),
    do: (u1 - u0) / (System.convert_time_unit(t1 - t0, :native, :microsecond) / 1.0e6)

  @doc "Stops the load processes and waits until they are gone."
  @spec stop(map()) :: :ok
  def stop(%{pids: pids}) do
    Enum.each(pids, &Process.unlink/1)
    refs = Enum.map(pids, &Process.monitor/1)
    Enum.each(pids, &Process.exit(&1, :kill))
    Enum.each(refs, fn ref -> receive(do: ({:DOWN, ^ref, _, _, _} -> :ok)) end)
  end

  @doc "The steps of one unit."
  def unit_steps, do: @unit_steps

  defp loop(counters, i) do
    _ = spin(@unit_steps, 0)
    :counters.add(counters, i, 1)
    loop(counters, i)
  end

  defp spin(0, acc), do: acc
  defp spin(n, acc), do: spin(n - 1, Bitwise.band(acc * 31 + n, 0xFFFFFF))
end
