defmodule PhoenixKitAgent.Turns.Locks.Config do
  @moduledoc false
  # Reads `config :phoenix_kit_agent_locks, …` once, when the application
  # starts, and hands the native side a map with every key (nil = default).
  # Types are checked here, ranges by the native side; both name the setting.

  @keys [:url, :pool_size, :connect_timeout, :checkout_timeout, :statement_timeout, :prefix]

  @doc "The options for `Native.start/1`, from the application environment."
  @spec read(keyword()) :: map()
  def read(env \\ Application.get_all_env(:phoenix_kit_agent_locks)) do
    env = Keyword.take(env, @keys)

    %{
      url: binary(:url, Keyword.get(env, :url) || System.get_env("DATABASE_URL")),
      pool_size: integer(:pool_size, env[:pool_size]),
      connect_timeout: integer(:connect_timeout, env[:connect_timeout]),
      checkout_timeout: integer(:checkout_timeout, env[:checkout_timeout]),
      statement_timeout: integer(:statement_timeout, env[:statement_timeout]),
      prefix: binary(:prefix, env[:prefix])
    }
  end

  defp binary(_key, nil), do: nil
  defp binary(_key, value) when is_binary(value), do: value

  defp binary(key, _value),
    do: raise(ArgumentError, "invalid configuration: #{key}: must be a string")

  defp integer(_key, nil), do: nil
  defp integer(_key, value) when is_integer(value), do: value

  defp integer(key, _value),
    do: raise(ArgumentError, "invalid configuration: #{key}: must be an integer")
end
