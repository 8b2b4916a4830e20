defmodule Mix.Tasks.Compile.LocksNif do
  @shortdoc "Builds the locks NIF with cargo and installs it in priv/native"
  @moduledoc """
  Builds `native/locks_nif` with `cargo build --release` and installs the
  library as `priv/native/liblocks_nif.so` of the application.

  Declared in `mix.exs` after Elixir's compilers, so `mix compile` in this
  project (and `mix deps.compile` in a host that depends on it) builds
  everything. cargo is incremental: with nothing changed this is a no-op.

  An installed library that is already loaded is never written over: the new
  file replaces it under a new inode (old file deleted first). The BEAM keeps
  running the old code until it restarts: rustler NIFs cannot be upgraded in
  place. If the stub module was loaded before the library existed (the first
  compile), it is reloaded so that this VM gets the NIF too.

  Set `LOCKS_NIF_PROFILE=debug` for a debug build.
  """

  use Mix.Task.Compiler

  @native PhoenixKitAgent.Turns.Locks.Native

  @impl true
  def run(_args) do
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
    target = System.get_env("CARGO_TARGET_DIR") || Path.join(root, "target")

    ["liblocks_nif.so", "liblocks_nif.dylib"]
    |> Enum.map(&Path.join([target, profile, &1]))
    |> Enum.find(&File.exists?/1)
    |> case do
      nil -> error("cargo built no liblocks_nif in #{Path.join(target, profile)}")
      path -> {:ok, path}
    end
  end

  defp install(built, dest) do
    if File.read!(built) == (File.exists?(dest) && File.read!(dest)) do
      {:noop, []}
    else
      File.mkdir_p!(Path.dirname(dest))
      # Delete first: the loaded file keeps its inode, and the VM using it
      # never sees its code change under it.
      File.rm(dest)
      File.cp!(built, dest)
      reload_stub()
      {:ok, []}
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
