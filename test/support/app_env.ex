defmodule PhoenixKitAgent.Turns.Locks.AppEnv do
  @moduledoc false
  # Restarts the :phoenix_kit_agent_locks application with a configuration
  # of a test's own, and puts the original back (configuration and pool)
  # when the test ends. Restarting replaces the pool every other test of
  # this VM uses, so only `async: false` modules may use it: ExUnit runs them
  # after every async module, one at a time.

  import ExUnit.Callbacks, only: [on_exit: 1]
  import ExUnit.CaptureLog, only: [capture_log: 1, with_log: 1]

  require Logger

  @app :phoenix_kit_agent_locks

  @doc """
  Registers the restoration of the current configuration for the end of
  the test. Call it first, in `setup`.
  """
  def restore_on_exit do
    original = Application.get_all_env(@app)

    on_exit(fn ->
      capture_log(fn ->
        _ = Application.stop(@app)
        replace_env(original)
        {:ok, _} = Application.ensure_all_started(@app)
      end)
    end)

    :ok
  end

  @doc """
  Stops the application, replaces its whole configuration by `env` and
  starts it again; returns what `Application.start/1` returned. The
  application's notices ("exited: :stopped") are kept out of the test's
  output.
  """
  def restart(env) do
    {result, _log} = restart_logged(env)
    result
  end

  @doc "As `restart/1`, and returns what was logged too: `{result, log}`."
  def restart_logged(env) do
    with_log(fn ->
      _ = Application.stop(@app)
      replace_env(env)
      result = Application.start(@app)
      # The application controller logs a failed start after it answered:
      # a call to it returns once that is done; then the Logger is flushed.
      _ = Application.started_applications()
      Logger.flush()
      result
    end)
  end

  @doc "Stops the application, its notice kept out of the test's output."
  def stop do
    capture_log(fn -> :ok = Application.stop(@app) end)
    :ok
  end

  defp replace_env(env) do
    for {key, _} <- Application.get_all_env(@app), do: Application.delete_env(@app, key)
    for {key, value} <- env, do: Application.put_env(@app, key, value)
    :ok
  end
end
