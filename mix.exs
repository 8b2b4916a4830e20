defmodule PhoenixKitAgent.Turns.Locks.MixProject do
  use Mix.Project

  @version "0.1.0"
  # Where the release workflow (.github/workflows/release.yml) publishes the
  # prebuilt libraries of a version; LOCKS_NIF_BASE_URL overrides it.
  @source_url "https://github.com/your-org/phoenix_kit_agent_locks"

  def project do
    [
      app: :phoenix_kit_agent_locks,
      version: @version,
      # Tested on Elixir 1.14 / OTP 25 and 1.18 / OTP 27 (README, "Requirements").
      elixir: "~> 1.14",
      # The project's own compiler (lib/mix/tasks/compile.locks_nif.ex) runs
      # after Elixir's: it installs a prebuilt library from the release (as
      # listed in the checksum file) or builds native/locks_nif with cargo, in
      # priv/native/. No hex package is involved.
      compilers: Mix.compilers() ++ [:locks_nif],
      locks_nif_base_url: "#{@source_url}/releases/download/v#{@version}",
      elixirc_paths: elixirc_paths(Mix.env()),
      # Only the Mix compiler downloads (Mix.Tasks.Compile.LocksNif.Prebuilt,
      # which puts :inets and :ssl on the code path and starts them itself):
      # the running application needs none of them (its TLS is Rust's), so
      # they are not in extra_applications.
      xref: [exclude: [:httpc, :inets, :ssl, :public_key]],
      start_permanent: Mix.env() == :prod,
      deps: [],
      # For `mix docs` where ExDoc can be had (a :dev dependency on hex, which
      # these machines cannot reach, so none is declared): the README and the
      # guides as extras beside the module docs. Each reads on its own as Markdown.
      docs: [
        main: "readme",
        source_url: @source_url,
        extras: ["README.md" | Path.wildcard("guides/*.md")] ++ ["CONTRIBUTING.md"]
      ],
      description:
        "The turn locks of PhoenixKitAgent as a Rust NIF over pooled PostgreSQL connections.",
      package: [
        files:
          ~w(lib native/locks_core native/locks_nif priv/schema.sql Cargo.toml Cargo.lock .cargo/config.toml
             checksum-Elixir.PhoenixKitAgent.Turns.Locks.Native.exs mix.exs README.md guides)
      ]
    ]
  end

  def application do
    [
      mod: {PhoenixKitAgent.Turns.Locks.Application, []},
      extra_applications: [:logger, :crypto]
    ]
  end

  # The demo and the release's checksum task (dev/, `mix locks.demo`, `mix
  # locks.checksum`) are the project's own: compiled in :dev and :test,
  # never in a host's release. The benchmark is a Mix project of its own
  # (bench/, which depends on this one by path).
  defp elixirc_paths(:test), do: ["lib", "dev", "test/support"]
  defp elixirc_paths(:dev), do: ["lib", "dev"]
  defp elixirc_paths(_), do: ["lib"]
end
