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

  def loaded, do: false

  # The library's functions, each a stub here: the pool's start/1 and stop/0,
  # its rules, the DDL, Locks.transaction/4's fence (for the pool's tables and
  # for the repo mode's); a lock call (call.rs: its stamp in monotonic ns, the
  # Locks function, its checked args), the queue's leave/0, status/0; and
  # testing: :sandbox (native/locks_nif/src/repo.rs, run by Locks.Sandbox).
  # Not named @nifs: Elixir 1.18 passes that attribute to the VM as the
  # module's list of NIFs, and OTP 27 then refuses one missing from it.
  @stubs [start: 1, stop: 0, rules: 0, ddl: 2, setup: 1, fence_sql: 0, repo_fence_sql: 0] ++
           [enter: 3, run: 3, leave: 0, status: 0, functions: 0] ++
           [repo_start: 1, repo_step: 2, repo_columns: 1, repo_answer: 3]

  for {name, arity} <- @stubs do
    args = for n <- 1..arity//1, do: Macro.var(:"_arg#{n}", __MODULE__)
    def unquote(name)(unquote_splicing(args)), do: :erlang.nif_error(not_loaded())
  end

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
