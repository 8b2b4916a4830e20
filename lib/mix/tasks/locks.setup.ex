defmodule Mix.Tasks.Locks.Setup do
  @shortdoc "Creates the lock tables (or adds the lock columns) in the configured database"
  @moduledoc """
  Applies the idempotent DDL of `PhoenixKitAgent.Turns.Locks.Schema` to the
  database the library is configured for (`:url` or `DATABASE_URL`).

      mix locks.setup                 # both tables, if missing
      mix locks.setup --lock-columns  # only the lock columns, for existing tables
  """

  use Mix.Task

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: [lock_columns: :boolean])
    kind = if opts[:lock_columns], do: :lock_columns, else: :tables

    Mix.Task.run("app.start")
    :ok = PhoenixKitAgent.Turns.Locks.Schema.setup!(kind)
    Mix.shell().info("phoenix_kit_agent_locks: applied #{kind} DDL")
  end
end
