defmodule PhoenixKitAgent.Turns.Locks.TestDB do
  @moduledoc false
  # The tests' one database helper: SQL straight to PostgreSQL through psql
  # (hex is unreachable, so there is no Postgrex). Rows are made, read and
  # backdated here (a lock is made stale by moving its `busy_since` back,
  # never by sleeping through a TTL).
  #
  # `query!/1` runs on one long-lived psql session (TestDB.Psql) shared by
  # the whole run: a new psql per statement costs some 30 ms of process
  # start and authentication. `query!/2` runs on a session of the caller's
  # own (`session!/1`, for a transaction that must stay open across calls)
  # or, given a URL, on a one-off psql for another database or cluster.

  alias PhoenixKitAgent.Turns.Locks.TestDB.Session

  @doc "The URL the tests run against."
  def url, do: System.fetch_env!("DATABASE_URL")

  @doc """
  Runs `sql` (one or more statements): on the shared session, on `where`
  when it is a session from `session!/1`, or on a one-off psql when it is a
  URL. The rows the statements returned, as lists of strings (NULL is nil).

  On a session each statement is a transaction of its own, and a slow one
  holds up every test that uses the session; a script that must run whole
  (DDL), or a statement that may wait (creating or dropping a database or
  schema), goes to a URL: `psql -c` sends it as one request, in one
  transaction.
  """
  def query!(sql, where \\ Session.shared())
  def query!(sql, url) when is_binary(url), do: once!(sql, url)
  def query!(sql, session) when is_pid(session), do: Session.query!(session, sql)

  @doc "One value of the first row `query!/2` answers, or nil."
  def value!(sql, where \\ Session.shared()) do
    case query!(sql, where) do
      [[value | _] | _] -> value
      [] -> nil
    end
  end

  @doc """
  A psql session on `url` of the calling process alone (linked to it), for
  a transaction that must stay open across calls, or for a database other
  than the tests' own; it ends with the process or with `close/1`, and an
  open transaction with it. `TimeZone` is UTC (TestDB.Psql).
  """
  def session!(url \\ url()), do: Session.open!(url)

  @doc "Ends a session from `session!/0`."
  defdelegate close(session), to: Session

  defp once!(sql, url) do
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

  @doc "Inserts `n` new chats (on `where`, as `query!/2` takes it) and returns their uuids."
  def insert_chats!(n, where \\ Session.shared()) do
    ids = for _ <- 1..n, do: uuid()
    query!(insert_chats_sql(ids), where)
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

  @doc """
  Makes schema `schema` anew with both tables as small as the lock calls
  take them: a key, `busy_since` of type `busy_since`, `busy_turn_ref`, and
  `user_columns` (SQL, after a comma) on the settings table.
  """
  def bare_tables!(schema, busy_since, user_columns \\ nil) do
    query!(
      """
      DROP SCHEMA IF EXISTS #{schema} CASCADE;
      CREATE SCHEMA #{schema};
      CREATE TABLE #{schema}.phoenix_kit_agent_conversations (
      uuid uuid PRIMARY KEY, busy_since #{busy_since}, busy_turn_ref text);
      CREATE TABLE #{schema}.phoenix_kit_agent_user_settings (
      user_uuid uuid PRIMARY KEY, busy_since #{busy_since}, busy_turn_ref text
      #{if user_columns, do: ", " <> user_columns});
      """,
      url()
    )
  end

  @doc "Inserts one new chat (on `where`) and returns its uuid."
  def insert_chat!(where \\ Session.shared()), do: hd(insert_chats!(1, where))

  @doc """
  The rows of `ids` (chats for `:chat`, settings for `:user`) that carry a
  lock: `[id, ref]`, in uuid order. For many rows at once, where `locks/1`
  would read each.
  """
  def locked(kind, ids) do
    {table, key} = table(kind)

    query!("""
    SELECT #{key}::text, busy_turn_ref FROM #{table}
    WHERE #{key} = ANY('{#{Enum.join(ids, ",")}}'::uuid[])
      AND (busy_turn_ref IS NOT NULL OR busy_since IS NOT NULL)
    ORDER BY 1
    """)
  end

  @doc """
  The lock of a chat (`:chat`) or user settings (`:user`) row:
  `{busy_turn_ref, whole_seconds_old}` by the database's clock, `{nil, nil}`
  when free, `nil` when there is no row.
  """
  def lock(kind, id) do
    [{^kind, lock}] = locks([{kind, id}])
    lock
  end

  @doc """
  The lock of each row as `lock/2` reports it, read in one statement. Takes
  and returns a keyword list keyed `:chat` / `:user`, so an assertion reads
  like the state it expects:

      assert locks(chat: chat, user: user) == [chat: {turn, 0}, user: nil]
  """
  def locks(ids) do
    ids
    |> read()
    |> Enum.map(fn
      {kind, nil} -> {kind, nil}
      {kind, %{ref: ref, age: age}} -> {kind, {ref, age}}
    end)
  end

  @doc """
  Every column a lock call could change, exactly, for each row: `:ref`,
  `:since` (`busy_since` as epoch seconds with microseconds) and `:xmin` (the
  transaction that wrote the row's current version: it changes on any write,
  even one that writes the same values back). `nil` when there is no row.
  Compare two snapshots to prove a call changed nothing; nothing in them
  depends on when they were read.
  """
  def rows(ids) do
    ids
    |> read()
    |> Enum.map(fn {kind, row} -> {kind, row && Map.delete(row, :age)} end)
  end

  # Both of the above, and the age in whole seconds by the database's clock,
  # in one statement.
  defp read(ids) do
    selects =
      ids
      |> Enum.with_index()
      |> Enum.map_join("\nUNION ALL\n", fn {{kind, id}, i} ->
        {table, key} = table(kind)

        """
        SELECT #{i}, r.#{key} IS NOT NULL, r.busy_turn_ref,
               extract(epoch FROM r.busy_since)::text,
               floor(extract(epoch FROM now() - r.busy_since))::int,
               r.xmin::text
        FROM (SELECT 1) AS one LEFT JOIN #{table} r ON r.#{key} = '#{id}'
        """
      end)

    found =
      (selects <> "\nORDER BY 1")
      |> query!()
      |> Enum.map(fn
        [_, "f" | _] -> nil
        [_, "t", ref, since, age, xmin] -> %{ref: ref, since: since, age: int(age), xmin: xmin}
      end)

    Enum.zip_with(ids, found, fn {kind, _id}, row -> {kind, row} end)
  end

  defp int(nil), do: nil
  defp int(text), do: String.to_integer(text)

  @doc """
  Makes the locks of the given rows (as `locks/1` takes them) look `seconds`
  older than they are, in one request (on `where`, as `query!/2` takes it), as if their node had gone down that
  long ago: the TTL passes without the test sleeping through it.
  """
  def backdate!(ids, seconds, where \\ Session.shared()) when is_integer(seconds) do
    ids
    |> Enum.map_join(";\n", fn {kind, id} ->
      {table, key} = table(kind)

      "UPDATE #{table} SET busy_since = busy_since - #{seconds} * interval '1 second' " <>
        "WHERE #{key} = '#{id}'"
    end)
    |> query!(where)

    :ok
  end

  @doc """
  Creates the settings row of `user` as a host app would have it: no lock,
  and an `updated_at` (and `inserted_at`) far in the past, given as an
  ISO 8601 timestamp with its offset.
  """
  def insert_settings!(user, updated_at) do
    # An Ecto-made table's uuid key has no default: Ecto generates it.
    {key, value} = if tables() == :ecto, do: {"uuid, ", "gen_random_uuid(), "}, else: {"", ""}

    query!("""
    INSERT INTO phoenix_kit_agent_user_settings (#{key}user_uuid, inserted_at, updated_at)
    VALUES (#{value}'#{user}', '#{updated_at}', '#{updated_at}')
    """)

    :ok
  end

  @doc "`updated_at` of the settings row of `user`, in UTC, ISO 8601 with microseconds."
  def updated_at(user) do
    [[at]] =
      query!("""
      SELECT to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
      FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}'
      """)

    at
  end

  @doc "The number of settings rows of `user` (0 or 1)."
  def settings_rows(user) do
    [[n]] =
      query!("SELECT count(*) FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}'")

    String.to_integer(n)
  end

  @doc "The table and key column of a chat (`:chat`) or user settings (`:user`) row."
  def table(:chat), do: {"phoenix_kit_agent_conversations", "uuid"}
  def table(:user), do: {"phoenix_kit_agent_user_settings", "user_uuid"}

  @doc """
  Raises one line naming the fix unless the server of `url` preloads
  pg_stat_statements, which the tests that count the library's statements
  read (scripts/pg's private cluster preloads it; a contributor's own
  DATABASE_URL may not).
  """
  def need_pg_stat_statements!(url \\ url()) do
    [[preloaded]] = query!("SHOW shared_preload_libraries", url)

    unless preloaded =~ "pg_stat_statements" do
      raise "this test counts statements with pg_stat_statements, which DATABASE_URL's " <>
              "server does not preload: add shared_preload_libraries = 'pg_stat_statements' " <>
              "to its postgresql.conf and restart it, or unset DATABASE_URL to use the " <>
              "private cluster (CONTRIBUTING.md)"
    end

    :ok
  end

  @stalled "locks_test_stalled_users"
  # The advisory lock a stalled insert holds until its transaction ends.
  @stalled_mark 424_242

  @doc """
  Keeps the insert of `user`'s (or each of a list of users') new settings
  row waiting at the server until
  `unstall!/1`: a lock call that creates it (`acquire/4` or
  `acquire_user/4` of a user with no row) runs on, holding its pool slot and
  the chat's row, without waiting for any lock (a trigger loops on
  `pg_sleep` while `user` is listed, holding a transaction-level advisory
  lock that marks its backend: `stalled_backends/2`). The lock
  statements do not wait for a row another session holds, so this is how a
  test keeps a call busy at the server. The trigger, made by the first call,
  lives on (as the test database does); it only slows the listed users.
  """
  def stall!(users, url \\ url()) do
    users = List.wrap(users)

    query!(
      """
      BEGIN;
      SELECT pg_advisory_xact_lock(#{:erlang.phash2(@stalled)});
      CREATE TABLE IF NOT EXISTS #{@stalled} (user_uuid uuid PRIMARY KEY);
      -- SECURITY DEFINER: the inserts of a role that may not read the list run it too.
      CREATE OR REPLACE FUNCTION #{@stalled}() RETURNS trigger LANGUAGE plpgsql
        SECURITY DEFINER SET search_path = pg_catalog, public AS $$
      BEGIN
        IF EXISTS (SELECT 1 FROM #{@stalled} WHERE user_uuid = NEW.user_uuid) THEN
          PERFORM pg_advisory_xact_lock_shared(#{@stalled_mark});
        END IF;
        WHILE EXISTS (SELECT 1 FROM #{@stalled} WHERE user_uuid = NEW.user_uuid) LOOP
          PERFORM pg_sleep(0.005);
        END LOOP;
        RETURN NEW;
      END $$;
      -- Made once: DDL on the table would wait for a stalled insert's lock on it.
      DO $$ BEGIN
        IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgname = '#{@stalled}'
                       AND tgrelid = 'phoenix_kit_agent_user_settings'::regclass) THEN
          CREATE TRIGGER #{@stalled} BEFORE INSERT ON phoenix_kit_agent_user_settings
            FOR EACH ROW EXECUTE FUNCTION #{@stalled}();
        END IF;
      END $$;
      INSERT INTO #{@stalled} VALUES #{Enum.map_join(users, ", ", &"('#{&1}')")};
      COMMIT
      """,
      url
    )

    {:stalled, users, url}
  end

  @doc "Lets the insert `stall!/2` keeps waiting go on."
  def unstall!({:stalled, users, url}) do
    in_list = Enum.map_join(users, ", ", &"'#{&1}'")
    query!("DELETE FROM #{@stalled} WHERE user_uuid IN (#{in_list})", url)
    :ok
  end

  @doc """
  The backends of `application_name` that a `stall!/2` keeps waiting (on
  `url`'s cluster): those holding its mark, whether in `pg_sleep` or between
  two of its sleeps.
  """
  def stalled_backends(application_name, url \\ url()) do
    query!(
      """
      SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid
      WHERE a.application_name = '#{application_name}' AND l.granted
        AND l.locktype = 'advisory' AND l.classid = 0 AND l.objid = #{@stalled_mark}
      """,
      url
    )
  end
