//! The Kafka consumer of one plugin: group `<service>.<plugin>`, subscribed to the topics of
//! the plugin's manifest.
//!
//! Messages are spread over `consumer.lanes` lanes by partition; a lane handles its messages
//! one at a time, so each partition (and so each key) stays in order, while partitions
//! proceed side by side. After a message is done — handled, deduplicated, stored in the
//! inbox, parked, quarantined or skipped — and only then, its offset is stored; librdkafka
//! commits stored offsets every `consumer.auto_commit_interval_ms`.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::message::{Message, OwnedMessage};
use sqlx::{PgConnection, PgPool};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

/// Message bytes (KiB) a consumer holds in its lanes at most.
const IN_FLIGHT_KIB: usize = 64 * 1024;

use super::{backoff, Incoming};
use crate::config::{ConsumerConfig, KafkaConfig};
use crate::dispatch::Dispatcher;
use crate::kafka::Brokers;
use crate::runtime::manifest::DeliveryMode;
use crate::runtime::registry::Registry;
use crate::signal::Signal;
use crate::trace::TraceContext;

pub struct Consumer {
    pub lag: Arc<crate::telemetry::ConsumerLag>,
    pub plugin: String,
    pub group: String,
    pub dispatcher: Arc<Dispatcher>,
    pub registry: Arc<Registry>,
    pub brokers: Arc<Brokers>,
    pub kafka: KafkaConfig,
    pub config: ConsumerConfig,
    /// Wakes the inbox processors when an event lands in the inbox.
    pub inbox: Signal,
    pub shutdown: watch::Receiver<bool>,
}

/// What the lane does with the offset of a message it finished.
enum Done {
    /// The message is settled: store its offset.
    Settled,
    /// Shutdown came first: leave the offset, so the message is delivered again.
    Stopped,
}

struct Lane {
    plugin: String,
    topic_prefix: String,
    dispatcher: Arc<Dispatcher>,
    registry: Arc<Registry>,
    config: ConsumerConfig,
    inbox: Signal,
    shutdown: watch::Receiver<bool>,
}

