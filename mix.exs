defmodule PhoenixKitAgent.Turns.Locks.MixProject do
  use Mix.Project

  @version "0.1.0"

  def project do
    [
      app: :phoenix_kit_agent_locks,
      version: @version,
      elixir: "~> 1.14",
      # The project's own compiler (lib/mix/tasks/compile.locks_nif.ex) runs
      # after Elixir's: it builds native/locks_nif with cargo and installs the
      # library in priv/native/. No hex package is involved.
      compilers: Mix.compilers() ++ [:locks_nif],
      elixirc_paths: elixirc_paths(Mix.env()),
      # Only bench/wire.ex (compiled in :dev and :test) calls :ssl, to reach
      # a server that asks for TLS; the library itself does TLS in Rust and
      # does not start :ssl.
      xref: [exclude: [:ssl, :public_key]],
      start_permanent: Mix.env() == :prod,
      deps: [],
      description:
        "The turn locks of PhoenixKitAgent as a Rust NIF over pooled PostgreSQL connections.",
      package: [
        files:
          ~w(lib native/locks_core native/locks_nif priv/schema.sql Cargo.toml Cargo.lock mix.exs README.md)
      ]
    ]
  end

  def application do
    [
      mod: {PhoenixKitAgent.Turns.Locks.Application, []},
      extra_applications: [:logger, :crypto]
    ]
  end

  # The benchmark (bench/, `mix locks.bench`) is the project's own: compiled
  # in :dev and :test, never in a host's release.
  defp elixirc_paths(:test), do: ["lib", "bench", "test/support"]
  defp elixirc_paths(:dev), do: ["lib", "bench"]
  defp elixirc_paths(_), do: ["lib"]
end
