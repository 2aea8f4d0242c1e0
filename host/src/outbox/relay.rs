//! The relay: publishes committed outbox rows to Kafka (R-DIST-OBX-1, R-DIST-OBX-3).
//!
//! Each step runs one transaction on the relay's own connection:
//!
//! 1. claim up to `batch_size` unpublished rows of the relay's shards, in id order, with
//!    `SELECT … FOR UPDATE SKIP LOCKED`;
//! 2. send each row to its own topic (key = `partition_key`, value = the JSON payload,
//!    headers `eventId`, `eventType`, `aggregateType`, `aggregateId`, `obx-plugin`) with the
//!    relay's one long-lived idempotent producer;
//! 3. wait for the delivery reports, up to `ack_timeout`;
//! 4. set `published_at` on exactly the rows the broker acknowledged, record refused rows
//!    for a later attempt with backoff, and commit. A row the broker refuses for good (too
//!    large, an invalid topic) is set aside instead: it stops holding up its key, and is
//!    counted in `obx status` and `obx_outbox_set_aside`. A broker refuses a whole produce
//!    batch for one row, so a row refused for good with other rows in flight first goes
//!    again alone (`State::alone`), and is set aside only if refused alone.
//!
//! **Ordering.** The rows of one partition key all fall in one of 64 shards
//! (`obx.outbox_shard`), and each shard is leased by one relay at a time with a session
//! advisory lock (keyed by the installation's random lock space, so that the keys are not
//! public constants), held on the same connection that claims rows: a relay never sees rows of a
//! shard while another relay could hold them. A relay sends a key's rows in id order and
//! never past one that is not yet acknowledged: a row the broker refused blocks the later
//! rows of its key on its topic (not the shard, nor the key on other topics, which may be
//! another plugin's) until it goes through. Producer messages never expire
//! (`message.timeout.ms = 0`), so a key's messages cannot be reordered by a timeout; a row
//! still unacknowledged at `ack_timeout` stays in flight, and a later step collects its
//! report instead of sending it again; a producer whose acknowledgements stall past
//! `stall_timeout` while the broker answers a new client is replaced, and its rows go again
//! in id order through the new one. Shards are spread evenly over the live relays: each
//! relay also holds a membership lock, and rebalances to its fair share every second.
//!
//! **At least once.** A row is marked only after its acknowledgement. A relay that dies
//! between the send and the mark leaves the row unpublished, and it is sent again: consumers
//! deduplicate by `eventId`. Kafka's idempotence covers one producer session only.
//!
//! **Delayed events** wait in `obx.outbox_delayed`. Before each claim a relay moves the due
//! ones into the outbox (`obx.outbox_release_due`), where each takes its place in its key's
//! order at that moment; an idle relay sleeps no longer than until the next one is due.
//!
//! **Wake-ups.** The relay wakes when this host commits outbox rows (in process), when
//! another host does (a `NOTIFY` on the installation's random channel, sent by
//! [`super::notifier`] outside the command transactions), and on a slow poll as a fallback.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection};
use tokio::sync::watch;

use crate::config::{CloudEventsConfig, KafkaConfig, RelayConfig};
use crate::db::locks::LockSpace;
use crate::kafka::Brokers;
use crate::otel;
use crate::trace::TraceContext;

use super::unprintable;

/// How many batches' worth of unanswered rows a relay keeps in flight, passed by.
const STUCK_BATCHES: usize = 10;

/// Relay shards; `obx.outbox_shard` computes the same modulus.
pub const SHARDS: i32 = 64;

/// Why a publish span ended without an answer from the broker.
const RESENT: &str = "the producer was replaced; the row is sent again";

const REBALANCE_EVERY: Duration = Duration::from_secs(1);
/// The longest pause after a failed step.
const STEP_RETRY_MAX: Duration = Duration::from_secs(1);

/// An outbox row as the relay and replay send it.
#[derive(Debug, sqlx::FromRow)]
pub struct OutboxRow {
    pub id: i64,
    pub event_id: uuid::Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: String,
    pub topic: String,
    pub partition_key: String,
    pub created_at: DateTime<Utc>,
    pub shard: i32,
    pub traceparent: Option<String>,
    pub plugin_name: String,
}

/// The columns [`OutboxRow`] reads, for the SELECTs of the relay and of replay.
/// Marks rows `ids` published, those the broker acknowledged, and forgets their failures.
/// A row already published keeps its time (a replay of rows set aside may run twice).
pub(super) async fn mark_published<'c>(conn: impl sqlx::PgExecutor<'c>, ids: &[i64]) -> sqlx::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "WITH marked AS (UPDATE obx.outbox_event SET published_at = now() \
                         WHERE id = ANY($1) AND published_at IS NULL RETURNING id) \
         DELETE FROM obx.outbox_delivery_failure WHERE outbox_id IN (SELECT id FROM marked)",
    )
    .bind(ids)
    .execute(conn)
    .await?;
    Ok(())
}

/// The rows a claim may take, as a condition on `o`, with this relay's shards as `$1`: not
/// published, and not behind a delivery failure of their key that waits (or set aside
/// themselves).
const CLAIMABLE: &str = "o.published_at IS NULL \
     AND obx.outbox_shard(o.partition_key) = ANY($1) \
     AND NOT EXISTS (SELECT 1 FROM obx.outbox_delivery_failure f \
                     WHERE f.topic = o.topic AND f.partition_key = o.partition_key \
                       AND f.outbox_id <= o.id \
                       AND CASE WHEN f.set_aside THEN f.outbox_id = o.id \
                                ELSE f.next_attempt_at > now() END)";

pub const OUTBOX_ROW_COLUMNS: &str = "o.id, o.event_id, o.aggregate_type, o.aggregate_id, o.event_type, \
     o.payload::text AS payload, o.topic, o.partition_key, o.created_at, \
     obx.outbox_shard(o.partition_key) AS shard, o.traceparent, o.plugin_name";

impl OutboxRow {
    /// What the row weighs in memory and in a Kafka message: its payload, key and the
    /// fields its headers carry.
    pub fn bytes(&self) -> usize {
        const FRAMING: usize = 256;
        self.payload.len()
            + self.partition_key.len()
            + self.aggregate_type.len()
            + self.aggregate_id.len()
            + self.event_type.len()
            + self.topic.len()
            + self.traceparent.as_ref().map_or(0, String::len)
            + FRAMING
    }

    /// The Kafka headers of this row. The first two are named as in the seed, so that
    /// services following it can read them; `obx-plugin` names the plugin that emitted it
    /// (from the session it was written on), and `traceparent` carries the trace on. Where
    /// `cloudevents` covers the row's topic, CloudEvents' binary-mode headers follow.
    pub fn headers(&self, cloudevents: &CloudEventsConfig) -> OwnedHeaders {
        let event_id = self.event_id.to_string();
        let mut headers = OwnedHeaders::new_with_capacity(13);
        let mut add = |key: &str, value: &str| {
            headers = std::mem::take(&mut headers).insert(Header {
                key,
                value: Some(value),
            });
        };
        add("eventId", &event_id);
        add("eventType", &self.event_type);
        add("aggregateType", &self.aggregate_type);
        add("aggregateId", &self.aggregate_id);
        add("obx-plugin", &self.plugin_name);
        if let Some(t) = &self.traceparent {
            add("traceparent", t);
        }
        if cloudevents.covers(&self.topic) {
            add("ce_specversion", "1.0");
            add("ce_id", &event_id);
            add("ce_type", &self.event_type);
            add("ce_source", &format!("{}/{}", cloudevents.source, self.plugin_name));
            add("ce_subject", &self.aggregate_id);
            add(
                "ce_time",
                &self.created_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            );
            add("content-type", "application/json");
        }
        headers
    }

