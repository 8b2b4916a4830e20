defmodule Mix.Tasks.Compile.LocksNif do
  @shortdoc "Installs the locks NIF in priv/native: a prebuilt library, or a cargo build"
  @moduledoc """
  Installs `priv/native/liblocks_nif.so`, prebuilt or built with cargo
  (README.md, "Install"; guides/installing-without-rust.md).
  """

  use Mix.Task.Compiler

  alias Mix.Tasks.Compile.LocksNif.Prebuilt

  @app :phoenix_kit_agent_locks
  @native PhoenixKitAgent.Turns.Locks.Native
  @build_env "LOCKS_NIF_BUILD"

  @impl true
  def run(_args) do
    # The library's directory, also as a dependency (Mix pushes its project).
    root = Path.dirname(Mix.Project.project_file())
    dest = Path.join(Mix.Project.app_path(), "priv/native/liblocks_nif.so")
    # Whether this VM runs a NIF already, from the library about to be replaced.
    running? = :code.is_loaded(@native) != false and @native.loaded()
    stale(compile(settings(root), dest), running?, dest)
  end

  @doc false
  # A new library installed while this VM runs the one it replaces (loaded at
  # its start, or by the compile of the Native module that came first): what
  # runs in this VM runs the old code. A warning, not an error: a `mix compile`
  # or `mix release` that ends here has installed the right library. Public for the tests.
  def stale({:ok, []}, true, dest) do
    message =
      "#{dest} is a new build, but this VM runs the NIF it replaces (rustler cannot " <>
        "replace a loaded NIF): what runs in this VM runs the old native code; " <>
        "run the command again, or restart the VM"

    {:ok, [report(message, :warning)]}
  end

  def stale(result, _running?, _dest), do: result

  # The library and its stamp.
  @impl true
  def clean, do: File.rm_rf(Path.join(Mix.Project.app_path(), "priv/native"))

  @doc false
  # What the compiler decides on; public for the tests, which give their own env and cargo.
  def settings(root, env \\ System.get_env(), config \\ Application.get_all_env(@app)) do
    home_cargo = Path.expand("~/.cargo/bin/cargo")

    %{
      root: root,
      build: build_mode(Prebuilt.var(env, @build_env), config[:build_from_source] == true),
      cargo: System.find_executable("cargo") || if(File.exists?(home_cargo), do: home_cargo),
      profile: Prebuilt.var(env, "LOCKS_NIF_PROFILE") || "release",
      # cargo reads a relative CARGO_TARGET_DIR against its working directory, `root`.
      target_dir: Path.expand(Prebuilt.var(env, "CARGO_TARGET_DIR") || "target", root),
      prebuilt: Prebuilt.settings(root, env)
    }
  end

  # `:prebuilt`, or `{:source, why}` (`why` nil for this repository's own builds).
  defp build_mode(on, _) when on in ["1", "true"], do: {:source, "#{@build_env}=#{on}"}
  defp build_mode(off, _) when off in ["0", "false"], do: :prebuilt
  defp build_mode(nil, true), do: {:source, "config #{inspect(@app)}, build_from_source: true"}

  # :dev and :test are this repository's builds: its Rust, not a release (guides/installing-without-rust.md, "Switches").
  defp build_mode(nil, _), do: if(Mix.env() in [:dev, :test], do: {:source, nil}, else: :prebuilt)

  defp build_mode(other, _),
    do: Mix.raise("#{@build_env}=#{other}: expected 1 or true (build from source), 0 or false")

  @doc false
  # Installs the library at `dest` as `settings` say, or does nothing, silently,
  # when the stamp beside it says it is current. Public for the tests.
  def compile(%{build: build} = settings, dest) do
    expected = if build == :prebuilt, do: Prebuilt.expected(settings.prebuilt)
    # A source build of the same sources is as good as the listed artifact.
    listed = for {:ok, artifact, checksum} <- [expected], do: prebuilt_stamp(artifact, checksum)

    cond do
      current?(dest, [source_stamp(settings) | listed]) ->
        reload_stub()
        {:noop, []}

      build == :prebuilt ->
        from_prebuilt(settings, dest, expected)

      true ->
        {:source, why} = build
        if why, do: Mix.shell().info("locks_nif: building from source (#{why})")
        from_source(settings, dest)
    end
  end

  defp from_prebuilt(%{prebuilt: prebuilt} = settings, dest, expected) do
    case Prebuilt.fetch(prebuilt, expected) do
      {:ok, library, artifact, from, checksum} ->
        with {:ok, []} <- install(library, dest, prebuilt_stamp(artifact, checksum)) do
          Mix.shell().info("locks_nif: installed #{artifact} from #{from} (SHA-256 as listed)")
          {:ok, []}
        end

      {:mismatch, message} ->
        error(message)

      {:error, why} when settings.cargo != nil ->
        Mix.shell().info("locks_nif: no prebuilt library (#{why}); building from source")
        from_source(settings, dest)

      {:error, why} ->
        error(Prebuilt.no_library(prebuilt, expected, why))
    end
  end

  defp from_source(%{cargo: nil}, dest) do
    state = if File.exists?(dest), do: "was built from other sources", else: "is missing"

    error(
      "cargo not found on PATH or in ~/.cargo/bin, and #{dest} #{state}: " <>
        "install Rust (https://rustup.rs) so that cargo is on PATH"
    )
  end

  defp from_source(settings, dest) do
    # Hashed before cargo reads them: a file changed meanwhile rebuilds next time.
    stamp = source_stamp(settings)
    release = if settings.profile == "release", do: ["--release"], else: []
    args = ["build", "--package", "locks_nif", "--locked"] ++ release
    opts = [cd: settings.root, stderr_to_stdout: true, into: IO.stream(:stdio, :line)]
    dir = Path.join(settings.target_dir, settings.profile)

    # liblocks_nif.dylib on macOS.
    with {_, 0} <- System.cmd(settings.cargo, args, opts),
         [built | _] <- Path.wildcard(Path.join(dir, "liblocks_nif.{so,dylib}")) do
      install(File.read!(built), dest, stamp)
    else
      {_, status} -> error("cargo build failed (exit #{status})")
      [] -> error("cargo built no liblocks_nif in #{dir}")
    end
  end

  ## The stamp: what the installed library was made from

  # `liblocks_nif.so.stamp` beside the library names what it was installed
  # from (the SHA-256 of the Rust sources and the profile, or the listed
  # artifact and its checksum) and the SHA-256 of the library itself. While
  # both still hold, compiling again runs no cargo, downloads nothing and
  # prints nothing (README, "Install").
  defp stamp(from, library), do: "#{from}\nlibrary #{Prebuilt.checksum(library)}\n"

  defp prebuilt_stamp(artifact, checksum), do: "prebuilt #{artifact} #{checksum}"

  defp current?(dest, froms) do
    with {:ok, stamp} <- File.read(dest <> ".stamp"),
         {:ok, library} <- File.read(dest),
         do: stamp in Enum.map(froms, &stamp(&1, library)),
         else: (_ -> false)
  end

  # A source build's: the SHA-256 of what cargo builds the library from,
  # every file under native/ (but a target/ directory), the workspace's
  # Cargo.toml and Cargo.lock, .cargo/config.toml and a rust-toolchain file,
  # by relative path and content (the external term format frames each),
  # and the profile.
  defp source_stamp(%{root: root, profile: profile}) do
    workspace = ~w(Cargo.toml Cargo.lock .cargo/config.toml rust-toolchain rust-toolchain.toml)

    root
    |> Path.join("native/**")
    |> Path.wildcard(match_dot: true)
    |> Enum.map(&Path.relative_to(&1, root))
    |> Enum.reject(&("target" in Path.split(&1)))
    |> Enum.concat(workspace)
    |> Enum.filter(&File.regular?(Path.join(root, &1)))
    |> Enum.sort()
    |> Enum.map(&{&1, File.read!(Path.join(root, &1))})
    |> :erlang.term_to_binary()
    |> Prebuilt.checksum()
    |> then(&"sources #{&1} #{profile}")
  end

  @doc false
  # Public for its test. Never into the installed file: a VM that loaded it
  # maps it, and would crash; renamed over, it lives on while a VM maps it.
  # The stamp, naming `from`, is written after the library (best effort: a
  # stamp that cannot be written costs a cargo run next time).
  def install(library, dest, from) do
    result =
      with false <- File.read(dest) == {:ok, library},
           :ok <- Prebuilt.write_beside(dest, library) do
        reload_stub()
        {:ok, []}
      else
        true -> {:noop, []}
        {:error, reason} -> error("cannot install #{dest}: #{:file.format_error(reason)}")
      end

    with {_, []} <- result, do: Prebuilt.write_beside(dest <> ".stamp", stamp(from, library))

    result
  end

  # The first compile loads the stub before the library exists: load it again so
  # its @on_load finds the library. One that runs the NIF stays (no NIF upgrade).
  # load_file/1 refuses while old code is left (purged first); the stub it
  # replaces becomes the old code, which runs in no process.
  defp reload_stub do
    if :code.is_loaded(@native) != false and not @native.loaded() do
      :code.purge(@native)
      {:module, @native} = :code.load_file(@native)
    end
  end

  defp error(message), do: {:error, [report(message, :error)]}

  # Printed, and returned as the compiler's diagnostic.
  defp report(message, severity) do
    label = if severity == :warning, do: "warning: "
    Mix.shell().error("locks_nif: #{label}#{message}")
    where = [compiler_name: "locks_nif", file: "native/locks_nif", position: nil]
    struct!(Mix.Task.Compiler.Diagnostic, where ++ [message: message, severity: severity])
  end
end
