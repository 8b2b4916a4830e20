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
        :ok

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
          :ok -> :ok
          {:error, {:upgrade, _}} -> {:error, :running_version_keeps_the_nif}
          {:error, {reason, text}} -> record(reason, text)
        end

      {:error, {reason, text}} ->
        record(reason, text)
    end
  end

  # Loading must not fail the module: during the first `mix compile` the
  # library is built only after this module, and the compiler reloads it.
  defp record(reason, text) do
    :persistent_term.put({__MODULE__, :load_error}, "#{reason}: #{text}")
    :ok
  end

  # Pool
  def start(_options), do: not_loaded()
  def stop, do: not_loaded()
  def loaded, do: false

  # Locks
  #
  # Each lock call is stamped with the OS clock right before it enters the NIF,
  # where it may queue for a free dirty-I/O scheduler: the native side counts
  # that wait against the call's timeout (locks_core's global::call). The
  # arities without the stamp are the ones to call.
  def acquire(c, u, t, ttl), do: acquire(c, u, t, ttl, now())
  def acquire_user(u, r, ttl, hold), do: acquire_user(u, r, ttl, hold, now())
  def fresh(c, t, ttl), do: fresh(c, t, ttl, now())
  def held(c, u, t), do: held(c, u, t, now())
  def keep_user(u, r, ttl, hold), do: keep_user(u, r, ttl, hold, now())
  def release(c, u, t), do: release(c, u, t, now())
  def release_stale(c, u, t, ttl), do: release_stale(c, u, t, ttl, now())
  def release_user(u, r), do: release_user(u, r, now())

  def acquire(_conversation_uuid, _user_uuid, _turn_ref, _ttl_s, _queued_at), do: not_loaded()
  def acquire_user(_user_uuid, _ref, _ttl_s, _hold_s, _queued_at), do: not_loaded()
  def fresh(_conversation_uuid, _turn_ref, _ttl_s, _queued_at), do: not_loaded()
  def held(_conversation_uuid, _user_uuid, _turn_ref, _queued_at), do: not_loaded()
  def keep_user(_user_uuid, _ref, _ttl_s, _hold_s, _queued_at), do: not_loaded()
  def release(_conversation_uuid, _user_uuid, _turn_ref, _queued_at), do: not_loaded()

  def release_stale(_conversation_uuid, _user_uuid, _turn_ref, _ttl_s, _queued_at),
    do: not_loaded()

  def release_user(_user_uuid, _ref, _queued_at), do: not_loaded()

  defp now, do: System.os_time(:microsecond)

  # Schema
  def ddl(_kind, _prefix), do: not_loaded()
  def setup(_kind), do: not_loaded()
  def statements, do: not_loaded()

  defp not_loaded do
    why = :persistent_term.get({__MODULE__, :load_error}, "not loaded")

    raise PhoenixKitAgent.Turns.Locks.Error,
      reason: :nif_not_loaded,
      message: "the locks NIF is not loaded (#{why}); run `mix compile`"
  end
end
