# One arm of `mix locks.compare`: a VM of one checkout, run there as
# `mix run --no-compile --no-start <this file>`, driven line by line through
# its standard input. It uses only the public lock calls, as every commit
# since the first has them, so the one script measures any two commits.
#
# The environment names the pool: LOCKS_COMPARE_PREFIX (the schema) and
# LOCKS_COMPARE_POOL_SIZE; the database is the checkout's configuration
# (DATABASE_URL in this repository). Each command is one line:
#
#     run <cycle|reads> <warm-up ms> <duration ms> <chat>,<user> <chat>,<user> …
#
# one caller a pair of uuids. The answer is one line,
#
#     compare: ops=<ops> us=<timed µs> cpu=<ticks> dirty_io=<ticks> schedulers=<ticks>
#
# the VM's CPU as every BEAM thread's utime + stime over the timed part
# (/proc/self/task/*/stat, clock ticks), split by the threads' names; or
# `compare: error <why>`. The arm ends at the end of its input.

alias PhoenixKitAgent.Turns.Locks

app = :phoenix_kit_agent_locks
Application.put_env(app, :prefix, System.fetch_env!("LOCKS_COMPARE_PREFIX"))
Application.put_env(app, :pool_size, String.to_integer(System.fetch_env!("LOCKS_COMPARE_POOL_SIZE")))
{:ok, _} = Application.ensure_all_started(app)

defmodule CompareArm do
  @ref "compare"
  @ttl 120

  def serve do
    case IO.gets("") do
      :eof ->
        :ok

      {:error, _} ->
        :ok

      line ->
        IO.puts("compare: " <> answer(String.split(line)))
        serve()
    end
  end

  defp answer(["run", workload, warmup, duration | pairs]) do
    callers = Enum.map(pairs, &(&1 |> String.split(",") |> List.to_tuple()))
    run(workload, callers, String.to_integer(warmup) * 1000)
    before = ticks()
    t0 = System.monotonic_time(:microsecond)
    ops = run(workload, callers, String.to_integer(duration) * 1000)
    us = System.monotonic_time(:microsecond) - t0
    after_ = ticks()
    cpu = Map.new(after_, fn {class, t} -> {class, t - Map.get(before, class, 0)} end)

    "ops=#{ops} us=#{us} cpu=#{cpu |> Map.values() |> Enum.sum()} " <>
      "dirty_io=#{Map.get(cpu, :dirty_io, 0)} schedulers=#{Map.get(cpu, :schedulers, 0)}"
  rescue
    e -> "error " <> (e |> Exception.message() |> String.replace("\n", " "))
  end

  defp answer(words), do: "error unknown command #{inspect(Enum.join(words, " "))}"

  # An op is two calls, on the caller's own chat and user.
  defp op("cycle") do
    fn chat, user ->
      :ok = Locks.acquire(chat, user, @ref, @ttl)
      :ok = Locks.release(chat, user, @ref)
    end
  end

  defp op("reads") do
    fn chat, user ->
      true = Locks.held?(chat, user, @ref)
      true = Locks.fresh?(chat, @ref, @ttl)
    end
  end

  # Every caller from the same instant for `us`; the ops done. Readers hold
  # their locks while they run, and every caller ends having released.
  defp run(workload, callers, us) do
    {op, reader} = {op(workload), workload == "reads"}
    parent = self()
    go = make_ref()

    tasks =
      for {chat, user} <- callers do
        Task.async(fn ->
          if reader, do: :ok = Locks.acquire(chat, user, @ref, @ttl)
          send(parent, {:ready, go})

          until =
            receive do
              {^go, until} -> until
            end

          n = loop(op, chat, user, until, 0)
          if reader, do: :ok = Locks.release(chat, user, @ref)
          n
        end)
      end

    for _ <- tasks, do: receive(do: ({:ready, ^go} -> :ok))
    until = System.monotonic_time(:microsecond) + us
    for task <- tasks, do: send(task.pid, {go, until})
    tasks |> Task.await_many(:infinity) |> Enum.sum()
  end

  defp loop(op, chat, user, until, n) do
    if System.monotonic_time(:microsecond) < until do
      op.(chat, user)
      loop(op, chat, user, until, n + 1)
    else
      n
    end
  end

  # Ticks by thread class: dirty-I/O schedulers, normal schedulers, others.
  defp ticks do
    for task <- File.ls!("/proc/self/task"),
        {:ok, stat} <- [File.read("/proc/self/task/#{task}/stat")],
        reduce: %{} do
      acc ->
        [name, rest] = stat |> String.split("(", parts: 2) |> List.last() |> split_name()
        fields = String.split(rest)
        t = String.to_integer(Enum.at(fields, 11)) + String.to_integer(Enum.at(fields, 12))
        Map.update(acc, class(name), t, &(&1 + t))
    end
  end

  defp split_name(text) do
    [rest | name] = text |> String.split(")") |> Enum.reverse()
    [name |> Enum.reverse() |> Enum.join(")"), rest]
  end

  defp class(name) do
    cond do
      name =~ "dirty_io" -> :dirty_io
      name =~ ~r/^\d+_scheduler$/ -> :schedulers
      true -> :other
    end
  end
end

IO.puts("compare: ready")
CompareArm.serve()
