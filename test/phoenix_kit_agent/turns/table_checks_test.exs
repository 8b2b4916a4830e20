defmodule PhoenixKitAgent.Turns.TableChecksTest do
  # A host's tables with one mistake each, made in SQL in a schema of the
  # test's own (the `prefix` setting), or a database of its own for the
  # search_path: the first call reads the catalog (schema.rs) and raises
  # `:config` naming the table, the column and the fix, never PostgreSQL's
  # raw error (42P01, 42883, 42P10, or 22001 only once a long ref comes).
  # Then the fix the message names is applied, and the next call works,
  # without a restart. async: false: each test restarts the application.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{AppEnv, Error, Schema, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Robust.Pg

  @ttl 60
  @chats "phoenix_kit_agent_conversations"
  @users "phoenix_kit_agent_user_settings"

  setup do
    AppEnv.restore_on_exit()
    schema = "locks_tables_#{System.unique_integer([:positive])}"
    on_exit(fn -> TestDB.query!("DROP SCHEMA IF EXISTS #{schema} CASCADE", TestDB.url()) end)
    chats = ~s("#{schema}".#{@chats})
    users = ~s("#{schema}".#{@users})
    %{schema: schema, chats: chats, users: users, url: TestDB.url()}
  end

  # The :config error of the first call (and of the next: nothing is
  # remembered until the tables pass); its message without the prefix every
  # :config message has.
  defp refused(ctx) do
    prefix = Map.get(ctx, :prefix, ctx.schema)
    :ok = AppEnv.restart(if prefix, do: [url: ctx.url, prefix: prefix], else: [url: ctx.url])

    messages =
      for _ <- 1..2 do
        error =
          assert_raise Error, fn -> Locks.acquire(TestDB.uuid(), TestDB.uuid(), "t", @ttl) end

        assert %Error{reason: :config, sqlstate: nil, message: "invalid configuration: " <> rest} =
                 error

        rest
      end

    assert [message] = Enum.uniq(messages)
    message
  end

  # After the fix: a whole turn (37-byte refs) on a chat of the schema.
  defp works!(ctx, chat_columns \\ "") do
    chat = TestDB.uuid()
    values = if chat_columns == "", do: "", else: ", now(), now()"
    TestDB.query!("INSERT INTO #{ctx.chats} (uuid#{chat_columns}) VALUES ('#{chat}'#{values})")
    assert Locks.with_turn(chat, TestDB.uuid(), [ttl_s: @ttl], fn _ -> :done end) == {:ok, :done}
  end

  defp shipped!(ctx, mistake) do
    TestDB.query!(Schema.sql(:tables, ctx.schema) <> mistake, ctx.url)
  end

  # Both tables as Ecto migrations make them (TestDB.ecto_tables/2: naive
  # timestamps, a varchar(255) busy_turn_ref on the chats), then `mistake`.
  defp ecto!(ctx, mistake) do
    TestDB.query!(TestDB.ecto_tables(ctx.schema) <> ";\n" <> mistake, ctx.url)
  end

  @ecto_chat ", inserted_at, updated_at"

  describe "a missing table" do
    test "no tables in the search_path (no prefix), named as the statements write them" do
      {_db, url} = Pg.create_database!("tables", tables: "SELECT 1")

      assert refused(%{url: url, prefix: nil, schema: nil}) ==
               "#{@chats}: no such table: create the tables (mix locks.setup, " <>
                 "or Schema.statements(:tables, …) in a migration)"

      assert Schema.setup!(:tables) == :ok

      assert Locks.acquire(TestDB.uuid(), TestDB.uuid(), "t", @ttl) ==
               {:error, :conversation_busy}
    end

    test "a prefix naming no schema", ctx do
      assert refused(ctx) ==
               "#{ctx.chats}: no such table: create the tables (mix locks.setup, " <>
                 "or Schema.statements(:tables, …) in a migration)"

      assert Schema.setup!(:tables) == :ok
      works!(ctx)
    end

    test "the settings table alone missing", ctx do
      shipped!(ctx, "DROP TABLE #{ctx.users};")

      assert refused(ctx) ==
               "#{ctx.users}: no such table: create the tables (mix locks.setup, " <>
                 "or Schema.statements(:tables, …) in a migration)"

      assert Schema.setup!(:tables) == :ok
      works!(ctx)
    end
  end

  describe "a key" do
    test "uuid of type text", ctx do
      shipped!(ctx, "ALTER TABLE #{ctx.chats} ALTER COLUMN uuid TYPE text;")

      assert refused(ctx) ==
               "#{ctx.chats}: uuid is of type text: it must be uuid " <>
                 "(ALTER TABLE #{ctx.chats} ALTER COLUMN uuid TYPE uuid USING uuid::uuid)"

      TestDB.query!("ALTER TABLE #{ctx.chats} ALTER COLUMN uuid TYPE uuid USING uuid::uuid")
      works!(ctx)
    end

    test "user_uuid of type text", ctx do
      ecto!(ctx, "ALTER TABLE #{ctx.users} ALTER COLUMN user_uuid TYPE text")

      assert refused(ctx) ==
               "#{ctx.users}: user_uuid is of type text: it must be uuid " <>
                 "(ALTER TABLE #{ctx.users} ALTER COLUMN user_uuid TYPE uuid USING user_uuid::uuid)"

      TestDB.query!(
        "ALTER TABLE #{ctx.users} ALTER COLUMN user_uuid TYPE uuid USING user_uuid::uuid"
      )

      works!(ctx, @ecto_chat)
    end

    @no_index "no unique index on user_uuid alone (not partial), which the upserts of " <>
                "acquire/4 and acquire_user/4 need (ON CONFLICT (user_uuid)): add one " <>
                "(mix locks.setup --lock-columns, or CREATE UNIQUE INDEX ON "
    @drop_ecto_indexes "DROP INDEX SCHEMA.phoenix_kit_agent_user_settings_user_uuid_index; " <>
                         "DROP INDEX SCHEMA.phoenix_kit_agent_user_settings_user_uuid_lock_index"

    for {name, mistake} <- [
          {"no unique index on user_uuid (Ecto-made tables)", @drop_ecto_indexes},
          {"a unique index on user_uuid that is partial",
           @drop_ecto_indexes <>
             "; CREATE UNIQUE INDEX ON USERS (user_uuid) WHERE settings IS NOT NULL"}
        ] do
      test name, ctx do
        ecto!(
          ctx,
          unquote(mistake)
          |> String.replace("SCHEMA", ~s("#{ctx.schema}"))
          |> String.replace("USERS", ctx.users)
        )

        assert refused(ctx) == "#{ctx.users}: #{@no_index}#{ctx.users} (user_uuid))"
        assert Schema.setup!(:lock_columns) == :ok
        works!(ctx, @ecto_chat)
      end
    end

    test "a unique constraint on user_uuid that is deferrable", ctx do
      shipped!(
        ctx,
        "ALTER TABLE #{ctx.users} DROP CONSTRAINT #{@users}_pkey; " <>
          "ALTER TABLE #{ctx.users} ADD UNIQUE (user_uuid) DEFERRABLE;"
      )

      assert refused(ctx) ==
               "#{ctx.users}: the unique constraint \"#{@users}_user_uuid_key\" on user_uuid is " <>
                 "deferrable, and the upserts of acquire/4 and acquire_user/4 (ON CONFLICT " <>
                 "(user_uuid)) fail with one: replace it by a unique index (mix locks.setup " <>
                 "--lock-columns, then ALTER TABLE #{ctx.users} DROP CONSTRAINT " <>
                 "\"#{@users}_user_uuid_key\")"

      assert Schema.setup!(:lock_columns) == :ok
      TestDB.query!(~s(ALTER TABLE #{ctx.users} DROP CONSTRAINT "#{@users}_user_uuid_key"))
      works!(ctx)
    end

    test "no unique index on the chats' uuid", ctx do
      shipped!(ctx, "ALTER TABLE #{ctx.chats} DROP CONSTRAINT #{@chats}_pkey;")

      assert refused(ctx) ==
               "#{ctx.chats}: no unique index on uuid alone (not partial): a chat must be one row " <>
                 "(ALTER TABLE #{ctx.chats} ADD PRIMARY KEY (uuid))"

      TestDB.query!("ALTER TABLE #{ctx.chats} ADD PRIMARY KEY (uuid)")
      works!(ctx)
    end
  end

  describe "busy_turn_ref" do
    test "of type integer", ctx do
      shipped!(
        ctx,
        "ALTER TABLE #{ctx.chats} ALTER COLUMN busy_turn_ref TYPE integer USING NULL;"
      )

      assert refused(ctx) ==
               "#{ctx.chats}: busy_turn_ref is of type integer: it must be text " <>
                 "(ALTER TABLE #{ctx.chats} ALTER COLUMN busy_turn_ref TYPE text)"

      TestDB.query!("ALTER TABLE #{ctx.chats} ALTER COLUMN busy_turn_ref TYPE text")
      works!(ctx)
    end

    # 255: the longest ref acquire/4 takes, in bytes, so in characters at
    # most; with_turn/4 makes 37-byte refs, click_ref/0 38-byte ones.
    test "a varchar shorter than the longest ref (Ecto's :string is varchar(255))", ctx do
      ecto!(ctx, "ALTER TABLE #{ctx.users} ALTER COLUMN busy_turn_ref TYPE varchar(254)")

      assert refused(ctx) ==
               "#{ctx.users}: busy_turn_ref is of type character varying(254), too short for a " <>
                 "ref (up to 255 bytes): it must be text or varchar(255) or longer " <>
                 "(ALTER TABLE #{ctx.users} ALTER COLUMN busy_turn_ref TYPE text)"

      TestDB.query!("ALTER TABLE #{ctx.users} ALTER COLUMN busy_turn_ref TYPE varchar(255)")
      works!(ctx, @ecto_chat)

      # The longest ref fits it, in bytes and in characters.
      chat = TestDB.uuid()

      TestDB.query!(
        "INSERT INTO #{ctx.chats} (uuid, inserted_at, updated_at) VALUES ('#{chat}', now(), now())"
      )

      for ref <- [String.duplicate("r", 255), String.duplicate("é", 127) <> "r"] do
        user = TestDB.uuid()
        assert Locks.acquire(chat, user, ref, @ttl) == :ok
        assert Locks.release(chat, user, ref) == :ok
      end
    end

    test "NOT NULL (a free lock is NULL)", ctx do
      shipped!(ctx, "ALTER TABLE #{ctx.users} ALTER COLUMN busy_turn_ref SET NOT NULL;")

      assert refused(ctx) ==
               "#{ctx.users}: busy_turn_ref is NOT NULL, and a free lock is NULL " <>
                 "(ALTER TABLE #{ctx.users} ALTER COLUMN busy_turn_ref DROP NOT NULL)"

      TestDB.query!("ALTER TABLE #{ctx.users} ALTER COLUMN busy_turn_ref DROP NOT NULL")
      works!(ctx)
    end
  end

  test "busy_since NOT NULL", ctx do
    ecto!(ctx, "ALTER TABLE #{ctx.chats} ALTER COLUMN busy_since SET NOT NULL")

    assert refused(ctx) ==
             "#{ctx.chats}: busy_since is NOT NULL, and a free lock is NULL " <>
               "(ALTER TABLE #{ctx.chats} ALTER COLUMN busy_since DROP NOT NULL)"

    TestDB.query!("ALTER TABLE #{ctx.chats} ALTER COLUMN busy_since DROP NOT NULL")
    works!(ctx, @ecto_chat)
  end
end
