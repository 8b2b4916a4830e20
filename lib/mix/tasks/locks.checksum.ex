defmodule Mix.Tasks.Locks.Checksum do
  @shortdoc "Writes the checksum file of a release's prebuilt NIF libraries"
  @moduledoc """
  Writes `checksum-Elixir.PhoenixKitAgent.Turns.Locks.Native.exs` in the
  current directory (the project's root): the SHA-256 of every artifact the
  release workflow builds for the version in `mix.exs`, one for each target
  and NIF version of `Mix.Tasks.Compile.LocksNif.Prebuilt`.

      mix locks.checksum            # downloads them from the release
      mix locks.checksum --dir DIR  # reads them from DIR

  The release is the base URL of `mix.exs` (`LOCKS_NIF_BASE_URL` overrides
  it), reached through `https_proxy` / `http_proxy` when set. `--dir` reads
  the artifacts from a directory instead (`gh release download v0.1.0 -D
  DIR`, a mirror, an offline copy).

  All or nothing: when an artifact is missing, the task lists what is
  missing and why, and leaves the file as it was. Commit the file it wrote:
  a host trusts an artifact only if this file lists its checksum.
  """

  use Mix.Task

  alias Mix.Tasks.Compile.LocksNif.Prebuilt

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: [dir: :string])
    path = Prebuilt.checksum_file(File.cwd!())
    settings = Prebuilt.settings(File.cwd!(), System.get_env())

    artifacts =
      for target <- Prebuilt.targets(), nif <- Prebuilt.nif_versions() do
        name = Prebuilt.artifact(settings.version, nif, target)
        {name, read(name, opts[:dir], settings)}
      end

    case for {name, {:error, why}} <- artifacts, do: "  #{name}: #{why}" do
      [] ->
        Prebuilt.write_checksums(
          path,
          Map.new(artifacts, fn {n, {:ok, b}} -> {n, Prebuilt.checksum(b)} end)
        )

        Mix.shell().info(
          "wrote #{Path.basename(path)}: #{length(artifacts)} artifacts of version #{settings.version}"
        )

      missing ->
        Mix.raise(
          "#{length(missing)} of #{length(artifacts)} artifacts are missing; " <>
            "#{Path.basename(path)} is left as it was:\n" <> Enum.join(missing, "\n")
        )
    end
  end

  defp read(name, nil, settings),
    do: Prebuilt.download("#{settings.base_url}/#{name}", settings.proxy)

  defp read(name, dir, _settings) do
    path = Path.join(dir, name)

    case File.read(path) do
      {:ok, bytes} -> {:ok, bytes}
      {:error, reason} -> {:error, "cannot read #{path}: #{:file.format_error(reason)}"}
    end
  end
end
