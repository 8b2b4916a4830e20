defmodule PhoenixKitAgent.Turns.Locks.Turn do
  @moduledoc """
  A turn of `PhoenixKitAgent.Turns.Locks.with_turn/4`: its
  `conversation_uuid`, `user_uuid`, `ref` (made by `with_turn/4`), `ttl_s`
  (the TTL every taker of these locks uses) and `lease_s` (how long its locks
  outlive their last renewal). `PhoenixKitAgent.Turns.Locks.lost?/1` tells
  whether it may still count on its locks. The other fields are the runner's.

  One keeper per turn, this module's GenServer under `Locks.Keepers`, takes
  the locks for the caller, renews them every `lease_s / 3` (each `keep/5` in
  a short-lived process, so that a database that does not answer never holds
  it up) and releases them when the turn ends or its caller dies. The lease is
  trusted until `sent + lease_s - lease_s / 50` on the node's monotonic clock,
  `sent` being when the last renewal the database confirmed was sent (the
  README's "Short leases" says why no taker can come first). That deadline is
  an `:atomics` slot, which `lost?/1` reads in any process.

  A second slot holds the turn's phase; whoever moves it from running tells
  the caller, once: the keeper (a renewal answered `false`, the deadline
  passed); its `terminate/2` on a graceful stop; a keeper killed or crashed is
  started again by its supervisor, and tells in `init/1`; or the caller, when
  it finds its keeper gone at the end. One back-off serves every retry.
  """

  use GenServer, restart: :transient

  require Logger

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Error, Observe}

  defstruct [:conversation_uuid, :user_uuid, :ref, :ttl_s, :lease_s, :caller, :keeper, :lease]

  @type t :: %__MODULE__{
          conversation_uuid: String.t(),
          user_uuid: String.t(),
          ref: String.t(),
          ttl_s: pos_integer(),
          lease_s: pos_integer(),
          caller: pid(),
          keeper: pid(),
          lease: :atomics.atomics_ref()
        }

  # The :atomics slots: the monotonic millisecond until which the lease is
  # trusted (@lost: for good), and the phase: @new until the keeper starts,
  # @acquiring, @running, then @ended (nobody is told: the turn ended holding
  # its locks, or its caller died) or @telling (the keeper sends), @told, or
  # @told_late (by a keeper started again, in its init/1).
  @not_started "not started: the :phoenix_kit_agent_locks application "
  @deadline 1
  @phase 2
  @lost -0x8000000000000000
  @new 0
  @acquiring 1
  @running 2
  @ended 3
  @telling 4
  @told 5
  @told_late 6

  @doc false
  def run(conversation_uuid, user_uuid, opts, fun) when is_function(fun, 1) do
    opts = Keyword.validate!(opts, [:ttl_s, :lease_s, wait_ms: 0])
    ttl_s = opts[:ttl_s] || raise ArgumentError, "missing option :ttl_s (the takers' TTL)"
    wait_ms = opts[:wait_ms]

    unless is_integer(wait_ms) and wait_ms >= 0,
      do: raise(ArgumentError, "invalid wait_ms: expected 0 or more, got: #{inspect(wait_ms)}")

    # ttl_s and lease_s are checked by acquire/5, in the keeper, before any SQL.
    turn = %__MODULE__{
      conversation_uuid: conversation_uuid,
      user_uuid: user_uuid,
      ref: "turn-" <> Base.encode16(:crypto.strong_rand_bytes(16), case: :lower),
      ttl_s: ttl_s,
      lease_s: opts[:lease_s] || ttl_s,
      caller: self(),
      keeper: nil,
      lease: :atomics.new(2, signed: true)
    }

    :atomics.put(turn.lease, @deadline, @lost)
    turn = %{turn | keeper: start_keeper!(turn)}

    case retry(fn -> call(turn.keeper, :acquire) end, now() + wait_ms) do
      :ok -> hold(turn, fun)
      {:error, _reason} = refused -> with(_ <- call(turn.keeper, :finish), do: refused)
      {:raise, exception} -> raise exception
      :gone -> raise not_started("stopped while the turn's locks were being taken")
    end
  end

  def run(_conversation_uuid, _user_uuid, _opts, fun) do
    raise ArgumentError, "invalid fun: expected a function of one argument, got: #{inspect(fun)}"
  end

  @doc false
  def lost?(%__MODULE__{lease: lease, keeper: keeper}),
    do: expired?(lease) or not Process.alive?(keeper)

  # The supervisor is gone or going (the application stopped): nothing was taken.
  defp start_keeper!(turn) do
    {:ok, keeper} = DynamicSupervisor.start_child(Locks.Keepers, {__MODULE__, turn})
    keeper
  catch
    :exit, _ -> raise not_started("is not running")
  end

  defp not_started(what), do: %Error{reason: :not_started, message: @not_started <> what}

  defp call(server, request) do
    GenServer.call(server, request, :infinity)
  catch
    :exit, _ -> :gone
  end

  defp hold(turn, fun) do
    fun.(turn)
  catch
    kind, reason ->
      finish(turn)
      :erlang.raise(kind, reason, __STACKTRACE__)
  else
    result -> {finish(turn), result}
  end

  # :ok when the turn ended holding its locks, :lost when it knows it did not.
  defp finish(turn), do: with(:gone <- call(turn.keeper, :finish), do: gone(turn))

  # The keeper ended before the turn (stopped, killed, crashed): the turn is
  # lost, and the caller tells itself unless a keeper did. A keeper started
  # again tells in init/1, which the supervisor runs before it answers any
  # call: after one, that message is in the mailbox.
  defp gone(turn) do
    case :atomics.get(turn.lease, @phase) do
      @ended -> :ok
      @told -> :lost
      @told_late -> with(_ <- call(Locks.Keepers, :count_children), do: :lost)
      phase -> (tell(turn, phase, @told) && :lost) || gone(turn)
    end
  end

  # Whether the deadline passed; once it has, for good: no renewal moves it back.
  defp expired?(lease) do
    deadline = :atomics.get(lease, @deadline)

    deadline == @lost or
      (now() >= deadline and
         (:atomics.compare_exchange(lease, @deadline, deadline, @lost) == :ok or expired?(lease)))
  end

  # The lease is lost for good. The caller is told by whoever moves the phase
  # from `from`: running, or telling should the keeper die while it sends.
  defp tell(turn, from, to) do
    :atomics.put(turn.lease, @deadline, @lost)
    told? = from in [@running, @telling] and cas(turn, from, to)

    if told? do
      send(turn.caller, {:turn_lock_lost, turn.ref})
      Observe.event([:turn, :lost], %{}, metadata(turn))
      if to == @telling, do: :atomics.put(turn.lease, @phase, @told)
    end

    told?
  end

  defp cas(turn, from, to), do: :atomics.compare_exchange(turn.lease, @phase, from, to) == :ok
  defp now, do: System.monotonic_time(:millisecond)

  ## The keeper

  @doc false
  def start_link(turn), do: GenServer.start_link(__MODULE__, turn)

  @impl true
  def init(turn) do
    # testing: :sandbox: the keeper's calls use the caller's sandbox connection.
    Locks.Sandbox.allow(turn.caller)

    case :atomics.compare_exchange(turn.lease, @phase, @new, @acquiring) do
      :ok ->
        # Exits trapped: a graceful stop goes through terminate/2.
        Process.flag(:trap_exit, true)
        Process.monitor(turn.caller)
        {:ok, %{turn: turn, held: false, lease_ms: nil, keeping: nil, pause: 50}}

      phase ->
        # Started again after the turn's keeper was killed or crashed.
        tell(turn, phase, @told_late)
        {:ok, %{turn: turn}, {:continue, :release}}
    end
  end

  @impl true
  def handle_continue(:release, state) do
    release(state.turn, :within_lease)
    {:stop, :normal, state}
  end

  @impl true
  def handle_call(:acquire, _from, %{turn: turn} = state) do
    sent = now()

    case safely(fn -> apply(Locks, :acquire, args(turn)) end) do
      :ok ->
        state = %{state | held: true, lease_ms: turn.lease_s * 1_000}
        :atomics.put(turn.lease, @deadline, trusted_until(state, sent))
        :atomics.put(turn.lease, @phase, @running)
        {:reply, :ok, renewed(state, sent)}

      {:error, _busy} = refused ->
        {:reply, refused, state}

      {:raise, %Error{reason: reason} = error} when reason in [:timeout, :disconnected] ->
        # It may have run: release what it may have taken.
        release(turn, :within_lease)
        {:stop, :normal, {:raise, error}, state}

      raised ->
        {:stop, :normal, raised, state}
    end
  end

  def handle_call(:finish, _from, %{turn: turn} = state) do
    verdict = if not expired?(turn.lease) and cas(turn, @running, @ended), do: :ok, else: :lost
    tell(turn, @running, @telling)
    if state.held, do: release(turn, :within_lease)
    {:stop, :normal, verdict, %{state | held: false}}
  end

  @impl true
  def handle_info(:keep, %{turn: turn, keeping: nil} = state) do
    with @running <- :atomics.get(turn.lease, @phase) do
      sent = now()

      {_pid, monitor} =
        spawn_monitor(fn ->
          Locks.Sandbox.allow(turn.caller)
          exit({:kept, safely(fn -> apply(Locks, :keep, args(turn)) end)})
        end)

      {:noreply, %{state | keeping: {monitor, sent}}}
    else
      _not_running -> {:noreply, state}
    end
  end

  def handle_info({:DOWN, monitor, :process, _, answer}, %{keeping: {monitor, sent}} = state) do
    state = %{state | keeping: nil}

    case answer do
      {:kept, true} ->
        if extend(state, sent),
          do: {:noreply, renewed(%{state | pause: 50}, sent)},
          else: lose(state)

      # The lease expired, or a lock was taken over: lost for good.
      {:kept, false} ->
        lose(state)

      # A timeout, a lost connection: again soon; the deadline ends the turn
      # should no renewal be confirmed before it.
      _error ->
        {wait, pause} = backoff(state.pause)
        Process.send_after(self(), :keep, wait)
        {:noreply, %{state | pause: pause}}
    end
  end

  def handle_info({:DOWN, _, :process, caller, _}, %{turn: %{caller: caller}} = state) do
    # Its caller died: the turn ends here, and nobody is told.
    cas(state.turn, @running, @ended)
    if state.held, do: release(state.turn, :within_lease)
    {:stop, :normal, %{state | held: false}}
  end

  def handle_info(:deadline, state),
    do: if(expired?(state.turn.lease), do: lose(state), else: {:noreply, state})

  def handle_info(_stale, state), do: {:noreply, state}

  # A graceful stop (the application's) while the turn runs: lost, released
  # once. A keeper killed or crashed is started again instead (init/1).
  @impl true
  def terminate(reason, %{held: true, turn: turn})
      when reason == :shutdown or (is_tuple(reason) and elem(reason, 0) == :shutdown) do
    tell(turn, @running, @telling)
    release(turn, :once)
  end

  def terminate(_reason, _state), do: :ok

  defp lose(state) do
    tell(state.turn, @running, @telling)
    {:noreply, state}
  end

  # A renewal sent at `sent` confirmed: trusted longer, unless already lost.
  defp extend(%{turn: turn} = state, sent) do
    current = :atomics.get(turn.lease, @deadline)
    deadline = trusted_until(state, sent)
    now() < current and :atomics.compare_exchange(turn.lease, @deadline, current, deadline) == :ok
  end

  # The deadline armed and the next renewal due, from `sent`.
  defp renewed(state, sent) do
    Process.send_after(self(), :deadline, trusted_until(state, sent), abs: true)
    Process.send_after(self(), :keep, max(sent + max(div(state.lease_ms, 3), 1) - now(), 0))
    state
  end

  defp trusted_until(state, sent), do: sent + state.lease_ms - div(state.lease_ms, 50)

  defp args(t), do: [t.conversation_uuid, t.user_uuid, t.ref, t.ttl_s, t.lease_s]

  defp safely(fun) do
    fun.()
  rescue
    exception -> {:raise, exception}
  end

  # The one back-off: 50 ms doubling to 1 s, each pause shortened at random by
  # up to a quarter. {this pause, the next}.
  defp backoff(pause), do: {pause - :rand.uniform(div(pause, 4) + 1) + 1, min(pause * 2, 1_000)}

  # fun.() again, with the back-off, while it answers {:error, _} and `until`
  # is ahead: the last answer.
  defp retry(fun, until, pause \\ 50) do
    with {:error, _} = error <- fun.() do
      {wait, next} = backoff(pause)
      left = until - now()
      if left > 0, do: Process.sleep(min(wait, left)) && retry(fun, until, next), else: error
    end
  end

  # Releases, again for the lease (after which the locks are free for any
  # taker anyway) or once; else a warning and an event.
  defp release(turn, how) do
    until = if how == :once, do: 0, else: now() + turn.lease_s * 1_000
    with {:error, error} <- retry(fn -> release(turn) end, until), do: give_up(turn, error)
  end

  defp release(turn) do
    Locks.release(turn.conversation_uuid, turn.user_uuid, turn.ref)
  rescue
    error in Error -> {:error, error}
  end

  defp give_up(turn, error) do
    Logger.warning(
      "phoenix_kit_agent_locks: could not release the locks of #{turn.ref} " <>
        "(conversation #{turn.conversation_uuid}, user #{turn.user_uuid}): " <>
        "#{Exception.message(error)}; they free themselves #{turn.lease_s} s " <>
        "after their last renewal"
    )

    Observe.event([:turn, :release_failed], %{}, Map.put(metadata(turn), :reason, error.reason))
  end

  defp metadata(turn), do: Map.take(turn, [:ref, :conversation_uuid, :user_uuid])
end
