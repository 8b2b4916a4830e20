defmodule PhoenixKitAgent.Turns.PrebuiltTest do
  # The Mix compiler's choice between a prebuilt library and cargo, driven
  # through `compile/2` with settings of the test's own: a library directory
  # with its checksum file, a cache directory, a loopback server
  # (ArtifactServer) for the release, a fake cargo, and a destination in a
  # temporary directory. The artifacts here hold a few bytes, not a library:
  # what is installed is compared byte for byte. prebuilt_host_test.exs runs
  # a real one in a host project.
  #
  # `async: false`: Mix's shell is switched to Mix.Shell.Process (global) to
  # read the compiler's messages, and downloads share one :httpc profile.
  use ExUnit.Case, async: false

  alias Mix.Tasks.Compile.LocksNif
  alias Mix.Tasks.Compile.LocksNif.Prebuilt
  alias PhoenixKitAgent.Turns.Locks.ArtifactServer

  @target "x86_64-unknown-linux-gnu"
  @nif List.to_string(:erlang.system_info(:nif_version))
  @version Mix.Project.config()[:version]
  @checksum_file "checksum-Elixir.PhoenixKitAgent.Turns.Locks.Native.exs"

  setup do
    dir = Path.join(System.tmp_dir!(), "locks_prebuilt_#{System.unique_integer([:positive])}")
    File.mkdir_p!(Path.join(dir, "library"))
    File.mkdir_p!(Path.join(dir, "bin"))
    on_exit(fn -> File.rm_rf!(dir) end)

    shell = Mix.shell()
    Mix.shell(Mix.Shell.Process)
    on_exit(fn -> Mix.shell(shell) end)

    # Stands in for cargo: records its arguments and "builds" the library
    # where the compiler looks for a release build.
    cargo = Path.join(dir, "bin/cargo")

    File.write!(cargo, """
    #!/bin/sh
    printf '%s\\n' "$*" >> #{Path.join(dir, "cargo_calls")}
    mkdir -p target/release
    printf 'built by cargo' > target/release/liblocks_nif.so
    """)

    File.chmod!(cargo, 0o755)

    name = Prebuilt.artifact(@version, @nif, @target)
    tarball = tarball!(dir, String.trim_trailing(name, ".tar.gz"), "prebuilt library")

    %{
      dir: dir,
      library: Path.join(dir, "library"),
      cache: Path.join(dir, "cache"),
      dest: Path.join(dir, "priv/native/liblocks_nif.so"),
      cargo: cargo,
      name: name,
      tarball: tarball
    }
  end

  # An artifact as the release workflow packs one: a gzipped tar holding
  # one file named as the artifact without `.tar.gz`.
  defp tarball!(dir, file, bytes) do
    path = Path.join(dir, "#{file}.tar.gz")

    :ok =
      :erl_tar.create(String.to_charlist(path), [{String.to_charlist(file), bytes}], [:compressed])

    File.read!(path)
  end

  # The compiler's settings for the test's library directory: the prebuilt
  # library preferred, unless `env` says otherwise.
  defp settings(ctx, env, cargo) do
    env =
      Map.merge(
        %{
          "LOCKS_NIF_BUILD" => "0",
          "LOCKS_NIF_CACHE_DIR" => ctx.cache,
          "LOCKS_NIF_TARGET" => @target,
          "LOCKS_NIF_BASE_URL" => "http://127.0.0.1:9/v#{@version}"
        },
        env
      )

    %{LocksNif.settings(ctx.library, env, []) | cargo: cargo}
  end

  defp list!(ctx, checksums),
    do:
      Mix.Tasks.Locks.Checksum.write_checksums(Path.join(ctx.library, @checksum_file), checksums)

  defp cargo_calls(ctx) do
    case File.read(Path.join(ctx.dir, "cargo_calls")) do
      {:ok, calls} -> String.split(calls, "\n", trim: true)
      {:error, :enoent} -> []
    end
  end

  defp messages do
    receive do
      {:mix_shell, kind, [message]} -> [{kind, message} | messages()]
    after
      0 -> []
    end
  end

  defp requests do
    receive do
      {:artifact_request, request} -> [request | requests()]
    after
      0 -> []
    end
  end

  describe "artifacts" do
    test "are named as rustler_precompiled names them" do
      assert Prebuilt.artifact("0.1.0", "2.16", "x86_64-unknown-linux-gnu") ==
               "liblocks_nif-v0.1.0-nif-2.16-x86_64-unknown-linux-gnu.so.tar.gz"

      assert Prebuilt.artifact("0.1.0", "2.17", "aarch64-apple-darwin") ==
               "liblocks_nif-v0.1.0-nif-2.17-aarch64-apple-darwin.so.tar.gz"
    end

    test "the target is the Rust triple of the VM's system architecture" do
      assert Enum.map(
               [
                 "x86_64-pc-linux-gnu",
                 "x86_64-unknown-linux-gnu",
                 "aarch64-unknown-linux-gnu",
                 "x86_64-alpine-linux-musl",
                 "aarch64-alpine-linux-musl",
                 "x86_64-pc-linux-musl",
                 "aarch64-unknown-linux-musl",
                 "x86_64-apple-darwin22.4.0",
                 "aarch64-apple-darwin23.4.0",
                 "armv7l-unknown-linux-gnueabihf",
                 "x86_64-pc-freebsd13.2"
               ],
               &Prebuilt.target_triple/1
             ) == [
               {:ok, "x86_64-unknown-linux-gnu"},
               {:ok, "x86_64-unknown-linux-gnu"},
               {:ok, "aarch64-unknown-linux-gnu"},
               {:ok, "x86_64-unknown-linux-musl"},
               {:ok, "aarch64-unknown-linux-musl"},
               {:ok, "x86_64-unknown-linux-musl"},
               {:ok, "aarch64-unknown-linux-musl"},
               {:ok, "x86_64-apple-darwin"},
               {:ok, "aarch64-apple-darwin"},
               {:error,
                "no Rust target known for the system architecture armv7l-unknown-linux-gnueabihf"},
               {:error, "no Rust target known for the system architecture x86_64-pc-freebsd13.2"}
             ]
    end

    test "the release workflow builds every target and NIF version the compiler looks for" do
      workflow = File.read!(".github/workflows/release.yml")

      assert Regex.scan(~r/^\s+- target: (\S+)$/m, workflow, capture: :all_but_first)
             |> List.flatten()
             |> Enum.sort() == Prebuilt.targets()

      assert [nifs] = Regex.run(~r/^\s+nif: \[(.*)\]$/m, workflow, capture: :all_but_first)

      assert nifs |> String.split(", ") |> Enum.map(&String.trim(&1, "\"")) ==
               Prebuilt.nif_versions()
    end
  end

  describe "the checksum file" do
    test "lists SHA-256 checksums in lower-case hex" do
      assert Prebuilt.checksum("") ==
               "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    end

    test "is written in name order, one artifact a line, and read back", %{dir: dir} do
      path = Path.join(dir, @checksum_file)

      :ok =
        Mix.Tasks.Locks.Checksum.write_checksums(path, %{
          "b.tar.gz" => "sha256:02",
          "a.tar.gz" => "sha256:01"
        })

      assert File.read!(path) == """
             %{
               "a.tar.gz" => "sha256:01",
               "b.tar.gz" => "sha256:02"
             }
             """

      assert Prebuilt.read_checksums(path) ==
               {:ok, %{"a.tar.gz" => "sha256:01", "b.tar.gz" => "sha256:02"}}
    end

    test "is read as data, never run", %{dir: dir} do
      path = Path.join(dir, @checksum_file)
      File.write!(path, ~s|%{"a.tar.gz" => File.write!("ran", "yes")}\n|)

      assert Prebuilt.read_checksums(path) ==
               {:error, "#{path} is not a map of artifact names to \"sha256:…\" checksums"}

      refute File.exists?("ran")
    end
  end

  describe "a prebuilt library" do
    test "is downloaded from the release, verified, installed and kept in the cache", ctx do
      list!(ctx, %{ctx.name => Prebuilt.checksum(ctx.tarball)})
      url = ArtifactServer.serve!(%{"/v#{@version}/#{ctx.name}" => ctx.tarball})
      settings = settings(ctx, %{"LOCKS_NIF_BASE_URL" => "#{url}/v#{@version}"}, ctx.cargo)

      assert LocksNif.compile(settings, ctx.dest) == {:ok, []}
      assert File.read!(ctx.dest) == "prebuilt library"
      assert File.read!(Path.join(ctx.cache, ctx.name)) == ctx.tarball
      assert requests() == ["GET /v#{@version}/#{ctx.name}"]

      assert messages() == [
               {:info,
                "locks_nif: installed #{ctx.name} from #{url}/v#{@version}/#{ctx.name} (SHA-256 as listed)"}
             ]

      # Again: the stamp beside it says it is the listed artifact, so the
      # cache is not even read (deleted here), and nothing is printed.
      File.rm_rf!(ctx.cache)
      assert LocksNif.compile(settings, ctx.dest) == {:noop, []}
      assert requests() == []
      assert messages() == []
      assert cargo_calls(ctx) == []

      # Another listed checksum (another release) is no longer what was installed.
      list!(ctx, %{ctx.name => "sha256:" <> String.duplicate("0", 64)})

      assert {:error, [%{message: "checksum mismatch for " <> _}]} =
               LocksNif.compile(settings, ctx.dest)
    end

    test "is taken from the cache with the server stopped", ctx do
      list!(ctx, %{ctx.name => Prebuilt.checksum(ctx.tarball)})
      {url, server} = ArtifactServer.start(%{"/v#{@version}/#{ctx.name}" => ctx.tarball})
      settings = settings(ctx, %{"LOCKS_NIF_BASE_URL" => "#{url}/v#{@version}"}, nil)
      assert LocksNif.compile(settings, Path.join(ctx.dir, "first.so")) == {:ok, []}
      assert requests() == ["GET /v#{@version}/#{ctx.name}"]
      _ = messages()

      :ok = ArtifactServer.stop(server)
      assert {:error, _} = :gen_tcp.connect(~c"127.0.0.1", URI.parse(url).port, [])

      assert LocksNif.compile(settings, ctx.dest) == {:ok, []}
      assert File.read!(ctx.dest) == "prebuilt library"

      assert messages() == [
               {:info,
                "locks_nif: installed #{ctx.name} from #{Path.join(ctx.cache, ctx.name)} (SHA-256 as listed)"}
             ]
    end

    test "is downloaded through the proxy of http_proxy", ctx do
      list!(ctx, %{ctx.name => Prebuilt.checksum(ctx.tarball)})
      # The release's host does not resolve: only the proxy can answer.
      proxy = ArtifactServer.serve!(%{"/v#{@version}/#{ctx.name}" => ctx.tarball})

      settings =
        settings(
          ctx,
          %{"LOCKS_NIF_BASE_URL" => "http://release.invalid/v#{@version}", "http_proxy" => proxy},
          nil
        )

      assert LocksNif.compile(settings, ctx.dest) == {:ok, []}
      assert File.read!(ctx.dest) == "prebuilt library"
      assert requests() == ["GET http://release.invalid/v#{@version}/#{ctx.name}"]
    end

    # The TLS alerts are logged: kept out of the test output.
    @tag :capture_log
    test "is not downloaded from an HTTPS server the system's CA certificates do not vouch for" do
      # A server certificate from a CA of the test's own (one no system trusts).
      key = [key: {:namedCurve, :secp256r1}]

      # :ssl runs already: test_helper.exs starts it.
      %{server_config: tls} =
        :public_key.pkix_test_data(%{
          server_chain: %{root: key, intermediates: [], peer: key},
          client_chain: %{root: key, intermediates: [], peer: key}
        })

      {:ok, listen} = :ssl.listen(0, [ip: {127, 0, 0, 1}, active: false] ++ tls)
      {:ok, {_, port}} = :ssl.sockname(listen)
      test = self()

      spawn_link(fn ->
        {:ok, socket} = :ssl.transport_accept(listen)
        send(test, {:handshake, :ssl.handshake(socket, 5_000)})
      end)

      url = "https://localhost:#{port}/#{Prebuilt.artifact(@version, @nif, @target)}"

      # Refused by a TLS alert, on both sides. Which alert is OTP's choice
      # (unknown_ca on OTP 25, handshake_failure on OTP 27): not asserted.
      assert {:error, "GET " <> failed} = Prebuilt.download(url, [])
      assert failed =~ ~r/^\Q#{url}\E failed: cannot connect: TLS alert [a-z_]+$/
      assert_receive {:handshake, {:error, {:tls_alert, {alert, _}}}} when is_atom(alert)
      :ssl.close(listen)
    end

    test "whose download does not match the checksum file stops the build: both hashes, nothing installed",
         ctx do
      listed = Prebuilt.checksum(ctx.tarball)
      list!(ctx, %{ctx.name => listed})
      tampered = tarball!(ctx.dir, String.trim_trailing(ctx.name, ".tar.gz"), "tampered library")
      url = ArtifactServer.serve!(%{"/v#{@version}/#{ctx.name}" => tampered})
      # cargo is there, and must not be used instead.
      settings = settings(ctx, %{"LOCKS_NIF_BASE_URL" => "#{url}/v#{@version}"}, ctx.cargo)

      message = """
      checksum mismatch for #{ctx.name} from #{url}/v#{@version}/#{ctx.name}:
        expected #{listed} (#{@checksum_file})
        got      #{Prebuilt.checksum(tampered)}
      Nothing was installed. The download is not the artifact the release published.\
      """

      assert {:error, [%Mix.Task.Compiler.Diagnostic{message: ^message, severity: :error}]} =
               LocksNif.compile(settings, ctx.dest)

      assert messages() == [{:error, "locks_nif: " <> message}]
      refute File.exists?(Path.dirname(ctx.dest))
      refute File.exists?(ctx.cache)
      assert cargo_calls(ctx) == []
    end

    test "whose cached artifact does not match the checksum file stops the build too", ctx do
      listed = Prebuilt.checksum(ctx.tarball)
      list!(ctx, %{ctx.name => listed})
      tampered = tarball!(ctx.dir, String.trim_trailing(ctx.name, ".tar.gz"), "tampered library")
      cached = Path.join(ctx.cache, ctx.name)
      File.mkdir_p!(ctx.cache)
      File.write!(cached, tampered)

      message = """
      checksum mismatch for #{ctx.name} from #{cached}:
        expected #{listed} (#{@checksum_file})
        got      #{Prebuilt.checksum(tampered)}
      Nothing was installed. Delete #{cached} to download the artifact again.\
      """

      assert {:error, [%{message: ^message}]} =
               LocksNif.compile(settings(ctx, %{}, ctx.cargo), ctx.dest)

      refute File.exists?(ctx.dest)
      assert cargo_calls(ctx) == []
    end
  end

  describe "cargo" do
    test "builds the library when the checksum file lists nothing for the target", ctx do
      list!(ctx, %{ctx.name => Prebuilt.checksum(ctx.tarball)})
      url = ArtifactServer.serve!(%{"/v#{@version}/#{ctx.name}" => ctx.tarball})

      settings =
        settings(
          ctx,
          %{
            "LOCKS_NIF_TARGET" => "riscv64gc-unknown-linux-gnu",
            "LOCKS_NIF_BASE_URL" => "#{url}/v#{@version}"
          },
          ctx.cargo
        )

      assert LocksNif.compile(settings, ctx.dest) == {:ok, []}
      assert File.read!(ctx.dest) == "built by cargo"
      assert cargo_calls(ctx) == ["build --package locks_nif --locked --release"]
      assert requests() == []

      assert messages() == [
               {:info,
                "locks_nif: no prebuilt library (#{@checksum_file} lists no artifact of version " <>
                  "#{@version} for riscv64gc-unknown-linux-gnu and NIF version #{@nif}); building from source"}
             ]
    end

    test "builds the library when the download fails", ctx do
      list!(ctx, %{ctx.name => Prebuilt.checksum(ctx.tarball)})
      url = ArtifactServer.serve!(%{})
      settings = settings(ctx, %{"LOCKS_NIF_BASE_URL" => "#{url}/v#{@version}"}, ctx.cargo)

      assert LocksNif.compile(settings, ctx.dest) == {:ok, []}
      assert File.read!(ctx.dest) == "built by cargo"
      assert cargo_calls(ctx) == ["build --package locks_nif --locked --release"]
      assert requests() == ["GET /v#{@version}/#{ctx.name}"]

      assert messages() == [
               {:info,
                "locks_nif: no prebuilt library (#{ctx.name} is not in #{ctx.cache}, and " <>
                  "GET #{url}/v#{@version}/#{ctx.name} answered 404 Not Found); building from source"}
             ]
    end

    test "LOCKS_NIF_BUILD=1 builds from source without asking for an artifact", ctx do
      list!(ctx, %{ctx.name => Prebuilt.checksum(ctx.tarball)})
      url = ArtifactServer.serve!(%{"/v#{@version}/#{ctx.name}" => ctx.tarball})

      settings =
        settings(
          ctx,
          %{"LOCKS_NIF_BUILD" => "1", "LOCKS_NIF_BASE_URL" => "#{url}/v#{@version}"},
          ctx.cargo
        )

      assert LocksNif.compile(settings, ctx.dest) == {:ok, []}
      assert File.read!(ctx.dest) == "built by cargo"
      assert cargo_calls(ctx) == ["build --package locks_nif --locked --release"]
      assert requests() == []
      assert messages() == [{:info, "locks_nif: building from source (LOCKS_NIF_BUILD=1)"}]
    end

    test "with neither an artifact nor cargo, the error names what was looked for and the ways out",
         ctx do
      list!(ctx, %{ctx.name => Prebuilt.checksum(ctx.tarball)})
      {url, server} = ArtifactServer.start(%{})
      :ok = ArtifactServer.stop(server)
      settings = settings(ctx, %{"LOCKS_NIF_BASE_URL" => "#{url}/v#{@version}"}, nil)

      message = """
      no library for target #{@target} and NIF version #{@nif}:
        prebuilt: #{ctx.name} is not in #{ctx.cache}, and GET #{url}/v#{@version}/#{ctx.name} failed: cannot connect: connection refused
        from source: cargo not found on PATH or in ~/.cargo/bin
      Either install Rust (https://rustup.rs) so that cargo is on PATH, or put #{ctx.name} \
      (as listed in #{@checksum_file}) in a directory and set LOCKS_NIF_CACHE_DIR to it.\
      """

      assert {:error, [%{message: ^message}]} = LocksNif.compile(settings, ctx.dest)
      refute File.exists?(ctx.dest)
    end

    test "with no artifact listed and no cargo, the error offers Rust alone (no cache could help)",
         ctx do
      list!(ctx, %{})
      settings = settings(ctx, %{}, nil)

      message = """
      no library for target #{@target} and NIF version #{@nif}:
        prebuilt: #{@checksum_file} lists no artifact of version #{@version} for #{@target} and NIF version #{@nif}
        from source: cargo not found on PATH or in ~/.cargo/bin
      Install Rust (https://rustup.rs) so that cargo is on PATH.\
      """

      assert {:error, [%{message: ^message}]} = LocksNif.compile(settings, ctx.dest)
      assert requests() == []
    end
  end

  describe "settings" do
    test "the switch: from source in this repository's dev and test builds, unless LOCKS_NIF_BUILD=0",
         %{library: library} do
      assert LocksNif.settings(library, %{}, []).build == {:source, nil}
      assert LocksNif.settings(library, %{"LOCKS_NIF_BUILD" => ""}, []).build == {:source, nil}
      assert LocksNif.settings(library, %{"LOCKS_NIF_BUILD" => "0"}, []).build == :prebuilt
      assert LocksNif.settings(library, %{"LOCKS_NIF_BUILD" => "false"}, []).build == :prebuilt

      assert LocksNif.settings(library, %{"LOCKS_NIF_BUILD" => "true"}, []).build ==
               {:source, "LOCKS_NIF_BUILD=true"}

      assert LocksNif.settings(library, %{}, build_from_source: true).build ==
               {:source, "config :phoenix_kit_agent_locks, build_from_source: true"}

      assert_raise Mix.Error,
                   "LOCKS_NIF_BUILD=yes: expected 1 or true (build from source), 0 or false",
                   fn -> LocksNif.settings(library, %{"LOCKS_NIF_BUILD" => "yes"}, []) end
    end

    test "the application's configuration accepts build_from_source" do
      assert {:ok, %PhoenixKitAgent.Turns.Locks.Config{hostname: "localhost", database: "db"}} =
               PhoenixKitAgent.Turns.Locks.Config.read(
                 url: "postgres://u@localhost/db",
                 build_from_source: true
               )
    end

    test "defaults, and the environment variables that override them", %{library: library} do
      {:ok, target} = Prebuilt.target_triple()

      assert LocksNif.settings(library, %{}, []).prebuilt == %{
               version: @version,
               target: {:ok, target},
               nif_version: @nif,
               checksum_file: Path.join(library, @checksum_file),
               cache_dir: :filename.basedir(:user_cache, "phoenix_kit_agent_locks"),
               base_url:
                 "https://github.com/your-org/phoenix_kit_agent_locks/releases/download/v#{@version}",
               proxy: []
             }

      env = %{
        "LOCKS_NIF_CACHE_DIR" => "/srv/artifacts",
        "LOCKS_NIF_BASE_URL" => "https://mirror.example/locks/",
        "LOCKS_NIF_TARGET" => "aarch64-unknown-linux-musl",
        "HTTPS_PROXY" => "proxy.example:3128"
      }

      assert %{
               cache_dir: "/srv/artifacts",
               base_url: "https://mirror.example/locks",
               target: {:ok, "aarch64-unknown-linux-musl"},
               proxy: [https_proxy: {{~c"proxy.example", 3128}, []}]
             } = LocksNif.settings(library, env, []).prebuilt
    end

    test "proxies: lower-case names first, no_proxy as exceptions, no_proxy=* turns them off" do
      assert Prebuilt.proxy_options(%{
               "http_proxy" => "http://lower:8080",
               "HTTP_PROXY" => "http://upper:8080",
               "HTTPS_PROXY" => "http://secure:3128",
               "NO_PROXY" => "localhost, .internal,127.0.0.1"
             }) == [
               proxy:
                 {{~c"lower", 8080},
                  [~c"localhost", ~c"*.localhost", ~c"*.internal", ~c"127.0.0.1"]},
               https_proxy:
                 {{~c"secure", 3128},
                  [~c"localhost", ~c"*.localhost", ~c"*.internal", ~c"127.0.0.1"]}
             ]

      assert Prebuilt.proxy_options(%{
               "HTTPS_PROXY" => "http://proxy.internal:3128",
               "no_proxy" => "10.0.0.1,.corp"
             }) == [https_proxy: {{~c"proxy.internal", 3128}, [~c"10.0.0.1", ~c"*.corp"]}]

      assert Prebuilt.proxy_options(%{"http_proxy" => "http://p:1", "no_proxy" => "*"}) == []
    end
  end

  describe "mix locks.checksum" do
    setup %{dir: dir} do
      names =
        for target <- Prebuilt.targets(),
            nif <- Prebuilt.nif_versions(),
            do: Prebuilt.artifact(@version, nif, target)

      artifacts = Path.join(dir, "artifacts")
      File.mkdir_p!(artifacts)
      for name <- names, do: File.write!(Path.join(artifacts, name), "artifact #{name}")

      # The task writes the file in the current directory, the project's root.
      cwd = File.cwd!()
      File.cd!(Path.join(dir, "library"))
      on_exit(fn -> File.cd!(cwd) end)

      expected =
        "%{\n" <>
          Enum.map_join(Enum.sort(names), ",\n", fn name ->
            ~s(  "#{name}" => "#{Prebuilt.checksum("artifact #{name}")}")
          end) <> "\n}\n"

      %{names: names, artifacts: artifacts, expected: expected}
    end

    test "--dir: writes the checksum of every target and NIF version", ctx do
      assert length(ctx.names) == 12
      Mix.Tasks.Locks.Checksum.run(["--dir", ctx.artifacts])

      assert File.read!(Path.join(ctx.library, @checksum_file)) == ctx.expected

      assert messages() == [
               {:info, "wrote #{@checksum_file}: 12 artifacts of version #{@version}"}
             ]
    end

    test "downloads them from the release's base URL", ctx do
      files = Map.new(ctx.names, fn name -> {"/v#{@version}/#{name}", "artifact #{name}"} end)

      url = ArtifactServer.serve!(files)
      System.put_env("LOCKS_NIF_BASE_URL", "#{url}/v#{@version}")
      on_exit(fn -> System.delete_env("LOCKS_NIF_BASE_URL") end)

      Mix.Tasks.Locks.Checksum.run([])

      assert File.read!(Path.join(ctx.library, @checksum_file)) == ctx.expected
      assert Enum.sort(requests()) == Enum.sort(Enum.map(ctx.names, &"GET /v#{@version}/#{&1}"))
    end

    test "an artifact missing stops it and leaves the file as it was", ctx do
      [missing | _] = ctx.names
      File.rm!(Path.join(ctx.artifacts, missing))
      File.write!(Path.join(ctx.library, @checksum_file), "%{}\n")

      assert_raise Mix.Error,
                   "1 of 12 artifacts are missing; #{@checksum_file} is left as it was:\n" <>
                     "  #{missing}: cannot read #{Path.join(ctx.artifacts, missing)}: no such file or directory",
                   fn -> Mix.Tasks.Locks.Checksum.run(["--dir", ctx.artifacts]) end

      assert File.read!(Path.join(ctx.library, @checksum_file)) == "%{}\n"
    end
  end
end
