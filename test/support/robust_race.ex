defmodule PhoenixKitAgent.Turns.Locks.Robust.Race do
  @moduledoc false
  # Many processes calling PhoenixKitAgent.Turns.Locks at the same instant.
  #
  # Every call gets a process of its own, which waits for `:go` before it
  # calls: the processes are all spawned (and the NIF module loaded) before
  # the first call, so the calls really overlap instead of trickling in as
  # they are spawned. Each answer is `{:ok, value}` or `{:raised, exception}`
  # (an exit or throw becomes `{:raised, {kind, reason}}`): a test asserts on
  # the whole list, and any raise (a serialization failure, a deadlock, a
  # panic) shows up as a value instead of a crash.
  #
  # `prepare/2` + `fire/2` split the same thing in two, so that a test can
  # make several nodes (Robust.Node) ready first and then fire them together.

  alias PhoenixKitAgent.Turns.Locks

  @doc "Runs `calls` (`{function, args}` of Locks) at once; answers in the same order."
  def run(calls, timeout \\ 60_000) do
    coordinator = start_coordinator(calls)
    fire_coordinator(coordinator, timeout)
  end

  @doc "Spawns the callers of `calls` under the registered `name`, waiting for `fire/2`."
  def prepare(name, calls) do
    coordinator = start_coordinator(calls)
    true = Process.register(coordinator, name)
    :ready
  end

  @doc "Lets the callers prepared under `name` go; their answers, in order."
  def fire(name, timeout \\ 60_000), do: fire_coordinator(Process.whereis(name), timeout)

  @doc "One call of Locks, its value or what it raised."
  def attempt(fun, args), do: attempt_in(Locks, fun, args)

  @doc "One call of `module` (e.g. the NIF module), its value or what it raised."
  def attempt_in(module, fun, args) do
    {:ok, apply(module, fun, args)}
  rescue
    e -> {:raised, e}
  catch
    kind, reason -> {:raised, {kind, reason}}
  end

  defp start_coordinator(calls) do
    ready = self()

    coordinator =
      spawn(fn ->
        me = self()

        callers =
          for {{fun, args}, i} <- Enum.with_index(calls) do
            spawn(fn ->
              receive do
                :go -> send(me, {:answer, i, attempt(fun, args)})
              end
            end)
          end

        send(ready, {:prepared, me})

        receive do
          {:go, reply_to} ->
            Enum.each(callers, &send(&1, :go))

            answers =
              for _ <- callers, into: %{} do
                receive do
                  {:answer, i, answer} -> {i, answer}
                end
              end

            send(reply_to, {:answers, me, Enum.map(0..(length(callers) - 1)//1, &answers[&1])})
        end
      end)

    receive do
      {:prepared, ^coordinator} -> coordinator
    end
  end

  defp fire_coordinator(coordinator, timeout) do
    send(coordinator, {:go, self()})

    receive do
      {:answers, ^coordinator, answers} -> answers
    after
      timeout -> raise "race: no answers within #{timeout} ms"
    end
  end
end
