//! The one path every consumed event takes to its handler, in dedup mode and in inbox mode
//! alike. A caller opens a transaction on the plugin's session and records there which
//! events it takes (dedup records, or an inbox claim); then [`run`] hands the events to the
//! handler in order and stops at the first whose handler fails. What that failure undoes is
//! the caller's choice ([`Undo`]): the event alone, rolled back to a savepoint taken before
//! it, or the whole transaction, when the caller would rather do the events before it again
//! than pay for a savepoint per event. The caller records what the failure means (a retry
//! later, or a dead letter: `obx.park_event`, in either mode), and commits
//! ([`Dispatcher::commit_events`]): the outbox rows of the handled events are written just
//! before the commit, as a single command's are, so outbox id order stays commit order.

use std::time::{Duration, Instant};

use sqlx::Executor as _;
use uuid::Uuid;

use super::Incoming;
use crate::db::sessions::PluginTx;
use crate::dispatch::{Dispatcher, Emitted};
use crate::runtime::bindings::guest;
use crate::runtime::Plugin;
use crate::trace::TraceContext;

/// How long a run may start handlers, from when its first handler returned (a wait for the
/// first call slot is not the handlers' time: counted, an overloaded host would run batches
/// of one): past it, the run ends with the events it has done, and the caller commits them
/// and leaves the rest for its next batch. A batch holds a plugin
/// session, its events' row locks (inbox) and a shared processor or a partition's lane; with
/// slow handlers, 64 events at a call deadline each would hold them for minutes.
pub(crate) const RUN_BUDGET: Duration = Duration::from_secs(1);

/// An event on its way to the handler: what the guest gets, and the trace it continues.
pub(crate) struct Job {
    pub event_id: Uuid,
    pub event: guest::Event,
    pub parent: Option<TraceContext>,
}

/// The fields of an event, wherever it was read from (a Kafka message or an inbox row).
pub(crate) struct EventFields {
    pub event_id: Uuid,
    pub event_type: String,
    pub topic: String,
    pub key: Option<String>,
    pub payload: String,
    pub headers: Vec<(String, String)>,
}

impl Job {
    /// The job for attempt `attempt` of an event.
    pub fn new(fields: EventFields, attempt: u32) -> Job {
        let parent = fields
            .headers
            .iter()
            .find(|(k, _)| k == "traceparent")
            .and_then(|(_, v)| TraceContext::parse(v));
        Job {
            event_id: fields.event_id,
            parent,
            event: guest::Event {
                event_id: fields.event_id.to_string(),
                event_type: fields.event_type,
                topic: fields.topic,
                key: fields.key,
                payload: fields.payload,
                headers: fields.headers,
                attempt,
            },
        }
    }

    pub fn of(incoming: &Incoming, attempt: u32) -> Job {
        Job::new(
            EventFields {
                event_id: incoming.event_id,
                event_type: incoming.event_type.clone(),
                topic: incoming.topic.clone(),
                key: incoming.key.clone(),
                payload: incoming.payload.clone(),
                headers: incoming.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            },
            attempt,
        )
    }
}

/// A handler's failure: for logs, `last_error` and the dead-letter table, and whether
/// another attempt can help (not for invalid input or a business rejection).
pub(crate) struct Failure {
    pub error: String,
    pub retriable: bool,
    /// The handler lost to concurrent work (a lock wait past `lock_timeout`, a deadlock; see
    /// [`crate::dispatch::EventFailure::lost_race`]): tried again after a backoff, the event
    /// is not charged an attempt for `consumer.contention_grace` ([`Deferred`]). A reload's
    /// migration that holds a table for minutes, or an operator's `LOCK TABLE`, so holds up
    /// the events of the keys in flight without parking them; counted, it parked each after
    /// `consumer.max_attempts` tries.
    pub lost_race: bool,
}

impl Failure {
    /// The failure `f` tells of, taken out of it (its session and call-slot flag stay).
    pub fn taken_from(f: &mut crate::dispatch::EventFailure) -> Failure {
        Failure {
            error: std::mem::take(&mut f.error),
            retriable: f.retriable,
            lost_race: f.lost_race,
        }
    }

    /// A failure the handler, or what it sent, is to blame for.
    pub fn charged(error: String, retriable: bool) -> Failure {
        Failure {
            error,
            retriable,
            lost_race: false,
        }
    }
}