    /// The span of this row's publishing to `topic`, under the span that wrote the row.
    fn publish_span(&self, topic: &str) -> Option<otel::Span> {
        if !otel::enabled() {
            return None;
        }
        let parent = self.traceparent.as_deref().and_then(TraceContext::parse);
        let mut span = otel::Span::export_only(format!("publish {topic}"), otel::Kind::Producer, parent.as_ref())?;
        if span.recording() {
            span.set("messaging.system", "kafka");
            span.set("messaging.operation.type", "send");
            span.set("messaging.destination.name", topic.to_string());
            span.set("messaging.kafka.message.key", self.partition_key.clone());
            span.set("messaging.message.id", self.event_id.to_string());
            span.set("obx.event_type", self.event_type.clone());
            span.set("obx.outbox_id", self.id);
        }
        Some(span)
    }

    /// The Kafka record of this row, for `topic` (the row's topic with the configured prefix).
    pub fn record<'a>(&'a self, topic: &'a str, headers: OwnedHeaders) -> FutureRecord<'a, str, str> {
        FutureRecord::to(topic)
            .key(self.partition_key.as_str())
            .payload(self.payload.as_str())
            .timestamp(self.created_at.timestamp_millis())
            .headers(headers)
    }
}

/// An idempotent producer. The relay's messages never expire (`message_timeout` `None`),
/// which keeps a key's order through any outage; replay gives up after a bound instead.
/// Its queue (messages not yet acknowledged) holds what [`STUCK_BATCHES`] claims and two
/// more may: rows the broker never answers are passed by, and the claims that follow would
/// otherwise queue `relay.batch_max_bytes` more at every step, up to librdkafka's 1 GiB.
/// Past it a send is refused as back-pressure, and the step queues no more.
pub fn producer(
    brokers: &Brokers,
    kafka: &KafkaConfig,
    relay: &RelayConfig,
    message_timeout: Option<Duration>,
) -> Result<FutureProducer> {
    let queue_bytes = ((STUCK_BATCHES + 2) * relay.batch_max_bytes).max(4 * kafka.producer_max_message_bytes());
    let mut config = brokers.client_config(kafka);
    // Ours first, then the user's properties again, so that theirs win, but for those the
    // guarantees rest on, which may only repeat ours.
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set(
            "message.timeout.ms",
            message_timeout.map_or(0, |t| t.as_millis()).to_string(),
        )
        .set("linger.ms", relay.linger_ms.to_string())
        .set("queue.buffering.max.kbytes", queue_bytes.div_ceil(1024).to_string())
        .set("partitioner", kafka.partitioner.librdkafka_name())
        .set("retry.backoff.ms", "50")
        .set("retry.backoff.max.ms", "1000")
        .set("reconnect.backoff.ms", "50")
        .set("reconnect.backoff.max.ms", "1000");
    for (key, value) in kafka.user_properties() {
        config.set(key, value);
    }
    config.create().context("creating the Kafka producer")
}

pub struct Relay {
    pub database_url: String,
    pub brokers: Arc<Brokers>,
    pub kafka: KafkaConfig,
    pub config: RelayConfig,
    /// Bumped by every local commit that wrote outbox rows.
    pub signal: watch::Receiver<u64>,
    pub shutdown: watch::Receiver<bool>,
    /// Set while this relay holds every shard: then no other relay needs waking.
    pub owns_all: Arc<AtomicBool>,
}

/// What one step did, and so what the loop does next.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// A full batch went out: there may be more.
    More,
    /// Nothing (more) to do: wait for a wake-up.
    Idle,
    /// Some rows were refused: wait before trying again.
    Backoff,
    /// Some rows are still unacknowledged after a whole `ack_timeout`: wait for them again
    /// at once, so that they are marked as soon as the broker answers (the wait itself paces
    /// the loop; a backoff here would delay recovery from an outage by up to `backoff_max`).
    Waiting,
}

/// A row sent and not yet acknowledged. Its report is collected by the steps that follow,
/// whatever they claim; claims pass it by.
struct Inflight {
    shard: i32,
    sent: Instant,
    delivery: DeliveryFuture,
    /// From the send to the broker's answer, when spans are exported.
    span: Option<otel::Span>,
    /// What marking it, or recording its failure, needs of the row.
    row: SentRow,
    /// Recorded as unanswered (past `stall_timeout`) since it was sent.
    unanswered: bool,
    /// Sent with no other row in flight (see `State::alone`).
    alone: bool,
}

/// The parts of a sent row that its delivery report is settled with.
#[derive(Clone)]
struct SentRow {
    id: i64,
    event_id: uuid::Uuid,
    topic: String,
    partition_key: String,
    created_at: DateTime<Utc>,
}

impl SentRow {
    fn of(row: &OutboxRow) -> SentRow {
        SentRow {
            id: row.id,
            event_id: row.event_id,
            topic: row.topic.clone(),
            partition_key: row.partition_key.clone(),
            created_at: row.created_at,
        }
    }
}

struct State {
    conn: Option<PgConnection>,
    locks: Option<LockSpace>,
    /// The installation's wake-up channel, read with the connection.
    channel: Option<String>,
    /// How many rows the next claim asks for (see [`next_claim_limit`]).
    claim_limit: u32,
    /// Set for the last step, at shutdown.
    closing: bool,
    producer: Option<FutureProducer>,
    /// Sent rows whose delivery report has not arrived yet, by row id.
    inflight: HashMap<i64, Inflight>,
    shards: BTreeSet<i32>,
    /// Topics seen to exist (or created): a new topic is checked once, before its first send.
    topics: HashSet<String>,
    last_rebalance: Option<Instant>,
    /// When the last claim began.
    last_step: Option<Instant>,
    /// How long, at the last step, until the earliest delayed event was due.
    next_delayed: Option<Duration>,
    /// Steps in a row whose release of due delayed events was held up by a lock.
    release_held: u32,
    /// When the producer last reported a delivery, acknowledged or refused.
    last_report: Option<Instant>,
    /// When a new client last found the broker answering (the stall check's probe).
    broker_answered: Option<Instant>,
    /// Rows the broker refused for good while other rows were in flight, by id, with their
    /// shard: each goes again alone, and is set aside only if refused alone. A broker refuses
    /// a whole produce batch for its size or one bad record (`MSG_SIZE_TOO_LARGE`,
    /// `INVALID_RECORD`), and librdkafka fails every row in it with that error: small rows of
    /// other keys were set aside with the one too large.
    alone: HashMap<i64, i32>,
    /// The highest row id this relay has sent: a later row of a key that went ahead of a
    /// refused one was sent by it, so none lies past this.
    sent_up_to: i64,
}

