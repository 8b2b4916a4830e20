defmodule PhoenixKitAgent.Turns.Locks.Turn do
  @moduledoc """
  A turn run by `PhoenixKitAgent.Turns.Locks.with_turn/4`: its locks kept
  alive by a keeper process while it runs, on a short lease.

  Fields: `conversation_uuid`, `user_uuid`, `ref` (the turn's ref, made by
  the runner) and `ttl_s` (the lease). Ask `PhoenixKitAgent.Turns.Locks.lost?/1`
  whether the turn still holds its locks; the process that runs the turn is
  also sent `{:turn_lock_lost, ref}` once, when they are lost.
  """

  alias PhoenixKitAgent.Turns.Locks

  @enforce_keys [:conversation_uuid, :user_uuid, :ref, :ttl_s, :keeper, :lost]
  defstruct @enforce_keys

  @type t :: %__MODULE__{
          conversation_uuid: String.t(),
          user_uuid: String.t(),
          ref: String.t(),
          ttl_s: pos_integer(),
          keeper: pid(),
          lost: :atomics.atomics_ref()
        }

  @options [:ttl_s, wait_ms: 0]
  # A refused acquire is tried again after this, doubling, up to the cap.
  @retry_first_ms 50
  @retry_max_ms 1_000

  @doc false
  def run(conversation_uuid, user_uuid, opts, fun) when is_function(fun, 1) do
    opts = Keyword.validate!(opts, @options)

    ttl_s =
      opts[:ttl_s] || raise(ArgumentError, "missing option :ttl_s (the lease, whole seconds)")

    wait_ms = opts[:wait_ms]

    unless is_integer(wait_ms) and wait_ms >= 0,
      do:
        raise(
          ArgumentError,
          "invalid wait_ms: expected a non-negative integer, got: #{inspect(wait_ms)}"
        )

    ref = "turn-" <> Base.encode16(:crypto.strong_rand_bytes(16), case: :lower)
    deadline = System.monotonic_time(:millisecond) + wait_ms

    case acquire(conversation_uuid, user_uuid, ref, ttl_s, deadline, @retry_first_ms) do
      :ok ->
        hold(
          %{conversation_uuid: conversation_uuid, user_uuid: user_uuid, ref: ref, ttl_s: ttl_s},
          fun
        )

      {:error, reason} ->
        {:error, reason}
    end
  end

  def run(_conversation_uuid, _user_uuid, _opts, fun),
    do:
      raise(
        ArgumentError,
        "invalid fun: expected a function of one argument, got: #{inspect(fun)}"
      )

  # Tries again while refused, with a capped, jittered back-off, until the
  # deadline; errors (Locks.Error) are not refusals and raise at once.
  defp acquire(chat, user, ref, ttl_s, deadline, pause) do
    case Locks.acquire(chat, user, ref, ttl_s) do
      :ok ->
        :ok

      {:error, _} = refused ->
        left = deadline - System.monotonic_time(:millisecond)

        if left <= 0 do
          refused
        else
          Process.sleep(min(left, pause - :rand.uniform(div(pause, 4) + 1) + 1))
          acquire(chat, user, ref, ttl_s, deadline, min(pause * 2, @retry_max_ms))
        end
    end
  end

  defp hold(turn, fun) do
    lost = :atomics.new(1, [])

    {:ok, keeper} =
      DynamicSupervisor.start_child(
        Locks.Keepers,
        {__MODULE__.Keeper, Map.merge(turn, %{caller: self(), lost: lost})}
      )

    turn = struct!(__MODULE__, Map.merge(turn, %{keeper: keeper, lost: lost}))

    try do
      fun.(turn)
    else
      result -> if __MODULE__.Keeper.finish(keeper), do: {:ok, result}, else: {:lost, result}
    after
      # On a raise, a throw or an exit too; once finished, this is a no-op.
      __MODULE__.Keeper.finish(keeper)
    end
  end

  @doc false
  def lost?(%__MODULE__{lost: lost}), do: :atomics.get(lost, 1) == 1
