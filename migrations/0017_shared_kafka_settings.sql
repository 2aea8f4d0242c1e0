-- The Kafka settings every host of an installation must share. A key's partition follows
-- `kafka.partitioner` and its topic `kafka.topic_prefix`: a relay that took shards over from
-- a host with another partitioner would put a key's later events on another partition, where
-- consumers read them out of order with its earlier ones. The first host of this version to
-- start records its settings; a host whose settings differ refuses to start
-- (`db::installation::check_shared_kafka_settings`). NULL: not recorded yet.
ALTER TABLE obx.installation
    ADD COLUMN kafka_partitioner text,
    ADD COLUMN kafka_topic_prefix text;
