defmodule Mix.Tasks.Locks.Checksum do
  @shortdoc "Writes the checksum file of a release's prebuilt NIF libraries"
  @moduledoc """
  Writes the checksum file, all or nothing: see CONTRIBUTING.md, "How a release is cut".

      mix locks.checksum            # downloads the artifacts from the release
      mix locks.checksum --dir DIR  # reads them from DIR
  """

  use Mix.Task

  alias Mix.Tasks.Compile.LocksNif.Prebuilt

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: [dir: :string])
    s = Prebuilt.settings(File.cwd!(), System.get_env())
    file = Path.basename(s.checksum_file)

    artifacts =
      for target <- Prebuilt.targets(), nif <- Prebuilt.nif_versions() do
        name = Prebuilt.artifact(s.version, nif, target)
        {name, read(name, opts[:dir], s)}
      end

    case for {name, {:error, why}} <- artifacts, do: "  #{name}: #{why}" do
      [] ->
        sums = Map.new(artifacts, fn {name, {:ok, bytes}} -> {name, Prebuilt.checksum(bytes)} end)
        write_checksums(s.checksum_file, sums)
        Mix.shell().info("wrote #{file}: #{map_size(sums)} artifacts of version #{s.version}")

      missing ->
        Mix.raise(
          "#{length(missing)} of #{length(artifacts)} artifacts are missing; " <>
            "#{file} is left as it was:\n" <> Enum.join(missing, "\n")
        )
    end
  end

  @doc false
  # The checksum file Prebuilt.read_checksums/1 reads, in name order, one
  # artifact a line: all the artifacts or nothing. Public for the tests.
  def write_checksums(path, checksums) do
    lines = for {name, sum} <- Enum.sort(checksums), do: "\n  #{inspect(name)} => #{inspect(sum)}"
    File.write!(path, "%{#{Enum.join(lines, ",")}\n}\n")
  end

  defp read(name, nil, s), do: Prebuilt.download("#{s.base_url}/#{name}", s.proxy)

  defp read(name, dir, _s) do
    path = Path.join(dir, name)

    with {:error, why} <- File.read(path),
         do: {:error, "cannot read #{path}: #{:file.format_error(why)}"}
  end
end
