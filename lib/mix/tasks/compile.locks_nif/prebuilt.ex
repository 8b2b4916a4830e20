defmodule Mix.Tasks.Compile.LocksNif.Prebuilt do
  @moduledoc """
  Finds a prebuilt `liblocks_nif` for the running VM, checks it against the
  checksum file and unpacks it, so that a host can build the library without
  Rust. `Mix.Tasks.Compile.LocksNif` installs what this returns or falls back
  to cargo; `mix locks.checksum` writes the checksum file.

  ## Artifacts

  Named as rustler_precompiled names them, from the crate, the version in
  `mix.exs`, a NIF version and a Rust target:

      liblocks_nif-v0.1.0-nif-2.16-x86_64-unknown-linux-gnu.so.tar.gz

  a gzipped tar holding one file, the same name without `.tar.gz` (macOS
  libraries are named `.so` too). One is built for every target of
  `targets/0` and NIF version of `nif_versions/0` (`.github/workflows/release.yml`).

  An artifact is used only if its SHA-256 is the one listed for its name in
  `checksum-Elixir.PhoenixKitAgent.Turns.Locks.Native.exs`, committed at the
  library's root. Of the listed artifacts for the target, the one of the
  newest NIF version the VM loads is taken (a library loads on a VM of its
  NIF version or a newer one of the same major version).

  ## Where an artifact is looked for

    1. the cache directory: `LOCKS_NIF_CACHE_DIR`, or else
       `:filename.basedir(:user_cache, "phoenix_kit_agent_locks")`
       (`~/.cache/phoenix_kit_agent_locks` on Linux);
    2. `<base URL>/<artifact>`: `LOCKS_NIF_BASE_URL`, or else
       `:locks_nif_base_url` of `mix.exs` (the GitHub release of the
       version); through the proxy of `https_proxy` / `http_proxy` (either
       case) when one is set, except for the hosts of `no_proxy`.

  A download whose checksum matched is kept in the cache, so the network is
  asked once per artifact. The target is derived from the VM's system
  architecture; `LOCKS_NIF_TARGET` names another.
  """

  @crate "locks_nif"
  @checksum_file "checksum-Elixir.PhoenixKitAgent.Turns.Locks.Native.exs"

  # What the release workflow builds; a test holds the workflow to this list.
  @targets ~w(
    aarch64-apple-darwin
    aarch64-unknown-linux-gnu
    aarch64-unknown-linux-musl
    x86_64-apple-darwin
    x86_64-unknown-linux-gnu
    x86_64-unknown-linux-musl
  )
  @nif_versions ~w(2.16 2.17)

  @cache_env "LOCKS_NIF_CACHE_DIR"
  @base_url_env "LOCKS_NIF_BASE_URL"
  @target_env "LOCKS_NIF_TARGET"
  @cache_name "phoenix_kit_agent_locks"

  # httpc keeps options (the proxy) per profile, and a proxy once set cannot
  # be unset: a profile of our own, started for one download and stopped
  # after it, so that neither the host's HTTP client nor the next download
  # inherits a proxy from this one.
  @profile :phoenix_kit_agent_locks_nif
  # An artifact is a few MB; a sandbox without network fails at connect.
  @connect_timeout 15_000
  @timeout 300_000

  @type settings :: %{
          version: String.t(),
          target: {:ok, String.t()} | {:error, String.t()},
          nif_version: String.t(),
          checksum_file: Path.t(),
          cache_dir: Path.t(),
          base_url: String.t(),
          proxy: keyword()
        }

  @doc "The Rust targets the release workflow builds."
  def targets, do: @targets

  @doc "The NIF versions the release workflow builds, oldest first."
  def nif_versions, do: @nif_versions

  @doc "The checksum file of the library at `root`."
  def checksum_file(root), do: Path.join(root, @checksum_file)

  @doc "Environment variables: the cache directory, the base URL, the target."
  def env_names, do: %{cache_dir: @cache_env, base_url: @base_url_env, target: @target_env}

  @doc """
  Where and what to look for, for the library at `root` (the project Mix
  runs the compiler for), from the environment `env`.
  """
  @spec settings(Path.t(), %{String.t() => String.t()}) :: settings()
  def settings(root, env) do
    config = Mix.Project.config()

    %{
      version: config[:version],
      target:
        if(target = value(env, @target_env),
          do: {:ok, target},
          else: target_triple(List.to_string(:erlang.system_info(:system_architecture)))
        ),
      nif_version: List.to_string(:erlang.system_info(:nif_version)),
      checksum_file: checksum_file(root),
      cache_dir: value(env, @cache_env) || :filename.basedir(:user_cache, @cache_name),
      base_url: String.trim_trailing(value(env, @base_url_env) || base_url(config), "/"),
      proxy: proxy_options(env)
    }
  end

  # The release's download URL, defined once, in mix.exs.
  defp base_url(config), do: Keyword.fetch!(config, :locks_nif_base_url)

  # An empty variable counts as unset, as shells and Docker ENV lines make them.
  defp value(env, name) do
    case env[name] do
      nil -> nil
      "" -> nil
      value -> value
    end
  end

  @doc """
  The Rust target for an Erlang system architecture
  (`:erlang.system_info(:system_architecture)`).

      iex> target_triple("x86_64-pc-linux-gnu")
      {:ok, "x86_64-unknown-linux-gnu"}
      iex> target_triple("aarch64-alpine-linux-musl")
      {:ok, "aarch64-unknown-linux-musl"}
      iex> target_triple("aarch64-apple-darwin23.4.0")
      {:ok, "aarch64-apple-darwin"}
  """
  @spec target_triple(String.t()) :: {:ok, String.t()} | {:error, String.t()}
  def target_triple(architecture) do
    cpu = %{
      "x86_64" => "x86_64",
      "amd64" => "x86_64",
      "aarch64" => "aarch64",
      "arm64" => "aarch64"
    }

    case String.split(architecture, "-") do
      [arch, _vendor, "linux", abi] when is_map_key(cpu, arch) and abi in ["gnu", "musl"] ->
        {:ok, "#{cpu[arch]}-unknown-linux-#{abi}"}

      [arch, "apple", "darwin" <> _] when is_map_key(cpu, arch) ->
        {:ok, "#{cpu[arch]}-apple-darwin"}

      _ ->
        {:error, "no Rust target known for the system architecture #{architecture}"}
    end
  end

  @doc "The artifact's file name."
  @spec artifact(String.t(), String.t(), String.t()) :: String.t()
  def artifact(version, nif_version, target),
    do: "#{library(version, nif_version, target)}.tar.gz"

  defp library(version, nif_version, target),
    do: "lib#{@crate}-v#{version}-nif-#{nif_version}-#{target}.so"

  @doc """
  The artifact for these settings, verified and unpacked:

    * `{:ok, library, artifact, from}`: the library's bytes, the artifact's
      name, and the cache file or URL it came from;
    * `{:mismatch, message}`: an artifact was found whose SHA-256 is not the
      listed one. Never a reason to build another way: the message names both
      hashes, and nothing was kept;
    * `{:unavailable, reason}`: no artifact to use (none listed, not cached
      and the download failed, …), and why.
  """
  @spec fetch(settings()) ::
          {:ok, binary(), String.t(), String.t()}
          | {:mismatch, String.t()}
          | {:unavailable, String.t()}
  def fetch(settings) do
    with {:ok, name, expected} <- listed(settings),
         {:ok, tarball, from} <- cached_or_downloaded(settings, name),
         :ok <- verify(tarball, expected, name, from),
         {:ok, library} <- unpack(tarball, name) do
      if match?({:download, _}, from), do: keep(settings.cache_dir, name, tarball)
      {:ok, library, name, describe(from)}
    end
  end

  @doc """
  The artifact to put in the cache directory by hand for these settings, for
  messages: the newest NIF version the VM loads, or `nil` with no target.
  """
  @spec wanted(settings()) :: String.t() | nil
  def wanted(%{target: {:ok, target}} = settings) do
    nif = List.first(loadable(settings.nif_version)) || settings.nif_version
    artifact(settings.version, nif, target)
  end

  def wanted(_settings), do: nil

  defp listed(%{target: {:error, why}}), do: {:unavailable, why}

  defp listed(%{target: {:ok, target}} = settings) do
    case read_checksums(settings.checksum_file) do
      {:ok, checksums} ->
        settings.nif_version
        |> loadable()
        |> Enum.map(&artifact(settings.version, &1, target))
        |> Enum.find(&Map.has_key?(checksums, &1))
        |> case do
          nil ->
            {:unavailable,
             "#{@checksum_file} lists no artifact of version #{settings.version} for " <>
               "#{target} and NIF version #{settings.nif_version}"}

          name ->
            {:ok, name, checksums[name]}
        end

      {:error, why} ->
        {:unavailable, why}
    end
  end

  # The NIF versions built (nif_versions/0) that a VM of NIF version
  # `running` loads, newest first: the same major version, a minor no higher.
  defp loadable(running) do
    {major, minor} = parse_nif(running)

    @nif_versions
    |> Enum.filter(fn version -> match?({^major, m} when m <= minor, parse_nif(version)) end)
    |> Enum.reverse()
  end

  defp parse_nif(version) do
    [major, minor] = version |> String.split(".") |> Enum.map(&String.to_integer/1)
    {major, minor}
  end

  defp cached_or_downloaded(settings, name) do
    cached = Path.join(settings.cache_dir, name)

    case File.read(cached) do
      {:ok, tarball} ->
        {:ok, tarball, {:cache, cached}}

      {:error, _} ->
        url = "#{settings.base_url}/#{name}"

        case download(url, settings.proxy) do
          {:ok, tarball} -> {:ok, tarball, {:download, url}}
          {:error, why} -> {:unavailable, "#{name} is not in #{settings.cache_dir}, and #{why}"}
        end
    end
  end

  defp verify(tarball, expected, name, from) do
    case checksum(tarball) do
      ^expected ->
        :ok

      actual ->
        {:mismatch,
         "checksum mismatch for #{name} from #{describe(from)}:\n" <>
           "  expected #{expected} (#{@checksum_file})\n" <>
           "  got      #{actual}\n" <>
           "Nothing was installed. " <>
           case from do
             {:cache, path} -> "Delete #{path} to download the artifact again."
             {:download, _} -> "The download is not the artifact the release published."
           end}
    end
  end

  defp unpack(tarball, name) do
    library = String.trim_trailing(name, ".tar.gz")

    case :erl_tar.extract({:binary, tarball}, [:memory, :compressed]) do
      {:ok, files} ->
        case Enum.find(files, fn {file, _} ->
               String.trim_leading(List.to_string(file), "./") == library
             end) do
          {_, bytes} -> {:ok, bytes}
          nil -> {:unavailable, "#{name} holds no #{library}"}
        end

      {:error, reason} ->
        {:unavailable, "cannot unpack #{name}: #{:erl_tar.format_error(reason)}"}
    end
  end

  # Best effort: a read-only cache (a sandbox) costs a download next time.
  defp keep(dir, name, tarball) do
    path = Path.join(dir, name)
    staged = "#{path}.#{System.pid()}-#{System.unique_integer([:positive])}.tmp"

    with :ok <- File.mkdir_p(dir),
         :ok <- File.write(staged, tarball),
         :ok <- File.rename(staged, path) do
      :ok
    else
      {:error, reason} ->
        File.rm(staged)
        Mix.shell().info("locks_nif: cannot cache #{path}: #{:file.format_error(reason)}")
    end
  end

  defp describe({_, where}), do: where

  ## Checksums

  @doc ~S"""
  The checksum of `bytes` as the checksum file writes it.

      iex> checksum("")
      "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
  """
  @spec checksum(binary()) :: String.t()
  def checksum(bytes), do: "sha256:" <> Base.encode16(:crypto.hash(:sha256, bytes), case: :lower)

  @doc """
  The checksum file at `path` as a map of artifact names to checksums. Read
  as a literal map of strings, never evaluated.
  """
  @spec read_checksums(Path.t()) :: {:ok, %{String.t() => String.t()}} | {:error, String.t()}
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

  @doc "Writes `checksums` to `path`, one artifact a line in name order."
  @spec write_checksums(Path.t(), %{String.t() => String.t()}) :: :ok
  def write_checksums(path, checksums) when checksums == %{}, do: File.write!(path, "%{}\n")

  def write_checksums(path, checksums) do
    lines =
      checksums
      |> Enum.sort()
      |> Enum.map_join(",\n", fn {name, sum} -> "  #{inspect(name)} => #{inspect(sum)}" end)

    File.write!(path, "%{\n#{lines}\n}\n")
  end

  ## HTTP

  @doc """
  GETs `url` with `:httpc` through `proxy` (`proxy_options/1`): `{:ok,
  body}` on a 200, `{:error, why}` otherwise. HTTPS verifies the server
  against the system's CA certificates and its host name.
  """
  @spec download(String.t(), keyword()) :: {:ok, binary()} | {:error, String.t()}
  def download(url, proxy) do
    with {:ok, _} <- Application.ensure_all_started(:inets),
         {:ok, _} <- Application.ensure_all_started(:ssl),
         {:ok, http_options} <- http_options(url) do
      case :inets.start(:httpc, profile: @profile) do
        {:ok, _} -> :ok
        {:error, {:already_started, _}} -> :ok
      end

      try do
        :ok = :httpc.set_options(proxy, @profile)
        request = {String.to_charlist(url), [{~c"user-agent", ~c"phoenix_kit_agent_locks"}]}

        case :httpc.request(:get, request, http_options, [body_format: :binary], @profile) do
          {:ok, {{_, 200, _}, _headers, body}} ->
            {:ok, body}

          {:ok, {{_, status, reason}, _, _}} ->
            {:error, "GET #{url} answered #{status} #{reason}"}

          {:error, reason} ->
            {:error, "GET #{url} failed: #{http_error(reason)}"}
        end
      after
        :inets.stop(:httpc, @profile)
      end
    else
      {:error, {app, reason}} when is_atom(app) ->
        {:error, "cannot start #{inspect(app)} to download #{url}: #{inspect(reason)}"}

      {:error, why} ->
        {:error, why}
    end
  end

  defp http_options("https:" <> _ = url) do
    ssl = [
      verify: :verify_peer,
      cacerts: :public_key.cacerts_get(),
      customize_hostname_check: [match_fun: :public_key.pkix_verify_hostname_match_fun(:https)]
    ]

    {:ok, [ssl: ssl, connect_timeout: @connect_timeout, timeout: @timeout]}
  rescue
    error -> {:error, "no CA certificates to verify #{url}: #{Exception.message(error)}"}
  end

  defp http_options(_url), do: {:ok, [connect_timeout: @connect_timeout, timeout: @timeout]}

  defp http_error({:failed_connect, info}) do
    case List.keyfind(info, :inet, 0) do
      {:inet, _, {:tls_alert, {alert, _text}}} -> "cannot connect: TLS alert #{alert}"
      {:inet, _, reason} -> "cannot connect: #{:inet.format_error(reason)}"
      nil -> "cannot connect: #{inspect(info)}"
    end
  end

  defp http_error(:timeout), do: "timed out"
  defp http_error(reason), do: inspect(reason)

  @doc """
  The `:httpc` proxy options for the environment `env`: `proxy` from
  `http_proxy`, `https_proxy` from `https_proxy` (the lower-case name first,
  then the upper-case one), each with the hosts of `no_proxy` as exceptions
  (`.example.com` and `example.com` both cover its subdomains).

      iex> proxy_options(%{"HTTPS_PROXY" => "http://proxy.internal:3128", "no_proxy" => "10.0.0.1,.corp"})
      [https_proxy: {{~c"proxy.internal", 3128}, [~c"10.0.0.1", ~c"*.corp"]}]

  `no_proxy=*` turns the proxies off.
  """
  @spec proxy_options(%{String.t() => String.t()}) :: keyword()
  def proxy_options(env) do
    exceptions =
      (value(env, "no_proxy") || value(env, "NO_PROXY") || "")
      |> String.split(",", trim: true)
      |> Enum.map(&String.trim/1)
      |> Enum.flat_map(fn
        "." <> domain -> ["*." <> domain]
        "*" <> _ = pattern -> [pattern]
        host -> if host =~ ~r/^[\d.:\[\]]+$/, do: [host], else: [host, "*." <> host]
      end)
      |> Enum.uniq()
      |> Enum.map(&String.to_charlist/1)

    proxies =
      for {option, names} <- [
            proxy: ~w(http_proxy HTTP_PROXY),
            https_proxy: ~w(https_proxy HTTPS_PROXY)
          ],
          proxy = Enum.find_value(names, &value(env, &1)) do
        uri = URI.parse(if proxy =~ "://", do: proxy, else: "http://" <> proxy)
        {option, {{String.to_charlist(uri.host), uri.port || 80}, exceptions}}
      end

    if ~c"*" in exceptions, do: [], else: proxies
  end
end
