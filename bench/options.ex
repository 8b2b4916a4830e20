defmodule PhoenixKitAgent.Turns.Locks.Bench.Options do
  @moduledoc false
  # The option checks `mix locks.bench` and `mix locks.compare` share; each
  # raises a Mix error that begins with the task's name.

  alias PhoenixKitAgent.Turns.Locks.{Config, Error}

  @doc "A comma-separated option as a list of its words; `default` when absent."
  def list(nil, default), do: default
  def list(text, _default), do: text |> String.split(",", trim: true) |> Enum.map(&String.trim/1)

  @doc """
  Caller counts: the rows of a workload are 50 per kind, and caller k uses
  row k. `text` is the option's value (nil: `default`), `option` its name.
  """
  def callers(task, text, default, option) do
    for word <- list(text, default) do
      case Integer.parse(word) do
        {n, ""} when n in 1..50 -> n
        _ -> Mix.raise("#{task}: #{option} takes numbers from 1 to 50, got #{word}")
      end
    end
  end

  @doc "The positive integer option `key` of `opts`, or `default`."
  def positive(task, opts, key, default) do
    case Keyword.get(opts, key, default) do
      n when is_integer(n) and n > 0 ->
        n

      _ ->
        Mix.raise("#{task}: --#{String.replace(to_string(key), "_", "-")} must be a positive integer")
    end
  end

  @doc "`--pool-size`, checked as the configuration's pool_size is, with its limits."
  def pool_size(task, n) do
    Config.check!(:pool_size, n, "--pool-size")
  rescue
    e in Error -> Mix.raise("#{task}: " <> Exception.message(e))
  end
end
