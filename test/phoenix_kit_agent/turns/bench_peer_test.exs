defmodule PhoenixKitAgent.Turns.BenchPeerTest do
  # `mix locks.bench --peer postgrex` in this project, which has no Postgrex:
  # the task says how to get the comparison (from a host app) and measures
  # nothing. With Postgrex (a host app) it is run by hand: bench/README.md.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks.Bench.Peer

  test "without Postgrex, --peer postgrex stops before measuring and says to run it from a host app" do
    refute Code.ensure_loaded?(Postgrex)

    error =
      assert_raise Mix.Error, fn ->
        Mix.Tasks.Locks.Bench.run(["--peer", "postgrex", "--out", "/nonexistent/never.md"])
      end

    assert error.message =~ ~r/\Alocks\.bench: --peer: Postgrex is not loaded\.\n\n/
    assert error.message =~ "Run the bench from a host app that has Postgrex"
    assert error.message =~ ~s({:phoenix_kit_agent_locks, path: "…", env: :dev})
    assert error.message =~ "MIX_ENV=dev mix locks.bench --peer postgrex"
  end

  test "an unknown peer is refused with the known ones" do
    assert Peer.check("mysql") == {:error, ~s(unknown peer "mysql"; known: postgrex)}
    assert Peer.check(nil) == {:ok, nil}
  end
end
