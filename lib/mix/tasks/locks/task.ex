defmodule Mix.Tasks.Locks.Task do
  @moduledoc false
  # What the locks.* tasks share: the library started on the configured
  # database, and the ordinary errors (nothing configured, a bad setting, a
  # database that refuses or cannot be reached) reported as one line by
  # Mix.raise, which Mix prints without a stack trace: the trace of a NIF
  # call shows its arguments, and says nothing the user can act on.
  #
  # Only the library is started, on the host's configuration (`app.config`,
  # as Ecto's tasks do), not the host's own applications: a task that reads
  # locks has no business starting an endpoint.

  alias PhoenixKitAgent.Turns.Locks.{Config, Error}

  @app :phoenix_kit_agent_locks

  # Parses `args` by `switches`, starts the library for `task` ("mix
  # locks.held"), then runs `fun` on the options; errors as above.
  def run(task, args, switches, fun) do
    {opts, _} = OptionParser.parse!(args, strict: switches)
    Mix.Task.run("app.config")

    if Config.read() == :unconfigured do
      Mix.raise(
        "#{task}: no database configured: set `config :phoenix_kit, repo: MyApp.Repo` " <>
          "(PhoenixKit's) or `config #{inspect(@app)}, repo: MyApp.Repo` " <>
          "(or `url: \"postgres://user:password@host/database\"`) in config/config.exs, " <>
          "or the DATABASE_URL environment variable"
      )
    end

    start!(task)
    fun.(opts)
  rescue
    error in Error -> Mix.raise("#{task}: #{Exception.message(error)}#{hint(error.reason)}")
  end

  # A pool that cannot be built (an unreadable ssl_ca_file) fails the start:
  # its Error is somewhere in the application's exit reason, and is reported
  # instead of OTP's notice of the exit, with its stack trace. A start that
  # fails returns its reason (application_master catches what a start
  # callback raises): nothing raises between the two Logger calls.
  defp start!(task) do
    level = Logger.level()
    Logger.configure(level: :error)
    started = Application.ensure_all_started(@app)
    Logger.configure(level: level)

    with {:error, reason} <- started do
      if error = find_error(reason),
        do: raise(error),
        else: Mix.raise("#{task}: cannot start #{inspect(@app)}: #{inspect(reason, limit: 5)}")
    end
  end

  defp find_error(%Error{} = error), do: error
  defp find_error(tuple) when is_tuple(tuple), do: find_error(Tuple.to_list(tuple))
  defp find_error(list) when is_list(list), do: Enum.find_value(list, &find_error/1)
  defp find_error(_), do: nil

  # What to check, where the message alone does not say it.
  defp hint(:connect),
    do:
      "; check the server, user and password that `config #{inspect(@app)}` " <>
        "(repo: or url:) or DATABASE_URL give"

  defp hint(_reason), do: ""
end
