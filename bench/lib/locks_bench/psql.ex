defmodule LocksBench.Psql do
  @moduledoc false
  # psql and pgbench against the library's configured database, given the
  # resolved configuration through libpq's environment, never as a URL: no
  # password on a command line.

  alias PhoenixKitAgent.Turns.Locks.Config

  @doc "libpq's environment for `config` (a nil value unsets a variable)."
  def env(%Config{} = config, name \\ "phoenix_kit_agent_locks bench") do
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
      {"PGAPPNAME", name},
      {"PGCONNECT_TIMEOUT", "10"}
    ]
  end

  @doc "Runs `commands` (one `-c` each, one session): their rows, as lists of strings; raises on an error."
  def query!(%Config{} = config, commands) do
    args =
      ["-X", "-q", "-A", "-t", "-F", "\t", "-v", "ON_ERROR_STOP=1"] ++
        Enum.flat_map(commands, &["-c", &1])

    case System.cmd(executable!("psql"), args, stderr_to_stdout: true, env: env(config)) do
      {out, 0} -> out |> String.split("\n", trim: true) |> Enum.map(&String.split(&1, "\t"))
      {out, status} -> raise "psql exited with #{status}: #{String.trim(out)}"
    end
  end

  @doc "The path of PostgreSQL's client program `name`; raises when it is not on the PATH."
  def executable!(name) do
    System.find_executable(name) ||
      raise "#{name} is not on the PATH (PostgreSQL's client programs)"
  end
end
