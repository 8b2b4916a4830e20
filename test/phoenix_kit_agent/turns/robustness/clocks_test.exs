defmodule PhoenixKitAgent.Turns.Robustness.ClocksTest do
  # Clocks and column types: the same TTL scenario (Robust.Scenarios.Clocks)
  # against a database per variant — `busy_since` as `timestamptz` or as
  # `timestamp without time zone`, the server's TimeZone UTC, far from UTC
  # (Pacific/Kiritimati, UTC+14) or with DST (America/Los_Angeles) — each
  # run by a separate node whose own TZ is set far off too. Every variant
  # must produce exactly the expected outcomes, and every stored busy_since
  # must be the database's now() as a UTC instant.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks.Robust.{Node, Pg}
  alias PhoenixKitAgent.Turns.Locks.Robust.Scenarios.Clocks

  @moduletag :robustness

  # {name, column type, server TimeZone, the node's TZ}
  @variants [
    {"tz_utc", "timestamptz", "UTC", nil},
    {"tz_kiritimati", "timestamptz", "Pacific/Kiritimati", "America/Los_Angeles"},
    {"tz_la", "timestamptz", "America/Los_Angeles", "Pacific/Kiritimati"},
    {"naive_utc", "timestamp", "UTC", "Etc/GMT+12"},
    {"naive_kiritimati", "timestamp", "Pacific/Kiritimati", "Pacific/Kiritimati"},
    {"naive_la", "timestamp", "America/Los_Angeles", "Asia/Kathmandu"}
  ]

  @expected [
    stored_since: {:ok, :db_now_utc, :db_now_utc},
    second_turn_same_chat: {:error, :conversation_busy},
    backdated_50_s_still_busy: {{:error, :conversation_busy}, true, false},
    age_seen_by_the_db: {:about, 50},
    backdated_61_s_taken_over: {false, :ok},
    after_take_over: {false, true, :ok, true},
    stale_cleanup: {true, false, [nil, nil], [nil, nil]},
    click_dated_back_by_ttl_minus_hold: {:ok, {:about, 50}},
    turn_refused_by_the_click: {:error, :click_in_flight},
    turn_takes_over_after_hold: :ok,
    keep_user_redates: {true, {:about, 50}, {:error, :click_in_flight}},
    host_wrote_a_lock_30_s_ago: {true, false, {:error, :conversation_busy}, :ok}
  ]

  @data_types %{
    "timestamptz" => "timestamp with time zone",
    "timestamp" => "timestamp without time zone"
  }

  defp naive_sql("timestamptz"), do: "SELECT 1"

  defp naive_sql("timestamp") do
    """
    ALTER TABLE phoenix_kit_agent_conversations ALTER busy_since TYPE timestamp;
    ALTER TABLE phoenix_kit_agent_user_settings ALTER busy_since TYPE timestamp
    """
  end

  @tag :slow
  test "the lock behaviour is identical for both column types and every server TimeZone, " <>
         "whatever the node's TZ" do
    runs =
      for {name, type, server_tz, node_tz} <- @variants do
        {_db, url} =
          Pg.create_database!(name, settings: ["timezone = '#{server_tz}'"], sql: naive_sql(type))

        env = [{"DATABASE_URL", url}] ++ if(node_tz, do: [{"TZ", node_tz}], else: [])
        node = Node.start!(app_env: [url: url, pool_size: 2], env: env)
        {name, type, server_tz, node_tz, node, Node.async(node, Clocks, :run, [url])}
      end

    for {name, type, server_tz, node_tz, node, id} <- runs do
      result = Node.await(node, id)

      # The variant is what it claims to be: the DB's zone and column type,
      # and a node clock whose local time is far from UTC.
      assert result.db_timezone == {server_tz, @data_types[type]},
             "#{name}: #{inspect(result.db_timezone)}"

      if node_tz,
        do: assert(result.node_utc_offset_s != 0, "#{name}: TZ=#{node_tz} not in effect")

      assert result.outcomes == @expected,
             "#{name}: " <> inspect(List.myers_difference(@expected, result.outcomes))
    end
  end
end
