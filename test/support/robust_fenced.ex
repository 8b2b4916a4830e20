defmodule PhoenixKitAgent.Turns.Locks.Robust.Fenced do
  @moduledoc false
  # Run in a child node (Robust.Node): a turn of `with_turn/4` that writes
  # through `Locks.transaction/4` (SandboxRepo outside the sandbox: a
  # transaction on a psql connection of its own, as a host's repo in
  # production) and stops between its write and its commit, until it is
  # sent `:commit` under the name `:fenced_writer`. It prints
  # "FENCED_WRITE_DONE <ref>" once its write is made, for the test to read in
  # the node's log.

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.SandboxRepo

  @messages "locks_test_messages"

  def messages_table, do: @messages

  def write_then_wait(chat, user, ttl_s, lease_s) do
    # The psql session is linked to this process and exits when the server
    # ends its connection: the error is raised, this process not killed.
    Process.flag(:trap_exit, true)

    Locks.with_turn(chat, user, [ttl_s: ttl_s, lease_s: lease_s], fn turn ->
      Locks.transaction(SandboxRepo, turn, fn repo ->
        {:ok, _} =
          repo.query(
            "INSERT INTO #{@messages} (chat, turn) VALUES ($1::uuid, $2::text)",
            [Base.decode16!(String.replace(chat, "-", ""), case: :mixed), turn.ref],
            []
          )

        Process.register(self(), :fenced_writer)
        IO.puts("FENCED_WRITE_DONE #{turn.ref}")
        receive(do: (:commit -> :written))
      end)
    end)
  end
end
