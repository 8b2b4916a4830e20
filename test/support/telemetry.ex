defmodule :telemetry do
  @moduledoc false
  # Stands in for the :telemetry library (hex is unreachable here): the same
  # execute/3 the library calls when it finds the module at its start.
  # Tests subscribe with `attach/1` and receive each event as
  # `{:telemetry, event, measurements, metadata}`; an event nobody listens
  # to goes nowhere, as with the real one.

  @key {__MODULE__, :listeners}

  def attach(pid \\ self()), do: :persistent_term.put(@key, [pid | listeners()])
  def detach(pid \\ self()), do: :persistent_term.put(@key, listeners() -- [pid])

  def execute(event, measurements, metadata) do
    for pid <- listeners(), do: send(pid, {:telemetry, event, measurements, metadata})
    :ok
  end

  defp listeners, do: :persistent_term.get(@key, [])
end
