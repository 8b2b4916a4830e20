defmodule PhoenixKitAgent.Turns.Locks.Bench.Probe do
  @moduledoc false
  # How late a normal scheduler answers while lock calls run: the figure
  # behind "a call never holds a normal scheduler", shared by `mix
  # locks.bench` (its "probe p99") and the robustness suite (the longest
  # delay, while the database is broken under a load).
  #
  # The probe is a process that never calls a NIF. Every `interval_ms` it
  # wakes up and sends a message to a second process, which answers it. Two
  # delays are kept, both in µs:
  #
  #   * `rtt`: the round trip of that message (a histogram): how long any
  #     process of the host waits for a scheduler to run it and its peer;
  #   * `late_max`: the most a wake-up came later than asked. Erlang timers
  #     have millisecond resolution, so up to about 1,000 µs of it is the
  #     timer's, not a busy scheduler's.
  #
  # `worst` is the larger of the longest round trip and `late_max`.
  #
  # With `file_io: path`, each sample also reads that (small) file and keeps
  # the time in `file_io` (a histogram): file operations run on the
  # dirty-I/O schedulers, the ones the lock calls run on, so this is how long
  # the rest of the VM waits for one of them. It is kept apart from `worst`,
  # which is about the normal schedulers.
  #
  # `start/1` and `stop/1` may be called from different processes (the
  # robustness suite runs each command of a child node in a process of its
  # own), so the probe is not linked to its starter.

  alias PhoenixKitAgent.Turns.Locks.Bench.Histogram

  @type result :: %{
          rtt: Histogram.stats(),
          late_max: non_neg_integer(),
          worst: non_neg_integer(),
          file_io: Histogram.stats() | nil
        }

  @doc """
  Starts a probe. Options: `:interval_ms` between samples (default 1);
  `:from`, a `System.monotonic_time/0` at which to take the first sample
  (default now); `:file_io`, a file to read at each sample (default none).
  """
  @spec start(keyword()) :: pid()
  def start(opts \\ []) do
    interval = Keyword.get(opts, :interval_ms, 1)
    from = Keyword.get(opts, :from, System.monotonic_time())

    spawn(fn ->
      echo = spawn_link(&echo/0)
      sleep_until(from)
      file = Keyword.get(opts, :file_io)

      state = %{
        echo: echo,
        interval: interval,
        hist: Histogram.new(),
        rtt_max: 0,
        late_max: 0,
        file: file,
        file_hist: file && Histogram.new(),
        file_max: 0
      }

      loop(state)
    end)
  end

  @doc "Stops `probe` and returns what it measured."
  @spec stop(pid()) :: result()
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
        Histogram.add(state.hist, rtt)
        state = %{state | rtt_max: max(state.rtt_max, rtt), late_max: max(state.late_max, late)}
        loop(read_file(state))
    end
  end

  defp read_file(%{file: nil} = state), do: state

  defp read_file(state) do
    started = now_us()
    {:ok, _} = File.read(state.file)
    took = now_us() - started
    Histogram.add(state.file_hist, took)
    %{state | file_max: max(state.file_max, took)}
  end

  defp result(state) do
    %{
      rtt: Histogram.stats(state.hist, state.rtt_max),
      late_max: state.late_max,
      worst: max(state.rtt_max, state.late_max),
      file_io: state.file_hist && Histogram.stats(state.file_hist, state.file_max)
    }
  end

  defp echo do
    receive do
      {:ping, from} -> send(from, :pong)
    end

    echo()
  end

  defp sleep_until(t) do
    left = System.convert_time_unit(t - System.monotonic_time(), :native, :millisecond)
    if left > 0, do: Process.sleep(left)
  end

  defp now_us, do: System.monotonic_time(:microsecond)
end
