defmodule PhoenixKitAgent.Turns.BenchAlternateTest do
  # `mix locks.bench --alternate 5` in this project, which has no Postgrex:
  # the mode still runs (the library and pgbench, alternated) and its report
  # has the lines bench/README.md's table is read from. One point (the
  # cycle at one caller), 1 s a run: about 15 s. async: false, since the
  # bench restarts the global pool on its own schema (and the configured one
  # after it).
  use ExUnit.Case, async: false

  import ExUnit.CaptureIO

  @moduletag :slow
  @moduletag timeout: 180_000

  test "without Postgrex, --alternate runs the library and pgbench 5 times a point and reports medians and ranges" do
    refute Code.ensure_loaded?(Postgrex)

    out =
      Path.join(
        System.tmp_dir!(),
        "locks_bench_alternate_#{System.unique_integer([:positive])}.md"
      )

    on_exit(fn -> File.rm(out) end)

    args =
      ~w(--peer postgrex --alternate 5 --workloads cycle --cycle-callers 1 --duration 1 --warmup 100 --out) ++
        [out]

    log = capture_io(:stderr, fn -> capture_io(fn -> Mix.Tasks.Locks.Bench.run(args) end) end)

    # library, pgbench; library, pgbench; …
    assert Regex.scan(~r/cycle ×1: (library|pgbench)/, log, capture: :all_but_first) ==
             List.duplicate([["library"], ["pgbench"]], 5) |> Enum.concat()

    report = File.read!(out)

    assert report =~
             ~r/^server: PostgreSQL \d+\.\d+.* · fsync (on|off) · synchronous_commit \w+ · full_page_writes (on|off)$/m

    assert report =~
             ~r/^machine: #{System.schedulers_online()} schedulers online · #{:erlang.system_info(:logical_processors)} logical processors · .* · load average \(1 min\) \d+\.\d+ before the run, \d+\.\d+ after$/m

    assert report =~ ~r/ · commit [0-9a-f]{10}(-dirty)? · 5 runs a point, 1 s each, /
    assert report =~ "Postgrex: absent (not loaded in this VM;"
    assert report =~ "No ratios: Postgrex is absent."

    assert report =~
             "| workload | callers | op | side | runs | ops/s median | ops/s range | VM CPU µs/statement median | VM CPU µs/statement range |\n"

    assert [[lib_median, lib_low, lib_high, cpu_median]] =
             Regex.scan(
               ~r/^\| cycle \| 1 \| acquire \+ release \| library \| 5 \| ([\d,]+) \| ([\d,]+)–([\d,]+) \| (\d+\.\d) \| \d+\.\d–\d+\.\d \|$/m,
               report,
               capture: :all_but_first
             )

    [lib_median, lib_low, lib_high] = Enum.map([lib_median, lib_low, lib_high], &number/1)
    assert lib_low <= lib_median and lib_median <= lib_high and lib_low > 0
    assert String.to_float(cpu_median) > 0

    # pgbench is another process: no VM CPU.
    assert report =~
             ~r/^\| cycle \| 1 \| acquire \+ release \| pgbench \| 5 \| [\d,]+ \| [\d,]+–[\d,]+ \| – \| – \|$/m

    refute report =~ "BEGIN … COMMIT"
  end

  # `--busy 1 --floor` on the held workload at 2 callers, 1 s a run: the
  # load alone, then the library, pgbench and the floor, 5 times; about 30 s
  # once the floor is built (a release build of the example the first time).
  @tag timeout: 600_000
  test "--busy and --floor add a baseline, the floor and the Busy VM section" do
    out =
      Path.join(System.tmp_dir!(), "locks_bench_busy_#{System.unique_integer([:positive])}.md")

    on_exit(fn -> File.rm(out) end)

    args =
      ~w(--alternate 5 --busy 1 --floor --workloads held --read-callers 2 --duration 1 --warmup 100 --out) ++
        [out]

    log = capture_io(:stderr, fn -> capture_io(fn -> Mix.Tasks.Locks.Bench.run(args) end) end)

    assert Regex.scan(~r/held ×2: (the load alone|library|pgbench|floor)$/m, log,
             capture: :all_but_first
           ) ==
             List.duplicate([["the load alone"], ["library"], ["pgbench"], ["floor"]], 5)
             |> Enum.concat()

    report = File.read!(out)

    assert report =~
             "each time in this order: the load alone, library, pgbench, floor;"

    # The floor's CPU is its own process's.
    assert report =~
             ~r/^\| held \| 2 \| held\? \| floor \| 5 \| [\d,]+ \| [\d,]+–[\d,]+ \| \d+\.\d \| \d+\.\d–\d+\.\d \|$/m

    assert report =~ "## Busy VM (`--busy 1`)"

    assert report =~
             ~r/^\| held \| 2 \| the load alone \| – \| [\d,]+ \([\d,]+–[\d,]+\) \| – \| one unit: \d+\.\d\d µs \(\d+\.\d\d–\d+\.\d\d\) of one load process \|$/m

    for side <- ~w(library pgbench floor) do
      assert report =~
               ~r/^\| held \| 2 \| #{side} \| [\d,]+ \([\d,]+–[\d,]+\) \| [\d,]+ \([\d,]+–[\d,]+\) \| -?\d+\.\d \(-?\d+\.\d–-?\d+\.\d\) \| \|$/m
    end
  end

  test "--busy and --floor run in --alternate mode only, --busy with at least 1 process" do
    for {args, message} <- [
          {~w(--busy 2), "locks.bench: --busy runs in --alternate mode only"},
          {~w(--floor), "locks.bench: --floor runs in --alternate mode only"},
          {~w(--alternate 5 --busy 0), "locks.bench: --busy takes at least 1 load process, got 0"}
        ] do
      error =
        assert_raise Mix.Error, fn ->
          Mix.Tasks.Locks.Bench.run(args ++ ~w(--out /nonexistent/never.md))
        end

      assert error.message == message
    end
  end

  test "--alternate takes at least 5 runs a point" do
    error =
      assert_raise Mix.Error, fn ->
        Mix.Tasks.Locks.Bench.run(~w(--alternate 3 --out /nonexistent/never.md))
      end

    assert error.message == "locks.bench: --alternate takes at least 5 runs a point, got 3"
  end

  defp number(text), do: text |> String.replace(",", "") |> String.to_integer()
end
