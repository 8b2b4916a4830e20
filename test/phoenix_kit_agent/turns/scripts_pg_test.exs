defmodule PhoenixKitAgent.Turns.ScriptsPgTest do
  # The README's commands start the private cluster with scripts/pg
  # (CONTRIBUTING.md, "Build, test, bench, release"). A clone in a private directory (root's
  # home is mode 700 on Debian, so is a `mktemp -d` folder) must work too,
  # although the postgres user that runs the cluster cannot enter it.
  use ExUnit.Case, async: true

  @moduletag :slow

  setup do
    # Unique across VMs too: two runs of the suite on one machine share /tmp.
    unique = "#{System.pid()}_#{System.unique_integer([:positive])}"
    parent = Path.join(System.tmp_dir!(), "locks_private_#{unique}")
    File.mkdir_p!(parent)
    File.chmod!(parent, 0o700)
    dir = Path.join(parent, "pg")

    on_exit(fn ->
      remove(dir)
      File.rm_rf!(parent)
    end)

    %{dir: dir}
  end

  # Stops the cluster of `dir` and deletes it, where it lives: where the
  # postgres user can reach it.
  defp remove(dir) do
    pg(dir, "stop")
    with {:ok, target} <- File.read_link(dir), do: File.rm_rf!(target)
  end

  defp pg(dir, command, env \\ []),
    do:
      System.cmd(Path.expand("scripts/pg"), [command],
        env: [{"LOCKS_PG_DIR", dir} | env],
        stderr_to_stdout: true
      )

  defp servers(command, registry),
    do:
      System.cmd(Path.expand("scripts/servers"), [command],
        env: [{"LOCKS_PG_REGISTRY", registry}],
        stderr_to_stdout: true
      )

  test "scripts/pg start runs a cluster for a directory under a mode-700 parent", %{dir: dir} do
    {out, status} = pg(dir, "start")

    assert status == 0, out
    refute out =~ "Permission denied"
    assert [_, url] = Regex.run(~r/DATABASE_URL='([^']+)'/, out)
    assert {"1\n", 0} = System.cmd("psql", ["-X", "-Atc", "SELECT 1", url])
    assert pg(dir, "url") == {url <> "\n", 0}
  end

  # Two starts at the same moment (this module's cluster and the fault tests',
  # in one run of the suite) found the same port free, and the second server
  # could not bind it: scripts/pg now chooses and binds under a lock, which no
  # server may inherit (it would hold the lock for as long as it runs).
  @tag timeout: 120_000
  test "scripts/pg start at the same moment: every cluster runs, each on a port of its own",
       %{dir: dir} do
    dirs = for i <- 1..3, do: "#{dir}-#{i}"
    for d <- dirs, do: on_exit(fn -> remove(d) end)

    # Made (initdb) first, so that the three starts choose their ports together.
    for d <- dirs do
      {_, 0} = pg(d, "start")
      {_, 0} = pg(d, "stop")
    end

    urls =
      dirs
      |> Task.async_stream(&pg(&1, "start"), max_concurrency: 3, timeout: 60_000)
      |> Enum.map(fn {:ok, {out, status}} ->
        assert status == 0, out
        assert [_, url] = Regex.run(~r/DATABASE_URL='([^']+)'/, out)
        url
      end)

    assert urls |> Enum.map(&URI.parse(&1).port) |> Enum.uniq() |> length() == 3

    for {d, url} <- Enum.zip(dirs, urls) do
      assert {"1\n", 0} = System.cmd("psql", ["-X", "-Atc", "SELECT 1", url])
      assert pg(d, "url") == {url <> "\n", 0}
    end

    lock = "/var/tmp/phoenix_kit_agent_locks-ports.lock"
    assert System.cmd("flock", ["-w", "30", lock, "true"]) == {"", 0}
  end

  # What scripts/test runs at its end, on success, failure or a signal.
  test "scripts/servers: check fails while a cluster listed by scripts/pg start runs, even " <>
         "frozen; stop stops it (and its PgBouncers), then check passes and forgets the list",
       %{dir: dir} do
    registry = Path.join(Path.dirname(dir), "servers")
    {_, 0} = pg(dir, "start", [{"LOCKS_PG_REGISTRY", registry}])
    {_, 0} = pg(dir, "bouncer")
    target = File.read_link(dir) |> elem(1) || dir
    assert File.read!(registry) == Path.expand(target) <> "\n"

    postmaster =
      dir |> Path.join("data/postmaster.pid") |> File.read!() |> String.split("\n") |> hd()

    bouncers =
      for mode <- ~w(transaction session),
          do: File.read!(Path.join(dir, "pgbouncer-#{mode}/pgbouncer.pid")) |> String.trim()

    {out, status} = servers("check", registry)
    assert status == 1

    assert out |> String.split("\n", trim: true) |> Enum.sort() ==
             Enum.sort(
               for {pid, command} <- [
                     {postmaster, "postgres"} | Enum.map(bouncers, &{&1, "pgbouncer"})
                   ],
                   do: "servers: left running: #{pid} #{command} (of #{Path.expand(target)})"
             )

    # Frozen, as a killed fault test leaves its cluster: pg_ctl stop alone would hang.
    {_, 0} = System.cmd("kill", ["-STOP", postmaster])
    assert servers("stop", registry) == {"", 0}
    assert servers("check", registry) == {"", 0}
    refute File.exists?(registry)
    # pg_ctl's wait ends when the postmaster removes its pid file, just before it exits.
    assert Enum.any?(1..100, fn _ ->
             Process.sleep(50)
             match?({_, 1}, System.cmd("kill", ["-0", postmaster], stderr_to_stdout: true))
           end)
  end
end
