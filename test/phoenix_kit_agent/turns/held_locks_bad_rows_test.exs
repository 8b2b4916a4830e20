# A host's own writes can leave a lock row whose busy_since no DateTime
# holds: 'infinity', '-infinity', the year 12000. held_locks/1 and `mix
# locks.held` list such a row, its age unknown and stale, among the others,
# on both column types a host may have. Each module restarts the
# application on a schema of its own (config :prefix), so the listing holds
# only its rows: not async.
for {suffix, column} <- [
      {Timestamptz, "timestamptz"},
      {Naive, "timestamp without time zone"}
    ] do
  defmodule Module.concat(PhoenixKitAgent.Turns.HeldLocksBadRowsTest, suffix) do
    use PhoenixKitAgent.Turns.LockCase, async: false

    alias PhoenixKitAgent.Turns.Locks.AppEnv

    @schema "h_unit_bad_rows_" <> String.downcase(inspect(suffix))
    @column column

    setup do
      TestDB.bare_tables!(@schema, @column)

      AppEnv.restore_on_exit()
      on_exit(fn -> TestDB.query!("DROP SCHEMA IF EXISTS #{@schema} CASCADE", TestDB.url()) end)

      :ok =
        AppEnv.restart(
          Keyword.put(Application.get_all_env(:phoenix_kit_agent_locks), :prefix, @schema)
        )
    end

    test "a busy_since no DateTime holds is listed with an unknown age, stale, and raises nothing" do
      [good, inf, neg, far, user] = for _ <- 1..5, do: TestDB.uuid()

      TestDB.query!("""
      INSERT INTO #{@schema}.phoenix_kit_agent_conversations (uuid, busy_since, busy_turn_ref) VALUES
        ('#{good}', now() - interval '10 seconds', 'good'),
        ('#{inf}', 'infinity', 'inf'),
        ('#{neg}', '-infinity', 'neg'),
        ('#{far}', '12000-01-01 00:00:00+00', 'far');
      INSERT INTO #{@schema}.phoenix_kit_agent_user_settings (user_uuid, busy_since, busy_turn_ref)
        VALUES ('#{user}', 'infinity', 'inf-user')
      """)

      unknown = fn kind, id, ref ->
        %{kind: kind, uuid: id, ref: ref, since: nil, age_s: nil, stale: true}
      end

      chats = Enum.sort([{inf, "inf"}, {neg, "neg"}, {far, "far"}])
      [%{since: since, age_s: age} = last | _] = held = Enum.reverse(Locks.held_locks(60))

      assert Enum.reverse(held) ==
               Enum.map(chats, fn {id, ref} -> unknown.(:chat, id, ref) end) ++
                 [unknown.(:user, user, "inf-user"), last]

      assert %{kind: :chat, uuid: ^good, ref: "good", stale: false} = last
      assert %DateTime{} = since
      assert age >= 10 and age < 20

      table = Mix.Tasks.Locks.Held.table(Enum.reverse(held))

      for {kind, id, ref} <- [{:chat, inf, "inf"}, {:chat, far, "far"}, {:user, user, "inf-user"}] do
        assert table =~ ~r/^#{kind}\s+#{id}\s+#{ref}\s+-\s+unknown\s+stale\s*$/m
      end

      assert table =~ ~r/^chat\s+#{good}\s+good\s+\S+Z\s+\d+\.\d s\s*$/m
    end
  end
end
