//! The installation's row (`obx.installation`): what every host of a service shares.

use anyhow::{bail, Context, Result};
use sqlx::{PgConnection, PgPool};

/// Postgres's SQLSTATE for a column that does not exist.
const UNDEFINED_COLUMN: &str = "42703";

/// Records this host's `kafka.partitioner` (if it relays: `None` if not) and
/// `kafka.topic_prefix` for the installation if none are recorded yet, and refuses a host
/// whose settings differ from those recorded: every host of a service relays the same keys,
/// and a key must stay on one partition of one topic whichever host sends it
/// (`migrations/0017_shared_kafka_settings.sql`). Partitioners that place keyed messages
/// alike (`murmur2` and `murmur2_random`, say) are the same here. Without `record`, only
/// compares (a replay: it publishes, and records nothing).
pub async fn check_shared_kafka_settings(
    pool: &PgPool,
    partitioner: Option<&str>,
    topic_prefix: &str,
    record: bool,
) -> Result<()> {
    let sql = if record {
        "UPDATE obx.installation SET kafka_partitioner = coalesce(kafka_partitioner, $1), \
                kafka_topic_prefix = coalesce(kafka_topic_prefix, $2) \
         RETURNING kafka_partitioner, kafka_topic_prefix"
    } else {
        "SELECT coalesce(kafka_partitioner, $1), coalesce(kafka_topic_prefix, $2) FROM obx.installation"
    };
    let recorded: sqlx::Result<(Option<String>, String)> = sqlx::query_as(sql)
        .bind(partitioner)
        .bind(topic_prefix)
        .fetch_one(pool)
        .await;
    let (recorded_partitioner, recorded_prefix) = match recorded {
        // A database its hosts have not yet migrated to record them (a replay run with a
        // newer CLI): nothing recorded, nothing to compare.
        Err(sqlx::Error::Database(e)) if !record && e.code().as_deref() == Some(UNDEFINED_COLUMN) => return Ok(()),
        recorded => recorded.context(match record {
            true => "recording the installation's Kafka settings",
            false => "reading the installation's Kafka settings",
        })?,
    };
    let placement = |name: &str| name.trim_end_matches("_random").to_string();
    let partitioners = match (partitioner, recorded_partitioner.as_deref()) {
        (Some(ours), Some(recorded)) => Some((ours, recorded)),
        _ => None,
    };
    let differing = [
        partitioners
            .filter(|(ours, recorded)| placement(ours) != placement(recorded))
            .map(|(ours, recorded)| ("kafka.partitioner", "kafka_partitioner", ours, recorded)),
        (topic_prefix != recorded_prefix).then_some((
            "kafka.topic_prefix",
            "kafka_topic_prefix",
            topic_prefix,
            recorded_prefix.as_str(),
        )),
    ];
    if let Some((key, column, ours, recorded)) = differing.into_iter().flatten().next() {
        bail!(
            "{key} is {ours:?} on this host but {recorded:?} on the hosts of this installation \
             (obx.installation.{column}): every host must use the same, or a key's events would \
             move to another partition or topic, out of order. To change it on purpose, stop \
             every host, let the outbox drain and the consumers catch up, run \
             `UPDATE obx.installation SET {column} = NULL`, and start them with the new setting"
        );
    }
    Ok(())
}

/// The channel other hosts' commits are announced on: random per installation
/// (`migrations/0018_notify_channel.sql`), since any session may NOTIFY any channel it can
/// name, and no plugin can read this one's name.
pub async fn notify_channel(conn: &mut PgConnection) -> sqlx::Result<String> {
    sqlx::query_scalar("SELECT notify_channel FROM obx.installation")
        .fetch_one(conn)
        .await
}
