defmodule PhoenixKitAgent.Turns.Locks.Bench.Wire do
  @moduledoc false
  # The statement texts the pool really sends, read off the wire, for
  # pgbench to run the very same SQL.
  #
  # The NIF does not hand them out (the shipped library carries nothing for
  # the benchmark), and pg_stat_statements cannot give them back: it stores
  # a statement with its constants replaced by `$n`, `interval '1 second'`
  # becoming `interval $5`, which no longer parses. So `start/1` opens a
  # proxy on 127.0.0.1 that passes every byte between a pool and the server
  # unchanged, and sends its owner the text of each Parse message (the
  # extended protocol's PREPARE, named or unnamed) a client sends:
  # `{:wire_parse, wire_ref, text}`.
  #
  # The pool reaches the proxy in plain TCP (the pool settings `start/1`
  # returns: sslmode disable); the proxy reaches the server as the
  # configuration says: over its socket directory or host and port, in TLS
  # unless the sslmode is `disable` (`prefer` falls back to plain text, and
  # `verify_ca`/`verify_full` check the server's certificate against
  # `ssl_ca_file` or the system's CAs). The password exchange passes
  # through: without TLS between pool and proxy there is no channel binding
  # for SCRAM to check.

  alias PhoenixKitAgent.Turns.Locks.Config

  @enforce_keys [:ref, :listener, :acceptor]
  defstruct [:ref, :listener, :acceptor]

  @type t :: %__MODULE__{}

  @ssl_request <<8::32, 80_877_103::32>>

  @doc """
  Starts a proxy to `config`'s server; its Parse texts go to the calling
  process. Returns the proxy and the settings of a pool that goes through
  it (`config` with its location and sslmode replaced, pool size 1).
  """
  @spec start(Config.t()) :: {:ok, t(), Config.t()} | {:error, String.t()}
  def start(%Config{} = config) do
    owner = self()
    ref = make_ref()

    case :gen_tcp.listen(0, [:binary, ip: {127, 0, 0, 1}, active: false, reuseaddr: true]) do
      {:ok, listener} ->
        {:ok, port} = :inet.port(listener)
        acceptor = spawn(fn -> accept(listener, config, owner, ref) end)
        :ok = :gen_tcp.controlling_process(listener, acceptor)

        pool = %{
          config
          | hostname: "127.0.0.1",
            socket_dir: nil,
            port: port,
            sslmode: :disable,
            ssl_ca_file: nil,
            pool_size: 1
        }

        {:ok, %__MODULE__{ref: ref, listener: listener, acceptor: acceptor}, pool}

      {:error, reason} ->
        {:error, "cannot listen on 127.0.0.1: #{:inet.format_error(reason)}"}
    end
  end

  @doc "The Parse texts received since the last call, oldest first."
  @spec texts(t()) :: [String.t()]
  def texts(%__MODULE__{ref: ref}), do: drain(ref, [])

  defp drain(ref, acc) do
    receive do
      {:wire_parse, ^ref, text} -> drain(ref, [text | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end

  @doc "Closes the proxy and every connection through it."
  @spec stop(t()) :: :ok
  def stop(%__MODULE__{listener: listener, acceptor: acceptor} = wire) do
    :gen_tcp.close(listener)
    Process.exit(acceptor, :kill)
    _ = texts(wire)
    :ok
  end

  ## Connections

  # Each connection's process is linked to the acceptor, so killing the
  # acceptor closes them all; the acceptor traps exits, so one connection's
  # end does not take the others with it.
  defp accept(listener, config, owner, ref) do
    Process.flag(:trap_exit, true)

    case :gen_tcp.accept(listener) do
      {:ok, client} ->
        pid = spawn_link(fn -> relay(client, config, owner, ref) end)
        :ok = :gen_tcp.controlling_process(client, pid)
        send(pid, :go)
        accept(listener, config, owner, ref)

      {:error, _closed} ->
        :ok
    end
  end

  defp relay(client, config, owner, ref) do
    receive(do: (:go -> :ok))

    case upstream(config) do
      {:ok, server} ->
        :ok = :inet.setopts(client, active: true)
        :ok = setopts(server, active: true)
        loop(%{client: client, server: server, owner: owner, ref: ref, buffer: "", startup: true})

      {:error, _reason} ->
        # The pool sees its connection closed and reports a connect error.
        :gen_tcp.close(client)
    end
  end

  defp loop(state) do
    %{client: client, server: server} = state

    receive do
      {:tcp, ^client, data} ->
        state = parse(%{state | buffer: state.buffer <> data})
        if write(server, data) == :ok, do: loop(state), else: hang_up(state)

      {tag, socket, data} when tag in [:tcp, :ssl] and socket == server ->
        if :gen_tcp.send(client, data) == :ok, do: loop(state), else: hang_up(state)

      {tag, _socket} when tag in [:tcp_closed, :ssl_closed] ->
        hang_up(state)

      {tag, _socket, _reason} when tag in [:tcp_error, :ssl_error] ->
        hang_up(state)
    end
  end

  defp hang_up(%{client: client, server: server}) do
    :gen_tcp.close(client)
    close(server)
  end

  # Frontend messages: the startup message has no type byte, every later
  # one is a type, a length that counts itself, and a body. A Parse ("P")
  # body is the statement's name, its text (both NUL-terminated), then
  # its parameter types.
  defp parse(%{startup: true, buffer: <<len::32, _::binary>> = buffer} = state)
       when byte_size(buffer) >= len do
    <<_::binary-size(len), rest::binary>> = buffer
    parse(%{state | startup: false, buffer: rest})
  end

  defp parse(%{startup: false, buffer: <<type, len::32, _::binary>> = buffer} = state)
       when byte_size(buffer) >= len + 1 do
    <<_, _::32, body::binary-size(len - 4), rest::binary>> = buffer

    if type == ?P do
      [_name, text | _] = :binary.split(body, <<0>>, [:global])
      send(state.owner, {:wire_parse, state.ref, text})
    end

    parse(%{state | buffer: rest})
  end

  defp parse(state), do: state

  ## The server's side

  defp upstream(%Config{} = config) do
    target =
      case config.socket_dir do
        nil -> {String.to_charlist(config.hostname), config.port}
        dir -> {{:local, Path.join(dir, ".s.PGSQL.#{config.port}")}, 0}
      end

    {address, port} = target
    timeout = config.connect_timeout

    with {:ok, socket} <- :gen_tcp.connect(address, port, [:binary, active: false], timeout) do
      tls(socket, config)
    end
  end

  defp tls(socket, %Config{sslmode: :disable}), do: {:ok, socket}

  defp tls(socket, %Config{} = config) do
    with :ok <- :gen_tcp.send(socket, @ssl_request),
         {:ok, answer} <- :gen_tcp.recv(socket, 1, config.connect_timeout) do
      case {answer, config.sslmode} do
        {"S", mode} ->
          :ok = Mix.Tasks.Compile.LocksNif.Prebuilt.ensure_started([:ssl])
          :ssl.connect(socket, ssl_options(config, mode), config.connect_timeout)

        {"N", :prefer} ->
          {:ok, socket}

        _ ->
          {:error, :no_tls}
      end
    end
  end

  defp ssl_options(_config, mode) when mode in [:prefer, :require], do: [verify: :verify_none]

  defp ssl_options(config, mode) do
    cas =
      case config.ssl_ca_file do
        nil -> [cacerts: :public_key.cacerts_get()]
        file -> [cacertfile: String.to_charlist(file)]
      end

    host =
      if mode == :verify_full and config.hostname,
        do: [server_name_indication: String.to_charlist(config.hostname)],
        # verify_ca: the chain is checked, not the name.
        else: [server_name_indication: :disable, customize_hostname_check: [match_fun: fn _, _ -> true end]]

    [verify: :verify_peer] ++ cas ++ host
  end

  defp setopts({:sslsocket, _, _} = socket, opts), do: :ssl.setopts(socket, opts)
  defp setopts(socket, opts), do: :inet.setopts(socket, opts)

  defp write({:sslsocket, _, _} = socket, data), do: :ssl.send(socket, data)
  defp write(socket, data), do: :gen_tcp.send(socket, data)

  defp close({:sslsocket, _, _} = socket), do: :ssl.close(socket)
  defp close(socket), do: :gen_tcp.close(socket)
end
