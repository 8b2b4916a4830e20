defmodule PhoenixKitAgent.Turns.ConfigTest do
  # What `config :phoenix_kit_agent_locks, …` (and a host's repo, a URL,
  # DATABASE_URL) becomes: one struct of checked settings for the native
  # side. Pure: nothing is started or connected here, each test makes a repo
  # module of its own, and DATABASE_URL is only read.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks.{Config, Error, FakeRepo, SandboxRepo}

  # DATABASE_URL is set for the whole test run (test_helper.exs).
  defp database_url, do: System.fetch_env!("DATABASE_URL")

  defp read!(env) do
    {:ok, config} = Config.read(env)
    config
  end

  # A config with every setting at its default but those given.
  defp defaults(fields) do
    struct!(
      %Config{
        port: 5432,
        username: nil,
        database: nil,
        sslmode: :prefer,
        application_name: "phoenix_kit_agent_locks",
        pool_size: Config.default_pool_size(),
        connect_timeout: 5_000,
        checkout_timeout: 5_000,
        statement_timeout: 5_000,
        prepare: :named,
        endpoints: [],
        target_server_type: :primary
      },
      fields
    )
  end

  defp refused(env) do
    error = assert_raise Error, fn -> Config.read(env) end
    assert error.reason == :config
    error.message
  end

  describe "a url" do
    test "is taken apart into its settings" do
      assert read!(url: "postgres://u:pw@db:5433/app") ==
               defaults(
                 hostname: "db",
                 port: 5433,
                 username: "u",
                 password: "pw",
                 database: "app"
               )
    end

    test "is decoded: percent-encoded parts, sslmode and sslrootcert parameters" do
      assert read!(
               url:
                 "postgresql://app:p%40ss%3Aw@db/my%20db?sslmode=verify-full&sslrootcert=%2Fca.pem"
             ) ==
               defaults(
                 hostname: "db",
                 username: "app",
                 password: "p@ss:w",
                 database: "my db",
                 sslmode: :verify_full,
                 ssl_ca_file: "/ca.pem"
               )
    end

    test "names a socket directory by a host that is a path, or a host= parameter" do
      assert %Config{socket_dir: "/run/postgresql", hostname: nil, port: 5433} =
               read!(url: "postgres://app@%2Frun%2Fpostgresql:5433/app")

      assert %Config{socket_dir: "/run/postgresql", hostname: nil} =
               read!(url: "postgres://app@/app?host=/run/postgresql")
    end

    test "an upper-case scheme is a scheme; prepare= is the prepare setting" do
      assert %Config{hostname: "db", prepare: :unnamed} =
               read!(url: "POSTGRES://app@db/app?prepare=unnamed")
    end
  end

  describe "where to connect" do
    test "with nothing configured, DATABASE_URL is the fallback" do
      assert read!([]) == read!(url: database_url())
    end

    test "discrete settings alone name the server: DATABASE_URL is not used" do
      assert read!(hostname: "db", port: 6432, username: "u", database: "app") ==
               defaults(hostname: "db", port: 6432, username: "u", database: "app")

      assert read!(socket_dir: "/run/postgresql", username: "u", database: "app") ==
               defaults(socket_dir: "/run/postgresql", username: "u", database: "app")
    end

    test "a discrete setting without a server overrides DATABASE_URL's part" do
      assert read!(password: "other") == %{read!([]) | password: "other"}
    end

    test "discrete settings override the url's parts; a hostname its socket directory too" do
      assert read!(url: "postgres://u:pw@%2Frun/app", hostname: "bouncer", database: "other") ==
               defaults(hostname: "bouncer", username: "u", password: "pw", database: "other")
    end

    test "the user defaults to PGUSER or USER; a database must be named" do
      user = System.get_env("PGUSER") || System.get_env("USER")
      if user, do: assert(read!(url: "postgres://db/app").username == user)

      assert refused(url: "postgres://u@db") ==
               "invalid configuration: database: missing: no database in the url, the repo or the settings"
    end
  end

  describe "repo:" do
    test "takes the location, credentials, TLS, prefix and prepare from the repo's config/0" do
      repo =
        FakeRepo.new(
          hostname: "db.internal",
          port: 5433,
          username: "app",
          password: "pw",
          database: "app_prod",
          ssl: true,
          prefix: "phoenix_kit",
          prepare: :unnamed,
          # An Ecto repo's own pool and timeouts are not the library's.
          pool_size: 40,
          timeout: 15_000
        )

      assert read!(repo: repo) ==
               defaults(
                 hostname: "db.internal",
                 port: 5433,
                 username: "app",
                 password: "pw",
                 database: "app_prod",
                 # Postgrex's ssl: true: verified against the OS store.
                 sslmode: :verify_full,
                 ssl_cacerts: for({:cert, der, _} <- :public_key.cacerts_get(), do: der),
                 prefix: "phoenix_kit",
                 prepare: :unnamed
               )
    end

    test "an Ecto repo configured by url: arrives as discrete settings" do
      repo = FakeRepo.new(url: "postgres://app:p%40ss@db:5432/app_dev")

      assert read!(repo: repo) ==
               defaults(
                 hostname: "db",
                 username: "app",
                 password: "p@ss",
                 database: "app_dev",
                 sslmode: :disable
               )
    end

    test "a repo whose config/0 gives a url has it parsed, with the url's own sslmode" do
      url = "postgres://app:pw@db/app?sslmode=verify-full&sslrootcert=/ca.pem"
      repo = FakeRepo.new(url: url, keep_url: true)
      assert read!(repo: repo) == read!(url: url)
    end

    test "explicit library settings override the repo's, a hostname its socket_dir too" do
      repo =
        FakeRepo.new(
          socket_dir: "/run/postgresql",
          username: "app",
          password: "pw",
          database: "app",
          prefix: "from_repo"
        )

      assert read!(
               repo: repo,
               hostname: "pgbouncer",
               username: "locks",
               prefix: "locks",
               pool_size: 4
             ) ==
               defaults(
                 hostname: "pgbouncer",
                 username: "locks",
                 password: "pw",
                 database: "app",
                 sslmode: :disable,
                 prefix: "locks",
                 pool_size: 4
               )
    end

    test "a library url replaces the repo's connection as a whole; the repo's prefix stays" do
      repo = FakeRepo.new(hostname: "db", username: "app", password: "pw", prefix: "kit")

      assert read!(repo: repo, url: "postgres://locks@other/locks") ==
               defaults(hostname: "other", username: "locks", database: "locks", prefix: "kit")
    end

    test "a repo without a server falls back to DATABASE_URL below it" do
      repo = FakeRepo.new(username: "app", prefix: "kit")

      assert read!(repo: repo) ==
               %{read!([]) | username: "app", sslmode: :disable, prefix: "kit"}
    end

    test "Postgrex's socket: names the directory and the port" do
      repo =
        FakeRepo.new(socket: "/var/run/postgresql/.s.PGSQL.5433", database: "app", username: "u")

      assert read!(repo: repo) ==
               defaults(
                 socket_dir: "/var/run/postgresql",
                 port: 5433,
                 username: "u",
                 database: "app",
                 sslmode: :disable
               )
    end
  end

  describe "several servers (endpoints:, target_server_type:, a multi-host url)" do
    test "a repo's endpoints: win over its hostname:/port:, as in Postgrex; the first is " <>
           "hostname/port" do
      repo =
        FakeRepo.new(
          hostname: "localhost",
          port: 5432,
          endpoints: [{"db-b", 5433}, {"db-a", 5432}],
          target_server_type: :primary,
          username: "app",
          database: "app"
        )

      assert read!(repo: repo) ==
               defaults(
                 hostname: "db-b",
                 port: 5433,
                 endpoints: [{"db-b", 5433}, {"db-a", 5432}],
                 username: "app",
                 database: "app",
                 sslmode: :disable
               )
    end

    test "target_server_type is :primary unless set; :any is taken" do
      repo = FakeRepo.new(endpoints: [{"db-a", 5432}], username: "app", database: "app")
      assert %Config{target_server_type: :primary} = read!(repo: repo)
      assert %Config{target_server_type: :any} = read!(repo: repo, target_server_type: :any)
    end

    test "a multi-host url lists its servers in order, each with its port or 5432; " <>
           "target_session_attrs is the target_server_type" do
      assert read!(
               url:
                 "postgres://u:pw@db-a:5433,[::1],db-c:6432/app?target_session_attrs=read-write"
             ) ==
               defaults(
                 hostname: "db-a",
                 port: 5433,
                 endpoints: [{"db-a", 5433}, {"::1", 5432}, {"db-c", 6432}],
                 username: "u",
                 password: "pw",
                 database: "app"
               )

      for {attrs, type} <- [{"primary", :primary}, {"any", :any}] do
        assert %Config{target_server_type: ^type} =
                 read!(url: "postgres://u@a,b/app?target_session_attrs=#{attrs}")
      end
    end

    test "the library's own hostname: replaces a repo's endpoints:, its own endpoints: a " <>
           "repo's hostname:" do
      repo = FakeRepo.new(endpoints: [{"db-a", 5432}, {"db-b", 5432}], database: "app")

      assert %Config{hostname: "bouncer", port: 5432, endpoints: []} =
               read!(repo: repo, hostname: "bouncer", username: "u")

      repo = FakeRepo.new(hostname: "db", database: "app")

      assert %Config{hostname: "db-a", endpoints: [{"db-a", 5432}, {"db-b", 5433}]} =
               read!(repo: repo, endpoints: [{"db-a", 5432}, {"db-b", 5433}], username: "u")
    end

    test ":secondary is refused, naming the fix; so are endpoints that are not {host, port}" do
      assert refused(hostname: "db", database: "app", target_server_type: :secondary) ==
               "invalid configuration: target_server_type: must be :primary (the default) or " <>
                 ":any: lock calls write, which a secondary (a standby) refuses; give :primary, " <>
                 "with every server the primary may be on, got: :secondary"

      for endpoints <- [[], [{"db", 0}], [{"", 5432}], ["db:5432"], {"db", 5432}] do
        assert refused(endpoints: endpoints, database: "app") ==
                 "invalid configuration: endpoints: must be a list of {hostname, port} tuples, " <>
                   ~s(e.g. [{"db-a", 5432}, {"db-b", 5432}], got: #{inspect(endpoints)})
      end
    end
  end

  describe "PhoenixKit's repo (config :phoenix_kit, repo:)" do
    # Config.read/2's second argument is PhoenixKit's configuration, as
    # `config :phoenix_kit, repo: MyApp.Repo` makes it.
    defp kit_repo, do: FakeRepo.new(hostname: "kitdb", username: "kit", database: "kit_app")

    test "with no repo:, url: or server of the library's own, is taken, before DATABASE_URL" do
      assert Config.read([], repo: kit_repo()) ==
               {:ok,
                defaults(
                  hostname: "kitdb",
                  username: "kit",
                  database: "kit_app",
                  sslmode: :disable
                )}

      assert Config.read([password: "pw", pool_size: 2], repo: kit_repo()) ==
               {:ok,
                defaults(
                  hostname: "kitdb",
                  username: "kit",
                  password: "pw",
                  database: "kit_app",
                  sslmode: :disable,
                  pool_size: 2
                )}
    end

    test "the library's own repo:, url: or server wins, and PhoenixKit's is not read" do
      own = FakeRepo.new(hostname: "own", username: "u", database: "d")

      for env <- [
            [repo: own],
            [url: "postgres://u@other/d"],
            [hostname: "h", username: "u", database: "d"],
            [socket_dir: "/run/postgresql", username: "u", database: "d"]
          ] do
        assert Config.read(env, repo: "not even a module") == Config.read(env, [])
      end
    end

    test "is the repo of testing: :sandbox when the library names none" do
      assert Config.testing([testing: :sandbox], repo: SandboxRepo) ==
               {:sandbox, SandboxRepo, nil}

      # The library's own repo: wins: here one without query/3, refused.
      error =
        assert_raise Error, fn ->
          Config.testing([testing: :sandbox, repo: FakeRepo], repo: SandboxRepo)
        end

      assert error.message =~ "repo: PhoenixKitAgent.Turns.Locks.FakeRepo has no query/3"
    end

    test "one that is not a module is refused, naming where it came from" do
      error = assert_raise Error, fn -> Config.read([], repo: "MyApp.Repo") end

      assert {error.reason, error.message} ==
               {:config,
                "invalid configuration: repo (config :phoenix_kit): must be a module, " <>
                  "e.g. MyApp.Repo, got: \"MyApp.Repo\""}
    end
  end

  describe "TLS from the repo's ssl: and ssl_opts:, with Postgrex 0.21's meaning" do
    defp tls(config) do
      config = read!(repo: FakeRepo.new([hostname: "db", username: "u", database: "d"] ++ config))

      Map.take(
        config,
        [:sslmode, :ssl_ca_file, :ssl_cacerts, :ssl_cert_file, :ssl_key_file] ++
          [:ssl_cert, :ssl_key, :ssl_server_name]
      )
      |> Enum.reject(fn {_key, value} -> value == nil end)
      |> Enum.sort()
    end

    defp tls_refused(config),
      do: refused(repo: FakeRepo.new([hostname: "db", username: "u", database: "d"] ++ config))

    # The OS store as OTP reads it, DER; one certificate of it; an EC key.
    defp os_store, do: for({:cert, der, _} <- :public_key.cacerts_get(), do: der)
    defp a_der, do: hd(os_store())

    defp ec_key do
      key = :public_key.generate_key({:namedCurve, :secp256r1})
      :public_key.der_encode(:ECPrivateKey, key)
    end

    defp https, do: [match_fun: :public_key.pkix_verify_hostname_match_fun(:https)]

    test "off (Postgrex's default) is sslmode disable" do
      assert tls([]) == [sslmode: :disable]
      assert tls(ssl: false) == [sslmode: :disable]
      assert tls(ssl: false, ssl_opts: [verify: :verify_none]) == [sslmode: :disable]
    end

    test "ssl: true verifies chain and host name against the OS store" do
      assert tls(ssl: true) == [ssl_cacerts: os_store(), sslmode: :verify_full]
    end

    test "a keyword list verifies with the CA it gives: DER, cacerts_get/0's records, or a file" do
      assert tls(ssl: [cacerts: [a_der()]]) == [ssl_cacerts: [a_der()], sslmode: :verify_full]

      assert tls(ssl: [cacerts: :public_key.cacerts_get(), customize_hostname_check: https()]) ==
               [ssl_cacerts: os_store(), sslmode: :verify_full]

      assert tls(ssl: [verify: :verify_peer, cacertfile: ~c"/ca.pem"]) ==
               [ssl_ca_file: "/ca.pem", sslmode: :verify_full]

      # cacerts: wins over cacertfile:, as in :ssl.
      assert tls(ssl: [cacertfile: "/ca.pem", cacerts: [a_der()]]) ==
               [ssl_cacerts: [a_der()], sslmode: :verify_full]
    end

    test "server_name_indication names the host checked; :disable checks none (verify_ca)" do
      assert tls(ssl: [cacertfile: "/ca.pem", server_name_indication: ~c"db.example"]) ==
               [ssl_ca_file: "/ca.pem", ssl_server_name: "db.example", sslmode: :verify_full]

      assert tls(ssl: [cacertfile: "/ca.pem", server_name_indication: :disable]) ==
               [ssl_ca_file: "/ca.pem", sslmode: :verify_ca]
    end

    test "verify: :verify_none is require: encrypted, not verified; a client certificate stays" do
      assert tls(ssl: [verify: :verify_none]) == [sslmode: :require]

      assert tls(ssl: [verify: :verify_none, cacertfile: "/ca.pem", certfile: "/c.pem"]) ==
               [ssl_cert_file: "/c.pem", ssl_key_file: "/c.pem", sslmode: :require]
    end

    test "ssl: true with ssl_opts: (older Postgrex) takes the list as it is, verifying" do
      assert tls(ssl: true, ssl_opts: [cacertfile: "/ca.pem"]) ==
               [ssl_ca_file: "/ca.pem", sslmode: :verify_full]

      assert tls(ssl: true, ssl_opts: [verify: :verify_none]) == [sslmode: :require]
    end

    test "client certificates: files (a certfile alone holds the key too) or DER" do
      assert tls(ssl: [cacertfile: "/ca.pem", certfile: "/c.pem", keyfile: ~c"/k.pem"]) ==
               [ssl_ca_file: "/ca.pem", ssl_cert_file: "/c.pem", ssl_key_file: "/k.pem"] ++
                 [sslmode: :verify_full]

      key = ec_key()

      assert tls(ssl: [cacertfile: "/ca.pem", cert: a_der(), key: {:ECPrivateKey, key}]) ==
               [ssl_ca_file: "/ca.pem", ssl_cert: [a_der()], ssl_key: {:sec1, key}] ++
                 [sslmode: :verify_full]
    end

    test "what cannot be honoured stops the start, naming the option, where it came from " <>
           "and what to write" do
      for {config, message} <- [
            {[
               ssl: [
                 cacertfile: "/ca.pem",
                 verify_fun: {fn _, _, state -> {:valid, state} end, []}
               ]
             ],
             "config()[:ssl][:verify_fun]: the library cannot run an Erlang verify function: it checks the chain and the host name as verify: :verify_peer does; give the CA with cacerts: or cacertfile: instead (or verify: :verify_none not to check)"},
            {[ssl: true, ssl_opts: [cacertfile: "/ca.pem", versions: [:"tlsv1.2"]]],
             "config()[:ssl_opts][:versions]: an :ssl option the library does not honour (it speaks TLS with rustls): remove it; the options it reads are :verify, :cacerts, :cacertfile, :certfile, :keyfile, :cert, :key, :server_name_indication, :customize_hostname_check"},
            {[ssl: [cacertfile: "/ca.pem", keyfile: "/k.pem", password: ~c"s3cr3t"]],
             "config()[:ssl][:password]: encrypted keys cannot be read: give keyfile: an unencrypted PEM key, or key: as DER"},
            {[ssl: []],
             "config()[:ssl]: verify: :verify_peer (Postgrex's default) needs the CA certificates to trust, and Postgrex connects with none: write cacerts: :public_key.cacerts_get() (the OS store, for managed PostgreSQL), cacertfile: \"ca.pem\" or cacerts: [der], or verify: :verify_none to connect without checking the certificate (what ssl: true did before Postgrex 0.18, and ssl_opts: on OTP 25)"},
            {[ssl: true, ssl_opts: [server_name_indication: ~c"db"]],
             "config()[:ssl_opts]: verify: :verify_peer (Postgrex's default) needs the CA"},
            {[ssl: [cacerts: ["not a certificate"]]],
             "config()[:ssl][:cacerts]: certificate 1 of 1 is not a DER certificate"},
            {[ssl: [cacerts: [a_der(), :x]]],
             "config()[:ssl][:cacerts]: must hold DER certificates, got: :x at 2"},
            {[ssl: [cacertfile: "/ca.pem", certfile: "/c.pem", key: {:ECPrivateKey, "s3cr3t"}]],
             "config()[:ssl][:key]: is not a ECPrivateKey DER encoding"},
            {[ssl: [cacertfile: "/ca.pem", certfile: "/c.pem", key: {:DSAPrivateKey, "s3cr3t"}]],
             "config()[:ssl][:key]: must be {type, der} with type :ECPrivateKey, :PrivateKeyInfo, :RSAPrivateKey (an engine key cannot be read): give keyfile: a PEM key instead"},
            {[ssl: [cacertfile: "/ca.pem", customize_hostname_check: [match_fun: &Kernel.==/2]]],
             "config()[:ssl][:customize_hostname_check]: the library checks host names as :public_key.pkix_verify_hostname_match_fun(:https) does (Postgrex's default): remove it, or write [match_fun: :public_key.pkix_verify_hostname_match_fun(:https)]"},
            {[ssl: [verify: :verify_nothing]],
             "config()[:ssl][:verify]: must be :verify_peer or :verify_none, got: :verify_nothing"},
            {[ssl: [cacertfile: 5]], "config()[:ssl][:cacertfile]: must be a path, got: 5"},
            {[ssl: [:verify_none]], "config()[:ssl]: must be a keyword list, got: [:verify_none]"}
          ] do
        message_given = tls_refused(config)

        assert message_given =~
                 ~r/\Ainvalid configuration: PhoenixKitAgent\.Turns\.Locks\.FakeRepo\.Repo\d+\./

        assert String.contains?(message_given, message), "#{message_given}\nlacks\n#{message}"
        refute message_given =~ "s3cr3t"
      end
    end

    test "the library's own settings override the repo's, a file its DER too" do
      assert %Config{sslmode: :verify_ca, ssl_ca_file: "/mine.pem", ssl_cacerts: nil} =
               read!(
                 repo: FakeRepo.new(hostname: "db", username: "u", database: "d", ssl: true),
                 sslmode: :verify_ca,
                 ssl_ca_file: "/mine.pem"
               )

      assert %Config{sslmode: :require, ssl_cert_file: "/c.pem", ssl_key_file: "/k.pem"} =
               read!(
                 repo:
                   FakeRepo.new(
                     hostname: "db",
                     username: "u",
                     database: "d",
                     ssl: [verify: :verify_none, cert: a_der(), key: {:ECPrivateKey, ec_key()}]
                   ),
                 ssl_cert_file: "/c.pem",
                 ssl_key_file: "/k.pem"
               )
    end
  end

  describe "TLS in the library's own settings and URLs" do
    test "sslcert and sslkey are the client certificate, as in libpq" do
      assert %Config{ssl_cert_file: "/c.pem", ssl_key_file: "/k.pem"} =
               read!(url: "postgres://u@h/db?sslmode=verify-full&sslcert=/c.pem&sslkey=%2Fk.pem")

      assert %Config{ssl_cert_file: "/c.pem", ssl_key_file: "/k.pem"} =
               read!(url: "postgres://u@h/db", ssl_cert_file: "/c.pem", ssl_key_file: "/k.pem")
    end

    test "ssl_ca_file \"system\" (sslrootcert=system) is the OS store, and verify_full" do
      os_store = for {:cert, der, _} <- :public_key.cacerts_get(), do: der

      for env <- [
            [url: "postgres://u@h/db?sslrootcert=system"],
            [url: "postgres://u@h/db", ssl_ca_file: "system", sslmode: :verify_full]
          ] do
        assert %Config{sslmode: :verify_full, ssl_ca_file: nil, ssl_cacerts: ^os_store} =
                 read!(env)
      end

      assert refused(url: "postgres://u@h/db?sslrootcert=system&sslmode=verify-ca") ==
               "invalid configuration: sslmode: must be :verify_full with ssl_ca_file \"system\" " <>
                 "(the OS store, as libpq's sslrootcert=system), got: :verify_ca"
    end
  end

  describe "defaults" do
    test "sslmode takes the atoms, or libpq's spelling" do
      for {atom, libpq} <- [
            disable: "disable",
            prefer: "prefer",
            require: "require",
            verify_ca: "verify-ca",
            verify_full: "verify-full"
          ] do
        assert read!(url: "postgres://u@h/db", sslmode: atom).sslmode == atom
        assert read!(url: "postgres://u@h/db", sslmode: libpq).sslmode == atom
        assert read!(url: "postgres://u@h/db?sslmode=#{libpq}").sslmode == atom
      end
    end

    test "pool_size leaves two of the VM's dirty-I/O schedulers to the rest of the VM, " <>
           "whatever is set" do
      dirty_io = :erlang.system_info(:dirty_io_schedulers)
      assert Config.default_pool_size() == dirty_io - 2
      assert read!(url: "postgres://u@h/db").pool_size == Config.default_pool_size()
      assert read!(url: "postgres://u@h/db", pool_size: 3).pool_size == 3

      log =
        ExUnit.CaptureLog.capture_log(fn ->
          for size <- [dirty_io - 1, 1_000] do
            assert read!(url: "postgres://u@h/db", pool_size: size).pool_size == dirty_io - 2
          end
        end)

      assert log =~
               "pool_size 1000 is more than the #{dirty_io - 2} lock calls that may run at once " <>
                 "(the VM's #{dirty_io} dirty-I/O schedulers less two; +SDio raises them): " <>
                 "#{dirty_io - 2} connections are used"
    end
  end

  describe "a bad setting" do
    test "raises Locks.Error :config naming it and, as argument errors do, the value it got; never a password or a url" do
      for {env, message} <- [
            {[urll: "x"],
             "invalid configuration: unknown setting :urll; the settings are :repo, :url, :hostname, :socket_dir, :port, :endpoints, :target_server_type, :username, :password, :database, :sslmode, :ssl_ca_file, :ssl_cert_file, :ssl_key_file, :application_name, :prefix, :pool_size, :connect_timeout, :checkout_timeout, :statement_timeout, :prepare, :testing"},
            {[url: ~c"postgres://u:s3cr3t@h/db"], "invalid configuration: url: must be a string"},
            {[password: 123_456], "invalid configuration: password: must be a string"},
            {[url: "postgres://h/db", port: "5432"],
             ~s{invalid configuration: port: must be an integer from 1 to 65535, got: "5432"}},
            {[url: "postgres://h/db", pool_size: 0],
             "invalid configuration: pool_size: must be an integer from 1 to 1000, got: 0"},
            {[url: "postgres://h/db", pool_size: "4"],
             ~s{invalid configuration: pool_size: must be an integer from 1 to 1000, got: "4"}},
            {[url: "postgres://h/db", checkout_timeout: 2 ** 64],
             "invalid configuration: checkout_timeout: must be an integer from 1 to 3600000 (milliseconds), got: 18446744073709551616"},
            {[url: "postgres://h/db", sslmode: :verify],
             "invalid configuration: sslmode: must be one of :disable, :prefer, :require, :verify_ca, :verify_full, got: :verify"},
            {[url: "postgres://h/db", sslmode: "verify"],
             ~s{invalid configuration: sslmode: must be one of :disable, :prefer, :require, :verify_ca, :verify_full, got: "verify"}},
            {[url: "postgres://h/db", prepare: true],
             "invalid configuration: prepare: must be :named or :unnamed, got: true"},
            {[url: "postgres://h/db", prefix: "a b"],
             ~s{invalid configuration: prefix: must be an identifier: a letter or _, then letters, digits, _ or $ (at most 63), got: "a b"}},
            {[url: "postgres://h/db", socket_dir: "run/pg"],
             ~s{invalid configuration: socket_dir: must be an absolute directory, got: "run/pg"}},
            {[url: "postgres://h/db", hostname: ""],
             ~s{invalid configuration: hostname: must not be empty, got: ""}},
            {[url: "postgres://h/db", application_name: [1, 2, 3, 4, 5, 6, 7]],
             "invalid configuration: application_name: must be a string, got: [1, 2, 3, 4, 5, ...]"},
            {[url: "postgres://h/db", prefix: String.duplicate("a", 70)],
             ~s{invalid configuration: prefix: must be an identifier: a letter or _, then letters, digits, _ or $ (at most 63), got: "#{String.duplicate("a", 64)}" <> ...}},
            {[repo: "MyApp.Repo"],
             ~s{invalid configuration: repo: must be a module, e.g. MyApp.Repo, got: "MyApp.Repo"}},
            {[repo: NoSuch.Repo],
             "invalid configuration: repo: NoSuch.Repo is not a module with config/0 (an Ecto repo)"},
            {[repo: FakeRepo.new(hostname: :db)],
             ~r/\Ainvalid configuration: PhoenixKitAgent\.Turns\.Locks\.FakeRepo\.Repo\d+\.config\(\)\[:hostname\]: must be a string, got: :db\z/},
            {[repo: FakeRepo.new(hostname: "db", ssl: :yes)],
             ~r/\Ainvalid configuration: PhoenixKitAgent\.Turns\.Locks\.FakeRepo\.Repo\d+\.config\(\)\[:ssl\]: must be a boolean or a keyword list, got: :yes\z/},
            {[repo: FakeRepo.new(socket: 5432, database: "d")],
             ~r/\Ainvalid configuration: PhoenixKitAgent\.Turns\.Locks\.FakeRepo\.Repo\d+\.config\(\)\[:socket\]: must be a string, got: 5432\z/},
            {[repo: FakeRepo.new(hostname: "db", ssl: true, ssl_opts: [cacertfile: :ca])],
             ~r/\Ainvalid configuration: PhoenixKitAgent\.Turns\.Locks\.FakeRepo\.Repo\d+\.config\(\)\[:ssl_opts\]\[:cacertfile\]: must be a path, got: :ca\z/},
            {[repo: FakeRepo.new(hostname: "db", password: ~c"s3cr3t")],
             ~r/\Ainvalid configuration: PhoenixKitAgent\.Turns\.Locks\.FakeRepo\.Repo\d+\.config\(\)\[:password\]: must be a string\z/}
          ] do
        message_given = refused(env)

        if is_binary(message),
          do: assert(message_given == message),
          else: assert(message_given =~ message)

        refute message_given =~ "s3cr3t"
        refute message_given =~ "123456"
      end
    end

    test "a url that cannot be used names the part, never the text" do
      for {url, why} <- [
            {" postgres://u:s3cr3t@h/db", "must be a postgres:// or postgresql:// URL"},
            {"mysql://u:s3cr3t@h/db", "must be a postgres:// or postgresql:// URL"},
            {"host=h user=u password=s3cr3t", "must be a postgres:// or postgresql:// URL"},
            {"postgres://u:s3cr3t@h:port/db", "has a port that is not a number"},
            {"postgres://u:s3cr3t@h:70000/db", "must be an integer from 1 to 65535"},
            {"postgres://u:s3cr3t@a:1,:2/db", "has a server that is not host:port"},
            {"postgres://u:s3cr3t@/db?host=a,b",
             "names several hosts in host=; list them as postgres://a:5432,b:5433/db"},
            {"postgres://u:s3cr3t@a:1,b:2/db?target_session_attrs=standby",
             "must be :primary (the default) or :any: lock calls write, which a secondary " <>
               "(a standby) refuses; give :primary, with every server the primary may be on"},
            {"postgres://u:s3cr3t%zz@h/db", "is not percent-encoded correctly"},
            {"postgres://u:s3cr3t@h/db?options=-c%20x%3Dy",
             "has an unsupported parameter \"options\""},
            {"postgres://u:s3cr3t@h/db?sslmode=s3cr3t",
             "must be one of :disable, :prefer, :require, :verify_ca, :verify_full"}
          ] do
        assert refused(url: url) == "invalid configuration: url: #{why}"
        assert refused(repo: FakeRepo.new(url: url, keep_url: true)) =~ "config()[:url]: #{why}"
      end
    end
  end

  describe "secrets" do
    # Odd URLs, refused or accepted, each with a password found nowhere else:
    # its parts percent-encoded or not, the scheme in any case, spaces and
    # control characters around it, separators inside the password.
    @password "S3cr3t-pw"
    defp odd_urls do
      specials = [
        "",
        "@",
        ":",
        "/",
        "?",
        "#",
        "%",
        "%40",
        " ",
        "'",
        "\"",
        "\\",
        "&",
        "=",
        "[",
        "é"
      ]

      for scheme <- ["postgres", "POSTGRES", "PostgreSQL", "mysql", ""],
          sep <- ["://", ":/", ":"],
          special <- specials,
          around <- ["", " ", "\n"] do
        password = @password <> special <> @password
        "#{around}#{scheme}#{sep}user:#{password}@db.example:5432/app?sslmode=require#{around}"
      end
    end

    # A repo module is compiled for each of the 1,440 URLs: on a loaded 2-core
    # machine that has taken more than ExUnit's default minute.
    @tag timeout: 300_000
    test "no refusal, inspect or exception of an odd url shows its password" do
      urls = odd_urls()
      assert length(urls) > 500

      shown =
        for url <- urls, env <- [[url: url], [repo: FakeRepo.new(url: url, keep_url: true)]] do
          try do
            case Config.read(env) do
              {:ok, config} -> inspect(config)
              :unconfigured -> ""
            end
          rescue
            error in Error -> Exception.format(:error, error, __STACKTRACE__) <> inspect(error)
          end
        end

      for text <- shown, do: refute(text =~ @password, text)
      # Some of them are accepted, some refused: both are looked at.
      assert Enum.any?(shown, &(&1 =~ "#PhoenixKitAgent.Turns.Locks.Config<"))
      assert Enum.any?(shown, &(&1 =~ "invalid configuration: url"))
    end

    test "inspect of an accepted configuration shows every setting but the password" do
      shown =
        inspect(read!(url: "postgres://locks:#{@password}@db/app", password: @password <> "2"))

      refute shown =~ @password
      assert shown =~ ~s(username: "locks")
    end
  end
end

defmodule PhoenixKitAgent.Turns.ConfigTest.PhoenixKitHost do
  # A PhoenixKit host: `config :phoenix_kit, repo:` set, nothing under
  # :phoenix_kit_agent_locks. The application starts on that repo's settings
  # and the lock calls work. `async: false`: it sets PhoenixKit's
  # configuration and restarts the application, which every test shares.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{AppEnv, Config, FakeRepo, TestDB}

  test "with only PhoenixKit's repo configured, the lock calls run on its database" do
    AppEnv.restore_on_exit()
    on_exit(fn -> Application.delete_env(:phoenix_kit, :repo) end)
    # The tests' database, through the repo's settings: its prepare: shows
    # they were taken (DATABASE_URL names the same server, but not that).
    repo = FakeRepo.new(url: TestDB.url(), prepare: :unnamed)
    Application.put_env(:phoenix_kit, :repo, repo)
    :ok = AppEnv.restart([])

    {:ok, config} = Config.read()
    assert {config.hostname, config.prepare} == {repo.config()[:hostname], :unnamed}

    chat = TestDB.insert_chat!()
    user = TestDB.uuid()
    assert Locks.acquire(chat, user, "turn-kit", 60) == :ok
    assert Locks.held?(chat, user, "turn-kit") == true
    assert Locks.release(chat, user, "turn-kit") == :ok
  end
end
