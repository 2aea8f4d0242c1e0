-- When the payment's deadline passes, recorded with the payment: a confirmation after it is
-- refused however late the deadline's timer fires (the hosts were down, the timers had a
-- backlog), and the timer then times the payment out. A payment requested before this column
-- has none: its timer alone decides, as before.
ALTER TABLE payments ADD COLUMN deadline_at timestamptz;