impl Relay {
    pub async fn run(mut self) {
        let mut state = State {
            conn: None,
            locks: None,
            channel: None,
            claim_limit: self.config.batch_size,
            closing: false,
            producer: None,
            inflight: HashMap::new(),
            shards: BTreeSet::new(),
            topics: HashSet::new(),
            last_rebalance: None,
            last_step: None,
            next_delayed: None,
            release_held: 0,
            last_report: None,
            broker_answered: None,
            alone: HashMap::new(),
            sent_up_to: 0,
        };
        let mut listener: Option<PgListener> = None;
        let mut backoff = self.config.backoff_initial;
        loop {
            if *self.shutdown.borrow() {
                break;
            }
            // After a step that found nothing, wait for a wake-up or the poll; after one
            // that failed, wait out the backoff (wake-ups would only hammer a sick broker).
            let (pause, wake_early) = match self.step(&mut state).await {
                Ok(Outcome::More) => {
                    backoff = self.config.backoff_initial;
                    continue;
                }
                Ok(Outcome::Idle) => {
                    backoff = self.config.backoff_initial;
                    // Under a steady stream of commits, let a few gather: fewer, larger
                    // steps cost the database less per event.
                    let since = state.last_step.map(|t| t.elapsed()).unwrap_or(Duration::MAX);
                    if since < self.config.min_step_interval {
                        tokio::time::sleep(self.config.min_step_interval - since).await;
                    }
                    let poll = self.config.poll_interval;
                    (state.next_delayed.map_or(poll, |due| due.min(poll)), true)
                }
                Ok(Outcome::Backoff) => (next_backoff(&mut backoff, self.config.backoff_max), false),
                Ok(Outcome::Waiting) => (self.config.backoff_initial, false),
                Err(e) => {
                    tracing::warn!(error = format!("{e:#}"), "outbox relay step failed");
                    metrics::counter!("obx_relay_errors_total", "kind" => "step").increment(1);
                    // A broken connection loses its leases; start over with a new one.
                    state.conn = None;
                    state.shards.clear();
                    state.alone.clear();
                    self.owns_all.store(false, Ordering::Relaxed);
                    // Another relay may take those shards at once: what is in flight on them
                    // goes with its producer, and is claimed again. Settled later on shards
                    // another relay held, a refusal recorded there locked the row, whose
                    // key's next row that relay then sent first.
                    if !state.inflight.is_empty() {
                        purge(&mut state, None).await;
                    }
                    // A step fails for the database (a restart, a terminated backend) or a
                    // producer that cannot be made: try again within a second, not after
                    // the backoff of refused deliveries (up to backoff_max).
                    (
                        next_backoff(&mut backoff, STEP_RETRY_MAX.min(self.config.backoff_max)),
                        false,
                    )
                }
            };
            if wake_early && listener.is_none() {
                if let Some(channel) = &state.channel {
                    listener = self.listen(channel).await;
                }
            }
            let wake = {
                let notified = async {
                    match listener.as_mut() {
                        Some(l) if wake_early => l.recv().await.is_err(),
                        _ => std::future::pending().await,
                    }
                };
                tokio::select! {
                    changed = self.signal.changed(), if wake_early => {
                        if changed.is_err() { Wake::Stop } else { Wake::Commit }
                    }
                    failed = notified => if failed { Wake::ListenerLost } else { Wake::Commit },
                    _ = tokio::time::sleep(pause) => Wake::Timer,
                    _ = self.shutdown.changed() => Wake::Stop,
                }
            };
            match wake {
                Wake::Stop => break,
                Wake::ListenerLost => listener = None,
                Wake::Commit | Wake::Timer => {}
            }
        }
        // Finish what is in flight, within a bound, so that acknowledged rows are marked.
        if let Some(producer) = &state.producer {
            let _ = producer.flush(Duration::from_secs(5));
        }
        if !state.inflight.is_empty() {
            state.closing = true;
            let _ = self.step(&mut state).await;
        }
        tracing::info!("outbox relay stopped");
    }

    /// Replaces the producer if it must be: after a fatal error, or when its
    /// acknowledgements have stalled past `stall_timeout` while the broker answers a new
    /// client (a producer can keep waiting on a connection or a sequence state from before
    /// an outage long after the broker is back; it may not even answer a metadata request
    /// itself). Its rows in flight go with it ([`purge`]).
    async fn replace_unfit_producer(&self, st: &mut State) -> Result<()> {
        let Some(current) = st.producer.as_ref() else {
            return Ok(());
        };
        let fatal = current.client().fatal_error();
        let why = if let Some((code, reason)) = &fatal {
            format!("fatal error {code:?}: {reason}")
        } else {
            let Some(oldest) = st.inflight.values().map(|f| f.sent).min() else {
                return Ok(());
            };
            // A producer that still reports deliveries works: its unanswered rows wait on
            // their partitions (one without a leader, a topic the broker does not know), and
            // a new producer would wait as it does, after sending every row again.
            let reporting = st.last_report.is_some_and(|t| t.elapsed() < self.config.stall_timeout);
            if oldest.elapsed() < self.config.stall_timeout || reporting {
                return Ok(());
            }
            format!(
                "{} rows unacknowledged for {:?} while the broker answers",
                st.inflight.len(),
                oldest.elapsed()
            )
        };
        let fresh = producer(&self.brokers, &self.kafka, &self.config, None)?;
        let probe = fresh.clone();
        let answers =
            tokio::task::spawn_blocking(move || probe.client().fetch_metadata(None, Duration::from_secs(2)).is_ok())
                .await
                .unwrap_or(false);
        if answers {
            st.broker_answered = Some(Instant::now());
        }
        if !answers && fatal.is_none() {
            // The broker is still away: a new producer would wait as the old one does.
            return Ok(());
        }
        tracing::warn!(why, "replacing the Kafka producer");
        metrics::counter!("obx_relay_producer_rebuilds_total").increment(1);
        purge(st, Some(fresh)).await;
        Ok(())
    }

    async fn listen(&self, channel: &str) -> Option<PgListener> {
        let mut listener = PgListener::connect(&self.database_url).await.ok()?;
        listener.listen(channel).await.ok()?;
        Some(listener)
    }

