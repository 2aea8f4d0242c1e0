//! Replay: publishes stored outbox events again, by id range, time range or aggregate, to
//! rebuild read models (R-DIST-OBX-3: Postgres is the source of truth, Kafka the transport).
//!
//! Replayed messages carry the same key, value and headers as the originals, plus
//! `obx-replay: true`. Consumers deduplicating by `eventId` skip what they have processed;
//! read models being rebuilt from scratch see every event again, in id order.
//! `published_at` is not touched.
//!
//! Only published events are sent again: an event the relay has not published yet is left to
//! it, in its key's order. Sent by a replay, it could go out before an earlier event of its
//! key that the relay holds (a refused send waiting out its backoff, or a relay behind), and
//! a consumer would take the two out of order.
//!
//! The exception is asked for by name (`set_aside`): the rows the relay set aside, refused
//! for good (too large, or a timestamp the topic refused), which it never sends again. Once
//! the cause is fixed, such a replay sends them (after their keys' events published since,
//! which went on without them) and marks each published once the broker acknowledged it; one
//! the broker refuses again stays set aside, and the replay goes on past it.

use anyhow::{bail, Context, Result};
use chrono::{DateTime, Utc};
use rdkafka::message::Header;
use rdkafka::producer::FutureProducer;
use sqlx::PgPool;

use super::relay::{mark_published, next_claim_limit, within_bytes, OutboxRow, OUTBOX_ROW_COLUMNS};

/// Which events to replay. Every given condition must hold; at least one must be given.
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplayFilter {
    pub from_id: Option<i64>,
    pub to_id: Option<i64>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    /// The rows the relay set aside instead of published ones. Left out when false, so that
    /// a host that does not know it (a rolling upgrade) takes the filter.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub set_aside: bool,
}

impl ReplayFilter {
    /// Whether no condition was given (which would select the whole outbox). The rows set
    /// aside are a condition of their own.
    pub fn is_empty(&self) -> bool {
        !self.set_aside
            && self.from_id.is_none()
            && self.to_id.is_none()
            && self.since.is_none()
            && self.until.is_none()
            && self.aggregate_type.is_none()
            && self.aggregate_id.is_none()
    }
}

/// Why a replay without a filter is refused: it would send the whole outbox.
pub const NO_FILTER: &str = "give at least one of: an id range, a time range, an aggregate, the rows set aside";

/// The header that marks a replayed message.
pub const REPLAY_HEADER: &str = "obx-replay";
const PAGE: u32 = 1000;

/// What a replay (or a part of one) sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replayed {
    pub sent: u64,
    /// Rows set aside that the broker refused again (`set_aside` only): they stay set aside,
    /// and the replay went on past them.
    pub refused: u64,
    /// Where the rest begins, if the replay stopped at its time before the end: the same
    /// filter with this `from_id` goes on.
    pub next_from_id: Option<i64>,
}

/// Replays every matching event, in id order, and waits until the broker has acknowledged
/// each. Returns how many were sent.
pub async fn replay(
    pool: &PgPool,
    producer: &FutureProducer,
    kafka: &crate::config::KafkaConfig,
    filter: &ReplayFilter,
    page_bytes: usize,
) -> Result<u64> {
    Ok(replay_until(pool, producer, kafka, filter, page_bytes, None)
        .await?
        .sent)
}

