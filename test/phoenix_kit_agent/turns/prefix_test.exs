defmodule PhoenixKitAgent.Turns.PrefixTest do
  # The tables in a schema other than `public`, named by the `prefix`
  # setting or by the host's repo, end to end: the DDL a migration runs
  # (Schema.sql/2), then every call on the tables of that schema only. Each
  # test restarts the application with its prefix, so this module is
  # `async: false`; the schema is dropped and the configuration restored
  # afterwards.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{AppEnv, FakeRepo, Schema, TestDB}

  setup do
    AppEnv.restore_on_exit()
    schema = "locks_prefix_#{System.unique_integer([:positive])}"

    on_exit(fn ->
      Application.delete_env(:locks_fake_host, FakeRepo)
      TestDB.query!("DROP SCHEMA IF EXISTS #{schema} CASCADE", TestDB.url())
    end)

    %{schema: schema}
  end

  defp insert_chat!(schema) do
    chat = TestDB.uuid()

    TestDB.query!(
      "INSERT INTO #{schema}.phoenix_kit_agent_conversations (uuid) VALUES ('#{chat}')"
    )

    chat
  end

  defp holder(schema, :chat, id),
    do:
      TestDB.query!(
        "SELECT busy_turn_ref FROM #{schema}.phoenix_kit_agent_conversations WHERE uuid = '#{id}'"
      )

  defp holder(schema, :user, id),
    do:
      TestDB.query!(
        "SELECT busy_turn_ref FROM #{schema}.phoenix_kit_agent_user_settings WHERE user_uuid = '#{id}'"
      )

  # A turn in `schema`: both locks taken there and nowhere else, then freed.
  defp turn_in!(schema) do
    chat = insert_chat!(schema)
    user = TestDB.uuid()

    assert Locks.acquire(chat, user, "turn-p", 60) == :ok
    assert holder(schema, :chat, chat) == [["turn-p"]]
    assert holder(schema, :user, user) == [["turn-p"]]
    assert TestDB.lock(:user, user) == nil, "no settings row in public"
    assert Locks.held?(chat, user, "turn-p")
    assert Locks.release(chat, user, "turn-p") == :ok
    assert holder(schema, :chat, chat) == [[nil]]
    assert holder(schema, :user, user) == [[nil]]
    {chat, user}
  end

  test "prefix: every call works on the tables of that schema", %{schema: schema} do
    TestDB.query!(Schema.sql(:tables, schema), TestDB.url())
    :ok = AppEnv.restart(url: TestDB.url(), prefix: schema)

    {_chat, user} = turn_in!(schema)
    # A chat that exists only in public is not one of this schema's.
    assert Locks.acquire(TestDB.insert_chat!(), user, "turn-q", 60) ==
             {:error, :conversation_busy}
  end

  test "the prefix of the host's repo is taken when the library sets none", %{schema: schema} do
    TestDB.query!(Schema.sql(:tables, schema), TestDB.url())
    Application.put_env(:locks_fake_host, FakeRepo, url: TestDB.url(), prefix: schema)
    :ok = AppEnv.restart(repo: FakeRepo)
    turn_in!(schema)
  end

  test "Schema.setup!/1 creates the tables under the configured prefix", %{schema: schema} do
    :ok = AppEnv.restart(url: TestDB.url(), prefix: schema)
    assert Schema.setup!(:tables) == :ok
    assert Schema.setup!(:tables) == :ok
    turn_in!(schema)
  end

  test "the lock columns added to a host's own tables (Ecto-made, in its schema)",
       %{schema: schema} do
    # Tables as a host's migrations may have made them: more columns, a
    # bigserial key for the settings, no lock columns, no unique user_uuid.
    TestDB.query!("""
    CREATE SCHEMA #{schema};
    CREATE TABLE #{schema}.phoenix_kit_agent_conversations (
      uuid uuid PRIMARY KEY,
      title text NOT NULL DEFAULT '',
      inserted_at timestamp(0) NOT NULL DEFAULT now(),
      updated_at timestamp(0) NOT NULL DEFAULT now()
    );
    CREATE TABLE #{schema}.phoenix_kit_agent_user_settings (
      id bigserial PRIMARY KEY,
      user_uuid uuid NOT NULL,
      settings jsonb NOT NULL DEFAULT '{}',
      inserted_at timestamp(0) NOT NULL DEFAULT now(),
      updated_at timestamp(0) NOT NULL DEFAULT now()
    );
    """)

    # As a migration runs them, one statement at a time; twice, since a
    # migration run again must change nothing.
    for _ <- 1..2,
        statement <- Schema.statements(:lock_columns, schema),
        do: TestDB.query!(statement)

    :ok = AppEnv.restart(url: TestDB.url(), prefix: schema)
    turn_in!(schema)

    user = TestDB.uuid()

    TestDB.query!(
      "INSERT INTO #{schema}.phoenix_kit_agent_user_settings (user_uuid, updated_at) " <>
        "VALUES ('#{user}', '2020-01-01 00:00:00')"
    )

    chat = insert_chat!(schema)
    assert Locks.acquire(chat, user, "turn-r", 60) == :ok
    assert Locks.release(chat, user, "turn-r") == :ok

    assert TestDB.query!(
             "SELECT count(*), max(updated_at)::text FROM #{schema}.phoenix_kit_agent_user_settings " <>
               "WHERE user_uuid = '#{user}'"
           ) == [["1", "2020-01-01 00:00:00"]]
  end
end
