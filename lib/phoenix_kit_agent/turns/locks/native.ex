defmodule PhoenixKitAgent.Turns.Locks.Native do
  @moduledoc false
  # Stubs of the NIF library native/locks_nif (priv/native/liblocks_nif.so), which
  # replaces them when it loads; they say why it did not. Callers use Locks.

  @on_load :load_nif
  @load_error {__MODULE__, :load_error}
  @rules {__MODULE__, :rules}

  def load_nif do
    path = :filename.join(:code.priv_dir(:phoenix_kit_agent_locks), ~c"native/liblocks_nif")

    loaded =
      with {:error, {:upgrade, _}} <- :erlang.load_nif(path, 0) do
        # Loaded again in a running VM while a version holds the library, and
        # rustler has no upgrade callback: an old version is purged for this
        # one to take the library; the current one keeps it, and this one is
        # refused (what survives: guides/operating.md, "Limits").
        :code.purge(__MODULE__)
        :erlang.load_nif(path, 0)
      end

    case loaded do
      # Read by every call of PhoenixKitAgent.Turns.Locks: kept where that costs nothing.
      :ok -> :persistent_term.put(@rules, rules())
      {:error, {:upgrade, _}} -> {:error, :running_version_keeps_the_nif}
      # Not an error: during the first `mix compile` the library is built only
      # after this module, and the compiler reloads it.
      {:error, {reason, text}} -> :persistent_term.put(@load_error, "#{reason}: #{text}")
    end
  end

  def start(_config), do: :erlang.nif_error(not_loaded())
  def stop, do: :erlang.nif_error(not_loaded())
  def loaded, do: false
  def rules, do: :erlang.nif_error(not_loaded())
  def ddl(_kind, _prefix), do: :erlang.nif_error(not_loaded())
  def setup(_kind), do: :erlang.nif_error(not_loaded())
  # Locks.transaction/4's fence, for the pool's tables and for the repo mode's.
  def fence_sql, do: :erlang.nif_error(not_loaded())
  def repo_fence_sql, do: :erlang.nif_error(not_loaded())

  # A lock call (call.rs): its stamp (monotonic ns), the Locks function, its checked args.
  def enter(_start, _function, _args), do: :erlang.nif_error(not_loaded())
  def run(_start, _function, _args), do: :erlang.nif_error(not_loaded())
  def leave, do: :erlang.nif_error(not_loaded())
  def status, do: :erlang.nif_error(not_loaded())
  def functions, do: :erlang.nif_error(not_loaded())

  # testing: :sandbox (native/locks_nif/src/repo.rs, run by Locks.Sandbox).
  def repo_start(_prefix), do: :erlang.nif_error(not_loaded())
  def repo_step(_function, _args), do: :erlang.nif_error(not_loaded())
  def repo_columns(_rows), do: :erlang.nif_error(not_loaded())
  def repo_answer(_function, _args, _rows), do: :erlang.nif_error(not_loaded())

  # The exception a stub raises. Raised by `:erlang.nif_error/1`, as rustler's
  # stubs are, so that Elixir's type checker (1.18 on) reads a stub's result
  # as any term, not as `none()`, at the call sites that match it.
  # With a NIF loaded (its rules kept), a stub runs only when that library is
  # older than this module and lacks the function (guides/operating.md, "Limits").
  defp not_loaded do
    why = :persistent_term.get(@load_error, "not loaded")

    message =
      case :persistent_term.get(@rules, nil) do
        nil -> "the locks NIF is not loaded (#{why}); run `mix compile`"
        _loaded -> "the locks NIF this VM loaded is older than this code: restart the VM"
      end

    %PhoenixKitAgent.Turns.Locks.Error{reason: :nif_not_loaded, message: message}
  end
end
