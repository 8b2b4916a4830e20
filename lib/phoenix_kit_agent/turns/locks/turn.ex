defmodule PhoenixKitAgent.Turns.Locks.Turn do
  @moduledoc """
  A turn of `PhoenixKitAgent.Turns.Locks.with_turn/4`: its
  `conversation_uuid`, `user_uuid`, `ref` (made by `with_turn/4`), `ttl_s`
  (the TTL every taker of these locks uses) and `lease_s` (how long its locks
  outlive their last renewal). `PhoenixKitAgent.Turns.Locks.lost?/1` tells
  whether it may still count on its locks. The other fields are the turn's
  own.

  ## The lease, from the holder's side

  Every renewal (`keep/5`) dates both locks `ttl_s - lease_s` seconds into
  the past by the database's `now()`, which is no earlier than the moment
  the renewal was sent: no taker can take them over before `lease_s` seconds
  after that moment, by the database's clock. So the keeper counts the lease
  on the node's monotonic clock from the moment it *sent* the last renewal
  the database confirmed (the acquire, at first), and trusts it until

      sent + lease_s - margin,   margin = lease_s / 50 (2 %)

  The margin covers the two clocks ticking at different rates over one
  lease: an NTP daemon slews a clock by at most 500 ppm, so two disciplined
  clocks differ by at most 0.1 %; 2 % leaves room for clocks that are not
  disciplined and for the VM's own time correction of its monotonic clock.
  The assumptions are that, and that the database's clock is not stepped
  forward during a lease (it decides every take-over).

  When that local deadline passes with no renewal confirmed, the turn is
  lost, whatever a renewal still on its way may answer: `lost?/1` compares
  the deadline itself (so it is right even if no process is scheduled), and
  the caller is sent `{:turn_lock_lost, ref}` once, with the `[:turn, :lost]`
  event. A renewal runs in a short-lived process of its own, so a database
  that does not answer never holds up the keeper; its answer, should it come
  after the turn was lost, is ignored.

  ## Processes

    * the **keeper** (under the library's `Locks.Keepers` supervisor) takes
      the locks for the caller, which waits for it, renews them every
      `lease_s / 3` and releases them at the end, or when the caller dies
      (also a caller killed during the acquire: it releases once the acquire
      returned);
    * the **watcher** (a plain process of the turn, outside the supervision
      tree) waits for the keeper to end: a keeper that stops before its turn
      ended (the application stopped, it was killed or crashed) makes the
      turn lost and has its locks released, and the caller told, by the
      watcher when the keeper could not do it itself.

  A release is tried again within the lease; what cannot be released is
  logged (`Logger.warning`) and reported as the `[:turn, :release_failed]`
  event: those locks free themselves `lease_s` after their last renewal.
  """

  require Logger

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Error, Observe}
  alias __MODULE__.{Keeper, Watcher}

  @enforce_keys [
    :conversation_uuid,
    :user_uuid,
    :ref,
    :ttl_s,
    :lease_s,
    :caller,
    :keeper,
    :watcher,
    :lease
  ]
  defstruct @enforce_keys

  @type t :: %__MODULE__{
          conversation_uuid: String.t(),
          user_uuid: String.t(),
          ref: String.t(),
          ttl_s: pos_integer(),
          lease_s: pos_integer(),
          caller: pid(),
          keeper: pid(),
          watcher: pid(),
          lease: :atomics.atomics_ref()
        }

  # The turn's shared state: an :atomics of three slots, written by the
  # keeper, the watcher and the caller's ending, read by lost?/1 anywhere.
  #
  #   * @deadline: the monotonic millisecond until which the lease is
  #     trusted, or @lost (for good: nothing ever moves it back);
  #   * @tell: @acquiring, then @running (the caller has its turn); then
  #     @telling and @told (whoever moves it from @running tells the caller,
  #     once), or @ended (the turn ended holding its locks: nobody tells);
  #   * @release: @unreleased, @released (or nothing was left to release),
  #     or @given_up (logged).
  @deadline 1
  @tell 2
  @release 3
  @lost -0x8000000000000000
  @acquiring 0
  @running 1
  @telling 2
  @told 3
  @ended 4
  @unreleased 0
  @released 1
  @given_up 2

  @max_ttl_s 315_360_000

  @doc false
  def run(conversation_uuid, user_uuid, opts, fun) when is_function(fun, 1) do
    opts = Keyword.validate!(opts, [:ttl_s, :lease_s, wait_ms: 0])
    ttl_s = opts[:ttl_s] || raise(ArgumentError, "missing option :ttl_s (the takers' TTL)")
    check!(:ttl_s, ttl_s, is_integer(ttl_s) and ttl_s in 1..@max_ttl_s, "1 to #{@max_ttl_s}")
    lease_s = Keyword.get(opts, :lease_s) || ttl_s
    check!(:lease_s, lease_s, is_integer(lease_s) and lease_s in 1..ttl_s, "1 to ttl_s")
    wait_ms = opts[:wait_ms]
    check!(:wait_ms, wait_ms, is_integer(wait_ms) and wait_ms >= 0, "0 or more")

    lease = :atomics.new(3, signed: true)
    :atomics.put(lease, @deadline, @lost)
    :atomics.put(lease, @tell, @acquiring)

    turn = %{
      conversation_uuid: conversation_uuid,
      user_uuid: user_uuid,
      ref: "turn-" <> Base.encode16(:crypto.strong_rand_bytes(16), case: :lower),
      ttl_s: ttl_s,
      lease_s: lease_s,
      caller: self(),
      lease: lease
    }

    watcher = Watcher.start(turn)
    keeper = start_keeper!(Map.put(turn, :watcher, watcher))
    turn = struct!(__MODULE__, Map.merge(turn, %{keeper: keeper, watcher: watcher}))

    case Keeper.acquire(keeper, wait_ms) do
      :ok -> hold(turn, fun)
      {:error, _reason} = refused -> refused
      {:raise, exception} -> raise exception
      :gone -> raise not_started("stopped while the turn's locks were being taken")
    end
  end

  def run(_conversation_uuid, _user_uuid, _opts, fun) do
    raise ArgumentError, "invalid fun: expected a function of one argument, got: #{inspect(fun)}"
  end

  defp check!(_name, _value, true, _expected), do: :ok

  defp check!(name, value, false, expected) do
    raise ArgumentError,
          "invalid #{name}: expected a whole number #{expected}, got: #{inspect(value)}"
  end

  # The library's supervisor is gone or going (the application stopped):
  # nothing was taken yet, and the turn cannot run.
  defp start_keeper!(turn) do
    case safe_start(turn) do
      {:ok, keeper} ->
        keeper

      _no_keeper ->
        send(turn.watcher, :stop)
        raise not_started("is not running")
    end
  end

  defp safe_start(turn) do
    DynamicSupervisor.start_child(Locks.Keepers, {Keeper, turn})
  catch
    :exit, reason -> {:exit, reason}
  end

  defp not_started(what) do
    %Error{
      reason: :not_started,
      message: "not started: the :phoenix_kit_agent_locks application #{what}"
    }
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

  # :ok when the turn ended holding its locks, :lost when it knows it did
  # not (lost?/1 true, the caller told).
  defp finish(turn) do
    case Keeper.finish(turn.keeper) do
      :held -> :ok
      :lost -> :lost
      :gone -> settle(turn)
    end
  end

  # The keeper ended before the turn did: the watcher tells the caller and
  # releases. The answer waits for the telling only (a release may take the
  # whole lease), and tells itself should the watcher be gone too.
  defp settle(turn) do
    case :atomics.get(turn.lease, @tell) do
      @told ->
        :lost

      @ended ->
        :ok

      _running_or_telling ->
        if Process.alive?(turn.watcher) do
          Process.sleep(1)
          settle(turn)
        else
          tell(turn)
          # A teller killed between claiming the telling and sending it.
          if :atomics.get(turn.lease, @tell) == @telling, do: send_lost(turn)
          if :atomics.get(turn.lease, @release) == @unreleased, do: release_within(turn)
          :lost
        end
    end
  end

  @doc false
  def lost?(%__MODULE__{lease: lease, keeper: keeper} = turn) do
    deadline = :atomics.get(lease, @deadline)

    cond do
      deadline == @lost ->
        true

      now() >= deadline ->
        # For good: the keeper may no longer extend it. Should it have just
        # extended it (a renewal confirmed in time), decide again.
        :atomics.compare_exchange(lease, @deadline, deadline, @lost) == :ok or lost?(turn)

      true ->
        not Process.alive?(keeper)
    end
  end

  ## The lease's state, shared by the keeper, the watcher and the ending

  @doc false
  def now, do: System.monotonic_time(:millisecond)

  @doc false
  # What the local deadline keeps back from the lease (see the moduledoc).
  def margin_ms(lease_ms), do: div(lease_ms, 50)

  @doc false
  # The lease as the acquire left it: trusted until `deadline`; the turn runs.
  def start(turn, deadline) do
    :atomics.put(turn.lease, @deadline, deadline)
    :atomics.put(turn.lease, @tell, @running)
  end

  @doc false
  # A renewal confirmed: trusted until `deadline`, unless the lease was
  # already lost (then the caller is told). :ok or :lost.
  def extend(turn, deadline) do
    current = :atomics.get(turn.lease, @deadline)

    cond do
      current == @lost or now() >= current ->
        tell(turn)

      deadline <= current ->
        :ok

      :atomics.compare_exchange(turn.lease, @deadline, current, deadline) == :ok ->
        :ok

      true ->
        extend(turn, deadline)
    end
  end

  @doc false
  # :lost when the local deadline passed (the caller is told), else :ok.
  def check(turn) do
    current = :atomics.get(turn.lease, @deadline)
    if current == @lost or now() >= current, do: tell(turn), else: :ok
  end

  @doc false
  # The turn ended, the keeper alive: :held when fun returned within the
  # lease and nothing said it was lost (then nobody tells any more), else
  # :lost, the caller told.
  def close(turn) do
    with :ok <- check(turn),
         :ok <- :atomics.compare_exchange(turn.lease, @tell, @running, @ended) do
      :held
    else
      _lost -> tell(turn)
    end
  end

  @doc false
  # The caller died: its turn ends here, and nobody is told.
  def abandon(turn), do: :atomics.compare_exchange(turn.lease, @tell, @running, @ended)

  @doc false
  # The lease is lost for good; the caller is told once, if its turn runs.
  def tell(turn) do
    :atomics.put(turn.lease, @deadline, @lost)

    if :atomics.compare_exchange(turn.lease, @tell, @running, @telling) == :ok,
      do: send_lost(turn)

    :lost
  end

  defp send_lost(turn) do
    send(turn.caller, {:turn_lock_lost, turn.ref})
    Observe.event([:turn, :lost], %{}, metadata(turn))
    :atomics.put(turn.lease, @tell, @told)
  end

  @doc false
  # Nothing is held (refused, never taken): nothing is left to release.
  def released(turn), do: :atomics.put(turn.lease, @release, @released)

  @doc false
  def released?(turn), do: :atomics.get(turn.lease, @release) != @unreleased

  @doc false
  # One try; :ok or :error (someone else tries again).
  def release_once(turn) do
    case release(turn) do
      :ok -> released(turn)
      {:error, _} -> :error
    end
  end

  @doc false
  # Releases, trying again for the lease (after which the locks are free
  # for any taker anyway); gives up with a warning and an event.
  def release_within(turn), do: release_within(turn, now() + turn.lease_s * 1_000, 50)

  defp release_within(turn, until, pause) do
    with {:error, error} <- release(turn) do
      if now() + pause < until do
        Process.sleep(pause)
        release_within(turn, until, min(pause * 2, 1_000))
      else
        give_up(turn, error)
      end
    else
      :ok -> released(turn)
    end
  end

  defp release(turn) do
    Locks.release(turn.conversation_uuid, turn.user_uuid, turn.ref)
  rescue
    error in Error -> {:error, error}
  end

  defp give_up(turn, error) do
    :atomics.put(turn.lease, @release, @given_up)

    Logger.warning(
      "phoenix_kit_agent_locks: could not release the locks of #{turn.ref} " <>
        "(conversation #{turn.conversation_uuid}, user #{turn.user_uuid}): " <>
        "#{Exception.message(error)}; they free themselves #{turn.lease_s} s " <>
        "after their last renewal"
    )

    Observe.event(
      [:turn, :release_failed],
      %{},
      Map.put(metadata(turn), :reason, error.reason)
    )
  end

  defp metadata(turn), do: Map.take(turn, [:ref, :conversation_uuid, :user_uuid])
