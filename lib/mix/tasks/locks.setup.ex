defmodule Mix.Tasks.Locks.Setup do
  @shortdoc "Creates the lock tables (or adds the lock columns) in the configured database"
  @moduledoc """
  Applies the idempotent DDL of `PhoenixKitAgent.Turns.Locks.Schema` to the
  database the library is configured for (`repo:`, `url:` or `DATABASE_URL`).

      mix locks.setup                 # both tables, if missing
      mix locks.setup --lock-columns  # only the lock columns, for existing tables

  Like `mix locks.held`, it starts the library alone, and stops an ordinary
  error with one line that says what to set or fix.
  """

  use Mix.Task

  @impl true
  def run(args) do
    Mix.Tasks.Locks.Task.run("mix locks.setup", args, [lock_columns: :boolean], fn opts ->
      kind = if opts[:lock_columns], do: :lock_columns, else: :tables
      :ok = PhoenixKitAgent.Turns.Locks.Schema.setup!(kind)
      Mix.shell().info("phoenix_kit_agent_locks: applied #{kind} DDL")
    end)
  end
end
