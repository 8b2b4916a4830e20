defmodule PhoenixKitAgent.Turns.Locks.FakeRepo do
  @moduledoc false
  # Stands in for a host's Ecto repo (Ecto is not available here): what the
  # library uses of a repo is `config/0`, which for an Ecto repo returns the
  # repo's application environment with a `url:` already split into discrete
  # settings. This module reads `config :locks_fake_host, FakeRepo, …` the
  # same way (so a test sets it with Application.put_env, async: false);
  # `new/1` makes a repo of its own per test, for async tests.

  @doc "The repo's settings, as `MyApp.Repo.config()` returns them."
  def config do
    :locks_fake_host
    |> Application.get_env(__MODULE__, [])
    |> ecto_config()
  end

  @doc """
  A new module whose `config/0` returns `config` (after Ecto's treatment of
  a `url:`), unique to the caller.
  """
  def new(config) do
    name = Module.concat(__MODULE__, "Repo#{System.unique_integer([:positive])}")
    # Kept aside, not in the module's code: a config may hold a function
    # (an :ssl option's match_fun), which cannot be compiled into it.
    :persistent_term.put({__MODULE__, name}, ecto_config(config))

    Module.create(
      name,
      quote(do: def(config, do: :persistent_term.get({unquote(__MODULE__), unquote(name)}))),
      Macro.Env.location(__ENV__)
    )

    name
  end

  @doc """
  What Ecto makes of a repo's settings: a `url:` becomes `hostname`, `port`,
  `username`, `password` and `database`, overriding the others. With
  `keep_url: true` the URL is left as it is (a repo that is not Ecto's).
  """
  def ecto_config(config) do
    case Keyword.pop(config, :url) do
      {nil, config} ->
        config

      {url, config} ->
        if Keyword.get(config, :keep_url),
          do: Keyword.put(Keyword.delete(config, :keep_url), :url, url),
          else: Keyword.merge(config, parse_url(url))
    end
  end

  defp parse_url(url) do
    uri = URI.parse(url)

    {username, password} =
      case String.split(uri.userinfo || "", ":", parts: 2) do
        [""] -> {nil, nil}
        [user] -> {URI.decode(user), nil}
        [user, password] -> {URI.decode(user), URI.decode(password)}
      end

    [
      username: username,
      password: password,
      hostname: uri.host,
      port: uri.port,
      database: uri.path && String.trim_leading(uri.path, "/")
    ]
    |> Enum.reject(fn {_key, value} -> value in [nil, ""] end)
  end
end
