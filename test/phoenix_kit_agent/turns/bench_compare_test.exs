defmodule PhoenixKitAgent.Turns.BenchCompareTest do
  # The parts of `mix locks.compare` a wrong figure would come from: an arm
  # (bench/compare_arm.exs in a VM of a checkout, here this one) runs a
  # point from its callers' rows and frees them; the ratios pair the runs of
  # one round; the interval is the same for the same runs. The whole task
  # builds two worktrees (minutes of cargo), so it is run by hand, not here.
  # async: false, since prepare/2 restarts the global pool.
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks.{Bench, TestDB}
  alias PhoenixKitAgent.Turns.Locks.Bench.Compare

  @moduletag :slow
  @moduletag timeout: 180_000

  test "the ratios pair the runs of each round, whatever order they ran in" do
    runs = [
      %{round: 2, arm: :head, cpu: 3.0},
      %{round: 1, arm: :base, cpu: 1.0},
      %{round: 1, arm: :head, cpu: 2.0},
      %{round: 2, arm: :base, cpu: 6.0},
      %{round: 1, arm: :base2, cpu: 4.0},
      %{round: 2, arm: :base2, cpu: 3.0}
    ]

    assert Compare.ratios(runs, :head, :base, :cpu) == [2.0, 0.5]
    assert Compare.ratios(runs, :base2, :base, :cpu) == [4.0, 0.5]
    assert Compare.ratios(runs, :head, :base2, :cpu) == [0.5, 1.0]
  end

  test "a ratio is reported as median (range) [the median's 90 % interval], the same for the same runs" do
    assert Compare.interval([1.0, 1.0, 1.0]) == "1.00 (1.00–1.00) [1.00–1.00]"

    ratios = [0.9, 1.0, 1.1, 1.2, 0.8, 1.05, 0.95]
    text = Compare.interval(ratios)
    assert text == Compare.interval(Enum.reverse(ratios))
    assert [_, lo, hi] = Regex.run(~r/^1\.00 \(0\.80–1\.20\) \[(\d\.\d\d)–(\d\.\d\d)\]$/, text)
    assert String.to_float(lo) < 1.0 and String.to_float(hi) > 1.0
  end

  test "an arm runs a point from its callers' rows, frees them, and refuses what it does not know" do
    {:ok, config} = Compare.config(2)
    callers = Compare.prepare(config, 2)
    port = Compare.start_arm(File.cwd!(), config, "test")

    try do
      for workload <- ~w(cycle reads) do
        figures = Compare.measure(port, {workload, 2}, callers, warmup: 100, duration: 1)
        assert figures.ops_s > 0
        assert figures.cpu > 0
        # In ticks: as µs per op, the sum of the parts may round past the whole.
        assert figures.ticks.dirty_io + figures.ticks.schedulers <= figures.ticks.cpu
      end

      chats = Enum.map_join(callers, ",", &"'#{&1 |> String.split(",") |> hd()}'")

      assert TestDB.value!(
               "SELECT count(*) FROM #{Bench.schema()}.phoenix_kit_agent_conversations " <>
                 "WHERE uuid IN (#{chats}) AND busy_turn_ref IS NULL"
             ) == "2"

      assert {:compare_failed, "an arm failed: " <> why} =
               catch_throw(Compare.measure(port, {"nope", 1}, callers, warmup: 1, duration: 1))

      assert why =~ "CompareArm.op/1"
    after
      Compare.close(port)
    end
  end
end
