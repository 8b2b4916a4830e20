defmodule PhoenixKitAgent.Turns.ScriptsPgTest do
  # The README's commands start the private cluster with scripts/pg. A clone
  # in a private directory (root's home is mode 700 on Debian, so is a
  # `mktemp -d` folder) must work too, although the postgres user that runs
  # the cluster cannot enter it.
  use ExUnit.Case, async: true

  @moduletag :slow

  setup do
    parent = Path.join(System.tmp_dir!(), "locks_private_#{System.unique_integer([:positive])}")
    File.mkdir_p!(parent)
    File.chmod!(parent, 0o700)
    dir = Path.join(parent, "pg")

    on_exit(fn ->
      pg(dir, "stop")
      # The cluster itself lives where the postgres user can reach it.
      with {:ok, target} <- File.read_link(dir), do: File.rm_rf!(target)
      File.rm_rf!(parent)
    end)

    %{dir: dir}
  end

  defp pg(dir, command),
    do:
      System.cmd(Path.expand("scripts/pg"), [command],
        env: [{"LOCKS_PG_DIR", dir}],
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
end
