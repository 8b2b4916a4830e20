defmodule PhoenixKitAgent.Turns.Locks.Robust.Probe do
  @moduledoc false
  # How late a normal scheduler answers while lock calls run: the figure
  # behind "a call never holds a normal scheduler" (the robustness suite's
  # fault and freeze scenarios, in child nodes).
  #
  # The probe is a process that never calls a NIF. Every `interval_ms` it
  # wakes up and sends a message to a second process, which answers it.
  # `stop/1` returns, in µs:
  #
  #   * `rtt`: the round trips' count and percentiles (`%{n:, p50:, p99:,
  #     max:}`): how long any process of the host waits for a scheduler to
  #     run it and its peer;
  #   * `late_max`: the most a wake-up came later than asked (Erlang timers
  #     have millisecond resolution: up to about 1,000 µs of it is the
  #     timer's, not a busy scheduler's);
  #   * `worst`: the larger of the longest round trip and `late_max`.
  #
  # The round trips are kept in a list in the probe's heap: a few thousand
  # small integers a run. Not linked to its starter: the suite starts and
  # stops it from different processes.

  @doc "Starts a probe; `interval_ms:` between samples (default 1)."
  def start(opts \\ []) do
    interval = Keyword.get(opts, :interval_ms, 1)

    spawn(fn ->
      echo = spawn_link(&echo/0)
      loop(%{echo: echo, interval: interval, rtts: [], late_max: 0})
    end)
  end

  @doc "Stops `probe` and returns what it measured."
  def stop(probe) do
    ref = Process.monitor(probe)
    send(probe, {:stop, self()})

    receive do
      {:probe, ^probe, result} ->
        Process.demonitor(ref, [:flush])
        result

      {:DOWN, ^ref, _, _, reason} ->
        exit({:probe_down, reason})
    end
  end

  defp loop(state) do
    asleep = now_us()

    receive do
      {:stop, from} ->
        send(from, {:probe, self(), result(state)})
        Process.exit(state.echo, :kill)
    after
      state.interval ->
        woke = now_us()
        send(state.echo, {:ping, self()})
        receive(do: (:pong -> :ok))
        rtt = now_us() - woke
        late = max(woke - asleep - state.interval * 1_000, 0)
        loop(%{state | rtts: [rtt | state.rtts], late_max: max(state.late_max, late)})
    end
  end

  defp result(%{rtts: rtts, late_max: late_max}) do
    sorted = Enum.sort(rtts)
    n = length(sorted)
    at = fn p -> if n > 0, do: Enum.at(sorted, max(ceil(p * n), 1) - 1) end
    rtt = %{n: n, p50: at.(0.5), p99: at.(0.99), max: List.last(sorted)}
    %{rtt: rtt, late_max: late_max, worst: max(rtt.max || 0, late_max)}
  end

  defp echo do
    receive do
      {:ping, from} -> send(from, :pong)
    end

    echo()
  end

  defp now_us, do: System.monotonic_time(:microsecond)
end
