defmodule LocksBench.MixProject do
  use Mix.Project

  # The benchmark of phoenix_kit_agent_locks, a project of its own: the
  # library is a path dependency, and so is the peer it is compared with,
  # Postgrex, only when LOCKS_BENCH_PEERS names a directory holding it and
  # what it needs, their dependencies on each other by path. No hex package
  # is involved; the peers are never committed.
  def project do
    [
      app: :phoenix_kit_agent_locks_bench,
      version: "0.1.0",
      elixir: "~> 1.14",
      deps: [{:phoenix_kit_agent_locks, path: ".."} | peers(System.get_env("LOCKS_BENCH_PEERS"))]
    ]
  end

  def application, do: [extra_applications: [:logger, :crypto, :ssl, :public_key]]

  defp peers(dir) when dir in [nil, ""], do: []
  defp peers(dir), do: [{:postgrex, path: Path.join(Path.expand(dir), "postgrex")}]
end
