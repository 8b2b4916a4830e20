defmodule PhoenixKitAgent.Turns.Locks.Error do
  @moduledoc """
  Raised when a lock call cannot be answered (a busy lock is never an error:
  it is `{:error, reason}`). Match on `:reason`: it says how far the call got,
  which is what a caller needs to recover (the README's "Errors" has a table
  of what to do):

    * `:connect` — no connection could be opened; nothing was sent;
    * `:pool_timeout` — every connection stayed busy for `:checkout_timeout`;
      nothing was sent;
    * `:timeout` — no answer within the call's time (`:checkout_timeout` +
      `:connect_timeout` + `:statement_timeout`); the statement **may have
      run**; its connection was closed and the statement cancelled;
    * `:disconnected` — the connection was lost with the statement in flight
      (a server shutdown, `pg_terminate_backend`, a broken path); the
      statement **may have run**;
    * `:row_locked` — a row the call writes (`keep/5`, `keep_user/4`,
      `release/3`, `release_user/2`) stayed locked by another session's
      transaction (the turn's own fenced write, a host's transaction) for
      the whole wait (it gives up after 250 ms a row); the statement changed
      nothing: try again.
      Also raised by `transaction/4` when its fence waited a whole lease;
    * `:statement` — PostgreSQL refused the statement, which changed nothing;
      `:sqlstate` says why (`"42501"`: the role may not write the tables);
    * `:config` — a setting, or the tables it points at, cannot be used (the
      message names the setting, or the table and its column, and the fix);
    * `:not_started` — the application is not running, or names no database;
    * `:nif_not_loaded` — the native library did not load.

  The message names the cause and never contains the database password.
  """

  defexception [:reason, :message, :sqlstate]

  @type t :: %__MODULE__{
          reason:
            :connect
            | :pool_timeout
            | :timeout
            | :disconnected
            | :row_locked
            | :statement
            | :config
            | :not_started
            | :nif_not_loaded,
          message: String.t(),
          sqlstate: String.t() | nil
        }
end