/// What recording a lost race ([`Failure::lost_race`]) came to: the work runs again after
/// its backoff as the same attempt, at the first lost race of its episode of contention or
/// a later one; or the episode is older than `consumer.contention_grace`, and the failure
/// counts as an attempt; or the work moved on since it was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Deferred {
    First,
    Again,
    Charge,
    Gone,
}

impl Deferred {
    /// The answer of `obx_api.inbox_defer` or `obx_api.timer_defer`. Any other is an error,
    /// which rolls the caller's transaction back: taken for `Gone`, it let an inbox claim
    /// commit its event as processed with nothing recorded.
    pub fn of(answer: &str) -> anyhow::Result<Deferred> {
        Ok(match answer {
            "first" => Deferred::First,
            "again" => Deferred::Again,
            "charge" => Deferred::Charge,
            "gone" => Deferred::Gone,
            other => anyhow::bail!("an unexpected answer from a deferral: {other:?}"),
        })
    }

    /// Tells of a lost race that was not counted, of the work of `plugin` named by `id` (an
    /// event's id, a timer's name and key): in `obx_handler_lost_races_total`, and in a log
    /// line at the first of an episode (a lock held for minutes would write one for every
    /// try). Told when recorded, before the commit: a try whose commit then fails, recorded
    /// again apart, is told twice. An event so held up holds up its key, and in dedup mode
    /// its lane's partitions: it shows in the consumer's lag, and in this counter.
    pub fn report(self, plugin: &str, id: &dyn std::fmt::Display, error: &str) {
        match self {
            Deferred::First => tracing::warn!(plugin, id = %id, error,
                "a handler lost to concurrent work; it runs again after a backoff, and no attempt is counted"),
            Deferred::Again => tracing::debug!(plugin, id = %id, error, "a handler lost to concurrent work again"),
            Deferred::Charge | Deferred::Gone => return,
        }
        metrics::counter!("obx_handler_lost_races_total", "plugin" => plugin.to_string()).increment(1);
    }
}

/// The failure a refused commit stands for, when the handlers caused it (see
/// [`crate::db::refused_for_content`]): a constraint they deferred to the commit, an error a
/// deferred trigger raised there, an event id emitted twice; or plugin code at the commit
/// that ran past its bound, so that the host cut the commit off
/// ([`crate::db::sessions::commit_cut`]). Such a commit ends the same way every time, so it
/// counts as a failed attempt of the event it carried, and the event is parked in the end;
/// a cut commit that went through all the same is found done (dedup: its `processed_event`
/// row, read at once and at the next attempt; inbox: the attempt is dropped for a processed
/// row).
///
/// A `COMMIT` that lost to concurrent work (plugin code at the commit, such as a deferred
/// trigger or check, that waited past `lock_timeout` or lost a deadlock) is a lost race of
/// the event's, as one of its handler's statements would be ([`Failure::lost_race`]): not
/// charged for `consumer.contention_grace`, then charged. It was the database's, retried
/// without end and without counting: a deferred trigger that waits on a lock nobody releases
/// held its key (in dedup mode, its partition) for ever. A race the host's own statements
/// lost before the `COMMIT` (the outbox rows' insert waiting on a migration's lock,
/// [`crate::db::sessions::lost_before_commit`]) stays the database's: no event is to blame.
/// Any other error is the database's.
pub(crate) fn refused_commit(e: &sqlx::Error) -> Option<Failure> {
    if crate::db::sessions::commit_cut(e) {
        return Some(Failure::charged(format!("the commit was cut off: {e}"), true));
    }
    if crate::db::lost_a_race(e) && !crate::db::sessions::lost_before_commit(e) {
        return Some(Failure {
            error: format!("the commit lost to concurrent work: {e}"),
            retriable: true,
            lost_race: true,
        });
    }
    crate::db::refused_for_content(e).then(|| Failure::charged(format!("the commit was refused: {e}"), true))
}

/// No call slot came free within the call deadline: the host is busy, and the handler
/// never ran. It is no attempt of the event's: when it was the run's first event, [`run`]
/// rolls the transaction back and gives this as its error, which callers treat as they
/// treat the database being away (the events are tried again later, and no attempt is
/// counted); a later event ends the run instead, as [`RUN_BUDGET`] does.
#[derive(Debug, thiserror::Error)]
#[error("no call slot came free within the call deadline")]
pub(crate) struct NoCallSlot;

