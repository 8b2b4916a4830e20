defmodule PhoenixKitAgent.Turns.LockCase do
  @moduledoc false
  # The case template of the lock tests: the rows are TestDB's (imported),
  # the assertions and set-ups are here.
  #
  # Every test makes its own rows (fresh uuids, fresh refs), so tests can run
  # `async: true` against the one shared database.

  use ExUnit.CaseTemplate

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.TestDB

  import TestDB,
    only: [insert_chats!: 1, locks: 1, backdate!: 2]

  using do
    quote do
      alias PhoenixKitAgent.Turns.Locks
      alias PhoenixKitAgent.Turns.Locks.{Native, TestDB}

      import TestDB,
        only: [
          insert_chat!: 0,
          insert_chats!: 1,
          lock: 2,
          locks: 1,
          locked: 2,
          rows: 1,
          backdate!: 2,
          insert_settings!: 2,
          updated_at: 1,
          settings_rows: 1
        ]

      import PhoenixKitAgent.Turns.LockCase
    end
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

  # The seconds a loaded machine may take between the call that dates a lock
  # and a check of that date: the read of its age, or a call that must still
  # find it fresh. The async tests beside it and PgBouncer's queue hold calls
  # up (over 1 s was seen in CI, through PgBouncer in transaction mode).
  @slack 3

  @doc "How far short of a boundary (a TTL, a hold, a lease) tests date a lock: #{@slack} s."
  def slack, do: @slack

  @doc """
  Asserts that the locks of `ids` (as `locks/1` takes them) are `expected`:
  the same holders, and each age (whole seconds) from the expected one to
  #{@slack} s more, since time passes between a call and the read. A
  lock dated anew (0 s) where an old one was expected, or the other way
  round, still fails.
  """
  def assert_locks(ids, expected) do
    actual = locks(ids)

    matches? =
      length(actual) == length(expected) and
        Enum.all?(Enum.zip(actual, expected), fn
          {{kind, {ref, age}}, {kind, {ref, want}}} when is_integer(want) ->
            is_integer(age) and age >= want and age <= want + @slack

          {{kind, lock}, {kind, lock}} ->
            true

          _ ->
            false
        end)

    ExUnit.Assertions.assert(matches?,
      message: "locks differ (ages may be up to #{@slack} s older)",
      left: actual,
      right: expected
    )
  end

  @doc "As `assert_locks/2`, for one row: `expected` is what `lock/2` answers."
  def assert_lock(kind, id, expected), do: assert_locks([{kind, id}], [{kind, expected}])

  @doc "A new turn ref, never used before in this VM."
  def turn_ref(label \\ "turn"), do: "#{label}-#{System.unique_integer([:positive])}"

  @doc """
  A new chat, a new user (or `:user`) and a turn ref (`turn_ref(label)`), the
  turn holding both locks under `ttl_s`, taken `age` seconds ago (both
  backdated).
  """
  def held_turn!(ttl_s, opts \\ []) do
    {chat, turn} = {TestDB.insert_chat!(), turn_ref(opts[:label] || "turn")}
    user = opts[:user] || new_user()
    :ok = Locks.acquire(chat, user, turn, ttl_s)
    age = Keyword.get(opts, :age, 0)
    if age > 0, do: backdate!([chat: chat, user: user], age)
    {chat, user, turn}
  end

  @doc """
  A new user (or `user`) and a click ref, the click holding the user's lock
  (`acquire_user/4`).
  """
  def held_click!(ttl_s, hold_s, user \\ new_user()) do
    click = Locks.click_ref()
    :ok = Locks.acquire_user(user, click, ttl_s, hold_s)
    {user, click}
  end

  @doc """
  A click's lock taken over by a turn once its hold passed: `{chat, user,
  click, turn}`, the turn holding both locks.
  """
  def click_taken_over!(ttl_s, hold_s) do
    {user, click} = held_click!(ttl_s, hold_s)
    {chat, turn} = {TestDB.insert_chat!(), turn_ref()}
    backdate!([user: user], hold_s + 1)
    :ok = Locks.acquire(chat, user, turn, ttl_s)
    {chat, user, click, turn}
  end

  @doc """
  A turn (`lost`) whose user's lock went stale and was taken over by a turn
  of the same user in another chat: `{chat, other_chat, user, lost, turn}`;
  `lost` still holds `chat`'s lock.
  """
  def user_taken_over!(ttl_s) do
    [chat, other_chat] = insert_chats!(2)
    {user, lost, turn} = {new_user(), turn_ref("lost"), turn_ref()}
    :ok = Locks.acquire(chat, user, lost, ttl_s)
    backdate!([user: user], ttl_s + 1)
    :ok = Locks.acquire(other_chat, user, turn, ttl_s)
    {chat, other_chat, user, lost, turn}
  end

  @doc """
  A turn (`lost`) whose chat's lock went stale and was taken over by a turn
  of another user: `{chat, user, other_user, lost, turn}`; `lost` still
  holds `user`'s lock.
  """
  def chat_taken_over!(ttl_s) do
    {chat, user, lost} = held_turn!(ttl_s, label: "lost")
    {other_user, turn} = {new_user(), turn_ref()}
    backdate!([chat: chat], ttl_s + 1)
    :ok = Locks.acquire(chat, other_user, turn, ttl_s)
    {chat, user, other_user, lost, turn}
  end

  @doc "A user uuid with no settings row yet."
  def new_user, do: TestDB.uuid()

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
      keep: [
        conversation_uuid: :uuid,
        user_uuid: :uuid,
        turn_ref: :turn_ref,
        ttl_s: :ttl_s,
        lease_s: :hold_s
      ],
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
        :keep -> {:aging_turn, [chat, user, turn, 60, 60]}
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
end
