defmodule PhoenixKitAgent.Turns.Locks.Application do
  @moduledoc false
  # Installs the native pool when the application starts (it connects on first
  # use, so a database that is down breaks nothing here) and closes it when
  # the application stops.

  use Application

  require Logger

  alias PhoenixKitAgent.Turns.Locks.{Config, Native}

  @impl true
  def start(_type, _args) do
    case Config.read() do
      %{url: nil} ->
        Logger.warning(
          "phoenix_kit_agent_locks: no :url configured and DATABASE_URL is unset; " <>
            "lock calls will raise until the application is restarted with one"
        )

      options ->
        :ok = Native.start(options)
    end

    Supervisor.start_link([], strategy: :one_for_one, name: __MODULE__.Supervisor)
  end

  @impl true
  def stop(_state) do
    Native.stop()
    :ok
  end
end
