defmodule PhoenixKitAgent.Turns.Locks.TestDB do
  @moduledoc false
  # Direct SQL for the tests, through `psql` (hex is unreachable, so there is
  # no Postgrex): inserting rows, reading them back, and making a lock stale
  # by backdating its `busy_since` instead of sleeping through a TTL.

  @doc "The URL the tests run against."
  def url, do: System.fetch_env!("DATABASE_URL")

  @doc "Runs `sql` and returns its rows as lists of strings (NULL is nil)."
  def query!(sql, url \\ url()) do
    args = [
      "-X",
      "-q",
      "-A",
      "-t",
      "-F",
      "\t",
      "-P",
      "null=\\N",
      "-v",
      "ON_ERROR_STOP=1",
      "-d",
      url,
      "-c",
      sql
    ]

    case System.cmd("psql", args,
           stderr_to_stdout: true,
           env: [{"PGCONNECT_TIMEOUT", "10"}, {"PGTZ", "UTC"}]
         ) do
      {out, 0} ->
        out
        |> String.split("\n", trim: true)
        |> Enum.map(fn line ->
          line |> String.split("\t") |> Enum.map(&if(&1 == "\\N", do: nil, else: &1))
        end)

      {out, status} ->
        raise "psql exited #{status}: #{out}"
    end
  end

  @doc "A new random (v4) UUID string, lower case."
  def uuid do
    <<a::48, _::4, b::12, _::2, c::62>> = :crypto.strong_rand_bytes(16)
    <<x::128>> = <<a::48, 4::4, b::12, 2::2, c::62>>

    x
    |> Integer.to_string(16)
    |> String.pad_leading(32, "0")
    |> String.downcase()
    |> then(fn h ->
      <<p1::binary-8, p2::binary-4, p3::binary-4, p4::binary-4, p5::binary-12>> = h
      Enum.join([p1, p2, p3, p4, p5], "-")
    end)
  end

  @doc """
  The tables the tests run on, from LOCKS_TEST_TABLES: `:shipped` (the
  library's own DDL, the default) or `:ecto` (as Ecto migrations make a
  host's: see `ecto_tables/2`).
  """
  def tables, do: if(System.get_env("LOCKS_TEST_TABLES") == "ecto", do: :ecto, else: :shipped)

  @doc """
  The SQL that inserts the chat rows of `ids` into `table`: on Ecto-made
  tables a row needs its `inserted_at` and `updated_at` (no default).
  """
  def insert_chats_sql(ids, table \\ "phoenix_kit_agent_conversations") do
    {columns, values} =
      if tables() == :ecto, do: {", inserted_at, updated_at", ", now(), now()"}, else: {"", ""}

    "INSERT INTO #{table} (uuid#{columns}) VALUES " <>
      Enum.map_join(ids, ",", &"('#{&1}'#{values})")
  end

  @doc "Inserts `n` new chats and returns their uuids."
  def insert_chats!(n) do
    ids = for _ <- 1..n, do: uuid()
    query!(insert_chats_sql(ids))
    ids
  end

  @doc """
  Both tables as a PhoenixKit host's Ecto migrations make them, in schema
  `prefix` (or the search_path), as Ecto's PostgreSQL adapter writes the
  DDL: uuid primary keys without a database default (Ecto generates them),
  `timestamps(type: timestamps)` columns `NOT NULL` without a default
  (`:naive_datetime` is `timestamp(0)`, `:utc_datetime_usec` is `timestamp`),
  and a chat table whose lock columns came from an earlier migration as
  `add :busy_since, :utc_datetime_usec` and `add :busy_turn_ref, :string`.
  Then the library's `Schema.statements(:lock_columns, prefix)`, as a host's
  migration runs them.
  """
  def ecto_tables(prefix \\ nil, timestamps \\ :naive_datetime) do
    ts = %{naive_datetime: "timestamp(0)", utc_datetime_usec: "timestamp"}[timestamps]
    q = fn table -> if prefix, do: ~s("#{prefix}"."#{table}"), else: ~s("#{table}") end

    [
      if(prefix, do: ~s[CREATE SCHEMA IF NOT EXISTS "#{prefix}"]),
      ~s[CREATE TABLE #{q.("phoenix_kit_agent_conversations")} ("uuid" uuid, "user_uuid" uuid, ] <>
        ~s["title" varchar(255), "busy_since" timestamp, "busy_turn_ref" varchar(255), ] <>
        ~s["inserted_at" #{ts} NOT NULL, "updated_at" #{ts} NOT NULL, PRIMARY KEY ("uuid"))],
      ~s[CREATE TABLE #{q.("phoenix_kit_agent_user_settings")} ("uuid" uuid, ] <>
        ~s["user_uuid" uuid NOT NULL, "settings" jsonb DEFAULT '{}' NOT NULL, ] <>
        ~s["inserted_at" #{ts} NOT NULL, "updated_at" #{ts} NOT NULL, PRIMARY KEY ("uuid"))],
      ~s[CREATE UNIQUE INDEX "phoenix_kit_agent_user_settings_user_uuid_index" ] <>
        ~s[ON #{q.("phoenix_kit_agent_user_settings")} ("user_uuid")]
      | PhoenixKitAgent.Turns.Locks.Schema.statements(:lock_columns, prefix)
    ]
    |> Enum.reject(&is_nil/1)
    |> Enum.map_join(";\n", & &1)
  end

  @doc "Inserts one new chat and returns its uuid."
  def insert_chat!, do: hd(insert_chats!(1))

  @doc """
  The lock columns of a chat (`:chat`) or user settings (`:user`) row:
  `{busy_turn_ref, age_in_whole_seconds}` by the database's clock, or `nil`
  when there is no row.
  """
  def lock(kind, id) do
    {table, key} = table(kind)

    case query!("""
         SELECT busy_turn_ref, floor(extract(epoch FROM now() - busy_since))::int
         FROM #{table} WHERE #{key} = '#{id}'
         """) do
      [] -> nil
      [[ref, age]] -> {ref, age && String.to_integer(age)}
    end
  end

  @doc """
  Makes a lock look `seconds` older than it is, as if its node had gone down
  that long ago: the TTL passes without the test sleeping through it.
  """
  def backdate!(kind, id, seconds) do
    {table, key} = table(kind)

    query!("""
    UPDATE #{table} SET busy_since = busy_since - #{seconds} * interval '1 second'
    WHERE #{key} = '#{id}'
    """)

    :ok
  end

  defp table(:chat), do: {"phoenix_kit_agent_conversations", "uuid"}
  defp table(:user), do: {"phoenix_kit_agent_user_settings", "user_uuid"}
end