end

defmodule PhoenixKitAgent.Turns.Locks.Turn.Keeper do
  @moduledoc false
  # Keeps one running turn's locks alive: `keep/4` every ttl/3, so the
  # lease never gets older than a third of its TTL while the turn runs, and
  # a turn lost with its node (this process dies with it) frees its chat
  # within the TTL. When a renewal answers false (the lease expired, or
  # another turn took a lock over) the turn is lost: the caller is told
  # ({:turn_lock_lost, ref}, lost?/1, a [:phoenix_kit_agent_locks, :turn,
  # :lost] event). A renewal that fails with an error (a timeout, a lost
  # connection) is tried again within the lease before the turn is declared
  # lost. The locks are released when the turn finishes, when the caller
  # exits (it is monitored), and when the application stops (terminate/2).

  use GenServer, restart: :temporary

  alias PhoenixKitAgent.Turns.Locks

  def start_link(turn), do: GenServer.start_link(__MODULE__, turn)

  @doc "Stops renewing, releases, and answers whether the turn still held both locks."
  def finish(keeper) do
    GenServer.call(keeper, :finish, :infinity)
  catch
    :exit, _ -> false
  end

  @impl true
  def init(turn) do
    Process.flag(:trap_exit, true)
    Process.monitor(turn.caller)
    every = max(div(turn.ttl_s * 1_000, 3), 1)
    now = System.monotonic_time(:millisecond)
    state = Map.merge(turn, %{every: every, lease_end: now + turn.ttl_s * 1_000, done: false})
    {:ok, schedule(state, every)}
  end

  @impl true
  def handle_call(:finish, _from, %{done: true} = state), do: {:reply, false, state}

  def handle_call(:finish, _from, state) do
    held = not lost?(state) and keep(state) == true
    release(state)
    {:stop, :normal, held, %{state | done: true}}
  end

  @impl true
  def handle_info(:keep, %{done: true} = state), do: {:noreply, state}

  def handle_info(:keep, state) do
    started = System.monotonic_time(:millisecond)

    case keep(state) do
      true ->
        {:noreply, schedule(%{state | lease_end: started + state.ttl_s * 1_000}, state.every)}

      false ->
        {:noreply, lose(state)}

      {:error, _reason} ->
        # Transient: try again soon, while the lease lasts.
        left = state.lease_end - System.monotonic_time(:millisecond)

        if left > 0,
          do: {:noreply, schedule(state, min(div(state.every, 3) + 1, left))},
          else: {:noreply, lose(state)}
    end
  end

  def handle_info({:DOWN, _, :process, caller, _}, %{caller: caller} = state) do
    unless state.done, do: release(state)
    {:stop, :normal, %{state | done: true}}
  end

  def handle_info(_other, state), do: {:noreply, state}

  @impl true
  def terminate(_reason, state) do
    unless state.done, do: release(state)
  end

  defp schedule(state, ms) do
    Process.send_after(self(), :keep, ms)
    state
  end

  defp keep(state) do
    Locks.keep(state.conversation_uuid, state.user_uuid, state.ref, state.ttl_s)
  rescue
    error in Locks.Error -> {:error, error.reason}
  end

  defp lost?(state), do: :atomics.get(state.lost, 1) == 1

  defp lose(state) do
    unless lost?(state) do
      :atomics.put(state.lost, 1, 1)
      send(state.caller, {:turn_lock_lost, state.ref})

      Locks.Observe.event([:turn, :lost], %{}, %{
        ref: state.ref,
        conversation_uuid: state.conversation_uuid,
        user_uuid: state.user_uuid
      })
    end

    state
  end

  # The locks go only if this turn still holds them: a lock another turn took
  # over stays that turn's.
  defp release(state) do
    Locks.release(state.conversation_uuid, state.user_uuid, state.ref)
  rescue
    _ in Locks.Error -> :error
  end
end
