defmodule PhoenixKitAgent.Turns.PrebuiltHostTest do
  # A host without Rust. A throwaway Mix project depends by `path:` on a copy
  # of the library as its package ships (mix.exs `package: [files: …]`),
  # whose checksum file lists one artifact: this build's own library, packed
  # as the release workflow packs it and served on loopback by ArtifactServer
  # as the release URL. The host's mix runs with no cargo on PATH and a HOME
  # without ~/.cargo, so the library it loads can only be the artifact; then
  # it takes and releases a lock in the test database.
  #
  # One `mix run`: it compiles the dependency (Elixir, then the NIF
  # compiler), the host, and runs. `async: false`: the compile takes both
  # cores, and runs alone.
  use ExUnit.Case, async: false

  alias Mix.Tasks.Compile.LocksNif.Prebuilt
  alias PhoenixKitAgent.Turns.Locks.{ArtifactServer, HostProject, TestDB}

  @moduletag timeout: 300_000

  setup do
    dir =
      Path.join(System.tmp_dir!(), "locks_prebuilt_host_#{System.unique_integer([:positive])}")

    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir}
  end

  test "a host with no cargo builds the library from a served artifact whose checksum matched, and takes locks",
       %{dir: dir} do
    version = Mix.Project.config()[:version]
    nif = List.to_string(:erlang.system_info(:nif_version))

    {:ok, target} = Prebuilt.target_triple()

    name = Prebuilt.artifact(version, nif, target)

    # The library as its package ships, without target/, _build/ or priv/native/.
    library = Path.join(dir, "phoenix_kit_agent_locks")
    files = Mix.Project.config()[:package][:files]
    checksum_file = Prebuilt.settings(library, %{}).checksum_file
    assert Path.relative_to(checksum_file, library) in files
    assert ".cargo/config.toml" in files

    for path <- files do
      File.mkdir_p!(Path.dirname(Path.join(library, path)))
      File.cp_r!(path, Path.join(library, path))
    end

    refute File.exists?(Path.join(library, "priv/native"))

    # The artifact: this build's library, as the workflow packs it.
    built =
      File.read!(Path.join(:code.priv_dir(:phoenix_kit_agent_locks), "native/liblocks_nif.so"))

    tarball = Path.join(dir, name)
    file = String.trim_trailing(name, ".tar.gz")

    :ok =
      :erl_tar.create(String.to_charlist(tarball), [{String.to_charlist(file), built}], [
        :compressed
      ])

    Mix.Tasks.Locks.Checksum.write_checksums(checksum_file, %{
      name => Prebuilt.checksum(File.read!(tarball))
    })

    url = ArtifactServer.serve!(%{"/v#{version}/#{name}" => File.read!(tarball)})

    HostProject.write!(Path.join(dir, "host"), HostProject.files(library, "prebuilt-turn"))

    cache = Path.join(dir, "cache")
    env = env(dir, [{"LOCKS_NIF_BASE_URL", "#{url}/v#{version}"}, {"LOCKS_NIF_CACHE_DIR", cache}])
    assert System.cmd("sh", ["-c", "command -v cargo || echo none"], env: env) == {"none\n", 0}

    chat = TestDB.insert_chat!()
    user = TestDB.uuid()

    {out, status} =
      System.cmd("mix", ["run", "-e", "HostApp.turn(System.argv())", chat, user],
        cd: Path.join(dir, "host"),
        env: env,
        stderr_to_stdout: true
      )

    assert status == 0, out
    refute out =~ "warning:", out

    assert HostProject.lines(out, "locks_nif: ") == [
             "locks_nif: installed #{name} from #{url}/v#{version}/#{name} (SHA-256 as listed)"
           ]

    assert HostProject.lines(out, "RESULTS ") == ["RESULTS [:ok, true, :ok, false]"]
    assert File.read!(Path.join(library, "priv/native/liblocks_nif.so")) == built
    assert File.read!(Path.join(cache, name)) == File.read!(tarball)
    assert_received {:artifact_request, request}
    assert request == "GET /v#{version}/#{name}"
    refute_received {:artifact_request, _}
    assert TestDB.lock(:chat, chat) == {nil, nil}
  end

  # The environment of the host's mix: its own project and env, the test
  # database, no cargo (PATH without the directories that hold one, HOME
  # without ~/.cargo), and none of the compiler's other switches.
  defp env(dir, extra) do
    path =
      System.get_env("PATH")
      |> String.split(":")
      |> Enum.reject(&File.exists?(Path.join(&1, "cargo")))
      |> Enum.join(":")

    home = Path.join(dir, "home")
    File.mkdir_p!(home)

    HostProject.env(
      [
        {"PATH", path},
        {"HOME", home},
        {"DATABASE_URL", TestDB.url()},
        {"LOCKS_NIF_BUILD", nil},
        {"LOCKS_NIF_TARGET", nil},
        {"CARGO_TARGET_DIR", nil}
      ] ++
        for(name <- ~w(http_proxy HTTP_PROXY https_proxy HTTPS_PROXY), do: {name, nil}) ++ extra
    )
  end
end
