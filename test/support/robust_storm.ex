defmodule PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Storm do
  @moduledoc false
  # Storms on the queue (native/locks_core/src/queue.rs), run in a child node
  # (Robust.Node) so its pool can be small and its application stopped.
  #
  # `run/1`: callers, each on a chat and a user of its own, take both locks
  # and release them, while a killer kills callers at random (some right as
  # their `:go` or their answer from the line arrives, seen by tracing their
  # receives) and the application
  # is stopped and started again at random. Every caller that survives
  # reports its outcome, then waits until the storm has settled and reports
  # what is left in its mailbox.
  #
  # `killed_in_run/1`: long-lived callers loop on held?/3 (a 1 ms checkout:
  # slots are often handed at a waiter's deadline) while a killer kills every
  # caller it finds inside run/3 and starts another: the end of each such
  # call hands the slot on from a dead process (its go sent by the NIF's own
  # thread, call.rs's `later/1`), and runs nothing from the line.
  # Counts each outcome and every message a caller finds after a call.
  #
  # `stale/1`: callers whose checkout deadline has already passed when they
  # ask for a slot (a stamp older than the checkout timeout), while two other
  # callers keep both slots busy; what each finds in its mailbox after each
  # call.

  alias PhoenixKitAgent.Turns.Locks

  @app :phoenix_kit_agent_locks

  def run(opts) do
    calls = Keyword.fetch!(opts, :calls)
    kills = Keyword.get(opts, :kills, 0)
    kill_on_answer = Keyword.get(opts, :kill_on_answer, 0.0)
    cycles = Keyword.get(opts, :cycles, 0)
    spread_ms = Keyword.get(opts, :spread_ms, 2_000)
    me = self()

    tracer = spawn(fn -> tracer(kill_on_answer) end)

    callers =
      for {{chat, user, ref}, i} <- Enum.with_index(calls) do
        pid = spawn(fn -> caller(me, i, chat, user, ref) end)
        Process.monitor(pid)
        # Every caller is watched for its :go and its answer (a :go is rare:
        # with every third watched, a run saw as few as none).
        :erlang.trace(pid, true, [:receive, {:tracer, tracer}])
        {i, pid}
      end

    pids = Map.new(callers)
    started = System.monotonic_time(:millisecond)
    for {_, pid} <- callers, do: send(pid, {:start, :rand.uniform(spread_ms)})

    killer = spawn(fn -> killer(Map.values(pids), kills, spread_ms) end)
    cycler = spawn(fn -> cycler(me, cycles, spread_ms) end)

    index = Map.new(callers, fn {i, pid} -> {pid, i} end)
    results = collect(map_size(pids), %{}, index)
    storm_ms = System.monotonic_time(:millisecond) - started
    Process.exit(killer, :kill)
    send(tracer, {:stop, self()})
    arrival_kills = receive(do: ({:kills, n} -> n), after: (10_000 -> :tracer_stuck))
    cycler_done = receive(do: ({:cycled, n} -> n), after: (10_000 -> :cycler_stuck))
    _ = cycler
    # The application runs again (the cycler leaves it started).
    {:ok, _} = Application.ensure_all_started(@app)

    pool = until_idle(5_000)
    Process.sleep(300)

    survivors = for {i, {:done, _}} <- results, Process.alive?(pids[i]), do: i
    for i <- survivors, do: send(pids[i], :finish)
    mailboxes = collect_mailboxes(length(survivors), %{})

    %{
      results: results,
      mailboxes: mailboxes,
      pool: pool,
      storm_ms: storm_ms,
      cycles: cycler_done,
      arrival_kills: arrival_kills
    }
  end

  defp caller(parent, i, chat, user, ref) do
    receive do
      {:start, delay} -> Process.sleep(delay)
    end

    acquire = attempt(fn -> Locks.acquire(chat, user, ref, 60) end)
    release = if acquire == {:ok, :ok}, do: attempt(fn -> Locks.release(chat, user, ref) end)
    {:messages, right_after} = Process.info(self(), :messages)
    send(parent, {:done, i, {acquire, release, right_after}})

    receive do
      :finish ->
        {:messages, left} = Process.info(self(), :messages)
        send(parent, {:mailbox, i, left})
    end
  end

  defp attempt(fun) do
    {:ok, fun.()}
  rescue
    e -> {:raised, Map.get(e, :reason, e)}
  catch
    kind, reason -> {:raised, {kind, reason}}
  end

  defp collect(0, results, _), do: results

  defp collect(n, results, index) do
    receive do
      {:done, i, outcome} ->
        collect(n - 1, Map.put(results, i, {:done, outcome}), index)

      {:DOWN, _, :process, pid, reason} ->
        i = index[pid]

        case results do
          # Killed after it reported: it has no mailbox to show.
          %{^i => {:done, outcome}} -> collect(n, Map.put(results, i, {:late, outcome}), index)
          _ -> collect(n - 1, Map.put(results, i, {:killed, reason}), index)
        end
    after
      60_000 -> Map.put(results, :stuck, n)
    end
  end

  defp collect_mailboxes(0, acc), do: acc

  defp collect_mailboxes(n, acc) do
    receive do
      {:mailbox, i, left} -> collect_mailboxes(n - 1, Map.put(acc, i, left))
    after
      10_000 -> Map.put(acc, :stuck, n)
    end
  end

  defp until_idle(ms) do
    deadline = System.monotonic_time(:millisecond) + ms

    Stream.repeatedly(fn ->
      pool = Locks.status().pool
      if pool.running == 0 and pool.waiting == 0, do: pool, else: Process.sleep(10) && nil
    end)
    |> Enum.find(fn pool ->
      pool != nil or System.monotonic_time(:millisecond) > deadline
    end)
    |> Kernel.||(Locks.status().pool)
  end

  defp killer(pids, kills, spread_ms) do
    pause = max(div(spread_ms, max(kills, 1)), 1)

    for _ <- 1..kills//1 do
      Process.sleep(:rand.uniform(pause))
      Process.exit(Enum.random(pids), :kill)
    end
  end

  defp tracer(p), do: tracer_loop(p, %{go: 0, answer: 0})

  # Kills a traced caller as its :go arrives (the rarer: most waiters get
  # their answer from the line), or, with probability `p`, as that answer
  # arrives; counts the kills of each.
  defp tracer_loop(p, kills) do
    receive do
      {:trace, pid, :receive, {:phoenix_kit_agent_locks, message}} ->
        kind = if message == :go, do: :go, else: :answer

        if kind == :go or :rand.uniform() < p,
          do: Process.exit(pid, :kill) && tracer_loop(p, Map.update!(kills, kind, &(&1 + 1))),
          else: tracer_loop(p, kills)

      {:trace, _, _, _} ->
        tracer_loop(p, kills)

      {:stop, from} ->
        send(from, {:kills, kills})
    end
  end

  defp cycler(parent, cycles, spread_ms) do
    done =
      Enum.count(1..cycles//1, fn _ ->
        Process.sleep(:rand.uniform(max(div(spread_ms, max(cycles, 1)), 1)))
        :ok = Application.stop(@app)
        Process.sleep(:rand.uniform(30))
        {:ok, _} = Application.ensure_all_started(@app)
      end)

    send(parent, {:cycled, done})
  end

  ## Killed inside run/3

  def killed_in_run(opts) do
    ms = Keyword.get(opts, :ms, 10_000)
    me = self()
    until = System.monotonic_time(:millisecond) + ms
    table = :ets.new(:callers, [:public, :set])
    for _ <- 1..Keyword.get(opts, :callers, 30), do: :ets.insert(table, {looper(me, until)})
    kills = kill_in_run(me, table, until, 0)
    Process.sleep(300)
    Map.merge(drain(%{}), %{kills: kills, pool: until_idle(5_000)})
  end

  defp looper(me, until), do: spawn(fn -> loop(me, until) end)

  defp kill_in_run(me, table, until, kills) do
    if System.monotonic_time(:millisecond) < until do
      kills =
        Enum.reduce(:ets.tab2list(table), kills, fn {pid}, kills ->
          case Process.info(pid, :current_function) do
            {:current_function, {_, :run, 3}} ->
              Process.exit(pid, :kill)
              :ets.delete(table, pid)
              :ets.insert(table, {looper(me, until)})
              kills + 1

            _ ->
              kills
          end
        end)

      kill_in_run(me, table, until, kills)
    else
      kills
    end
  end

  defp loop(me, until) do
    if System.monotonic_time(:millisecond) < until do
      outcome =
        case attempt(fn -> Locks.held?(uuid(), uuid(), "looper") end) do
          {:ok, _} -> :ok
          {:raised, reason} -> reason
        end

      send(me, {:outcome, outcome})
      {:messages, left} = Process.info(self(), :messages)
      for message <- left, do: receive(do: (_ -> send(me, {:outcome, {:stray, message}})))
      loop(me, until)
    end
  end

  defp drain(counts) do
    receive do
      {:outcome, outcome} -> drain(Map.update(counts, outcome, 1, &(&1 + 1)))
    after
      300 -> counts
    end
  end

  ## Stale stamps

  def stale(opts) do
    ms = Keyword.get(opts, :ms, 3_000)
    stale_callers = Keyword.get(opts, :callers, 20)
    me = self()
    until = System.monotonic_time(:millisecond) + ms

    busy =
      for _ <- 1..2 do
        spawn(fn -> busy(until) && send(me, :busy_done) end)
      end

    for _ <- 1..stale_callers, do: spawn(fn -> send(me, {:stale, stale_loop(until, %{})}) end)

    counts =
      Enum.reduce(1..stale_callers, %{}, fn _, acc ->
        receive do
          {:stale, c} -> Map.merge(acc, c, fn _, a, b -> a + b end)
        end
      end)

    for _ <- busy, do: receive(do: (:busy_done -> :ok))
    Map.put(counts, :pool, until_idle(5_000))
  end

  defp busy(until) do
    if System.monotonic_time(:millisecond) < until do
      attempt(fn -> Locks.held?(uuid(), uuid(), "busy") end)
      busy(until)
    else
      true
    end
  end

  defp stale_loop(until, counts) do
    if System.monotonic_time(:millisecond) < until do
      # A stamp older than any checkout timeout: run/3 finds the deadline gone.
      start = System.monotonic_time(:nanosecond) - 3_600_000_000_000
      args = [<<:rand.uniform(1_000_000_000_000)::128>>, <<1::128>>, "stale"]

      outcome =
        case attempt(fn -> Locks.call(:held?, start, args) end) do
          {:ok, _} -> :ran
          {:raised, reason} -> reason
        end

      {:messages, left} = Process.info(self(), :messages)
      for _ <- left, do: receive(do: (_ -> :ok))
      counts = Map.update(counts, outcome, 1, &(&1 + 1))
      counts = Map.update(counts, :stray, length(left), &(&1 + length(left)))
      stale_loop(until, counts)
    else
      counts
    end
  end

  defp uuid, do: :crypto.strong_rand_bytes(16) |> Base.encode16(case: :lower) |> hyphenate()

  defp hyphenate(<<a::binary-8, b::binary-4, c::binary-4, d::binary-4, e::binary-12>>),
    do: Enum.join([a, b, c, d, e], "-")
end
