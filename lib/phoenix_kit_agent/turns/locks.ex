defmodule PhoenixKitAgent.Turns.Locks do
  @moduledoc """
  The two locks a turn of an AI chat holds, rows in PostgreSQL: the chat's
  (`busy_since` / `busy_turn_ref` of `phoenix_kit_agent_conversations`), one
  turn at a time per chat, and the user's (the same columns of
  `phoenix_kit_agent_user_settings`; a user with no row gets an empty one the
  first time their lock is taken), one turn in flight per user across all
  their chats. A click on a confirmation card takes the user's lock alone
  (`acquire_user/4`).

  A lock is taken by one atomic statement only when it is free
  (`busy_turn_ref` names no holder) or its `busy_since` is older than the
  caller's TTL, so the locks of a node that went down free themselves, with
  no cleanup job. Every time is the database's `now()`. Only the holder's ref
  frees or re-dates a lock; taking it again with that ref succeeds and
  re-dates it.

  Every call is one statement on a pooled connection, run on a dirty-I/O
  scheduler, at most `pool_size` at once. A refusal is a return value; a
  failure to answer (no database, a timeout) raises
  `PhoenixKitAgent.Turns.Locks.Error`, whose reason says whether the
  statement may have run; a bad argument raises `ArgumentError` before
  anything is sent. The README describes the configuration and operation;
  its "Testing your host" the mode in which a host's tests run every call
  through their repo, inside the Ecto SQL Sandbox (`testing: :sandbox`).

  ## Arguments

    * `conversation_uuid`, `user_uuid`: UUID strings in the hyphenated form,
      any letter case. A `conversation_uuid` with no row is never locked:
      `acquire/4` answers `{:error, :conversation_busy}`.
    * `turn_ref`: a string of 1 to 255 bytes (valid UTF-8, no NUL byte) that
      does not start with `"click:"`; `ref` (the click functions): one made by
      `click_ref/0`.
    * `ttl_s`: whole seconds from 1 to 315_360_000 (ten years); `hold_s`:
      whole seconds from 1 to `ttl_s`.
  """

  alias PhoenixKitAgent.Turns.Locks.{Error, Native, Observe, Sandbox, Turn}

  @typedoc "Why the user's lock was refused: a turn or a click holds it."
  @type user_busy :: :turn_in_flight | :click_in_flight

  @typedoc "Why `acquire/4` took neither lock."
  @type acquire_error :: :conversation_busy | user_busy()

  @max_ttl_s 315_360_000
  @max_ref_bytes 255

  @doc """
  Takes both locks for `turn_ref`, or neither; a lock older than `ttl_s`
  seconds is taken over. The chat is tried first: while another turn holds
  it, the answer is `{:error, :conversation_busy}` and the user's lock is not
  touched. With the chat free, the user's lock decides: held by a turn of the
  same user (in another chat) it is `{:error, :turn_in_flight}`, by a click
  `{:error, :click_in_flight}`, and the chat stays free.

      :ok = Locks.acquire(chat, user, "turn-1", 120)
      {:error, :conversation_busy} = Locks.acquire(chat, other_user, "turn-2", 120)
      {:error, :turn_in_flight} = Locks.acquire(other_chat, user, "turn-3", 120)
  """
  @spec acquire(String.t(), String.t(), String.t(), pos_integer()) ::
          :ok | {:error, acquire_error()}
  def acquire(conversation_uuid, user_uuid, turn_ref, ttl_s),
    do: run(:acquire, stamp(), turn!(conversation_uuid, user_uuid, turn_ref) ++ [ttl!(ttl_s)])

  @doc """
  Takes the user's lock alone for `ref`, a click on a confirmation card;
  refused with `{:error, :turn_in_flight}` while a turn of the user runs and
  `{:error, :click_in_flight}` while another click does. `ttl_s` is how old
  another holder's lock must be to be taken over: pass a turn's TTL, so a
  running turn is never taken over. `hold_s` is how long this lock keeps
  turns out: it is dated `ttl_s - hold_s` seconds in the past, so a turn
  takes it over `hold_s` seconds after it was taken (or last kept with
  `keep_user/4`) unless it is released with `release_user/2`.

      click = Locks.click_ref()
      :ok = Locks.acquire_user(user, click, 120, 30)
      {:error, :click_in_flight} = Locks.acquire(chat, user, "turn-1", 120)
  """
  @spec acquire_user(String.t(), String.t(), pos_integer(), pos_integer()) ::
          :ok | {:error, user_busy()}
  def acquire_user(user_uuid, ref, ttl_s, hold_s),
    do: run(:acquire_user, stamp(), click!(user_uuid, ref, ttl_s, hold_s))

  @doc """
  A new ref for a click on a confirmation card: `"click:"` and 32 random hex
  digits. Locks held under it are reported as `:click_in_flight`.

      iex> ref = PhoenixKitAgent.Turns.Locks.click_ref()
      iex> {String.starts_with?(ref, "click:"), byte_size(ref)}
      {true, 38}
  """
  @spec click_ref() :: String.t()
  def click_ref, do: click_prefix() <> Base.encode16(:crypto.strong_rand_bytes(16), case: :lower)

  @doc """
  Whether the chat's lock is `turn_ref`'s and no older than `ttl_s` seconds
  (by the database's clock): the turn may still be running, on this node or
  another, and nobody can take its lock over yet.
  """
  @spec fresh?(String.t(), String.t(), pos_integer()) :: boolean()
  def fresh?(conversation_uuid, turn_ref, ttl_s),
    do: run(:fresh?, stamp(), [chat!(conversation_uuid), turn_ref!(turn_ref), ttl!(ttl_s)])

  @doc """
  Whether `turn_ref` holds both locks. A turn asks before each round and
  stops when the answer is `false`: one of its locks was taken over.
  """
  @spec held?(String.t(), String.t(), String.t()) :: boolean()
  def held?(conversation_uuid, user_uuid, turn_ref),
    do: run(:held?, stamp(), turn!(conversation_uuid, user_uuid, turn_ref))

  @doc """
  Dates the user's lock of `ref` as if taken now (with the `ttl_s` and
  `hold_s` of `acquire_user/4`), while `ref` still holds it, so a click that
  runs longer than its hold keeps turns out. `true` when `ref` held it.
  """
  @spec keep_user(String.t(), String.t(), pos_integer(), pos_integer()) :: boolean()
  def keep_user(user_uuid, ref, ttl_s, hold_s),
    do: run(:keep_user, stamp(), click!(user_uuid, ref, ttl_s, hold_s))

  @doc """
  Releases whichever of the two locks `turn_ref` still holds; a lock that
  another turn took over stays that turn's. Always `:ok`.
  """
  @spec release(String.t(), String.t(), String.t()) :: :ok
  def release(conversation_uuid, user_uuid, turn_ref),
    do: run(:release, stamp(), turn!(conversation_uuid, user_uuid, turn_ref))

  @doc """
  Releases the locks of a turn lost with its node: only while the chat's lock
  is still `turn_ref`'s and older than `ttl_s` seconds (the database's clock).
  The user's lock goes too, if `turn_ref` still holds it. `true` when this
  call released them, so of several callers at most one gets `true`.

      false = Locks.release_stale(chat, user, "turn-1", 120)  # still fresh, or not turn-1's
  """
  @spec release_stale(String.t(), String.t(), String.t(), pos_integer()) :: boolean()
  def release_stale(conversation_uuid, user_uuid, turn_ref, ttl_s) do
    run(:release_stale, stamp(), turn!(conversation_uuid, user_uuid, turn_ref) ++ [ttl!(ttl_s)])
  end

  @doc "Releases the user's lock if the click `ref` still holds it. Always `:ok`."
  @spec release_user(String.t(), String.t()) :: :ok
  def release_user(user_uuid, ref),
    do: run(:release_user, stamp(), [uuid!(:user_uuid, user_uuid), click_ref!(ref)])

  @doc """
  Renews a turn's lease: dates both of `turn_ref`'s locks as if taken now,
  while it holds both and neither is older than `ttl_s` seconds. `true` when
  it did. A lease that expired is not revived (another turn may be taking it
  over), and a turn that lost one of its locks keeps neither: it must stop.
  A turn on a short TTL calls this well within it (`with_turn/4` does), so
  that its locks free themselves soon after its node dies, yet never while
  it runs.
  """
  @spec keep(String.t(), String.t(), String.t(), pos_integer()) :: boolean()
  def keep(conversation_uuid, user_uuid, turn_ref, ttl_s),
    do: run(:keep, stamp(), turn!(conversation_uuid, user_uuid, turn_ref) ++ [ttl!(ttl_s)])

  @doc """
  Runs `fun` as a turn: takes both locks under a new turn ref with a lease
  of `ttl_s` seconds, keeps the lease alive while `fun` runs, and releases
  both locks when `fun` returns, raises, throws or exits. Answers `{:ok,
  result}` when the turn ended holding its locks, `{:lost, result}` when it
  did not, and `acquire/4`'s `{:error, reason}` (without running `fun`) when
  the locks stayed refused.

  `fun` gets the `PhoenixKitAgent.Turns.Locks.Turn`. A keeper process
  (supervised by the library) renews the lease with `keep/4` every
  `ttl_s / 3`, retrying within the lease after an error. When the lease is
  lost (it expired, or another turn took a lock over), `lost?/1` answers
  `true` from then on and the calling process is sent `{:turn_lock_lost,
  ref}` once: the turn must stop, as one whose `held?/3` answered `false`.
  If the calling process dies, the keeper releases the locks; if the node
  dies, they free themselves after `ttl_s`; when the application stops, its
  keepers release theirs.

  Options: `:ttl_s` (required), the lease in whole seconds; `:wait_ms`, how
  long to keep trying while the locks are refused, with a back-off of 50 ms
  doubling to 1 s, each pause shortened at random by up to a quarter
  (default `0`: one try).

      Locks.with_turn(chat, user, [ttl_s: 15], fn turn ->
        for round <- rounds, not Locks.lost?(turn), do: run(round)
      end)
      # => {:ok, [...]}
  """
  @spec with_turn(String.t(), String.t(), keyword(), (Turn.t() -> result)) ::
          {:ok, result} | {:lost, result} | {:error, acquire_error()}
        when result: term()
  defdelegate with_turn(conversation_uuid, user_uuid, opts, fun), to: Turn, as: :run

  @doc "Whether a turn of `with_turn/4` lost its locks (read from memory: no query)."
  @spec lost?(Turn.t()) :: boolean()
  defdelegate lost?(turn), to: Turn

  @doc """
  Every lock taken, the oldest first (at most 1000): for an operator to see
  what is stuck. Each is a map with `:kind` (`:chat` or `:user`), `:uuid`,
  `:ref` (the holder), `:since` (a UTC `DateTime`), `:age_s` (seconds, by
  the database's clock) and `:stale` (whether it may be taken over under
  `ttl_s`). `mix locks.held` prints it as a table.

      Locks.held_locks(120)
      # => [%{kind: :chat, uuid: "6f1c…", ref: "turn-1", since: ~U[…], age_s: 3.2, stale: false}, …]
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
    for {kind, uuid, ref, since, age, stale} <- run(:held_locks, stamp(), [ttl!(ttl_s)]) do
      since = since && DateTime.from_unix!(since, :microsecond)
      %{kind: kind, uuid: uuid, ref: ref, since: since, age_s: age, stale: stale}
    end
  end

  @doc """
  What the library is doing: `:pool` (`:size`, the calls that may run at
  once; `:running`, `:waiting` for a turn; `:served`, the calls run in
  another call's turn since the VM started; the pool's `:connections` and
  those `:idle`), `:calls` (by function, the count of each outcome: `:ok`,
  each refusal reason, each error reason) and `:latency` (by function:
  `:calls`, `:p50_us`, `:p99_us`, `:max_us`, the upper bounds of
  power-of-two buckets), since the VM started. Raises `:not_started`
  without a pool.
  """
  @spec status() :: %{pool: map(), calls: map(), latency: map()}
  def status, do: Map.put(Observe.counts(), :pool, Native.status())

  ## Running a call

  # The call's one stamp, on the monotonic clock, taken before it queues: its
  # deadline (checkout + connect + statement timeouts) runs from here, and the
  # native side reads the same clock.
  defp stamp, do: System.monotonic_time(:nanosecond)

  defp run(function, start, args) do
    Observe.start(function, start)

    # testing: :sandbox: through the host's repo, in this process (sandbox.ex).
    result =
      case Sandbox.repo() do
        nil -> call(function, start, args)
        repo -> Sandbox.call(repo, function, args)
      end

    Observe.stop(function, start, result)
    result
  rescue
    error ->
      Observe.exception(function, start, error, __STACKTRACE__)
      reraise error, __STACKTRACE__
  end

  @doc false
  # The NIF call of `function`, by the protocol of native/locks_nif/src/call.rs:
  # beyond pool_size running calls, the caller waits here, on a normal scheduler.
  def call(function, start, args) do
    case Native.admit(start, function, args) do
      {:wait, ticket, wait_ms} ->
        receive do
          {:phoenix_kit_agent_locks, ^ticket, message} -> reply(message, function, start, args)
        after
          wait_ms -> give_up(ticket, function, start, args)
        end

      token ->
        run_in_turn(token, start, function, args)
    end
  end

  defp run_in_turn(token, start, function, args) do
    with {:phoenix_kit_agent_locks, :deliver, answer} <- Native.run(token, start, function, args) do
      Native.deliver()
      answer
    end
  end

  defp reply({:turn, token}, function, start, args), do: run_in_turn(token, start, function, args)
  defp reply(served, _function, _start, _args), do: served_answer(served)

  defp served_answer({:done, answer}), do: answer
  defp served_answer({:raise, exception}), do: raise(exception)

  # The checkout deadline passed (leave/2: call.rs). A served answer still missing
  # wait_ms later was kept by a call killed before sending it: deliver/0 sends it.
  defp give_up(ticket, function, start, args) do
    case Native.leave(ticket, start) do
      {:served, wait_ms} ->
        receive do
          {:phoenix_kit_agent_locks, ^ticket, message} -> reply(message, function, start, args)
        after
          wait_ms ->
            Native.deliver()
            message = "no answer from the call that ran this one within #{wait_ms} ms"
            answer_now(ticket, %Error{reason: :timeout, message: message})
        end

      {:left, pool_timeout} ->
        answer_now(ticket, pool_timeout)
    end
  end

  defp answer_now(ticket, error) do
    receive do
      {:phoenix_kit_agent_locks, ^ticket, {:turn, _}} -> raise error
      {:phoenix_kit_agent_locks, ^ticket, served} -> served_answer(served)
    after
      0 -> raise error
    end
  end

  ## Argument checks: each raises ArgumentError naming the argument before
  ## anything reaches the native side, which refuses, unworded, what it cannot use.

  defp turn!(chat, user, turn_ref),
    do: [chat!(chat), uuid!(:user_uuid, user), turn_ref!(turn_ref)]

  defp chat!(uuid), do: uuid!(:conversation_uuid, uuid)

  defp click!(user_uuid, ref, ttl_s, hold_s) do
    ttl_s = ttl!(ttl_s)
    [uuid!(:user_uuid, user_uuid), click_ref!(ref), ttl_s, hold!(hold_s, ttl_s)]
  end

  # A binary pattern, not a regex: this runs on every call. The uuid's 16 bytes
  # are made as one integer, a binary on the caller's heap (Base.decode16/2
  # makes an off-heap one, about 20 µs of CPU a call on the dirty scheduler).
  # The first digit is checked because String.to_integer/2 would take a sign.
  defp uuid!(
         name,
         <<h, a::binary-7, ?-, b::binary-4, ?-, c::binary-4, ?-, d::binary-4, ?-, e::binary-12>> =
           value
       )
       when h in ?0..?9 or h in ?a..?f or h in ?A..?F do
    hex = <<h, a::binary, b::binary, c::binary, d::binary, e::binary>>
    <<String.to_integer(hex, 16)::128>>
  rescue
    ArgumentError -> bad!(name, "a hyphenated UUID string", value)
  end

  defp uuid!(name, value), do: bad!(name, "a hyphenated UUID string", value)

  defp turn_ref!(value) do
    if click_ref?(value), do: bad!(:turn_ref, "a turn's ref, not a click's (click_ref/0)", value)
    ref!(:turn_ref, value)
  end

  defp click_ref!(value) do
    unless click_ref?(value), do: bad!(:ref, "a click ref made by click_ref/0", value)
    ref!(:ref, value)
  end

  defp click_ref?(value), do: is_binary(value) and String.starts_with?(value, click_prefix())

  # The native side's prefix (it tells a refusal's holder by it), kept by Native.
  defp click_prefix, do: :persistent_term.get({Native, :click_prefix})

  defp ref!(name, value) when is_binary(value) and byte_size(value) in 1..@max_ref_bytes do
    if String.valid?(value) and not String.contains?(value, <<0>>),
      do: value,
      else: bad!(name, "valid UTF-8 without NUL bytes", value)
  end

  defp ref!(name, value), do: bad!(name, "a string of 1 to #{@max_ref_bytes} bytes", value)

  defp ttl!(value) when is_integer(value) and value in 1..@max_ttl_s, do: value
  defp ttl!(value), do: bad!(:ttl_s, "a whole number of seconds from 1 to #{@max_ttl_s}", value)

  defp hold!(value, ttl_s) when is_integer(value) and value in 1..ttl_s, do: value
  defp hold!(value, _ttl_s), do: bad!(:hold_s, "a whole number of seconds from 1 to ttl_s", value)

  defp bad!(name, expected, value) do
    raise ArgumentError,
          "invalid #{name}: expected #{expected}, got: " <>
            inspect(value, limit: 5, printable_limit: 64)
  end
end