    async fn step(&self, st: &mut State) -> Result<Outcome> {
        if st.conn.is_none() {
            let options = crate::db::lease_holder(crate::db::host_options(&self.database_url, "obx-relay")?);
            let mut conn = PgConnection::connect_with(&options)
                .await
                .context("connecting the relay")?;
            let locks = LockSpace::load(&mut conn).await?;
            st.channel = Some(crate::db::installation::notify_channel(&mut conn).await?);
            join(&mut conn, locks).await?;
            st.conn = Some(conn);
            st.locks = Some(locks);
            st.last_rebalance = None;
        }
        self.replace_unfit_producer(st).await?;
        let conn = st.conn.as_mut().expect("connected above");
        let locks = st.locks.expect("loaded with the connection");
        if st.last_rebalance.is_none_or(|t| t.elapsed() >= REBALANCE_EVERY) {
            let busy: HashSet<i32> = st.inflight.values().map(|f| f.shard).collect();
            rebalance(conn, locks, &mut st.shards, &busy).await?;
            st.alone.retain(|_, shard| st.shards.contains(shard));
            self.owns_all
                .store(st.shards.len() == SHARDS as usize, Ordering::Relaxed);
            st.last_rebalance = Some(Instant::now());
            metrics::gauge!("obx_relay_shards").set(st.shards.len() as f64);
        }
        if st.shards.is_empty() {
            return Ok(Outcome::Idle);
        }
        if st.producer.is_none() {
            st.producer = Some(producer(&self.brokers, &self.kafka, &self.config, None)?);
        }
        let producer = st.producer.as_ref().expect("built above");

        let wake = (!self.owns_all.load(Ordering::Relaxed))
            .then_some(st.channel.as_deref())
            .flatten();
        let (next, held) = match release_due(conn, self.config.batch_size, wake).await? {
            Released::Due { next, held } => (next, held),
            Released::Held => (Some(RELEASE_RETRY), true),
        };
        st.next_delayed = next;
        if held {
            st.release_held += 1;
            if st.release_held % RELEASE_HELD_WARN == 0 {
                tracing::warn!(
                    steps = st.release_held,
                    "due delayed events are held back: their release keeps \
                    waiting for a lock (an open transaction writing an event with the same id, or other relays)"
                );
            }
        } else {
            st.release_held = 0;
        }
        let shards: Vec<i32> = st.shards.iter().copied().collect();
        let started = Instant::now();
        st.last_step = Some(started);
        // The mark need not wait for the disk: if it is lost in a crash, the rows are sent
        // again, which at-least-once allows. This keeps fsync out of the relay's cycle.
        // The claim must walk the partial index in id order and stop at the batch size; with
        // stale statistics (right after a burst) the planner may prefer to read and sort the
        // whole backlog instead, so that plan shape is ruled out for this transaction. A plan
        // priced with a ruled-out node would also be JIT-compiled at every claim: no JIT.
        let mut tx = conn
            .begin_with(
                "BEGIN; SELECT set_config('synchronous_commit', 'off', true), set_config('enable_sort', 'off', true), \
                 set_config('enable_bitmapscan', 'off', true), set_config('jit', 'off', true)",
            )
            .await?;
        let claim = format!(
            "SELECT {OUTBOX_ROW_COLUMNS} FROM obx.outbox_event o WHERE {CLAIMABLE} \
             ORDER BY o.id LIMIT $2 FOR UPDATE OF o SKIP LOCKED"
        );
        let rows = sqlx::query_as::<_, OutboxRow>(&claim)
            .bind(&shards)
            .bind(i64::from(st.claim_limit))
            .fetch(&mut *tx);
        let (rows, cut) = match within_bytes(rows, self.config.batch_max_bytes).await {
            Ok(claimed) => claimed,
            Err(e) if unprintable::failed_to_print(&e) => {
                tx.rollback().await?;
                // None set aside: the server is short of memory for another reason, and the
                // step fails as any other, with its pause (not claimed again at once).
                if unprintable::set_aside(conn, CLAIMABLE, &shards, st.claim_limit).await? == 0 {
                    return Err(e.into());
                }
                return Ok(Outcome::More);
            }
            Err(e) => return Err(e.into()),
        };
        let full = rows.len() as u32 >= st.claim_limit;
        st.claim_limit = next_claim_limit(
            st.claim_limit,
            &rows,
            cut,
            self.config.batch_size,
            self.config.batch_max_bytes,
        );
        if rows.is_empty() && st.inflight.is_empty() {
            tx.commit().await?;
            return Ok(Outcome::Idle);
        }
        let claimed = started.elapsed();

        let topics: Vec<String> = rows
            .iter()
            .map(|r| format!("{}{}", self.kafka.topic_prefix, r.topic))
            .collect();
        if self.kafka.create_topics {
            let mut new: Vec<String> = topics.iter().filter(|t| !st.topics.contains(*t)).cloned().collect();
            new.sort();
            new.dedup();
            if !new.is_empty() {
                crate::kafka::ensure_topics(&self.brokers, &self.kafka, &new).await;
                st.topics.extend(new);
            }
        }

        // Send, in id order. A key whose row could not be queued sends nothing after it.
        // A row to go alone is sent once nothing else awaits an answer, and with nothing else.
        let solo = first_to_go_alone(&rows, &st.alone);
        let waiting = st.inflight.values().any(|f| !f.unanswered);
        let (mut held_back, mut queue_full) = (false, false);
        let mut blocked: HashSet<(&str, &str)> = HashSet::new();
        // Nor does a key with a row still in flight from an earlier step: sent in another
        // produce request, a later row can land before it if the broker refuses it for a
        // reason the producer does not retry (its idempotence keeps order only through the
        // retries it makes itself). A step waits for its answers, so this holds keys back only
        // while the broker is slow to answer.
        let earlier: HashSet<(String, String)> = st
            .inflight
            .values()
            .map(|f| (f.row.topic.clone(), f.row.partition_key.clone()))
            .collect();
        let mut refused: Vec<(SentRow, Refusal)> = Vec::new();
        // Topics the broker does not know: created (where allowed) before the next attempt.
        let mut unknown_topics: Vec<String> = Vec::new();
        for (row, topic) in rows.iter().zip(&topics) {
            // Stopping: the last step settles what is in flight, and sends nothing new.
            if st.closing
                || blocked.contains(&(row.topic.as_str(), row.partition_key.as_str()))
                || st.inflight.contains_key(&row.id)
            {
                continue;
            }
            if !earlier.is_empty() && earlier.contains(&(row.topic.clone(), row.partition_key.clone())) {
                blocked.insert((row.topic.as_str(), row.partition_key.as_str()));
                // Answered later in this step, that row lets it go in the next one at once.
                held_back = true;
                continue;
            }
            if solo.is_some_and(|id| waiting || id != row.id) {
                held_back = true;
                continue;
            }
            if solo.is_none() && st.alone.contains_key(&row.id) {
                // An earlier row of its key goes first.
                blocked.insert((row.topic.as_str(), row.partition_key.as_str()));
                continue;
            }
            match producer.send_result(row.record(topic, row.headers(&self.kafka.cloudevents))) {
                Ok(delivery) => {
                    let inflight = Inflight {
                        shard: row.shard,
                        sent: Instant::now(),
                        delivery,
                        span: row.publish_span(topic),
                        row: SentRow::of(row),
                        unanswered: false,
                        alone: solo == Some(row.id),
                    };
                    st.inflight.insert(row.id, inflight);
                    st.sent_up_to = st.sent_up_to.max(row.id);
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    // Back-pressure, not a fault of the row: stop queueing for this step.
                    metrics::counter!("obx_relay_errors_total", "kind" => "queue_full").increment(1);
                    queue_full = true;
                    break;
                }
                Err((e, _)) => {
                    let refusal = Refusal::of(&e, row.created_at);
                    if refusal.permanent {
                        // The producer judged this row alone.
                        st.alone.remove(&row.id);
                    }
                    blocked.insert((row.topic.as_str(), row.partition_key.as_str()));
                    refused.push((SentRow::of(row), refusal));
                }
            }
        }

        // Collect the delivery reports of every row in flight, this step's and earlier ones'.
        let sent_at = started.elapsed();
        // Rows stalled past `stall_timeout` are waited for a second at a time, so that the
        // producer is checked (and replaced) soon after the broker is back.
        let stalled = st
            .inflight
            .values()
            .any(|f| f.sent.elapsed() >= self.config.stall_timeout);
        let wait = if stalled {
            self.config.ack_timeout.min(Duration::from_secs(1))
        } else {
            self.config.ack_timeout
        };
        let deadline = tokio::time::Instant::now() + wait;
        let mut acked: Vec<SentRow> = Vec::new();
        let mut pending = 0usize;
        // Rows in flight past `stall_timeout` with no answer while the broker answers others,
        // or a new client (a partition without a leader, a topic the broker does not know):
        // recorded as failing, so that they are counted and claims pass them and their keys
        // by (as long as they stay in flight: `still_unanswered`), up to `STUCK_BATCHES`
        // batches of them. In an outage of the whole broker they are not: the rows in flight
        // keep their places in the claims, which bounds how many are sent meanwhile.
        let mut unanswered: Vec<(SentRow, Refusal)> = Vec::new();
        let mut still_unanswered: Vec<i64> = Vec::new();
        let recent = |t: Option<Instant>| t.is_some_and(|t| t.elapsed() < self.config.stall_timeout * 3);
        let broker_answers = recent(st.last_report) || recent(st.broker_answered);
        let mut stuck = st.inflight.values().filter(|f| f.unanswered).count();
        let most_stuck = self.config.batch_size as usize * STUCK_BATCHES;
        let mut ids: Vec<i64> = st.inflight.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let inflight = st.inflight.get_mut(&id).expect("listed above");
            // A row already recorded as unanswered is only asked, not waited for: it must not
            // slow the steps of the others.
            let known = inflight.unanswered;
            let until = if known { tokio::time::Instant::now() } else { deadline };
            let Ok(result) = tokio::time::timeout_at(until, &mut inflight.delivery).await else {
                let waited = inflight.sent.elapsed();
                if known {
                    still_unanswered.push(id);
                } else if waited >= self.config.stall_timeout && broker_answers && stuck < most_stuck {
                    inflight.unanswered = true;
                    stuck += 1;
                    unanswered.push((inflight.row.clone(), Refusal::unanswered(waited)));
                } else {
                    pending += 1;
                }
                continue;
            };
            st.last_report = Some(Instant::now());
            let Inflight {
                mut span,
                row,
                alone,
                shard,
                ..
            } = st.inflight.remove(&id).expect("listed above");
            match result {
                Ok(Ok(delivery)) => {
                    if let Some(span) = &mut span {
                        span.set("messaging.destination.partition.id", delivery.partition.to_string());
                        span.set("messaging.kafka.offset", delivery.offset);
                    }
                    // Commit-to-ack: from the row's insert, just before its commit.
                    let latency = (Utc::now() - row.created_at).num_microseconds().unwrap_or(0).max(0);
                    metrics::histogram!("obx_outbox_commit_to_ack_seconds").record(latency as f64 / 1e6);
                    st.alone.remove(&row.id);
                    acked.push(row)
                }
                Ok(Err((e, _))) => {
                    if let Some(span) = &mut span {
                        span.fail(e.to_string());
                    }
                    let topic = format!("{}{}", self.kafka.topic_prefix, row.topic);
                    let unknown = matches!(
                        e.rdkafka_error_code(),
                        Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic)
                    );
                    if unknown && !unknown_topics.contains(&topic) {
                        unknown_topics.push(topic);
                    }
                    let mut refusal = Refusal::of(&e, row.created_at);
                    if refusal.permanent {
                        // Perhaps for another row of its produce batch: sent with others, it
                        // goes again alone (unless that would pass a later row of its key).
                        refusal.again_alone = (!alone).then_some(shard);
                        refusal.permanent = alone;
                        st.alone.remove(&row.id);
                    }
                    refused.push((row, refusal));
                }
                // The producer that sent it is gone; the row is sent again.
                Err(_canceled) => {
                    if let Some(span) = &mut span {
                        span.fail(RESENT);
                    }
                }
            }
        }

        let acked_at = started.elapsed();
        // Mark what the broker acknowledged; record what it refused.
        let acked_ids: Vec<i64> = acked.iter().map(|r| r.id).collect();
        mark_published(&mut *tx, &acked_ids).await?;
        // After the marks: a later row of a refused row's key may be among them.
        let in_flight = st.inflight.values().map(|f| &f.row);
        settle_again_alone(&mut tx, &mut st.alone, in_flight, st.sent_up_to, &mut refused).await?;
        if !refused.is_empty() {
            self.record_refusals(&mut tx, &refused).await?;
        }
        if !unanswered.is_empty() {
            self.record_refusals(&mut tx, &unanswered).await?;
        }
        if !still_unanswered.is_empty() {
            // Still no answer: claims go on passing them by.
            sqlx::query(
                "UPDATE obx.outbox_delivery_failure \
                 SET next_attempt_at = greatest(next_attempt_at, now() + make_interval(secs => $2)) \
                 WHERE outbox_id = ANY($1) AND NOT set_aside",
            )
            .bind(&still_unanswered)
            .bind(self.config.stall_timeout.as_secs_f64())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        for topic in &unknown_topics {
            // Check it again before the next attempt.
            st.topics.remove(topic);
        }

        tracing::debug!(rows = rows.len(), acked = acked.len(), ?claimed, ?sent_at, ?acked_at, took = ?started.elapsed(), "relay step");
        metrics::counter!("obx_outbox_published_total").increment(acked.len() as u64);
        metrics::counter!("obx_relay_errors_total", "kind" => "refused").increment(refused.len() as u64);
        metrics::gauge!("obx_relay_inflight").set(st.inflight.len() as f64);
        if pending > 0 {
            metrics::counter!("obx_relay_errors_total", "kind" => "ack_timeout").increment(1);
            tracing::warn!(
                pending,
                "outbox rows still unacknowledged after {wait:?}; is the broker up?",
            );
        }
        Ok(outcome(&Step {
            refused: !refused.is_empty(),
            pending: pending > 0,
            acked: !acked.is_empty(),
            more_claimable: cut || full,
            held_back,
            queue_full,
        }))
    }
}

