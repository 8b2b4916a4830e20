defmodule PhoenixKitAgent.Turns.CompilerTest do
  # The Mix compiler's install step: a VM that loaded the library keeps
  # its file (and so its code) when a new build is installed.
  use ExUnit.Case, async: true

  alias Mix.Tasks.Compile.LocksNif

  setup do
    dir = Path.join(System.tmp_dir!(), "locks_compiler_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir}
  end

  test "a new build is renamed into place: the installed file is never written into",
       %{dir: dir} do
    dest = Path.join(dir, "priv/native/liblocks_nif.so")

    assert LocksNif.install("old build", dest) == {:ok, []}
    %File.Stat{inode: installed} = File.stat!(dest)
    # As a VM that has it loaded (mapped) does, keep the installed file open.
    {:ok, loaded} = File.open(dest, [:read, :binary])

    assert LocksNif.install("new build", dest) == {:ok, []}
    assert File.stat!(dest).inode != installed
    assert File.read!(dest) == "new build"
    assert IO.binread(loaded, :eof) == "old build"
    File.close(loaded)

    assert LocksNif.install("new build", dest) == {:noop, []}
    assert File.ls!(Path.dirname(dest)) == ["liblocks_nif.so"], "no staged file left behind"
  end

  test "the NIF compiler runs after Elixir's, which compile it" do
    assert List.last(Mix.Project.config()[:compilers]) == :locks_nif
  end
end
