defmodule Mix.Tasks.Locks.Demo do
  @shortdoc "Plays the story of the turn locks against real rows and prints a timeline"
  @moduledoc """
  Plays out, against the configured database (`:url` or `DATABASE_URL`,
  with the tables applied by `mix locks.setup`), the story of a turn's locks,
  and prints a timeline stamped with the database's clock:

    1. two turns race for one chat: one wins, the other is `:conversation_busy`;
    2. the same user's turn in a second chat is `:turn_in_flight`;
    3. a click on a confirmation card takes the user's lock, blocks a turn
       (`:click_in_flight`), keeps its lock fresh and releases it;
    4. a turn's node dies: after the TTL another turn takes the chat over,
       the dead turn sees `held?` false and its late release frees nothing;
    5. the leftovers of a lost turn are cleaned by `release_stale/4`, exactly
       once though two nodes try;
    6. a turn run by `with_turn/4` on a 5-second lease under the common
       120-second TTL, kept alive while it runs, dies with its node (its
       processes are killed): a turn taking the chat with the standard TTL
       gets it within the lease, not after a whole turn's TTL.

  Time passing is shown by backdating `busy_since` in SQL (through `psql`),
  not by waiting a TTL, but in the last part, which waits out the 5-second
  lease for real. `scripts/demo` runs this on a private cluster.
  """

  use Mix.Task

  alias PhoenixKitAgent.Turns.Locks

  @ttl 120

  @impl true
  def run(_args) do
    Mix.Task.run("app.start")
    url = System.get_env("DATABASE_URL") || Application.get_env(:phoenix_kit_agent_locks, :url)
    db = fn sql -> psql!(url, sql) end

    [chat_a, chat_b] = for _ <- 1..2, do: uuid()
    [alice, bob] = for _ <- 1..2, do: uuid()
    db.("INSERT INTO phoenix_kit_agent_conversations (uuid) VALUES ('#{chat_a}'), ('#{chat_b}')")
    names = %{chat_a => "chat A", chat_b => "chat B", alice => "alice", bob => "bob"}

    say = fn text -> IO.puts(["\n", IO.ANSI.format([:bright, text])]) end

    step = fn who, call, result, rows ->
      IO.puts(
        "#{db_now(db)}  #{String.pad_trailing(who, 22)} #{String.pad_trailing(call, 38)} → " <>
          String.pad_trailing(inspect(result), 30) <> state(db, names, rows)
      )

      result
    end

    IO.puts("""
    phoenix_kit_agent_locks demo — TTL of a turn's locks: #{@ttl} s
    chat A = #{chat_a}
    chat B = #{chat_b}
    alice  = #{alice}
    bob    = #{bob}
    Times are the database's (UTC). After each answer: the lock rows (holder, busy_since).
    """)

    say.("1. Two turns race for chat A")

    [r1, r2] =
      [{"turn-1", alice}, {"turn-2", bob}]
      |> Enum.map(fn {turn, user} ->
        Task.async(fn -> {turn, user, Locks.acquire(chat_a, user, turn, @ttl)} end)
      end)
      |> Enum.map(&Task.await/1)

    for {turn, user, result} <- [r1, r2] do
      step.("#{turn} (#{names[user]})", "acquire(chat A, #{names[user]})", result, [
        {:chat, chat_a},
        {:user, user}
      ])
    end

    {winner, winner_user, :ok} = Enum.find([r1, r2], &match?({_, _, :ok}, &1))

    say.("2. The winner's user starts a turn in chat B")

    step.(
      "turn-3 (#{names[winner_user]})",
      "acquire(chat B, #{names[winner_user]})",
      Locks.acquire(chat_b, winner_user, "turn-3", @ttl),
      [{:chat, chat_b}, {:user, winner_user}]
    )

    step.(
      "#{winner} (#{names[winner_user]})",
      "held?(chat A)",
      Locks.held?(chat_a, winner_user, winner),
      []
    )

    step.(
      "#{winner} (#{names[winner_user]})",
      "release(chat A)",
      Locks.release(chat_a, winner_user, winner),
      [{:chat, chat_a}, {:user, winner_user}]
    )

    say.("3. A click on a confirmation card holds alice's lock (hold 30 s of the #{@ttl} s TTL)")
    click = Locks.click_ref()

    step.(
      "click (alice)",
      "acquire_user(alice, ttl #{@ttl}, hold 30)",
      Locks.acquire_user(alice, click, @ttl, 30),
      [{:user, alice}]
    )

    step.(
      "turn-4 (alice)",
      "acquire(chat B, alice)",
      Locks.acquire(chat_b, alice, "turn-4", @ttl),
      [{:chat, chat_b}]
    )

    db.(
      "UPDATE phoenix_kit_agent_user_settings SET busy_since = busy_since - interval '20 seconds' WHERE user_uuid = '#{alice}'"
    )

    IO.puts(
      "#{db_now(db)}  … 20 s pass (backdated in SQL); the click is still running  " <>
        state(db, names, [{:user, alice}])
    )

    step.(
      "click (alice)",
      "keep_user(alice, ttl #{@ttl}, hold 30)",
      Locks.keep_user(alice, click, @ttl, 30),
      [{:user, alice}]
    )

    step.("click (alice)", "release_user(alice)", Locks.release_user(alice, click), [
      {:user, alice}
    ])

    step.(
      "turn-4 (alice)",
      "acquire(chat B, alice)",
      Locks.acquire(chat_b, alice, "turn-4", @ttl),
      [{:chat, chat_b}, {:user, alice}]
    )

    say.("4. turn-4's node dies while it holds chat B")

    db.(
      "UPDATE phoenix_kit_agent_conversations SET busy_since = busy_since - interval '#{@ttl + 1} seconds' WHERE uuid = '#{chat_b}'"
    )

    db.(
      "UPDATE phoenix_kit_agent_user_settings SET busy_since = busy_since - interval '#{@ttl + 1} seconds' WHERE user_uuid = '#{alice}'"
    )

    IO.puts("#{db_now(db)}  … #{@ttl + 1} s pass with no release (backdated in SQL)")

    step.("turn-4 (alice)", "fresh?(chat B)", Locks.fresh?(chat_b, "turn-4", @ttl), [
      {:chat, chat_b}
    ])

    step.("turn-5 (bob)", "acquire(chat B, bob)", Locks.acquire(chat_b, bob, "turn-5", @ttl), [
      {:chat, chat_b},
      {:user, bob}
    ])

    step.("turn-4 (alice), late", "held?(chat B)", Locks.held?(chat_b, alice, "turn-4"), [])

    step.("turn-4 (alice), late", "release(chat B)", Locks.release(chat_b, alice, "turn-4"), [
      {:chat, chat_b},
      {:user, alice}
    ])

    step.("turn-5 (bob)", "held?(chat B)", Locks.held?(chat_b, bob, "turn-5"), [])

    step.("turn-5 (bob)", "release(chat B)", Locks.release(chat_b, bob, "turn-5"), [
      {:chat, chat_b},
      {:user, bob}
    ])

    say.("5. turn-6 is lost with its node; two nodes clean up after the TTL")

    step.(
      "turn-6 (alice)",
      "acquire(chat A, alice)",
      Locks.acquire(chat_a, alice, "turn-6", @ttl),
      [{:chat, chat_a}, {:user, alice}]
    )

    step.(
      "node 1",
      "release_stale(turn-6)",
      Locks.release_stale(chat_a, alice, "turn-6", @ttl),
      []
    )

    db.(
      "UPDATE phoenix_kit_agent_conversations SET busy_since = busy_since - interval '#{@ttl + 1} seconds' WHERE uuid = '#{chat_a}'"
    )

    IO.puts("#{db_now(db)}  … #{@ttl + 1} s pass (backdated in SQL)")

    ["node 1", "node 2"]
    |> Enum.map(fn node ->
      Task.async(fn -> {node, Locks.release_stale(chat_a, alice, "turn-6", @ttl)} end)
    end)
    |> Enum.map(&Task.await/1)
    |> Enum.each(fn {node, result} ->
      step.(node, "release_stale(turn-6)", result, [{:chat, chat_a}, {:user, alice}])
    end)

    say.(
      "6. turn-7 runs with with_turn/4 on a 5-second lease (TTL #{@ttl}), kept every 5/3 s; its node dies"
    )
    me = self()

    runner =
      spawn(fn ->
        Locks.with_turn(chat_b, alice, [ttl_s: @ttl, lease_s: 5], fn turn ->
          send(me, {:running, turn})
          Process.sleep(:infinity)
        end)
      end)

    turn = receive(do: ({:running, turn} -> turn))

    IO.puts(
      "#{db_now(db)}  turn-7 (alice)         runs as #{String.slice(turn.ref, 0, 12)}…, its locks dated #{@ttl} - 5 s back  " <>
        state(db, names, [{:chat, chat_b}])
    )

    Process.sleep(3_500)

    IO.puts(
      "#{db_now(db)}  … 3.5 s later, kept alive by its keeper  " <>
        state(db, names, [{:chat, chat_b}])
    )

    # Nothing releases: as when the whole node goes down. The keeper is frozen,
    # not killed (one killed is started again, and releases), the caller killed.
    :ok = :sys.suspend(turn.keeper)
    Process.exit(runner, :kill)
    died = System.monotonic_time(:millisecond)
    IO.puts("#{db_now(db)}  turn-7's node dies (its caller killed, its keeper frozen)")

    try_turn = fn -> Locks.acquire(chat_b, bob, "turn-8", @ttl) end
    step.("turn-8 (bob)", "acquire(chat B, bob, ttl #{@ttl})", try_turn.(), [{:chat, chat_b}])

    free =
      Enum.find_value(
        Stream.repeatedly(fn -> Process.sleep(250) && try_turn.() end),
        &(&1 == :ok)
      )

    waited = (System.monotonic_time(:millisecond) - died) / 1_000

    step.("turn-8 (bob)", "acquire(chat B, bob, ttl #{@ttl})", free && :ok, [
      {:chat, chat_b},
      {:user, bob}
    ])

    IO.puts(
      "#{db_now(db)}  chat B was free for a #{@ttl}-second TTL #{Float.round(waited, 1)} s after turn-7's node died (lease: 5 s, last kept ≤ 5/3 s before)"
    )

    Locks.release(chat_b, bob, "turn-8")
    # Thawed, the keeper sees its caller dead and releases: nothing of turn-7's is left.
    :ok = :sys.resume(turn.keeper)

    IO.puts("\nDone: every answer above is one SQL statement, timed by the database.")
  end

  defp state(db, names, rows) do
    Enum.map_join(rows, "  ", fn {kind, id} ->
      {table, key} =
        if kind == :chat,
          do: {"phoenix_kit_agent_conversations", "uuid"},
          else: {"phoenix_kit_agent_user_settings", "user_uuid"}

      case db.(
             "SELECT coalesce(busy_turn_ref, '-'), coalesce(to_char(busy_since AT TIME ZONE 'UTC', 'HH24:MI:SS'), '') FROM #{table} WHERE #{key} = '#{id}'"
           ) do
        [[ref, since]] ->
          "#{names[id]}: #{String.slice(ref, 0, 12)} #{since}" |> String.trim_trailing()

        [] ->
          "#{names[id]}: (no row)"
      end
    end)
  end

  defp db_now(db) do
    [[now]] = db.("SELECT to_char(now() AT TIME ZONE 'UTC', 'HH24:MI:SS.US')")
    now
  end

  defp psql!(url, sql) do
    args = ["-X", "-q", "-A", "-t", "-F", "\t", "-v", "ON_ERROR_STOP=1", "-d", url, "-c", sql]

    case System.cmd("psql", args, stderr_to_stdout: true) do
      {out, 0} -> out |> String.split("\n", trim: true) |> Enum.map(&String.split(&1, "\t"))
      {out, _} -> Mix.raise("psql failed: #{out}")
    end
  end

  defp uuid do
    hex = Base.encode16(:crypto.strong_rand_bytes(16), case: :lower)

    <<a::binary-8, b::binary-4, _::binary-1, c::binary-3, _::binary-1, d::binary-3, e::binary-12>> =
      hex

    "#{a}-#{b}-4#{c}-8#{d}-#{e}"
  end
end
