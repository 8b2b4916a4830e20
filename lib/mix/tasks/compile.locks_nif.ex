defmodule Mix.Tasks.Compile.LocksNif do
  @shortdoc "Installs the locks NIF in priv/native: a prebuilt library, or a cargo build"
  @moduledoc """
  Installs the NIF library of `PhoenixKitAgent.Turns.Locks.Native` as
  `priv/native/liblocks_nif.so` of the application: a prebuilt one when an
  artifact for this VM is listed in the checksum file, else one built from
  `native/locks_nif` with `cargo build --release`.

  Declared in `mix.exs` after Elixir's compilers (this module is one of the
  files they compile), so `mix compile` in this project, and `mix
  deps.compile` / `mix compile` in a host that depends on it by `path:` or
  `git:`, install everything with no other step.

  ## Prebuilt or from source

  A host (which compiles its dependencies with `MIX_ENV=prod`) gets the
  prebuilt library: `Mix.Tasks.Compile.LocksNif.Prebuilt` looks for it in the
  cache directory, then at the release's URL, and checks its SHA-256 against
  the checksum file committed with the library. Then cargo is not needed.

  It builds from source with cargo instead when:

    * `LOCKS_NIF_BUILD=1` (or `true`) is set, or `config
      :phoenix_kit_agent_locks, build_from_source: true` in the host's
      config;
    * the library is built in its own repository (`MIX_ENV` `dev` or
      `test`), so that what runs is the checkout's Rust code;
      `LOCKS_NIF_BUILD=0` (or `false`) asks for the prebuilt library there
      too;
    * no artifact fits (no target for this system, none listed, the
      download failed) and cargo is installed; when it is not, the build
      stops with an error that says what was looked for and the two ways
      out.

  A checksum mismatch is never a reason to build another way: the build
  stops, prints both hashes, and installs nothing.

  ## Building from source

  cargo is incremental: with nothing changed it is a no-op. It runs in the
  library's own directory (its workspace), so its `target/` is reused by
  every project that depends on the same checkout; `CARGO_TARGET_DIR` moves
  it (relative to the library's directory). `LOCKS_NIF_PROFILE=debug` makes
  a debug build. cargo is looked for on `PATH`, then in `~/.cargo/bin`.

  ## Installing

  For a dependency, Mix links the application's `priv` in `_build` to the
  library's own `priv`, so the library lands in the dependency's source
  directory (`deps/phoenix_kit_agent_locks/priv/native` for a `git:`
  dependency, the checkout itself for a `path:` one), as it does for this
  project; `mix release` copies it from there.

  An installed library is never written over: the new one is written
  beside it and renamed into place, so a VM that has the old one loaded
  keeps running its code, and a VM that loads the library at the same
  moment sees either file whole. Installing the same bytes again is a
  no-op. A running VM never switches to new native code (rustler NIFs
  cannot be upgraded): restart it. If the stub module was loaded before the
  library existed (the first compile), it is reloaded so that this VM gets
  the NIF too.
  """

  use Mix.Task.Compiler

  alias Mix.Tasks.Compile.LocksNif.Prebuilt

  @native PhoenixKitAgent.Turns.Locks.Native
  @build_env "LOCKS_NIF_BUILD"
  @profile_env "LOCKS_NIF_PROFILE"

  @impl true
  def run(_args) do
    # The library's directory, also when it is a dependency (Mix runs its
    # compilers with its own project pushed).
    root = Path.dirname(Mix.Project.project_file())
    compile(settings(root), Path.join(Mix.Project.app_path(), "priv/native/liblocks_nif.so"))
  end

  @impl true
  def clean do
    File.rm_rf(Path.join(Mix.Project.app_path(), "priv/native"))
    :ok
  end

  @doc false
  # Everything the compiler decides on, read once, for the library at `root`.
  # Public for the tests, which give their own environment and cargo.
  def settings(
        root,
        env \\ System.get_env(),
        config \\ Application.get_all_env(:phoenix_kit_agent_locks)
      ) do
    profile = if env[@profile_env] in [nil, ""], do: "release", else: env[@profile_env]
    # cargo reads a relative CARGO_TARGET_DIR against its working directory,
    # which is `root`.
    target_dir =
      if env["CARGO_TARGET_DIR"] in [nil, ""], do: "target", else: env["CARGO_TARGET_DIR"]

    %{
      root: root,
      build: build_mode(env[@build_env], config),
      cargo: cargo(),
      profile: profile,
      target_dir: Path.expand(target_dir, root),
      prebuilt: Prebuilt.settings(root, env)
    }
  end

  # `:prebuilt`, or `{:source, why}` (`why` nil when building from source is
  # the default: this repository's own dev and test builds).
  defp build_mode(switch, config) do
    case switch do
      on when on in ["1", "true"] ->
        {:source, "#{@build_env}=#{on}"}

      off when off in ["0", "false"] ->
        :prebuilt

      unset when unset in [nil, ""] ->
        cond do
          config[:build_from_source] == true ->
            {:source, "config :phoenix_kit_agent_locks, build_from_source: true"}

          # A host compiles its dependencies in :prod; :dev and :test are
          # this repository's, where a prebuilt library of the same version
          # would silently run instead of the Rust code being worked on.
          Mix.env() in [:dev, :test] ->
            {:source, nil}

          true ->
            :prebuilt
        end

      other ->
        Mix.raise("#{@build_env}=#{other}: expected 1 or true (build from source), 0 or false")
    end
  end

  @doc false
  # Installs the library at `dest` as `settings` say. Public for the tests.
  def compile(%{build: {:source, why}} = settings, dest) do
    if why, do: Mix.shell().info("locks_nif: building from source (#{why})")
    from_source(settings, dest)
  end

  def compile(%{build: :prebuilt} = settings, dest) do
    case Prebuilt.fetch(settings.prebuilt) do
      {:ok, library, artifact, from} ->
        with {:ok, []} <- install_binary(library, dest) do
          Mix.shell().info("locks_nif: installed #{artifact} from #{from} (SHA-256 as listed)")
          {:ok, []}
        end

      {:mismatch, message} ->
        error(message)

      {:unavailable, why} when settings.cargo != nil ->
        Mix.shell().info("locks_nif: no prebuilt library (#{why}); building from source")
        from_source(settings, dest)

      {:unavailable, why} ->
        error(neither(settings.prebuilt, why))
    end
  end

  defp from_source(settings, dest) do
    with {:ok, cargo} <- found(settings.cargo),
         :ok <- cargo_build(cargo, settings.root, settings.profile),
         {:ok, built} <- built_library(settings.target_dir, settings.profile) do
      install(built, dest)
    end
  end

  defp neither(prebuilt, why) do
    target =
      case prebuilt.target do
        {:ok, target} -> target
        {:error, _} -> "(unknown)"
      end

    artifact =
      case Prebuilt.wanted(prebuilt) do
        nil -> "the artifact for your target (#{Prebuilt.env_names().target} names it)"
        name -> name
      end

    """
    no library for target #{target} and NIF version #{prebuilt.nif_version}:
      prebuilt: #{why}
      from source: cargo not found on PATH or in ~/.cargo/bin
    Either install Rust (https://rustup.rs) so that cargo is on PATH, or put \
    #{artifact} (as listed in #{Path.basename(prebuilt.checksum_file)}) in a \
    directory and set #{Prebuilt.env_names().cache_dir} to it.\
    """
  end

  defp cargo do
    System.find_executable("cargo") || existing(Path.expand("~/.cargo/bin/cargo"))
  end

  defp found(nil), do: error("cargo not found: install Rust (rustup) or put cargo on PATH")
  defp found(cargo), do: {:ok, cargo}

  defp existing(path), do: if(File.exists?(path), do: path)

  defp cargo_build(cargo, root, profile) do
    args =
      ["build", "--package", "locks_nif", "--locked"] ++
        if(profile == "release", do: ["--release"], else: [])

    case System.cmd(cargo, args, cd: root, stderr_to_stdout: true, into: IO.stream(:stdio, :line)) do
      {_, 0} -> :ok
      {_, status} -> error("cargo build failed (exit #{status})")
    end
  end

  defp built_library(target_dir, profile) do
    ["liblocks_nif.so", "liblocks_nif.dylib"]
    |> Enum.map(&Path.join([target_dir, profile, &1]))
    |> Enum.find(&File.exists?/1)
    |> case do
      nil -> error("cargo built no liblocks_nif in #{Path.join(target_dir, profile)}")
      path -> {:ok, path}
    end
  end

  @doc false
  # Public for its test: installs the file `built` as `dest`, `{:noop, []}`
  # when `dest` already has the same bytes.
  def install(built, dest), do: install_binary(File.read!(built), dest)

  defp install_binary(library, dest) do
    if File.read(dest) == {:ok, library} do
      {:noop, []}
    else
      File.mkdir_p!(Path.dirname(dest))
      # Never write into the installed file: a VM that loaded it maps its
      # pages, and changing them under it would crash it. Write a new file
      # and rename it over the old one (atomic on one file system): the
      # loaded file lives on, nameless, for as long as a VM maps it.
      staged = "#{dest}.#{System.pid()}-#{System.unique_integer([:positive])}.tmp"
      File.write!(staged, library)

      case File.rename(staged, dest) do
        :ok ->
          reload_stub()
          {:ok, []}

        {:error, reason} ->
          File.rm(staged)
          error("cannot install #{dest}: #{:file.format_error(reason)}")
      end
    end
  end

  # The first compile loads the stub module before the library exists; load
  # it again so its @on_load finds the library. A module that already runs
  # the NIF is left alone (no NIF upgrade).
  defp reload_stub do
    if :code.is_loaded(@native) != false and not @native.loaded() do
      :code.purge(@native)
      :code.delete(@native)
      :code.purge(@native)
      {:module, @native} = :code.load_file(@native)
    end

    :ok
  end

  defp error(message) do
    Mix.shell().error("locks_nif: " <> message)

    {:error,
     [
       %Mix.Task.Compiler.Diagnostic{
         compiler_name: "locks_nif",
         file: "native/locks_nif",
         message: message,
         position: nil,
         severity: :error
       }
     ]}
  end
end
