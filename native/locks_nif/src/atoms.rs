//! The atoms the NIF returns, raises or sends.

rustler::atoms! {
    ok,
    error,
    wait,
    // acquire/4 and acquire_user/4 refusals
    conversation_busy,
    turn_in_flight,
    click_in_flight,
    // PhoenixKitAgent.Turns.Locks.Error reasons
    config,
    not_started,
    connect,
    pool_timeout,
    timeout,
    disconnected,
    statement,
    // held_locks/1 kinds
    chat,
    user,
    // DDL kinds
    tables,
    lock_columns,
    // The message that hands a waiting caller its turn.
    phoenix_kit_agent_locks,
}
