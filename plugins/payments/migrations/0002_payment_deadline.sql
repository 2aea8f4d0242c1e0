-- The payment deadline (the saga's timeout): a requested payment not confirmed within it is
-- timed out, and its order compensated. One row; SetPaymentDeadline changes it.
CREATE TABLE settings (
    id                  boolean PRIMARY KEY DEFAULT true CHECK (id),
    payment_deadline_ms bigint  NOT NULL DEFAULT 900000 CHECK (payment_deadline_ms BETWEEN 1 AND 86400000)
);
INSERT INTO settings DEFAULT VALUES;
-- When the payment was confirmed or timed out; status is 'requested', 'confirmed' or 'timed_out'.
ALTER TABLE payments ADD COLUMN settled_at timestamptz;
