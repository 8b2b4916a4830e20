//! The atoms the NIF returns or raises.

rustler::atoms! {
    ok,
    error,
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
    statement,
    // DDL kinds
    tables,
    lock_columns,
}
