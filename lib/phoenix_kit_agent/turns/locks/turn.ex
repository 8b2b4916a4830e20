defmodule PhoenixKitAgent.Turns.Locks.Turn do
  @moduledoc """
  A turn of `PhoenixKitAgent.Turns.Locks.with_turn/4`: its `conversation_uuid`,
  `user_uuid`, `ref` (made by `with_turn/4`) and `ttl_s` (the lease);
  `PhoenixKitAgent.Turns.Locks.lost?/1` tells whether it still holds its locks.
  """

  alias PhoenixKitAgent.Turns.Locks
  alias __MODULE__.Keeper

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

  @retry_first_ms 50
  @retry_max_ms 1_000

  @doc false
  def run(conversation_uuid, user_uuid, opts, fun) when is_function(fun, 1) do
    opts = Keyword.validate!(opts, [:ttl_s, wait_ms: 0])

    ttl_s =
      opts[:ttl_s] || raise(ArgumentError, "missing option :ttl_s (the lease, whole seconds)")

    wait_ms = opts[:wait_ms]

    unless is_integer(wait_ms) and wait_ms >= 0 do
      raise ArgumentError,
            "invalid wait_ms: expected a non-negative integer, got: #{inspect(wait_ms)}"
    end

    ref = "turn-" <> Base.encode16(:crypto.strong_rand_bytes(16), case: :lower)
    turn = %{conversation_uuid: conversation_uuid, user_uuid: user_uuid, ref: ref, ttl_s: ttl_s}
    deadline = System.monotonic_time(:millisecond) + wait_ms

    with :ok <- acquire(turn, deadline, @retry_first_ms), do: hold(turn, fun)
  end

  def run(_conversation_uuid, _user_uuid, _opts, fun) do
    raise ArgumentError, "invalid fun: expected a function of one argument, got: #{inspect(fun)}"
  end

  # Again while refused, until the deadline; an error (Locks.Error) raises at once.
  defp acquire(turn, deadline, pause) do
    with {:error, _} = refused <-
           Locks.acquire(turn.conversation_uuid, turn.user_uuid, turn.ref, turn.ttl_s) do
      left = deadline - System.monotonic_time(:millisecond)

      if left <= 0 do
        refused
      else
        Process.sleep(min(left, pause - :rand.uniform(div(pause, 4) + 1) + 1))
        acquire(turn, deadline, min(pause * 2, @retry_max_ms))
      end
    end
  end

  defp hold(turn, fun) do
    lost = :atomics.new(1, [])
    keeper_args = Map.merge(turn, %{caller: self(), lost: lost})
    {:ok, keeper} = DynamicSupervisor.start_child(Locks.Keepers, {Keeper, keeper_args})
    turn = struct!(__MODULE__, Map.merge(turn, %{keeper: keeper, lost: lost}))

    try do
      fun.(turn)
    else
      result -> if Keeper.finish(keeper), do: {:ok, result}, else: {:lost, result}
    after
      # On a raise, a throw or an exit too; once finished, this is a no-op.
      Keeper.finish(keeper)
    end
  end

  @doc false
  def lost?(%__MODULE__{lost: lost}), do: :atomics.get(lost, 1) == 1
end

defmodule PhoenixKitAgent.Turns.Locks.Turn.Keeper do
  @moduledoc false
  # Keeps one turn's lease and releases its locks, as Locks.with_turn/4's doc says.

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
    # testing: :sandbox: this process's calls use the caller's sandbox connection.
    Locks.Sandbox.allow(turn.caller)
    Process.flag(:trap_exit, true)
    Process.monitor(turn.caller)
    every = max(div(turn.ttl_s * 1_000, 3), 1)
    now = System.monotonic_time(:millisecond)
    state = Map.merge(turn, %{every: every, lease_end: now + turn.ttl_s * 1_000})
    {:ok, schedule(state, every)}
  end

  # terminate/2 releases the locks, before the reply.
  @impl true
  def handle_call(:finish, _from, state),
    do: {:stop, :normal, not lost?(state) and keep(state) == true, state}

  @impl true
  def handle_info(:keep, state) do
    started = System.monotonic_time(:millisecond)

    state =
      case keep(state) do
        true ->
          schedule(%{state | lease_end: started + state.ttl_s * 1_000}, state.every)

        false ->
          lose(state)

        {:error, _reason} ->
          # Transient (a timeout, a lost connection): again soon, while the lease lasts.
          left = state.lease_end - System.monotonic_time(:millisecond)
          if left > 0, do: schedule(state, min(div(state.every, 3) + 1, left)), else: lose(state)
      end

    {:noreply, state}
  end

  def handle_info({:DOWN, _, :process, caller, _}, %{caller: caller} = state),
    do: {:stop, :normal, state}

  def handle_info(_other, state), do: {:noreply, state}

  # Every ending comes here: finish, the caller's exit, a shutdown (exits are trapped).
  @impl true
  def terminate(_reason, state) do
    Locks.release(state.conversation_uuid, state.user_uuid, state.ref)
  rescue
    _ in Locks.Error -> :error
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
      metadata = Map.take(state, [:ref, :conversation_uuid, :user_uuid])
      Locks.Observe.event([:turn, :lost], %{}, metadata)
    end

    state
  end
end
