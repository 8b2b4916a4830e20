defmodule PhoenixKitAgent.Turns.Locks.Native do
  @moduledoc false
  # The NIF library (native/locks_nif), loaded from priv/native/liblocks_nif.so
  # in place of the stubs below, which only run when it did not load and say
  # why. Call PhoenixKitAgent.Turns.Locks, not this module.

  @on_load :load_nif

  @doc false
  def load_nif do
    path = :filename.join(:code.priv_dir(:phoenix_kit_agent_locks), ~c"native/liblocks_nif")

    loaded =
      with {:error, {:upgrade, _}} <- :erlang.load_nif(path, 0) do
        # Loaded again in a running VM (recompile, r/1, c/1) while a version
        # holds the library (rustler has no upgrade callback): an old version
        # is purged (a call running in it is killed) and this one takes the
        # library; if the current version holds it, this one is refused and
        # the current one runs on. Either way the library stays mapped: its
        # pool, and its code as first loaded.
        :code.purge(__MODULE__)
        :erlang.load_nif(path, 0)
      end

    case loaded do
      # Read by every call of PhoenixKitAgent.Turns.Locks: kept where that costs nothing.
      :ok ->
        :persistent_term.put({__MODULE__, :click_prefix}, click_prefix())

      {:error, {:upgrade, _}} ->
        {:error, :running_version_keeps_the_nif}

      # Not an error: during the first `mix compile` the library is built only
      # after this module, and the compiler reloads it.
      {:error, {reason, text}} ->
        :persistent_term.put({__MODULE__, :load_error}, "#{reason}: #{text}")
    end
  end

  # The pool
  def start(_config), do: not_loaded()
  def stop, do: not_loaded()
  def loaded, do: false
  def click_prefix, do: not_loaded()

  # A lock call (native/locks_nif/src/call.rs): `function` is the Locks function's
  # name, `args` its checked arguments, `start` its stamp (monotonic, in ns).
  def admit(_start, _function, _args), do: not_loaded()
  def run(_token, _start, _function, _args), do: not_loaded()
  def leave(_ticket, _start), do: not_loaded()
  def deliver, do: not_loaded()
  def status, do: not_loaded()

  # The schema
  def ddl(_kind, _prefix), do: not_loaded()
  def setup(_kind), do: not_loaded()

  defp not_loaded do
    why = :persistent_term.get({__MODULE__, :load_error}, "not loaded")

    raise PhoenixKitAgent.Turns.Locks.Error,
      reason: :nif_not_loaded,
      message: "the locks NIF is not loaded (#{why}); run `mix compile`"
  end
end
