defmodule PhoenixKitAgent.Turns.Locks.Native do
  @moduledoc false
  # The NIF library (native/locks_nif). Every function here is replaced by the
  # Rust one when priv/native/liblocks_nif.so loads; the stubs only run when it
  # did not, and say why. Call PhoenixKitAgent.Turns.Locks, not this module.

  require Logger

  @on_load :load_nif

  @doc false
  def load_nif do
    path = :filename.join(:code.priv_dir(:phoenix_kit_agent_locks), ~c"native/liblocks_nif")

    case :erlang.load_nif(path, 0) do
      :ok ->
        keep_click_prefix()

      {:error, {:upgrade, _}} ->
        # This module is being loaded again in a running VM (`recompile`,
        # `r/1` or `c/1` in IEx) while an earlier version holds the library,
        # and rustler has no upgrade callback. Which version holds it decides:
        #
        #   * an old version (Mix's compiler has already made the running
        #     version old): drop it (a call still running in it is killed, as
        #     any purge does) and load the library into this version;
        #   * the current version (the module is compiled anew beside it):
        #     refuse this version, so that the current one keeps running.
        #
        # Either way the library stays mapped, with its runtime and its pool,
        # and its code stays the one loaded first: the dynamic loader hands
        # out the mapped library for the same path.
        :code.purge(__MODULE__)

        case :erlang.load_nif(path, 0) do
          :ok -> keep_click_prefix()
          {:error, {:upgrade, _}} -> {:error, :running_version_keeps_the_nif}
          {:error, {reason, text}} -> record(reason, text)
        end

      {:error, {reason, text}} ->
        record(reason, text)
    end
  end

  # The prefix of a click's ref is the native side's; PhoenixKitAgent.Turns.Locks
  # reads it on every call, so it is kept where that costs nothing.
  defp keep_click_prefix do
    :persistent_term.put({__MODULE__, :click_prefix}, click_prefix())
  end

  # Loading must not fail the module: during the first `mix compile` the
  # library is built only after this module, and the compiler reloads it.
  defp record(reason, text) do
    :persistent_term.put({__MODULE__, :load_error}, "#{reason}: #{text}")
    :ok
  end

  # Pool
  def start(_config), do: not_loaded()
  def stop, do: not_loaded()
  def loaded, do: false
  def click_prefix, do: not_loaded()

  # Lock calls (native/locks_nif/src/call.rs): at most pool_size run at
  # once. `function` is the name of the PhoenixKitAgent.Turns.Locks function,
  # `args` its arguments (uuids as their 16 bytes), `start` the caller's stamp
  # (System.monotonic_time(:nanosecond)).
  def admit(_start, _function, _args), do: not_loaded()
  def run(_token, _start, _function, _args), do: not_loaded()
  def leave(_ticket, _start), do: not_loaded()
  def deliver, do: not_loaded()
  def status, do: not_loaded()

  # Schema
  def ddl(_kind, _prefix), do: not_loaded()
  def setup(_kind), do: not_loaded()

  defp not_loaded do
    why = :persistent_term.get({__MODULE__, :load_error}, "not loaded")

    raise PhoenixKitAgent.Turns.Locks.Error,
      reason: :nif_not_loaded,
      message: "the locks NIF is not loaded (#{why}); run `mix compile`"
  end
end
