defmodule PhoenixKitAgent.Turns.Locks.HostProject do
  @moduledoc false
  # A throwaway Mix project that depends on the library by `path:`, as a
  # Phoenix host would: its files, and the environment its `mix` runs in.
  # Its `HostApp.turn/1` takes a turn on the chat and user given as
  # arguments and prints `RESULTS [acquire, held?, release, held?]`.

  @doc "Writes `files` (`%{relative path => text}`) under `dir`."
  def write!(dir, files) do
    for {path, text} <- files do
      path = Path.join(dir, path)
      File.mkdir_p!(Path.dirname(path))
      File.write!(path, text)
    end

    :ok
  end

  @doc "The host's `mix.exs` and `lib/host_app.ex`, depending on `library`, turns under `turn_ref`."
  def files(library, turn_ref) do
    %{
      "mix.exs" => """
      defmodule HostApp.MixProject do
        use Mix.Project

        def project do
          [
            app: :host_app,
            version: "0.1.0",
            elixir: "~> 1.14",
            deps: [{:phoenix_kit_agent_locks, path: #{inspect(library)}}]
          ]
        end

        def application, do: [extra_applications: [:logger]]
      end
      """,
      "lib/host_app.ex" => """
      defmodule HostApp do
        alias PhoenixKitAgent.Turns.Locks

        def turn([chat, user]) do
          results = [
            Locks.acquire(chat, user, #{inspect(turn_ref)}, 60),
            Locks.held?(chat, user, #{inspect(turn_ref)}),
            Locks.release(chat, user, #{inspect(turn_ref)}),
            Locks.held?(chat, user, #{inspect(turn_ref)})
          ]

          IO.puts("RESULTS " <> inspect(results))
        end
      end
      """
    }
  end

  @doc """
  The environment of a `mix` run for the host rather than this project: its
  own build directory and env (`dev`), no DATABASE_URL; then `extra`.
  """
  def env(extra) do
    [
      {"MIX_ENV", "dev"},
      {"MIX_BUILD_ROOT", nil},
      {"MIX_BUILD_PATH", nil},
      {"MIX_DEPS_PATH", nil},
      {"MIX_EXS", nil},
      {"MIX_LOCKFILE", nil},
      {"DATABASE_URL", nil}
      | extra
    ]
  end

  @doc "The lines of `out` that start with `prefix`."
  def lines(out, prefix),
    do: out |> String.split("\n") |> Enum.filter(&String.starts_with?(&1, prefix))
end
