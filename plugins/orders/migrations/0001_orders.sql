CREATE TABLE orders (
    id          uuid        PRIMARY KEY,
    customer_id text        NOT NULL,
    amount      numeric(12, 2) NOT NULL CHECK (amount > 0),
    status      text        NOT NULL DEFAULT 'pending',
    items       jsonb       NOT NULL DEFAULT '[]',
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_orders_customer ON orders (customer_id);
