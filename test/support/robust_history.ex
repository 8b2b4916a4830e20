defmodule PhoenixKitAgent.Turns.Locks.Robust.History do
  @moduledoc false
  # A history checker for the turn locks, in three parts:
  #
  #   1. `setup_sql/2`: the lock tables in a schema of the test's own, plus a
  #      trigger on each that logs every change of `busy_turn_ref` /
  #      `busy_since` into `<schema>.history`, stamped with the database's
  #      clock (`clock_timestamp()`), the statement's `now()` (the time the
  #      lock statements compare against) and the `txid`. Nothing outside the
  #      schema is touched: the shared tables carry no trigger.
  #   2. `workload/1`: many processes running random lock calls over a few
  #      chats and users with TTLs of 1-2 s (take-overs happen by themselves),
  #      recording for every call the caller's clock just before and just
  #      after it (`System.os_time/1`) and the answer. Run in a child node
  #      (Robust.Node) configured with `prefix: <schema>`.
  #   3. `check/3`: compares the calls with the history and returns every
  #      violation found (an empty list is a pass).
  #
  # Comparing the caller's clock with `clock_timestamp()` is sound here (and
  # only here) because the test and PostgreSQL run on one machine and both
  # read CLOCK_REALTIME: the library itself never compares the two.
  #
  # A trigger fires inside the statement, so the time of a change lies within
  # its caller's [before, after] exactly. The change becomes visible to other
  # statements at commit, a little later; answers that depend on what a
  # statement *saw* (held?, fresh?, keep_user) are therefore judged over the
  # call's window widened by @slack_us on both sides.

  @slack_us 100_000

  # -- 1. schema, history table, triggers ---------------------------------------

  @doc "SQL that (re)creates `schema` with the lock tables, `chats` chat rows and the history triggers."
  def setup_sql(schema, chats) do
    tables = PhoenixKitAgent.Turns.Locks.Native.ddl(:tables, schema)
    values = Enum.map_join(chats, ",", &"('#{&1}')")

    """
    DROP SCHEMA IF EXISTS #{schema} CASCADE;
    #{tables}
    CREATE TABLE #{schema}.history (
      id bigserial PRIMARY KEY,
      kind text NOT NULL,
      key uuid NOT NULL,
      old_ref text, new_ref text,
      old_since timestamptz, new_since timestamptz,
      stmt_now timestamptz NOT NULL,
      ts timestamptz NOT NULL,
      txid bigint NOT NULL
    );
    #{log_function(schema, "chat", "uuid", "phoenix_kit_agent_conversations")}
    #{log_function(schema, "user", "user_uuid", "phoenix_kit_agent_user_settings")}
    INSERT INTO #{schema}.phoenix_kit_agent_conversations (uuid) VALUES #{values}
    """
  end

  defp log_function(schema, kind, key, table) do
    """
    CREATE FUNCTION #{schema}.log_#{kind}() RETURNS trigger LANGUAGE plpgsql AS $fn$
    BEGIN
      INSERT INTO #{schema}.history
        (kind, key, old_ref, new_ref, old_since, new_since, stmt_now, ts, txid)
      VALUES ('#{kind}', NEW.#{key},
        CASE WHEN TG_OP = 'UPDATE' THEN OLD.busy_turn_ref END, NEW.busy_turn_ref,
        CASE WHEN TG_OP = 'UPDATE' THEN OLD.busy_since END, NEW.busy_since,
        now(), clock_timestamp(), txid_current());
      RETURN NULL;
    END $fn$;
    CREATE TRIGGER log_#{kind}_insert AFTER INSERT ON #{schema}.#{table}
      FOR EACH ROW EXECUTE FUNCTION #{schema}.log_#{kind}();
    CREATE TRIGGER log_#{kind}_update AFTER UPDATE ON #{schema}.#{table}
      FOR EACH ROW WHEN (OLD.busy_turn_ref IS DISTINCT FROM NEW.busy_turn_ref
                         OR OLD.busy_since IS DISTINCT FROM NEW.busy_since)
      EXECUTE FUNCTION #{schema}.log_#{kind}();
    """
  end

  @doc "The SQL that reads the history back, oldest first, times in epoch microseconds."
  def history_sql(schema) do
    us = &"(extract(epoch FROM #{&1}) * 1000000)::bigint"

    """
    SELECT kind, key::text, old_ref, new_ref, #{us.("old_since")}, #{us.("new_since")},
           #{us.("stmt_now")}, #{us.("ts")}, txid
    FROM #{schema}.history ORDER BY id
    """
  end

  @doc "Rows of `history_sql/1` (strings) as event maps."
  def events(rows) do
    int = fn
      nil -> nil
      s -> String.to_integer(s)
    end

    for [kind, key, old_ref, new_ref, old_since, new_since, now, ts, txid] <- rows do
      %{
        kind: String.to_existing_atom(kind),
        key: key,
        old_ref: old_ref,
        new_ref: new_ref,
        old_since: int.(old_since),
        new_since: int.(new_since),
        now: int.(now),
        ts: int.(ts),
        txid: int.(txid)
      }
    end
  end

  # -- 2. the workload (runs in the child node) --------------------------------

  @doc """
  Runs `workers` processes for `ms` milliseconds over `chats` and `users`;
  returns every call as `{op, args, before_us, after_us, answer}`.
  """
  def workload(%{chats: chats, users: users, workers: workers, ms: ms, seed: seed}) do
    # Every turn granted so far, by number: others call release_stale/4,
    # held? and release/3 on it too, as late callers would.
    refs = :ets.new(:robust_refs, [:public, :set, write_concurrency: true])
    :ets.insert(refs, {:count, 0})
    deadline = System.monotonic_time(:millisecond) + ms
    parent = self()

    pids =
      for w <- 1..workers do
        spawn_link(fn ->
          :rand.seed(:exsss, {seed, w, 17})
          ctx = %{w: w, chats: chats, users: users, refs: refs, deadline: deadline}
          state = %{n: 0, turns: [], abandoned: [], slow: [], clicks: [], running: nil}
          send(parent, {:records, self(), loop(ctx, state, [])})
        end)
      end

    Enum.flat_map(pids, fn pid ->
      receive do
        {:records, ^pid, records} -> records
      end
    end)
  end

  defp loop(ctx, state, acc) do
    if System.monotonic_time(:millisecond) >= ctx.deadline do
      acc
    else
      {record, state} = step(ctx, %{state | n: state.n + 1})
      loop(ctx, state, [record | acc])
    end
  end

  # The cleanup of a lost turn comes first: an abandoned turn of this
  # worker's, a second old, is released with release_stale/4 (TTL 1), in a
  # race with the take-overs of other workers.
  defp step(ctx, %{abandoned: [{{c, u, ref}, at} | rest]} = state) do
    if System.monotonic_time(:millisecond) - at >= 1_000,
      do: {call(:release_stale, [c, u, ref, 1]), %{state | abandoned: rest}},
      else: roll(ctx, state)
  end

  # Workers 1 and 2 run turns as the spec has them run: take both locks,
  # then check held? before each "round" and never release, until held?
  # says a lock was taken over (its TTL of 1 s passed); then release what may
  # still be theirs (a late release) and start the next turn.
  defp step(%{w: w} = ctx, state) when w <= 2 do
    case state.running do
      nil ->
        {chat, user, ref} = {Enum.random(ctx.chats), Enum.random(ctx.users), "run#{w}-#{state.n}"}
        record = call(:acquire, [chat, user, ref, 1])
        running = if ok?(record), do: {chat, user, ref}
        {record, %{state | running: running}}

      {chat, user, ref} = running ->
        case call(:held?, [chat, user, ref]) do
          {_, _, _, _, {:ok, false}} = record -> {record, %{state | running: {:lost, running}}}
          record -> {record, state}
        end

      {:lost, {chat, user, ref}} ->
        {call(:release, [chat, user, ref]), %{state | running: nil}}
    end
  end

  defp step(ctx, state), do: roll(ctx, state)

  defp roll(ctx, state) do
    chat = Enum.random(ctx.chats)
    user = Enum.random(ctx.users)
    # Mostly 2 s: the cleanups (TTL 1) then often come before a take-over.
    ttl = Enum.random([1, 2, 2, 2])
    # A turn of this worker's, else one granted to anyone (a late caller).
    turn = pick(state.turns) || random_turn(ctx.refs) || {chat, user, "none"}
    # What a turn checks before each round: half the time a slow one's.
    checked =
      if state.slow != [] and :rand.uniform(2) == 1, do: elem(pick(state.slow), 0), else: turn

    own_click = pick(state.clicks)
    roll = :rand.uniform(100)

    cond do
      roll <= 30 ->
        ref = "w#{ctx.w}-#{state.n}"
        record = call(:acquire, [chat, user, ref, ttl])
        fate = :rand.uniform(100)

        cond do
          not ok?(record) ->
            {record, state}

          fate <= 10 ->
            # Abandoned at once, as by a node that went down: it expires
            # after its TTL and is taken over or cleaned up (release_stale).
            now = System.monotonic_time(:millisecond)
            {record, %{state | abandoned: state.abandoned ++ [{{chat, user, ref}, now}]}}

          fate <= 20 ->
            # Slow: it runs on past its TTL, checking its locks (held?,
            # fresh?) and never releasing them; a worker keeps its 3 newest.
            now = System.monotonic_time(:millisecond)
            {record, %{state | slow: Enum.take([{{chat, user, ref}, now} | state.slow], 3)}}

          true ->
            :ets.insert(ctx.refs, {:ets.update_counter(ctx.refs, :count, 1), {chat, user, ref}})
            {record, %{state | turns: Enum.take([{chat, user, ref} | state.turns], 4)}}
        end

      roll <= 45 ->
        {c, u, ref} = checked
        {call(:held?, [c, u, ref]), state}

      roll <= 52 ->
        {c, _u, ref} = checked
        {call(:fresh?, [c, ref, ttl]), state}

      roll <= 65 ->
        {c, u, ref} = turn
        {call(:release, [c, u, ref]), %{state | turns: List.delete(state.turns, turn)}}

      roll <= 75 ->
        {c, u, ref} = random_turn(ctx.refs) || turn
        {call(:release_stale, [c, u, ref, ttl]), state}

      roll <= 85 or own_click == nil ->
        ref = PhoenixKitAgent.Turns.Locks.click_ref()
        hold = Enum.random(1..ttl)
        record = call(:acquire_user, [user, ref, ttl, hold])

        state =
          if ok?(record),
            do: %{state | clicks: Enum.take([{user, ref, ttl, hold} | state.clicks], 3)},
            else: state

        {record, state}

      roll <= 93 ->
        {u, ref, t, h} = own_click
        {call(:keep_user, [u, ref, t, h]), state}

      true ->
        {u, ref, _t, _h} = own_click
        {call(:release_user, [u, ref]), %{state | clicks: List.delete(state.clicks, own_click)}}
    end
  end

  defp pick([]), do: nil
  defp pick(list), do: Enum.random(list)

  defp random_turn(table) do
    case :ets.lookup_element(table, :count, 2) do
      0 ->
        nil

      n ->
        case :ets.lookup(table, :rand.uniform(n)) do
          [{_, turn}] -> turn
          [] -> nil
        end
    end
  end

  defp ok?({_, _, _, _, {:ok, :ok}}), do: true
  defp ok?(_), do: false

  defp call(op, args) do
    before = System.os_time(:microsecond)
    answer = PhoenixKitAgent.Turns.Locks.Robust.Race.attempt(op, args)
    {op, List.to_tuple(args), before, System.os_time(:microsecond), answer}
  end

  # -- 3. the checker --------------------------------------------------------------

  @doc """
  Every violation of the lock guarantees found in `records` (the calls) and
  `events` (the history), as `{what, details}`; `[]` when there is none.
  """
  def check(records, events, slack_us \\ @slack_us) do
    by_ref = index_records(records)
    timelines = timelines(events)

    Enum.concat([
      raised(records),
      take_overs(events, by_ref),
      new_refs_come_from_granted_calls(events, by_ref),
      granted_calls_left_their_mark(records, events),
      refused_calls_left_none(records, events),
      releases_by_their_owner(events, records),
      redates_by_their_owner(events, records),
      release_stale_at_most_once(records, events),
      answers_match_the_history(records, timelines, slack_us)
    ])
  end

  @doc "How many take-overs (a ref replaced by another) the history holds."
  def take_over_count(events),
    do: Enum.count(events, &(&1.old_ref && &1.new_ref && &1.old_ref != &1.new_ref))

  # A row held past the row wait (a chain of waits under contention) is a
  # documented answer, not a fault: the other checks prove it changed
  # nothing, since only :ok answers may take, free or re-date a lock.
  defp raised(records) do
    for {op, args, _, _, {:raised, e}} <- records,
        not match?(%PhoenixKitAgent.Turns.Locks.Error{reason: :row_locked}, e),
        do: {:raised, {op, args, e}}
  end

  # ref => the call that tried to take a lock under it (refs are never reused).
  defp index_records(records) do
    for {op, args, _, _, _} = r <- records, op in [:acquire, :acquire_user], into: %{} do
      ref = if op == :acquire, do: elem(args, 2), else: elem(args, 1)
      {ref, r}
    end
  end

  # A lock may pass from one ref to another only when the holder's
  # busy_since was older than the new holder's TTL at the statement's now().
  defp take_overs(events, by_ref) do
    for %{old_ref: old, new_ref: new} = e <- events,
        old != nil,
        new != nil,
        old != new,
        violation = take_over_violation(e, by_ref[new]),
        do: violation
  end

  defp take_over_violation(e, nil), do: {:unknown_ref_took_over, e}

  defp take_over_violation(e, {op, args, _, _, _}) do
    ttl_us = if(op == :acquire, do: elem(args, 3), else: elem(args, 2)) * 1_000_000

    if e.old_since != nil and e.old_since < e.now - ttl_us,
      do: nil,
      else: {:taken_over_before_ttl, %{event: e, ttl_s: div(ttl_us, 1_000_000)}}
  end

  # Every ref that appears in a lock came from a call that answered :ok, on
  # that row, while the call ran.
  defp new_refs_come_from_granted_calls(events, by_ref) do
    for %{new_ref: new, old_ref: old} = e <- events,
        new != nil,
        new != old,
        violation = granted_by(e, by_ref[new]),
        do: violation
  end

  defp granted_by(e, nil), do: {:lock_taken_by_no_call, e}

  defp granted_by(e, {op, args, before, after_, answer}) do
    on_row =
      case {op, e.kind} do
        {:acquire, :chat} -> elem(args, 0) == e.key
        {:acquire, :user} -> elem(args, 1) == e.key
        {:acquire_user, :user} -> elem(args, 0) == e.key
        _ -> false
      end

    cond do
      not on_row -> {:lock_taken_on_another_row, {e, op, args}}
      answer != {:ok, :ok} -> {:lock_taken_by_a_refused_call, {e, op, args, answer}}
      e.ts < before or e.ts > after_ -> {:lock_taken_outside_its_call, {e, before, after_}}
      true -> nil
    end
  end

  # :ok means both locks (one transaction) or the user's lock was taken.
  defp granted_calls_left_their_mark(records, events) do
    taken =
      events
      |> Enum.filter(&(&1.new_ref != nil and &1.new_ref != &1.old_ref))
      |> Enum.group_by(& &1.new_ref)

    for {op, args, _, _, {:ok, :ok}} <- records,
        op in [:acquire, :acquire_user],
        violation = mark_violation(op, args, Map.get(taken, ref_of(op, args), [])),
        do: violation
  end

  defp ref_of(:acquire, args), do: elem(args, 2)
  defp ref_of(:acquire_user, args), do: elem(args, 1)

  defp mark_violation(:acquire, args, events) do
    case Enum.sort_by(events, & &1.kind) do
      [%{kind: :chat, txid: t}, %{kind: :user, txid: t}] -> nil
      other -> {:acquire_ok_without_both_locks_in_one_transaction, {args, other}}
    end
  end

  defp mark_violation(:acquire_user, args, events) do
    case events do
      [%{kind: :user}] -> nil
      other -> {:acquire_user_ok_without_the_lock, {args, other}}
    end
  end

  defp refused_calls_left_none(records, events) do
    refs = MapSet.new(events, & &1.new_ref)

    for {op, args, _, _, {:ok, {:error, _} = answer}} <- records,
        MapSet.member?(refs, ref_of(op, args)),
        do: {:refused_call_left_a_lock, {op, args, answer}}
  end

  # A lock is freed only by a release of its own ref on its row, while that
  # release ran: a late release never frees a newer turn's lock.
  defp releases_by_their_owner(events, records) do
    releases =
      for {op, args, before, after_, {:ok, answer}} <- records,
          op in [:release, :release_user] or (op == :release_stale and answer == true),
          do: {op, args, before, after_}

    by_ref = Enum.group_by(releases, &release_ref/1)

    for %{old_ref: old, new_ref: nil} = e <- events,
        old != nil,
        not Enum.any?(Map.get(by_ref, old, []), &frees?(&1, e)),
        do: {:freed_by_no_release_of_its_ref, e}
  end

  defp release_ref({:release_user, args, _, _}), do: elem(args, 1)
  defp release_ref({_, args, _, _}), do: elem(args, 2)

  defp frees?({op, args, before, after_}, e) do
    row =
      case {op, e.kind} do
        {:release_user, :user} -> elem(args, 0)
        {:release_user, :chat} -> :none
        {_, :chat} -> elem(args, 0)
        {_, :user} -> elem(args, 1)
      end

    row == e.key and e.ts >= before and e.ts <= after_
  end

  # A lock's busy_since moves under the same ref only by keep_user/4 of
  # that ref (refs are never reused, so no acquire re-dates): a refused
  # call leaves the lock exactly as it was, not fresher.
  defp redates_by_their_owner(events, records) do
    keeps =
      records
      |> Enum.filter(&match?({:keep_user, _, _, _, {:ok, true}}, &1))
      |> Enum.group_by(fn {_, args, _, _, _} -> elem(args, 1) end)

    for %{old_ref: ref, new_ref: ref} = e <- events,
        ref != nil,
        not Enum.any?(Map.get(keeps, ref, []), fn {_, args, b, a, _} ->
          e.kind == :user and elem(args, 0) == e.key and e.ts >= b and e.ts <= a
        end),
        do: {:lock_redated_by_another_call, e}
  end

  # Of several release_stale/4 of one ref, at most one answers true, and a
  # true answer freed a chat lock that was older than the TTL.
  defp release_stale_at_most_once(records, events) do
    freed = Enum.filter(events, &(&1.kind == :chat and &1.old_ref != nil and &1.new_ref == nil))

    trues = for {:release_stale, args, b, a, {:ok, true}} <- records, do: {args, b, a}

    many =
      for {ref, [_, _ | _] = calls} <- Enum.group_by(trues, fn {args, _, _} -> elem(args, 2) end),
          do: {:release_stale_true_twice, {ref, calls}}

    stale =
      for {args, b, a} <- trues,
          not Enum.any?(freed, fn e ->
            e.old_ref == elem(args, 2) and e.key == elem(args, 0) and e.ts >= b and e.ts <= a and
              e.old_since < e.now - elem(args, 3) * 1_000_000
          end),
          do: {:release_stale_true_without_freeing_a_stale_lock, args}

    many ++ stale
  end

  # -- answers judged against the timeline of each row -----------------------------

  # key => [{from_us, until_us, ref, since_us}], one segment per state of the
  # row. The events of one row are in the order of their ids, which is the
  # order they happened in: each writer waited for the row lock of the last.
  defp timelines(events) do
    events
    |> Enum.group_by(&{&1.kind, &1.key})
    |> Map.new(fn {row, evs} ->
      untils = Enum.map(tl(evs), & &1.ts) ++ [:infinity]
      {row, Enum.zip_with(evs, untils, fn e, u -> {e.ts, u, e.new_ref, e.new_since} end)}
    end)
  end

  defp answers_match_the_history(records, timelines, slack) do
    for {op, args, before, after_, {:ok, answer}} <- records,
        op in [:held?, :fresh?, :keep_user],
        window = {before - slack, after_ + slack},
        violation = judge(op, args, answer, window, timelines),
        do: violation
  end

  defp judge(:held?, {chat, user, ref}, answer, window, timelines) do
    both =
      intersect(
        held_by(timelines[{:chat, chat}], ref),
        held_by(timelines[{:user, user}], ref)
      )

    verdict(:held?, {chat, user, ref}, answer, window, both)
  end

  defp judge(:fresh?, {chat, ref, ttl}, answer, window, timelines) do
    # Fresh at t: the chat is ref's and since >= t - ttl, i.e. t <= since + ttl.
    fresh =
      for {from, until, ^ref, since} <- timelines[{:chat, chat}] || [],
          fresh_until = since + ttl * 1_000_000,
          from <= fresh_until,
          do: {from, min_time(until, fresh_until)}

    verdict(:fresh?, {chat, ref, ttl}, answer, window, fresh)
  end

  defp judge(:keep_user, {user, ref, ttl, hold}, answer, window, timelines) do
    verdict(
      :keep_user,
      {user, ref, ttl, hold},
      answer,
      window,
      held_by(timelines[{:user, user}], ref)
    )
  end

  # true: the condition held at some instant of the window; false: not at every instant.
  defp verdict(op, args, true, {lo, hi} = window, intervals) do
    if Enum.any?(intervals, fn {from, until} -> from <= hi and after?(until, lo) end),
      do: nil,
      else: {:"#{op}_true_while_not_so", {args, window, intervals}}
  end

  defp verdict(op, args, false, {lo, hi} = window, intervals) do
    if Enum.any?(intervals, fn {from, until} -> from <= lo and after?(until, hi) end),
      do: {:"#{op}_false_while_so_throughout", {args, window, intervals}},
      else: nil
  end

  defp held_by(nil, _ref), do: []

  defp held_by(segments, ref) do
    segments
    |> Enum.filter(&match?({_, _, ^ref, _}, &1))
    |> Enum.map(fn {from, until, _, _} -> {from, until} end)
    |> merge()
  end

  # Adjacent segments of one ref (a re-dating) are one interval.
  defp merge(intervals) do
    intervals
    |> Enum.reduce([], fn
      {from, until}, [{f, u} | rest] when u == from -> [{f, until} | rest]
      interval, acc -> [interval | acc]
    end)
    |> Enum.reverse()
  end

  defp intersect(as, bs) do
    for {a1, a2} <- as,
        {b1, b2} <- bs,
        from = max(a1, b1),
        until = min_time(a2, b2),
        after?(until, from),
        do: {from, until}
  end

  defp min_time(:infinity, b), do: b
  defp min_time(a, :infinity), do: a
  defp min_time(a, b), do: min(a, b)

  defp after?(:infinity, _), do: true
  defp after?(a, b), do: a > b
end
