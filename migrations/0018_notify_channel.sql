-- The channel the relays of an installation wake each other on. It was the constant
-- `obx_outbox`: any session may NOTIFY any channel (Postgres checks no privilege), so a
-- plugin could queue a million notifications in one call, and each woke every relay for a
-- step of its own, for as long as the queue lasted. The name is now random per installation
-- and kept in `obx.installation`, which no plugin can read.
ALTER TABLE obx.installation
    ADD COLUMN notify_channel text NOT NULL
        DEFAULT 'obx_outbox_' || substr(md5(gen_random_uuid()::text), 1, 16);
