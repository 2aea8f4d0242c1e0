-- Indexes the retention job's deletes need.
--
-- Deleting a processed inbox row cascades to its dead letters, by (consumer, event_id): with no
-- index there, each deleted row scanned the whole of obx.dead_letter, so a batch of 5,000 rows
-- after an incident with many parked keys ran for minutes, holding back vacuum everywhere.
CREATE INDEX ix_dead_letter_event ON obx.dead_letter(consumer, event_id);

-- Quarantined messages (up to a message's size each) go by age, and arrive in time order:
-- a BRIN index spares each batch a scan of the whole table.
CREATE INDEX ix_quarantine_received_at ON obx.quarantine USING brin (received_at);