impl Relay {
    /// Records refused rows: for a later attempt with backoff (their key waits), or, when
    /// the broker will never take them, set aside (their key moves on). The backoff's doubling
    /// stops at 2^60: `power(2, 1024)` overflows a double, and a row refused that often (8.5
    /// hours of a missing ACL at a 30 s backoff) failed every step of its relay.
    async fn record_refusals(&self, conn: &mut PgConnection, refused: &[(SentRow, Refusal)]) -> Result<()> {
        for (row, r) in refused {
            if r.again_alone.is_some() {
                tracing::warn!(id = row.id, event_id = %row.event_id, topic = %row.topic, error = %r.error,
                    "the broker refused an outbox row with the rows sent with it; it goes again alone");
            } else if r.permanent {
                tracing::error!(id = row.id, event_id = %row.event_id, topic = %row.topic, error = %r.error,
                    "the broker refuses an outbox row for good; it is set aside and its key moves on");
                metrics::counter!("obx_outbox_set_aside_total").increment(1);
            } else {
                tracing::warn!(id = row.id, event_id = %row.event_id, topic = %row.topic, error = %r.error,
                    "the broker refused an outbox row; it will be retried");
            }
        }
        sqlx::query(
            "INSERT INTO obx.outbox_delivery_failure \
               (outbox_id, topic, partition_key, attempts, last_error, next_attempt_at, set_aside) \
             SELECT id, topic, key, 1, error, \
                    CASE WHEN aside THEN 'infinity' ELSE now() + make_interval(secs => $5) END, aside \
             FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::bool[], $7::text[]) \
                  AS r(id, key, error, aside, topic) \
             ON CONFLICT (outbox_id) DO UPDATE SET \
               attempts = obx.outbox_delivery_failure.attempts + 1, \
               last_error = EXCLUDED.last_error, \
               set_aside = EXCLUDED.set_aside, \
               next_attempt_at = CASE WHEN EXCLUDED.set_aside THEN 'infinity' ELSE now() + make_interval(secs => \
                   least($6, $5 * power(2, least(obx.outbox_delivery_failure.attempts, 60)))) END, \
               updated_at = now()",
        )
        .bind(refused.iter().map(|(r, _)| r.id).collect::<Vec<_>>())
        .bind(
            refused
                .iter()
                .map(|(r, _)| r.partition_key.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(refused.iter().map(|(_, e)| e.error.as_str()).collect::<Vec<_>>())
        .bind(refused.iter().map(|(_, e)| e.permanent).collect::<Vec<_>>())
        .bind(self.config.backoff_initial.as_secs_f64())
        .bind(self.config.backoff_max.as_secs_f64())
        .bind(refused.iter().map(|(r, _)| r.topic.as_str()).collect::<Vec<_>>())
        .execute(conn)
        .await?;
        Ok(())
    }
}

/// The first claimed row that is to go alone (`State::alone`) and is the first claimed row of
/// its key on its topic: an earlier row of its key goes before it, alone or not.
fn first_to_go_alone(rows: &[OutboxRow], alone: &HashMap<i64, i32>) -> Option<i64> {
    let mut keys: HashSet<(&str, &str)> = HashSet::new();
    rows.iter()
        .find(|r| keys.insert((r.topic.as_str(), r.partition_key.as_str())) && alone.contains_key(&r.id))
        .map(|r| r.id)
}

/// Decides, for each row refused for good with other rows in flight, whether it goes
/// again alone (`State::alone`): not if a later row of its key on its topic is published
/// (this step's marks included: run after them) or still in flight, since that row would
/// then precede it on the broker. Such a row is set aside, and its key moves on. A later row
/// that went ahead was sent by this relay, so only rows up to `sent_up_to` are read: the
/// claims since the refused row's, not the outbox.
async fn settle_again_alone<'a>(
    conn: &mut PgConnection,
    alone: &mut HashMap<i64, i32>,
    in_flight: impl Iterator<Item = &'a SentRow>,
    sent_up_to: i64,
    refused: &mut [(SentRow, Refusal)],
) -> sqlx::Result<()> {
    let candidates: Vec<&SentRow> = refused
        .iter()
        .filter(|(_, r)| r.again_alone.is_some())
        .map(|(row, _)| row)
        .collect();
    if candidates.is_empty() {
        return Ok(());
    }
    // Walks the rows from each candidate to the last this relay sent, by the primary key.
    let published: HashSet<i64> = sqlx::query_scalar(
        "SELECT r.id FROM unnest($1::bigint[], $2::text[], $3::text[]) AS r(id, topic, key) \
         WHERE EXISTS (SELECT 1 FROM obx.outbox_event o WHERE o.id > r.id AND o.id <= $4 \
                         AND o.topic = r.topic AND o.partition_key = r.key AND o.published_at IS NOT NULL)",
    )
    .bind(candidates.iter().map(|r| r.id).collect::<Vec<_>>())
    .bind(candidates.iter().map(|r| r.topic.as_str()).collect::<Vec<_>>())
    .bind(candidates.iter().map(|r| r.partition_key.as_str()).collect::<Vec<_>>())
    .bind(sent_up_to)
    .fetch_all(conn)
    .await?
    .into_iter()
    .collect();
    let in_flight: Vec<&SentRow> = in_flight.collect();
    for (row, refusal) in refused.iter_mut() {
        let Some(shard) = refusal.again_alone else {
            continue;
        };
        let overtaken = published.contains(&row.id)
            || in_flight
                .iter()
                .any(|l| l.id > row.id && l.topic == row.topic && l.partition_key == row.partition_key);
        if overtaken {
            refusal.again_alone = None;
            refusal.permanent = true;
        } else {
            alone.insert(row.id, shard);
        }
    }
    Ok(())
}

/// Drops the rows in flight with the producer that sent them, which `replacement` (if any)
/// takes the place of: the old one's messages are purged and its connections closed (off
/// the async workers, as that may block) before anything else is sent, and the rows are
/// claimed and sent again in id order, so each key's order holds (second copies on the
/// broker are allowed: at least once).
async fn purge(st: &mut State, replacement: Option<FutureProducer>) {
    let old = std::mem::replace(&mut st.producer, replacement);
    for (_, inflight) in st.inflight.drain() {
        if let Some(mut span) = inflight.span {
            span.fail(RESENT);
        }
    }
    if let Some(old) = old {
        let _ = tokio::task::spawn_blocking(move || drop(old)).await;
    }
}

/// What a step saw, for what the loop does next.
struct Step {
    /// The broker refused rows.
    refused: bool,
    /// Rows are still unacknowledged after the step's wait.
    pending: bool,
    /// The broker acknowledged rows.
    acked: bool,
    /// The claim was full or cut by its bytes: more rows may be waiting.
    more_claimable: bool,
    /// A row was held back to go alone once nothing else is in flight.
    held_back: bool,
    /// The producer's queue refused a send.
    queue_full: bool,
}

/// What the loop does after a step. A queue that refused a send frees room only as the
/// broker answers: with no answer this step, the next one waits instead of following at once
/// (rows the broker never answers can fill the queue by their bytes, and the relay then
/// stepped without a pause, a claim and an update at every turn).
fn outcome(step: &Step) -> Outcome {
    if step.refused {
        Outcome::Backoff
    } else if step.pending || (step.queue_full && !step.acked) {
        Outcome::Waiting
    } else if step.more_claimable || (step.held_back && !step.queue_full) {
        Outcome::More
    } else {
        Outcome::Idle
    }
}

/// How old a row must be (by this host's clock) for the broker's refusal of its timestamp to
/// be for good: it is then older than the topic allows, and only grows older. A younger row
/// refused so is ahead of the brokers' clock (the database's clock is ahead of theirs, past
/// the topic's `message.timestamp.after.max.ms`): time mends that, so it is retried with
/// backoff, its key held, where it was set aside, and with it the whole backlog, one row a
/// step, each key's order lost for good.
const SURELY_OLD: chrono::TimeDelta = chrono::TimeDelta::minutes(5);

/// Why the broker (or the producer) refused a row.
struct Refusal {
    error: String,
    /// No later attempt can succeed: the message is too large, the topic is invalid, or
    /// the broker refuses the timestamp of a row past [`SURELY_OLD`] (its age, against the
    /// topic's `message.timestamp.*` settings: the row keeps its `created_at`, and only grows
    /// older).
    permanent: bool,
    /// Refused for good, but with other rows in flight, perhaps for one of them: it goes
    /// again alone. Its shard.
    again_alone: Option<i32>,
}

impl Refusal {
    /// A row in flight for `waited` with no answer from the broker.
    fn unanswered(waited: Duration) -> Refusal {
        Refusal {
            error: format!(
                "no answer from the broker for {:.1?} (a partition without a leader, or a topic the broker \
                 does not know?); the row is still in flight",
                waited
            ),
            permanent: false,
            again_alone: None,
        }
    }

