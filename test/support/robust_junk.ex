defmodule PhoenixKitAgent.Turns.Locks.Robust.Junk do
  @moduledoc false
  # Bad arguments from a seeded generator (:rand with an explicit state, so a
  # failure can be replayed from its seed), and a runner that calls every
  # public function, and the NIF directly, with them.
  #
  # Every generated call has at least one bad argument in a position of its
  # own kind (a uuid, a turn ref, a click ref, a TTL, a hold); the others are
  # valid, so a check that is skipped for one position shows up. What is bad
  # for a position may be fine for another: SQL text is a valid turn ref
  # (it is a bound parameter), never a valid uuid.

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.Native

  @mib :binary.copy("a", 1_048_576)
  @sql "'; DROP TABLE phoenix_kit_agent_conversations; --"
  @uuid "6f1c4f9e-8a53-4a77-9b1e-3f0c2d8e5a10"

  # {function, [argument kinds]} of Locks, and the Native function it calls.
  @api [
    {:acquire, [:uuid, :uuid, :turn, :ttl], :acquire},
    {:acquire_user, [:uuid, :click, :ttl, :hold], :acquire_user},
    {:fresh?, [:uuid, :turn, :ttl], :fresh?},
    {:held?, [:uuid, :uuid, :turn], :held?},
    {:keep_user, [:uuid, :click, :ttl, :hold], :keep_user},
    {:release, [:uuid, :uuid, :turn], :release},
    {:release_stale, [:uuid, :uuid, :turn, :ttl], :release_stale},
    {:release_user, [:uuid, :click], :release_user}
  ]

  @doc """
  `n` bad calls from `seed`, as `{module, function, args}`: each Locks
  function and its Native counterpart get the same junk.
  """
  def calls(seed, n) do
    state = :rand.seed_s(:exsss, seed)

    {calls, _} =
      Enum.map_reduce(1..n, state, fn i, state ->
        {fun, kinds, native} = Enum.at(@api, rem(i, length(@api)))

        # Every other round of the eight functions goes to the NIF directly
        # (with a turn and a stamp, as Locks calls it; valid uuids as their
        # 16 bytes, which is what the NIF takes).
        {target, call} =
          if rem(div(i, length(@api)), 2) == 0,
            do: {Locks, &{Locks, fun, &1}},
            else: {Native, &{Native, native, &1}}

        {args, state} = args(kinds, target, state)
        {call.(args), state}
      end)

    calls
  end

  # Valid arguments except at least one junk position.
  defp args(kinds, target, state) do
    {bad_at, state} = :rand.uniform_s(length(kinds), state)

    Enum.map_reduce(Enum.with_index(kinds, 1), state, fn {kind, pos}, state ->
      {coin, state} = :rand.uniform_s(3, state)

      if pos == bad_at or coin == 1,
        do: junk(kind, target, state),
        else: {valid(kind, target), state}
    end)
  end

  defp valid(:uuid, Native), do: Base.decode16!(String.replace(@uuid, "-", ""), case: :lower)
  defp valid(kind, _target), do: valid(kind)

  defp valid(:uuid), do: @uuid
  defp valid(:turn), do: "turn-1"
  defp valid(:click), do: "click:0123456789abcdef0123456789abcdef"
  defp valid(:ttl), do: 60
  # With the valid TTL of 60; junk TTLs are checked before the hold.
  defp valid(:hold), do: 30

  @doc """
  A bad value for an argument of `kind` of a call to `target`. Values beyond
  the documented limits alone (a ref of 256 bytes, a TTL of ten years and a
  second) are only the Elixir API's to refuse: the NIF can run them.
  """
  def junk(kind, target, state) do
    {pick, state} = :rand.uniform_s(3, state)
    pool = if pick == 1, do: common(), else: specific(kind)
    pool = if target == Native, do: pool -- limits_only(), else: pool
    {i, state} = :rand.uniform_s(length(pool), state)
    {Enum.at(pool, i - 1), state}
  end

  defp limits_only,
    do: [
      315_360_001,
      String.duplicate("x", 256),
      String.duplicate("é", 128),
      "click:" <> String.duplicate("x", 250),
      @mib
    ]

  # Bad in every position (no positive integer: that is a valid TTL or hold).
  defp common do
    [
      nil,
      true,
      false,
      :ok,
      :"#{@sql}",
      0,
      -1,
      2 ** 64,
      -(2 ** 70),
      1.0,
      60.0,
      -0.5,
      1.0e308,
      [],
      ~c"abc",
      [1, 2, 3],
      [@uuid],
      {},
      {:ok, @uuid},
      {@uuid},
      %{},
      %{uuid: @uuid},
      self(),
      make_ref(),
      &Kernel.+/2,
      <<1::3>>,
      <<@uuid::binary, 1::1>>
    ]
  end

  defp specific(:uuid) do
    [
      "",
      @mib,
      <<0xFF, 0xFE, 0xFD>>,
      String.slice(@uuid, 0, 35),
      @uuid <> "0",
      String.replace(@uuid, "-", ""),
      String.replace(@uuid, "a", "g"),
      "6f1c4f9e8-a53-4a77-9b1e-3f0c2d8e5a10",
      "{" <> @uuid <> "}",
      "urn:uuid:" <> @uuid,
      " " <> String.slice(@uuid, 1, 35),
      @uuid <> "\n",
      String.slice(@uuid, 0, 35) <> "\0",
      String.slice(@uuid, 0, 34) <> "é",
      String.slice(@uuid, 0, 35) <> <<0xFF>>,
      "６f1c4f9e-8a53-4a77-9b1e-3f0c2d8e5a1",
      @sql,
      String.pad_trailing(@sql, 36, "-"),
      "00000000-0000-0000-0000-00000000000'",
      "null"
    ]
  end

  defp specific(:turn) do
    [
      "",
      @mib,
      String.duplicate("x", 256),
      String.duplicate("é", 128),
      <<0xFF, 0xFE>>,
      "turn" <> <<0xC3>>,
      "a\0b",
      "\0",
      "click:",
      "click:0123456789abcdef0123456789abcdef"
    ]
  end

  defp specific(:click) do
    [
      "",
      @mib,
      "turn-1",
      "Click:0123",
      " click:0123",
      @sql,
      "click:" <> String.duplicate("x", 250),
      "click:\0",
      "click:" <> <<0xFF>>,
      "click" <> <<0>>
    ]
  end

  defp specific(:ttl),
    do: [0, -1, -60, 315_360_001, 2 ** 31, 2 ** 63, -(2 ** 63), 2 ** 100, 1.5, "60", ~c"60"]

  defp specific(:hold), do: [0, -1, 61, 315_360_000, 2 ** 63, 2 ** 100, 30.0, "30", nil]

  @doc """
  Runs `calls`; returns `{counts by what happened, the unexpected ones}`.
  Expected: ArgumentError or FunctionClauseError, nothing else — no return
  value, no Locks.Error (it would mean the call reached the pool), no
  `:nif_panicked`.
  """
  def run(calls) do
    results =
      for {m, f, a} <- calls do
        outcome =
          try do
            {:returned, call(m, f, a)}
          rescue
            e in [ArgumentError, FunctionClauseError] -> {:raised, e.__struct__}
            e -> {:unexpected, e}
          catch
            kind, reason -> {:unexpected, {kind, reason}}
          end

        {{m, f, a}, outcome}
      end

    counts =
      Enum.frequencies_by(results, fn
        {_, {:raised, module}} -> module
        {_, {tag, _}} -> tag
      end)

    bad =
      for {call, outcome} <- results,
          not match?({:raised, _}, outcome),
          do: {shorten(call), inspect(outcome, limit: 5, printable_limit: 80)}

    {counts, bad}
  end

  defp call(Locks, f, a), do: apply(Locks, f, a)

  defp call(Native, f, a), do: Locks.call(f, System.monotonic_time(:nanosecond), a)

  defp decode_error(%ErlangError{original: "Could not decode field " <> _}), do: :decode_error
  defp decode_error(e), do: {:unexpected, inspect(e)}

  @doc "Generates `n` calls from `seed` here and runs them (nothing big crosses a port)."
  def run_seeded(seed, n), do: run(calls(seed, n))

  @doc """
  Bad configurations for `Native.start/1`: not a Config struct or a port
  no socket can have (ArgumentError), a field of the wrong type (rustler's
  decode error, an ErlangError), or well typed but unusable (`Locks.Error`
  with reason `:config`). None may panic or replace the running pool.
  """
  def start_junk do
    {:ok, good} = PhoenixKitAgent.Turns.Locks.Config.read(url: "postgres://u:pw@127.0.0.1:1/db")

    wrong_types =
      [nil, 1, "url", [url: "x"], {:url, "x"}, %{}, Map.from_struct(good), @mib] ++
        for {key, value} <- [
              hostname: 1,
              port: 0,
              port: 70_000,
              username: nil,
              password: <<0xFF>>,
              sslmode: :verify,
              sslmode: "prefer",
              pool_size: "10",
              pool_size: 2 ** 64,
              pool_size: 1.0,
              connect_timeout: :infinity,
              checkout_timeout: -1,
              prefix: 1,
              prepare: :maybe
            ],
            do: Map.put(good, key, value)

    unusable =
      for fields <- [
            [sslmode: :verify_full],
            [sslmode: :verify_ca, ssl_ca_file: "/nonexistent/ca.pem"],
            [sslmode: :require, ssl_ca_file: "/dev/null", hostname: @sql]
          ],
          do: struct!(good, fields)

    for options <- wrong_types ++ unusable do
      outcome =
        try do
          {:returned, Native.start(options)}
        rescue
          _ in ArgumentError -> :argument_error
          e in PhoenixKitAgent.Turns.Locks.Error -> {:locks_error, e.reason}
          # rustler's NifMap decoder raises this for a field of the wrong type.
          e in ErlangError -> decode_error(e)
          e -> {:unexpected, inspect(e)}
        catch
          kind, reason -> {:unexpected, inspect({kind, reason})}
        end

      outcome
    end
  end

  defp shorten({m, f, a}),
    do:
      {m, f,
       Enum.map(
         a,
         &if(is_binary(&1) and byte_size(&1) > 64, do: {:bytes, byte_size(&1)}, else: &1)
       )}
end