/// What a failed handler undoes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Undo {
    /// Its own event only: each event runs behind a savepoint, and a failure rolls back to
    /// it. The transaction stays open for the events before it.
    Event,
    /// The whole transaction: no savepoints (each costs a round trip, and a subtransaction
    /// in Postgres), and a failure rolls everything back. For callers that can do the
    /// events before the failed one again, in a new transaction.
    Transaction,
}

/// How a run of handlers ended.
pub(crate) enum Ran {
    /// The transaction is open. The handlers of the first `emitted.len()` jobs succeeded;
    /// `failed` is why the next one's did not (rolled back to its savepoint). With no
    /// failure and fewer emitted than jobs, the run met [`RUN_BUDGET`], or the next found no
    /// call slot: the rest did not run.
    Open {
        tx: PluginTx,
        emitted: Vec<Emitted>,
        failed: Option<Failure>,
    },
    /// The transaction was lost with the handler of job `at` (a call killed while its
    /// statement may still run): nothing of it will commit. `session` is the session, when
    /// it came back, for the caller to abandon.
    Lost {
        at: usize,
        failure: Failure,
        session: Option<PluginTx>,
    },
    /// [`Undo::Transaction`]: the handler of job `at` failed, and the transaction was
    /// rolled back, with the work of the jobs before it and all the caller's records.
    RolledBack { at: usize, failure: Failure },
}

/// Runs the handlers of `jobs` in order in `tx` up to the first that fails, which undoes
/// what `undo` says, or until [`RUN_BUDGET`] has passed since the first returned. A handler that
/// could not start for want of a call slot ends the run with the events before it, as the
/// budget does; if it was the first, the transaction is rolled back and the error is
/// [`NoCallSlot`].
pub(crate) async fn run(
    dispatcher: &Dispatcher,
    plugin: &Plugin,
    mut tx: PluginTx,
    jobs: &[&Job],
    undo: Undo,
) -> anyhow::Result<Ran> {
    let mut emitted: Vec<Emitted> = Vec::with_capacity(jobs.len());
    let mut emitted_bytes = 0;
    let mut first_returned: Option<Instant> = None;
    for (at, job) in jobs.iter().enumerate() {
        // Past its time, or once its emits reach one call's limit, the run ends with the
        // events it has done.
        if first_returned.is_some_and(|t| t.elapsed() >= RUN_BUDGET) || dispatcher.batch_emitted_enough(emitted_bytes) {
            break;
        }
        let contracts = &plugin.identity.contracts;
        if let Err(e) = contracts.check_consumed(&job.event.topic, &job.event.event_type, &job.event.payload) {
            // Not for the handler: the plugin said it cannot take such a payload.
            let failure = Failure::charged(format!("the payload of {} {e}", job.event.event_type), false);
            return Ok(Ran::Open {
                tx,
                emitted,
                failed: Some(failure),
            });
        }
        if undo == Undo::Event {
            // Nested savepoints of one name: a rollback to it undoes this event alone.
            tx.execute("SAVEPOINT obx_event").await?;
        }
        match dispatcher
            .call_event(plugin, tx, job.event.clone(), job.parent.as_ref())
            .await
        {
            Ok((back, e)) => {
                tx = back;
                emitted_bytes += e.bytes();
                emitted.push(e);
                first_returned.get_or_insert_with(Instant::now);
            }
            Err(f) if f.busy => match f.tx {
                // The busy call never touched the transaction: the run ends with the events
                // done, as at its time budget, rather than undo them to do them again.
                Some(back) if !emitted.is_empty() && !back.is_poisoned() => {
                    return Ok(Ran::Open {
                        tx: back,
                        emitted,
                        failed: None,
                    });
                }
                back => {
                    if let Some(back) = back {
                        back.rollback().await?;
                    }
                    return Err(NoCallSlot.into());
                }
            },
            Err(mut f) => {
                let failure = Failure::taken_from(&mut f);
                return Ok(match f.tx.take() {
                    Some(back) if !back.is_poisoned() && undo == Undo::Transaction => {
                        back.rollback().await?;
                        Ran::RolledBack { at, failure }
                    }
                    Some(mut back) if !back.is_poisoned() => {
                        back.execute("ROLLBACK TO SAVEPOINT obx_event").await?;
                        Ran::Open {
                            tx: back,
                            emitted,
                            failed: Some(failure),
                        }
                    }
                    session => Ran::Lost { at, failure, session },
                });
            }
        }
    }
    Ok(Ran::Open {
        tx,
        emitted,
        failed: None,
    })
}
