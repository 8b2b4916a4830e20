defmodule PhoenixKitAgent.Turns.LockCase do
  @moduledoc false
  # The case template of the lock tests.
  #
  # Every test makes its own rows (fresh uuids, fresh refs), so tests can run
  # `async: true` against the one shared database. Rows are read and changed
  # with SQL through one long-lived psql session (LockCase.SQL below): a new
  # psql per statement, as TestDB.query!/1 runs, costs some 30 ms of process
  # start and authentication, which made the suite ten times slower. The
  # helpers mean the same as TestDB's (`lock/2` answers what `TestDB.lock/2`
  # answers) and read or backdate several rows in one statement.

  use ExUnit.CaseTemplate

  alias PhoenixKitAgent.Turns.LockCase.SQL
  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Native, TestDB}

  using do
    quote do
      alias PhoenixKitAgent.Turns.Locks
      alias PhoenixKitAgent.Turns.Locks.{Native, TestDB}
      import PhoenixKitAgent.Turns.LockCase
    end
  end

  @doc "Runs `sql` on the shared psql session; its rows as lists of strings (NULL is nil)."
  defdelegate sql!(sql), to: SQL, as: :query!

  @doc "Inserts `n` new chats (rows of `phoenix_kit_agent_conversations`) and returns their uuids."
  def insert_chats!(n) do
    ids = for _ <- 1..n, do: TestDB.uuid()
    sql!(TestDB.insert_chats_sql(ids))
    ids
  end

  @doc "Inserts one new chat and returns its uuid."
  def insert_chat!, do: hd(insert_chats!(1))

  @doc """
  As `TestDB.lock/2`: `{busy_turn_ref, whole_seconds_old}` of a chat
  (`:chat`) or user settings (`:user`) row by the database's clock,
  `{nil, nil}` when free, `nil` when there is no row.
  """
  def lock(kind, id) do
    [{^kind, lock}] = locks([{kind, id}])
    lock
  end

  @doc """
  Makes the NIF call of `fun` as `PhoenixKitAgent.Turns.Locks` does
  (`Locks.call/3`: a turn, the call's stamp), with every valid uuid string
  of `args` as its 16 bytes (anything else is passed as it is).
  """
  def native(fun, args) do
    Locks.call(fun, System.monotonic_time(:nanosecond), Enum.map(args, &uuid_bytes/1))
  end

  @doc "The 16 bytes of a hyphenated uuid string; any other term as it is."
  def uuid_bytes(
        <<_::binary-8, ?-, _::binary-4, ?-, _::binary-4, ?-, _::binary-4, ?-, _::binary-12>> =
          text
      ) do
    case Base.decode16(String.replace(text, "-", ""), case: :mixed) do
      {:ok, bytes} -> bytes
      :error -> text
    end
  end

  def uuid_bytes(term), do: term

  # How much older than expected a lock may be when it is read: the seconds
  # a loaded machine may take between the call that dated it and the read.
  @age_slack 2

  @doc """
  Asserts that the locks of `ids` (as `locks/1` takes them) are `expected`:
  the same holders, and each age (whole seconds) from the expected one to
  #{@age_slack} s more, since time passes between a call and the read. A
  lock dated anew (0 s) where an old one was expected, or the other way
  round, still fails.
  """
  def assert_locks(ids, expected) do
    actual = locks(ids)

    matches? =
      length(actual) == length(expected) and
        Enum.all?(Enum.zip(actual, expected), fn
          {{kind, {ref, age}}, {kind, {ref, want}}} when is_integer(want) ->
            is_integer(age) and age >= want and age <= want + @age_slack

          {{kind, lock}, {kind, lock}} ->
            true

          _ ->
            false
        end)

    ExUnit.Assertions.assert(matches?,
      message: "locks differ (ages may be up to #{@age_slack} s older)",
      left: actual,
      right: expected
    )
  end

  @doc "As `assert_locks/2`, for one row: `expected` is what `lock/2` answers."
  def assert_lock(kind, id, expected), do: assert_locks([{kind, id}], [{kind, expected}])

  @doc "A new turn ref, never used before in this VM."
  def turn_ref(label \\ "turn"), do: "#{label}-#{System.unique_integer([:positive])}"

  @doc "A user uuid with no settings row yet."
  def new_user, do: TestDB.uuid()

  @doc """
  The lock of each row as `lock/2` reports it (`{busy_turn_ref,
  whole_seconds_old}`, `{nil, nil}` when free, `nil` when there is no row),
  read in one statement. Takes and returns a keyword list keyed `:chat` /
  `:user`, so an assertion reads like the state it expects:

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
      |> sql!()
      |> Enum.map(fn
        [_, "f" | _] -> nil
        [_, "t", ref, since, age, xmin] -> %{ref: ref, since: since, age: int(age), xmin: xmin}
      end)

    Enum.zip_with(ids, found, fn {kind, _id}, row -> {kind, row} end)
  end

  @doc """
  Runs `fun.(i)` for i in 1..n in n processes that really overlap: a
  transaction of another session holds the row `{kind, id}` locked (FOR
  UPDATE) until every one of the n calls is waiting for that row, then ends,
  and the calls go on together. Every call must touch that row. Returns the
  answers in order of i.

  Without the gate, calls started "at once" mostly run one after the other
  (each statement takes a fraction of a millisecond), and a race would prove
  nothing. Keep n well under the pool's size: the waiting calls hold their
  turns. Races of different tests run one at a time, or two of them could
  hold every turn, each waiting for a call of its own that queues behind
  the other's.
  """
  def race_at_row(row, n, fun) do
    :global.trans(
      {__MODULE__.Race, self()},
      fn -> race_at_row!(row, n, fun) end,
      [node()],
      :infinity
    )
  end

  defp race_at_row!({kind, id}, n, fun) do
    {table, key} = table(kind)
    gate = SQL.open!()

    [[ctid, xid]] =
      SQL.query!(gate, """
      BEGIN;
      SELECT ctid::text, pg_current_xact_id()::text FROM #{table} WHERE #{key} = '#{id}' FOR UPDATE
      """)

    [page, tuple] = Regex.run(~r/\((\d+),(\d+)\)/, ctid, capture: :all_but_first)
    tasks = for i <- 1..n, do: Task.async(fn -> fun.(i) end)

    # Each call waits either for the gate's transaction (the first in line)
    # or for the row's tuple lock (those behind it).
    waiting = """
    SELECT count(*) FROM pg_locks WHERE NOT granted AND (
      (locktype = 'transactionid' AND transactionid::text = '#{xid}')
      OR (locktype = 'tuple' AND relation = '#{table}'::regclass
          AND page = #{page} AND tuple = #{tuple}))
    """

    all_waiting? =
      Enum.any?(1..10_000, fn _ -> sql!(waiting) |> hd() |> hd() |> String.to_integer() >= n end)

    SQL.query!(gate, "COMMIT")
    SQL.close(gate)
    answers = Task.await_many(tasks, 30_000)
    if not all_waiting?, do: raise("the #{n} calls never all waited for the row #{kind} #{id}")
    answers
  end

  @doc """
  Makes the locks of the given rows look `seconds` older than they are, in
  one statement: the TTL passes without the test sleeping through it (as
  `TestDB.backdate!/3` does for one row).
  """
  def backdate!(ids, seconds) when is_integer(seconds) do
    ids
    |> Enum.map_join(";\n", fn {kind, id} ->
      {table, key} = table(kind)

      "UPDATE #{table} SET busy_since = busy_since - #{seconds} * interval '1 second' " <>
        "WHERE #{key} = '#{id}'"
    end)
    |> sql!()

    :ok
  end

  @doc """
  Creates the settings row of `user` as a host app would have it: no lock,
  and an `updated_at` (and `inserted_at`) far in the past, given as an
  ISO 8601 timestamp with its offset.
  """
  def insert_settings!(user, updated_at) do
    # An Ecto-made table's uuid key has no default: Ecto generates it.
    {key, value} =
      if TestDB.tables() == :ecto, do: {"uuid, ", "gen_random_uuid(), "}, else: {"", ""}

    sql!("""
    INSERT INTO phoenix_kit_agent_user_settings (#{key}user_uuid, inserted_at, updated_at)
    VALUES (#{value}'#{user}', '#{updated_at}', '#{updated_at}')
    """)

    :ok
  end

  @doc "`updated_at` of the settings row of `user`, in UTC, ISO 8601 with microseconds."
  def updated_at(user) do
    [[at]] =
      sql!("""
      SELECT to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
      FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}'
      """)

    at
  end

  @doc "The number of settings rows of `user` (0 or 1)."
  def settings_rows(user) do
    [[n]] =
      sql!("SELECT count(*) FROM phoenix_kit_agent_user_settings WHERE user_uuid = '#{user}'")

    String.to_integer(n)
  end

  ## Bad arguments

  @valid_uuid "0b6c2b0e-5f55-4d8a-9f62-2c1e8d7a4b10"

  @doc """
  The name of every argument of each lock function, in order, and the kind
  of value it takes (`:uuid`, `:turn_ref`, `:ref`, `:ttl_s`, `:hold_s`).
  The Native functions take the same arguments (`fresh?` is `fresh`, `held?`
  is `held`).
  """
  def arguments do
    [
      acquire: [conversation_uuid: :uuid, user_uuid: :uuid, turn_ref: :turn_ref, ttl_s: :ttl_s],
      acquire_user: [user_uuid: :uuid, ref: :ref, ttl_s: :ttl_s, hold_s: :hold_s],
      fresh?: [conversation_uuid: :uuid, turn_ref: :turn_ref, ttl_s: :ttl_s],
      held?: [conversation_uuid: :uuid, user_uuid: :uuid, turn_ref: :turn_ref],
      keep: [conversation_uuid: :uuid, user_uuid: :uuid, turn_ref: :turn_ref, ttl_s: :ttl_s],
      keep_user: [user_uuid: :uuid, ref: :ref, ttl_s: :ttl_s, hold_s: :hold_s],
      release: [conversation_uuid: :uuid, user_uuid: :uuid, turn_ref: :turn_ref],
      release_stale: [
        conversation_uuid: :uuid,
        user_uuid: :uuid,
        turn_ref: :turn_ref,
        ttl_s: :ttl_s
      ],
      release_user: [user_uuid: :uuid, ref: :ref]
    ]
  end

  @doc "What an argument of `kind` must be, in words."
  def valid(:uuid), do: "a hyphenated uuid string"
  def valid(:turn_ref), do: ~s{a turn's ref (1..255 bytes of UTF-8, no NUL, not "click:…")}
  def valid(:ref), do: ~s{a click's ref ("click:…", at most 255 bytes of UTF-8, no NUL)}
  def valid(:ttl_s), do: "whole seconds in 1..315_360_000"
  def valid(:hold_s), do: "whole seconds in 1..ttl_s"

  @doc """
  Values an argument of `kind` must be refused, each with what is wrong with
  it. `:hold_s` values are wrong next to a `ttl_s` of 60.
  """
  def invalid(:uuid) do
    [
      {"nil", nil},
      {"an atom", :uuid},
      {"an integer", 42},
      {"a charlist", String.to_charlist(@valid_uuid)},
      {"empty", ""},
      {"35 characters", binary_part(@valid_uuid, 0, 35)},
      {"37 characters", @valid_uuid <> "0"},
      {"no hyphens", String.replace(@valid_uuid, "-", "")},
      {"hyphens misplaced", "0b6c2b0e5-f55-4d8a-9f62-2c1e8d7a4b10"},
      {"underscores for hyphens", String.replace(@valid_uuid, "-", "_")},
      {"a non-hex digit", "0b6c2b0e-5f55-4d8a-9f62-2c1e8d7a4b1g"},
      {"a leading plus sign", "+b6c2b0e-5f55-4d8a-9f62-2c1e8d7a4b10"},
      {"a leading minus sign", "-b6c2b0e-5f55-4d8a-9f62-2c1e8d7a4b10"},
      {"a sign inside", "0b6c2b0e-+f55-4d8a-9f62-2c1e8d7a4b10"},
      {"an underscore inside", "0b6c2b0e-5f55-4d8a-9f62-2c1e8d7a4b_0"},
      {"in braces", "{" <> @valid_uuid <> "}"},
      {"a trailing newline", @valid_uuid <> "\n"},
      {"a leading space", " " <> binary_part(@valid_uuid, 1, 35)},
      {"a URN", "urn:uuid:" <> @valid_uuid},
      {"invalid UTF-8 of 36 bytes", :binary.copy(<<0xFF>>, 36)},
      {"a NUL byte", binary_part(@valid_uuid, 0, 35) <> <<0>>},
      {"a SQL fragment", String.pad_trailing("'; DELETE FROM x; --", 36, "-")}
    ]
  end

  def invalid(:turn_ref) do
    [
      {"nil", nil},
      {"an atom", :turn},
      {"an integer", 1},
      {"a charlist", ~c"turn-1"},
      {"empty", ""},
      {"256 bytes", String.duplicate("t", 256)},
      {"256 bytes in 128 characters", String.duplicate("é", 128)},
      {"invalid UTF-8", <<"turn-", 0xFF, 0xFE>>},
      {"a NUL byte", "turn\0ref"},
      {"a click's ref", "click:" <> String.duplicate("0", 32)},
      {"the bare click prefix", "click:"}
    ]
  end

  def invalid(:ref) do
    [
      {"nil", nil},
      {"an atom", :click},
      {"a charlist", ~c"click:0123"},
      {"empty", ""},
      {"a turn's ref", "turn-1"},
      {"a click prefix in upper case", "CLICK:0123"},
      {"256 bytes", "click:" <> String.duplicate("0", 250)},
      {"invalid UTF-8", <<"click:", 0xFF>>},
      {"a NUL byte", "click:01\0"}
    ]
  end

  def invalid(:ttl_s) do
    [
      {"zero", 0},
      {"negative", -1},
      {"a float", 60.0},
      {"a fraction", 1.5},
      {"above ten years", 315_360_001},
      {"2^31", 2_147_483_648},
      {"a bignum", 2 ** 64},
      {"a negative bignum", -(2 ** 64)},
      {"nil", nil},
      {"a string", "60"},
      {"an atom", :infinity}
    ]
  end

  def invalid(:hold_s) do
    [
      {"zero", 0},
      {"negative", -1},
      {"above ttl_s", 61},
      {"a float", 10.0},
      {"a bignum", 2 ** 64},
      {"nil", nil},
      {"a string", "10"}
    ]
  end

  @doc """
  Valid arguments for `fun` and the rows they would change: every writing
  call is set up so that, were it run, it would change one of the rows
  (take, re-date or free a lock, or create the settings row). A refused call
  must leave `rows(ids)` as it was.
  """
  def call_that_would_write(fun) do
    [chat] = insert_chats!(1)
    {user, turn, click} = {new_user(), turn_ref(), Locks.click_ref()}
    ids = [chat: chat, user: user]

    {before, args} =
      case fun do
        :acquire -> {:nothing, [chat, user, turn, 60]}
        :acquire_user -> {:nothing, [user, click, 60, 10]}
        :fresh? -> {:stale_turn, [chat, turn, 60]}
        :held? -> {:stale_turn, [chat, user, turn]}
        :keep -> {:aging_turn, [chat, user, turn, 60]}
        :release -> {:stale_turn, [chat, user, turn]}
        :release_stale -> {:stale_turn, [chat, user, turn, 60]}
        :keep_user -> {:click, [user, click, 60, 10]}
        :release_user -> {:click, [user, click]}
      end

    case before do
      :nothing ->
        :ok

      :stale_turn ->
        :ok = Locks.acquire(chat, user, turn, 60)
        backdate!(ids, 61)

      :aging_turn ->
        :ok = Locks.acquire(chat, user, turn, 60)
        backdate!(ids, 30)

      :click ->
        :ok = Locks.acquire_user(user, click, 60, 10)
        backdate!(ids, 5)
    end

    {args, ids}
  end

  defp int(nil), do: nil
  defp int(text), do: String.to_integer(text)

  defp table(:chat), do: {"phoenix_kit_agent_conversations", "uuid"}
  defp table(:user), do: {"phoenix_kit_agent_user_settings", "user_uuid"}
end

defmodule PhoenixKitAgent.Turns.LockCase.SQL do
  @moduledoc false
  # One psql session (Robust.Psql) for the whole test run, owned by this
  # process and shared by every test. It is started by the first query
  # (unlinked, so it outlives the test that started it) and ends with the VM.
  # Statements are serialized through this process; each takes well under a
  # millisecond.

  use GenServer

  alias PhoenixKitAgent.Turns.Locks.Robust.Psql
  alias PhoenixKitAgent.Turns.Locks.TestDB

  @doc """
  Runs `sql` (one or more statements) on the shared session, or on `session`
  from `open!/0`; the rows of the last as lists of strings (NULL is nil).
  """
  def query!(session \\ server(), sql) do
    case GenServer.call(session, {:query, sql}, 30_000) do
      {:ok, rows} -> rows
      {:error, message} -> raise "psql failed: #{message}"
    end
  end

  @doc """
  A psql session of the calling process alone (linked to it), for a
  transaction that must stay open across calls; it ends with the process
  or with `close/1`, and an open transaction with it.
  """
  def open! do
    {:ok, pid} = GenServer.start_link(__MODULE__, TestDB.url())
    pid
  end

  @doc "Ends a session from `open!/0`."
  def close(session), do: GenServer.stop(session)

  defp server do
    case GenServer.start(__MODULE__, TestDB.url(), name: __MODULE__) do
      {:ok, pid} -> pid
      {:error, {:already_started, pid}} -> pid
    end
  end

  @impl true
  def init(url), do: {:ok, Psql.open!(url)}

  # A failed statement is the caller's error, not the end of the session
  # every other test shares.
  @impl true
  def handle_call({:query, sql}, _from, psql) do
    {:reply, {:ok, Psql.query!(psql, sql)}, psql}
  rescue
    e in RuntimeError -> {:reply, {:error, e.message}, psql}
  end

  @impl true
  def terminate(_reason, psql), do: Psql.close(psql)
end
