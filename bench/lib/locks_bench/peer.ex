defmodule LocksBench.Peer do
  @moduledoc false
  # `--peer postgrex`: the library's own statements through Postgrex, the
  # driver a Phoenix host already has, with a pool of the same size; each
  # statement prepared once (`Postgrex.prepare/4`; DBConnection prepares it
  # again on each other connection the first time it runs there) and run
  # with `Postgrex.execute/4` by every caller.
  #
  # Postgrex is a dependency only when LOCKS_BENCH_PEERS is set (mix.exs),
  # so it is called through apply/3: the bench compiles without it.

  alias PhoenixKitAgent.Turns.Locks.Config

  @postgrex Postgrex

  @doc "Whether Postgrex is in this build."
  def loaded?, do: Code.ensure_loaded?(@postgrex) and function_exported?(@postgrex, :execute, 4)

  @doc "Postgrex's version and DBConnection's, for the report."
  def versions, do: "Postgrex #{vsn(:postgrex)} (DBConnection #{vsn(:db_connection)})"

  defp vsn(app), do: to_string(Application.spec(app, :vsn) || "?")

  @doc "Starts a pool of `pool_size` for `config` and prepares `texts` (`%{name => sql}`) on it."
  def start(%Config{} = config, pool_size, texts) do
    {:ok, _} = Application.ensure_all_started(:postgrex)

    opts = [
      port: config.port,
      username: config.username,
      password: config.password,
      database: config.database,
      ssl: ssl(config),
      pool_size: pool_size,
      # DBConnection's defaults drop requests that queue longer than 50 ms
      # to 1 s, which 50 callers on a small pool do; the library's callers
      # wait up to its checkout timeout, and so do these.
      queue_target: config.checkout_timeout,
      queue_interval: config.checkout_timeout,
      parameters: [application_name: "phoenix_kit_agent_locks bench postgrex"]
    ]

    location =
      if config.socket_dir, do: [socket_dir: config.socket_dir], else: [hostname: config.hostname]

    {:ok, pool} = apply(@postgrex, :start_link, [location ++ opts])
    Process.unlink(pool)

    queries =
      Map.new(texts, fn {name, sql} ->
        {:ok, query} =
          apply(@postgrex, :prepare, [pool, "bench_" <> String.replace(name, "?", "_q"), sql, []])

        {name, query}
      end)

    %{pool: pool, queries: queries}
  end

  @doc "Stops the pool."
  def stop(%{pool: pool}) do
    ref = Process.monitor(pool)
    Process.exit(pool, :shutdown)
    receive(do: ({:DOWN, ^ref, _, _, _} -> :ok))
  end

  @doc "Runs the prepared statement `name` with `params`: its rows."
  def execute(%{pool: pool, queries: queries}, name, params) do
    {:ok, _query, %{rows: rows}} =
      apply(@postgrex, :execute, [pool, Map.fetch!(queries, name), params, []])

    rows
  end

  # Postgrex has no `prefer`: such a server is used in the clear.
  defp ssl(%Config{sslmode: mode}) when mode in [:disable, :prefer], do: false
  defp ssl(%Config{sslmode: :require}), do: [verify: :verify_none]

  defp ssl(%Config{ssl_ca_file: ca} = config) do
    sni =
      if config.sslmode == :verify_full,
        do: [server_name_indication: String.to_charlist(config.hostname)],
        else: []

    [verify: :verify_peer, cacertfile: ca] ++ sni
  end
end
