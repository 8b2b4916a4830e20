defmodule PhoenixKitAgent.Turns.Locks.Schema do
  @moduledoc """
  The tables the locks live in, as idempotent DDL of two kinds: `:tables`
  creates both tables (`priv/schema.sql`); `:lock_columns` only adds `busy_since` /
  `busy_turn_ref` and the unique index on `user_uuid` to tables a host has.
  """

  alias PhoenixKitAgent.Turns.Locks.{Config, Native}

  @type kind :: :tables | :lock_columns

  @doc """
  The DDL of `kind` as one script (psql, a SQL file), with the tables
  qualified by the schema `prefix` (an identifier, quoted) when one is given.
  """
  @spec sql(kind(), String.t() | nil) :: String.t()
  def sql(kind \\ :tables, prefix \\ nil) when kind in [:tables, :lock_columns] do
    unless prefix == nil or Config.prefix?(prefix),
      do: raise(ArgumentError, "invalid prefix: #{Config.prefix_rule()}, got: #{inspect(prefix)}")

    Native.ddl(kind, prefix)
  end

  @doc """
  The DDL of `sql/2` one statement at a time, without comments or the final
  `;`, for an Ecto migration's `execute/1`: Postgrex prepares what it sends,
  and PostgreSQL refuses several commands in one prepared statement.

      for statement <- Schema.statements(:lock_columns, prefix()), do: execute(statement)

  (the whole migration: guides/operating.md, "Schema and migrations").
  """
  @spec statements(kind(), String.t() | nil) :: [String.t()]
  def statements(kind \\ :tables, prefix \\ nil) when kind in [:tables, :lock_columns] do
    # The library's own DDL: a comment is a line of its own, and a `;` ends a
    # line only where a statement ends.
    sql(kind, prefix)
    |> String.replace(~r/^[ \t]*--.*\n?/m, "")
    |> String.split(~r/;[ \t]*$/m)
    |> Enum.map(&String.trim/1)
    |> Enum.reject(&(&1 == ""))
  end

  @doc """
  Runs the DDL of `kind` on the library's pool (under its configured prefix),
  as `mix locks.setup` does. Raises `PhoenixKitAgent.Turns.Locks.Error` when
  the database refuses it.
  """
  @spec setup!(kind()) :: :ok
  def setup!(kind \\ :tables) when kind in [:tables, :lock_columns], do: Native.setup(kind)
end
