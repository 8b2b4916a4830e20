defmodule PhoenixKitAgent.Turns.HostAppTest do
  # The library as a host uses it: a throwaway Mix project in a temporary
  # directory depends on this checkout by `path:`, builds it with
  # `mix deps.compile` and `mix compile` alone (the NIF through the
  # library's own Mix compiler), and takes locks with the connection of its
  # own "repo" (`config :phoenix_kit_agent_locks, repo: HostApp.Repo`), no
  # DATABASE_URL; then compiles and runs again, which runs no cargo and
  # prints nothing, also with no cargo at all. Then IEx on the library:
  # `recompile(force: true)` in a running shell keeps the NIF and the locks.
  #
  # cargo runs in this checkout's workspace either way, so both reuse its
  # target/ and cargo has nothing to rebuild; the time goes to the mix
  # commands (Elixir compiling the library again for each project).
  # `async: false`: the compiles take both cores, and run alone.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks.{HostProject, TestDB}

  @moduletag timeout: 600_000

  setup do
    dir = Path.join(System.tmp_dir!(), "locks_host_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir, library: File.cwd!()}
  end

  defp mix!(dir, args, extra_env) do
    {out, status} =
      System.cmd("mix", args, cd: dir, env: HostProject.env(extra_env), stderr_to_stdout: true)

    assert status == 0, "mix #{Enum.join(args, " ")} exited #{status}:\n#{out}"
    refute out =~ "warning:", "mix #{Enum.join(args, " ")} warned:\n#{out}"
    out
  end

  test "a host depending on the library by path: builds it, starts it, takes locks with its repo's connection",
       %{dir: dir, library: library} do
    HostProject.write!(dir, HostProject.files(library, "host-turn"))

    HostProject.write!(dir, %{
      "config/config.exs" => """
      import Config

      # As an Ecto repo is configured; the URL only says where the test
      # database is (HOST_APP_DB), the library is given the repo.
      uri = URI.parse(System.fetch_env!("HOST_APP_DB"))
      [username, password] = String.split(uri.userinfo, ":")

      config :host_app, HostApp.Repo,
        hostname: uri.host,
        port: uri.port,
        username: username,
        password: password,
        database: String.trim_leading(uri.path, "/"),
        ssl: false,
        pool_size: 10

      config :phoenix_kit_agent_locks, repo: HostApp.Repo
      """,
      "lib/host_app/repo.ex" => """
      defmodule HostApp.Repo do
        # Stands in for an Ecto repo: config/0 reads what Ecto's does.
        def config, do: Application.fetch_env!(:host_app, __MODULE__)
      end
      """
    })

    # cargo, as a script that records each call before it runs the real one.
    bin = Path.join(dir, "bin")
    File.mkdir_p!(bin)
    calls = Path.join(dir, "cargo_calls")

    File.write!(Path.join(bin, "cargo"), """
    #!/bin/sh
    echo "$*" >> #{calls}
    exec #{System.find_executable("cargo")} "$@"
    """)

    File.chmod!(Path.join(bin, "cargo"), 0o755)
    db = [{"HOST_APP_DB", TestDB.url()}, {"PATH", bin <> ":" <> System.get_env("PATH")}]

    deps = mix!(dir, ["deps.compile"], db)
    assert deps =~ "Generated phoenix_kit_agent_locks app"

    assert File.exists?(
             Path.join(dir, "_build/dev/lib/phoenix_kit_agent_locks/priv/native/liblocks_nif.so")
           )

    assert mix!(dir, ["compile"], db) =~ "Generated host_app app"

    chat = TestDB.insert_chat!()
    user = TestDB.uuid()
    out = mix!(dir, ["run", "-e", "HostApp.turn(System.argv())", chat, user], db)

    assert HostProject.lines(out, "RESULTS ") == ["RESULTS [:ok, true, :ok, false]"]

    assert TestDB.lock(:chat, chat) == {nil, nil}
    assert TestDB.lock(:user, user) == {nil, nil}

    # Every later command finds the installed library current (its stamp):
    # no cargo run, and nothing printed but the host's own output.
    File.rm(calls)
    assert mix!(dir, ["compile"], db) == ""
    chat = TestDB.insert_chat!()
    out = mix!(dir, ["run", "-e", "HostApp.turn(System.argv())", chat, user], db)
    assert out == "RESULTS [:ok, true, :ok, false]\n"
    assert File.read(calls) == {:error, :enoent}, "cargo ran"

    # And with no cargo at all (not on PATH, no ~/.cargo/bin in HOME).
    path =
      System.get_env("PATH")
      |> String.split(":")
      |> Enum.reject(&File.exists?(Path.join(&1, "cargo")))

    home = Path.join(dir, "home")
    File.mkdir_p!(home)
    no_cargo = [{"PATH", Enum.join(path, ":")}, {"HOME", home}]

    assert System.cmd("sh", ["-c", "command -v cargo || echo none"], env: no_cargo) ==
             {"none\n", 0}

    assert mix!(dir, ["compile"], db ++ no_cargo) == ""
  end

  test "IEx: recompile(force: true) in a running shell keeps the NIF and the locks",
       %{dir: dir, library: library} do
    chat = TestDB.insert_chat!()
    user = TestDB.uuid()

    HostProject.write!(dir, %{
      "input.exs" => """
      chat = #{inspect(chat)}
      user = #{inspect(user)}
      IO.puts("ACQUIRE " <> inspect(PhoenixKitAgent.Turns.Locks.acquire(chat, user, "iex-turn", 60)))
      IO.puts("RECOMPILE " <> inspect(recompile(force: true)))
      IO.puts("HELD " <> inspect(PhoenixKitAgent.Turns.Locks.held?(chat, user, "iex-turn")))
      IO.puts("RELEASE " <> inspect(PhoenixKitAgent.Turns.Locks.release(chat, user, "iex-turn")))
      """
    })

    # This checkout, built in a directory of the test's own; `iex` reads the
    # lines above as if typed, and ends at their end.
    {out, status} =
      System.cmd("sh", ["-c", "iex -S mix < #{Path.join(dir, "input.exs")}"],
        cd: library,
        env:
          HostProject.env([
            {"MIX_BUILD_ROOT", Path.join(dir, "_build")},
            {"DATABASE_URL", TestDB.url()}
          ]),
        stderr_to_stdout: true
      )

    assert status == 0, out

    # IEx prints each answer after its prompt (`iex(3)> HELD true`).
    assert Regex.scan(~r/(?:ACQUIRE|RECOMPILE|HELD|RELEASE) .*$/m, out) |> List.flatten() == [
             "ACQUIRE :ok",
             "RECOMPILE :ok",
             "HELD true",
             "RELEASE :ok"
           ]

    assert TestDB.lock(:chat, chat) == {nil, nil}
  end
end
