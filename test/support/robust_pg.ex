defmodule PhoenixKitAgent.Turns.Locks.Robust.Pg do
  @moduledoc false
  # PostgreSQL as the robustness tests need it beyond plain SQL:
  #
  #   * a SECOND cluster of their own (scripts/pg with LOCKS_PG_DIR), which
  #     the fault tests stop with `pg_ctl stop -m immediate`, freeze with
  #     SIGSTOP and start again. The first cluster (_build/pg) is shared with
  #     everyone and is never stopped here.
  #   * databases of their own on the shared cluster (created per run, with
  #     a random suffix, dropped afterwards), for the variants of server
  #     settings and for counters that only the test moves.

  alias PhoenixKitAgent.Turns.Locks.TestDB

  @doc "The fault cluster's directory: `_build/pg-faults` (as scripts/pg expects: see CONTRIBUTING.md)."
  def faults_dir do
    dir = Path.expand("_build/pg-faults")

    # scripts/pg moves a cluster the postgres user cannot reach to /var/tmp,
    # under a name derived from the checkout alone, and `rm -rf`s that place
    # first: for a second cluster that would be the FIRST cluster's data.
    # Creating the directory here (owned by postgres) keeps it from doing so;
    # where postgres cannot reach _build, the cluster goes to a /var/tmp
    # directory of its own.
    dir =
      if root?() and not postgres_can_reach?(Path.dirname(dir)),
        do: "/var/tmp/phoenix_kit_agent_locks-pg-faults-#{:erlang.phash2(dir)}",
        else: dir

    File.mkdir_p!(dir)
    if root?(), do: {_, 0} = System.cmd("chown", ["postgres:postgres", dir])
    dir
  end

  defp root?, do: System.cmd("id", ["-u"]) |> elem(0) |> String.trim() == "0"

  defp postgres_can_reach?(dir),
    do: match?({_, 0}, System.cmd("runuser", ["-u", "postgres", "--", "test", "-x", dir]))

  @doc """
  Takes the fault cluster for the calling test module, from `setup_all`:
  an exclusive lock on its directory, held by a process of its own until
  the module's `on_exit` has stopped the cluster (two modules, or two runs
  of the suite in one checkout, take turns with it instead of stopping it
  under each other); then starts it on a port of its own. `{dir, url}`.
  """
  def take_faults_cluster! do
    dir = faults_dir()
    test = self()

    holder =
      spawn(fn ->
        port = lock!(dir)
        send(test, {:locked, self()})

        receive do
          {:release, from} ->
            Port.close(port)
            send(from, :released)
        end
      end)

    receive do
      {:locked, ^holder} -> :ok
    after
      600_000 -> raise "could not lock #{dir} within 10 minutes"
    end

    ExUnit.Callbacks.on_exit(fn ->
      stop!(dir)
      send(holder, {:release, self()})

      receive do
        :released -> :ok
      after
        10_000 -> :ok
      end
    end)

    {dir, own_port!(dir, start!(dir))}
  end

  # An exclusive lock on `dir` for as long as the calling process lives.
  defp lock!(dir), do: flock!(Path.join(dir, ".robust.lock"))

  # An exclusive lock on `path` until the returned port is closed or the
  # calling process exits (a `flock` child that waits on its stdin).
  defp flock!(path) do
    port =
      Port.open({:spawn_executable, System.find_executable("flock")}, [
        :binary,
        :exit_status,
        {:line, 1024},
        args: ["-x", path, "-c", "echo locked; exec cat"]
      ])

    receive do
      {^port, {:data, {:eol, "locked"}}} -> port
    end
  end

  @doc "Starts the cluster in `dir` (initdb the first time); its URL."
  def start!(dir) do
    {out, 0} = System.cmd(Path.expand("scripts/pg"), ["start"], env: [{"LOCKS_PG_DIR", dir}])
    [_, url] = Regex.run(~r/DATABASE_URL='([^']+)'/, out)
    url
  end

  @doc """
  Moves the running cluster of `dir` to a port of its own and returns its
  URL. The fault tests restart it on the same port (the nodes' URL must stay
  valid), and while it is down two things can take that port: another
  scripts/pg cluster starting meanwhile (it picks from 25432-25532), and the
  nodes themselves: a client that keeps connecting to a closed local port
  inside the kernel's ephemeral range (ip_local_port_range, often
  32768-60999) eventually gets that very port as its source port and
  connects to itself (TCP simultaneous open), holding it. So the port is
  chosen outside both. It is chosen and bound under scripts/pg's port lock:
  another checkout's fault tests, moving their cluster at the same moment,
  would find the same port free.
  """
  def own_port!(dir, url) do
    current = port(dir)
    range = own_ports()

    port =
      if current in range do
        current
      else
        with_port_lock(fn ->
          port = Enum.find(range, &free_port?/1) || raise "no free port in #{inspect(range)}"
          data = Path.join(dir, "data")
          {_, 0} = run(as_pg([pg_ctl(), "-D", data, "-m", "fast", "-w", "stop"]))
          File.write!(Path.join(dir, "port"), "#{port}\n")
          :ok = restart!(dir)
          port
        end)
      end

    url |> URI.parse() |> Map.put(:port, port) |> URI.to_string()
  end

  @doc """
  Runs `fun` holding the lock scripts/pg chooses and binds its ports under
  (a directory: see PORT_LOCK there): a port chosen and bound inside is
  nobody else's, whatever starts at the same moment.
  """
  @port_lock "/var/tmp/phoenix_kit_agent_locks-ports.lock"
  def with_port_lock(fun) do
    File.mkdir_p!(@port_lock)
    lock = flock!(@port_lock)

    try do
      fun.()
    after
      Port.close(lock)
    end
  end

  @doc "The fault clusters' 100 ports: below the kernel's ephemeral range, or else above it."
  def own_ports do
    [low, high] =
      case File.read("/proc/sys/net/ipv4/ip_local_port_range") do
        {:ok, text} -> text |> String.split() |> Enum.map(&String.to_integer/1)
        {:error, _} -> [32_768, 60_999]
      end

    cond do
      low > 15_531 -> 15_432..15_531
      high < 65_000 -> (high + 100)..(high + 199)
      true -> raise "no port range outside the ephemeral ports #{low}-#{high}"
    end
  end

  defp port(dir),
    do: dir |> Path.join("port") |> File.read!() |> String.trim() |> String.to_integer()

  @doc "Whether nothing listens on `port` of 127.0.0.1 (bind it under `with_port_lock/1`)."
  def free_port?(port) do
    case :gen_tcp.listen(port, ip: {127, 0, 0, 1}) do
      {:ok, socket} -> :gen_tcp.close(socket) == :ok
      {:error, _} -> false
    end
  end

  @doc "Starts the cluster of `dir` again (on its own port) unless it runs."
  def ensure_running!(dir) do
    case run(as_pg([pg_ctl(), "-D", Path.join(dir, "data"), "status"])) do
      {_, 0} -> :ok
      _ -> restart!(dir)
    end
  end

  @doc "Stops it the polite way (scripts/pg stop)."
  def stop!(dir) do
    {_, 0} = System.cmd(Path.expand("scripts/pg"), ["stop"], env: [{"LOCKS_PG_DIR", dir}])
    :ok
  end

  @doc "Stops the cluster of `dir` the way a restart does (`pg_ctl stop -m fast`), waiting for it."
  def stop_fast!(dir) do
    {out, status} =
      run(as_pg([pg_ctl(), "-D", Path.join(dir, "data"), "-m", "fast", "-w", "stop"]))

    if status != 0, do: raise("pg_ctl stop failed (#{status}): #{out}")
    :ok
  end

  @doc "The `pg_ctl stop -m immediate` command for `dir`, as `[executable | args]`."
  def crash_command(dir),
    do: as_pg([pg_ctl(), "-D", Path.join(dir, "data"), "-m", "immediate", "-w", "stop"])

  @doc "Starts the stopped cluster again on the port it had (the URL stays valid)."
  def restart!(dir) do
    port = dir |> Path.join("port") |> File.read!() |> String.trim()
    data = Path.join(dir, "data")
    log = Path.join(dir, "server.log")

    [exe | args] =
      as_pg([pg_ctl(), "-D", data, "-l", log, "-o", "-p #{port}", "-w", "-t", "60", "start"])

    {out, status} = System.cmd(exe, args, stderr_to_stdout: true)
    if status != 0, do: raise("pg_ctl start failed (#{status}): #{out}")
    :ok
  end

  @doc "Sends `signal` (\"STOP\", \"CONT\") to the postmaster of `dir` and all its children."
  def signal!(dir, signal) do
    [postmaster | _] =
      dir |> Path.join("data/postmaster.pid") |> File.read!() |> String.split("\n")

    {children, _} = System.cmd("pgrep", ["-P", postmaster])
    pids = [postmaster | String.split(children, "\n", trim: true)]
    # A backend may have exited since pgrep listed it: that is no failure.
    System.cmd("kill", ["-#{signal}" | pids], stderr_to_stdout: true)
    pids
  end

  @doc "Runs `cmd` (`[executable | args]`); its exit status and output."
  def run([exe | args]), do: System.cmd(exe, args, stderr_to_stdout: true)

  defp pg_ctl do
    "/usr/lib/postgresql/*/bin/pg_ctl"
    |> Path.wildcard()
    |> Enum.sort_by(&(&1 |> Path.split() |> Enum.at(-3) |> String.to_integer()))
    |> List.last() || raise "no pg_ctl"
  end

  defp as_pg(cmd), do: if(root?(), do: ["runuser", "-u", "postgres", "--" | cmd], else: cmd)

  # -- databases of the test's own on the shared cluster --------------------------

  @doc """
  Creates a database `locks_robust_<name>_<random>` on the shared cluster,
  runs `sql` in it (after the tables are made: `tables:` the DDL, the
  library's own by default), and returns `{dbname, url}`. It is dropped when
  the test ends.
  """
  def create_database!(name, opts \\ []) do
    db = "locks_robust_#{name}_#{System.unique_integer([:positive])}_#{:rand.uniform(1_000_000)}"
    TestDB.query!("CREATE DATABASE #{db}", TestDB.url())

    ExUnit.Callbacks.on_exit(fn ->
      TestDB.query!("DROP DATABASE IF EXISTS #{db} WITH (FORCE)", TestDB.url())
    end)

    for setting <- Keyword.get(opts, :settings, []),
        do: TestDB.query!("ALTER DATABASE #{db} SET #{setting}")

    url = database_url(db)

    tables =
      Keyword.get_lazy(opts, :tables, fn ->
        PhoenixKitAgent.Turns.Locks.Native.ddl(:tables, nil)
      end)

    TestDB.query!(tables <> ";\n" <> Keyword.get(opts, :sql, "SELECT 1"), url)
    {db, url}
  end

  @doc "The shared cluster's URL, for database `db`."
  def database_url(db),
    do: TestDB.url() |> URI.parse() |> Map.put(:path, "/" <> db) |> URI.to_string()
end
