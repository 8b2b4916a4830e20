defmodule LocksBench.Wire do
  @moduledoc false
  # The statement texts the library's pool really sends, read off the wire,
  # so that pgbench and Postgrex run the very same SQL: the library hands
  # out nothing for the bench, and pg_stat_statements keeps a statement with
  # its constants replaced by `$n`, which no longer parses.
  #
  # `start/1` opens a proxy on 127.0.0.1 that passes every byte between a
  # pool and the server unchanged and sends its owner the text of each Parse
  # message a client sends: `{:wire_parse, ref, text}`. The pool reaches the
  # proxy in plain TCP; the proxy reaches the server as the configuration
  # says (its socket directory or host and port; TLS unless sslmode is
  # disable, the certificate checked with ssl_ca_file for verify_ca and
  # verify_full).

  alias PhoenixKitAgent.Turns.Locks.Config

  @doc "Starts a proxy to `config`'s server: `{ref, listener, pool}`, `pool` the settings of a pool of one connection through it."
  def start(%Config{} = config) do
    {owner, ref} = {self(), make_ref()}
    opts = [:binary, ip: {127, 0, 0, 1}, active: false, reuseaddr: true]
    {:ok, listener} = :gen_tcp.listen(0, opts)
    {:ok, port} = :inet.port(listener)
    acceptor = spawn(fn -> accept(listener, config, owner, ref) end)
    :ok = :gen_tcp.controlling_process(listener, acceptor)

    pool = %{
      config
      | hostname: "127.0.0.1",
        socket_dir: nil,
        endpoints: [],
        port: port,
        sslmode: :disable,
        ssl_ca_file: nil,
        pool_size: 1
    }

    {{ref, listener, acceptor}, pool}
  end

  @doc "The Parse texts received since the last call, oldest first."
  def texts({ref, _, _} = wire) do
    receive do
      {:wire_parse, ^ref, text} -> [text | texts(wire)]
    after
      0 -> []
    end
  end

  @doc "Closes the proxy and every connection through it."
  def stop({_ref, listener, acceptor} = wire) do
    :gen_tcp.close(listener)
    Process.exit(acceptor, :kill)
    _ = texts(wire)
    :ok
  end

  # The relays are linked to the acceptor, which traps exits: killing it
  # closes them all, one relay's end closes no other.
  defp accept(listener, config, owner, ref) do
    Process.flag(:trap_exit, true)

    with {:ok, client} <- :gen_tcp.accept(listener) do
      pid = spawn_link(fn -> relay(client, config, owner, ref) end)
      :ok = :gen_tcp.controlling_process(client, pid)
      send(pid, :go)
      accept(listener, config, owner, ref)
    end
  end

  defp relay(client, config, owner, ref) do
    receive(do: (:go -> :ok))

    case upstream(config) do
      {:ok, {mod, server}} ->
        :ok = :inet.setopts(client, active: true)

        :ok =
          if(mod == :ssl,
            do: :ssl.setopts(server, active: true),
            else: :inet.setopts(server, active: true)
          )

        loop(%{
          client: client,
          server: server,
          mod: mod,
          owner: owner,
          ref: ref,
          buffer: "",
          startup: true
        })

      {:error, _} ->
        # The pool sees its connection closed and says so.
        :gen_tcp.close(client)
    end
  end

  defp loop(%{client: client, server: server, mod: mod} = state) do
    receive do
      {:tcp, ^client, data} ->
        state = parse(%{state | buffer: state.buffer <> data})
        if mod.send(server, data) == :ok, do: loop(state), else: hang_up(state)

      {tag, ^server, data} when tag in [:tcp, :ssl] ->
        if :gen_tcp.send(client, data) == :ok, do: loop(state), else: hang_up(state)

      _closed_or_error ->
        hang_up(state)
    end
  end

  defp hang_up(%{client: client, server: server, mod: mod}) do
    :gen_tcp.close(client)
    mod.close(server)
  end

  # Frontend messages: the startup message has no type byte, every later
  # one is a type, a length that counts itself, and a body; a Parse ("P")
  # body is the statement's name and text, each NUL-terminated, then types.
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

  defp upstream(%Config{} = config) do
    {address, port} =
      case config.socket_dir do
        nil -> {String.to_charlist(config.hostname), config.port}
        dir -> {{:local, Path.join(dir, ".s.PGSQL.#{config.port}")}, 0}
      end

    with {:ok, socket} <- :gen_tcp.connect(address, port, [:binary, active: false], 10_000) do
      if config.sslmode == :disable, do: {:ok, {:gen_tcp, socket}}, else: tls(socket, config)
    end
  end

  # SSLRequest; the server answers S (go on in TLS) or N.
  defp tls(socket, config) do
    :ok = :gen_tcp.send(socket, <<8::32, 80_877_103::32>>)

    case {:gen_tcp.recv(socket, 1, 10_000), config.sslmode} do
      {{:ok, "S"}, mode} ->
        verify =
          if mode in [:prefer, :require],
            do: [verify: :verify_none],
            else: [verify: :verify_peer] ++ cas(config.ssl_ca_file) ++ host(config)

        with {:ok, tls} <- :ssl.connect(socket, verify, 10_000), do: {:ok, {:ssl, tls}}

      {{:ok, "N"}, :prefer} ->
        {:ok, {:gen_tcp, socket}}

      _ ->
        {:error, :no_tls}
    end
  end

  defp cas(nil), do: [cacerts: :public_key.cacerts_get()]
  defp cas(file), do: [cacertfile: String.to_charlist(file)]

  defp host(%Config{sslmode: :verify_full, hostname: host}) when is_binary(host),
    do: [server_name_indication: String.to_charlist(host)]

  defp host(_config),
    do: [
      server_name_indication: :disable,
      customize_hostname_check: [match_fun: fn _, _ -> true end]
    ]
end
