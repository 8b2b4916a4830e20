# Loaded by `iex -S mix` in this directory. scripts/iex inserts sample rows
# and exports their uuids; they are bound here, so that
#
#     PhoenixKitAgent.Turns.Locks.acquire(chat, user, "turn-1", 60)
#
# answers :ok. Without them (a plain `iex -S mix`) the names are bound to
# nil, and nothing else happens.
alias PhoenixKitAgent.Turns.Locks

samples = fn name ->
  name |> System.get_env("") |> String.split() |> Enum.concat([nil, nil]) |> Enum.take(2)
end

[chat, chat2] = samples.("LOCKS_IEX_CHATS")
[user, user2] = samples.("LOCKS_IEX_USERS")
