defmodule Mix.Tasks.Compile.LocksNif do
  @shortdoc "Builds the locks NIF with cargo and installs it in priv/native"
  @moduledoc """
  Builds `native/locks_nif` with `cargo build --release` and installs the
  library as `priv/native/liblocks_nif.so` of the application.

  Declared in `mix.exs` after Elixir's compilers (this module is one of the
  files they compile), so `mix compile` in this project, and `mix
  deps.compile` / `mix compile` in a host that depends on it by `path:` or
  `git:`, build everything with no other step. cargo is incremental: with
  nothing changed this is a no-op. cargo runs in the library's own directory
  (its workspace), so its `target/` is reused by every project that depends
  on the same checkout; `CARGO_TARGET_DIR` moves it (relative to the
  library's directory).

  For a dependency, Mix links the application's `priv` in `_build` to the
  library's own `priv`, so the library lands in the dependency's source
  directory (`deps/phoenix_kit_agent_locks/priv/native` for a `git:`
  dependency, the checkout itself for a `path:` one), as it does for this
  project; `mix release` copies it from there.

  An installed library is never written over: the new one is written
  beside it and renamed into place, so a VM that has the old one loaded
  keeps running its code, and a VM that loads the library at the same
  moment sees either file whole. A running VM never switches to new native
  code (rustler NIFs cannot be upgraded): restart it. If the stub module
  was loaded before the library existed (the first compile), it is
  reloaded so that this VM gets the NIF too.

  Set `LOCKS_NIF_PROFILE=debug` for a debug build.
  """

  use Mix.Task.Compiler

  @native PhoenixKitAgent.Turns.Locks.Native

  @impl true
  def run(_args) do
    # The library's directory, also when it is a dependency (Mix runs its
    # compilers with its own project pushed).
    root = Path.dirname(Mix.Project.project_file())
    profile = System.get_env("LOCKS_NIF_PROFILE", "release")

    with {:ok, cargo} <- cargo(),
         :ok <- build(cargo, root, profile),
         {:ok, built} <- built_library(root, profile) do
      install(built, Path.join(Mix.Project.app_path(), "priv/native/liblocks_nif.so"))
    end
  end

  @impl true
  def clean do
    File.rm_rf(Path.join(Mix.Project.app_path(), "priv/native"))
    :ok
  end

  defp cargo do
    case System.find_executable("cargo") || existing(Path.expand("~/.cargo/bin/cargo")) do
      nil -> error("cargo not found: install Rust (rustup) or put cargo on PATH")
      path -> {:ok, path}
    end
  end

  defp existing(path), do: if(File.exists?(path), do: path)

  defp build(cargo, root, profile) do
    args =
      ["build", "--package", "locks_nif", "--locked"] ++
        if(profile == "release", do: ["--release"], else: [])

    case System.cmd(cargo, args, cd: root, stderr_to_stdout: true, into: IO.stream(:stdio, :line)) do
      {_, 0} -> :ok
      {_, status} -> error("cargo build failed (exit #{status})")
    end
  end

  defp built_library(root, profile) do
    # cargo reads a relative CARGO_TARGET_DIR against its working directory,
    # which is `root`.
    target = Path.expand(System.get_env("CARGO_TARGET_DIR") || "target", root)

    ["liblocks_nif.so", "liblocks_nif.dylib"]
    |> Enum.map(&Path.join([target, profile, &1]))
    |> Enum.find(&File.exists?/1)
    |> case do
      nil -> error("cargo built no liblocks_nif in #{Path.join(target, profile)}")
      path -> {:ok, path}
    end
  end

  @doc false
  # Public for its test: installs `built` as `dest`, `{:noop, []}` when
  # `dest` already has the same bytes.
  def install(built, dest) do
    if same_file?(built, dest) do
      {:noop, []}
    else
      File.mkdir_p!(Path.dirname(dest))
      # Never write into the installed file: a VM that loaded it maps its
      # pages, and changing them under it would crash it. Write a new file
      # and rename it over the old one (atomic on one file system): the
      # loaded file lives on, nameless, for as long as a VM maps it.
      staged = "#{dest}.#{System.pid()}-#{System.unique_integer([:positive])}.tmp"
      File.cp!(built, staged)

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

  defp same_file?(a, b) do
    case {File.stat(a), File.stat(b)} do
      {{:ok, %{size: size}}, {:ok, %{size: size}}} -> File.read!(a) == File.read!(b)
      _ -> false
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
