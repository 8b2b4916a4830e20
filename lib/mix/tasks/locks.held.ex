defmodule Mix.Tasks.Locks.Held do
  @shortdoc "Prints the locks taken (chats and users), the oldest first"
  @moduledoc """
  Prints every lock taken in the configured database, the oldest first, as
  `PhoenixKitAgent.Turns.Locks.held_locks/1` lists them (a bad row first, its
  age `unknown`, as stale): what is stuck, and since when. `--ttl` (seconds,
  default 120): older locks are shown as stale (they may be taken over).

      mix locks.held            # stale: older than 120 s
      mix locks.held --ttl 900  # the TTL your turns use

  It starts the library alone, and an ordinary error stops it with one line
  that says what to set or fix (guides/operating.md, "Schema and migrations").
  """

  use Mix.Task

  @impl true
  def run(args) do
    Mix.Tasks.Locks.Task.run("mix locks.held", args, [ttl: :integer], fn opts ->
      locks =
        try do
          PhoenixKitAgent.Turns.Locks.held_locks(Keyword.get(opts, :ttl, 120))
        rescue
          # Its one argument: "invalid ttl_s: expected …, got: 0".
          e in ArgumentError ->
            Mix.raise(String.replace_prefix(e.message, "invalid ttl_s", "mix locks.held: --ttl"))
        end

      Mix.shell().info(if locks == [], do: "no lock is taken", else: table(locks))
    end)
  end

  @doc false
  def table(locks) do
    rows =
      for lock <- locks do
        [
          Atom.to_string(lock.kind),
          lock.uuid,
          lock.ref,
          if(lock.since, do: DateTime.to_iso8601(lock.since), else: "-"),
          if(lock.age_s, do: "#{Float.round(lock.age_s, 1)} s", else: "unknown"),
          if(lock.stale, do: "stale", else: "")
        ]
      end

    rows = [["kind", "uuid", "ref", "since (UTC)", "age", "stale"] | rows]

    widths = Enum.zip_with(rows, &Enum.max(Enum.map(&1, fn cell -> String.length(cell) end)))

    Enum.map_join(rows, "\n", fn row ->
      row |> Enum.zip_with(widths, &String.pad_trailing/2) |> Enum.join("  ")
    end)
  end
end
