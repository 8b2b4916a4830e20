defmodule PhoenixKitAgent.Turns.Locks.Robust.Node do
  @moduledoc false
  # Another BEAM, as a separate OS process: `elixir -pa <this build's ebin>`
  # running `child_main/0`, with the library configured as the test asks
  # (its own URL, pool size, timeouts, prefix; its own TZ). It is how the
  # robustness tests get several nodes on one database, a node that can be
  # `kill -9`ed, and a pool configured differently from the test VM's
  # (which is shared with every other test and must not be restarted).
  #
  # Protocol, over the port's stdin/stdout, one line per message:
  #   parent -> child  Base64(term_to_binary({id, {m, f, a}}))
  #   child -> parent  "ROBUST:" <> Base64(term_to_binary({id, reply}))
  # The child runs each command in a process of its own, so commands can
  # overlap (`async/4` + `await/3`). Every other line the child prints (its
  # Logger's console output, crash reports) is kept as its log.
  # The child halts when its stdin closes, so a test that ends (the server
  # below is start_supervised) leaves no process behind; `terminate/2` also
  # kills it by pid should it not read stdin any more.

  use GenServer

  @prefix "ROBUST:"

  # -- the test's side --------------------------------------------------------

  @doc """
  Starts a node for the running test (stopped when the test ends).

  Options: `:app_env` (keyword for `:phoenix_kit_agent_locks`, put before the
  application starts), `:env` (OS environment, e.g. `[{"TZ", "…"}]`),
  `:start_app` (default true). Returns the server; `hello/1` tells how the
  application start went.
  """
  def start!(opts) do
    ExUnit.Callbacks.start_supervised!(%{
      id: make_ref(),
      start: {__MODULE__, :start_link, [opts]},
      restart: :temporary
    })
  end

  def start_link(opts), do: GenServer.start_link(__MODULE__, opts)

  @doc "`{os_pid, application start result}` the child reported when it came up."
  # A BEAM starts in well under a second, but on a loaded shared machine it
  # has been seen to take over five.
  def hello(node), do: GenServer.call(node, :hello, 60_000)

  @doc "Runs `apply(m, f, a)` in the child; returns its value or raises with the child's error."
  def call(node, m, f, a, timeout \\ 120_000) do
    node |> async(m, f, a) |> then(&await(node, &1, timeout))
  end

  @doc "Sends a command without waiting; `await/3` its answer."
  def async(node, m, f, a), do: GenServer.call(node, {:send, {m, f, a}})

  def await(node, id, timeout \\ 120_000) do
    case GenServer.call(node, {:await, id}, timeout + 1_000) do
      {:ok, value} -> value
      {:raised, text} -> raise "child node raised:\n" <> text
      {:node_down, status} -> raise "child node is down (exit status #{status})"
    end
  end

  @doc "Kills the child with SIGKILL and waits until the OS reports it gone."
  def kill9!(node) do
    {pid, _} = hello(node)
    {_, 0} = System.cmd("kill", ["-9", Integer.to_string(pid)])
    await_exit(node, 10_000)
  end

  @doc "Waits (bounded) for the child's exit status."
  def await_exit(node, timeout), do: GenServer.call(node, :await_exit, timeout + 1_000)

  @doc "Every line the child printed that is not a protocol message."
  def log(node), do: GenServer.call(node, :log)

  # -- GenServer ----------------------------------------------------------------

  @impl true
  def init(opts) do
    Process.flag(:trap_exit, true)
    elixir = System.find_executable("elixir") || raise "elixir not found"
    ebin = :code.which(__MODULE__) |> List.to_string() |> Path.dirname()

    config =
      %{app_env: Keyword.get(opts, :app_env, []), start_app: Keyword.get(opts, :start_app, true)}
      |> :erlang.term_to_binary()
      |> Base.encode64()

    env =
      [{"ROBUST_NODE_CONFIG", config} | Keyword.get(opts, :env, [])]
      |> Enum.map(fn {k, v} ->
        {String.to_charlist(k), if(v, do: String.to_charlist(v), else: false)}
      end)

    port =
      Port.open({:spawn_executable, elixir}, [
        :binary,
        :exit_status,
        :use_stdio,
        :stderr_to_stdout,
        {:line, 65_536},
        {:env, env},
        args: ["-pa", ebin, "-e", "#{inspect(__MODULE__)}.child_main()"]
      ])

    state = %{
      port: port,
      partial: [],
      next: 1,
      results: %{},
      waiting: %{},
      log: [],
      hello: nil,
      hello_waiters: [],
      exit_status: nil,
      exit_waiters: []
    }

    {:ok, state}
  end

  @impl true
  def handle_call(:hello, from, %{hello: nil} = state),
    do: {:noreply, %{state | hello_waiters: [from | state.hello_waiters]}}

  def handle_call(:hello, _from, state), do: {:reply, state.hello, state}

  def handle_call({:send, mfa}, _from, %{exit_status: nil} = state) do
    id = state.next
    Port.command(state.port, [encode({id, mfa}), "\n"])
    {:reply, id, %{state | next: id + 1}}
  end

  def handle_call({:send, _mfa}, _from, state) do
    id = state.next
    results = Map.put(state.results, id, {:node_down, state.exit_status})
    {:reply, id, %{state | next: id + 1, results: results}}
  end

  def handle_call({:await, id}, from, state) do
    case Map.pop(state.results, id) do
      {nil, _} when state.exit_status != nil -> {:reply, {:node_down, state.exit_status}, state}
      {nil, _} -> {:noreply, %{state | waiting: Map.put(state.waiting, id, from)}}
      {result, results} -> {:reply, result, %{state | results: results}}
    end
  end

  def handle_call(:await_exit, from, %{exit_status: nil} = state),
    do: {:noreply, %{state | exit_waiters: [from | state.exit_waiters]}}

  def handle_call(:await_exit, _from, state), do: {:reply, state.exit_status, state}

  def handle_call(:log, _from, state), do: {:reply, Enum.reverse(state.log), state}

  @impl true
  def handle_info({port, {:data, {:noeol, chunk}}}, %{port: port} = state),
    do: {:noreply, %{state | partial: [state.partial, chunk]}}

  def handle_info({port, {:data, {:eol, chunk}}}, %{port: port} = state) do
    line = IO.iodata_to_binary([state.partial, chunk])
    {:noreply, line(line, %{state | partial: []})}
  end

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    for from <- state.exit_waiters, do: GenServer.reply(from, status)
    for {_id, from} <- state.waiting, do: GenServer.reply(from, {:node_down, status})
    for from <- state.hello_waiters, do: GenServer.reply(from, {:node_down, status})

    {:noreply, %{state | exit_status: status, exit_waiters: [], waiting: %{}, hello_waiters: []}}
  end

  def handle_info({:EXIT, _port, _reason}, state), do: {:noreply, state}

  @impl true
  def terminate(_reason, state) do
    with nil <- state.exit_status, {pid, _} <- state.hello, true <- is_integer(pid) do
      System.cmd("kill", ["-9", Integer.to_string(pid)], stderr_to_stdout: true)
    end

    :ok
  end

  defp line(@prefix <> message, state) do
    case decode(message) do
      {:hello, hello} ->
        for from <- state.hello_waiters, do: GenServer.reply(from, hello)
        %{state | hello: hello, hello_waiters: []}

      {id, result} ->
        case Map.pop(state.waiting, id) do
          {nil, _} ->
            %{state | results: Map.put(state.results, id, result)}

          {from, waiting} ->
            GenServer.reply(from, result)
            %{state | waiting: waiting}
        end
    end
  end

  defp line(other, state), do: %{state | log: [other | state.log]}

  defp encode(term), do: term |> :erlang.term_to_binary() |> Base.encode64()
  defp decode(text), do: text |> String.trim() |> Base.decode64!() |> :erlang.binary_to_term()

  # -- the child's side ---------------------------------------------------------

  @doc false
  def child_main do
    config = System.fetch_env!("ROBUST_NODE_CONFIG") |> decode()
    :ok = Application.load(:phoenix_kit_agent_locks)

    for {key, value} <- config.app_env,
        do: Application.put_env(:phoenix_kit_agent_locks, key, value)

    started =
      if config.start_app,
        do: Application.ensure_all_started(:phoenix_kit_agent_locks),
        else: :not_started

    reply(:hello, {String.to_integer(System.pid()), started})
    serve()
  end

  defp serve do
    case IO.binread(:stdio, :line) do
      data when is_binary(data) ->
        {id, {m, f, a}} = decode(data)
        spawn(fn -> reply(id, run(m, f, a)) end)
        serve()

      _eof_or_error ->
        System.halt(0)
    end
  end

  defp run(m, f, a) do
    {:ok, apply(m, f, a)}
  rescue
    e -> {:raised, Exception.format(:error, e, __STACKTRACE__)}
  catch
    kind, reason -> {:raised, Exception.format(kind, reason, __STACKTRACE__)}
  end

  defp reply(id, result), do: IO.binwrite(:stdio, [@prefix, encode({id, result}), "\n"])
end
