defmodule PhoenixKitAgent.Turns.Locks.Observe do
  @moduledoc false
  # Each lock call, counted for Locks.status/0 (lock-free :counters) and, when
  # the host has :telemetry, a span of events (the README's "Observability").
  # The functions counted are the native side's lock functions (Native.functions/0).

  alias PhoenixKitAgent.Turns.Locks.Native

  @outcomes ~w(ok true false conversation_busy turn_in_flight click_in_flight connect pool_timeout
               timeout disconnected statement config not_started nif_not_loaded other)a
  # Bucket i holds the calls that took less than 2^i µs (the last: the rest).
  @buckets 27
  @per_function length(@outcomes) + @buckets

  @counters {__MODULE__, :counters}
  @telemetry {__MODULE__, :telemetry}

  # The counters and each function's place in them, made once per VM (status/0
  # counts since it started) by the first start whose pool or sandbox mode loaded
  # the NIF. A VM that loads modules on first use and names no database loads
  # Native only at the first call, which then raises :not_started uncounted.
  def setup do
    :persistent_term.put(@telemetry, Code.ensure_loaded?(:telemetry))

    with nil <- :persistent_term.get(@counters, nil),
         true <- :code.is_loaded(Native) != false and Native.loaded() do
      index = Map.new(Enum.with_index(Native.functions()))
      counters = :counters.new(map_size(index) * @per_function, [:write_concurrency])
      :persistent_term.put(@counters, {counters, index})
    end
  end

  # A span by :telemetry.span/3's convention: the :start metadata (the
  # function and its arguments as the caller passed them, and a
  # :telemetry_span_context) comes again in :stop with the :result, and in
  # :exception with the :kind, :reason and :stacktrace of what was raised.
  def start(function, start, metadata) do
    metadata = Map.put(metadata, :telemetry_span_context, make_ref())

    if telemetry?() do
      monotonic = System.convert_time_unit(start, :nanosecond, :native)
      measurements = %{monotonic_time: monotonic, system_time: System.system_time()}
      emit([function, :start], measurements, metadata)
    end

    {function, start, metadata}
  end

  def stop({function, start, metadata}, result) do
    duration = count(function, start, outcome(result))

    if telemetry?(),
      do: emit([function, :stop], measures(duration), Map.put(metadata, :result, result))
  end

  def exception({function, start, metadata}, kind, reason, stacktrace) do
    outcome =
      case reason do
        %{__exception__: true, reason: outcome} when outcome in @outcomes -> outcome
        _other -> :other
      end

    duration = count(function, start, outcome)

    if telemetry?() do
      metadata = Map.merge(metadata, %{kind: kind, reason: reason, stacktrace: stacktrace})
      emit([function, :exception], measures(duration), metadata)
    end
  end

  def event(event, measurements, metadata),
    do: if(telemetry?(), do: emit(event, measurements, metadata))

  defp telemetry?, do: :persistent_term.get(@telemetry, false)

  defp measures(duration), do: %{duration: duration, monotonic_time: System.monotonic_time()}

  # A handler that raises, or a :telemetry application that is not started,
  # must not fail the lock call.
  defp emit(event, measurements, metadata) do
    apply(:telemetry, :execute, [[:phoenix_kit_agent_locks | event], measurements, metadata])
  catch
    _, _ -> :ok
  end

  # What status/0 counts an answer as: a refusal by its reason, a boolean
  # by its value, anything else (:ok, a listing) as :ok.
  defp outcome({:error, reason}), do: reason
  defp outcome(answer) when is_boolean(answer), do: answer
  defp outcome(_answered), do: :ok

  # Counts the call; its duration, in native units.
  defp count(function, start, outcome) do
    duration = System.monotonic_time() - System.convert_time_unit(start, :nanosecond, :native)

    with {counters, %{^function => i}} <- :persistent_term.get(@counters, nil) do
      base = i * @per_function
      :counters.add(counters, base + Enum.find_index(@outcomes, &(&1 == outcome)) + 1, 1)
      us = System.convert_time_unit(duration, :native, :microsecond)
      bucket = min(bit_length(us), @buckets - 1)
      :counters.add(counters, base + length(@outcomes) + bucket + 1, 1)
    end

    duration
  end

  defp bit_length(0), do: 0
  defp bit_length(n), do: bit_length(Bitwise.bsr(n, 1)) + 1

  # The `:calls` and `:latency` of `Locks.status/0`, for the functions called so far.
  def counts do
    {counters, index} = :persistent_term.get(@counters, {nil, %{}})

    for {function, i} <- index,
        read = for(j <- 1..@per_function, do: :counters.get(counters, i * @per_function + j)),
        {outcomes, buckets} = Enum.split(read, length(@outcomes)),
        Enum.sum(outcomes) > 0,
        reduce: %{calls: %{}, latency: %{}} do
      %{calls: calls, latency: latency} ->
        counts = for {n, o} <- Enum.zip(outcomes, @outcomes), n > 0, into: %{}, do: {o, n}

        # A call being counted right now may have its outcome and not yet its
        # latency (write_concurrency counters are read without a snapshot).
        latency =
          if Enum.sum(buckets) > 0,
            do: Map.put(latency, function, latency(buckets)),
            else: latency

        %{calls: Map.put(calls, function, counts), latency: latency}
    end
  end

  # A quantile is the bound of the first bucket that reaches it; the maximum,
  # that of the last one used.
  defp latency(buckets) do
    total = Enum.sum(buckets)
    running = Enum.scan(buckets, &+/2)
    upper = fn q -> Bitwise.bsl(1, Enum.find_index(running, &(&1 >= q * total))) end
    %{calls: total, p50_us: upper.(0.5), p99_us: upper.(0.99), max_us: upper.(1)}
  end
end
