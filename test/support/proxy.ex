defmodule PhoenixKitAgent.Turns.Locks.Proxy do
  @moduledoc false
  # A TCP proxy on 127.0.0.1 (an ephemeral port) in front of the test
  # cluster, for the network tests: one process per connection pair, and a
  # mode that says what the path does.
  #
  #   * `:pass` — bytes go both ways at once;
  #   * `{:delay_replies, ms}` — server→client bytes are held `ms` first;
  #   * `:blackhole_old` — connections accepted before the switch forward
  #     nothing; new ones pass;
  #   * `:blackhole_all` — every connection, old and new, forwards nothing
  #     (new ones are still accepted, as a kernel would complete a handshake);
  #   * `:refuse` — new connections are accepted and closed at once.
  #
  # A black hole is faithful to TCP: bytes are buffered, not dropped, and
  # delivered when the path returns (`restore/1`), as the peers' kernels
  # would retransmit them, even after a client closed its socket with a FIN.
  # Only a client's *reset* (SO_LINGER 0) drops its buffered bytes, as the
  # kernel drops its unsent data: then the server side is reset too.
  #
  # The proxy records per connection, in order of acceptance: when it was
  # accepted, the client→server bytes it received and forwarded (with their
  # times, `System.monotonic_time/0`), and how the client closed it
  # (`:fin`, `:reset`, and the buffered bytes a reset dropped).

  use GenServer

  alias PhoenixKitAgent.Turns.Locks.TestDB

  @type mode ::
          :pass | {:delay_replies, pos_integer()} | :blackhole_old | :blackhole_all | :refuse

  ## API

  @doc "Starts a proxy (linked) in front of the server of `url`."
  def start(url \\ TestDB.url()) do
    %URI{host: host, port: port} = URI.parse(url)
    GenServer.start_link(__MODULE__, {String.to_charlist(host), port})
  end

  def child_spec(url), do: %{id: __MODULE__, start: {__MODULE__, :start, [url]}}

  @doc "The port it listens on."
  def port(proxy), do: GenServer.call(proxy, :port)

  @doc "`url` pointed at the proxy."
  def url(proxy, url \\ TestDB.url()),
    do:
      url |> URI.parse() |> Map.merge(%{host: "127.0.0.1", port: port(proxy)}) |> URI.to_string()

  @doc "Sets what the path does (see the moduledoc)."
  def mode(proxy, mode), do: GenServer.call(proxy, {:mode, mode})

  @doc "The path returns: every connection passes, buffered bytes are delivered."
  def restore(proxy), do: mode(proxy, :pass)

  @doc "Resets both sides of connection `id` (dropping what it buffered)."
  def cut(proxy, id), do: GenServer.call(proxy, {:cut, id})

  @doc """
  Every connection accepted so far, in order: `%{id, accepted_at, client,
  dropped, done, received, forwarded}`. `client` is how the client side
  ended: `:open`, `:fin`, `:reset`, `:cut` (`cut/2`) or `:refused` (closed
  by the proxy in `:refuse` mode); `dropped` the buffered client→server
  bytes a reset or a cut dropped; `done` whether the pair has
  ended; `received` and `forwarded` the client→server bytes as `[{time,
  bytes}]`, newest first.
  """
  def connections(proxy), do: GenServer.call(proxy, :connections)

  @doc """
  The client→server bytes connection `conn` (from `connections/1`)
  `:received` from its client, or `:forwarded` to the server, at or after
  `since` (`System.monotonic_time/0`).
  """
  def bytes(conn, which, since) when which in [:received, :forwarded],
    do: for({t, n} <- Map.fetch!(conn, which), t >= since, reduce: 0, do: (sum -> sum + n))

  @doc """
  Waits until `fun.(connections)` is true, for at most `timeout` ms: `:ok`,
  or `{:timeout, connections}`. Checked on every change, not by polling.
  """
  def await(proxy, fun, timeout),
    do: GenServer.call(proxy, {:await, fun, timeout}, timeout + 5_000)

  ## The proxy

  @impl true
  def init(upstream) do
    Process.flag(:trap_exit, true)

    {:ok, listen} =
      :gen_tcp.listen(0, [:binary, ip: {127, 0, 0, 1}, active: false, show_econnreset: true])

    {:ok, port} = :inet.port(listen)
    proxy = self()
    spawn_link(fn -> accept_loop(proxy, listen) end)

    {:ok,
     %{listen: listen, port: port, upstream: upstream, mode: :pass, conns: %{}, waiters: %{}}}
  end

  @impl true
  def handle_call(:port, _from, s), do: {:reply, s.port, s}

  def handle_call(:accepted, _from, s) do
    id = map_size(s.conns) + 1
    conn = %{id: id, pid: nil, accepted_at: now(), client: :open, dropped: 0, done: false}
    conn = Map.merge(conn, %{received: [], forwarded: []})

    if s.mode == :refuse do
      {:reply, :refuse, changed(put_in(s.conns[id], %{conn | client: :refused, done: true}))}
    else
      {proxy, mode} =
        {self(), if(s.mode == :blackhole_all, do: :blackhole, else: pair_mode(s.mode))}

      pid = spawn_link(fn -> pair(proxy, id, s.upstream, mode) end)
      {:reply, {:pair, pid}, changed(put_in(s.conns[id], %{conn | pid: pid}))}
    end
  end

  def handle_call({:mode, mode}, _from, s) do
    old = if mode in [:blackhole_old, :blackhole_all], do: :blackhole, else: pair_mode(mode)
    if mode != :refuse, do: for({_, %{pid: pid}} <- s.conns, pid, do: send(pid, {:mode, old}))
    {:reply, :ok, %{s | mode: mode}}
  end

  def handle_call({:cut, id}, _from, s) do
    send(s.conns[id].pid, :cut)
    {:reply, :ok, s}
  end

  def handle_call(:connections, _from, s), do: {:reply, list(s), s}

  def handle_call({:await, fun, timeout}, from, s) do
    ref = make_ref()
    Process.send_after(self(), {:await_timeout, ref}, timeout)
    {:noreply, changed(put_in(s.waiters[ref], {from, fun}))}
  end

  @impl true
  def handle_info({event, id, t, n}, s) when event in [:received, :forwarded],
    do: {:noreply, changed(update_in(s.conns[id][event], &[{t, n} | &1]))}

  def handle_info({:client, id, how, dropped}, s),
    do: {:noreply, changed(update_in(s.conns[id], &%{&1 | client: how, dropped: dropped}))}

  # A pair ends normally; anything else (the acceptor ending, a crash) ends the proxy.
  def handle_info({:EXIT, pid, reason}, s) do
    case Enum.find(s.conns, fn {_, c} -> c.pid == pid end) do
      {id, _} when reason == :normal -> {:noreply, changed(put_in(s.conns[id].done, true))}
      _ -> {:stop, {:proxy_process_ended, reason}, s}
    end
  end

  def handle_info({:await_timeout, ref}, s) do
    {waiter, waiters} = Map.pop(s.waiters, ref)
    with {from, _fun} <- waiter, do: GenServer.reply(from, {:timeout, list(s)})
    {:noreply, %{s | waiters: waiters}}
  end

  # Answers the waiters whose condition now holds.
  defp changed(s) do
    conns = list(s)
    {done, waiting} = Enum.split_with(s.waiters, fn {_, {_, fun}} -> fun.(conns) end)
    for {_, {from, _}} <- done, do: GenServer.reply(from, :ok)
    %{s | waiters: Map.new(waiting)}
  end

  defp list(s), do: s.conns |> Map.values() |> Enum.sort_by(& &1.id)
  defp pair_mode({:delay_replies, ms}), do: {:delay, ms}
  defp pair_mode(_), do: :pass
  defp now, do: System.monotonic_time()

  # Accepts connections and hands each to its pair (or closes it, refused).
  defp accept_loop(proxy, listen) do
    with {:ok, client} <- :gen_tcp.accept(listen) do
      case GenServer.call(proxy, :accepted) do
        {:pair, pid} ->
          :ok = :gen_tcp.controlling_process(client, pid)
          send(pid, {:go, client})

        :refuse ->
          :gen_tcp.close(client)
      end

      accept_loop(proxy, listen)
    end
  end

  ## One connection pair

  defp pair(proxy, id, {host, port}, mode) do
    client = receive do: ({:go, client} -> client)
    opts = [:binary, active: true, nodelay: true, show_econnreset: true]
    {:ok, server} = :gen_tcp.connect(host, port, opts)
    :ok = :inet.setopts(client, opts)

    s = %{proxy: proxy, id: id, client: client, server: server, mode: mode}
    loop(Map.merge(s, %{up: [], down: :queue.new(), client_eof: false, server_eof: false}))
  end

  defp loop(%{client: client, server: server} = s) do
    receive do
      {:tcp, ^client, data} ->
        send(s.proxy, {:received, s.id, now(), byte_size(data)})
        loop(%{s | up: s.up ++ [data]} |> flush())

      {:tcp, ^server, data} ->
        loop(%{s | down: :queue.in({due(s.mode), data}, s.down)} |> flush())

      {:tcp_error, ^client, :econnreset} ->
        # The client's kernel dropped its unsent bytes: so does the path.
        send(s.proxy, {:client, s.id, :reset, IO.iodata_length(s.up)})
        reset(server)

      {:tcp_closed, ^client} ->
        send(s.proxy, {:client, s.id, :fin, 0})
        finish(%{s | client_eof: true})

      {:tcp_error, ^server, _} ->
        reset(client)

      {:tcp_closed, ^server} ->
        finish(%{s | server_eof: true})

      {:mode, mode} ->
        finish(flush(%{s | mode: mode}))

      :deliver ->
        finish(flush(s))

      :cut ->
        send(s.proxy, {:client, s.id, :cut, IO.iodata_length(s.up)})
        reset(client)
        reset(server)
    end
  end

  defp due({:delay, ms}) do
    Process.send_after(self(), :deliver, ms)
    System.monotonic_time(:millisecond) + ms
  end

  defp due(_mode), do: System.monotonic_time(:millisecond)

  # Delivers what the mode lets through: nothing in a black hole; replies
  # whose delay has passed, in order.
  defp flush(%{mode: :blackhole} = s), do: s

  defp flush(s) do
    if s.up != [] do
      :gen_tcp.send(s.server, s.up)
      send(s.proxy, {:forwarded, s.id, now(), IO.iodata_length(s.up)})
    end

    # When the path passes again, replies still delayed go at once.
    until = if s.mode == :pass, do: :infinity, else: System.monotonic_time(:millisecond)
    %{s | up: [], down: deliver(s.client, s.down, until)}
  end

  defp deliver(client, down, until) do
    case :queue.peek(down) do
      {:value, {due, data}} when due <= until ->
        :gen_tcp.send(client, data)
        deliver(client, :queue.drop(down), until)

      _ ->
        down
    end
  end

  # A side that closed cleanly is closed on the other side once its bytes
  # are through; until then (a black hole, a delay) the pair waits.
  defp finish(%{client_eof: true, mode: mode, up: []} = s) when mode != :blackhole,
    do: :gen_tcp.close(s.server)

  defp finish(%{server_eof: true, mode: mode} = s) when mode != :blackhole do
    if :queue.is_empty(s.down), do: :gen_tcp.close(s.client), else: loop(s)
  end

  defp finish(s), do: loop(s)

  defp reset(socket) do
    :inet.setopts(socket, linger: {true, 0})
    :gen_tcp.close(socket)
  end
end
