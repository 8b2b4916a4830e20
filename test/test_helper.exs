# The tests run against a real PostgreSQL: DATABASE_URL, or else the project's
# private cluster (scripts/pg), started here and left running for the next run
# (scripts/test starts and stops it itself, with every cluster of its run).
#
# LOCKS_TEST_VIA says how the library reaches it:
#
#   * `direct` (the default): the `locks` database, with the shipped tables;
#   * `pgbouncer_transaction` / `pgbouncer_session`: through Debian's PgBouncer
#     in that pool mode (scripts/pg bouncer), on a database of its own,
#     `locks_ecto`, whose tables are made as a host's Ecto migrations make them
#     (TestDB.ecto_tables/2) and whose sessions start in Asia/Tokyo: the
#     contract suite (test/phoenix_kit_agent/turns/locks) runs there with
#     `prepare: :unnamed` in transaction mode and named statements in session
#     mode. The SQL of the tests' own goes to the database directly.
alias PhoenixKitAgent.Turns.Locks.{Schema, TestDB}

# The project lists no TLS application (mix.exs); the tests of the download
# speak TLS themselves, and Mix (Elixir 1.15 on) left them off the code path.
:ok = Mix.Tasks.Compile.LocksNif.Prebuilt.ensure_started([:ssl])

app = :phoenix_kit_agent_locks
pg = fn args -> System.cmd(Path.expand("scripts/pg"), args) end

unless System.get_env("DATABASE_URL") do
  {out, 0} = pg.(["start"])
  [_, url] = Regex.run(~r/DATABASE_URL='([^']+)'/, out)
  System.put_env("DATABASE_URL", url)
end

case System.get_env("LOCKS_TEST_VIA", "direct") do
  "direct" ->
    :ok

  via when via in ["pgbouncer_transaction", "pgbouncer_session"] ->
    {out, 0} = pg.(["bouncer"])
    mode = via |> String.replace_prefix("pgbouncer_", "") |> String.upcase()
    [_, bouncer] = Regex.run(~r/LOCKS_PGBOUNCER_#{mode}_URL='([^']+)'/, out)
    in_db = fn url -> url |> URI.parse() |> Map.put(:path, "/locks_ecto") |> URI.to_string() end

    # On one-off sessions of the `locks` database: TestDB's shared session
    # opens at its first query, which must find DATABASE_URL naming locks_ecto.
    admin = TestDB.url()
    TestDB.query!("DROP DATABASE IF EXISTS locks_ecto WITH (FORCE)", admin)
    TestDB.query!("CREATE DATABASE locks_ecto", admin)
    TestDB.query!("ALTER DATABASE locks_ecto SET timezone TO 'Asia/Tokyo'", admin)
    System.put_env("DATABASE_URL", in_db.(admin))
    System.put_env("LOCKS_TEST_TABLES", "ecto")
    TestDB.query!(TestDB.ecto_tables(), TestDB.url())

    Application.put_env(app, :url, in_db.(bouncer))
    Application.put_env(app, :prepare, if(mode == "TRANSACTION", do: :unnamed, else: :named))
end

# The application started before this file ran, with what was set then.
:ok = Application.stop(app)
{:ok, _} = Application.ensure_all_started(app)
if TestDB.tables() == :shipped, do: :ok = Schema.setup!()

ExUnit.start()