impl Consumer {
    pub async fn run(mut self) {
        let Some(plugin) = self.registry.get(&self.plugin) else {
            return;
        };
        let prefix = &self.kafka.topic_prefix;
        let topics: Vec<String> = plugin
            .manifest
            .subscriptions
            .iter()
            .map(|s| format!("{prefix}{}", s.topic))
            .collect();
        if topics.is_empty() {
            return;
        }
        if self.kafka.create_topics {
            crate::kafka::ensure_topics(&self.brokers, &self.kafka, &topics).await;
        }
        let consumer = match self.create() {
            Ok(c) => Arc::new(c),
            Err(e) => {
                tracing::error!(plugin = %self.plugin, error = %e, "cannot create the Kafka consumer");
                return;
            }
        };
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        if let Err(e) = consumer.subscribe(&names) {
            tracing::error!(plugin = %self.plugin, error = %e, "cannot subscribe");
            return;
        }
        tracing::info!(plugin = %self.plugin, group = %self.group, ?topics, "consuming");

        // Lanes take their messages from unbounded queues, so that a busy partition never
        // holds up the others; what bounds memory is a budget of bytes in flight.
        let budget = Arc::new(Semaphore::new(IN_FLIGHT_KIB));
        let mut lanes = Vec::new();
        let mut senders = Vec::new();
        for _ in 0..self.config.lanes.max(1) {
            let (tx, rx) = mpsc::unbounded_channel::<(OwnedMessage, OwnedSemaphorePermit)>();
            let lane = Lane {
                plugin: self.plugin.clone(),
                topic_prefix: self.kafka.topic_prefix.clone(),
                dispatcher: self.dispatcher.clone(),
                registry: self.registry.clone(),
                config: self.config.clone(),
                inbox: self.inbox.clone(),
                shutdown: self.shutdown.clone(),
            };
            lanes.push(tokio::spawn(lane.run(rx, consumer.clone())));
            senders.push(tx);
        }
        loop {
            let message = tokio::select! {
                m = consumer.recv() => m,
                _ = self.shutdown.changed() => break,
            };
            match message {
                Ok(m) => {
                    let kib = (m.payload_len() / 1024).clamp(1, IN_FLIGHT_KIB) as u32;
                    let permit = tokio::select! {
                        p = budget.clone().acquire_many_owned(kib) => p.expect("never closed"),
                        _ = self.shutdown.changed() => break,
                    };
                    let lane = m.partition().unsigned_abs() as usize % senders.len();
                    if senders[lane].send((m.detach(), permit)).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(plugin = %self.plugin, error = %e, "Kafka consumer error");
                    metrics::counter!("obx_consumer_errors_total", "plugin" => self.plugin.clone()).increment(1);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        drop(senders);
        for lane in lanes {
            let _ = lane.await;
        }
        // Commit the offsets of completed work before leaving the group.
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::debug!(plugin = %self.plugin, error = %e, "final offset commit");
        }
        tracing::info!(plugin = %self.plugin, "consumer stopped");
    }

    fn create(&self) -> rdkafka::error::KafkaResult<StreamConsumer<LagReporter>> {
        let mut config = self.brokers.client_config(&self.kafka);
        config
            .set("group.id", &self.group)
            .set("enable.auto.commit", "true")
            .set("enable.auto.offset.store", "false")
            .set(
                "auto.commit.interval.ms",
                self.config.auto_commit_interval_ms.to_string(),
            )
            .set("auto.offset.reset", "earliest")
            // A subscribed topic that does not exist yet is created (where the brokers allow
            // it), rather than waited for.
            .set("allow.auto.create.topics", "true")
            .set("topic.metadata.refresh.interval.ms", "5000")
            // A host that dies gives up its partitions after 10 s, not librdkafka's 45 s.
            .set("session.timeout.ms", "10000")
            .set("heartbeat.interval.ms", "1000")
            // librdkafka reports each partition's lag with its statistics.
            .set("statistics.interval.ms", "5000")
            .set("fetch.wait.max.ms", "50");
        for (key, value) in &self.kafka.properties {
            config.set(key, value.expose());
        }
        config.create_with_context(LagReporter {
            plugin: self.plugin.clone(),
            lag: self.lag.clone(),
        })
    }
}

/// Publishes each partition's consumer lag (`obx_consumer_lag`) from librdkafka's statistics.
pub struct LagReporter {
    plugin: String,
    lag: Arc<crate::telemetry::ConsumerLag>,
}

impl rdkafka::ClientContext for LagReporter {
    fn stats(&self, statistics: rdkafka::Statistics) {
        for (topic, t) in statistics.topics {
            for (id, p) in t.partitions {
                // -1 is librdkafka's internal "unassigned" partition; a negative lag is unknown.
                if id < 0 || p.consumer_lag < 0 {
                    continue;
                }
                metrics::gauge!("obx_consumer_lag", "plugin" => self.plugin.clone(), "topic" => topic.clone(),
                    "partition" => id.to_string())
                .set(p.consumer_lag as f64);
                self.lag.set(&self.plugin, &topic, id, p.consumer_lag);
            }
        }
    }
}

impl rdkafka::consumer::ConsumerContext for LagReporter {}

impl Lane {
    async fn run(
        self,
        mut rx: mpsc::UnboundedReceiver<(OwnedMessage, OwnedSemaphorePermit)>,
        consumer: Arc<StreamConsumer<LagReporter>>,
    ) {
        while let Some((m, _permit)) = rx.recv().await {
            if *self.shutdown.borrow() {
                // What is still queued is delivered again to whoever takes the partition.
                return;
            }
            match self.handle_guarded(&m).await {
                Done::Settled => {
                    // After a rebalance the partition may belong to another host; its
                    // redelivery is then a dedup hit.
                    let _ = consumer.store_offset(m.topic(), m.partition(), m.offset());
                }
                Done::Stopped => return,
            }
        }
    }

    /// [`Lane::handle`], retried after a pause if it panics: a bug must not stop the lane,
    /// nor move the partition past the message.
    async fn handle_guarded(&self, m: &OwnedMessage) -> Done {
        loop {
            match std::panic::AssertUnwindSafe(self.handle(m)).catch_unwind().await {
                Ok(done) => return done,
                Err(_) => {
                    tracing::error!(plugin = %self.plugin, topic = m.topic(), partition = m.partition(),
                        offset = m.offset(), "handling a message panicked; retrying it");
                    if self.pause(self.config.backoff_max).await {
                        return Done::Stopped;
                    }
                }
            }
        }
    }

    fn pool(&self) -> &PgPool {
        &self.dispatcher.pool
    }

    async fn handle(&self, m: &OwnedMessage) -> Done {
        let event = match Incoming::parse(m, self.config.max_message_bytes, &self.topic_prefix) {
            Ok(e) => e,
            Err(reason) => {
                tracing::warn!(plugin = %self.plugin, topic = m.topic(), partition = m.partition(), offset = m.offset(),
                    %reason, "quarantined a message");
                metrics::counter!("obx_consumer_quarantined_total", "plugin" => self.plugin.clone()).increment(1);
                return self.retry_db(DbStep::Quarantine(m, &reason.0)).await;
            }
        };
        let Some(plugin) = self.registry.get(&self.plugin) else {
            return Done::Stopped;
        };
        let Some(subscription) = plugin.manifest.subscriptions.iter().find(|s| s.topic == event.topic) else {
            return Done::Settled;
        };
        if !subscription.event_types.is_empty() && !subscription.event_types.contains(&event.event_type) {
            return Done::Settled;
        }
        match subscription.mode {
            DeliveryMode::Inbox => {
                let done = self.retry_db(DbStep::StoreInInbox(&event)).await;
                self.inbox.notify();
                done
            }
            DeliveryMode::Dedup => self.handle_dedup(&event).await,
        }
    }

    /// Dedup mode: one transaction, on the plugin's own session, inserts the
    /// `processed_event` row (through `obx_api.begin_event`), runs the handler and commits
    /// both. A second delivery finds the row and does nothing.
    async fn handle_dedup(&self, event: &Incoming) -> Done {
        let started = std::time::Instant::now();
        let mut attempt = 1;
        loop {
            let Some(plugin) = self.registry.get(&self.plugin) else {
                return Done::Stopped;
            };
            let step = async {
                let mut tx = self.dispatcher.sessions.begin(&self.plugin).await?;
                // One statement: is the key parked behind a dead letter, and if not, is this
                // event new? (It records the event as processed, in this transaction.)
                let (parked, fresh): (bool, bool) =
                    sqlx::query_as("SELECT parked, fresh FROM obx_api.begin_event($1, $2, $3)")
                        .bind(event.event_id)
                        .bind(&event.topic)
                        .bind(&event.key)
                        .fetch_one(&mut *tx)
                        .await?;
                if parked {
                    tx.rollback().await?;
                    // Wait behind the parked event of this key, in the inbox.
                    let mut conn = self.pool().acquire().await?;
                    store_in_inbox(&mut conn, &self.plugin, event).await?;
                    self.inbox.notify();
                    metrics::counter!("obx_consumer_parked_behind_total", "plugin" => self.plugin.clone()).increment(1);
                    return Ok::<_, anyhow::Error>(Step::Done);
                }
                if !fresh {
                    tx.rollback().await?;
                    metrics::counter!("obx_consumer_dedup_hits_total", "plugin" => self.plugin.clone()).increment(1);
                    return Ok(Step::Done);
                }
                let parent = event.headers.get("traceparent").and_then(|t| TraceContext::parse(t));
                match self
                    .dispatcher
                    .run_event(&plugin, tx, event.to_guest(attempt), parent.as_ref())
                    .await
                {
                    Ok((tx, emitted)) => {
                        self.dispatcher.commit_event(tx, emitted).await?;
                        Ok(Step::Done)
                    }
                    Err(mut failure) => {
                        if let Some(tx) = failure.tx.take() {
                            let _ = tx.rollback().await;
                        }
                        Ok(Step::Failed(failure))
                    }
                }
            };
            match step.await {
                Ok(Step::Done) => {
                    tracing::trace!(plugin = %self.plugin, event_id = %event.event_id, took = ?started.elapsed(), "event settled");
                    return Done::Settled;
                }
                Ok(Step::Failed(failure)) => {
                    tracing::warn!(plugin = %self.plugin, event_id = %event.event_id, attempt,
                        error = %failure.error, "event handler failed");
                    if !failure.retriable || attempt >= self.config.max_attempts {
                        return self.retry_db(DbStep::Park(event, attempt, &failure.error)).await;
                    }
                    if self
                        .pause(backoff(self.config.backoff_initial, self.config.backoff_max, attempt))
                        .await
                    {
                        return Done::Stopped;
                    }
                    attempt += 1;
                }
                Err(e) => {
                    // The database, not the handler: wait for it, without using up attempts.
                    tracing::warn!(plugin = %self.plugin, error = %e, "database error while consuming; retrying");
                    if self.pause(self.config.backoff_max).await {
                        return Done::Stopped;
                    }
                }
            }
        }
    }

    /// Runs a database step until it succeeds, or shutdown.
    async fn retry_db(&self, step: DbStep<'_>) -> Done {
        loop {
            let result = async {
                let mut conn = self.pool().acquire().await?;
                match step {
                    DbStep::Quarantine(m, reason) => quarantine(&mut conn, &self.plugin, m, reason).await,
                    DbStep::StoreInInbox(e) => store_in_inbox(&mut conn, &self.plugin, e).await,
                    DbStep::Park(e, attempts, error) => park(&mut conn, &self.plugin, e, attempts, error).await,
                }
            }
            .await;
            match result {
                Ok(()) => return Done::Settled,
                Err(e) => {
                    tracing::warn!(plugin = %self.plugin, error = %e, "database error while consuming; retrying");
                    if self.pause(self.config.backoff_max).await {
                        return Done::Stopped;
                    }
                }
            }
        }
    }

    /// Sleeps; returns true if shutdown began meanwhile.
    async fn pause(&self, d: Duration) -> bool {
        let mut shutdown = self.shutdown.clone();
        if *shutdown.borrow() {
            return true;
        }
        tokio::select! {
            _ = tokio::time::sleep(d) => *shutdown.borrow(),
            _ = shutdown.changed() => true,
        }
    }
}

enum Step {
    Done,
    Failed(crate::dispatch::EventFailure),
}

/// The database writes a lane retries until they succeed.
#[derive(Clone, Copy)]
enum DbStep<'a> {
    Quarantine(&'a OwnedMessage, &'a str),
    StoreInInbox(&'a Incoming),
    Park(&'a Incoming, u32, &'a str),
}

/// Stores an event in the inbox, once: a redelivery finds it there.
pub(crate) async fn store_in_inbox(conn: &mut PgConnection, consumer: &str, e: &Incoming) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, headers) \
         VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7) ON CONFLICT (consumer, event_id) DO NOTHING",
    )
    .bind(consumer)
    .bind(e.event_id)
    .bind(&e.topic)
    .bind(&e.payload)
    .bind(&e.event_type)
    .bind(&e.key)
    .bind(e.headers_json())
    .execute(conn)
    .await?;
    Ok(())
}

