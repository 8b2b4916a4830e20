defmodule PhoenixKitAgent.Turns.Locks.Application do
  @moduledoc false
  # Installs the native pool when the application starts and closes it when
  # the application stops. The pool connects on first use, so a database that
  # is down breaks nothing here; a setting that is wrong (a bad port, a CA
  # file that cannot be read) stops the start, with the setting named.
  #
  # Stopping closes the pool (its connections are dropped) and starting again
  # installs a new one from the configuration as it is then, in the same VM.

  use Application

  require Logger

  alias PhoenixKitAgent.Turns.Locks.{Config, Error, Native, Observe}

  @impl true
  def start(_type, _args) do
    case Config.read() do
      {:ok, config} ->
        start_pool!(config)

      :unconfigured ->
        Logger.warning(
          "phoenix_kit_agent_locks: no database configured (config :phoenix_kit_agent_locks, " <>
            "repo: … or url: …) and DATABASE_URL is unset; lock calls will raise until the " <>
            "application is restarted with one"
        )
    end

    Observe.setup()

    # The keepers of with_turn/4's turns: stopped before stop/1 closes the
    # pool, so each releases its turn's locks on the way out.
    children = [
      {DynamicSupervisor, name: PhoenixKitAgent.Turns.Locks.Keepers, strategy: :one_for_one}
    ]

    Supervisor.start_link(children, strategy: :one_for_one, name: __MODULE__.Supervisor)
  end

  @impl true
  def stop(_state) do
    Native.stop()
    :ok
  end

  # A NIF that raises puts its arguments in the stacktrace, and these hold
  # the password: raise the same exception again from here, without them.
  defp start_pool!(config) do
    Native.start(config)
  rescue
    error in [Error, ArgumentError] -> raise error
  end
end