/// [`replay`], stopping at the first page boundary past `until`, if given, with every event
/// sent so far acknowledged: a replay through the admin API answers within its request's
/// time, in parts (a long one was cut at `http.request_timeout`, and its retry started over).
pub async fn replay_until(
    pool: &PgPool,
    producer: &FutureProducer,
    kafka: &crate::config::KafkaConfig,
    filter: &ReplayFilter,
    page_bytes: usize,
    until: Option<std::time::Instant>,
) -> Result<Replayed> {
    let f = filter;
    if f.is_empty() {
        bail!(NO_FILTER);
    }
    // A replayed key goes where its live events went.
    let partitioner = kafka.partitioner.librdkafka_name();
    crate::db::installation::check_shared_kafka_settings(pool, Some(partitioner), &kafka.topic_prefix, false).await?;
    // Saturating: `from_id` is the caller's, and i64::MIN - 1 overflowed.
    let mut after = f.from_id.map(|id| id.saturating_sub(1)).unwrap_or(0);
    let (mut sent, mut refused) = (0u64, 0u64);
    // Published rows; or those set aside, which are not, found from their failure records
    // (few, and indexed) rather than by walking the outbox.
    let (from, which) = match f.set_aside {
        false => ("obx.outbox_event o", "o.published_at IS NOT NULL"),
        true => (
            "obx.outbox_delivery_failure f JOIN obx.outbox_event o ON o.id = f.outbox_id",
            "f.set_aside AND f.outbox_id > $1 AND o.published_at IS NULL",
        ),
    };
    let page = format!(
        "SELECT {OUTBOX_ROW_COLUMNS} FROM {from} \
             WHERE o.id > $1 \
               AND ($2::bigint IS NULL OR o.id <= $2) \
               AND ($3::timestamptz IS NULL OR o.created_at >= $3) \
               AND ($4::timestamptz IS NULL OR o.created_at < $4) \
               AND ($5::text IS NULL OR o.aggregate_type = $5) \
               AND ($6::text IS NULL OR o.aggregate_id = $6) \
               AND {which} \
             ORDER BY o.id LIMIT $7"
    );
    // Rows asked for: as for a relay claim, about as many as fitted in the last page.
    let mut limit = PAGE;
    loop {
        let rows = sqlx::query_as::<_, OutboxRow>(&page)
            .bind(after)
            .bind(f.to_id)
            .bind(f.since)
            .bind(f.until)
            .bind(&f.aggregate_type)
            .bind(&f.aggregate_id)
            .bind(i64::from(limit))
            .fetch(pool);
        // A page of large rows, and the producer's queue after it, holds a bounded amount
        // of memory, as a relay claim does (`relay.batch_max_bytes`).
        let (rows, cut) = within_bytes(rows, page_bytes).await.context("reading the outbox")?;
        let Some(last) = rows.last() else { break };
        after = last.id;
        let mut deliveries = Vec::with_capacity(rows.len());
        for row in &rows {
            let headers = row.headers(&kafka.cloudevents).insert(Header {
                key: REPLAY_HEADER,
                value: Some("true"),
            });
            let topic = format!("{}{}", kafka.topic_prefix, row.topic);
            let delivery = producer
                .send_result(row.record(&topic, headers))
                .map_err(|(e, _)| e)
                .with_context(|| format!("queueing outbox row {}", row.id))?;
            deliveries.push((row.id, delivery));
        }
        let (mut acked, mut refused_again) = (Vec::with_capacity(deliveries.len()), Vec::new());
        let outcome = async {
            for (id, delivery) in deliveries {
                match delivery.await {
                    Ok(Ok(_)) => acked.push(id),
                    // Set aside again: the rows after it go on.
                    Ok(Err((e, _))) if f.set_aside => refused_again.push((id, e)),
                    Ok(Err((e, _))) => bail!("the broker refused outbox row {id}: {e}"),
                    Err(_) => bail!("the producer stopped before outbox row {id} was acknowledged"),
                }
            }
            Ok(())
        }
        .await;
        sent += acked.len() as u64;
        refused += refused_again.len() as u64;
        if let Some((id, e)) = refused_again.first() {
            tracing::warn!(rows = refused_again.len(), first = id, error = %e, "the broker refused rows set aside again; they stay set aside");
        }
        if f.set_aside {
            // Even when a later row was refused: those the broker took are not sent again.
            mark_published(pool, &acked)
                .await
                .context("marking the rows set aside as published")?;
        }
        outcome?;
        metrics::counter!("obx_outbox_replayed_total").increment(rows.len() as u64);
        if !cut && (rows.len() as u32) < limit {
            break;
        }
        if until.is_some_and(|t| std::time::Instant::now() >= t) {
            return Ok(Replayed {
                sent,
                refused,
                next_from_id: Some(after.saturating_add(1)),
            });
        }
        limit = next_claim_limit(limit, &rows, cut, PAGE, page_bytes);
    }
    Ok(Replayed {
        sent,
        refused,
        next_from_id: None,
    })
}