    /// The broker's refusal `e` of a row written at `created_at`.
    fn of(e: &KafkaError, created_at: DateTime<Utc>) -> Refusal {
        use RDKafkaErrorCode as C;
        let code = e.rdkafka_error_code();
        let mut permanent = matches!(
            code,
            Some(
                C::MessageSizeTooLarge
                    | C::InvalidMessageSize
                    | C::MessageBatchTooLarge
                    | C::InvalidTopic
                    | C::InvalidRecord
            )
        );
        let mut error = e.to_string();
        if code == Some(C::InvalidTimestamp) {
            let age = Utc::now().signed_duration_since(created_at);
            permanent = age > SURELY_OLD;
            if !permanent {
                error.push_str(&format!(
                    " (the row was written {:.1} s ago by the database's clock, which may be ahead of \
                     the brokers': it waits until they take it)",
                    age.as_seconds_f64()
                ));
            }
        }
        Refusal {
            error,
            permanent,
            again_alone: None,
        }
    }
}

enum Wake {
    Commit,
    Timer,
    ListenerLost,
    Stop,
}

/// What the release of due delayed events came to.
enum Released {
    /// Done: how long until the next delayed event is due, if one waits, and whether due
    /// events were left because their key is held: an event of it could not move without
    /// waiting for a lock (an open transaction that wrote its id, or another relay), and a
    /// key's events move in due order (`obx.outbox_release_due`, migration 0023).
    Due { next: Option<Duration>, held: bool },
    /// It waited its most for a lock outside the function's own waits, and left its rows for
    /// a later step; the relay publishes on meanwhile.
    Held,
}

/// A release held up by a lock is tried again this soon.
const RELEASE_RETRY: Duration = Duration::from_millis(100);
/// Steps in a row held up before a warning (and between warnings).
const RELEASE_HELD_WARN: u32 = 20;

/// Moves the delayed events that are due into the outbox (each takes its place in its key's
/// order now), in a transaction of its own, before the claim; wakes the other relays if it
/// moved any, since their shards may hold them.
async fn release_due(conn: &mut PgConnection, batch_size: u32, wake: Option<&str>) -> Result<Released> {
    let row = sqlx::query_as("SELECT released, next_due_ms, held FROM obx.outbox_release_due($1)")
        .bind(i32::try_from(batch_size).unwrap_or(i32::MAX))
        .fetch_one(&mut *conn)
        .await;
    let (released, next_due_ms, held): (i32, Option<i64>, i32) = match row {
        Err(e) if crate::db::lock_timed_out(&e) => {
            metrics::counter!("obx_outbox_delayed_release_held_total").increment(1);
            tracing::debug!("releasing due delayed events waited its most for a lock; trying again next step");
            return Ok(Released::Held);
        }
        row => row.context("releasing due delayed events")?,
    };
    if held > 0 {
        metrics::counter!("obx_outbox_delayed_release_held_total").increment(1);
        tracing::debug!(held, released, "due delayed events of a held key wait for a later step");
    }
    if released > 0 {
        metrics::counter!("obx_outbox_delayed_released_total").increment(released as u64);
        if let Some(channel) = wake {
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(channel)
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(Released::Due {
        next: next_due_ms.map(|ms| Duration::from_millis(ms.max(0) as u64)),
        held: held > 0,
    })
}

fn next_backoff(backoff: &mut Duration, max: Duration) -> Duration {
    let pause = *backoff;
    *backoff = (*backoff * 2).min(max);
    pause
}

/// Registers this relay as a member, so that the others count it when they share shards.
pub(crate) async fn join(conn: &mut PgConnection, locks: LockSpace) -> Result<()> {
    loop {
        let member: i32 = rand_i32();
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
            .bind(locks.member)
            .bind(member)
            .fetch_one(&mut *conn)
            .await?;
        if locked {
            return Ok(());
        }
    }
}

fn rand_i32() -> i32 {
    uuid::Uuid::new_v4().as_u128() as i32
}

/// The first rows of a claim, in id order, that fit in `max_bytes` (the first row always),
/// and whether the claim had more. The rest is read and dropped: those rows stay
/// unpublished, for the next step. So a claim of large rows, and the producer's queue after
/// it, holds a bounded amount of memory, and a key's rows still go out in order.
pub(super) async fn within_bytes<S>(rows: S, max_bytes: usize) -> sqlx::Result<(Vec<OutboxRow>, bool)>
where
    S: futures::Stream<Item = sqlx::Result<OutboxRow>> + Unpin,
{
    crate::db::take_within(rows, max_bytes, OutboxRow::bytes).await
}

/// The rows the next claim asks Postgres for: [`crate::db::next_take_limit`], up to
/// `batch_size`. A backlog of large rows thus costs the database about what the relay sends.
pub(super) fn next_claim_limit(limit: u32, kept: &[OutboxRow], cut: bool, most_rows: u32, most_bytes: usize) -> u32 {
    let bytes: usize = kept.iter().map(OutboxRow::bytes).sum();
    crate::db::next_take_limit(limit, kept.len(), bytes, cut, most_rows, most_bytes)
}

/// Moves this relay's shards toward its fair share: `ceil(64 / members)`. A shard with rows
/// still in flight is not given up, so that a hand-over never sends a row twice.
async fn rebalance(
    conn: &mut PgConnection,
    locks: LockSpace,
    held: &mut BTreeSet<i32>,
    busy: &HashSet<i32>,
) -> Result<()> {
    locks.evict_intruders(conn).await?;
    // Members are the host user's sessions: a plugin session is never counted.
    let members: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid = $1::oid \
           AND a.usename = current_user \
           AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())",
    )
    .bind(locks.member as i64)
    .fetch_one(&mut *conn)
    .await?;
    let fair = (SHARDS as usize).div_ceil(members.max(1) as usize);
    if held.len() > fair {
        let extra: Vec<i32> = held
            .iter()
            .rev()
            .filter(|s| !busy.contains(s))
            .take(held.len() - fair)
            .copied()
            .collect();
        sqlx::query("SELECT pg_advisory_unlock($1, s) FROM unnest($2::int[]) AS s")
            .bind(locks.shard)
            .bind(&extra)
            .execute(&mut *conn)
            .await?;
        for s in extra {
            held.remove(&s);
        }
    } else if held.len() < fair {
        let mine: Vec<i32> = held.iter().copied().collect();
        // The LIMIT stops the scan, so exactly the returned shards were locked. The CASE
        // fixes the order of evaluation: with a plain AND the planner may run the (cheaper)
        // lock first, which takes a held shard's lock a second time (session locks count),
        // and one unlock would then no longer release it.
        let got: Vec<i32> = sqlx::query_scalar(
            "SELECT s FROM generate_series(0, $3 - 1) AS s \
             WHERE CASE WHEN s = ANY($2) THEN false ELSE pg_try_advisory_lock($1, s) END \
             LIMIT $4",
        )
        .bind(locks.shard)
        .bind(&mine)
        .bind(SHARDS)
        .bind((fair - held.len()) as i64)
        .fetch_all(&mut *conn)
        .await?;
        held.extend(got);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::embedded::EmbeddedPostgres;

    const LOCKS: LockSpace = LockSpace::of(0x6f62_7800);

    /// A step whose sends met a full queue and that got no answer waits before the next one:
    /// rows the broker never answers can fill the queue by their bytes, and the relay then
    /// stepped without a pause. With answers, the queue has room again, and it goes on.
    #[test]
    fn a_full_queue_with_no_answer_waits_before_the_next_step() {
        let step = |acked: bool, queue_full: bool| Step {
            refused: false,
            pending: false,
            acked,
            more_claimable: true,
            held_back: false,
            queue_full,
        };
        assert_eq!(outcome(&step(false, true)), Outcome::Waiting);
        assert_eq!(outcome(&step(true, true)), Outcome::More);
        assert_eq!(outcome(&step(false, false)), Outcome::More);
        let refused = Step {
            refused: true,
            ..step(false, true)
        };
        assert_eq!(outcome(&refused), Outcome::Backoff);
    }

    fn row(id: i64, payload_bytes: usize) -> OutboxRow {
        OutboxRow {
            id,
            event_id: uuid::Uuid::now_v7(),
            aggregate_type: "A".into(),
            aggregate_id: "a".into(),
            event_type: "E".into(),
            payload: "x".repeat(payload_bytes),
            topic: "t".into(),
            partition_key: "k".into(),
            created_at: Utc::now(),
            shard: 0,
            traceparent: None,
            plugin_name: "p".into(),
        }
    }

    /// A row refused for good with others in flight goes again alone, unless a later row of
    /// its key on its topic is published (by an earlier step, or marked in this one) or still
    /// in flight: sent again, it would follow that row on the broker. It is then set aside.
    /// And a row to go alone waits for an earlier claimed row of its key.
    #[tokio::test]
    async fn a_refused_row_goes_again_alone_only_if_no_later_row_of_its_key_went_ahead() {
        let pg = EmbeddedPostgres::start(&[]).unwrap();
        let pool = sqlx::PgPool::connect(&pg.url("postgres")).await.unwrap();
        crate::db::migrate(&pool).await.unwrap();
        // Rows of keys k, j and i, in this order; the second row of k is published.
        let mut ids = HashMap::new();
        for (name, key, published) in [
            ("k1", "k", false),
            ("j1", "j", false),
            ("i1", "i", false),
            ("k2", "k", true),
        ] {
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO obx.outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, topic, \
                                               partition_key, plugin_name, plugin_version, published_at) \
                 VALUES (gen_random_uuid(), 'A', $1, 'E', '{}', 't', $1, 'p', '1', \
                         CASE WHEN $2 THEN now() END) RETURNING id",
            )
            .bind(key)
            .bind(published)
            .fetch_one(&pool)
            .await
            .unwrap();
            ids.insert(name, id);
        }
        let sent = |name: &str, key: &str| {
            let mut r = row(ids[name], 1);
            r.partition_key = key.into();
            SentRow::of(&r)
        };
        let refusal = || Refusal {
            error: "Broker: Message size too large".into(),
            permanent: false,
            again_alone: Some(7),
        };
        let mut refused = vec![
            (sent("k1", "k"), refusal()),
            (sent("j1", "j"), refusal()),
            (sent("i1", "i"), refusal()),
        ];
        // A later row of j is still in flight.
        let in_flight = [
            sent("i1", "i"),
            SentRow {
                id: ids["k2"] + 1,
                ..sent("j1", "j")
            },
        ];
        let mut alone = HashMap::new();
        let mut conn = pool.acquire().await.unwrap();
        settle_again_alone(&mut conn, &mut alone, in_flight.iter(), ids["k2"] + 1, &mut refused)
            .await
            .unwrap();
        let settled: Vec<(bool, Option<i32>)> = refused.iter().map(|(_, r)| (r.permanent, r.again_alone)).collect();
        assert_eq!(settled, vec![(true, None), (true, None), (false, Some(7))]);
        assert_eq!(alone, HashMap::from([(ids["i1"], 7)]));

        // Of two rows of a key to go alone, the earlier goes first; a row of another key
        // claimed before them does not change that.
        let claimed = |names: &[(&str, &str)]| {
            names
                .iter()
                .map(|(name, key)| {
                    let mut r = row(ids[name], 1);
                    r.partition_key = (*key).into();
                    r
                })
                .collect::<Vec<_>>()
        };
        let alone = HashMap::from([(ids["j1"], 0), (ids["k2"], 0)]);
        let rows = claimed(&[("k1", "k"), ("j1", "j"), ("k2", "k")]);
        assert_eq!(first_to_go_alone(&rows, &alone), Some(ids["j1"]));
        let alone = HashMap::from([(ids["k2"], 0)]);
        assert_eq!(first_to_go_alone(&rows, &alone), None);
        // `close` waits for every connection out of the pool: with `conn` still held, and no
        // idle one for it to close (a race), it waited for ever.
        drop(conn);
        pool.close().await;
    }

