defmodule PhoenixKitAgent.Turns.Locks.Robust.Replica do
  @moduledoc false
  # A primary and its streaming standby, for the failover tests: two
  # clusters of the test module's own, made anew for each test, in
  # /var/tmp (fresh_dir!/1), laid out as scripts/pg
  # lays one out (data/, port, sock/, server.log) so that `scripts/pg stop`
  # and `scripts/servers stop` stop either. The primary is started by
  # `scripts/pg start` (which lists it in LOCKS_PG_REGISTRY); the standby is
  # a `pg_basebackup -R` of it, listed there before it starts. Both listen on
  # ports of their own, outside scripts/pg's 25432-25532 and the kernel's
  # ephemeral range (see Robust.Pg.own_port!/2), from the top of the range
  # whose bottom the fault cluster takes.

  alias PhoenixKitAgent.Turns.Locks.Robust.Pg
  alias PhoenixKitAgent.Turns.Locks.TestDB

  @password "locks-test-pw"

  @doc """
  Makes a primary and a standby streaming from it, each on a port of its
  own, the library's tables on both; `%{a: primary, b: standby}`, each
  `%{dir, port, url}`. Both are stopped when the test ends.
  """
  def pair! do
    [a, b] = for name <- ["a", "b"], do: fresh_dir!("pg-failover-" <> name)
    ExUnit.Callbacks.on_exit(fn -> Enum.each([b, a], &Pg.stop!/1) end)

    url = Pg.start!(a)

    # Chosen and bound under scripts/pg's port lock, as every cluster's port.
    {port_a, port_b} =
      Pg.with_port_lock(fn ->
        [port_a, port_b] = Enum.take(Enum.filter(ports(), &Pg.free_port?/1), 2)
        :ok = Pg.stop_fast!(a)
        File.write!(Path.join(a, "port"), "#{port_a}\n")
        :ok = Pg.restart!(a)
        {port_a, port_b}
      end)

    url_a = url(url, port_a)
    TestDB.query!(PhoenixKitAgent.Turns.Locks.Native.ddl(:tables, nil), url_a)

    :ok = Pg.with_port_lock(fn -> standby_of!(b, a, port_b) end)
    url_b = url(url, port_b)
    until!(fn -> TestDB.query!("SELECT pg_is_in_recovery()", url_b) == [["t"]] end)
    caught_up!(url_a, url_b)

    %{a: %{dir: a, port: port_a, url: url_a}, b: %{dir: b, port: port_b, url: url_b}}
  end

  @doc """
  Makes `dir` a standby of the running cluster in `primary` (`pg_basebackup
  -R`, its data made anew) and starts it on `port`; listed in
  LOCKS_PG_REGISTRY first.
  """
  def standby_of!(dir, primary, port) do
    :ok = stop_if_running(dir)
    data = Path.join(dir, "data")
    sock = Path.join(dir, "sock")
    {_, 0} = run(["rm", "-rf", data, sock])
    {_, 0} = run(as_pg(["mkdir", "-p", sock]))
    source = [{"-h", Path.join(primary, "sock")}, {"-p", read_port(primary)}]

    {out, status} =
      run(
        as_pg(
          ["pg_basebackup" |> bin(), "-D", data, "-R", "-X", "stream", "-c", "fast"] ++
            Enum.flat_map(source, &Tuple.to_list/1) ++ ["-U", "postgres"]
        )
      )

    if status != 0, do: raise("pg_basebackup failed (#{status}): #{out}")
    File.write!(Path.join(dir, "port"), "#{port}\n")

    if registry = System.get_env("LOCKS_PG_REGISTRY"),
      do: File.write!(registry, dir <> "\n", [:append])

    {out, status} =
      run(
        as_pg([
          bin("pg_ctl"),
          "-D",
          data,
          "-l",
          Path.join(dir, "server.log"),
          "-o",
          "-p #{port} -k #{sock}",
          "-w",
          "-t",
          "60",
          "start"
        ])
      )

    if status != 0, do: raise("pg_ctl start of the standby failed (#{status}): #{out}")
    :ok
  end

  @doc "Promotes the standby in `dir` (`pg_ctl promote`, waiting until it takes writes)."
  def promote!(dir) do
    {out, status} = run(as_pg([bin("pg_ctl"), "-D", Path.join(dir, "data"), "-w", "promote"]))
    if status != 0, do: raise("pg_ctl promote failed (#{status}): #{out}")
    :ok
  end

  @doc """
  Waits until the standby at `standby_url` has replayed everything the
  primary at `primary_url` has written so far (asynchronous replication:
  what it has not, a failover loses).
  """
  def caught_up!(primary_url, standby_url) do
    [[lsn]] = TestDB.query!("SELECT pg_current_wal_lsn()", primary_url)
    sql = "SELECT pg_last_wal_replay_lsn() >= '#{lsn}'::pg_lsn"
    until!(fn -> TestDB.query!(sql, standby_url) == [["t"]] end)
  end

  @doc "The connections of `application_name` on the server at `url`."
  def connections(url, application_name) do
    sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = '#{application_name}'"
    [[n]] = TestDB.query!(sql, url)
    String.to_integer(n)
  end

  @doc "Polls `fun` until it is true, for at most `ms` (raises after)."
  def until!(fun, ms \\ 30_000) do
    deadline = System.monotonic_time(:millisecond) + ms

    Stream.repeatedly(fn ->
      cond do
        fun.() -> true
        System.monotonic_time(:millisecond) > deadline -> raise "not true within #{ms} ms"
        true -> receive(do: (:never -> nil), after: (20 -> nil))
      end
    end)
    |> Enum.find(& &1)

    :ok
  end

  @doc "The URL of `url` with `port`; the role is scripts/pg's."
  def url(url, port), do: url |> URI.parse() |> Map.put(:port, port) |> URI.to_string()

  def password, do: @password

  # In /var/tmp, named after this checkout: the postgres user must reach the
  # directory, which it cannot under a private parent (root's home, a
  # `mktemp -d` folder), and pg_basebackup and pg_ctl run as postgres with
  # its path (scripts/pg puts its own clusters there for the same reason).
  defp fresh_dir!(name) do
    checkout = File.cwd!() |> :erlang.phash2() |> Integer.to_string()
    dir = Path.join("/var/tmp", "phoenix_kit_agent_locks-#{name}-#{checkout}")
    :ok = stop_if_running(dir)
    {_, 0} = run(["rm", "-rf", dir])
    File.mkdir_p!(dir)
    if root?(), do: {_, 0} = System.cmd("chown", ["postgres:postgres", dir])
    dir
  end

  defp stop_if_running(dir) do
    if File.exists?(Path.join(dir, "data/postmaster.pid")), do: Pg.stop!(dir)
    :ok
  end

  defp read_port(dir), do: dir |> Path.join("port") |> File.read!() |> String.trim()

  # The top 50 of the fault cluster's 100 ports (it takes the first free one).
  defp ports, do: Pg.own_ports() |> Enum.reverse() |> Enum.take(50)

  defp bin(name) do
    "/usr/lib/postgresql/*/bin/#{name}"
    |> Path.wildcard()
    |> Enum.sort_by(&(&1 |> Path.split() |> Enum.at(-3) |> String.to_integer()))
    |> List.last() || raise "no #{name}"
  end

  defp root?, do: System.cmd("id", ["-u"]) |> elem(0) |> String.trim() == "0"
  defp as_pg(cmd), do: if(root?(), do: ["runuser", "-u", "postgres", "--" | cmd], else: cmd)
  defp run([exe | args]), do: System.cmd(exe, args, stderr_to_stdout: true, cd: "/")
end
