defmodule PhoenixKitAgent.Turns.LifecycleTest do
  # The pool's life follows the application's: installed (not connected) when
  # it starts, closed when it stops, installed anew when it starts again in
  # the same VM. Each test restarts the application with a configuration of
  # its own, so this module is `async: false` and AppEnv puts the original
  # configuration, and a pool built from it, back afterwards.
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{AppEnv, Error, FakeRepo, Native, Robust, TestDB}

  @app :phoenix_kit_agent_locks

  setup do
    AppEnv.restore_on_exit()
    on_exit(fn -> Application.delete_env(:locks_fake_host, FakeRepo) end)
    %{name: "locks_lifecycle_#{System.unique_integer([:positive])}"}
  end

  # The test database's URL with an application_name of the test's own, so
  # that its connections can be counted in pg_stat_activity.
  defp url_named(name), do: with_query(TestDB.url(), "application_name=#{name}")

  defp with_query(url, query) do
    uri = URI.parse(url)
    URI.to_string(%{uri | query: if(uri.query, do: "#{uri.query}&#{query}", else: query)})
  end

  defp connections(name) do
    [[count]] =
      TestDB.query!("SELECT count(*) FROM pg_stat_activity WHERE application_name = '#{name}'")

    String.to_integer(count)
  end

  # Polls `check` for up to two seconds: a closed connection leaves
  # pg_stat_activity when its backend has exited, a moment after.
  defp eventually(check, tries \\ 100) do
    cond do
      check.() -> true
      tries == 0 -> false
      true -> Process.sleep(20) && eventually(check, tries - 1)
    end
  end

  defp turn(round \\ 1) do
    chat = TestDB.insert_chat!()
    user = TestDB.uuid()
    ref = "turn-#{round}"
    assert Locks.acquire(chat, user, ref, 60) == :ok
    assert Locks.held?(chat, user, ref)
    assert Locks.release(chat, user, ref) == :ok
    refute Locks.held?(chat, user, ref)
  end

  describe "starting" do
    test "installs the pool without connecting; the first call connects", %{name: name} do
      assert AppEnv.restart(url: url_named(name)) == :ok
      assert connections(name) == 0
      turn()
      assert connections(name) == 1
    end

    test "a database that is down does not stop the start: calls raise :connect" do
      assert AppEnv.restart(url: "postgres://locks:pw@127.0.0.1:1/locks", connect_timeout: 1_000) ==
               :ok

      error = assert_raise Error, fn -> Locks.held?(TestDB.uuid(), TestDB.uuid(), "t") end
      assert error.reason == :connect
      assert error.message =~ "Connection refused"
    end

    test "a bad setting stops the start, naming the setting, and shows no password" do
      url = "postgres://locks:St4rt-s3cr3t@127.0.0.1:1/locks"

      for {env, message} <- [
            {[url: url, pool_size: 0],
             "invalid configuration: pool_size: must be an integer from 1 to 1000, got: 0"},
            {[url: url, prefix: "not an identifier"],
             ~s{invalid configuration: prefix: must be an identifier: a letter or _, then letters, digits, _ or $ (at most 63), got: "not an identifier"}},
            {[url: url, port: 70_000],
             "invalid configuration: port: must be an integer from 1 to 65535, got: 70000"},
            {[url: url <> "?sslmode=verify-full"],
             ~s{invalid configuration: ssl_ca_file: required by the verifying sslmodes: a PEM file of the CA certificates to trust ("system" for the OS store)}},
            {[url: url, sslmode: :verify_ca, ssl_ca_file: "/nonexistent/ca.pem"],
             ~s{invalid configuration: ssl_ca_file: cannot read "/nonexistent/ca.pem": No such file or directory (os error 2)}}
          ] do
        {result, log} = AppEnv.restart_logged(env)
        assert {:error, reason} = result
        # The message as the exit reason's inspect shows it (quotes escaped).
        assert inspect(reason) =~ String.slice(inspect(message), 1..-2//1)
        refute inspect(reason) =~ "St4rt-s3cr3t"
        refute log =~ "St4rt-s3cr3t"
      end
    end
  end

  describe "with nothing configured" do
    test "every call raises :not_started, whatever module was loaded first" do
      # A VM of its own that loads modules on first use: Native is not
      # loaded until a call asks for it.
      node = Robust.Node.start!(env: [{"DATABASE_URL", nil}])
      assert {_pid, {:ok, _}} = Robust.Node.hello(node)
      refute Robust.Node.call(node, :code, :is_loaded, [Native])

      for {function, args} <- [
            acquire: [TestDB.uuid(), TestDB.uuid(), "t", 60],
            fresh?: [TestDB.uuid(), "t", 60],
            release_user: [TestDB.uuid(), "click:x"]
          ] do
        assert {:raised, %Error{reason: :not_started}} =
                 Robust.Node.call(node, Robust.Race, :attempt, [function, args])
      end
    end
  end

  describe "stopping" do
    test "closes the pool's connections; calls then raise :not_started", %{name: name} do
      :ok = AppEnv.restart(url: url_named(name), pool_size: 3)

      1..6
      |> Enum.map(fn round -> Task.async(fn -> turn(round) end) end)
      |> Task.await_many()

      assert connections(name) in 1..3
      :ok = AppEnv.stop()
      assert eventually(fn -> connections(name) == 0 end)

      error = assert_raise Error, fn -> Locks.held?(TestDB.uuid(), TestDB.uuid(), "t") end
      assert error.reason == :not_started
    end

    test "and starting again in the same VM, as many times as wanted", %{name: name} do
      for round <- 1..3 do
        :ok = AppEnv.restart(url: url_named(name))
        turn(round)
        assert connections(name) == 1
        :ok = AppEnv.stop()
        assert eventually(fn -> connections(name) == 0 end)
      end

      assert {:ok, _} = Application.ensure_all_started(@app)
      turn()
    end
  end

  describe "the Native module compiled again in a running VM (`r`, `c` or `recompile` in IEx)" do
    # rustler has no upgrade: a version compiled beside the running one is
    # refused by its own @on_load (logged), and the running one carries on.
    # (`recompile(force: true)`, where Mix first makes the running version
    # old, is run in a real IEx by HostAppTest.)
    test "keeps the NIF, the pool and the locks held" do
      chat = TestDB.insert_chat!()
      user = TestDB.uuid()
      assert Locks.acquire(chat, user, "before", 60) == :ok

      Code.compiler_options(ignore_module_conflict: true)

      log =
        try do
          capture_log(fn ->
            assert [{Native, _beam}] =
                     Code.compile_file("lib/phoenix_kit_agent/turns/locks/native.ex")
          end)
        after
          Code.compiler_options(ignore_module_conflict: false)
        end

      assert log =~ "{:error, :running_version_keeps_the_nif}"
      assert Native.loaded()
      assert Locks.held?(chat, user, "before")
      assert Locks.release(chat, user, "before") == :ok
      turn()
    end
  end

  describe "TLS settings reach the connection" do
    # The shared test server has no TLS, so a mode that needs it fails every
    # call with tokio-postgres' own words; native/locks_core/tests/tls.rs
    # connects to a server that has it. (A call that fails to connect starts
    # the back-off: the second call within it fails with the same words.)
    # The message names the server.
    defp no_tls! do
      %URI{host: host, port: port} = URI.parse(TestDB.url())

      no_tls =
        "database connection failed: #{host}:#{port}: error performing TLS handshake: " <>
          "server does not support TLS"

      error = assert_raise Error, fn -> Locks.held?(TestDB.uuid(), TestDB.uuid(), "t") end
      assert {error.reason, error.message} == {:connect, no_tls}
    end

    test "sslmode: from the library's setting, or from the url" do
      :ok = AppEnv.restart(url: TestDB.url(), sslmode: :require)
      no_tls!()
      :ok = AppEnv.restart(url: with_query(TestDB.url(), "sslmode=require"))
      no_tls!()
      :ok = AppEnv.restart(url: with_query(TestDB.url(), "sslmode=require"), sslmode: :disable)
      turn()
    end

    test "the repo's ssl: true asks for TLS (verify_full); ssl: false is disable" do
      Application.put_env(:locks_fake_host, FakeRepo, url: TestDB.url(), ssl: true)
      :ok = AppEnv.restart(repo: FakeRepo)
      no_tls!()

      Application.put_env(:locks_fake_host, FakeRepo, url: TestDB.url(), ssl: false)
      :ok = AppEnv.restart(repo: FakeRepo)
      turn()
    end

    test "a verifying mode reads its CA file at the start" do
      dir =
        Path.join(System.tmp_dir!(), "locks_lifecycle_ca_#{System.unique_integer([:positive])}")

      File.mkdir_p!(dir)
      on_exit(fn -> File.rm_rf!(dir) end)
      ca = Path.join(dir, "ca.pem")

      {_, 0} =
        System.cmd(
          "openssl",
          ~w(req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1
             -subj /CN=lifecycle-test -keyout #{Path.join(dir, "ca.key")} -out #{ca}),
          stderr_to_stdout: true
        )

      :ok = AppEnv.restart(url: TestDB.url(), sslmode: :verify_full, ssl_ca_file: ca)
      no_tls!()
    end
  end
end