    /// After a claim cut by its bytes, the next asks for as many rows as fitted; after a full
    /// one well within them, for twice as many, up to `batch_size`.
    #[test]
    fn a_claim_asks_for_about_as_many_rows_as_fit() {
        const MOST: usize = 100_000;
        let rows = |n: usize, each: usize| (0..n as i64).map(|i| row(i, each)).collect::<Vec<_>>();
        assert_eq!(next_claim_limit(100, &rows(3, 3_000), true, 100, MOST), 3);
        assert_eq!(next_claim_limit(1, &rows(1, 50_000), true, 100, MOST), 1);
        assert_eq!(next_claim_limit(3, &rows(3, 100), false, 100, MOST), 6);
        assert_eq!(next_claim_limit(3, &rows(3, 20_000), false, 100, MOST), 3);
        assert_eq!(next_claim_limit(80, &rows(80, 10), false, 100, MOST), 100);
        assert_eq!(next_claim_limit(10, &rows(4, 10), false, 100, MOST), 10);
    }

    /// A claim keeps the rows that fit, in order, and always its first row. A row weighs its
    /// payload, its key and its headers' fields.
    #[tokio::test]
    async fn a_claim_keeps_the_first_rows_within_its_bytes() {
        let claim = |sizes: &[usize]| {
            let rows: Vec<sqlx::Result<OutboxRow>> =
                sizes.iter().enumerate().map(|(i, n)| Ok(row(i as i64, *n))).collect();
            futures::stream::iter(rows)
        };
        let ids = |(rows, cut): (Vec<OutboxRow>, bool)| (rows.iter().map(|r| r.id).collect::<Vec<_>>(), cut);
        let (empty, tiny) = (row(0, 0).bytes(), row(0, 10).bytes());
        assert!(empty > 0 && tiny == empty + 10);
        let budget = 2 * tiny + 5;
        assert_eq!(
            ids(within_bytes(claim(&[10, 10, 10]), budget).await.unwrap()),
            (vec![0, 1], true)
        );
        assert_eq!(
            ids(within_bytes(claim(&[10, 10]), budget).await.unwrap()),
            (vec![0, 1], false)
        );
        assert_eq!(
            ids(within_bytes(claim(&[10, 10, 0]), 2 * tiny + empty).await.unwrap()),
            (vec![0, 1, 2], false)
        );
        assert_eq!(
            ids(within_bytes(claim(&[5000, 1]), budget).await.unwrap()),
            (vec![0], true)
        );
        assert_eq!(
            ids(within_bytes(claim(&[5000]), budget).await.unwrap()),
            (vec![0], false)
        );
        assert_eq!(ids(within_bytes(claim(&[]), budget).await.unwrap()), (vec![], false));
    }

