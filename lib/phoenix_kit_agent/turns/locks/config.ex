defmodule PhoenixKitAgent.Turns.Locks.Config do
  @moduledoc false
  # guides/operating.md's "Configuration", resolved into one struct of checked values
  # that the NIF decodes as it is: every default, range and name lives here.
  # The struct keeps no URL; inspect/1 hides the password.

  require Logger

  alias PhoenixKitAgent.Turns.Locks.Error

  @app :phoenix_kit_agent_locks

  # The settings that name the server(s).
  @servers [:hostname, :endpoints, :socket_dir]

  @timeouts [:connect_timeout, :checkout_timeout, :statement_timeout]
  # The struct's fields, each a setting of the same name.
  @fields ~w(hostname socket_dir port endpoints target_server_type username password database
             sslmode ssl_ca_file ssl_cert_file ssl_key_file ssl_cacerts ssl_cert ssl_key
             ssl_server_name application_name prefix pool_size)a ++ @timeouts ++ [:prepare]
  # Fields only a repo's `ssl:` fills (Postgrex's options libpq has no
  # setting for): DER certificates and key, and the server name to check.
  @repo_only ~w(ssl_cacerts ssl_cert ssl_key ssl_server_name)a
  @settings [:repo, :url] ++ (@fields -- @repo_only) ++ [:testing]
  # Read by the Mix compiler (Mix.Tasks.Compile.LocksNif): allowed, ignored here.
  @build_settings [:build_from_source]
  # What the library takes from a repo's config/0 as it is.
  @repo_settings ~w(hostname port endpoints target_server_type username password database
                    socket_dir prefix prepare)a
  @texts ~w(hostname username database ssl_ca_file ssl_cert_file ssl_key_file application_name)a
  # endpoints: [] is hostname:port alone; :primary because lock calls write
  # (Postgrex's default is :any).
  @defaults [port: 5432, endpoints: [], target_server_type: :primary, sslmode: :prefer] ++
              [application_name: "phoenix_kit_agent_locks"] ++
              Enum.map(@timeouts, &{&1, 5_000}) ++ [prepare: :named]
  @sslmodes [:disable, :prefer, :require, :verify_ca, :verify_full]
  @prepares [:named, :unnamed]
  # A server that takes writes, or whichever takes the connection; Postgrex's
  # :secondary is refused: a standby refuses every lock call but the reads.
  @target_server_types [:primary, :any]
  # libpq's target_session_attrs, as target_server_type; its standby values
  # (read-only, standby, prefer-standby) are refused as they are, as :secondary is.
  @session_attrs %{"read-write" => :primary, "primary" => :primary, "any" => :any}

  # Fields that a layer sets or replaces together (over/2): the server (a host,
  # endpoints or a socket directory), and each of three that say the same in
  # two forms (a file, DER).
  @together [
    @servers,
    [:ssl_ca_file, :ssl_cacerts],
    [:ssl_cert_file, :ssl_cert],
    [:ssl_key_file, :ssl_key]
  ]

  # The key is secret; the certificates are many (the OS store).
  @derive {Inspect, except: [:password, :ssl_key, :ssl_cacerts, :ssl_cert]}
  defstruct @fields

  @type t :: %__MODULE__{}

  # `{:ok, config}`, or `:unconfigured` when no source names a server.
  # `phoenix_kit` is PhoenixKit's configuration (`config :phoenix_kit, …`).
  # The sources, each part from the first that has it: the library's own
  # settings; its url: or else its repo's server; the repo's prefix and
  # prepare (which a url: does not replace); then, when none names a server,
  # DATABASE_URL.
  @spec read(keyword(), keyword()) :: {:ok, t()} | :unconfigured
  def read(env \\ Application.get_all_env(@app), phoenix_kit \\ phoenix_kit_env()) do
    own = own_settings!(env)
    repo = if module = repo(own, phoenix_kit), do: repo_settings!(module), else: []

    server = if own[:url], do: parse_url!(own[:url], "url"), else: repo
    layers = [Keyword.take(repo, [:prefix, :prepare]), server, Keyword.take(own, @fields)]
    settings = Enum.reduce(layers, &over/2)
    database_url = System.get_env("DATABASE_URL", "")

    settings =
      if located?(settings) or database_url == "",
        do: settings,
        else: over(settings, parse_url!(database_url, "DATABASE_URL"))

    if located?(settings), do: {:ok, build!(settings)}, else: :unconfigured
  end

  # `{:sandbox, repo, prefix}` under `testing: :sandbox`, else `:disabled`.
  # Checks every setting, as `read/2` does.
  @spec testing(keyword(), keyword()) :: {:sandbox, module(), String.t() | nil} | :disabled
  def testing(env \\ Application.get_all_env(@app), phoenix_kit \\ phoenix_kit_env()) do
    own = own_settings!(env)

    with :sandbox <- Keyword.get(own, :testing, :disabled) do
      repo =
        repo(own, phoenix_kit) ||
          bad!(:testing, ":sandbox needs repo: the host's Ecto repo (or PhoenixKit's)")

      name = inspect(repo)

      unless Code.ensure_loaded?(repo) and function_exported?(repo, :query, 3),
        do: bad!(:repo, "#{name} has no query/3 (an Ecto SQL repo), which testing: :sandbox runs")

      {:sandbox, repo, own[:prefix] || repo_settings!(repo)[:prefix]}
    end
  end

  # The host's repo: the library's own `repo:`; else, when its configuration
  # names no url: or server either, PhoenixKit's (`config :phoenix_kit,
  # repo:`, which every PhoenixKit host has), so that such a host configures
  # nothing here. It comes before DATABASE_URL, as a repo: of the library's does.
  defp repo(own, phoenix_kit) do
    cond do
      own[:repo] || own[:url] || located?(own) -> own[:repo]
      phoenix_kit[:repo] -> check!(:repo, phoenix_kit[:repo], "repo (config :phoenix_kit)")
      true -> nil
    end
  end

  defp phoenix_kit_env, do: Application.get_all_env(:phoenix_kit)

  # The most lock calls that may run at once, and the pool size when none is
  # set: the VM's dirty-I/O schedulers less two, so two stay free for the rest
  # of the VM whatever the database does (guides/operating.md, "Limits").
  @spec default_pool_size() :: pos_integer()
  def default_pool_size do
    schedulers = :erlang.system_info(:dirty_io_schedulers)

    if schedulers < 3,
      do:
        invalid!(
          "the VM has #{schedulers} dirty-I/O schedulers; lock calls need at least 3, " <>
            "so that two stay free: start it with +SDio 3 or more"
        )

    schedulers - 2
  end

  # `top` over `base`: where `top` sets a field of a @together group, none of
  # `base`'s group is kept (a host in `top` drops `base`'s endpoints too).
  defp over(top, base) do
    replaced = for group <- @together, Enum.any?(group, &(top[&1] != nil)), do: group
    Keyword.merge(Keyword.drop(base, List.flatten(replaced)), top)
  end

  defp located?(connection), do: Enum.any?(@servers, &(connection[&1] != nil))

  defp build!(settings) do
    settings = Keyword.merge(@defaults, system_store!(settings)) |> first_endpoint()

    username =
      settings[:username] || System.get_env("PGUSER") || System.get_env("USER") ||
        bad!(:username, "missing: no user in the url, the repo or the settings")

    unless settings[:database],
      do: bad!(:database, "missing: no database in the url, the repo or the settings")

    # A pool_size above default_pool_size/0 is cut to it: more calls at once would
    # let a database that hangs hold the dirty-I/O schedulers the VM needs.
    most = default_pool_size()
    size = Keyword.get(settings, :pool_size, most)

    if size > most do
      Logger.warning(
        "phoenix_kit_agent_locks: pool_size #{size} is more than the #{most} lock calls that " <>
          "may run at once (the VM's #{most + 2} dirty-I/O schedulers less two; +SDio raises " <>
          "them): #{most} connections are used"
      )
    end

    struct!(__MODULE__, Keyword.merge(settings, username: username, pool_size: min(size, most)))
  end

  # As Postgrex: endpoints: wins over hostname:/port:, a socket directory over
  # both. hostname/port become the first endpoint, which the struct keeps as
  # hostname/port too (the native side reads endpoints, or them when it is []).
  defp first_endpoint(settings) do
    case {settings[:socket_dir], settings[:endpoints]} do
      {nil, [{host, port} | _]} -> Keyword.merge(settings, hostname: host, port: port)
      _ -> Keyword.put(settings, :endpoints, [])
    end
  end

  ## Checks, one rule per setting, whatever its source

  defp own_settings!(env) do
    unless Keyword.keyword?(env), do: invalid!("expected a keyword list of settings")
    unknown = Keyword.keys(env) -- (@settings ++ @build_settings)

    if unknown != [] do
      plural = if length(unknown) > 1, do: "s"
      invalid!("unknown setting#{plural} #{names(unknown)}; the settings are #{names(@settings)}")
    end

    for {key, value} <- env, key in @settings, value != nil, do: {key, check!(key, value, key)}
  end

  # The checked `value` of setting `key`; `name` is what an error calls it: the
  # key, or where it came from (`url`, `DATABASE_URL`, `MyApp.Repo.config()[:port]`).
  # The error ends in `got:` and the value, as an argument error does, unless
  # `shown?` is false (a part of a URL, which may carry the password anywhere)
  # or the value is a password or a URL.
  def check!(key, value, name, shown? \\ true) do
    value = normal(key, value)
    {ok?, rule} = rule(key, value)
    if ok?, do: value, else: bad!(name, rule <> if(shown?, do: got(key, value), else: ""))
  end

  # libpq's spelling, as a URL's sslmode= has it.
  defp normal(:sslmode, mode) when is_binary(mode),
    do: Enum.find(@sslmodes, mode, &(Atom.to_string(&1) == String.replace(mode, "-", "_")))

  defp normal(:target_server_type, attrs) when is_binary(attrs),
    do: Map.get(@session_attrs, attrs, attrs)

  defp normal(_key, value), do: value

  defp got(key, _value) when key in [:url, :password], do: ""
  defp got(_key, value), do: ", got: " <> inspect(value, limit: 5, printable_limit: 64)

  # Whether `value` passes setting `key`'s rule, and what an error says of it.
  defp rule(:repo, v), do: {is_atom(v), "must be a module, e.g. MyApp.Repo"}
  defp rule(:port, v), do: up_to(v, 65_535, "")
  defp rule(:pool_size, v), do: up_to(v, 1_000, "")
  defp rule(key, v) when key in @timeouts, do: up_to(v, 3_600_000, " (milliseconds)")

  defp rule(:sslmode, v), do: {v in @sslmodes, "must be one of #{names(@sslmodes)}"}

  defp rule(:prepare, v), do: {v in @prepares, "must be :named or :unnamed"}

  defp rule(:endpoints, v),
    do:
      {is_list(v) and v != [] and Enum.all?(v, &endpoint?/1),
       ~s(must be a list of {hostname, port} tuples, e.g. [{"db-a", 5432}, {"db-b", 5432}])}

  defp rule(:target_server_type, v),
    do:
      {v in @target_server_types,
       "must be :primary (the default) or :any: lock calls write, which a secondary " <>
         "(a standby) refuses; give :primary, with every server the primary may be on"}

  # `testing: :sandbox` runs the statements through `repo`'s query/3 (Locks.Sandbox).
  defp rule(:testing, v), do: {v in [:disabled, :sandbox], "must be :sandbox or :disabled"}
  defp rule(:socket_dir, v), do: {match?("/" <> _, v), "must be an absolute directory"}
  defp rule(:prefix, v), do: {prefix?(v), prefix_rule()}
  # `socket` is a repo's (Postgrex's): the path of the socket file.
  defp rule(key, v) when key in [:url, :password, :socket], do: {text?(v), "must be a string"}
  defp rule(key, "") when key in @texts, do: {false, "must not be empty"}
  defp rule(key, v) when key in @texts, do: {text?(v), "must be a string"}
  # A repo's Postgrex TLS options.
  defp rule(:ssl, v),
    do: {v in [nil, true, false] or is_list(v), "must be a boolean or a keyword list"}

  defp rule(key, v) when key in [:cacertfile, :certfile, :keyfile],
    do: {chars?(v), "must be a path"}

  defp rule(:verify, v),
    do: {v in [:verify_peer, :verify_none], "must be :verify_peer or :verify_none"}

  defp rule(:server_name_indication, v),
    do: {v == :disable or chars?(v), "must be a host name or :disable"}

  # A charlist as :ssl takes it, as a string; anything else (a list that is
  # not one) as it is.
  defp chars(v) when is_list(v) do
    List.to_string(v)
  rescue
    _ in [ArgumentError, UnicodeConversionError] -> v
  end

  defp chars(v), do: v

  defp endpoint?({host, port}), do: text?(host) and host != "" and port in 1..65_535
  defp endpoint?(_), do: false

  defp names(atoms), do: Enum.map_join(atoms, ", ", &inspect/1)

  defp up_to(v, max, unit), do: {v in 1..max, "must be an integer from 1 to #{max}#{unit}"}

  defp text?(value),
    do: is_binary(value) and String.valid?(value) and not String.contains?(value, <<0>>)

  # A path or host name as :ssl takes it: a string or a charlist, not empty.
  defp chars?(v), do: text?(chars(v)) and v not in ["", []]

  # What a schema prefix must be, for settings and function arguments alike.
  def prefix?(prefix),
    do: is_binary(prefix) and prefix =~ ~r/\A[A-Za-z_][A-Za-z0-9_$]{0,62}\z/

  def prefix_rule,
    do: "must be an identifier: a letter or _, then letters, digits, _ or $ (at most 63)"

  defp bad!(name, rule), do: invalid!("#{name}: #{rule}")

  defp invalid!(why),
    do: raise(Error, reason: :config, message: "invalid configuration: " <> why)

  ## URLs, parsed as Ecto parses a repo's

  @url_parameters %{
    "sslmode" => :sslmode,
    "sslrootcert" => :ssl_ca_file,
    "sslcert" => :ssl_cert_file,
    "sslkey" => :ssl_key_file,
    "host" => :hostname,
    "port" => :port,
    "user" => :username,
    "password" => :password,
    "dbname" => :database,
    "application_name" => :application_name,
    "prepare" => :prepare,
    "target_session_attrs" => :target_server_type
  }

  # Errors name the source and the part, never the text.
  def parse_url!(url, name) do
    uri = URI.parse(if text?(url), do: url, else: bad!(name, "must be a string"))

    unless uri.scheme in ["postgres", "postgresql"] and is_binary(uri.authority),
      do: bad!(name, "must be a postgres:// or postgresql:// URL")

    # The host and port follow the last @.
    [_, userinfo, hostport] = Regex.run(~r/\A(?:(.*)@)?(.*)\z/s, uri.authority)

    # libpq's multi-host URL: postgres://a:5432,b:5433/db.
    servers = String.split(hostport, ",")
    several? = length(servers) > 1

    if not several? and uri.port == nil and
         String.contains?(String.replace(hostport, ~r/\A\[[^\]]*\]/, ""), ":"),
       do: bad!(name, "has a port that is not a number")

    destructure([username, password], String.split(userinfo, ":", parts: 2))
    path = uri.path && String.trim_leading(uri.path, "/")
    host = if not several?, do: uri.host
    parts = [hostname: host, username: username, password: password, database: path]
    decoded = for {key, part} <- parts, part != nil, do: {key, decode!(part, name)}
    location = if several?, do: [endpoints: endpoints!(servers, name)], else: [port: uri.port]

    parameters =
      for {key, value} <- URI.query_decoder(percent!(uri.query || "", name)) do
        {@url_parameters[key] || bad!(name, "has an unsupported parameter #{inspect(key)}"),
         value}
      end

    (location ++ decoded)
    |> Keyword.merge(parameters)
    |> Enum.reject(fn {_key, value} -> value in [nil, ""] end)
    |> Enum.map(fn
      {:hostname, "/" <> _ = dir} -> {:socket_dir, dir}
      {:hostname, hosts} -> {:hostname, one_host!(hosts, name)}
      {:port, text} when is_binary(text) -> {:port, with({p, ""} <- Integer.parse(text), do: p)}
      {:prepare, text} -> {:prepare, Enum.find(@prepares, &(Atom.to_string(&1) == text))}
      other -> other
    end)
    |> Enum.map(fn {key, value} -> {key, check!(key, value, name, false)} end)
  end

  defp decode!(part, name), do: URI.decode(percent!(part, name))

  # libpq's multi-host URL, `postgres://a:5432,b:5433/db`: each server a host
  # (an IPv6 address in brackets) and its port, the default port if none.
  defp endpoints!(servers, name) do
    for server <- servers do
      case Regex.run(~r/\A(\[[^\]]*\]|[^:\[\]]+)(?::(\d+))?\z/, server) do
        [_, host | port] ->
          host = host |> String.trim_leading("[") |> String.trim_trailing("]")
          port = if port == [], do: @defaults[:port], else: String.to_integer(hd(port))
          {decode!(host, name), port}

        nil ->
          bad!(name, "has a server that is not host:port")
      end
    end
  end

  defp one_host!(hosts, name) do
    if String.contains?(hosts, ","),
      do: bad!(name, "names several hosts in host=; list them as postgres://a:5432,b:5433/db")

    hosts
  end

  # URI.decode/1 raises on a lone `%`, and its message shows the text.
  defp percent!(part, name) do
    if part =~ ~r/%(?![0-9A-Fa-f]{2})/, do: bad!(name, "is not percent-encoded correctly")
    part
  end

  ## The host's repo

  # What `repo.config()` says, in the library's terms, checked by the same
  # rules. Ecto splits a repo's url: into these; one that returns it is parsed.
  defp repo_settings!(repo) do
    name = inspect(repo)

    unless Code.ensure_loaded?(repo) and function_exported?(repo, :config, 0),
      do: bad!(:repo, "#{name} is not a module with config/0 (an Ecto repo)")

    config = repo.config()

    unless Keyword.keyword?(config),
      do: bad!(:repo, "#{name}.config() must return a keyword list")

    # What an error calls the repo's setting `key`.
    at = &"#{name}.config()[#{inspect(&1)}]"
    from_url = if config[:url], do: parse_url!(config[:url], at.(:url)), else: []

    settings =
      for key <- @repo_settings, config[key] != nil, do: {key, check!(key, config[key], at.(key))}

    Enum.reduce([socket(config[:socket], at), settings, ssl(config, at)], from_url, &over/2)
  end

  # Postgrex's `socket: "/run/postgresql/.s.PGSQL.5432"` names the socket
  # file: its directory, and the port in its name.
  defp socket(nil, _at), do: []

  defp socket(path, at) do
    path = check!(:socket, path, at.(:socket))

    port =
      for [_, p] <- [Regex.run(~r/\.s\.PGSQL\.(\d+)\z/, path)], do: {:port, String.to_integer(p)}

    [socket_dir: check!(:socket_dir, Path.dirname(path), at.(:socket))] ++ port
  end

  ## TLS: Postgrex's options and libpq's sslrootcert=system

  # Postgrex 0.21's TLS (its lib/postgrex/protocol.ex), in the library's
  # terms, each option with the verdict Postgrex gives it: `ssl: true` is
  # verify_peer with the host-name check over the OS store
  # (`:public_key.cacerts_get()`); a keyword list is merged over the defaults
  # verify_peer and the HTTPS host-name match; `ssl: true, ssl_opts: list`
  # (older Postgrex) hands :ssl the list as it is, whose verify default is
  # taken as OTP 26's, verify_peer (OTP 25's was verify_none: the error that
  # asks for a CA says to write `verify: :verify_none` to keep that). A url's
  # sslmode stays when `ssl:` is off.
  defp ssl(config, at) do
    case {check!(:ssl, config[:ssl], at.(:ssl)), config[:ssl_opts]} do
      {off, _} when off in [nil, false] ->
        if config[:url], do: [], else: [sslmode: :disable]

      {true, nil} ->
        [sslmode: :verify_full, ssl_cacerts: os_store!("#{at.(:ssl)} (true: the OS store)")]

      {true, opts} ->
        tls!(opts, at.(:ssl_opts))

      {opts, _} ->
        tls!(opts, at.(:ssl))
    end
  end

  # The :ssl options the library reads; any other stops the start.
  @ssl_options ~w(verify cacerts cacertfile certfile keyfile cert key server_name_indication
                  customize_hostname_check)a
  @key_formats %{RSAPrivateKey: :pkcs1, ECPrivateKey: :sec1, PrivateKeyInfo: :pkcs8}

  defp tls!(opts, name) do
    unless Keyword.keyword?(opts), do: bad!(name, "must be a keyword list" <> got(:ssl, opts))
    at = &"#{name}[#{inspect(&1)}]"

    for {key, _} <- opts, key not in @ssl_options, do: bad!(at.(key), unknown_ssl(key))
    opts = for {key, value} <- opts, value != nil, do: {key, ssl_option!(key, value, at.(key))}

    # The CA and the client certificate, as :ssl reads them: cacerts: over
    # cacertfile:, cert: (DER, or a list: the chain) over certfile:, key:
    # ({type, DER}) over keyfile:, and a certfile: without a key is read for
    # its key too.
    ca = first(opts, cacerts: :ssl_cacerts, cacertfile: :ssl_ca_file)

    client =
      first(opts, cert: :ssl_cert, certfile: :ssl_cert_file) ++
        first(opts, key: :ssl_key, keyfile: :ssl_key_file, certfile: :ssl_key_file)

    # server_name_indication: the host name to check; :disable checks none (verify_ca).
    sni = opts[:server_name_indication]
    server = if is_binary(sni), do: [ssl_server_name: sni], else: []

    cond do
      opts[:verify] == :verify_none ->
        [sslmode: :require] ++ server ++ client

      ca == [] ->
        bad!(
          name,
          "verify: :verify_peer (Postgrex's default) needs the CA certificates to trust, and " <>
            "Postgrex connects with none: write cacerts: :public_key.cacerts_get() (the OS " <>
            "store, for managed PostgreSQL), cacertfile: \"ca.pem\" or cacerts: [der], or " <>
            "verify: :verify_none to connect without checking the certificate (what ssl: " <>
            "true did before Postgrex 0.18, and ssl_opts: on OTP 25)"
        )

      sni == :disable ->
        [sslmode: :verify_ca] ++ ca ++ client

      true ->
        [sslmode: :verify_full] ++ ca ++ server ++ client
    end
  end

  # An :ssl option's value, checked, as the library's field takes it (a path
  # or a host name as a string).
  defp ssl_option!(:cacerts, certs, name), do: ders!(certs, name)
  defp ssl_option!(:cert, cert, name), do: ders!(List.wrap(cert), name)
  defp ssl_option!(:key, key, name), do: key!(key, name)
  defp ssl_option!(:customize_hostname_check, check, name), do: https!(check, name)
  defp ssl_option!(key, value, name), do: chars(check!(key, value, name))

  # The first of `options` (option: field) that `opts` sets, as its field.
  defp first(opts, options) do
    Enum.find_value(options, [], fn {option, field} -> opts[option] && [{field, opts[option]}] end)
  end

  defp unknown_ssl(:verify_fun),
    do:
      "the library cannot run an Erlang verify function: it checks the chain and the host " <>
        "name as verify: :verify_peer does; give the CA with cacerts: or cacertfile: instead " <>
        "(or verify: :verify_none not to check)"

  defp unknown_ssl(:password),
    do: "encrypted keys cannot be read: give keyfile: an unencrypted PEM key, or key: as DER"

  defp unknown_ssl(_key),
    do:
      "an :ssl option the library does not honour (it speaks TLS with rustls): remove it; " <>
        "the options it reads are #{names(@ssl_options)}"

  # The HTTPS match, Postgrex's default (wildcards in the certificate's
  # names), is what rustls does; `[]`, :ssl's own, is taken as it.
  defp https!(check, name) do
    unless check in [[], [match_fun: :public_key.pkix_verify_hostname_match_fun(:https)]],
      do:
        bad!(
          name,
          "the library checks host names as :public_key.pkix_verify_hostname_match_fun(:https) " <>
            "does (Postgrex's default): remove it, or write [match_fun: " <>
            ":public_key.pkix_verify_hostname_match_fun(:https)]"
        )

    check
  end

  defp key!({type, der}, name) when is_map_key(@key_formats, type) and is_binary(der) do
    :public_key.der_decode(type, der)
    {@key_formats[type], der}
  rescue
    _ -> bad!(name, "is not a #{type} DER encoding")
  end

  defp key!(_key, name),
    do:
      bad!(
        name,
        "must be {type, der} with type #{names(Map.keys(@key_formats))} " <>
          "(an engine key cannot be read): give keyfile: a PEM key instead"
      )

  # Certificates as DER, from binaries or the records :public_key.cacerts_get() returns.
  defp ders!(certs, name) do
    unless is_list(certs) and certs != [],
      do: bad!(name, "must be a list of DER certificates" <> got(:cacerts, certs))

    for {cert, n} <- Enum.with_index(certs, 1) do
      der = with {:cert, der, _otp} <- cert, do: der

      unless is_binary(der),
        do: bad!(name, "must hold DER certificates, got: #{inspect(cert, limit: 5)} at #{n}")

      try do
        :public_key.pkix_decode_cert(der, :plain)
      rescue
        _ -> bad!(name, "certificate #{n} of #{length(certs)} is not a DER certificate")
      end

      der
    end
  end

  # The OS store, as Postgrex reads it for `ssl: true`.
  defp os_store!(name) do
    ders!(:public_key.cacerts_get(), name)
  catch
    # ders!'s own refusal goes on as it is.
    kind, reason when not is_struct(reason, Error) ->
      bad!(
        name,
        "the OS store cannot be read (:public_key.cacerts_get(): #{inspect({kind, reason})}): " <>
          "give the CA certificates with cacertfile: or cacerts:"
      )
  end

  # libpq's sslrootcert=system: `ssl_ca_file: "system"` trusts the OS store,
  # and makes verify_full the sslmode; as in libpq, a weaker one is refused.
  defp system_store!(settings) do
    if settings[:ssl_ca_file] == "system" do
      unless settings[:sslmode] in [nil, :verify_full],
        do:
          bad!(
            :sslmode,
            "must be :verify_full with ssl_ca_file \"system\" (the OS store, as libpq's " <>
              "sslrootcert=system), got: #{inspect(settings[:sslmode])}"
          )

      Keyword.merge(settings,
        sslmode: :verify_full,
        ssl_ca_file: nil,
        ssl_cacerts: os_store!("ssl_ca_file \"system\"")
      )
    else
      settings
    end
  end
end
