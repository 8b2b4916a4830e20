defmodule PhoenixKitAgent.Turns.Locks.Bench.Histogram do
  @moduledoc false
  # Latencies in whole microseconds, kept in `:counters` rather than a list:
  # concurrent callers add to it without locks, and nobody's heap grows while
  # it is being timed (a list of every latency would be collected by the
  # garbage collector, and that would show up as latency).
  #
  # Buckets: exact below 1 ms, 10 µs wide to 100 ms, 1 ms wide to 10 s, then
  # one overflow bucket. A percentile is the lowest latency of its bucket.

  @buckets 1_000 + 9_900 + 9_900 + 1

  @type t :: :counters.counters_ref()

  @typedoc "Percentiles in µs; `max` is the one the caller measured (exact)."
  @type stats :: %{
          n: non_neg_integer(),
          p50: non_neg_integer() | nil,
          p99: non_neg_integer() | nil,
          max: non_neg_integer() | nil
        }

  @spec new() :: t()
  def new, do: :counters.new(@buckets, [:write_concurrency])

  @doc "Counts one latency of `us` microseconds."
  @spec add(t(), non_neg_integer()) :: :ok
  def add(hist, us), do: :counters.add(hist, bucket(us) + 1, 1)

  defp bucket(us) when us < 1_000, do: us
  defp bucket(us) when us < 100_000, do: 1_000 + div(us - 1_000, 10)
  defp bucket(us) when us < 10_000_000, do: 10_900 + div(us - 100_000, 1_000)
  defp bucket(_us), do: @buckets - 1

  defp bucket_us(i) when i < 1_000, do: i
  defp bucket_us(i) when i < 10_900, do: 1_000 + (i - 1_000) * 10
  defp bucket_us(i), do: 100_000 + (i - 10_900) * 1_000

  @doc "p50 and p99 of what was added; `slowest` is reported as `max`."
  @spec stats(t(), non_neg_integer() | nil) :: stats()
  def stats(hist, slowest) do
    counts = for i <- 1..@buckets, do: :counters.get(hist, i)
    n = Enum.sum(counts)

    if n == 0 do
      %{n: 0, p50: nil, p99: nil, max: nil}
    else
      at = fn p -> rank_us(counts, max(1, ceil(p * n))) end
      %{n: n, p50: at.(0.5), p99: at.(0.99), max: slowest}
    end
  end

  defp rank_us(counts, rank) do
    Enum.reduce_while(counts, {0, 0}, fn c, {i, seen} ->
      if seen + c >= rank, do: {:halt, {:found, i}}, else: {:cont, {i + 1, seen + c}}
    end)
    |> case do
      {:found, i} -> bucket_us(i)
      _ -> nil
    end
  end
end
