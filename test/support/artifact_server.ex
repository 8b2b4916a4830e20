defmodule PhoenixKitAgent.Turns.Locks.ArtifactServer do
  @moduledoc false
  # A loopback HTTP/1.1 server of the tests' own (gen_tcp, one connection at
  # a time), standing in for a release's download URL and for a proxy:
  #
  #   * serves `files` (request path => body) and answers 404 to anything
  #     else, closing every connection after its answer;
  #   * tells `owner` of every request as `{:artifact_request, "GET /path"}`,
  #     or `{:artifact_request, "GET http://host/path"}` when it was asked as
  #     a proxy is (the absolute URL on the request line);
  #   * `stop/1` closes its port: a connection is refused from then on.

  @doc "Starts the server: `{base_url, server}`, base_url `http://127.0.0.1:PORT`."
  def start(files, owner \\ self()) do
    parent = self()

    pid =
      spawn(fn ->
        {:ok, listen} =
          :gen_tcp.listen(0, [:binary, packet: :http_bin, active: false, ip: {127, 0, 0, 1}])

        {:ok, port} = :inet.port(listen)
        send(parent, {:artifact_server, self(), port})
        accept(listen, files, owner)
      end)

    receive do
      {:artifact_server, ^pid, port} -> {"http://127.0.0.1:#{port}", pid}
    after
      5_000 -> raise "the artifact server did not start"
    end
  end

  @doc """
  Starts the server for the calling test, which stops it when it ends (an
  ExUnit `on_exit/1`); its base URL.
  """
  def serve!(files) do
    {url, server} = start(files)
    ExUnit.Callbacks.on_exit(fn -> stop(server) end)
    url
  end

  @doc "Stops the server; its listening socket is closed when this returns."
  def stop(server) do
    ref = Process.monitor(server)
    Process.exit(server, :kill)

    receive do
      {:DOWN, ^ref, :process, _, _} -> :ok
    end
  end

  defp accept(listen, files, owner) do
    {:ok, socket} = :gen_tcp.accept(listen)
    {:ok, {:http_request, method, uri, _version}} = :gen_tcp.recv(socket, 0, 5_000)
    :ok = skip_headers(socket)

    {path, shown} =
      case uri do
        {:abs_path, path} ->
          {path, path}

        {:absoluteURI, scheme, host, port, path} ->
          {path, "#{scheme}://#{host}#{if port != :undefined, do: ":#{port}"}#{path}"}
      end

    send(owner, {:artifact_request, "#{method} #{shown}"})

    {status, body} =
      case files do
        %{^path => body} -> {"200 OK", body}
        _ -> {"404 Not Found", "not found"}
      end

    :ok = :inet.setopts(socket, packet: :raw)

    :gen_tcp.send(socket, [
      "HTTP/1.1 #{status}\r\ncontent-length: #{byte_size(body)}\r\nconnection: close\r\n\r\n",
      body
    ])

    :gen_tcp.close(socket)
    accept(listen, files, owner)
  end

  defp skip_headers(socket) do
    case :gen_tcp.recv(socket, 0, 5_000) do
      {:ok, :http_eoh} -> :ok
      {:ok, {:http_header, _, _, _, _}} -> skip_headers(socket)
    end
  end
end
