defmodule PhoenixKitAgent.Turns.Locks.Bench.Peer do
  @moduledoc false
  # `--peer postgrex`: the library's own statements through Postgrex, the
  # Elixir driver a host already has, on the same database with the same
  # pool size, in the same run as the library and pgbench.
  #
  # The project has no hex dependency: Postgrex is only there when the bench
  # runs from a host app that has it. So it is called through `apply/3` on
  # module atoms, never by name: the library compiles without it (and with
  # --warnings-as-errors).
  #
  # Each statement is prepared once (`Postgrex.prepare/4`, on one pooled
  # connection; DBConnection prepares it again on each other connection the
  # first time it runs there, as for an Ecto repo) and executed with
  # `Postgrex.execute/4` by every caller.

  alias PhoenixKitAgent.Turns.Locks.Config

  @how """
  --peer postgrex needs Postgrex loaded in this VM, and this project has no \
  hex dependency. Run the bench from a host app that has Postgrex (every \
  Phoenix app with Ecto does), with this library as a dependency compiled \
  in :dev (the bench is not in a release):

      # the host's mix.exs
      {:phoenix_kit_agent_locks, path: "…", env: :dev}

      # then, in the host app
      MIX_ENV=dev mix locks.bench --peer postgrex --workloads cycle,reads --runs 5
  """

  @peers ["postgrex"]

  @doc """
  The peer `--peer` names, when it can run here: `{:ok, nil}` without one,
  `{:ok, :postgrex}`, or `{:error, message}` (the message says how to get
  the comparison).
  """
  @spec check(String.t() | nil) :: {:ok, :postgrex | nil} | {:error, String.t()}
  def check(nil), do: {:ok, nil}

  def check("postgrex") do
    if loaded?(), do: {:ok, :postgrex}, else: {:error, "Postgrex is not loaded.\n\n" <> @how}
  end

  def check(other),
    do: {:error, "unknown peer #{inspect(other)}; known: #{Enum.join(@peers, ", ")}"}

  @doc "Whether Postgrex is loaded in this VM."
  @spec loaded?() :: boolean()
  def loaded?,
    do: Code.ensure_loaded?(Postgrex) and function_exported?(Postgrex, :execute, 4)

  @doc """
  Starts a Postgrex pool of `pool_size` for `config` and prepares `texts`
  (`%{name => sql}`) on it: `%{pool: pid, queries: %{name => query}}`.
  """
  @spec start(Config.t(), pos_integer(), %{String.t() => String.t()}) ::
          {:ok, map()} | {:error, String.t()}
  def start(%Config{} = config, pool_size, texts) do
    opts =
      location(config) ++
        [
          port: config.port,
          username: config.username,
          password: config.password,
          database: config.database,
          ssl: ssl(config),
          pool_size: pool_size,
          # DBConnection's defaults (50 ms, 1 s) drop queued requests once
          # the queue waits longer than that, which 50 callers on a pool of 8
          # do on a loaded machine; the library's callers wait up to its
          # checkout timeout, and so do these.
          queue_target: config.checkout_timeout,
          queue_interval: config.checkout_timeout,
          parameters: [application_name: "phoenix_kit_agent_locks bench postgrex"],
          # Not linked to the caller: the bench stops it itself.
          sync_connect: false
        ]

    with {:ok, pool} <- apply(Postgrex, :start_link, [opts]) do
      Process.unlink(pool)

      queries =
        Map.new(texts, fn {name, sql} ->
          statement = "bench_" <> String.replace(name, "?", "_q")

          case apply(Postgrex, :prepare, [pool, statement, sql, []]) do
            {:ok, query} -> {name, query}
            {:error, e} -> throw({:prepare, name, Exception.message(e)})
          end
        end)

      {:ok, %{pool: pool, queries: queries}}
    end
  catch
    {:prepare, name, why} -> {:error, "Postgrex cannot prepare #{name}: #{why}"}
  end

  @doc "Stops the pool."
  def stop(%{pool: pool}) do
    ref = Process.monitor(pool)
    Process.exit(pool, :shutdown)
    receive(do: ({:DOWN, ^ref, _, _, _} -> :ok))
  end

  @doc "Runs the prepared statement `name` with `params`: its rows (raises on an error)."
  @spec execute(map(), String.t(), list()) :: [list()]
  def execute(%{pool: pool, queries: queries}, name, params) do
    case apply(Postgrex, :execute, [pool, Map.fetch!(queries, name), params, []]) do
      {:ok, _query, %{rows: rows}} -> rows
      {:error, e} -> raise "Postgrex: #{name} failed: #{Exception.message(e)}"
    end
  end

  defp location(%Config{socket_dir: dir}) when is_binary(dir), do: [socket_dir: dir]
  defp location(%Config{hostname: host}), do: [hostname: host]

  # Postgrex has no `prefer`: a server that offers TLS is still used in
  # the clear, as with `disable`.
  defp ssl(%Config{sslmode: mode}) when mode in [:disable, :prefer], do: false
  defp ssl(%Config{sslmode: :require}), do: [verify: :verify_none]

  defp ssl(%Config{ssl_ca_file: ca} = config) do
    [verify: :verify_peer, cacertfile: ca] ++
      if config.sslmode == :verify_full,
        do: [server_name_indication: String.to_charlist(config.hostname)],
        else: []
  end
end
