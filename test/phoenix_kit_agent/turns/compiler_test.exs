defmodule PhoenixKitAgent.Turns.CompilerTest do
  # The Mix compiler's install step: a VM that loaded the library keeps
  # its file (and so its code) when a new build is installed. And its stamp:
  # compiling again with nothing changed runs no cargo and prints nothing,
  # with a fake cargo (a script that records its calls) on a library
  # directory of the test's own.
  use ExUnit.Case, async: true

  import ExUnit.CaptureIO

  alias Mix.Tasks.Compile.LocksNif

  setup do
    dir = Path.join(System.tmp_dir!(), "locks_compiler_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir}
  end

  test "a new build installed while the VM runs the NIF it replaces is a warning " <>
         "naming the way out; a current one, or one installed first, passes silently",
       %{dir: dir} do
    dest = Path.join(dir, "liblocks_nif.so")

    message =
      "#{dest} is a new build, but this VM runs the NIF it replaces (rustler cannot " <>
        "replace a loaded NIF): what runs in this VM runs the old native code; " <>
        "run the command again, or restart the VM"

    {{:ok, [%{message: ^message, severity: :warning}]}, printed} =
      with_io(:stderr, fn -> LocksNif.stale({:ok, []}, true, dest) end)

    assert printed == "locks_nif: warning: #{message}\n"
    assert LocksNif.stale({:noop, []}, true, dest) == {:noop, []}
    assert LocksNif.stale({:ok, []}, false, dest) == {:ok, []}
  end

  test "a new build is renamed into place: the installed file is never written into",
       %{dir: dir} do
    dest = Path.join(dir, "priv/native/liblocks_nif.so")

    assert LocksNif.install("old build", dest, "test") == {:ok, []}
    %File.Stat{inode: installed} = File.stat!(dest)
    # As a VM that has it loaded (mapped) does, keep the installed file open.
    {:ok, loaded} = File.open(dest, [:read, :binary])

    assert LocksNif.install("new build", dest, "test") == {:ok, []}
    assert File.stat!(dest).inode != installed
    assert File.read!(dest) == "new build"
    assert IO.binread(loaded, :eof) == "old build"
    File.close(loaded)

    assert LocksNif.install("new build", dest, "test") == {:noop, []}

    assert Enum.sort(File.ls!(Path.dirname(dest))) == ["liblocks_nif.so", "liblocks_nif.so.stamp"],
           "no staged file left behind"
  end

  test "the NIF compiler runs after Elixir's, which compile it" do
    assert List.last(Mix.Project.config()[:compilers]) == :locks_nif
  end

  describe "the stamp beside the library" do
    setup %{dir: dir} do
      root = Path.join(dir, "library")

      for {path, text} <- [
            {"Cargo.toml", "[workspace]\n"},
            {"Cargo.lock", "version = 4\n"},
            {"native/locks_nif/Cargo.toml", "[package]\n"},
            {"native/locks_nif/src/lib.rs", "// v1\n"}
          ] do
        File.mkdir_p!(Path.dirname(Path.join(root, path)))
        File.write!(Path.join(root, path), text)
      end

      cargo = Path.join(dir, "cargo")

      File.write!(cargo, """
      #!/bin/sh
      echo called >> #{Path.join(dir, "cargo_calls")}
      echo '   Compiling locks_nif'
      mkdir -p target/release
      printf 'built by cargo' > target/release/liblocks_nif.so
      """)

      File.chmod!(cargo, 0o755)
      # This repository's test build: from source, as the tests run in MIX_ENV=test.
      settings = %{LocksNif.settings(root, %{}, []) | cargo: cargo}
      assert settings.build == {:source, nil}
      %{root: root, settings: settings, dest: Path.join(dir, "priv/native/liblocks_nif.so")}
    end

    defp compile(settings, dest) do
      parent = self()
      # Errors go to stderr, and are asserted from the result.
      compile = fn -> send(parent, {:compiled, LocksNif.compile(settings, dest)}) end
      out = capture_io(fn -> capture_io(:stderr, compile) end)
      assert_received {:compiled, result}
      {result, out}
    end

    defp cargo_calls(dir) do
      case File.read(Path.join(dir, "cargo_calls")) do
        {:ok, calls} -> length(String.split(calls, "\n", trim: true))
        {:error, :enoent} -> 0
      end
    end

    test "a second compile runs no cargo and prints nothing until a source, Cargo.lock or the library changes",
         %{dir: dir, root: root, settings: settings, dest: dest} do
      assert compile(settings, dest) == {{:ok, []}, "   Compiling locks_nif\n"}
      assert cargo_calls(dir) == 1

      assert File.ls!(Path.dirname(dest)) |> Enum.sort() ==
               ~w(liblocks_nif.so liblocks_nif.so.stamp)

      assert compile(settings, dest) == {{:noop, []}, ""}
      # A new mtime alone (a checkout, a copy) is no change.
      File.touch!(Path.join(root, "native/locks_nif/src/lib.rs"), System.os_time(:second) + 60)
      assert compile(settings, dest) == {{:noop, []}, ""}
      assert cargo_calls(dir) == 1

      # cargo builds the same bytes again: the library stays, the stamp is renewed.
      for {path, text} <- [{"native/locks_nif/src/lib.rs", "// v2\n"}, {"Cargo.lock", "v5"}] do
        File.write!(Path.join(root, path), text)
        assert compile(settings, dest) == {{:noop, []}, "   Compiling locks_nif\n"}
        assert compile(settings, dest) == {{:noop, []}, ""}
      end

      assert cargo_calls(dir) == 3

      # What cargo leaves under native/ is no source.
      File.mkdir_p!(Path.join(root, "native/locks_nif/target"))
      File.write!(Path.join(root, "native/locks_nif/target/build.log"), "x")
      assert compile(settings, dest) == {{:noop, []}, ""}

      # The installed file replaced by anything else is built again, and so is a debug build.
      File.write!(dest, "other bytes")
      assert compile(settings, dest) == {{:ok, []}, "   Compiling locks_nif\n"}

      assert {{:error, _}, "   Compiling locks_nif\n"} =
               compile(%{settings | profile: "debug"}, dest)

      assert cargo_calls(dir) == 5
    end

    test "without cargo, a current library is kept silently; a stale or missing one names the way out",
         %{root: root, settings: settings, dest: dest} do
      no_cargo = %{settings | cargo: nil}

      assert {{:error, [%{message: missing}]}, _} = compile(no_cargo, dest)

      assert missing ==
               "cargo not found on PATH or in ~/.cargo/bin, and #{dest} is missing: " <>
                 "install Rust (https://rustup.rs) so that cargo is on PATH"

      assert {{:ok, []}, _} = compile(settings, dest)
      assert compile(no_cargo, dest) == {{:noop, []}, ""}

      File.write!(Path.join(root, "native/locks_nif/src/lib.rs"), "// v2\n")
      assert {{:error, [%{message: stale}]}, _} = compile(no_cargo, dest)

      assert stale ==
               "cargo not found on PATH or in ~/.cargo/bin, and #{dest} was built from " <>
                 "other sources: install Rust (https://rustup.rs) so that cargo is on PATH"

      assert File.read!(dest) == "built by cargo"
    end
  end
end
