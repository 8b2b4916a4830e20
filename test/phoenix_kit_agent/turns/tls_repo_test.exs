defmodule PhoenixKitAgent.Turns.TlsRepoTest do
  # A host's repo's TLS settings against a real server: the TLS cluster of
  # native/locks_core/tests/tls.rs (`_build/pg-tls`: `ssl = on`, a private
  # CA, a certificate for localhost only, plain TCP refused, and the user
  # locks_cert logging in by client certificate alone), set up by running
  # that test once. Each form gets the library's verdict (a lock call after
  # a restart with the repo) and Postgrex 0.21's (`postgrex/2`: the :ssl
  # options it would build, in a handshake after the SSLRequest, as it
  # makes one). async: false: it restarts the application (AppEnv).
  use ExUnit.Case, async: false

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{AppEnv, Error, FakeRepo, TestDB}

  setup_all do
    {out, status} =
      System.cmd("cargo", ~w(test -p locks_core --test tls verify_full_with_the_right_ca),
        stderr_to_stdout: true
      )

    assert status == 0, out
    dir = Path.expand("_build/pg-tls")
    certs = Path.join(dir, "tls")
    port = dir |> Path.join("port") |> File.read!() |> String.trim() |> String.to_integer()

    der = fn file ->
      [{:Certificate, der, _}] = pem(Path.join(certs, file))
      der
    end

    %{
      port: port,
      path: &Path.join(certs, &1),
      ca: der.("ca.crt"),
      wrong: der.("wrong-ca.crt")
    }
  end

  setup do
    AppEnv.restore_on_exit()
    on_exit(fn -> Application.delete_env(:locks_fake_host, FakeRepo) end)
  end

  defp pem(file), do: :public_key.pem_decode(File.read!(file))

  defp https, do: [match_fun: :public_key.pkix_verify_hostname_match_fun(:https)]

  defp repo(ctx, host, tls, user \\ [username: "locks", password: "locks-test-pw"]) do
    [hostname: host, port: ctx.port, database: "locks"] ++ user ++ tls
  end

  # The library's verdict: :ok when a lock call ran over TLS, else the error.
  defp library(config) do
    Application.put_env(:locks_fake_host, FakeRepo, config)

    case AppEnv.restart_logged(repo: FakeRepo) do
      {:ok, _log} ->
        try do
          false = Locks.held?(TestDB.uuid(), TestDB.uuid(), "tls")
          :ok
        rescue
          error in Error -> {error.reason, error.message}
        end

      {{:error, reason}, _log} ->
        {:start, reason}
    end
  end

  # Postgrex 0.21's verdict on the handshake (lib/postgrex/protocol.ex):
  # ssl: true is [cacerts: cacerts_get()] ++ defaults, ssl: true with
  # ssl_opts: the list alone, a list is merged over the defaults; the
  # host name is the server_name_indication unless one is given.
  defp postgrex(config, port) do
    defaults = [verify: :verify_peer, customize_hostname_check: https()]

    opts =
      case {config[:ssl], config[:ssl_opts]} do
        {true, nil} -> [cacerts: :public_key.cacerts_get()] ++ defaults
        {true, opts} -> opts
        {opts, _} -> Keyword.merge(defaults, opts)
      end

    opts = Keyword.put_new(opts, :server_name_indication, to_charlist(config[:hostname]))
    {:ok, tcp} = :gen_tcp.connect(~c"127.0.0.1", port, [:binary, active: false])
    :ok = :gen_tcp.send(tcp, <<8::32, 80_877_103::32>>)
    {:ok, "S"} = :gen_tcp.recv(tcp, 1, 5_000)

    ExUnit.CaptureLog.capture_log(fn ->
      send(self(), {:handshake, :ssl.connect(tcp, opts, 5_000)})
    end)

    :gen_tcp.close(tcp)

    case receive(do: ({:handshake, result} -> result)) do
      {:ok, tls} -> :ssl.close(tls) && :ok
      {:error, _} -> :refused
    end
  end

  defp verdict(:ok), do: :ok
  defp verdict({:connect, _}), do: :refused
  defp verdict(other), do: other

  test "each form of the repo's ssl: gives Postgrex 0.21's verdict", ctx do
    {ca, wrong, file} = {ctx.ca, ctx.wrong, ctx.path}

    for {host, tls, expected} <- [
          {"localhost", [ssl: [cacerts: [ca]]], :ok},
          {"localhost", [ssl: [cacerts: [wrong]]], :refused},
          {"localhost", [ssl: [cacertfile: file.("ca.crt")]], :ok},
          {"localhost", [ssl: [cacertfile: to_charlist(file.("wrong-ca.crt"))]], :refused},
          {"127.0.0.1", [ssl: [cacerts: [ca]]], :refused},
          {"localhost", [ssl: true], :refused},
          {"localhost", [ssl: [cacerts: :public_key.cacerts_get()]], :refused},
          {"localhost", [ssl: [cacerts: :public_key.cacerts_get() ++ [ca]]], :ok},
          {"localhost", [ssl: [verify: :verify_none]], :ok},
          {"localhost", [ssl: [verify: :verify_none, cacerts: [wrong]]], :ok},
          {"127.0.0.1", [ssl: [cacerts: [ca], server_name_indication: ~c"localhost"]], :ok},
          {"127.0.0.1", [ssl: [cacerts: [ca], server_name_indication: :disable]], :ok},
          {"localhost", [ssl: [cacerts: [ca], customize_hostname_check: https()]], :ok},
          {"localhost",
           [ssl: true, ssl_opts: [verify: :verify_peer, cacertfile: file.("ca.crt")]], :ok},
          {"127.0.0.1", [ssl: true, ssl_opts: [verify: :verify_peer, cacerts: [ca]]], :refused},
          {"localhost", [ssl: true, ssl_opts: [verify: :verify_none]], :ok}
        ] do
      config = repo(ctx, host, tls)
      result = library(config)
      assert {host, tls, verdict(result)} == {host, tls, expected}
      assert {host, tls, postgrex(config, ctx.port)} == {host, tls, expected}
    end
  end

  test "a refusal names the server and the cause, and how to trust or not check", ctx do
    assert {:connect, message} = library(repo(ctx, "localhost", ssl: true))

    assert message ==
             "database connection failed: localhost:#{ctx.port}: error performing TLS " <>
               "handshake: invalid peer certificate: UnknownIssuer (checked as Postgrex 0.18 " <>
               "and later check it: name its CA with the repo's cacerts:/cacertfile: or " <>
               "ssl_ca_file; verify: :verify_none in the repo's ssl options, or sslmode: " <>
               ":require, connects without checking it, as older Postgrex did)"
  end

  test "ssl_opts: without verify: is verified (OTP 26's :ssl default; OTP 25's did not)", ctx do
    config = repo(ctx, "localhost", ssl: true, ssl_opts: [cacertfile: ctx.path.("wrong-ca.crt")])
    assert verdict(library(config)) == :refused
    otp_default = if :erlang.system_info(:otp_release) == ~c"25", do: :ok, else: :refused
    assert postgrex(config, ctx.port) == otp_default
  end

  test "a client certificate logs in the user that needs one: files or DER", ctx do
    user = [username: "locks_cert"]
    ca = [cacertfile: ctx.path.("ca.crt")]
    [{:Certificate, cert, _}] = pem(ctx.path.("client.crt"))
    [{type, key, :not_encrypted}] = pem(ctx.path.("client.key"))

    assert {:connect, message} = library(repo(ctx, "localhost", [ssl: ca], user))
    assert message =~ "connection requires a valid client certificate (28000)"

    files = [certfile: ctx.path.("client.crt"), keyfile: ctx.path.("client.key")]
    assert library(repo(ctx, "localhost", [ssl: ca ++ files], user)) == :ok

    assert library(repo(ctx, "localhost", [ssl: ca ++ [cert: cert, key: {type, key}]], user)) ==
             :ok
  end

  test "an :ssl option the library does not honour stops the start, naming itself", ctx do
    config =
      repo(ctx, "localhost",
        ssl: [cacerts: [ctx.ca], verify_fun: {fn _, _, s -> {:valid, s} end, []}]
      )

    assert {:start, reason} = library(config)

    assert inspect(reason) =~
             "FakeRepo.config()[:ssl][:verify_fun]: the library cannot run an Erlang verify function"
  end
end
