defmodule LocksBenchTest do
  # The bench's own checks: its options, its arithmetic, the pgbench script
  # it writes, and short runs whose report has what README.md says it has.
  # async: false: a run restarts the library's global pool.
  use ExUnit.Case, async: false

  import ExUnit.CaptureIO

  alias LocksBench.{Psql, Stats, Workload}
  alias Mix.Tasks.Locks.Bench, as: Task
  alias PhoenixKitAgent.Turns.Locks.Config

  @moduletag timeout: 300_000

  test "the options' defaults, and what is refused" do
    opts = Task.options([])
    assert opts[:rounds] == 5 and opts[:workloads] == ~w(cycle reads)
    assert opts[:callers] == [1, 10, 50] and opts[:duration] == 3 and opts[:peer] == false

    for {args, message} <- [
          {[workloads: "cycle,nope"], "unknown workloads nope; known: cycle,reads,held"},
          {[callers: "10,51"], "--callers takes numbers from 1 to 50, got 51"},
          {[rounds: 0], "--rounds must be a positive integer"},
          {[peer: "mysql"], "--peer: unknown peer mysql; known: postgrex"},
          {[pool_size: 0], "invalid configuration: --pool-size: must be an integer from 1"}
        ] do
      error = assert_raise Mix.Error, fn -> Task.options(args) end
      assert error.message =~ "locks.bench: " <> message
    end

    unless LocksBench.Peer.loaded?() do
      error = assert_raise Mix.Error, fn -> Task.options(peer: "postgrex") end
      assert error.message =~ "Postgrex is not in this build"
      assert error.message =~ "LOCKS_BENCH_PEERS"
    end
  end

  test "medians, ranges and ratios" do
    assert Stats.median([3, 1, 2]) == 2
    assert Stats.median([4, 1, 3, 2]) == 2.5
    assert Stats.median([nil]) == nil
    assert Stats.summary([1200.4, 900, 1500], 0) == "1,200 (900–1,500)"
    assert Stats.summary([0.5, nil, 1.25], 2) == "0.88 (0.50–1.25)"
    assert Stats.summary([nil], 1) == "–"
    assert Stats.ratio(1, 4) == 0.25 and Stats.ratio(1, 0) == nil and Stats.ratio(nil, 1) == nil
    assert Stats.per_statement_us(10, 1000, 100) == 100.0
    assert is_integer(Stats.ticks()) and Stats.ticks() > 0
  end

  test "caller k's rows are the ones pgbench's client k computes, its statements bound to variables" do
    {:ok, config} = Config.read()
    [[uuid]] = Psql.query!(config, ["SELECT md5('bench/cycle/chat/' || 7)::uuid"])
    assert Workload.row("cycle", 7)["chat"] == uuid

    texts = %{"acquire" => "SELECT f($1, $2, $3, $4, $5)", "release" => "SELECT g($1, $3, $2)"}
    script = Workload.script("cycle", texts)
    assert script =~ "SELECT f(:chat, :usr, :ref, :ttl, :ttl);\nSELECT g(:chat, :ref, :usr);\n"
    assert script =~ ~r/\\if :inited = 0\n.*\\gset\n\\set inited 1\n\\endif\n/s
  end

  test "a short run alternates the library and pgbench, round by round, and reports medians and ranges" do
    {report, log} =
      bench(~w(--rounds 2 --workloads cycle,held --callers 1,2 --duration 1 --warmup 100))

    assert Regex.scan(~r/round (\d)\/2: (\w+) ×(\d): (\w+)/, log, capture: :all_but_first) ==
             for(
               r <- ~w(1 2),
               w <- ~w(cycle held),
               n <- ~w(1 2),
               side <- ~w(library pgbench),
               do: [r, w, n, side]
             )

    assert report =~
             "    mix locks.bench --rounds 2 --workloads cycle,held --callers 1,2 --duration 1 --warmup 100 --out "

    assert report =~
             ~r/^\* \*\*server\*\*: PostgreSQL \d+.*; fsync (on|off), synchronous_commit \w+, full_page_writes (on|off): (durable|not durable)/m

    assert report =~
             ~r/^\* \*\*machine\*\*: #{:erlang.system_info(:logical_processors)} logical processors, #{System.schedulers_online()} schedulers online, .* CPU busy \d+ % in the second before the run, \d+ % over it /m

    assert report =~ "Postgrex not run"

    for w <- ["cycle \\| acquire/4 \\+ release/3", "held \\| held\\?/3"], n <- [1, 2] do
      assert report =~
               ~r/^\| #{w} \| #{n} \| library \| [\d,]+ \([\d,]+–[\d,]+\) \| [\d,]+ \([\d,]+–[\d,]+\) \|$/m

      assert report =~
               ~r/^\| #{w} \| #{n} \| pgbench \| [\d,]+ \([\d,]+–[\d,]+\) \| – \(not the VM\) \|$/m
    end

    assert report =~ ~r/^\| cycle \| 2 \| \d\.\d\d \(\d\.\d\d–\d\.\d\d\) \|$/m
  end

  @tag :peer
  test "with --peer postgrex, Postgrex runs between the library and pgbench, and the ratios pair them" do
    {report, log} =
      bench(
        ~w(--peer postgrex --rounds 1 --workloads reads --callers 2 --duration 1 --warmup 100)
      )

    assert Regex.scan(~r/reads ×2: (\w+)/, log, capture: :all_but_first) == [
             ~w(library),
             ~w(Postgrex),
             ~w(pgbench)
           ]

    assert report =~ ~r/Postgrex \d+\.\d+\.\d+ \(DBConnection \d+\.\d+\.\d+\), pool_size \d+/

    assert report =~
             ~r/^\| reads \| held\?\/3 \+ fresh\?\/3 \| 2 \| Postgrex \| [\d,]+ \| [\d,]+ \|$/m

    assert report =~ ~r/^\| reads \| 2 \| \d\.\d\d \| \d\.\d\d \| \d\.\d\d \|$/m
  end

  # The report and the progress log of `mix locks.bench args`.
  defp bench(args) do
    out = Path.join(System.tmp_dir!(), "locks_bench_#{System.unique_integer([:positive])}.md")
    on_exit(fn -> File.rm(out) end)
    log = capture_io(:stderr, fn -> capture_io(fn -> Task.run(args ++ ["--out", out]) end) end)
    {File.read!(out), log}
  end
end