    /// Shards whose lock this session really holds, as Postgres sees them.
    async fn locked(conn: &mut PgConnection) -> BTreeSet<i32> {
        sqlx::query_scalar::<_, i64>(
            "SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND pid = pg_backend_pid() AND classid = $1::oid AND objsubid = 2",
        )
        .bind(LOCKS.shard as i64)
        .fetch_all(&mut *conn)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s as i32)
        .collect()
    }

    async fn member(url: &str) -> PgConnection {
        let mut conn = PgConnection::connect(url).await.unwrap();
        join(&mut conn, LOCKS).await.unwrap();
        conn
    }

    /// A relay that takes shards while it already holds some, and later gives shards up,
    /// really releases them: what it believes it holds is what Postgres says it holds.
    /// (Postgres may evaluate the lock before the "not already mine" test; a session lock
    /// taken twice needs two unlocks.)
    #[tokio::test]
    async fn what_a_relay_believes_it_holds_is_what_it_holds() {
        let pg = EmbeddedPostgres::start(&[]).unwrap();
        let url = pg.url("postgres");
        // The host's schema, as a relay always has it: its eviction reads the plugin roles.
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        crate::db::migrate(&pool).await.unwrap();
        pool.close().await;
        let none = HashSet::new();
        let (mut a, mut b) = (member(&url).await, member(&url).await);
        let (mut held_a, mut held_b) = (BTreeSet::new(), BTreeSet::new());
        rebalance(&mut a, LOCKS, &mut held_a, &none).await.unwrap();
        rebalance(&mut b, LOCKS, &mut held_b, &none).await.unwrap();
        assert_eq!((held_a.len(), held_b.len()), (32, 32));
        // B leaves: A takes the rest while holding its own 32.
        b.close().await.unwrap();
        // B's backend ends (and its locks go) a moment after its client closes.
        for _ in 0..100 {
            rebalance(&mut a, LOCKS, &mut held_a, &none).await.unwrap();
            if held_a.len() == 64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(held_a.len(), 64);
        assert_eq!(locked(&mut a).await, held_a);
        // Two more join: A gives up to its fair share, and the others get the rest.
        let (mut c, mut d) = (member(&url).await, member(&url).await);
        let (mut held_c, mut held_d) = (BTreeSet::new(), BTreeSet::new());
        for _ in 0..2 {
            rebalance(&mut a, LOCKS, &mut held_a, &none).await.unwrap();
            rebalance(&mut c, LOCKS, &mut held_c, &none).await.unwrap();
            rebalance(&mut d, LOCKS, &mut held_d, &none).await.unwrap();
        }
        assert_eq!(locked(&mut a).await, held_a, "A holds locks it gave up");
        assert_eq!(held_a.len(), 22);
        assert_eq!(held_c.len() + held_d.len(), 42, "C {held_c:?} D {held_d:?}");
    }
}
