defmodule PhoenixKitAgent.Turns.Locks.Config do
  @moduledoc false
  # Reads `config :phoenix_kit_agent_locks, …` once, when the application
  # starts, and hands the native side a struct with every key (nil = default).
  #
  # Where to connect comes from, in order:
  #
  #   1. the library's own settings (`url:`, or `hostname:`/`socket_dir:`…);
  #   2. the host's repo (`repo: MyApp.Repo`): what `MyApp.Repo.config()`
  #      says, as Ecto and Postgrex understand it;
  #   3. the `DATABASE_URL` environment variable.
  #
  # A library `url:` replaces the repo's location and credentials as a whole;
  # a discrete library setting (`username:`, `hostname:`, …) replaces only that
  # part of the repo's or of the URL's. Types and ranges are checked here,
  # the rest (a URL, an sslmode string, the prefix, the CA file) by the native
  # side; both name the setting and never show a value.

  # The settings that say where and as whom to connect.
  @connection [
    :url,
    :hostname,
    :port,
    :username,
    :password,
    :database,
    :socket_dir,
    :sslmode,
    :ssl_ca_file
  ]

  @settings [:repo] ++
              @connection ++
              [:prefix, :pool_size, :connect_timeout, :checkout_timeout, :statement_timeout]

  # Read by the Mix compiler when it builds the library (Mix.Tasks.Compile.LocksNif),
  # not here: allowed in the application's configuration, and ignored.
  @build_settings [:build_from_source]

  # Ranges as native/locks_core/src/config.rs checks them, with its wording:
  # checked here too so that an integer too large for the native side is
  # refused naming the setting, instead of failing to decode.
  @ranges %{
    port: 1..65_535,
    pool_size: 1..1_000,
    connect_timeout: 1..3_600_000,
    checkout_timeout: 1..3_600_000,
    statement_timeout: 1..3_600_000
  }

  @sslmodes %{
    disable: "disable",
    prefer: "prefer",
    require: "require",
    verify_ca: "verify-ca",
    verify_full: "verify-full"
  }

  # What `Native.start/1` takes; a struct so that `inspect/1` (a crash
  # report, a log line) never shows the password.
  defstruct [
    :url,
    :host,
    :port,
    :user,
    :password,
    :dbname,
    :socket_dir,
    :sslmode,
    :ssl_ca_file,
    :prefix,
    :pool_size,
    :connect_timeout,
    :checkout_timeout,
    :statement_timeout
  ]

  @type t :: %__MODULE__{}

  @doc """
  The options for `Native.start/1`, from the application environment (or
  `env`). Raises `ArgumentError` naming the first bad setting.
  """
  @spec read(keyword()) :: t()
  def read(env \\ Application.get_all_env(:phoenix_kit_agent_locks)) do
    env = validate!(env)
    repo = repo_settings(env[:repo])
    own = Keyword.take(env, @connection)

    connection =
      cond do
        Keyword.has_key?(own, :url) -> own
        repo != [] -> merge_location(repo, own)
        true -> own
      end

    connection =
      if located?(connection),
        do: connection,
        else: Keyword.put(connection, :url, System.get_env("DATABASE_URL"))

    %__MODULE__{
      url: connection[:url],
      host: connection[:hostname],
      port: connection[:port],
      user: connection[:username],
      password: connection[:password],
      dbname: connection[:database],
      socket_dir: connection[:socket_dir],
      sslmode: connection[:sslmode],
      ssl_ca_file: connection[:ssl_ca_file],
      prefix: Keyword.get(env, :prefix, repo[:prefix]),
      pool_size: Keyword.get(env, :pool_size, default_pool_size()),
      connect_timeout: env[:connect_timeout],
      checkout_timeout: env[:checkout_timeout],
      statement_timeout: env[:statement_timeout]
    }
  end

  @doc "Whether `options` (from `read/1`) say where the database is."
  @spec configured?(t()) :: boolean()
  def configured?(options),
    do: options.url != nil or options.host != nil or options.socket_dir != nil

  # One connection per dirty-I/O scheduler: every lock call runs on one, so
  # more connections could never be used at once, and fewer would make calls
  # wait for a connection while schedulers are free.
  defp default_pool_size, do: :erlang.system_info(:dirty_io_schedulers)

  defp located?(connection),
    do: Enum.any?([:url, :hostname, :socket_dir], &(connection[&1] != nil))

  # The library's own hostname or socket_dir replaces the repo's location.
  defp merge_location(repo, own) do
    repo =
      if Keyword.has_key?(own, :hostname) or Keyword.has_key?(own, :socket_dir),
        do: Keyword.drop(repo, [:hostname, :socket_dir]),
        else: repo

    Keyword.merge(repo, own)
  end

  ## The library's own settings

  defp validate!(env) do
    unless Keyword.keyword?(env),
      do: raise(ArgumentError, "invalid configuration: expected a keyword list of settings")

    case Keyword.keys(env) -- (@settings ++ @build_settings) do
      [] ->
        :ok

      unknown ->
        raise ArgumentError,
              "invalid configuration: unknown setting#{if length(unknown) > 1, do: "s"} " <>
                "#{Enum.map_join(unknown, ", ", &inspect/1)}; the settings are " <>
                Enum.map_join(@settings, ", ", &inspect/1)
    end

    env
    |> Keyword.drop(@build_settings)
    |> Enum.reject(fn {_key, value} -> value == nil end)
    |> Enum.map(fn {key, value} -> {key, check!(key, value)} end)
  end

  defp check!(:repo, repo) when is_atom(repo), do: repo
  defp check!(:repo, _), do: bad!(:repo, "must be a module, e.g. MyApp.Repo")

  defp check!(:sslmode, mode) when is_map_key(@sslmodes, mode), do: @sslmodes[mode]
  defp check!(:sslmode, mode) when is_binary(mode), do: mode

  defp check!(:sslmode, _),
    do: bad!(:sslmode, "must be one of :disable, :prefer, :require, :verify_ca, :verify_full")

  defp check!(key, value) when is_map_key(@ranges, key) do
    range = @ranges[key]

    if is_integer(value) and value in range,
      do: value,
      else: bad!(key, "must be an integer from #{range.first} to #{range.last}")
  end

  defp check!(key, value) do
    if is_binary(value), do: value, else: bad!(key, "must be a string")
  end

  defp bad!(key, reason), do: raise(ArgumentError, "invalid configuration: #{key}: #{reason}")

  ## The host's repo

  # What `repo.config()` says, in the library's terms. Ecto has already
  # turned a repo's `url:` into discrete settings; a repo that returns `url:`
  # itself is taken as it is.
  defp repo_settings(nil), do: []

  defp repo_settings(repo) do
    unless Code.ensure_loaded?(repo) and function_exported?(repo, :config, 0),
      do: bad!(:repo, "#{inspect(repo)} is not a module with config/0 (an Ecto repo)")

    config = repo.config()

    unless Keyword.keyword?(config),
      do: bad!(:repo, "#{inspect(repo)}.config() must return a keyword list")

    check = fn key, value, reason_if_bad ->
      if value == nil or reason_if_bad == nil,
        do: value,
        else: bad!(:repo, "#{inspect(repo)}.config()[:#{key}] #{reason_if_bad}")
    end

    text = fn key ->
      value = config[key]
      check.(key, value, if(not is_binary(value), do: "must be a string"))
    end

    {socket_dir, socket_port} = socket(config, check)
    port = config[:port] || socket_port

    port = check.(:port, port, if(not is_integer(port), do: "must be an integer from 1 to 65535"))
    {sslmode, ca_file} = ssl(config, repo)

    [
      url: text.(:url),
      hostname: text.(:hostname),
      port: port,
      username: text.(:username),
      password: text.(:password),
      database: text.(:database),
      socket_dir: text.(:socket_dir) || socket_dir,
      sslmode: sslmode,
      ssl_ca_file: ca_file,
      prefix: text.(:prefix)
    ]
    |> Enum.reject(fn {_key, value} -> value == nil end)
  end

  # Postgrex's `socket: "/run/postgresql/.s.PGSQL.5432"` names the socket
  # file: its directory and the port in its name.
  defp socket(config, check) do
    case config[:socket] do
      nil ->
        {nil, nil}

      path when is_binary(path) ->
        port =
          case Regex.run(~r/\.s\.PGSQL\.(\d+)\z/, path) do
            [_, port] -> String.to_integer(port)
            nil -> nil
          end

        {Path.dirname(path), port}

      other ->
        {check.(:socket, other, "must be a string"), nil}
    end
  end

  # Postgrex's `ssl:` / `ssl_opts:` as an sslmode: no TLS when off (Postgrex's
  # default), `verify-full` when the options ask to verify the peer (Erlang's
  # :ssl then checks the host name too), `require` otherwise. A repo that
  # only gives a URL keeps the URL's sslmode.
  defp ssl(config, repo) do
    ssl_opts =
      case {config[:ssl], config[:ssl_opts]} do
        {opts, _} when is_list(opts) -> opts
        {_, opts} when is_list(opts) -> opts
        _ -> []
      end

    case config[:ssl] do
      off when off in [nil, false] ->
        if Keyword.has_key?(config, :url), do: {nil, nil}, else: {"disable", nil}

      on when on == true or is_list(on) ->
        ca_file =
          case Keyword.get(ssl_opts, :cacertfile) do
            file when is_binary(file) or file == nil -> file
            file when is_list(file) -> List.to_string(file)
            _ -> bad!(:repo, "#{inspect(repo)}.config() ssl cacertfile must be a path")
          end

        mode = if ssl_opts[:verify] == :verify_peer, do: "verify-full", else: "require"
        {mode, ca_file}

      _ ->
        bad!(:repo, "#{inspect(repo)}.config()[:ssl] must be a boolean or a keyword list")
    end
  end
end

defimpl Inspect, for: PhoenixKitAgent.Turns.Locks.Config do
  # The password is shown as `"**redacted**"`, in the URL too (after the user
  # name, as a `password=` parameter, or in a key=value string).
  import Inspect.Algebra

  def inspect(config, opts) do
    shown =
      config
      |> Map.from_struct()
      |> Map.update!(:password, &(&1 && "**redacted**"))
      |> Map.update!(:url, &(&1 && redact(&1)))
      |> Enum.sort()

    concat(["#PhoenixKitAgent.Turns.Locks.Config<", to_doc(shown, opts), ">"])
  end

  defp redact(url) do
    url
    |> String.replace(~r{\A(postgres(?:ql)?://[^:@]*:)[^@]*@}, "\\1**redacted**@")
    |> String.replace(~r{([?&]password=)[^&]*}, "\\1**redacted**")
    |> String.replace(~r{(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]+)}, "\\1**redacted**")
  end
end