end

defmodule PhoenixKitAgent.Turns.Locks.TestDB.Session do
  @moduledoc false
  # A psql session (TestDB.Psql) owned by a process of its own: the shared
  # one is started by the first query (unlinked, so it outlives the test that
  # started it) and ends with the VM; `open!/1` makes one linked to its
  # caller. Statements are serialized through the process; each takes well
  # under a millisecond. A session whose psql died or stopped answering is
  # ended (the shared one starts again at the next query): what it would
  # print later could not be told from the answer to the next statement.

  use GenServer

  alias PhoenixKitAgent.Turns.Locks.TestDB.Psql
  alias PhoenixKitAgent.Turns.Locks.TestDB

  def query!(session, sql) do
    case GenServer.call(session, {:query, sql}, 30_000) do
      {:ok, rows} -> rows
      {:error, message} -> raise "psql failed: #{message}"
    end
  end

  def open!(url) do
    {:ok, pid} = GenServer.start_link(__MODULE__, url)
    pid
  end

  def close(session), do: GenServer.stop(session)

  def shared do
    case GenServer.start(__MODULE__, TestDB.url(), name: __MODULE__) do
      {:ok, pid} -> pid
      {:error, {:already_started, pid}} -> pid
    end
  end

  @impl true
  def init(url), do: {:ok, Psql.open!(url)}

  # A failed statement is the caller's error, not the end of the session
  # every other test shares; a psql that died or stopped answering is.
  @impl true
  def handle_call({:query, sql}, _from, psql) do
    {:reply, {:ok, Psql.query!(psql, sql)}, psql}
  rescue
    e in RuntimeError ->
      if Psql.broken?(e),
        do: {:stop, :normal, {:error, e.message}, psql},
        else: {:reply, {:error, e.message}, psql}
  end

  @impl true
  def terminate(_reason, psql), do: Psql.close(psql)
end
