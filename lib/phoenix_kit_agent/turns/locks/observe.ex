defmodule PhoenixKitAgent.Turns.Locks.Observe do
  @moduledoc false
  # Each lock call, counted for Locks.status/0 (lock-free :counters) and, when
  # the host has :telemetry, a span of events (guides/operating.md, "Observability").
  # The functions counted are the native side's lock functions (Native.functions/0).

  alias PhoenixKitAgent.Turns.Locks.{Error, Native}

  @outcomes ~w(ok true false conversation_busy turn_in_flight click_in_flight)a ++
              Error.reasons() ++ [:other]
  # A function's counters: one per outcome, then 27 latency buckets, where
  # bucket i holds the calls that took less than 2^i µs (the last: the rest).
  @slot Map.new(Enum.with_index(@outcomes, 1))
  @buckets 27
  @size length(@outcomes) + @buckets

  # Keyed by the layout: a recompile that changes it makes new counters
  # (at the next start) rather than misreading the VM's old ones. The layout
  # as a hash made at compile time: every call looks the key up, and a term
  # key is hashed at each lookup.
  @counters {__MODULE__, :counters, :erlang.phash2(@outcomes)}
  @telemetry {__MODULE__, :telemetry}

  # Each function's counters, made once per VM (status/0 counts since it
  # started) by the first start whose pool or sandbox mode loaded the NIF. A
  # VM that loads modules on first use and names no database loads Native
  # only at the first call, which then raises :not_started uncounted.
  def setup do
    :persistent_term.put(@telemetry, Code.ensure_loaded?(:telemetry))

    with nil <- :persistent_term.get(@counters, nil),
         true <- :code.is_loaded(Native) != false and Native.loaded() do
      counters = Map.new(Native.functions(), &{&1, :counters.new(@size, [:write_concurrency])})
      :persistent_term.put(@counters, counters)
    end
  end

  # A span by :telemetry.span/3's convention: the :start metadata (the
  # function and its arguments as the caller passed them, and a
  # :telemetry_span_context) comes again in :stop with the :result, and in
  # :exception with the :kind, :reason and :stacktrace of what was raised.
  def start(function, start, metadata) do
    if telemetry?() do
      metadata = Map.put(metadata, :telemetry_span_context, make_ref())
      monotonic = System.convert_time_unit(start, :nanosecond, :native)
      measurements = %{monotonic_time: monotonic, system_time: System.system_time()}
      emit([function, :start], measurements, metadata)
      {function, start, metadata}
    else
      {function, start, metadata}
    end
  end

  def stop(span, result), do: finish(span, outcome(result), :stop, %{result: result})

  def exception(span, kind, reason, stacktrace) do
    finish(span, raised(reason), :exception, %{kind: kind, reason: reason, stacktrace: stacktrace})
  end

  # Counts the call by its outcome and its duration, and ends its span.
  defp finish({function, start, metadata}, outcome, event, more) do
    duration = System.monotonic_time() - System.convert_time_unit(start, :nanosecond, :native)

    with %{^function => counters} <- :persistent_term.get(@counters, nil) do
      us = System.convert_time_unit(duration, :native, :microsecond)
      :counters.add(counters, @slot[outcome], 1)
      :counters.add(counters, length(@outcomes) + min(bit_length(us), @buckets - 1) + 1, 1)
    end

    if telemetry?() do
      measurements = %{duration: duration, monotonic_time: System.monotonic_time()}
      emit([function, event], measurements, Map.merge(metadata, more))
    end
  end

  def event(event, measurements, metadata),
    do: if(telemetry?(), do: emit(event, measurements, metadata))

  defp telemetry?, do: :persistent_term.get(@telemetry, false)

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

  defp raised(%{__exception__: true, reason: reason}) when reason in @outcomes, do: reason
  defp raised(_reason), do: :other

  defp bit_length(0), do: 0
  defp bit_length(n), do: bit_length(Bitwise.bsr(n, 1)) + 1

  # The `:calls` and `:latency` of `Locks.status/0`, for the functions called so far.
  def counts do
    counted =
      for {function, counters} <- :persistent_term.get(@counters, %{}),
          {outcomes, buckets} = Enum.split(read(counters), length(@outcomes)),
          calls = for({n, o} <- Enum.zip(outcomes, @outcomes), n > 0, into: %{}, do: {o, n}),
          calls != %{},
          do: {function, calls, latency(buckets)}

    %{
      calls: Map.new(counted, fn {function, calls, _latency} -> {function, calls} end),
      latency: for({function, _, %{} = latency} <- counted, into: %{}, do: {function, latency})
    }
  end

  defp read(counters), do: for(i <- 1..@size, do: :counters.get(counters, i))

  # A quantile is the bound of the first bucket that reaches it; the maximum,
  # that of the last one used. None while no call has its latency counted: a
  # call being counted right now may have its outcome and not yet its latency
  # (write_concurrency counters are read without a snapshot).
  defp latency(buckets) do
    total = Enum.sum(buckets)
    running = Enum.scan(buckets, &+/2)
    upper = fn q -> Bitwise.bsl(1, Enum.find_index(running, &(&1 >= q * total))) end

    if total > 0,
      do: %{calls: total, p50_us: upper.(0.5), p99_us: upper.(0.99), max_us: upper.(1)}
  end
end
