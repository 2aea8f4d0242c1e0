CREATE TABLE products (
    id                text        PRIMARY KEY,
    quantity          integer     NOT NULL CHECK (quantity >= 0),
    reserved_quantity integer     NOT NULL DEFAULT 0 CHECK (reserved_quantity >= 0),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    CHECK (reserved_quantity <= quantity)
);
CREATE TABLE reservations (
    order_id   text        NOT NULL,
    product_id text        NOT NULL REFERENCES products(id),
    quantity   integer     NOT NULL CHECK (quantity > 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, product_id)
);
