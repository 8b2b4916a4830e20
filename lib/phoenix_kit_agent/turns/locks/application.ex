defmodule PhoenixKitAgent.Turns.Locks.Application do
  @moduledoc false

  use Application

  require Logger

  alias PhoenixKitAgent.Turns.Locks.{Config, Error, Keepers, Native, Observe, Sandbox}

  @impl true
  def start(_type, _args) do
    # testing: :sandbox opens no connection: the host's repo runs every statement.
    with :disabled <- Sandbox.start(Config.testing()), do: start_pool()

    Observe.setup()

    # with_turn/4's keepers: stopped before stop/1 closes the pool, so each
    # tells its turn it is lost and releases its locks on the way out.
    children = [{DynamicSupervisor, name: Keepers, strategy: :one_for_one}]

    Supervisor.start_link(children, strategy: :one_for_one, name: __MODULE__.Supervisor)
  end

  @impl true
  def stop(_state), do: Native.stop()

  defp start_pool do
    case Config.read() do
      {:ok, config} ->
        Native.start(config)

      :unconfigured ->
        Logger.warning(
          "phoenix_kit_agent_locks: no database configured (config :phoenix_kit, repo: …, or " <>
            "config :phoenix_kit_agent_locks, repo: … or url: …) and DATABASE_URL is unset; " <>
            "lock calls will raise until the application is restarted with one"
        )
    end
  rescue
    # A NIF that raises puts its arguments, the password among them, in the
    # stacktrace: the same exception is raised again from here, without them.
    error in [Error, ArgumentError] -> raise error
  end
end
