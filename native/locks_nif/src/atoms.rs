//! The atoms the NIF returns, raises or sends.

rustler::atoms! {
    ok, error,
    // The queue's answers and replies (call.rs), and the replies' tag
    go, wait, taken, phoenix_kit_agent_locks,
    // PhoenixKitAgent.Turns.Locks.Error reasons
    config, not_started, connect, pool_timeout, timeout, disconnected, statement, row_locked,
    // testing: :sandbox's steps (repo.rs)
    columns, run,
}
