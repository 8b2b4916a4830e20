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

    case System.cmd("psql", args, stderr_to_stdout: true, env: [{"PGCONNECT_TIMEOUT", "10"}]) do
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

  @doc "Inserts `n` new chats and returns their uuids."
  def insert_chats!(n) do
    ids = for _ <- 1..n, do: uuid()
    values = Enum.map_join(ids, ",", &"('#{&1}')")
    query!("INSERT INTO phoenix_kit_agent_conversations (uuid) VALUES #{values}")
    ids
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
