CREATE TABLE payments (
    order_id    text           PRIMARY KEY,
    customer_id text           NOT NULL,
    amount      numeric(12, 2) NOT NULL,
    status      text           NOT NULL DEFAULT 'requested',
    created_at  timestamptz    NOT NULL DEFAULT now()
);
