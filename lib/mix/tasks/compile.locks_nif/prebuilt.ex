defmodule Mix.Tasks.Compile.LocksNif.Prebuilt do
  @moduledoc false
  # Finds, verifies and unpacks a prebuilt `liblocks_nif` for the running VM
  # (guides/installing-without-rust.md): the Mix compiler's, and `mix
  # locks.checksum`'s (dev/), not a user API.

  @checksum_file "checksum-Elixir.PhoenixKitAgent.Turns.Locks.Native.exs"
  # What the release workflow builds; a test holds the workflow to these lists.
  @targets ~w(aarch64-apple-darwin aarch64-unknown-linux-gnu aarch64-unknown-linux-musl
              x86_64-apple-darwin x86_64-unknown-linux-gnu x86_64-unknown-linux-musl)
  @nif_versions ~w(2.16 2.17)
  @cache_env "LOCKS_NIF_CACHE_DIR"
  @proxy_env [proxy: ~w(http_proxy HTTP_PROXY), https_proxy: ~w(https_proxy HTTPS_PROXY)]
  # httpc keeps options (the proxy) per profile, and a proxy once set cannot be
  # unset: a profile of our own, started and stopped around each download, so
  # that neither the host's HTTP client nor the next download inherits one.
  @profile :phoenix_kit_agent_locks_nif
  # An artifact is a few MB; a sandbox without network fails at connect.
  @timeouts [connect_timeout: 15_000, timeout: 300_000]

  def targets, do: @targets
  def nif_versions, do: @nif_versions

  # As rustler_precompiled names them.
  def artifact(v, nif, target), do: "liblocks_nif-v#{v}-nif-#{nif}-#{target}.so.tar.gz"

  # The variable `name` of `env`; empty counts as unset (as shells and Docker make them).
  def var(env, name), do: if(env[name] in [nil, ""], do: nil, else: env[name])

  # Where and what to look for, for the library at `root`, from the environment `env`.
  def settings(root, env) do
    config = Mix.Project.config()
    base_url = var(env, "LOCKS_NIF_BASE_URL") || Keyword.fetch!(config, :locks_nif_base_url)

    %{
      version: config[:version],
      target: if(target = var(env, "LOCKS_NIF_TARGET"), do: {:ok, target}, else: target_triple()),
      nif_version: List.to_string(:erlang.system_info(:nif_version)),
      checksum_file: Path.join(root, @checksum_file),
      cache_dir:
        var(env, @cache_env) || :filename.basedir(:user_cache, "phoenix_kit_agent_locks"),
      base_url: String.trim_trailing(base_url, "/"),
      proxy: proxy_options(env)
    }
  end

  # The target of `targets/0` for an Erlang system architecture, the VM's by default.
  def target_triple(architecture \\ List.to_string(:erlang.system_info(:system_architecture))) do
    cpu = %{"amd64" => "x86_64", "arm64" => "aarch64"}

    triple =
      case String.split(architecture, "-") do
        [arch, _vendor, "linux", abi] -> "#{cpu[arch] || arch}-unknown-linux-#{abi}"
        [arch, "apple", "darwin" <> _] -> "#{cpu[arch] || arch}-apple-darwin"
        _ -> nil
      end

    if triple in @targets,
      do: {:ok, triple},
      else: {:error, "no Rust target known for the system architecture #{architecture}"}
  end

  # `{:ok, artifact, checksum}`: the artifact to install and its listed
  # checksum; or `{:error, why}`. Of the artifacts listed for the target, the
  # one of the newest NIF version the VM loads: a library of NIF 2.16 loads
  # on a VM of 2.16 or a later 2.x (`~> 2.16`).
  def expected(%{version: version, nif_version: running} = settings) do
    with {:ok, target} <- settings.target,
         {:ok, checksums} <- read_checksums(settings.checksum_file) do
      none =
        "#{@checksum_file} lists no artifact of version #{version} for " <>
          "#{target} and NIF version #{running}"

      Enum.find_value(Enum.reverse(@nif_versions), {:error, none}, fn nif ->
        name = artifact(version, nif, target)

        if Version.match?("#{running}.0", "~> #{nif}") and Map.has_key?(checksums, name),
          do: {:ok, name, checksums[name]}
      end)
    end
  end

  # The artifact `expected/1` answered, `expected`, as `{:ok, library,
  # artifact, from, checksum}` (`from` a file or URL), or `{:mismatch, why}`
  # or `{:error, why}`.
  def fetch(settings, expected) do
    with {:ok, name, checksum} <- expected,
         cached = Path.join(settings.cache_dir, name),
         {:ok, tarball, from} <- read_or_download(settings, name, cached),
         :ok <- verify(checksum(tarball), checksum, name, from, cached),
         {:ok, library} <- unpack(tarball, name) do
      if from != cached, do: keep(cached, tarball)
      {:ok, library, name, from, checksum}
    end
  end

  # The compiler's error when no artifact fits and cargo is not found: `why`
  # fetch/2 failed, for `expected/1`'s answer `expected`.
  def no_library(settings, expected, why) do
    target = with {:ok, t} <- settings.target, do: t, else: (_ -> "(unknown)")

    """
    no library for target #{target} and NIF version #{settings.nif_version}:
      prebuilt: #{why}
      from source: cargo not found on PATH or in ~/.cargo/bin
    #{way_out(expected)}\
    """
  end

  # A listed artifact can be put in the cache directory; else Rust is the one way.
  defp way_out({:ok, artifact, _}),
    do:
      "Either install Rust (https://rustup.rs) so that cargo is on PATH, or put #{artifact} " <>
        "(as listed in #{@checksum_file}) in a directory and set #{@cache_env} to it."

  defp way_out({:error, _}), do: "Install Rust (https://rustup.rs) so that cargo is on PATH."

  # The cached file when it can be read (the `else`), else the download.
  defp read_or_download(settings, name, cached) do
    url = "#{settings.base_url}/#{name}"

    with {:error, _} <- File.read(cached),
         {:ok, tarball} <- download(url, settings.proxy) do
      {:ok, tarball, url}
    else
      {:ok, tarball} -> {:ok, tarball, cached}
      {:error, why} -> {:error, "#{name} is not in #{settings.cache_dir}, and #{why}"}
    end
  end

  defp verify(expected, expected, _name, _from, _cached), do: :ok

  defp verify(actual, expected, name, from, cached) do
    {:mismatch,
     """
     checksum mismatch for #{name} from #{from}:
       expected #{expected} (#{@checksum_file})
       got      #{actual}
     Nothing was installed. #{advice(from, cached)}\
     """}
  end

  # From the cache, or downloaded.
  defp advice(cached, cached), do: "Delete #{cached} to download the artifact again."
  defp advice(_url, _cached), do: "The download is not the artifact the release published."

  # A gzipped tar holding one file, the library, as the release workflow packs
  # it: no other shape can be met, as the bytes are the listed ones (verified).
  defp unpack(tarball, name) do
    case :erl_tar.extract({:binary, tarball}, [:memory, :compressed]) do
      {:ok, [{_, library}]} -> {:ok, library}
      _ -> {:error, "#{name} is not a gzipped tar of one file"}
    end
  end

  # Best effort: a read-only cache (a sandbox) costs a download next time.
  defp keep(path, tarball) do
    with {:error, reason} <- write_beside(path, tarball),
         do: Mix.shell().info("locks_nif: cannot cache #{path}: #{:file.format_error(reason)}")
  end

  # Writes `bytes` as `path` by a rename (atomic): a reader sees either file whole.
  def write_beside(path, bytes) do
    staged = "#{path}.#{System.pid()}-#{System.unique_integer([:positive])}.tmp"

    result =
      with :ok <- File.mkdir_p(Path.dirname(path)),
           :ok <- File.write(staged, bytes),
           do: File.rename(staged, path)

    if result != :ok, do: File.rm(staged)
    result
  end

  def checksum(bytes), do: "sha256:" <> Base.encode16(:crypto.hash(:sha256, bytes), case: :lower)

  # The checksum file at `path` as a map of artifact names to checksums; never run.
  # Its one writer is mix locks.checksum (dev/).
  def read_checksums(path) do
    with {:ok, text} <- File.read(path),
         {:ok, {:%{}, _, pairs}} <- Code.string_to_quoted(text),
         true <- Enum.all?(pairs, &match?({name, "sha256:" <> _} when is_binary(name), &1)) do
      {:ok, Map.new(pairs)}
    else
      {:error, :enoent} -> {:error, "#{path} is missing"}
      {:error, reason} when is_atom(reason) -> {:error, "cannot read #{path}: #{reason}"}
      _ -> {:error, "#{path} is not a map of artifact names to \"sha256:…\" checksums"}
    end
  end

  # GETs `url` with `:httpc`; HTTPS verified by the system's CA certificates and host name.
  def download(url, proxy) do
    # What a download needs; the project lists none of them (mix.exs).
    with :ok <- ensure_started([:crypto, :public_key, :ssl, :inets]),
         {:ok, options} <- http_options(url) do
      # Started now, or already: left by a download whose process died in it.
      _ = :inets.start(:httpc, profile: @profile)

      try do
        :ok = :httpc.set_options(proxy, @profile)
        request = {String.to_charlist(url), [{~c"user-agent", ~c"phoenix_kit_agent_locks"}]}

        case :httpc.request(:get, request, options, [body_format: :binary], @profile) do
          {:ok, {{_, 200, _}, _headers, body}} -> {:ok, body}
          {:ok, {{_, status, text}, _, _}} -> {:error, "GET #{url} answered #{status} #{text}"}
          {:error, reason} -> {:error, "GET #{url} failed: #{http_error(reason)}"}
        end
      after
        :inets.stop(:httpc, @profile)
      end
    end
  end

  # Every download verifies TLS: an http: URL too, should it redirect to
  # https:. Without the system's CA certificates (cacerts_get/0 raises), an
  # https: URL is refused here; an http: one goes on (OTP 27's :httpc would
  # crash looking for them itself, were no ssl options given), and a
  # redirect of it to https: is refused by the TLS check, which no CA passes.
  defp http_options(url) do
    verify = [verify: :verify_peer, cacerts: :public_key.cacerts_get()]
    hostname = [match_fun: :public_key.pkix_verify_hostname_match_fun(:https)]
    {:ok, [ssl: verify ++ [customize_hostname_check: hostname]] ++ @timeouts}
  rescue
    error ->
      if String.starts_with?(url, "https:"),
        do: {:error, "no CA certificates to verify #{url}: #{Exception.message(error)}"},
        else: {:ok, [ssl: [verify: :verify_peer, cacerts: []]] ++ @timeouts}
  end

  # Starts `apps`, each put on the code path first: `:ok`, or the first
  # `{:error, why}`. Mix (Elixir 1.15 on) keeps only the paths of the
  # applications a project lists; Mix.ensure_application!/1 puts one back
  # (absent before 1.15).
  def ensure_started(apps) do
    Enum.find_value(apps, :ok, fn app ->
      if function_exported?(Mix, :ensure_application!, 1),
        do: apply(Mix, :ensure_application!, [app])

      case Application.ensure_all_started(app) do
        {:ok, _} -> nil
        {:error, reason} -> {:error, "cannot start #{inspect(app)}: #{inspect(reason)}"}
      end
    end)
  end

  # :httpc's connect failures: [{:to_address, _}, {:inet, _, reason}] (the
  # default ipfamily, inet, is the one tried); any other shape is inspected.
  defp http_error({:failed_connect, [_, {:inet, _, {:tls_alert, {alert, _text}}}]}),
    do: "cannot connect: TLS alert #{alert}"

  defp http_error({:failed_connect, [_, {:inet, _, reason}]}),
    do: "cannot connect: #{:inet.format_error(reason)}"

  defp http_error(:timeout), do: "timed out"
  defp http_error(reason), do: inspect(reason)

  # The `:httpc` proxy options for `env`; `.example.com` and `example.com` cover
  # subdomains (a pattern twice, from both, is matched as once).
  def proxy_options(env) do
    exceptions =
      (var(env, "no_proxy") || var(env, "NO_PROXY") || "")
      |> String.split(",", trim: true)
      |> Enum.flat_map(fn host ->
        case String.trim(host) do
          "." <> domain -> ["*." <> domain]
          "*" <> _ = pattern -> [pattern]
          host -> if host =~ ~r/^[\d.:\[\]]+$/, do: [host], else: [host, "*." <> host]
        end
      end)
      |> Enum.map(&String.to_charlist/1)

    proxies =
      for {option, names} <- @proxy_env, proxy = Enum.find_value(names, &var(env, &1)) do
        uri = URI.parse(if proxy =~ "://", do: proxy, else: "http://" <> proxy)
        {option, {{String.to_charlist(uri.host), uri.port || 80}, exceptions}}
      end

    if ~c"*" in exceptions, do: [], else: proxies
  end
end