/// Parks a dedup-mode event that kept failing: it goes to the inbox, parked, with a
/// dead-letter row; later events of its key will queue behind it.
async fn park(conn: &mut PgConnection, consumer: &str, e: &Incoming, attempts: u32, error: &str) -> sqlx::Result<()> {
    use sqlx::Connection;
    let mut tx = conn.begin().await?;
    sqlx::query(
        "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, headers, \
                                      attempts, last_error, parked) \
         VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8, $9, true) \
         ON CONFLICT (consumer, event_id) DO UPDATE SET parked = true, attempts = EXCLUDED.attempts, \
                                                        last_error = EXCLUDED.last_error",
    )
    .bind(consumer)
    .bind(e.event_id)
    .bind(&e.topic)
    .bind(&e.payload)
    .bind(&e.event_type)
    .bind(&e.key)
    .bind(e.headers_json())
    .bind(attempts as i32)
    .bind(error)
    .execute(&mut *tx)
    .await?;
    super::dlq::record(
        &mut tx,
        consumer,
        e.event_id,
        &e.topic,
        e.key.as_deref(),
        &e.event_type,
        error,
        attempts,
    )
    .await?;
    tx.commit().await?;
    tracing::error!(consumer, event_id = %e.event_id, attempts, error, "event parked in the dead-letter table");
    Ok(())
}

async fn quarantine(conn: &mut PgConnection, consumer: &str, m: &OwnedMessage, reason: &str) -> sqlx::Result<()> {
    const KEEP: usize = 64 * 1024;
    let headers = serde_json::to_value(super::utf8_headers(m)).unwrap_or_default();
    sqlx::query(
        "INSERT INTO obx.quarantine (consumer, topic, kafka_partition, kafka_offset, key, value, headers, reason) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
    )
    .bind(consumer)
    .bind(m.topic())
    .bind(m.partition())
    .bind(m.offset())
    .bind(m.key())
    .bind(m.payload().map(|p| &p[..p.len().min(KEEP)]))
    .bind(headers)
    .bind(reason)
    .execute(conn)
    .await?;
    Ok(())
}
