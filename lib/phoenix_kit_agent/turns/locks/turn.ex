defmodule PhoenixKitAgent.Turns.Locks.Turn do
  @moduledoc """
  A turn of `PhoenixKitAgent.Turns.Locks.with_turn/4`: its
  `conversation_uuid`, `user_uuid`, `ref` (made by `with_turn/4`), `ttl_s`
  (the TTL every taker of these locks uses) and `lease_s` (how long its locks
  outlive their last renewal). `PhoenixKitAgent.Turns.Locks.lost?/1` tells
  whether it may still count on its locks. The other fields are the runner's.

  ## The lease, from the holder's side

  Every renewal (`keep/5`) dates both locks `ttl_s - lease_s` seconds back by
  the database's `now()`, which is no earlier than the moment the renewal was
  sent: no taker can take them over sooner than `lease_s` after that moment.
  So the turn trusts its lease, on the node's monotonic clock, until

      sent + lease_s - lease_s / 50

  where `sent` is when the last renewal the database confirmed was sent (the
  acquire, at first). The 2 % margin covers the two clocks ticking at
  different rates (NTP slews a clock by at most 0.05 %) and the VM's
  correction of its monotonic clock; the database's clock, which decides
  every take-over, must not be stepped forward during a lease. The deadline
  is an `:atomics`, so `lost?/1` compares it itself, in any process, with no
  message: it is right even while no process of the turn is scheduled.

  ## One keeper per turn

  The caller starts the turn's keeper (a GenServer under the library's
  `Locks.Keepers`) and waits while it takes the locks. The keeper renews them
  every `lease_s / 3`, each `keep/5` in a short-lived process so that a
  database that does not answer never holds it up. When `fun` returns, the
  caller asks the keeper to end the turn: it answers whether the turn ended
  holding its locks, releases them and stops. A caller that dies, even during
  the acquire, is seen by the keeper, which releases once the acquire
  returned. One back-off serves every retry: the acquire's while refused and
  `:wait_ms` lasts, a renewal's after an error, a release's within the lease
  (after which a `Logger.warning` and the `[:turn, :release_failed]` event).

  The turn is lost when a renewal answers `false`, when the deadline passes,
  or when the keeper stops before the turn ends. The caller is then sent
  `{:turn_lock_lost, ref}` once, with the `[:turn, :lost]` event, by whoever
  moves the turn's phase (a second `:atomics` slot) from running: the keeper;
  its `terminate/2` on a graceful stop, which also releases; after it was
  killed or crashed, the keeper its supervisor starts again in its place,
  which tells in `init/1` and releases; or the caller, finding the keeper
  gone at the end of its turn.
  """

  use GenServer, restart: :transient

  require Logger

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Error, Observe}

  @enforce_keys [:conversation_uuid, :user_uuid, :ref, :ttl_s, :lease_s, :caller, :keeper, :lease]
  defstruct @enforce_keys

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
  # trusted (@lost for good: nothing moves it back), and the turn's phase.
  @deadline 1
  @phase 2
  @lost -0x8000000000000000
  # No keeper yet; then acquiring, running, and one of: ended (holding its
  # locks, or its caller died: nobody is told), telling (the keeper is
  # sending), told, told_late (by a keeper started again, in its init/1).
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
      do:
        raise(
          ArgumentError,
          "invalid wait_ms: expected a whole number, 0 or more, got: #{inspect(wait_ms)}"
        )

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

    case call(turn.keeper, {:acquire, wait_ms}) do
      :ok -> hold(turn, fun)
      {:error, _reason} = refused -> refused
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
    case DynamicSupervisor.start_child(Locks.Keepers, {__MODULE__, turn}) do
      {:ok, keeper} -> keeper
      _error -> raise not_started("is not running")
    end
  catch
    :exit, _ -> raise not_started("is not running")
  end

  defp not_started(what),
    do: %Error{
      reason: :not_started,
      message: "not started: the :phoenix_kit_agent_locks application #{what}"
    }

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

  # The keeper ended before the turn did (it was stopped, killed or crashed):
  # the turn is lost, and the caller tells itself unless a keeper did. One
  # started again tells in init/1, which the supervisor runs before it answers
  # anything else: after one call to it, that message is in the mailbox.
  defp gone(turn) do
    case :atomics.get(turn.lease, @phase) do
      @ended ->
        :ok

      @told ->
        :lost

      @told_late ->
        call(Locks.Keepers, :count_children) && :lost

      phase when phase in [@running, @telling] ->
        (tell(turn, phase, @told) && :lost) || gone(turn)
    end
  end

  # Whether the deadline passed; once it has, for good: no renewal moves it back.
  defp expired?(lease) do
    deadline = :atomics.get(lease, @deadline)

    deadline == @lost or
      (now() >= deadline and
         (:atomics.compare_exchange(lease, @deadline, deadline, @lost) == :ok or expired?(lease)))
  end

  # The lease is lost for good; the caller is told by whoever moves the phase
  # from `from` (running, or telling when the teller was killed while sending).
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
        {:ok, %{turn: turn, held: false, lease_ms: nil, keeping: nil, timer: nil, pause: 50}}

      phase ->
        # Started again after this turn's keeper was killed or crashed.
        tell(turn, phase, @told_late)
        {:ok, %{turn: turn}, {:continue, :release}}
    end
  end

  @impl true
  def handle_continue(:release, state) do
    release_within(state.turn)
    {:stop, :normal, state}
  end

  @impl true
  def handle_call({:acquire, wait_ms}, _from, %{turn: turn} = state) do
    case acquire(turn, now() + wait_ms, 50) do
      {:ok, sent} ->
        state = %{state | held: true, lease_ms: turn.lease_s * 1_000}
        :atomics.put(turn.lease, @deadline, trusted_until(state, sent))
        :atomics.put(turn.lease, @phase, @running)
        {:reply, :ok, renewed(state, sent)}

      {:raise, %Error{reason: reason} = error} when reason in [:timeout, :disconnected] ->
        # It may have run: release what it may have taken.
        release_within(turn)
        {:stop, :normal, {:raise, error}, state}

      {:stop, reason} ->
        {:stop, reason, {:raise, not_started("is stopping")}, state}

      refused_or_raised ->
        {:stop, :normal, refused_or_raised, state}
    end
  end

  def handle_call(:finish, _from, %{turn: turn} = state) do
    verdict =
      if not expired?(turn.lease) and cas(turn, @running, @ended) do
        :ok
      else
        tell(turn, @running, @telling)
        :lost
      end

    :atomics.put(turn.lease, @deadline, @lost)
    release_within(turn)
    {:stop, :normal, verdict, %{state | held: false}}
  end

  @impl true
  def handle_info(:keep, %{turn: turn, keeping: nil} = state) do
    if :atomics.get(turn.lease, @phase) == @running do
      if state.timer, do: Process.cancel_timer(state.timer)
      {sent, args} = {now(), args(turn)}

      {_pid, monitor} =
        spawn_monitor(fn ->
          Locks.Sandbox.allow(turn.caller)
          exit({:kept, safely(fn -> apply(Locks, :keep, args) end)})
        end)

      {:noreply, %{state | keeping: {monitor, sent}, timer: nil}}
    else
      {:noreply, state}
    end
  end

  def handle_info({:DOWN, monitor, :process, _, answer}, %{keeping: {monitor, sent}} = state) do
    state = %{state | keeping: nil}
    deadline = trusted_until(state, sent)

    case answer do
      {:kept, true} ->
        # Confirmed: trusted until its deadline, unless the lease was lost meanwhile.
        current = :atomics.get(state.turn.lease, @deadline)

        if not expired?(state.turn.lease) and
             :atomics.compare_exchange(state.turn.lease, @deadline, current, deadline) == :ok do
          {:noreply, renewed(%{state | pause: 50}, sent)}
        else
          tell(state.turn, @running, @telling)
          {:noreply, state}
        end

      {:kept, false} ->
        # The lease expired, or a lock was taken over: lost for good.
        tell(state.turn, @running, @telling)
        {:noreply, state}

      _transient ->
        # A timeout, a lost connection: again soon; the deadline ends the turn
        # should no renewal be confirmed before it.
        {wait, pause} = backoff(state.pause)
        {:noreply, %{state | pause: pause, timer: Process.send_after(self(), :keep, wait)}}
    end
  end

  def handle_info({:DOWN, _, :process, caller, _}, %{turn: %{caller: caller}} = state) do
    # Its caller died: the turn ends here, and nobody is told.
    cas(state.turn, @running, @ended)
    if state.held, do: release_within(state.turn)
    {:stop, :normal, %{state | held: false}}
  end

  def handle_info(:deadline, %{turn: turn} = state) do
    if expired?(turn.lease), do: tell(turn, @running, @telling)
    {:noreply, state}
  end

  def handle_info(_stale, state), do: {:noreply, state}

  # A graceful stop (the application's) while the turn runs: lost, released
  # once. A killed or crashed keeper is started again instead (init/1).
  @impl true
  def terminate(reason, %{held: true, turn: turn})
      when reason == :shutdown or (is_tuple(reason) and elem(reason, 0) == :shutdown) do
    tell(turn, @running, @telling)
    with {:error, error} <- release(turn), do: give_up(turn, error)
  end

  def terminate(_reason, _state), do: :ok

  # The renewal confirmed at `sent`: the deadline armed, the next renewal due.
  defp renewed(state, sent) do
    Process.send_after(self(), :deadline, trusted_until(state, sent), abs: true)
    every = max(div(state.lease_ms, 3), 1)
    %{state | timer: Process.send_after(self(), :keep, max(sent + every - now(), 0))}
  end

  defp trusted_until(state, sent), do: sent + state.lease_ms - div(state.lease_ms, 50)

  # acquire/5, again while refused until `until`, pausing with the back-off; a
  # caller that dies or a shutdown during a pause stops it.
  defp acquire(turn, until, pause) do
    sent = now()
    {wait, next} = backoff(pause)
    caller = turn.caller

    case safely(fn -> apply(Locks, :acquire, args(turn)) end) do
      :ok ->
        {:ok, sent}

      {:error, _} = refused when until > sent ->
        receive do
          {:DOWN, _, :process, ^caller, _} -> refused
          {:EXIT, _, reason} -> {:stop, reason}
        after
          min(until - now(), wait) |> max(0) -> acquire(turn, until, next)
        end

      refused_or_raised ->
        refused_or_raised
    end
  end

  defp args(turn),
    do: [turn.conversation_uuid, turn.user_uuid, turn.ref, turn.ttl_s, turn.lease_s]

  # The one back-off: 50 ms doubling to 1 s, each pause shortened at random by
  # up to a quarter. {this pause, the next one}.
  defp backoff(pause), do: {pause - :rand.uniform(div(pause, 4) + 1) + 1, min(pause * 2, 1_000)}

  defp safely(fun) do
    fun.()
  rescue
    exception -> {:raise, exception}
  end

  # Releases, again with the back-off for the lease (after which the locks are
  # free for any taker anyway); then gives up with a warning and an event.
  defp release_within(turn), do: release_within(turn, now() + turn.lease_s * 1_000, 50)

  defp release_within(turn, until, pause) do
    {wait, next} = backoff(pause)

    with {:error, error} <- release(turn) do
      if now() + wait < until do
        Process.sleep(wait)
        release_within(turn, until, next)
      else
        give_up(turn, error)
      end
    end
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
