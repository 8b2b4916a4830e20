defmodule PhoenixKitAgent.Turns.SchemaTest do
  # The DDL a host's migration runs: its text, and that it runs (twice) on
  # a fresh schema of its own. Nothing here restarts the application.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks.{Schema, TestDB}

  describe "sql/2" do
    test "the tables without a prefix are priv/schema.sql" do
      assert Schema.sql() == File.read!("priv/schema.sql")
      assert Schema.sql(:tables, nil) == Schema.sql()
    end

    test "the lock columns for existing tables, qualified by a quoted prefix" do
      assert Schema.sql(:lock_columns, "phoenix_kit") == """
             -- The lock columns for tables a host already has. Idempotent.
             ALTER TABLE "phoenix_kit".phoenix_kit_agent_conversations
               ADD COLUMN IF NOT EXISTS busy_since timestamptz,
               ADD COLUMN IF NOT EXISTS busy_turn_ref text;

             ALTER TABLE "phoenix_kit".phoenix_kit_agent_user_settings
               ADD COLUMN IF NOT EXISTS busy_since timestamptz,
               ADD COLUMN IF NOT EXISTS busy_turn_ref text;

             -- acquire/4 and acquire_user/4 upsert ON CONFLICT (user_uuid).
             CREATE UNIQUE INDEX IF NOT EXISTS phoenix_kit_agent_user_settings_user_uuid_lock_index ON "phoenix_kit".phoenix_kit_agent_user_settings (user_uuid);
             """

      assert Schema.sql(:lock_columns) =~ "ALTER TABLE phoenix_kit_agent_conversations\n"
    end

    test "the tables under a prefix create the schema, then qualify both tables" do
      expected =
        Schema.sql()
        |> String.replace(
          "CREATE TABLE IF NOT EXISTS phoenix_kit_agent_conversations",
          ~s(CREATE SCHEMA IF NOT EXISTS "phoenix_kit";\n) <>
            ~s(CREATE TABLE IF NOT EXISTS "phoenix_kit".phoenix_kit_agent_conversations)
        )
        |> String.replace(
          "CREATE TABLE IF NOT EXISTS phoenix_kit_agent_user_settings",
          ~s(CREATE TABLE IF NOT EXISTS "phoenix_kit".phoenix_kit_agent_user_settings)
        )

      assert Schema.sql(:tables, "phoenix_kit") == expected
    end
  end

  describe "statements/2" do
    defp words(text), do: String.split(text)

    defp without_comments(text),
      do:
        text
        |> String.split("\n")
        |> Enum.reject(&String.starts_with?(&1, "--"))
        |> Enum.join("\n")

    test "one statement each, no comment, no `;`: together, the script of sql/2" do
      for kind <- [:tables, :lock_columns], prefix <- [nil, "phoenix_kit"] do
        statements = Schema.statements(kind, prefix)
        assert Enum.all?(statements, &(not (&1 =~ ";") and not (&1 =~ "--")))

        assert words(Enum.map_join(statements, " ", &(&1 <> ";"))) ==
                 words(without_comments(Schema.sql(kind, prefix)))
      end

      assert Enum.map(Schema.statements(:tables, "phoenix_kit"), &hd(words(&1))) ==
               ["CREATE", "CREATE", "CREATE"]

      assert length(Schema.statements()) == 2
      assert length(Schema.statements(:lock_columns)) == 3
    end
  end

  describe "the DDL on a database" do
    setup do
      schema = "locks_schema_#{System.unique_integer([:positive])}"
      on_exit(fn -> TestDB.query!("DROP SCHEMA IF EXISTS #{schema} CASCADE", TestDB.url()) end)
      %{schema: schema}
    end

    defp columns(schema, table) do
      TestDB.query!("""
      SELECT column_name || ' ' || data_type FROM information_schema.columns
      WHERE table_schema = '#{schema}' AND table_name = '#{table}' ORDER BY ordinal_position
      """)
      |> List.flatten()
    end

    test "runs, and runs again, the tables and then the lock columns", %{schema: schema} do
      for _ <- 1..2,
          kind <- [:tables, :lock_columns],
          do: TestDB.query!(Schema.sql(kind, schema), TestDB.url())

      assert columns(schema, "phoenix_kit_agent_conversations") == [
               "uuid uuid",
               "busy_since timestamp with time zone",
               "busy_turn_ref text"
             ]

      assert columns(schema, "phoenix_kit_agent_user_settings") == [
               "user_uuid uuid",
               "busy_since timestamp with time zone",
               "busy_turn_ref text",
               "inserted_at timestamp with time zone",
               "updated_at timestamp with time zone"
             ]
    end

    test "runs one statement at a time, as an Ecto migration does", %{schema: schema} do
      for _ <- 1..2,
          kind <- [:tables, :lock_columns],
          statement <- Schema.statements(kind, schema),
          do: TestDB.query!(statement)

      assert columns(schema, "phoenix_kit_agent_conversations") == [
               "uuid uuid",
               "busy_since timestamp with time zone",
               "busy_turn_ref text"
             ]
    end
  end
end
