defmodule PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Freeze do
  @moduledoc false
  # Runs in a child node while the test holds its database frozen (SIGSTOP):
  # many lock calls at once, and meanwhile what the rest of a host's VM does
  # (file I/O from a process that has nothing to do with the locks, a probe
  # of the normal schedulers, optionally `Application.stop/1`), each timed.

  alias PhoenixKitAgent.Turns.Locks.Robust.{Probe, Race}

  @doc """
  Starts `calls` (`{fun, args}` of Locks) at once; `after_ms` later times an
  unrelated process's `File.read!/1` and `File.write!/2` of a small file,
  then, with `stop_app: true`, `Application.stop(:phoenix_kit_agent_locks)`.
  Returns `%{answers: [{answer, ms}], read_ms:, write_ms:, stop_ms:, probe:}`
  once every call has ended, `probe` being what `Robust.Probe` measured
  meanwhile (its `rtt`: the message round trips on the normal schedulers).
  """
  def run(calls, opts) do
    # The file exists before the calls start: only the timed read and write
    # happen while they wait.
    path = Path.join(System.tmp_dir!(), "robust_freeze_#{System.unique_integer([:positive])}")
    File.write!(path, "x")
    probe = Probe.start()
    me = self()

    for {{fun, args}, i} <- Enum.with_index(calls) do
      spawn(fn ->
        started = now_us()
        answer = Race.attempt(fun, args)
        send(me, {:answer, i, {answer, div(now_us() - started, 1_000)}})
      end)
    end

    receive do
    after
      Keyword.fetch!(opts, :after_ms) -> :ok
    end

    {read_ms, write_ms} = file_io(path)

    stop_ms =
      if opts[:stop_app],
        do: ms(fn -> Application.stop(:phoenix_kit_agent_locks) end),
        else: nil

    answers =
      for i <- 0..(length(calls) - 1)//1 do
        receive do
          {:answer, ^i, answer} -> answer
        end
      end

    %{
      answers: answers,
      read_ms: read_ms,
      write_ms: write_ms,
      stop_ms: stop_ms,
      probe: Probe.stop(probe)
    }
  end

  # File I/O runs on the dirty-I/O schedulers, as the lock calls do. Done
  # in a process of its own, which has nothing to do with the locks.
  defp file_io(path) do
    task =
      Task.async(fn ->
        read = ms(fn -> "x" = File.read!(path) end)
        write = ms(fn -> :ok = File.write!(path, "y") end)
        {read, write}
      end)

    result = Task.await(task, 60_000)
    File.rm(path)
    result
  end

  defp ms(fun) do
    started = now_us()
    fun.()
    (now_us() - started) / 1_000
  end

  defp now_us, do: System.monotonic_time(:microsecond)
end
