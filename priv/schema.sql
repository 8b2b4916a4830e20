-- The tables of phoenix_kit_agent_locks. Idempotent: safe to run again.
-- busy_since / busy_turn_ref are a row's lock: free when busy_turn_ref is NULL.
CREATE TABLE IF NOT EXISTS phoenix_kit_agent_conversations (
  uuid uuid PRIMARY KEY,
  busy_since timestamptz,
  busy_turn_ref text
);

CREATE TABLE IF NOT EXISTS phoenix_kit_agent_user_settings (
  user_uuid uuid PRIMARY KEY,
  busy_since timestamptz,
  busy_turn_ref text,
  inserted_at timestamptz NOT NULL DEFAULT now(),
  updated_at timestamptz NOT NULL DEFAULT now()
);
