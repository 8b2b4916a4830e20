defmodule PhoenixKitAgent.Turns.Locks.Turn do
  @moduledoc """
  A turn of `PhoenixKitAgent.Turns.Locks.with_turn/4`: its `conversation_uuid`,
  `user_uuid`, `ref`, `ttl_s` (the takers' TTL) and `lease_s`; the other fields
  are the runner's. `PhoenixKitAgent.Turns.Locks.lost?/1` reads its lease.

  One keeper per turn (this module's GenServer, under `Locks.Keepers`) takes,
  renews and releases the locks. The lease is trusted until `lease_s` less
  2 % after the sending of the last confirmed renewal, on the node's
  monotonic clock, in an `:atomics` slot (guides/leases.md).
  """

  use GenServer, restart: :transient

  require Logger

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Error, Observe}

  defstruct [:conversation_uuid, :user_uuid, :ref, :ttl_s, :lease_s, :caller, :keeper, :lease]

  @type t :: %__MODULE__{conversation_uuid: String.t(), user_uuid: String.t(), ref: String.t()}

  # :atomics slots: the monotonic ms until which the lease is trusted (@lost: for
  # good), and the phase: @new, @acquiring, @running, then @ended (nobody told) or
  # @telling, @told, @told_late (by a keeper started again). Whoever moves the phase
  # from running tells the caller, once: the keeper, its terminate/2 on a graceful
  # stop, the keeper its supervisor starts again, or the caller at the end.
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
  @not_started "not started: the :phoenix_kit_agent_locks application "

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
      lease: :atomics.new(2, signed: true)
    }

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
  def lost?(%__MODULE__{lease: lease, keeper: pid}),
    do: expired?(lease) or not Process.alive?(pid)

  # An exit: the application is stopped or stopping, and nothing was taken.
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
    result = fun.(turn)
    {finish(turn), result}
  catch
    kind, reason -> finish(turn) && :erlang.raise(kind, reason, __STACKTRACE__)
  end

  # :ok when the turn ended holding its locks, :lost when it knows it did not.
  defp finish(turn), do: with(:gone <- call(turn.keeper, :finish), do: gone(turn))

  # The keeper ended first: tell unless a keeper did (one started again tells
  # in init/1, which its supervisor runs before it answers the next call).
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
    at = :atomics.get(lease, @deadline)
    now() >= at and (at == @lost or cas(lease, @deadline, at, @lost) or expired?(lease))
  end

  # Lost for good; the caller told by whoever moves the phase from `from`
  # (running, or telling: a keeper killed while it sent).
  defp tell(turn, from, to \\ @telling) do
    :atomics.put(turn.lease, @deadline, @lost)

    with true <- from in [@running, @telling] and cas(turn.lease, @phase, from, to) do
      send(turn.caller, {:turn_lock_lost, turn.ref})
      Observe.event([:turn, :lost], %{}, metadata(turn))
      to != @telling or cas(turn.lease, @phase, @telling, @told)
    end
  end

  defp cas(lease, slot, from, to), do: :atomics.compare_exchange(lease, slot, from, to) == :ok
  defp now, do: System.monotonic_time(:millisecond)

  @doc false
  # The keeper.
  def start_link(turn), do: GenServer.start_link(__MODULE__, turn)

  @impl true
  def init(turn) do
    # testing: :sandbox: the keeper's calls use the caller's sandbox connection.
    Locks.Sandbox.allow(turn.caller)

    if cas(turn.lease, @phase, @new, @acquiring) do
      Process.flag(:trap_exit, true)
      Process.monitor(turn.caller)
      {:ok, %{turn: turn, held: false, pause: 50}}
    else
      # Started again after the turn's keeper was killed or crashed.
      tell(turn, :atomics.get(turn.lease, @phase), @told_late)
      {:ok, %{turn: turn, held: true}, {:continue, :release}}
    end
  end

  @impl true
  def handle_continue(:release, state), do: {:stop, :normal, close(state)}

  @impl true
  def handle_call(:acquire, _from, %{turn: turn} = state) do
    {_, ref} = spawn_attempt(turn, :acquire, now())

    receive do
      {:DOWN, ^ref, _, _, {_, sent, :ok}} ->
        :atomics.put(turn.lease, @deadline, trusted_until(turn, sent))
        :atomics.put(turn.lease, @phase, @running)
        {:reply, :ok, renewed(%{state | held: true}, sent)}

      {:DOWN, ^ref, _, _, {_, _, {:error, busy} = refused}} when is_atom(busy) ->
        {:reply, refused, state}

      {:DOWN, ^ref, _, _, {_, _, {:error, error}}} ->
        # After a :timeout or :disconnected it may have run: released then.
        ran? = match?(%Error{reason: r} when r in [:timeout, :disconnected], error)
        {:stop, :normal, {:raise, error}, close(%{state | held: ran?})}

      {:DOWN, ^ref, _, _, reason} ->
        exit(reason)
    end
  end

  def handle_call(:finish, _from, %{turn: %{lease: lease}} = state) do
    held? = not expired?(lease) and cas(lease, @phase, @running, @ended)
    {:stop, :normal, if(held?, do: :ok, else: :lost), close(state)}
  end

  @impl true
  def handle_info(:keep, %{turn: turn} = state) do
    if :atomics.get(turn.lease, @phase) == @running, do: spawn_attempt(turn, :keep, now())
    {:noreply, state}
  end

  # Its caller died: the turn ends here, and nobody is told.
  def handle_info({:DOWN, _, :process, caller, _}, %{turn: %{caller: caller}} = state) do
    cas(state.turn.lease, @phase, @running, @ended)
    {:stop, :normal, close(state)}
  end

  # A renewal's answer. false: the lease expired, or a lock was taken over.
  def handle_info({:DOWN, _, :process, _, {:keep, sent, true}}, state),
    do: if(extend(state.turn, sent), do: {:noreply, renewed(state, sent)}, else: lose(state))

  def handle_info({:DOWN, _, :process, _, {:keep, _, false}}, state), do: lose(state)

  # A timeout, a lost connection: again soon, within the deadline.
  def handle_info({:DOWN, _, :process, _, _error}, state) do
    {wait, pause} = backoff(state.pause)
    Process.send_after(self(), :keep, wait)
    {:noreply, %{state | pause: pause}}
  end

  def handle_info(:deadline, state),
    do: if(expired?(state.turn.lease), do: lose(state), else: {:noreply, state})

  def handle_info(_stale, state), do: {:noreply, state}

  # A graceful stop: lost, released once. A killed keeper's successor does it.
  @impl true
  def terminate(:shutdown, state), do: close(state, :once)
  def terminate({:shutdown, _}, state), do: close(state, :once)
  def terminate(_reason, _state), do: :ok

  # The turn over (lost unless it ended holding its locks); released, again
  # for the lease (then they are free anyway) or once, else a warning.
  defp close(%{turn: turn} = state, how \\ :within_lease) do
    tell(turn, @running)

    with true <- state.held,
         until = if(how == :once, do: 0, else: now() + turn.lease_s * 1_000),
         {:error, error} <- retry(fn -> attempt(turn, :release, 3) end, until),
         do: give_up(turn, error)

    %{state | held: false}
  end

  defp lose(state), do: with(_ <- tell(state.turn, @running), do: {:noreply, state})

  # A renewal sent at `sent` confirmed: trusted longer, unless already lost.
  defp extend(turn, sent) do
    at = :atomics.get(turn.lease, @deadline)
    now() < at and cas(turn.lease, @deadline, at, trusted_until(turn, sent))
  end

  # From `sent`: the deadline armed, the next renewal due, the back-off reset.
  defp renewed(%{turn: turn} = state, sent) do
    Process.send_after(self(), :deadline, trusted_until(turn, sent), abs: true)
    Process.send_after(self(), :keep, max(sent + div(turn.lease_s * 1_000, 3) - now(), 0))
    %{state | pause: 50}
  end

  # lease_s less its 2 % margin (clocks ticking at different rates), in ms.
  defp trusted_until(turn, sent), do: sent + turn.lease_s * 980

  # acquire/5 or keep/5 (sent at `sent`) in a process of its own, which exits
  # `{fun, sent, answer}`; an acquire releases if the keeper is dead by then: a
  # statement outlives its process, and the keeper started again may release first.
  defp spawn_attempt(turn, fun, sent, keeper \\ self()) do
    spawn_monitor(fn ->
      Locks.Sandbox.allow(turn.caller)
      answer = attempt(turn, fun, 5)
      if fun == :keep or Process.alive?(keeper), do: exit({fun, sent, answer})
      close(%{turn: turn, held: true})
    end)
  end

  # Locks.fun/n on the turn's first n arguments; a raise as {:error, exception}.
  defp attempt(t, fun, n) do
    apply(Locks, fun, Enum.take([t.conversation_uuid, t.user_uuid, t.ref, t.ttl_s, t.lease_s], n))
  rescue
    exception -> {:error, exception}
  end

  # The one back-off: 50 ms doubling to 1 s, less up to a quarter at random.
  defp backoff(pause), do: {pause - :rand.uniform(div(pause, 4) + 1) + 1, min(pause * 2, 1_000)}

  # fun.() again with the back-off while {:error, _} and `until` is ahead.
  defp retry(fun, until, pause \\ 50) do
    with {:error, _} = error <- fun.() do
      {wait, next} = backoff(pause)
      left = until - now()
      if left > 0, do: Process.sleep(min(wait, left)) && retry(fun, until, next), else: error
    end
  end

  defp give_up(turn, error) do
    Logger.warning(
      "phoenix_kit_agent_locks: could not release the locks of #{turn.ref} (conversation " <>
        "#{turn.conversation_uuid}, user #{turn.user_uuid}): #{Exception.message(error)}; " <>
        "they free themselves #{turn.lease_s} s after their last renewal"
    )

    reason = Map.get(error, :reason)
    Observe.event([:turn, :release_failed], %{}, Map.put(metadata(turn), :reason, reason))
  end

  defp metadata(turn), do: Map.take(turn, [:ref, :conversation_uuid, :user_uuid])
end
