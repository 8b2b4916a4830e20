defmodule LocksBench.Workload do
  @moduledoc false
  # The workloads, each a list of the library's statements that one op runs
  # in turn, and each such op as the three sides run it: the library's
  # public call, Postgrex's prepared statement, a pgbench script line.
  #
  # Caller k of a workload works on rows of its own, the same on every
  # side: chat md5("bench/<workload>/chat/<k>")::uuid, its user likewise,
  # ref "bench-<workload>-<k>". pgbench cannot build strings: each client
  # fetches its values once, with \gset, in its first transaction.

  alias LocksBench.Peer
  alias PhoenixKitAgent.Turns.Locks

  @ttl 120
  # name => {what an op is, its statements, whether its callers hold their locks}
  @workloads %{
    "cycle" => {"acquire/4 + release/3", ["acquire", "release"], false},
    "reads" => {"held?/3 + fresh?/3", ["held?", "fresh?"], true},
    "held" => {"held?/3", ["held?"], true}
  }
  # Each statement's parameters, in `$n` order (acquire/4 passes the TTL as the hold).
  @params %{
    "acquire" => ~w(chat usr ref ttl ttl),
    "release" => ~w(chat usr ref),
    "held?" => ~w(chat usr ref),
    "fresh?" => ~w(chat ref ttl)
  }

  def names, do: ~w(cycle reads held)
  def statements, do: ~w(acquire held? fresh? release)
  def unit(w), do: elem(Map.fetch!(@workloads, w), 0)
  def calls(w), do: elem(Map.fetch!(@workloads, w), 1)
  def holds?(w), do: elem(Map.fetch!(@workloads, w), 2)
  def ttl, do: @ttl

  @doc "Caller k's values of workload `w`."
  def row(w, k),
    do: %{
      "chat" => uuid("bench/#{w}/chat/#{k}"),
      "usr" => uuid("bench/#{w}/user/#{k}"),
      "ref" => "bench-#{w}-#{k}",
      "ttl" => @ttl
    }

  @doc "md5(text)::uuid, as PostgreSQL spells it."
  def uuid(text) do
    <<a::binary-8, b::binary-4, c::binary-4, d::binary-4, e::binary-12>> =
      Base.encode16(:crypto.hash(:md5, text), case: :lower)

    Enum.join([a, b, c, d, e], "-")
  end

  @doc "Takes the locks of callers 0..n-1 of `w`, for the workloads that read them."
  def hold!(w, n), do: for(k <- 0..(n - 1), do: call("acquire", row(w, k)))

  @doc "Caller k's op through the library: it returns the statements it ran."
  def library_op(w, k) do
    {row, calls} = {row(w, k), calls(w)}

    fn ->
      Enum.each(calls, &call(&1, row))
      length(calls)
    end
  end

  @doc "One library call, its answer checked: the one a caller on its own rows gets."
  def call("acquire", r), do: :ok = Locks.acquire(r["chat"], r["usr"], r["ref"], @ttl)
  def call("release", r), do: :ok = Locks.release(r["chat"], r["usr"], r["ref"])
  def call("held?", r), do: true = Locks.held?(r["chat"], r["usr"], r["ref"])
  def call("fresh?", r), do: true = Locks.fresh?(r["chat"], r["ref"], @ttl)

  @doc "Caller k's op through Postgrex, the same statements with the same parameters."
  def peer_op(peer, w, k) do
    row =
      Map.new(row(w, k), fn {var, v} -> {var, if(var in ["chat", "usr"], do: bin(v), else: v)} end)

    steps = for name <- calls(w), do: {name, Enum.map(Map.fetch!(@params, name), &row[&1])}

    fn ->
      for {name, params} <- steps, do: check(name, Peer.execute(peer, name, params))
      length(steps)
    end
  end

  defp check("acquire", [[true | _]]), do: :ok
  defp check("release", _rows), do: :ok
  defp check(name, [[true]]) when name in ["held?", "fresh?"], do: :ok

  # A uuid as Postgrex takes it: its 16 bytes.
  defp bin(uuid), do: Base.decode16!(String.replace(uuid, "-", ""), case: :lower)

  @doc """
  Workload `w` as a pgbench script of the statement `texts` (`%{name => sql}`),
  each `$n` bound to a pgbench variable (pgbench sends each occurrence as a
  parameter of its own: the same plan, a few more bytes to bind). A
  `:name` inside a string literal would be read as a variable, hence `/`.
  """
  def script(w, texts) do
    init = """
    \\if :inited = 0
    SELECT md5('bench/#{w}/chat/' || :client_id)::uuid AS chat,
           md5('bench/#{w}/user/' || :client_id)::uuid AS usr,
           'bench-#{w}-' || :client_id AS ref \\gset
    \\set inited 1
    \\endif
    """

    Enum.map_join(calls(w), "", fn name ->
      vars = Map.fetch!(@params, name)

      sql =
        Regex.replace(~r/\$(\d+)/, Map.fetch!(texts, name), fn _, i ->
          ":" <> Enum.at(vars, String.to_integer(i) - 1)
        end)

      String.trim(sql) <> ";\n"
    end)
    |> then(&(init <> &1))
  end
end
