defmodule PhoenixKitAgent.Turns.Locks.Error do
  @moduledoc """
  Raised when a lock call cannot be answered: the database is unreachable, a
  timeout passed, PostgreSQL refused the statement, or the library is not
  started. A busy lock is never an error: it is `{:error, reason}`.

  Match on `:reason`:

    * `:connect` — no connection could be opened, or it broke mid-call;
    * `:timeout` — the whole call took longer than the sum of
      `:checkout_timeout`, `:connect_timeout` and `:statement_timeout`;
    * `:pool_timeout` — every pooled connection stayed busy for `:checkout_timeout`;
    * `:statement` — PostgreSQL refused the statement; `:sqlstate` says why
      (`"57014"`: `:statement_timeout` passed; `"42P01"`: the tables are missing);
    * `:config` — a setting is unusable (the message names it);
    * `:not_started` — the application is not running, or has no `:url`;
    * `:nif_not_loaded` — the native library did not load.

  The message names the cause and never contains the database password.
  """

  defexception [:reason, :message, :sqlstate]

  @type t :: %__MODULE__{
          reason:
            :connect
            | :timeout
            | :pool_timeout
            | :statement
            | :config
            | :not_started
            | :nif_not_loaded,
          message: String.t(),
          sqlstate: String.t() | nil
        }
end
