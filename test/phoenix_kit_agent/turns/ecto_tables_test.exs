defmodule PhoenixKitAgent.Turns.EctoTablesTest do
  # The tables a host really has: made by Ecto migrations (TestDB.ecto_tables/2),
  # so `inserted_at`/`updated_at` are NOT NULL without a database default and
  # the settings table's uuid key has no default either (Ecto generates both
  # in the application); the lock columns were added with
  # `Schema.statements(:lock_columns, prefix)`. The first turn of a new user
  # creates that user's settings row: the library must fill what the
  # database does not. Each database of this module starts its sessions in
  # Asia/Tokyo, so a time written in the session's zone would be 9 h off.
  #
  # async: false: each test restarts the application on a database of its own.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{AppEnv, Error, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.Pg

  @ttl 60

  setup do
    AppEnv.restore_on_exit()
  end

  defp host!(prefix, timestamps) do
    {_db, url} =
      Pg.create_database!("ecto",
        tables: TestDB.ecto_tables(prefix, timestamps),
        settings: ["timezone TO 'Asia/Tokyo'"]
      )

    :ok = AppEnv.restart(url: url, prefix: prefix)
    table = fn name -> if prefix, do: ~s("#{prefix}".#{name}), else: name end

    %{
      url: url,
      chats: table.("phoenix_kit_agent_conversations"),
      users: table.("phoenix_kit_agent_user_settings")
    }
  end

  defp chat!(%{url: url, chats: chats}) do
    chat = TestDB.uuid()

    TestDB.query!(
      "INSERT INTO #{chats} (uuid, inserted_at, updated_at) VALUES ('#{chat}', now(), now())",
      url
    )

    chat
  end

  # The new row: its key, and whether both timestamps hold the database's
  # now as UTC (within the second a timestamp(0) rounds to).
  defp settings_row(%{url: url, users: users}, user) do
    TestDB.query!(
      """
      SELECT uuid IS NOT NULL, inserted_at = updated_at,
             abs(extract(epoch FROM (now() AT TIME ZONE 'UTC') - inserted_at)) < 2,
             busy_turn_ref
      FROM #{users} WHERE user_uuid = '#{user}'
      """,
      url
    )
  end

  for {name, prefix, timestamps} <- [
        {"timestamps()", nil, :naive_datetime},
        {"timestamps(type: :utc_datetime_usec)", nil, :utc_datetime_usec},
        {"timestamps() under a prefix", "ecto_host", :naive_datetime}
      ] do
    describe "tables made by Ecto with #{name}" do
      setup do
        %{host: host!(unquote(prefix), unquote(timestamps))}
      end

      test "a user's first turn creates the settings row: a generated key, both timestamps now (UTC)",
           %{host: host} do
        {chat, user, turn} = {chat!(host), TestDB.uuid(), "first-turn"}

        assert Locks.acquire(chat, user, turn, @ttl) == :ok
        assert settings_row(host, user) == [["t", "t", "t", turn]]
        assert Locks.held?(chat, user, turn)
        assert Locks.release(chat, user, turn) == :ok
      end

      test "a new user's click creates it too", %{host: host} do
        {user, click} = {TestDB.uuid(), Locks.click_ref()}

        assert Locks.acquire_user(user, click, @ttl, 10) == :ok
        assert settings_row(host, user) == [["t", "t", "t", click]]
        assert Locks.release_user(user, click) == :ok
      end

      test "an existing row's timestamps are never touched", %{host: host} do
        {chat, user, turn} = {chat!(host), TestDB.uuid(), "old-user"}

        TestDB.query!(
          "INSERT INTO #{host.users} (uuid, user_uuid, inserted_at, updated_at) " <>
            "VALUES (gen_random_uuid(), '#{user}', '2001-02-03 04:05:06', '2001-02-03 04:05:06')",
          host.url
        )

        assert Locks.acquire(chat, user, turn, @ttl) == :ok
        assert Locks.release(chat, user, turn) == :ok

        assert TestDB.query!(
                 "SELECT inserted_at::text, updated_at::text FROM #{host.users} WHERE user_uuid = '#{user}'",
                 host.url
               ) == [["2001-02-03 04:05:06", "2001-02-03 04:05:06"]]
      end
    end
  end

  describe "a NOT NULL column the library cannot fill" do
    test "every call raises :config naming the column and the fix; with a default, the next call " <>
           "works without a restart" do
      host = host!(nil, :naive_datetime)
      TestDB.query!("ALTER TABLE #{host.users} ADD COLUMN locale text NOT NULL", host.url)
      {chat, user} = {chat!(host), TestDB.uuid()}

      for _ <- 1..2 do
        error = assert_raise Error, fn -> Locks.acquire(chat, user, "t", @ttl) end

        assert {error.reason, error.message} ==
                 {:config,
                  "invalid configuration: phoenix_kit_agent_user_settings: column \"locale\" is NOT " <>
                    "NULL without a default, and a new settings row cannot fill a text: give it a " <>
                    "default (ALTER TABLE phoenix_kit_agent_user_settings ALTER COLUMN \"locale\" SET DEFAULT …)"}
      end

      TestDB.query!("ALTER TABLE #{host.users} ALTER COLUMN locale SET DEFAULT 'en'", host.url)
      assert Locks.acquire(chat, user, "t", @ttl) == :ok
    end
  end
end
