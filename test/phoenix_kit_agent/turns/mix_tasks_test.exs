defmodule PhoenixKitAgent.Turns.MixTasksTest do
  # `mix locks.setup` and `mix locks.held` as a host runs them: in a
  # throwaway Mix project that depends on this checkout by `path:`
  # (HostProject), configured by `url:` from HOST_LOCKS_URL when set. Each
  # ordinary error is one line, `** (Mix) …`, that says what to set or fix:
  # the whole output is asserted, so a stack trace (or the arguments of a NIF
  # call in one) fails the test.
  #
  # `async: false`: the host's first compile takes both cores.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks.{HostProject, TestDB}

  @moduletag timeout: 600_000

  setup_all do
    dir = Path.join(System.tmp_dir!(), "locks_tasks_#{System.unique_integer([:positive])}")
    HostProject.write!(dir, HostProject.files(File.cwd!(), "tasks-turn"))

    HostProject.write!(dir, %{
      "config/config.exs" => """
      import Config

      if url = System.get_env("HOST_LOCKS_URL"), do: config(:phoenix_kit_agent_locks, url: url)
      """
    })

    on_exit(fn -> File.rm_rf!(dir) end)
    {_, 0} = mix(dir, ["compile"], nil)
    %{dir: dir}
  end

  defp mix(dir, args, url) do
    System.cmd("mix", args,
      cd: dir,
      env: HostProject.env([{"HOST_LOCKS_URL", url}]),
      stderr_to_stdout: true
    )
  end

  defp url(parts), do: TestDB.url() |> URI.parse() |> Map.merge(Map.new(parts)) |> URI.to_string()

  @fix "; check the server, user and password that `config :phoenix_kit_agent_locks` " <>
         "(repo: or url:) or DATABASE_URL give"

  test "nothing configured: says what to set", %{dir: dir} do
    for task <- ["locks.setup", "locks.held"] do
      assert mix(dir, [task], nil) ==
               {"** (Mix) mix #{task}: no database configured: set `config :phoenix_kit, " <>
                  "repo: MyApp.Repo` (PhoenixKit's) or `config :phoenix_kit_agent_locks, " <>
                  "repo: MyApp.Repo` (or `url: \"postgres://user:password@host/database\"`) in " <>
                  "config/config.exs, or the DATABASE_URL environment variable\n", 1}
    end
  end

  test "--ttl out of range names the option and the value", %{dir: dir} do
    assert mix(dir, ["locks.held", "--ttl", "0"], TestDB.url()) ==
             {"** (Mix) mix locks.held: --ttl: expected a whole number of seconds from 1 to " <>
                "315360000, got: 0\n", 1}
  end

  test "a wrong password: the server's refusal, the server, and what to check", %{dir: dir} do
    %URI{host: host, port: port} = URI.parse(TestDB.url())
    wrong = url(userinfo: "locks:wr0ng-pw")

    assert mix(dir, ["locks.setup"], wrong) ==
             {"** (Mix) mix locks.setup: database connection failed: #{host}:#{port}: " <>
                ~s{password authentication failed for user "locks" (28P01)} <> @fix <> "\n", 1}
  end

  test "a dead port: the server and the refusal, no NIF call", %{dir: dir} do
    assert mix(dir, ["locks.held"], url(host: "127.0.0.1", port: 1)) ==
             {"** (Mix) mix locks.held: database connection failed: 127.0.0.1:1: " <>
                "Connection refused (os error 111)" <> @fix <> "\n", 1}
  end

  test "a setting the pool cannot use: the setting and the file", %{dir: dir} do
    url = TestDB.url() <> "?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem"

    assert mix(dir, ["locks.held"], url) ==
             {"** (Mix) mix locks.held: invalid configuration: ssl_ca_file: cannot read " <>
                ~s{"/nonexistent/ca.pem": No such file or directory (os error 2)\n}, 1}

    assert mix(dir, ["locks.setup"], "postgres://locks@127.0.0.1:x/locks") ==
             {"** (Mix) mix locks.setup: invalid configuration: url: has a port that is not a number\n",
              1}
  end

  test "locks.held lists a lock dated 'infinity' with an unknown age, stale, and exits 0",
       %{dir: dir} do
    chat = TestDB.uuid()
    ref = "bad-row-#{System.unique_integer([:positive])}"

    on_exit(fn ->
      TestDB.query!("DELETE FROM phoenix_kit_agent_conversations WHERE uuid = '#{chat}'")
    end)

    TestDB.query!(
      TestDB.insert_chats_sql([chat]) <>
        ";\nUPDATE phoenix_kit_agent_conversations SET busy_since = 'infinity', " <>
        "busy_turn_ref = '#{ref}' WHERE uuid = '#{chat}'"
    )

    assert {out, 0} = mix(dir, ["locks.held"], TestDB.url())
    assert out =~ ~r/^chat\s+#{chat}\s+#{ref}\s+-\s+unknown\s+stale\s*$/m
  end

  test "configured: setup applies the DDL", %{dir: dir} do
    assert mix(dir, ["locks.setup"], TestDB.url()) ==
             {"phoenix_kit_agent_locks: applied tables DDL\n", 0}
  end
end
