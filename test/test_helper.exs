# The tests run against a real PostgreSQL: DATABASE_URL, or else the project's
# private cluster (scripts/pg), started here and left running for the next run.
unless System.get_env("DATABASE_URL") do
  {out, 0} = System.cmd(Path.expand("scripts/pg"), ["start"])
  [_, url] = Regex.run(~r/DATABASE_URL='([^']+)'/, out)
  System.put_env("DATABASE_URL", url)
  # The application started before this file ran, without a URL.
  :ok = Application.stop(:phoenix_kit_agent_locks)
  {:ok, _} = Application.ensure_all_started(:phoenix_kit_agent_locks)
end

:ok = PhoenixKitAgent.Turns.Locks.Schema.setup!()

ExUnit.start()
