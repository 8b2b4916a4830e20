defmodule PhoenixKitAgent.Turns.Locks do
  @moduledoc """
  The two locks a turn of an AI chat holds, rows in PostgreSQL: the chat's
  (`busy_since` / `busy_turn_ref` of `phoenix_kit_agent_conversations`), one
  turn per chat, and the user's (of `phoenix_kit_agent_user_settings`, whose
  row is made the first time it is taken), one turn in flight per user. A
  click on a confirmation card takes the user's lock alone (`acquire_user/4`).

  Each call is one atomic statement on a pooled connection, on a dirty-I/O
  scheduler. A lock is taken only when it is free or older than the caller's
  TTL (by the database's `now()`), so a dead node's locks free themselves;
  only the holder's ref frees or re-dates it. A refusal is a return value; a
  bad argument raises `ArgumentError` before anything is sent; a call that
  cannot be answered raises `PhoenixKitAgent.Turns.Locks.Error`. No call
  waits long on a row another session holds: a taker answers busy at once,
  a holder's own write raises `:row_locked` after 250 ms. The guides:
  README.md, "Guides".

  ## Arguments

    * `conversation_uuid`, `user_uuid`: UUID strings in the hyphenated form,
      any letter case. A `conversation_uuid` with no row is never locked:
      `acquire/4` answers `{:error, :conversation_busy}`.
    * `turn_ref`: a string of 1 to 255 bytes (valid UTF-8, no NUL byte) that
      does not start with `"click:"`; `ref` (the click functions): one made by
      `click_ref/0`.
    * `ttl_s`: whole seconds from 1 to 315_360_000 (ten years); `hold_s`,
      `lease_s`: whole seconds from 1 to `ttl_s`.
  """

  alias PhoenixKitAgent.Turns.Locks.{Native, Observe, Sandbox, Turn}

  @typedoc "Why the user's lock was refused: a turn or a click holds it."
  @type user_busy :: :turn_in_flight | :click_in_flight

  @typedoc "Why `acquire/4` took neither lock."
  @type acquire_error :: :conversation_busy | user_busy()

  @doc """
  Takes both locks for `turn_ref`, or neither; a lock older than `ttl_s`
  seconds is taken over. The chat is tried first: while another turn holds
  it, the answer is `{:error, :conversation_busy}` and the user's lock is not
  touched. Then the user's: held by another turn of the user, `{:error,
  :turn_in_flight}`, by a click `{:error, :click_in_flight}`.

      :ok = Locks.acquire(chat, user, "turn-1", 120)
      {:error, :conversation_busy} = Locks.acquire(chat, other_user, "turn-2", 120)
      {:error, :turn_in_flight} = Locks.acquire(other_chat, user, "turn-3", 120)
  """
  @spec acquire(String.t(), String.t(), String.t(), pos_integer()) ::
          :ok | {:error, acquire_error()}
  def acquire(conversation_uuid, user_uuid, turn_ref, ttl_s) do
    run(:acquire, binding(), turn!(conversation_uuid, user_uuid, turn_ref) ++ [ttl!(ttl_s)])
  end

  @doc """
  As `acquire/4`, with a lease (guides/leases.md): both locks are dated
  `ttl_s - lease_s` seconds back, so a taker with the common TTL `ttl_s`
  takes them over `lease_s` seconds after this call, or after the last
  `keep/5`, unless they are released. With `lease_s == ttl_s` this is
  `acquire/4`.
  """
  @spec acquire(String.t(), String.t(), String.t(), pos_integer(), pos_integer()) ::
          :ok | {:error, acquire_error()}
  def acquire(conversation_uuid, user_uuid, turn_ref, ttl_s, lease_s) do
    run(:acquire, binding(), lease!(conversation_uuid, user_uuid, turn_ref, ttl_s, lease_s))
  end

  @doc """
  Takes the user's lock alone for `ref`, a click on a confirmation card;
  refused with `{:error, :turn_in_flight}` while a turn of the user runs and
  `{:error, :click_in_flight}` while another click does. `ttl_s` is how old
  another holder's lock must be to be taken over (pass a turn's TTL);
  `hold_s` is how long this one keeps turns out: it is dated `ttl_s -
  hold_s` seconds back, so a turn takes it over `hold_s` seconds after it
  was taken or last kept (`keep_user/4`), unless released.

      :ok = Locks.acquire_user(user, Locks.click_ref(), 120, 30)
      {:error, :click_in_flight} = Locks.acquire(chat, user, "turn-1", 120)
  """
  @spec acquire_user(String.t(), String.t(), pos_integer(), pos_integer()) ::
          :ok | {:error, user_busy()}
  def acquire_user(user_uuid, ref, ttl_s, hold_s),
    do: run(:acquire_user, binding(), click!(user_uuid, ref, ttl_s, hold_s))

  @doc """
  A new ref for a click on a confirmation card: `"click:"` and 32 random hex
  digits. Locks held under it are reported as `:click_in_flight`.

      iex> ref = PhoenixKitAgent.Turns.Locks.click_ref()
      iex> {String.starts_with?(ref, "click:"), byte_size(ref)}
      {true, 38}
  """
  @spec click_ref() :: String.t()
  def click_ref,
    do: rules().click_prefix <> Base.encode16(:crypto.strong_rand_bytes(16), case: :lower)

  @doc """
  Whether the chat's lock is `turn_ref`'s and no older than `ttl_s` seconds
  (by the database's clock): the turn may still run, and nobody can take it over.
  """
  @spec fresh?(String.t(), String.t(), pos_integer()) :: boolean()
  def fresh?(conversation_uuid, turn_ref, ttl_s) do
    run(:fresh?, binding(), [chat!(conversation_uuid), turn_ref!(turn_ref), ttl!(ttl_s)])
  end

  @doc """
  Whether `turn_ref` holds both locks. A turn asks before each round and
  stops when the answer is `false`: one of its locks was taken over.
  """
  @spec held?(String.t(), String.t(), String.t()) :: boolean()
  def held?(conversation_uuid, user_uuid, turn_ref),
    do: run(:held?, binding(), turn!(conversation_uuid, user_uuid, turn_ref))

  @doc """
  Dates the user's lock of `ref` as `acquire_user/4` does, from now, while
  `ref` still holds it: a click that outlasts its hold keeps turns out. `true`
  when `ref` held it.
  """
  @spec keep_user(String.t(), String.t(), pos_integer(), pos_integer()) :: boolean()
  def keep_user(user_uuid, ref, ttl_s, hold_s),
    do: run(:keep_user, binding(), click!(user_uuid, ref, ttl_s, hold_s))

  @doc """
  Releases whichever of the two locks `turn_ref` still holds; a lock that
  another turn took over stays that turn's. Always `:ok`.
  """
  @spec release(String.t(), String.t(), String.t()) :: :ok
  def release(conversation_uuid, user_uuid, turn_ref),
    do: run(:release, binding(), turn!(conversation_uuid, user_uuid, turn_ref))

  @doc """
  Releases the locks of a turn lost with its node: only while the chat's lock
  is still `turn_ref`'s and older than `ttl_s` seconds (the database's clock).
  The user's lock goes too, if `turn_ref` still holds it. `true` when this
  call released them, so of several callers at most one gets `true`.
  """
  @spec release_stale(String.t(), String.t(), String.t(), pos_integer()) :: boolean()
  def release_stale(conversation_uuid, user_uuid, turn_ref, ttl_s) do
    run(:release_stale, binding(), turn!(conversation_uuid, user_uuid, turn_ref) ++ [ttl!(ttl_s)])
  end

  @doc "Releases the user's lock if the click `ref` still holds it. Always `:ok`."
  @spec release_user(String.t(), String.t()) :: :ok
  def release_user(user_uuid, ref),
    do: run(:release_user, binding(), [uuid!(:user_uuid, user_uuid), click_ref!(ref)])

  @doc """
  Renews a turn's lease: dates both of `turn_ref`'s locks as `acquire/5`
  does, from now, while it holds both and neither is older than `ttl_s`.
  `true` when it did. An expired lease is not revived, and a turn that lost
  one of its locks keeps neither: it must stop. `with_turn/4` calls it
  every `lease_s / 3`.
  """
  @spec keep(String.t(), String.t(), String.t(), pos_integer(), pos_integer()) :: boolean()
  def keep(conversation_uuid, user_uuid, turn_ref, ttl_s, lease_s) do
    run(:keep, binding(), lease!(conversation_uuid, user_uuid, turn_ref, ttl_s, lease_s))
  end

  @doc """
  Runs `fun.(turn)` on a short lease: takes both locks under a new ref
  (`acquire/5`), renews them with `keep/5` every `lease_s / 3` from a
  supervised keeper, and releases them when `fun` returns, raises, throws
  or exits (or the caller dies). A turn learns it lost its lease before
  another node can take it over: `lost?/1` turns `true` and the caller is
  sent `{:turn_lock_lost, ref}` once; it must then stop (guides/leases.md).

  Answers `{:ok, result}` (the turn ended holding its locks), `{:lost,
  result}` (it knows, or cannot tell, that it did not) or `acquire/4`'s
  `{:error, reason}` without running `fun`. Raises as `acquire/4` does, or
  `:not_started` when the application is not running or stops during the
  acquire; it never exits because of the library's processes.

  Options: `:ttl_s` (required), the TTL every taker of these locks uses;
  `:lease_s`, how long the locks outlive their last renewal (1 to `ttl_s`,
  the default); `:wait_ms`, how long to try again while refused (a back-off
  of 50 ms doubling to 1 s; default `0`, one try).

      Locks.with_turn(chat, user, [ttl_s: 600, lease_s: 15], fn turn ->
        for round <- rounds, not Locks.lost?(turn), do: run(round)
      end)
      # => {:ok, [...]}
  """
  @spec with_turn(String.t(), String.t(), keyword(), (Turn.t() -> result)) ::
          {:ok, result} | {:lost, result} | {:error, acquire_error()}
        when result: term()
  defdelegate with_turn(conversation_uuid, user_uuid, opts, fun), to: Turn, as: :run

  # transaction/4's bound for a turn given as {conversation_uuid, user_uuid, turn_ref}.
  @fence_lease_s 15
  # PostgreSQL's largest timeout setting (an int4 of milliseconds, 24.8 days).
  @max_timeout_ms 2_147_483_647

  @typedoc "A turn, as `transaction/4` takes it: `with_turn/4`'s, or its ids and ref."
  @type turn :: Turn.t() | {String.t(), String.t(), String.t()}

  @doc """
  Runs `fun` in a transaction of the host's Ecto `repo`
  (`repo.transaction(fun, opts)`) that commits only while `turn` holds both
  its locks: a fenced write. `turn` is `with_turn/4`'s turn or
  `{conversation_uuid, user_uuid, turn_ref}`; `fun` takes no argument or the
  repo. Its first statement takes both lock rows `FOR SHARE` where the turn
  still holds them, so no write of `fun` commits after another turn (or a
  click, `release/3`, `release_stale/4`) took either lock, however long the
  turn was paused. Answers `{:ok, value}`, `{:error, :lost}` (`fun` did not
  run) or `{:error, value}` after `repo.rollback(value)`; an exception in
  `fun` rolls back and is raised again.

  Keep it short: while it is open nobody writes the two rows, the turn's
  renewal included. The server ends one that stalls a lease after it went
  idle (`lease_s:`, taken out of `opts`: the turn's, or 15 for a tuple; none under
  `testing: :sandbox`). The details: guides/fenced-writes.md.

      {:ok, message} = Locks.transaction(Repo, turn, fn -> Repo.insert!(message) end)
  """
  # `fun` of any arity in the spec: `(-> result)` is written differently by
  # Elixir 1.14's formatter and 1.18's, and the guard takes 0 or 1 alone.
  @spec transaction(module(), turn(), (... -> result), keyword()) ::
          {:ok, result} | {:error, :lost | term()}
        when result: term()
  def transaction(repo, turn, fun, opts \\ [])
      when is_atom(repo) and (is_function(fun, 0) or is_function(fun, 1)) and is_list(opts) do
    {conversation_uuid, user_uuid, turn_ref, lease_s} = turn_ids!(turn)
    {lease_s, opts} = Keyword.pop(opts, :lease_s, lease_s)
    params = turn!(conversation_uuid, user_uuid, turn_ref)
    lease_ms = min(ttl!(lease_s, :lease_s) * 1_000, @max_timeout_ms)

    # The fence's text, for the tables the lock calls use (native sql.rs,
    # FENCE), bounded by the lease outside the sandbox.
    {sql, params} =
      if Sandbox.repo(),
        do: {Native.repo_fence_sql(), params},
        else: {Native.fence_sql(), params ++ [lease_ms]}

    repo.transaction(
      fn ->
        case repo.query(sql, params, []) do
          {:ok, %{rows: [[true]]}} -> if is_function(fun, 0), do: fun.(), else: fun.(repo)
          {:ok, %{rows: [[false]]}} -> repo.rollback(:lost)
          {:error, error} -> raise Sandbox.error(error)
        end
      end,
      opts
    )
  end

  defp turn_ids!(%Turn{conversation_uuid: chat, user_uuid: user, ref: ref, lease_s: lease_s}),
    do: {chat, user, ref, lease_s}

  defp turn_ids!({chat, user, ref}), do: {chat, user, ref, @fence_lease_s}

  defp turn_ids!(turn),
    do: bad!(:turn, "with_turn/4's turn or {conversation_uuid, user_uuid, turn_ref}", turn)

  @doc """
  Whether a turn of `with_turn/4` lost its lease (its deadline passed with
  no renewal confirmed, a renewal answered `false`, or its keeper stopped),
  from memory, in any process; `true` for good once it is.
  """
  @spec lost?(Turn.t()) :: boolean()
  defdelegate lost?(turn), to: Turn

  @doc """
  Every lock taken, the oldest first (at most 1000), for an operator to see
  what is stuck (`mix locks.held` prints it). `:age_s` is by the database's
  clock, `:stale` whether it may be taken over under `ttl_s`. A lock whose
  age is unknown comes first, with `since: nil`, `age_s: nil` and `stale:
  true` (guides/operating.md, "Observability"). No row makes this raise.
  """
  @spec held_locks(pos_integer()) :: [
          %{
            kind: :chat | :user,
            uuid: String.t(),
            ref: String.t(),
            since: DateTime.t() | nil,
            age_s: float() | nil,
            stale: boolean()
          }
        ]
  def held_locks(ttl_s) do
    run(:held_locks, binding(), [ttl!(ttl_s)], fn held ->
      for {kind, uuid, ref, since, age, stale} <- held do
        # Within DateTime's range: the statement gives none other (sql.rs HELD_LOCKS).
        since = since && DateTime.from_unix!(since, :microsecond)
        %{kind: kind, uuid: uuid, ref: ref, since: since, age_s: age, stale: stale}
      end
    end)
  end

  @doc """
  What the library is doing: `:pool` (`:size`, `:running`, `:waiting`,
  `:connections`, `:idle`), and by function since the VM started, the `:calls`
  of each outcome and their `:latency` (guides/operating.md, "Observability").
  """
  @spec status() :: %{pool: map(), calls: map(), latency: map()}
  def status, do: Map.put(Observe.counts(), :pool, Native.status())

  ## Running a call

  # One call, a span of events (Observe) whose metadata is the function and
  # its arguments as the caller passed them (the public function's
  # `binding()`, taken before it binds anything else; `args` are the NIF's);
  # `answer` makes the function's return of the NIF's answer. Under
  # testing: :sandbox the call goes through the host's repo, in this process
  # (sandbox.ex).
  # The call's one stamp, on the monotonic clock, is taken before it queues:
  # its deadline (checkout + connect + statement timeouts) runs from there,
  # and the native side reads the same clock.
  defp run(function, arguments, args, answer \\ & &1) do
    start = System.monotonic_time(:nanosecond)
    span = Observe.start(function, start, Map.new([{:function, function} | arguments]))

    try do
      answered =
        case Sandbox.repo() do
          nil -> call(function, start, args)
          repo -> Sandbox.call(repo, function, args)
        end

      result = answer.(answered)
      Observe.stop(span, result)
      result
    catch
      kind, reason ->
        Observe.exception(span, kind, reason, __STACKTRACE__)
        :erlang.raise(kind, reason, __STACKTRACE__)
    end
  end

  @doc false
  # One lock call, by the protocol of native/locks_core/src/queue.rs.
  def call(function, start, args) do
    case with(:go <- Native.enter(start, function, args), do: Native.run(start, function, args)) do
      {:wait, ms} -> await(ms, nil, fn -> call(function, start, args) end)
      answer -> answer
    end
  end

  # The one receive of a caller in line (`left`: the exception to raise once it left
  # at its deadline, when a go handed as it left may be here; `:taken`: its answer comes).
  defp await(ms, left, go) do
    receive do
      {:phoenix_kit_agent_locks, _go} when left != nil -> raise left
      {:phoenix_kit_agent_locks, :go} -> go.()
      {:phoenix_kit_agent_locks, {:ok, answer}} -> answer
      {:phoenix_kit_agent_locks, {:error, error}} -> raise error
    after
      ms ->
        case left || Native.leave() do
          :taken -> await(:infinity, nil, go)
          ^left -> raise left
          error -> await(0, error, go)
        end
    end
  end

  ## Argument checks: each raises ArgumentError naming the argument before
  ## anything reaches the native side. The rules are the native side's
  ## (native/locks_core/src/args.rs), which refuses the same terms, unworded;
  ## their limits come from it (rules/0).

  defp turn!(chat, user, turn_ref),
    do: [chat!(chat), uuid!(:user_uuid, user), turn_ref!(turn_ref)]

  defp chat!(uuid), do: uuid!(:conversation_uuid, uuid)

  defp click!(user_uuid, ref, ttl_s, hold_s) do
    ttl_s = ttl!(ttl_s)
    [uuid!(:user_uuid, user_uuid), click_ref!(ref), ttl_s, hold!(:hold_s, hold_s, ttl_s)]
  end

  defp lease!(chat, user, turn_ref, ttl_s, lease_s) do
    ttl_s = ttl!(ttl_s)
    turn!(chat, user, turn_ref) ++ [ttl_s, hold!(:lease_s, lease_s, ttl_s)]
  end

  # A binary pattern, not a regex: this runs on every call. The uuid's 16 bytes
  # are made as one integer, a binary on the caller's heap (Base.decode16/2
  # makes an off-heap one, which the dirty scheduler must shrink and the VM
  # free across threads).
  # The first digit is checked because String.to_integer/2 would take a sign;
  # anything else (not a binary, not the pattern, not hex) fails a match or
  # the parse.
  defp uuid!(name, value) do
    <<a::binary-8, ?-, b::binary-4, ?-, c::binary-4, ?-, d::binary-4, ?-, e::binary-12>> = value
    <<first, _::binary>> = a
    true = first in ?0..?9 or first in ?a..?f or first in ?A..?F
    <<String.to_integer(a <> b <> c <> d <> e, 16)::128>>
  rescue
    _ in [MatchError, ArgumentError] -> bad!(name, "a hyphenated UUID string", value)
  end

  defp turn_ref!(value) do
    if click_ref?(value), do: bad!(:turn_ref, "a turn's ref, not a click's (click_ref/0)", value)
    ref!(:turn_ref, value)
  end

  defp click_ref!(value) do
    unless click_ref?(value), do: bad!(:ref, "a click ref made by click_ref/0", value)
    ref!(:ref, value)
  end

  defp click_ref?(value),
    do: is_binary(value) and String.starts_with?(value, rules().click_prefix)

  # The native side's limits (its click prefix tells a refusal's holder by it),
  # kept by Native when it loads; asking Native loads it, in a VM that loads
  # modules on first use.
  defp rules, do: :persistent_term.get({Native, :rules}, nil) || Native.rules()

  defp ref!(name, value) do
    %{max_ref_bytes: max} = rules()

    unless is_binary(value) and byte_size(value) in 1..max,
      do: bad!(name, "a string of 1 to #{max} bytes", value)

    unless String.valid?(value) and not String.contains?(value, <<0>>),
      do: bad!(name, "valid UTF-8 without NUL bytes", value)

    value
  end

  defp ttl!(value, name \\ :ttl_s) do
    %{max_ttl_s: max} = rules()

    if is_integer(value) and value in 1..max,
      do: value,
      else: bad!(name, "a whole number of seconds from 1 to #{max}", value)
  end

  defp hold!(_name, value, ttl_s) when is_integer(value) and value >= 1 and value <= ttl_s,
    do: value

  defp hold!(name, value, _ttl_s),
    do: bad!(name, "a whole number of seconds from 1 to ttl_s", value)

  defp bad!(name, expected, value) do
    raise ArgumentError,
          "invalid #{name}: expected #{expected}, got: " <>
            inspect(value, limit: 5, printable_limit: 64)
  end
end
