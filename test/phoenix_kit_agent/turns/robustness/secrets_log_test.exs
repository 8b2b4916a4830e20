defmodule PhoenixKitAgent.Turns.Robustness.SecretsLogTest do
  # The same guarantee as SecretsTest, seen through this VM's own Logger
  # (ExUnit.CaptureLog): the application is restarted with a URL carrying a
  # password found nowhere else. Restarting the application replaces the
  # pool every other test uses, so this module is `async: false` (ExUnit
  # runs it after every async module, alone) and puts the original
  # configuration back, and the pool with it, when each test ends.
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  require Logger

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Error, TestDB}

  @moduletag :robustness

  @app :phoenix_kit_agent_locks
  @password "L0g-S3cr3t-pw"
  @keys [:url, :pool_size, :connect_timeout, :checkout_timeout, :statement_timeout, :prefix]

  setup do
    original = Application.get_all_env(@app)

    on_exit(fn ->
      capture_log(fn ->
        _ = Application.stop(@app)
        for key <- @keys, do: Application.delete_env(@app, key)
        for {key, value} <- original, do: Application.put_env(@app, key, value)
        {:ok, _} = Application.ensure_all_started(@app)
      end)

      chat = TestDB.insert_chat!()
      :ok = Locks.acquire(chat, TestDB.uuid(), "restored", 60)
    end)

    :ok
  end

  defp restart_with(env) do
    capture_log(fn ->
      _ = Application.stop(@app)
      for {key, value} <- env, do: Application.put_env(@app, key, value)
      send(self(), {:started, Application.start(@app)})
      # The application controller logs a failed start after it answered:
      # a call to it returns once it is done, then the Logger is flushed.
      _ = Application.started_applications()
      Logger.flush()
    end)
    |> then(fn log ->
      receive do
        {:started, result} -> {result, log}
      end
    end)
  end

  defp url_with_password do
    uri = URI.parse(TestDB.url())
    "postgres://locks:#{@password}@#{uri.host}:#{uri.port}#{uri.path}"
  end

  test "calls that cannot authenticate raise errors, and log nothing, without the password" do
    {:ok, log} =
      restart_with(
        url: url_with_password(),
        connect_timeout: 1_000,
        checkout_timeout: 1_000,
        statement_timeout: 1_000
      )

    refute log =~ @password

    chat = TestDB.uuid()

    log =
      capture_log(fn ->
        for _ <- 1..3 do
          e = assert_raise Error, fn -> Locks.acquire(chat, chat, "t", 60) end
          assert e.reason == :connect
          assert e.message =~ "password authentication failed"
          refute inspect(e) =~ @password
          refute Exception.format(:error, e, []) =~ @password
        end
      end)

    refute log =~ @password
  end

  test "a start refused for a bad setting logs neither the URL nor its password" do
    {result, log} = restart_with(url: url_with_password(), pool_size: 0)
    assert {:error, _} = result
    refute inspect(result) =~ @password, "the start error: #{inspect(result)}"
    refute log =~ @password, "the log: #{log}"
  end
end
