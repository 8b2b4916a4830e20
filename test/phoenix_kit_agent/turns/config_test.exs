defmodule PhoenixKitAgent.Turns.ConfigTest do
  # What `config :phoenix_kit_agent_locks, …` (and a host's repo) becomes
  # for the native side. Pure: nothing is started or connected here, each
  # test makes a repo module of its own, and DATABASE_URL is only read.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks.{Config, FakeRepo}

  @dirty_io :erlang.system_info(:dirty_io_schedulers)

  # Every field at its default: no connection, the VM's pool size.
  defp defaults(fields), do: struct!(%Config{pool_size: @dirty_io}, fields)

  describe "where to connect" do
    test "the library's url is taken as it is" do
      assert Config.read(url: "postgres://u:pw@db:5433/app") ==
               defaults(url: "postgres://u:pw@db:5433/app")
    end

    test "with nothing configured, DATABASE_URL is the fallback" do
      assert Config.read([]) == defaults(url: System.get_env("DATABASE_URL"))
    end

    test "discrete library settings are a location of their own: no DATABASE_URL" do
      assert Config.read(hostname: "db", port: 6432, username: "u", database: "app") ==
               defaults(host: "db", port: 6432, user: "u", dbname: "app")

      assert Config.read(socket_dir: "/run/postgresql", database: "app") ==
               defaults(socket_dir: "/run/postgresql", dbname: "app")
    end

    test "a discrete setting without a location overrides DATABASE_URL's part" do
      assert Config.read(password: "other") ==
               defaults(url: System.get_env("DATABASE_URL"), password: "other")
    end
  end

  describe "repo:" do
    test "takes the location, credentials, TLS and prefix from the repo's config/0" do
      repo =
        FakeRepo.new(
          hostname: "db.internal",
          port: 5433,
          username: "app",
          password: "pw",
          database: "app_prod",
          ssl: true,
          prefix: "phoenix_kit",
          # An Ecto repo's own pool and timeouts are not the library's.
          pool_size: 40,
          timeout: 15_000
        )

      assert Config.read(repo: repo) ==
               defaults(
                 host: "db.internal",
                 port: 5433,
                 user: "app",
                 password: "pw",
                 dbname: "app_prod",
                 sslmode: "require",
                 prefix: "phoenix_kit"
               )
    end

    test "an Ecto repo configured by url: arrives as discrete settings" do
      repo = FakeRepo.new(url: "postgres://app:p%40ss@db:5432/app_dev")

      assert Config.read(repo: repo) ==
               defaults(
                 host: "db",
                 port: 5432,
                 user: "app",
                 password: "p@ss",
                 dbname: "app_dev",
                 sslmode: "disable"
               )
    end

    test "a repo whose config/0 gives a url keeps it, and the url's own sslmode" do
      url = "postgres://app:pw@db/app?sslmode=verify-full&sslrootcert=/ca.pem"
      repo = FakeRepo.new(url: url, keep_url: true)
      assert Config.read(repo: repo) == defaults(url: url)
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

      assert Config.read(
               repo: repo,
               hostname: "pgbouncer",
               username: "locks",
               prefix: "locks",
               pool_size: 4
             ) ==
               defaults(
                 host: "pgbouncer",
                 user: "locks",
                 password: "pw",
                 dbname: "app",
                 sslmode: "disable",
                 prefix: "locks",
                 pool_size: 4
               )
    end

    test "a library url replaces the repo's connection as a whole; the repo's prefix stays" do
      repo = FakeRepo.new(hostname: "db", username: "app", password: "pw", prefix: "kit")

      assert Config.read(repo: repo, url: "postgres://locks@other/locks") ==
               defaults(url: "postgres://locks@other/locks", prefix: "kit")
    end

    test "a repo without a location falls back to DATABASE_URL" do
      repo = FakeRepo.new(username: "app", prefix: "kit")

      assert Config.read(repo: repo) ==
               defaults(
                 url: System.get_env("DATABASE_URL"),
                 user: "app",
                 sslmode: "disable",
                 prefix: "kit"
               )
    end

    test "Postgrex's socket: names the directory and the port" do
      repo = FakeRepo.new(socket: "/var/run/postgresql/.s.PGSQL.5433", database: "app")

      assert Config.read(repo: repo) ==
               defaults(
                 socket_dir: "/var/run/postgresql",
                 port: 5433,
                 dbname: "app",
                 sslmode: "disable"
               )
    end
  end

  describe "TLS from the repo's ssl: and ssl_opts:" do
    defp sslmode(config), do: Config.read(repo: FakeRepo.new([hostname: "db"] ++ config))

    test "off (Postgrex's default) is sslmode disable" do
      assert %Config{sslmode: "disable", ssl_ca_file: nil} = sslmode([])
      assert %Config{sslmode: "disable"} = sslmode(ssl: false)
    end

    test "on without verify_peer is require: encrypted, not verified" do
      assert %Config{sslmode: "require", ssl_ca_file: nil} = sslmode(ssl: true)

      assert %Config{sslmode: "require", ssl_ca_file: "/ca.pem"} =
               sslmode(ssl: true, ssl_opts: [verify: :verify_none, cacertfile: "/ca.pem"])
    end

    test "verify_peer is verify-full with the cacertfile, in ssl_opts or in ssl itself" do
      assert %Config{sslmode: "verify-full", ssl_ca_file: "/ca.pem"} =
               sslmode(ssl: true, ssl_opts: [verify: :verify_peer, cacertfile: ~c"/ca.pem"])

      assert %Config{sslmode: "verify-full", ssl_ca_file: "/ca.pem"} =
               sslmode(ssl: [verify: :verify_peer, cacertfile: "/ca.pem"])
    end

    test "the library's sslmode and ssl_ca_file override the repo's" do
      assert %Config{sslmode: "verify-ca", ssl_ca_file: "/mine.pem"} =
               Config.read(
                 repo: FakeRepo.new(hostname: "db", ssl: true),
                 sslmode: :verify_ca,
                 ssl_ca_file: "/mine.pem"
               )
    end
  end

  describe "sslmode:" do
    test "takes libpq's modes as atoms or strings" do
      for {atom, string} <- [
            disable: "disable",
            prefer: "prefer",
            require: "require",
            verify_ca: "verify-ca",
            verify_full: "verify-full"
          ] do
        assert Config.read(url: "postgres://h/db", sslmode: atom).sslmode == string
        assert Config.read(url: "postgres://h/db", sslmode: string).sslmode == string
      end
    end
  end

  describe "pool_size:" do
    test "defaults to the VM's dirty-I/O schedulers, one connection for each" do
      assert Config.read(url: "postgres://h/db").pool_size == @dirty_io
      assert Config.read(url: "postgres://h/db", pool_size: 3).pool_size == 3
    end
  end

  describe "a bad setting" do
    test "raises ArgumentError naming it, never its value" do
      for {env, message} <- [
            {[urll: "x"],
             "invalid configuration: unknown setting :urll; the settings are :repo, :url, :hostname, :port, :username, :password, :database, :socket_dir, :sslmode, :ssl_ca_file, :prefix, :pool_size, :connect_timeout, :checkout_timeout, :statement_timeout"},
            {[url: ~c"postgres://u:s3cr3t@h/db"], "invalid configuration: url: must be a string"},
            {[password: 123_456], "invalid configuration: password: must be a string"},
            {[url: "postgres://h/db", port: "5432"],
             "invalid configuration: port: must be an integer from 1 to 65535"},
            {[url: "postgres://h/db", pool_size: 0],
             "invalid configuration: pool_size: must be an integer from 1 to 1000"},
            {[url: "postgres://h/db", checkout_timeout: 2 ** 64],
             "invalid configuration: checkout_timeout: must be an integer from 1 to 3600000"},
            {[url: "postgres://h/db", sslmode: :verify],
             "invalid configuration: sslmode: must be one of :disable, :prefer, :require, :verify_ca, :verify_full"},
            {[repo: "MyApp.Repo"],
             "invalid configuration: repo: must be a module, e.g. MyApp.Repo"},
            {[repo: NoSuch.Repo],
             "invalid configuration: repo: NoSuch.Repo is not a module with config/0 (an Ecto repo)"},
            {[repo: FakeRepo.new(hostname: ~c"db")],
             ~r/\Ainvalid configuration: repo: PhoenixKitAgent\.Turns\.Locks\.FakeRepo\.Repo\d+\.config\(\)\[:hostname\] must be a string\z/},
            {[repo: FakeRepo.new(hostname: "db", ssl: :yes)],
             ~r/\Ainvalid configuration: repo: PhoenixKitAgent\.Turns\.Locks\.FakeRepo\.Repo\d+\.config\(\)\[:ssl\] must be a boolean or a keyword list\z/}
          ] do
        error = assert_raise ArgumentError, fn -> Config.read(env) end

        if is_binary(message),
          do: assert(error.message == message),
          else: assert(error.message =~ message)

        refute error.message =~ "s3cr3t"
        refute error.message =~ "123456"
      end
    end
  end

  describe "inspect/1" do
    test "never shows the password, of the url or the setting" do
      for url <- [
            "postgres://locks:s3cr3t-pw@db/app",
            "postgres://db/app?user=locks&password=s3cr3t-pw",
            "host=db user=locks password='s3cr3t-pw' dbname=app",
            "host=db password=s3cr3t-pw"
          ] do
        shown = inspect(Config.read(url: url, password: "s3cr3t-pw2"))
        refute shown =~ "s3cr3t", shown
        assert shown =~ "**redacted**"
      end

      assert inspect(Config.read(url: "postgres://locks:pw@db/app")) =~
               ~s(url: "postgres://locks:**redacted**@db/app")
    end
  end
end