end

defmodule PhoenixKitAgent.Turns.Locks.Turn.Keeper do
  @moduledoc false
  # Takes one turn's locks for its caller, keeps its lease and releases its
  # locks, as the Turn moduledoc says.

  use GenServer, restart: :temporary

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Error, Turn}

  @retry_first_ms 50
  @retry_max_ms 1_000

  def start_link(turn), do: GenServer.start_link(__MODULE__, turn)

  @doc "Takes the locks (trying again for `wait_ms` while refused): :ok, a refusal, {:raise, exception} or :gone."
  def acquire(keeper, wait_ms), do: call(keeper, {:acquire, wait_ms})

  @doc "Ends the turn and releases: :held, :lost, or :gone (the keeper had ended)."
  def finish(keeper), do: call(keeper, :finish)

  defp call(keeper, request) do
    GenServer.call(keeper, request, :infinity)
  catch
    :exit, _ -> :gone
  end

  @impl true
  def init(turn) do
    # Exits trapped: a shutdown goes through terminate/2, which tells and releases.
    # testing: :sandbox: this process's calls use the caller's sandbox connection.
    Locks.Sandbox.allow(turn.caller)
    Process.flag(:trap_exit, true)
    Process.monitor(turn.caller)
    send(turn.watcher, {:keeper, self()})
    lease_ms = turn.lease_s * 1_000

    state = %{
      turn:
        Map.take(turn, [:conversation_uuid, :user_uuid, :ref, :ttl_s, :lease_s, :caller, :lease]),
      phase: :acquiring,
      lease_ms: lease_ms,
      every: max(div(lease_ms, 3), 1),
      margin: Turn.margin_ms(lease_ms),
      keeping: nil
    }

    {:ok, state}
  end

  @impl true
  def handle_call({:acquire, wait_ms}, _from, %{phase: :acquiring, turn: turn} = state) do
    case acquire(state, Turn.now() + wait_ms, @retry_first_ms) do
      {:ok, sent} ->
        deadline = sent + state.lease_ms - state.margin
        Turn.start(turn, deadline)
        arm(deadline)
        Process.send_after(self(), :keep, state.every)
        {:reply, :ok, %{state | phase: :running}}

      {:error, _reason} = refused ->
        Turn.released(turn)
        {:stop, :normal, refused, %{state | phase: :done}}

      {:raise, %Error{reason: reason} = error} when reason in [:timeout, :disconnected] ->
        # It may have run: release what it may have taken.
        Turn.release_within(turn)
        {:stop, :normal, {:raise, error}, %{state | phase: :done}}

      {:raise, exception} ->
        Turn.released(turn)
        {:stop, :normal, {:raise, exception}, %{state | phase: :done}}

      {:stop, :caller_down} ->
        Turn.released(turn)
        {:stop, :normal, :gone, %{state | phase: :done}}

      {:stop, reason} ->
        Turn.released(turn)
        error = %Error{reason: :not_started, message: "not started: the application is stopping"}
        {:stop, reason, {:raise, error}, %{state | phase: :done}}
    end
  end

  def handle_call(:finish, _from, %{phase: phase, turn: turn} = state)
      when phase in [:running, :lost] do
    verdict = Turn.close(turn)
    Turn.release_within(turn)
    {:stop, :normal, verdict, %{state | phase: :done}}
  end

  @impl true
  def handle_info(:keep, %{phase: :running, keeping: nil, turn: turn} = state) do
    sent = Turn.now()
    args = [turn.conversation_uuid, turn.user_uuid, turn.ref, turn.ttl_s, turn.lease_s]
    caller = turn.caller

    {_pid, watch} =
      spawn_monitor(fn ->
        # testing: :sandbox: this process's call uses the caller's connection too.
        Locks.Sandbox.allow(caller)
        exit({:kept, keep(args)})
      end)

    {:noreply, %{state | keeping: {watch, sent}}}
  end

  def handle_info(:keep, state), do: {:noreply, state}

  def handle_info({:DOWN, watch, :process, _, answer}, %{keeping: {watch, sent}} = state) do
    state = %{state | keeping: nil}

    case {state.phase, answer} do
      {:running, {:kept, true}} ->
        deadline = sent + state.lease_ms - state.margin

        case Turn.extend(state.turn, deadline) do
          :ok ->
            arm(deadline)
            Process.send_after(self(), :keep, max(sent + state.every - Turn.now(), 0))
            {:noreply, state}

          :lost ->
            {:noreply, %{state | phase: :lost}}
        end

      {:running, {:kept, false}} ->
        # The lease expired or a lock was taken over: lost for good.
        Turn.tell(state.turn)
        {:noreply, %{state | phase: :lost}}

      {:running, _error} ->
        # Transient (a timeout, a lost connection): again soon; the local
        # deadline ends the turn if no renewal is confirmed before it.
        Process.send_after(self(), :keep, div(state.every, 3) + 1)
        {:noreply, state}

      {_lost, _late} ->
        {:noreply, state}
    end
  end

  def handle_info({:DOWN, _, :process, caller, _}, %{turn: %{caller: caller}} = state) do
    if state.phase in [:running, :lost] do
      Turn.abandon(state.turn)
      Turn.release_within(state.turn)
    end

    {:stop, :normal, %{state | phase: :done}}
  end

  def handle_info(:deadline, %{phase: :running} = state) do
    case Turn.check(state.turn) do
      :ok -> {:noreply, state}
      :lost -> {:noreply, %{state | phase: :lost}}
    end
  end

  def handle_info(_other, state), do: {:noreply, state}

  # Stopped before its turn ended (a shutdown, a crash): the turn is lost;
  # one release here, the watcher tries again if it fails.
  @impl true
  def terminate(_reason, %{phase: phase, turn: turn}) when phase in [:running, :lost] do
    Turn.tell(turn)
    Turn.release_once(turn)
  end

  def terminate(_reason, _state), do: :ok

  # Again while refused, until the deadline, pausing with a back-off; a
  # caller that dies or a shutdown during a pause stops it.
  defp acquire(%{turn: turn} = state, deadline, pause) do
    sent = Turn.now()

    case safely(fn ->
           Locks.acquire(
             turn.conversation_uuid,
             turn.user_uuid,
             turn.ref,
             turn.ttl_s,
             turn.lease_s
           )
         end) do
      :ok ->
        {:ok, sent}

      {:error, _} = refused ->
        left = deadline - Turn.now()
        caller = turn.caller

        if left <= 0 do
          refused
        else
          receive do
            {:DOWN, _, :process, ^caller, _} -> {:stop, :caller_down}
            {:EXIT, _, reason} -> {:stop, reason}
          after
            min(left, pause - :rand.uniform(div(pause, 4) + 1) + 1) ->
              acquire(state, deadline, min(pause * 2, @retry_max_ms))
          end
        end

      raised ->
        raised
    end
  end

  defp safely(fun) do
    fun.()
  rescue
    exception -> {:raise, exception}
  end

  defp keep(args) do
    apply(Locks, :keep, args)
  rescue
    error -> {:error, error}
  end

  # The local deadline, on the monotonic clock (send_after's absolute time).
  defp arm(deadline), do: Process.send_after(self(), :deadline, deadline, abs: true)
end

defmodule PhoenixKitAgent.Turns.Locks.Turn.Watcher do
  @moduledoc false
  # Waits for a turn's keeper to end; one that ends before its turn did
  # (killed, crashed, shut down) has the caller told and the locks released
  # here, whatever the keeper managed itself (see the Turn moduledoc).

  alias PhoenixKitAgent.Turns.Locks.Turn

  def start(turn), do: spawn(fn -> await_keeper(turn) end)

  defp await_keeper(turn) do
    caller = Process.monitor(turn.caller)

    receive do
      {:keeper, keeper} ->
        Process.demonitor(caller, [:flush])
        watch(turn, Process.monitor(keeper))

      # No keeper could be started, or the caller died first.
      :stop ->
        :ok

      {:DOWN, ^caller, :process, _, _} ->
        :ok
    end
  end

  defp watch(turn, keeper) do
    receive do
      {:DOWN, ^keeper, :process, _, :normal} ->
        :ok

      {:DOWN, ^keeper, :process, _, _abnormal} ->
        Turn.tell(turn)
        unless Turn.released?(turn), do: Turn.release_within(turn)
    end
  end
end
