defmodule Mix.Tasks.Locks.Held do
  @shortdoc "Prints the locks taken (chats and users), the oldest first"
  @moduledoc """
  Prints every lock taken in the database the library is configured for, the
  oldest first, as `PhoenixKitAgent.Turns.Locks.held_locks/1` lists them:
  what is stuck, and since when.

      mix locks.held            # stale: older than 120 s
      mix locks.held --ttl 900  # the TTL your turns use

  ## Options

    * `--ttl` - seconds: a lock older than this is shown as stale (it may
      be taken over). Defaults to 120.
  """

  use Mix.Task

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: [ttl: :integer])
    Mix.Task.run("app.start")

    case PhoenixKitAgent.Turns.Locks.held_locks(Keyword.get(opts, :ttl, 120)) do
      [] -> Mix.shell().info("no lock is taken")
      locks -> Mix.shell().info(table(locks))
    end
  end

  @doc false
  def table(locks) do
    header = ["kind", "uuid", "ref", "since (UTC)", "age", "stale"]

    rows =
      for lock <- locks do
        [
          Atom.to_string(lock.kind),
          lock.uuid,
          lock.ref,
          if(lock.since, do: DateTime.to_iso8601(lock.since), else: "-"),
          if(lock.age_s, do: "#{Float.round(lock.age_s, 1)} s", else: "-"),
          if(lock.stale, do: "stale", else: "")
        ]
      end

    widths =
      for i <- 0..(length(header) - 1),
          do: Enum.max(for row <- [header | rows], do: String.length(Enum.at(row, i)))

    [header | rows]
    |> Enum.map_join("\n", fn row ->
      row
      |> Enum.zip(widths)
      |> Enum.map_join("  ", fn {cell, w} -> String.pad_trailing(cell, w) end)
    end)
  end
end
