defmodule PhoenixKitAgent.Turns.Locks.Bench.Psql do
  @moduledoc false
  # `psql` and `pgbench` against the database the library is configured for,
  # whatever the configuration's source (a url, the host's repo, discrete
  # settings, DATABASE_URL): libpq is given the resolved `%Config{}` through
  # its environment variables, never as a URL, so a repo's settings need no
  # URL to be written and no password ever appears on a command line.

  alias PhoenixKitAgent.Turns.Locks.Config

  @doc """
  libpq's environment for `config`, for `System.cmd/3`'s `:env` (a `nil`
  value unsets a variable). PGHOSTADDR and PGSERVICE are unset: either
  would take precedence over PGHOST or fill in what the configuration left
  out.
  """
  @spec env(Config.t(), String.t()) :: [{String.t(), String.t() | nil}]
  def env(%Config{} = config, application_name \\ "phoenix_kit_agent_locks bench") do
    [
      # libpq takes a directory as a host: its socket.
      {"PGHOST", config.socket_dir || config.hostname},
      {"PGHOSTADDR", nil},
      {"PGSERVICE", nil},
      {"PGPORT", Integer.to_string(config.port)},
      {"PGUSER", config.username},
      {"PGPASSWORD", config.password},
      {"PGDATABASE", config.database},
      {"PGSSLMODE", config.sslmode |> Atom.to_string() |> String.replace("_", "-")},
      {"PGSSLROOTCERT", config.ssl_ca_file},
      {"PGAPPNAME", application_name},
      {"PGCONNECT_TIMEOUT", "10"}
    ]
  end

  @doc """
  Runs each of `commands` (one `-c` each, in one session) and returns the
  rows of all of them as lists of strings: `{:ok, rows}`, or
  `{:error, message}` with psql's own words.
  """
  @spec query(Config.t(), [String.t()]) :: {:ok, [[String.t()]]} | {:error, String.t()}
  def query(%Config{} = config, commands) do
    case System.find_executable("psql") do
      nil ->
        {:error, "psql is not on the PATH"}

      psql ->
        args =
          ["-X", "-q", "-A", "-t", "-F", "\t", "-v", "ON_ERROR_STOP=1"] ++
            Enum.flat_map(commands, &["-c", &1])

        case System.cmd(psql, args, stderr_to_stdout: true, env: env(config)) do
          {out, 0} ->
            {:ok, out |> String.split("\n", trim: true) |> Enum.map(&String.split(&1, "\t"))}

          {out, status} ->
            {:error, "psql exited with #{status}: #{String.trim(out)}"}
        end
    end
  end
end
