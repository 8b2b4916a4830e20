defmodule PhoenixKitAgent.Turns.Locks.Error do
  @moduledoc """
  Raised when a lock call cannot be answered (a busy lock is never an error:
  it is `{:error, reason}`). Match on `:reason`, which says how far the call
  got: `:connect`, `:pool_timeout`, `:config`, `:not_started` and
  `:nif_not_loaded` sent nothing; `:statement` (with its `:sqlstate`) and
  `:row_locked` (gave up on a row another session held, after 250 ms;
  `transaction/4`'s fence after a lease) changed
  nothing; after `:timeout` or `:disconnected` the statement **may have
  run**. What to do for each: the README's "Errors". The message names the
  cause and never contains the database password.
  """

  defexception [:reason, :message, :sqlstate]

  # Every reason, once: the type, status/0's counts (Observe) and the docs'
  # tables (docs_test) read this list.
  @reasons ~w(connect pool_timeout timeout disconnected row_locked statement config not_started
              nif_not_loaded)a

  # `:connect | :pool_timeout | …`, in the order of @reasons.
  @typedoc "Why a call could not be answered (the README's \"Errors\")."
  @type reason :: unquote(Enum.reduce(Enum.reverse(@reasons), &{:|, [], [&1, &2]}))

  @type t :: %__MODULE__{reason: reason(), message: String.t(), sqlstate: String.t() | nil}

  @doc false
  def reasons, do: @reasons
end
