-- Partition leases (consumer.assignment = "leases"): a consumer holds a session advisory
-- lock per partition it consumes, and a shared one per group it belongs to. These tables
-- give each group and each partition a small number of its own, the second key of its lock,
-- so that no two of them can ever share a lock (a hash of the names could).
CREATE TABLE obx.consumer_group (
    id         integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_name text NOT NULL UNIQUE
);

CREATE TABLE obx.consumer_partition (
    id         integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_id   integer NOT NULL REFERENCES obx.consumer_group (id),
    topic      text    NOT NULL,
    partition  integer NOT NULL,
    UNIQUE (group_id, topic, partition)
);
