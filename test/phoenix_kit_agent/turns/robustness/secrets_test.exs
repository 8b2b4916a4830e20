defmodule PhoenixKitAgent.Turns.Robustness.SecretsTest do
  # The password of the database URL must never show: not in a connection
  # failure's message, a raised error, `inspect` of one, the configuration,
  # nor the log. Each case runs in a node of its own configured with a URL
  # that carries a password found nowhere else; everything the node printed
  # (its Logger output, crash reports) is its log.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks.{Config, Error, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.{Node, Race, Scenarios}

  @moduletag :robustness

  @password "S3cr3t-R0bust-pw"
  @timeouts [connect_timeout: 1_000, checkout_timeout: 1_000, statement_timeout: 1_000]

  defp url_with(host_port, password \\ @password) do
    uri = URI.parse(TestDB.url())
    "postgres://locks:#{password}@#{host_port}#{uri.path}"
  end

  defp real_host_port do
    uri = URI.parse(TestDB.url())
    "#{uri.host}:#{uri.port}"
  end

  # A closed port on this machine: bound and released, nobody listens.
  defp closed_port do
    {:ok, socket} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
    {:ok, port} = :inet.port(socket)
    :gen_tcp.close(socket)
    port
  end

  defp refute_secret(text, where) do
    refute text =~ @password, "the password shows in #{where}: #{text}"
  end

  defp failing_calls(node) do
    chat = TestDB.uuid()

    for {fun, args} <- [
          {:acquire, [chat, chat, "t", 60]},
          {:held?, [chat, chat, "t"]},
          {:release, [chat, chat, "t"]}
        ] do
      assert {:raised, %Error{} = e} = Node.call(node, Race, :attempt, [fun, args])
      e
    end
  end

  for {name, url_fun, reason, message} <- [
        {"a refused connection", :refused, :connect, "database connection failed"},
        {"a wrong password", :wrong_password, :connect, "password authentication failed"},
        {"a host that does not resolve", :no_host, :connect, "database connection failed"}
      ] do
    @tag url: url_fun, reason: reason, message: message
    test "#{name}: the error, its message, inspect and the node's log omit the password",
         %{url: url_fun, reason: reason, message: message} do
      url =
        case url_fun do
          :refused -> url_with("127.0.0.1:#{closed_port()}")
          :wrong_password -> url_with(real_host_port())
          :no_host -> url_with("no-such-host.invalid:5432")
        end

      node = Node.start!(app_env: [url: url, pool_size: 2] ++ @timeouts)
      assert {_pid, {:ok, _}} = Node.hello(node)

      for e <- failing_calls(node) do
        assert e.reason == reason
        assert e.message =~ message
        refute_secret(e.message, "the message")
        refute_secret(inspect(e), "inspect of the error")
        refute_secret(Exception.format(:error, e, []), "the formatted error")
      end

      for line <- Node.log(node), do: refute_secret(line, "the node's log")
    end
  end

  test "a raised error's stacktrace (which carries the call's arguments) omits the password" do
    node =
      Node.start!(
        app_env: [url: url_with("127.0.0.1:#{closed_port()}"), pool_size: 1] ++ @timeouts
      )

    chat = TestDB.uuid()
    text = Node.call(node, Scenarios, :formatted_failure, [:acquire, [chat, chat, "t", 60]])
    assert text =~ "database connection failed"
    refute_secret(text, "the formatted exception with its stacktrace")
  end

  describe "a configuration the library refuses" do
    # A NIF that raises keeps its arguments in the stacktrace: were the
    # options handed to Native.start/1 a plain map, the application's start
    # error, and the crash report the VM logs for it, would carry the URL
    # and its password (they did, before Config became a struct and the
    # start re-raised without the NIF's arguments).
    for {setting, value} <- [pool_size: 0, checkout_timeout: -1, prefix: "not an identifier"] do
      @tag setting: {setting, value}
      test "#{setting}: #{inspect(value)}: the start error and the log omit the password",
           %{setting: {setting, value}} do
        app_env = [{:url, url_with(real_host_port())}, {setting, value}]
        node = Node.start!(app_env: app_env)
        assert {_pid, {:error, reason}} = Node.hello(node)
        assert inspect(reason) =~ "invalid configuration: #{setting}"
        refute_secret(inspect(reason), "the application's start error")
        for line <- Node.log(node), do: refute_secret(line, "the node's log")
      end
    end

    test "inspect of the configuration omits the password" do
      {:ok, options} = Config.read(url: url_with(real_host_port()), pool_size: 3)
      assert options.pool_size == 3
      refute_secret(inspect(options), "inspect of Config.read/1")
    end
  end
end
