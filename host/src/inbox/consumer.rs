//! The Kafka consumer of one plugin: group `<service>.<plugin>`, reading the topics of the
//! plugin's manifest, on the partitions it leases ([`Leased`], the default) or that the
//! group's coordinator gives it (`consumer.assignment = "group"`).
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
use uuid::Uuid;

/// Message bytes (KiB) a consumer holds in its lanes at most.
const IN_FLIGHT_KIB: usize = 64 * 1024;

/// How often a lane looks again for its plugin while it is away (see `Lane::plugin`).
const PLUGIN_AWAY_POLL: Duration = Duration::from_millis(100);

use super::handling::{self, Deferred, Failure, Job, Ran, Undo};
use super::leased::{self, Leased, Tracked};
use super::stuck::{self, Progress};
use super::{backoff, contended_wait, Incoming};
use crate::config::{Assignment, ConsumerConfig, KafkaConfig};
use crate::db::storable;
use crate::dispatch::Dispatcher;
use crate::kafka::Brokers;
use crate::runtime::manifest::DeliveryMode;
use crate::runtime::registry::Registry;
use crate::signal::Signal;
use crate::text::clipped;

pub struct Consumer {
    pub lag: Arc<crate::inbox::ConsumerLag>,
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

/// What a queued message holds while it is in a lane: its bytes of the in-flight budget,
/// and (under leases) its place in its partition's count.
type Hold = (OwnedSemaphorePermit, Option<Tracked>);

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

/// How one membership of the group ended.
enum Ended {
    /// The host or the plugin's consumer is stopping.
    Shutdown,
    /// Partitions with messages to consume, and no progress for this long.
    Stuck(Duration),
    /// The client's assignment no longer follows the leases: another host leased partitions
    /// of this one while its lease session was gone, or the client refused a change. The
    /// consumer starts over with a new client, assigned exactly the partitions it holds (an
    /// old client that unassigned lost partitions stopped fetching in the fault suite).
    Lost,
    /// The consumer could not be created or subscribed (logged).
    Failed,
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
        drop(plugin);
        if topics.is_empty() {
            return;
        }
        if self.kafka.create_topics {
            crate::kafka::ensure_topics(&self.brokers, &self.kafka, &topics).await;
        }
        let mut leased = (self.config.assignment == Assignment::Leases).then(|| {
            let options = self.dispatcher.pool.connect_options().as_ref().clone();
            Leased::new(&self.plugin, &self.group, options, &topics)
        });
        loop {
            match self.membership(&topics, leased.as_mut()).await {
                Ended::Shutdown | Ended::Failed => break,
                Ended::Lost => {}
                Ended::Stuck(idle) => {
                    tracing::warn!(plugin = %self.plugin, group = %self.group, idle_ms = idle.as_millis() as u64,
                        "the consumer holds partitions with messages to consume and has made no progress: \
                         starting over with a new client");
                    metrics::counter!("obx_consumer_rejoins_total", "plugin" => self.plugin.clone()).increment(1);
                }
            }
        }
        // After the final offset commit: the partitions' next owners start from it.
        if let Some(leased) = leased {
            leased.close().await;
        }
    }

    /// One membership of the group: joins it, consumes until shutdown or until stuck, then
    /// finishes what its lanes hold, commits their offsets and leaves.
    async fn membership(&mut self, topics: &[String], mut leased: Option<&mut Leased>) -> Ended {
        let consumer = match self.create() {
            Ok(c) => Arc::new(c),
            Err(e) => {
                tracing::error!(plugin = %self.plugin, error = %e, "cannot create the Kafka consumer");
                return Ended::Failed;
            }
        };
        match leased.as_deref_mut() {
            Some(leased) => leased.resume(&*consumer),
            None => {
                let names: Vec<&str> = topics.iter().map(String::as_str).collect();
                if let Err(e) = consumer.subscribe(&names) {
                    tracing::error!(plugin = %self.plugin, error = %e, "cannot subscribe");
                    return Ended::Failed;
                }
            }
        }
        let mut lease_step = tokio::time::interval(leased::STEP_EVERY);
        lease_step.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(plugin = %self.plugin, group = %self.group, ?topics, assignment = ?self.config.assignment, "consuming");

        // Lanes take their messages from unbounded queues, so that a busy partition never
        // holds up the others; what bounds memory is a budget of bytes in flight.
        let budget = Arc::new(Semaphore::new(IN_FLIGHT_KIB));
        let progress = Arc::new(Progress::new());
        let mut lanes = Vec::new();
        let mut senders = Vec::new();
        for _ in 0..self.config.lanes.max(1) {
            let (tx, rx) = mpsc::unbounded_channel::<(OwnedMessage, Hold)>();
            let lane = Lane {
                plugin: self.plugin.clone(),
                topic_prefix: self.kafka.topic_prefix.clone(),
                dispatcher: self.dispatcher.clone(),
                registry: self.registry.clone(),
                config: self.config.clone(),
                inbox: self.inbox.clone(),
                shutdown: self.shutdown.clone(),
            };
            lanes.push(tokio::spawn(lane.run(rx, consumer.clone(), progress.clone())));
            senders.push(tx);
        }
        let stuck_after = self.config.stuck_after;
        let mut check =
            tokio::time::interval((stuck_after / 4).clamp(Duration::from_millis(100), Duration::from_secs(5)));
        let ended = loop {
            let message = tokio::select! {
                m = consumer.recv() => m,
                _ = self.shutdown.changed() => break Ended::Shutdown,
                _ = lease_step.tick(), if leased.is_some() => {
                    if leased.as_deref_mut().expect("guarded").step(&consumer).await {
                        continue;
                    }
                    break Ended::Lost;
                }
                _ = check.tick(), if !stuck_after.is_zero() => {
                    // Only with nothing in the lanes: a lane at work is progress to come.
                    let Some(idle) = progress.idle_beyond(stuck_after) else { continue };
                    if budget.available_permits() < IN_FLIGHT_KIB {
                        continue;
                    }
                    let c = consumer.clone();
                    if tokio::task::spawn_blocking(move || stuck::behind(&*c)).await.unwrap_or(false) {
                        break Ended::Stuck(idle);
                    }
                    // Not behind: ask the broker again a bound from now.
                    progress.advanced();
                    continue;
                }
            };
            match message {
                Ok(m) => {
                    progress.advanced();
                    // Not (or no longer) this consumer's: the partition's owner reads it.
                    let tenure = match leased.as_deref().map(|l| l.tenure(m.topic(), m.partition())) {
                        Some(None) => continue,
                        Some(Some(tenure)) => Some(tenure),
                        None => None,
                    };
                    // The key and headers count too: a message of 1 MB of them and an empty
                    // value took 1 KiB of the budget.
                    let m = m.detach();
                    let kib = (super::message_bytes(&m) / 1024).clamp(1, IN_FLIGHT_KIB) as u32;
                    let permit = match self
                        .budget(&budget, kib, &mut lease_step, leased.as_deref_mut(), &consumer)
                        .await
                    {
                        Ok(permit) => permit,
                        Err(ended) => break ended,
                    };
                    // Admitted now, not before the wait: the leases may have moved meanwhile,
                    // even away and back (then the message is read again, in its order).
                    let tracked = match (leased.as_deref(), tenure) {
                        (Some(l), Some(tenure)) => match l.admit(m.topic(), m.partition(), tenure) {
                            None => continue,
                            tracked => tracked,
                        },
                        _ => None,
                    };
                    let lane = m.partition().unsigned_abs() as usize % senders.len();
                    if senders[lane].send((m, (permit, tracked))).is_err() {
                        break Ended::Shutdown;
                    }
                }
                Err(e) => {
                    tracing::warn!(plugin = %self.plugin, error = %e, "Kafka consumer error");
                    metrics::counter!("obx_consumer_errors_total", "plugin" => self.plugin.clone()).increment(1);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        drop(senders);
        for lane in lanes {
            let _ = lane.await;
        }
        // Commit the offsets of completed work before leaving the group. Both block (a
        // commit waits for the group's coordinator, for up to the session timeout with the
        // broker away; closing is librdkafka's leave), so they happen off the async runtime.
        let plugin = self.plugin.clone();
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
                tracing::debug!(%plugin, error = %e, "final offset commit");
            }
            drop(consumer);
        })
        .await;
        if let Ended::Shutdown = ended {
            tracing::info!(plugin = %self.plugin, "consumer stopped");
        }
        ended
    }

    /// `kib` of the in-flight budget. The leases go on stepping while it is waited for: lanes
    /// that hold the whole budget (a lock a handler waits for, a slow database) must not
    /// stop this host from handing partitions over to a newcomer, nor from noticing that it
    /// lost some. The wait keeps its place in the budget's queue across the steps.
    async fn budget(
        &mut self,
        budget: &Arc<Semaphore>,
        kib: u32,
        lease_step: &mut tokio::time::Interval,
        mut leased: Option<&mut Leased>,
        consumer: &Arc<StreamConsumer<LagReporter>>,
    ) -> Result<OwnedSemaphorePermit, Ended> {
        let wait = budget.clone().acquire_many_owned(kib);
        tokio::pin!(wait);
        loop {
            tokio::select! {
                p = &mut wait => return Ok(p.expect("never closed")),
                _ = self.shutdown.changed() => return Err(Ended::Shutdown),
                _ = lease_step.tick(), if leased.is_some() => {
                    if !leased.as_deref_mut().expect("guarded").step(consumer).await {
                        return Err(Ended::Lost);
                    }
                }
            }
        }
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
            .set("session.timeout.ms", millis(self.config.session_timeout))
            .set("heartbeat.interval.ms", millis(self.config.heartbeat_interval))
            .set("partition.assignment.strategy", &self.config.assignor)
            // After an outage, reconnect within a second of the broker's return, not
            // librdkafka's 10 s backoff ceiling (the relay's producer does the same).
            .set("reconnect.backoff.ms", "50")
            .set("reconnect.backoff.max.ms", "1000")
            // A request unanswered for 2 s closes its connection, and the next one opens a
            // new connection: a connection the broker stopped answering without closing it
            // (a broker that restarted behind a half-open connection, a network partition)
            // would otherwise hold the partitions for librdkafka's default of 60 s. A
            // consumer's requests are short: fetches wait 50 ms at the most. (At 5 s, one
            // fetch the mock cluster left unanswered across its outage held a partition
            // for 5 s after the broker was back: 7.1 s of recovery in one run, 2.8 s in
            // another.)
            .set("socket.timeout.ms", "2000")
            // librdkafka reports each partition's lag with its statistics.
            .set("statistics.interval.ms", "5000")
            .set("fetch.wait.max.ms", "50");
        if let Some(id) = &self.config.instance_id {
            config.set("group.instance.id", id);
        }
        for (key, value) in self.kafka.user_properties() {
            config.set(key, value);
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
    lag: Arc<crate::inbox::ConsumerLag>,
}

impl rdkafka::ClientContext for LagReporter {
    fn stats(&self, statistics: rdkafka::Statistics) {
        let mut lags = Vec::new();
        for (topic, t) in statistics.topics {
            for (id, p) in t.partitions {
                if let Some(lag) = partition_lag(id, &p) {
                    metrics::gauge!("obx_consumer_lag", "plugin" => self.plugin.clone(), "topic" => topic.clone(),
                        "partition" => id.to_string())
                    .set(lag as f64);
                    lags.push((topic.clone(), id, lag));
                }
            }
        }
        // Partitions handed to another host: their lag is that host's to report now.
        for (topic, id) in self.lag.replace(&self.plugin, lags) {
            metrics::gauge!("obx_consumer_lag", "plugin" => self.plugin.clone(), "topic" => topic,
                "partition" => id.to_string())
            .set(0.0);
        }
    }
}

/// The lag of a partition this consumer reads: the messages after its committed offset. A
/// partition with nothing committed yet counts from its start (so an empty one has no lag,
/// where librdkafka's own figure says "unknown"). `None` for a partition it does not read
/// (librdkafka's statistics list every partition of a topic), or whose end is not known yet.
fn partition_lag(id: i32, p: &rdkafka::statistics::Partition) -> Option<i64> {
    // -1 is librdkafka's internal "unassigned" partition.
    if id < 0 || !p.desired || p.hi_offset < 0 {
        return None;
    }
    if p.consumer_lag >= 0 {
        return Some(p.consumer_lag);
    }
    let from = if p.committed_offset >= 0 {
        p.committed_offset
    } else {
        p.lo_offset.max(0)
    };
    Some((p.hi_offset - from).max(0))
}

/// Logs each change of the consumer's partitions: what an operator reads to see a failover.
impl rdkafka::consumer::ConsumerContext for LagReporter {
    fn post_rebalance(&self, _: &rdkafka::consumer::BaseConsumer<Self>, rebalance: &rdkafka::consumer::Rebalance<'_>) {
        use rdkafka::consumer::Rebalance;
        let list = |tpl: &rdkafka::TopicPartitionList| {
            let parts: Vec<String> = tpl
                .elements()
                .iter()
                .map(|e| format!("{}[{}]", e.topic(), e.partition()))
                .collect();
            parts.join(" ")
        };
        match rebalance {
            Rebalance::Assign(tpl) => {
                tracing::info!(plugin = %self.plugin, partitions = %list(tpl), "partitions assigned")
            }
            Rebalance::Revoke(tpl) => {
                tracing::info!(plugin = %self.plugin, partitions = %list(tpl), "partitions revoked")
            }
            Rebalance::Error(e) => tracing::warn!(plugin = %self.plugin, error = %e, "rebalance failed"),
        }
    }
}

fn millis(d: Duration) -> String {
    d.as_millis().to_string()
}

impl Lane {
    async fn run(
        self,
        mut rx: mpsc::UnboundedReceiver<(OwnedMessage, Hold)>,
        consumer: Arc<StreamConsumer<LagReporter>>,
        progress: Arc<Progress>,
    ) {
        while let Some(first) = rx.recv().await {
            // Whatever else is queued goes with it, up to the batch limits: a batch never
            // waits to fill.
            let mut bytes = first.0.payload().map_or(0, <[u8]>::len);
            let mut queued = vec![first];
            while queued.len() < self.config.batch_max_events as usize && bytes < self.config.batch_max_bytes {
                match rx.try_recv() {
                    Ok(m) => {
                        bytes += m.0.payload().map_or(0, <[u8]>::len);
                        queued.push(m);
                    }
                    Err(_) => break,
                }
            }
            if *self.shutdown.borrow() {
                // What is still queued is delivered again to whoever takes the partition.
                return;
            }
            let messages: Vec<&OwnedMessage> = queued.iter().map(|(m, _)| m).collect();
            // After a rebalance the partition may belong to another host; its redelivery
            // is then a dedup hit.
            let settle = |m: &OwnedMessage| {
                let _ = consumer.store_offset(m.topic(), m.partition(), m.offset());
                progress.advanced();
            };
            if let Done::Stopped = self.handle_all(&messages, &settle).await {
                return;
            }
        }
    }

    /// Handles messages in order, settling each as it is done: runs of dedup-mode events
    /// in one transaction each ([`Lane::try_batch`]), everything else one at a time.
    async fn handle_all(&self, messages: &[&OwnedMessage], settle: &(dyn Fn(&OwnedMessage) + Sync)) -> Done {
        let mut i = 0;
        while i < messages.len() {
            let (mode, run) = self.run_of(&messages[i..]);
            let mut failed = Failed::new();
            if run.len() > 1 {
                let (committed, in_batch) = match mode {
                    DeliveryMode::Dedup => self.try_batch(&run).await,
                    DeliveryMode::Inbox => (self.store_batch(&run).await, Failed::new()),
                };
                for m in &messages[i..i + committed] {
                    settle(m);
                }
                self.skipped(run[..committed].iter().filter(|e| e.is_none()).count());
                failed = in_batch.into_iter().map(|(at, f)| (i + at, f)).collect();
                i += committed;
                if i == messages.len() {
                    break;
                }
            }
            // One message alone: the path that retries, parks, stores in the inbox and
            // quarantines; after a batch that failed, each message up to its last failed
            // event, which comes here with the attempt the batch made counted.
            let last = failed.last().map_or(i, |(at, _)| *at);
            let mut failed = failed.into_iter().peekable();
            while i <= last {
                let first_failure = failed.next_if(|(at, _)| *at == i).map(|(_, f)| f);
                match self.handle_guarded(messages[i], first_failure).await {
                    Done::Settled => settle(messages[i]),
                    Done::Stopped => return Done::Stopped,
                }
                i += 1;
            }
        }
        Done::Settled
    }

    /// Counts `n` events settled without running: their type is not among those the
    /// plugin's subscription lists (or the plugin no longer subscribes to their topic). A
    /// producer that renames an event type would otherwise see its events vanish unseen.
    fn skipped(&self, n: usize) {
        if n > 0 {
            metrics::counter!("obx_consumer_skipped_total", "plugin" => self.plugin.clone()).increment(n as u64);
        }
    }

    /// The leading messages that a batch can take: events of subscriptions of one mode
    /// (`Some`), and messages that this plugin skips (`None`: not subscribed).
    fn run_of(&self, messages: &[&OwnedMessage]) -> (DeliveryMode, Vec<Option<Incoming>>) {
        let mut run = Vec::new();
        let mut mode = None;
        let Some(plugin) = self.registry.get(&self.plugin) else {
            return (DeliveryMode::Dedup, run);
        };
        for m in messages {
            let Ok(event) = Incoming::parse(m, self.config.max_message_bytes, &self.topic_prefix) else {
                break;
            };
            match plugin.manifest.subscriptions.iter().find(|s| s.topic == event.topic) {
                Some(s) if s.event_types.is_empty() || s.event_types.contains(&event.event_type) => {
                    if *mode.get_or_insert(s.mode) != s.mode {
                        break;
                    }
                    run.push(Some(event));
                }
                _ => run.push(None),
            }
        }
        (mode.unwrap_or(DeliveryMode::Dedup), run)
    }

    /// Inbox mode, batched: stores the events of `run` with one statement. Returns how
    /// many leading messages are settled: all, or none after a database error (they then
    /// go one at a time).
    async fn store_batch(&self, run: &[Option<Incoming>]) -> usize {
        let events: Vec<&Incoming> = run.iter().flatten().collect();
        let stored = async {
            let mut conn = self.pool().acquire().await?;
            store_all_in_inbox(&mut conn, &self.plugin, &events).await
        };
        match stored.await {
            Ok(()) => {
                self.inbox.notify();
                run.len()
            }
            Err(e) => {
                tracing::warn!(plugin = %self.plugin, error = %e, "storing a batch in the inbox failed; its events go one at a time");
                0
            }
        }
    }

    /// Dedup mode, batched: the events of `run` in one transaction on the plugin's session,
    /// their outbox rows written just before the one commit, with no savepoint between them:
    /// handlers fail rarely, and a savepoint per event costs a round trip and a Postgres
    /// subtransaction. Stops at the first event that cannot be done here: one whose key is
    /// parked, or whose handler failed. A failed handler rolls the whole batch back; the
    /// events before it are then done again in a batch of their own ([`Lane::redo`]), and the
    /// failures met are returned, for the one-at-a-time path to retry or park each with its
    /// attempt counted. Returns how many leading events committed; after a database error,
    /// none.
    async fn try_batch(&self, run: &[Option<Incoming>]) -> (usize, Failed) {
        let Some(plugin) = self.registry.get(&self.plugin) else {
            return (0, Failed::new());
        };
        match self.batch(&plugin, run).await {
            Ok(Batch::Committed(n, failure)) => (n, failure.map(|f| vec![(n, f)]).unwrap_or_default()),
            // Nothing committed: the handler of event `n` failed, or the transaction was
            // lost with it. It goes on alone, this attempt counted; the events before it
            // are done again first, without it.
            Ok(Batch::Undone(n, failure)) => {
                let mut failed = vec![(n, failure)];
                let committed = self.redo(&plugin, run, &mut failed).await;
                (committed, failed)
            }
            Err(e) => {
                tracing::warn!(plugin = %self.plugin, error = %e, "a batch failed; its events go one at a time");
                (0, Failed::new())
            }
        }
    }

    /// Does the events before the first of `failed` again, in batches, each without the
    /// event that failed last; an event that fails now (a handler that failed only this time)
    /// joins `failed`, ahead, so that each attempt made is counted. Returns how many leading
    /// messages committed.
    async fn redo(&self, plugin: &crate::runtime::Plugin, run: &[Option<Incoming>], failed: &mut Failed) -> usize {
        loop {
            let end = failed[0].0;
            if end == 0 {
                return 0;
            }
            match self.batch(plugin, &run[..end]).await {
                Ok(Batch::Committed(done, failure)) => {
                    if let Some(f) = failure {
                        failed.insert(0, (done, f));
                    }
                    return done;
                }
                Ok(Batch::Undone(at, failure)) => failed.insert(0, (at, failure)),
                Err(e) => {
                    tracing::warn!(plugin = %self.plugin, error = %e, "a batch failed; its events go one at a time");
                    return 0;
                }
            }
        }
    }

    async fn batch(&self, plugin: &crate::runtime::Plugin, run: &[Option<Incoming>]) -> anyhow::Result<Batch> {
        let positions: Vec<usize> = (0..run.len()).filter(|&i| run[i].is_some()).collect();
        let events: Vec<&Incoming> = run.iter().flatten().collect();
        if events.is_empty() {
            // Only messages this plugin skips.
            return Ok(Batch::Committed(run.len(), None));
        }
        let mut tx = self.dispatcher.sessions.begin(&self.plugin).await?;
        // One statement records the run's new events as processed, before any handler runs;
        // the records of events that end up not run are given back before the commit.
        let begun = begin_events(&mut tx, &events).await?;
        // The batch takes the events up to the first whose key is parked; of those, it
        // runs the new ones.
        let taken = begun.iter().take_while(|(parked, _)| !parked).count();
        let jobs: Vec<(usize, Job)> = (0..taken)
            .filter(|&i| begun[i].1)
            .map(|i| (i, Job::of(events[i], 1)))
            .collect();
        let hits = taken - jobs.len();
        if hits > 0 {
            metrics::counter!("obx_consumer_dedup_hits_total", "plugin" => self.plugin.clone()).increment(hits as u64);
        }
        // The messages settled by this batch end at the first event not done.
        let settled = |stop: usize| positions.get(stop).copied().unwrap_or(run.len());
        let to_run: Vec<&Job> = jobs.iter().map(|(_, j)| j).collect();
        match handling::run(&self.dispatcher, plugin, tx, &to_run, Undo::Transaction).await? {
            Ran::Lost { at, failure, .. } | Ran::RolledBack { at, failure } => {
                Ok(Batch::Undone(settled(jobs[at].0), failure))
            }
            Ran::Open {
                mut tx,
                emitted,
                failed,
            } => {
                let stop = jobs.get(emitted.len()).map_or(taken, |(i, _)| *i);
                let not_run: Vec<Uuid> = (stop..events.len())
                    .filter(|&i| begun[i].1)
                    .map(|i| events[i].event_id)
                    .collect();
                if !not_run.is_empty() {
                    forget_events(&mut tx, &not_run).await?;
                }
                self.dispatcher.commit_events(tx, &emitted).await?;
                metrics::histogram!("obx_consumer_batch_events", "plugin" => self.plugin.clone())
                    .record(settled(stop) as f64);
                Ok(Batch::Committed(settled(stop), failed))
            }
        }
    }

    /// [`Lane::handle`], retried after a pause if it panics: a bug must not stop the lane,
    /// nor move the partition past the message.
    async fn handle_guarded(&self, m: &OwnedMessage, mut first_failure: Option<Failure>) -> Done {
        loop {
            let handled = std::panic::AssertUnwindSafe(self.handle(m, first_failure.take()))
                .catch_unwind()
                .await;
            match handled {
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

    async fn handle(&self, m: &OwnedMessage, first_failure: Option<Failure>) -> Done {
        let event = match Incoming::parse(m, self.config.max_message_bytes, &self.topic_prefix) {
            Ok(e) => e,
            Err(reason) => {
                tracing::warn!(plugin = %self.plugin, topic = m.topic(), partition = m.partition(), offset = m.offset(),
                    %reason, "quarantined a message");
                metrics::counter!("obx_consumer_quarantined_total", "plugin" => self.plugin.clone()).increment(1);
                return self.retry_db(DbStep::Quarantine(m, &reason.0)).await;
            }
        };
        let Some(plugin) = self.plugin().await else {
            return Done::Stopped;
        };
        let Some(subscription) = plugin.manifest.subscriptions.iter().find(|s| s.topic == event.topic) else {
            self.skipped(1);
            return Done::Settled;
        };
        if !subscription.event_types.is_empty() && !subscription.event_types.contains(&event.event_type) {
            tracing::debug!(plugin = %self.plugin, event_type = %event.event_type, topic = %event.topic,
                            "an event of a type the subscription does not list: skipped");
            self.skipped(1);
            return Done::Settled;
        }
        match subscription.mode {
            DeliveryMode::Inbox => {
                let done = self.retry_db(DbStep::StoreInInbox(m, &event)).await;
                self.inbox.notify();
                done
            }
            DeliveryMode::Dedup => self.handle_dedup(m, &event, first_failure).await,
        }
    }

    /// Dedup mode, one event: one transaction, on the plugin's own session, inserts the
    /// `processed_event` row (through `obx_api.begin_events`), runs the handler and commits
    /// both. A second delivery finds the row and does nothing. `first_failure` is the
    /// failure of an attempt already made in a batch.
    async fn handle_dedup(&self, m: &OwnedMessage, event: &Incoming, first_failure: Option<Failure>) -> Done {
        let started = std::time::Instant::now();
        let mut tries = Tries {
            attempt: 1,
            contended_since: None,
        };
        let mut db_errors = 0;
        if let Some(failure) = first_failure {
            if let Some(done) = self.after_failure(m, event, &mut tries, &failure).await {
                return done;
            }
        }
        loop {
            let Some(plugin) = self.plugin().await else {
                return Done::Stopped;
            };
            let step = async {
                let mut tx = self.dispatcher.sessions.begin(&self.plugin).await?;
                // One statement: is the key parked behind a dead letter, and if not, is this
                // event new? (It records the event as processed, in this transaction.)
                let (parked, fresh) = begin_events(&mut tx, &[event]).await?[0];
                if parked {
                    tx.rollback().await?;
                    return Ok::<_, anyhow::Error>(Step::ParkedBehind);
                }
                if !fresh {
                    tx.rollback().await?;
                    metrics::counter!("obx_consumer_dedup_hits_total", "plugin" => self.plugin.clone()).increment(1);
                    return Ok(Step::Done);
                }
                let job = Job::of(event, tries.attempt);
                // One event: its failure rolls back everything anyway.
                match handling::run(&self.dispatcher, &plugin, tx, &[&job], Undo::Transaction).await? {
                    Ran::Open {
                        tx,
                        emitted,
                        failed: None,
                    } => match self.dispatcher.commit_events(tx, &emitted).await {
                        Ok(()) => Ok(Step::Done),
                        Err(e) => match handling::refused_commit(&e) {
                            Some(_) if crate::db::sessions::commit_cut(&e) && self.recorded(event).await? => {
                                Ok(Step::Done)
                            }
                            Some(failure) => Ok(Step::Failed(failure)),
                            None => Err(e.into()),
                        },
                    },
                    Ran::Open {
                        tx,
                        failed: Some(failure),
                        ..
                    } => {
                        let _ = tx.rollback().await;
                        Ok(Step::Failed(failure))
                    }
                    Ran::Lost { failure, .. } | Ran::RolledBack { failure, .. } => Ok(Step::Failed(failure)),
                }
            };
            match step.await {
                Ok(Step::ParkedBehind) => {
                    // Wait behind the parked event of this key, in the inbox.
                    let done = self.retry_db(DbStep::StoreInInbox(m, event)).await;
                    self.inbox.notify();
                    metrics::counter!("obx_consumer_parked_behind_total", "plugin" => self.plugin.clone()).increment(1);
                    return done;
                }
                Ok(Step::Done) => {
                    tracing::trace!(plugin = %self.plugin, event_id = %event.event_id, took = ?started.elapsed(), "event settled");
                    return Done::Settled;
                }
                Ok(Step::Failed(failure)) => {
                    if let Some(done) = self.after_failure(m, event, &mut tries, &failure).await {
                        return done;
                    }
                }
                Err(e) => {
                    // The database, or no call slot (`handling::NoCallSlot`), not the handler:
                    // wait, without using up attempts.
                    db_errors += 1;
                    if self.pause_after_db_error(&e, db_errors).await {
                        return Done::Stopped;
                    }
                }
            }
        }
    }

    /// Whether `event` is recorded as processed. A commit the host cut off may have gone
    /// through all the same (a database that stalled past the bound after writing its commit
    /// record): the event is then done, and parked on its last attempt it would have been
    /// both processed and a dead letter.
    async fn recorded(&self, event: &Incoming) -> sqlx::Result<bool> {
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM obx.processed_event WHERE consumer = $1 AND event_id = $2)")
            .bind(&self.plugin)
            .bind(event.event_id)
            .fetch_one(&self.dispatcher.pool)
            .await
    }

    /// After a try of an event failed: parks it if that was the last attempt or another
    /// cannot help, or waits out the backoff (`None`: try again, as the next attempt unless
    /// the handler lost a race within `consumer.contention_grace`, [`Failure::lost_race`]).
    async fn after_failure(
        &self,
        m: &OwnedMessage,
        event: &Incoming,
        tries: &mut Tries,
        failure: &Failure,
    ) -> Option<Done> {
        let (error, at) = (&failure.error, tries.attempt);
        let mut pause = backoff(self.config.backoff_initial, self.config.backoff_max, at);
        match tries.lost_race(failure, self.config.contention_grace) {
            Some(deferred @ (Deferred::First | Deferred::Again)) => {
                deferred.report(&self.plugin, &event.event_id, error);
                let contended = tries.contended_since.map_or(Duration::ZERO, |since| since.elapsed());
                pause = contended_wait(contended, pause, self.config.backoff_max);
            }
            _ => {
                tracing::warn!(plugin = %self.plugin, event_id = %event.event_id, attempt = at, error, "event handler failed");
                if !failure.retriable || at >= self.config.max_attempts {
                    return Some(self.retry_db(DbStep::Park(m, event, at, error)).await);
                }
                tries.attempt += 1;
            }
        }
        if self.pause(pause).await {
            return Some(Done::Stopped);
        }
        None
    }

    /// Runs a database step until it succeeds, or shutdown. A step that stores the event is
    /// quarantined instead if Postgres refuses the event itself ([`crate::db::refused_value`]):
    /// it would be refused at every try, and hold its partition for ever.
    async fn retry_db(&self, step: DbStep<'_>) -> Done {
        let refusal = match self.retry_db_until_refused(step).await {
            Ok(done) => return done,
            Err(refusal) => refusal,
        };
        let (m, reason) = match step {
            DbStep::Park(m, _, attempts, error) => (
                m,
                format!(
                    "Postgres refused the event: {refusal}; it was to be parked after {attempts} attempts: {}",
                    clipped(error, 1024)
                ),
            ),
            DbStep::StoreInInbox(m, _) | DbStep::Quarantine(m, _) => {
                (m, format!("Postgres refused the event: {refusal}"))
            }
        };
        tracing::warn!(plugin = %self.plugin, topic = m.topic(), partition = m.partition(), offset = m.offset(),
            %reason, "quarantined a message");
        metrics::counter!("obx_consumer_quarantined_total", "plugin" => self.plugin.clone()).increment(1);
        // A quarantine is never refused for its content: no error to come back.
        self.retry_db_until_refused(DbStep::Quarantine(m, &reason))
            .await
            .unwrap_or(Done::Settled)
    }

    /// [`Lane::retry_db`], but returns Postgres's refusal of the event a step stores.
    async fn retry_db_until_refused(&self, step: DbStep<'_>) -> Result<Done, String> {
        let mut db_errors = 0;
        loop {
            let result = async {
                let mut conn = self.pool().acquire().await?;
                match step {
                    DbStep::Quarantine(m, reason) => quarantine(&mut conn, &self.plugin, m, reason).await,
                    DbStep::StoreInInbox(_, e) => store_in_inbox(&mut conn, &self.plugin, e).await,
                    DbStep::Park(_, e, attempts, error) => park(&mut conn, &self.plugin, e, attempts, error).await,
                }
            }
            .await;
            match result {
                Ok(()) => return Ok(Done::Settled),
                Err(e) => {
                    if let Some(refusal) = self.refusal_of(step, &e).await {
                        return Err(refusal);
                    }
                    db_errors += 1;
                    if self.pause_after_db_error(&e, db_errors).await {
                        return Ok(Done::Stopped);
                    }
                }
            }
        }
    }

    /// Postgres's refusal of the event `step` stores, when `e` is one: the step failed with a
    /// data exception, and Postgres refuses the event's payload as `jsonb` on its own. Not
    /// when the exception came from anything else (the host's own values, a trigger, the
    /// server), which a retry, or an operator, must cure: the event is not at fault.
    async fn refusal_of(&self, step: DbStep<'_>, e: &sqlx::Error) -> Option<String> {
        let (DbStep::StoreInInbox(_, event) | DbStep::Park(_, event, ..)) = step else {
            return None;
        };
        if !crate::db::refused_value(e) {
            return None;
        }
        match sqlx::query("SELECT $1::jsonb")
            .bind(&event.payload)
            .execute(self.pool())
            .await
        {
            Err(refused) if crate::db::refused_value(&refused) => Some(refused.to_string()),
            _ => None,
        }
    }

    /// Logs the `n`th database error in a row of one message, and waits before the next
    /// try: `backoff_initial` first (a connection that a restart or a terminated backend
    /// broke is usually replaced at once), doubling up to `backoff_max`. Returns true if
    /// shutdown began meanwhile.
    async fn pause_after_db_error(&self, error: &(dyn std::fmt::Display + Sync), n: u32) -> bool {
        tracing::warn!(plugin = %self.plugin, error = %error, "database error or no call slot while consuming; retrying");
        self.pause(backoff(self.config.backoff_initial, self.config.backoff_max, n))
            .await
    }

    /// The plugin, once it is loaded: it may be away for a moment, unloaded and loaded again
    /// (a file replaced by a delete and a copy). `None` once this consumer is stopping, as
    /// the supervisor stops the consumer of a plugin that stays away. A lane that met the
    /// plugin away used to end: its message unsettled, and the consumer ended at its
    /// partition's next message, while the supervisor, busy or seeing the same subscriptions
    /// again, kept it listed as running.
    async fn plugin(&self) -> Option<Arc<crate::runtime::Plugin>> {
        loop {
            if let Some(plugin) = self.registry.get(&self.plugin) {
                return Some(plugin);
            }
            if self.pause(PLUGIN_AWAY_POLL).await {
                return None;
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
    Failed(Failure),
    /// The event's key is parked: the event waits behind it, in the inbox.
    ParkedBehind,
}

/// Events whose handler failed in a batch that did not commit them, by their message's
/// position, ascending: each goes on alone with that attempt counted.
type Failed = Vec<(usize, Failure)>;

/// How a batch ended.
enum Batch {
    /// Its first `n` messages committed; the failure of the next one's handler, if that is
    /// why it stopped there.
    Committed(usize, Option<Failure>),
    /// Nothing committed: the handler of message `n` failed, or the transaction was lost
    /// with it (a call killed while its statement ran).
    Undone(usize, Failure),
}

/// Records the events of a batch as processed in `tx`, through `obx_api.begin_events`, in one
/// statement: for each, in order, whether its key is parked behind a dead letter (then
/// nothing is recorded), and whether the event is new.
async fn begin_events(tx: &mut PgConnection, events: &[&Incoming]) -> anyhow::Result<Vec<(bool, bool)>> {
    let begun: Vec<(bool, bool)> = sqlx::query_as("SELECT parked, fresh FROM obx_api.begin_events($1, $2, $3)")
        .bind(events.iter().map(|e| e.event_id).collect::<Vec<_>>())
        .bind(events.iter().map(|e| e.topic.as_str()).collect::<Vec<_>>())
        .bind(events.iter().map(|e| e.key.as_deref()).collect::<Vec<_>>())
        .fetch_all(tx)
        .await?;
    // The plugin's own session answered: believe it only if the answer has the right shape.
    anyhow::ensure!(
        begun.len() == events.len(),
        "begin_events answered {} rows for {} events",
        begun.len(),
        events.len()
    );
    Ok(begun)
}

/// Gives back the records `begin_events` made in this transaction for events not run.
async fn forget_events(tx: &mut PgConnection, event_ids: &[Uuid]) -> sqlx::Result<()> {
    sqlx::query("SELECT obx_api.forget_events($1)")
        .bind(event_ids)
        .execute(tx)
        .await?;
    Ok(())
}

/// The database writes a lane retries until they succeed.
#[derive(Clone, Copy)]
enum DbStep<'a> {
    Quarantine(&'a OwnedMessage, &'a str),
    /// The message, and the event it holds.
    StoreInInbox(&'a OwnedMessage, &'a Incoming),
    Park(&'a OwnedMessage, &'a Incoming, u32, &'a str),
}

/// The tries of one dedup-mode event on its lane: the attempt the next is, and since when
/// its handler has lost races (an episode of contention, kept in memory: a host that stops
/// meanwhile leaves the event to one that starts it afresh).
struct Tries {
    attempt: u32,
    contended_since: Option<std::time::Instant>,
}

impl Tries {
    /// What `failure` comes to, if it is a lost race.
    fn lost_race(&mut self, failure: &Failure, grace: Duration) -> Option<Deferred> {
        if !failure.lost_race {
            return None;
        }
        Some(match self.contended_since {
            _ if grace.is_zero() => Deferred::Charge,
            None => {
                self.contended_since = Some(std::time::Instant::now());
                Deferred::First
            }
            Some(since) if since.elapsed() < grace => Deferred::Again,
            Some(_) => Deferred::Charge,
        })
    }
}

/// The `held` of an event stored by consumer `$1`, with topic `e.topic` and key
/// `e.partition_key`: its key has a parked event (`obx.inbox_event_held`, which reads that
/// row `FOR SHARE`, so that a release running at the same time does not leave the event held
/// for ever). Asked only once the plugin, then the key, is seen to have one: each look that
/// misses a park in progress only leaves an event unheld, which claims read as before.
const HELD: &str = "(SELECT EXISTS (SELECT 1 FROM obx.inbox_event p \
                                   WHERE p.consumer = $1 AND p.parked AND NOT p.processed)) \
                    AND EXISTS (SELECT 1 FROM obx.inbox_event p \
                                WHERE p.consumer = $1 AND p.topic = e.topic AND p.partition_key = e.partition_key \
                                  AND p.parked AND NOT p.processed) \
                    AND obx.inbox_event_held($1, e.topic, e.partition_key)";

/// Stores an event in the inbox, once: a redelivery finds it there.
pub(crate) async fn store_in_inbox(conn: &mut PgConnection, consumer: &str, e: &Incoming) -> sqlx::Result<()> {
    store_all_in_inbox(conn, consumer, &[e]).await
}

/// Stores events in the inbox, in their order, each once, with one statement.
async fn store_all_in_inbox(conn: &mut PgConnection, consumer: &str, events: &[&Incoming]) -> sqlx::Result<()> {
    if events.is_empty() {
        return Ok(());
    }
    sqlx::query(&format!(
        "INSERT INTO obx.inbox_event (consumer, event_id, topic, payload, event_type, partition_key, headers, held) \
         SELECT $1, e.event_id, e.topic, e.payload::jsonb, e.event_type, e.partition_key, e.headers, {HELD} \
         FROM unnest($2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[], $7::jsonb[]) WITH ORDINALITY \
              AS e(event_id, topic, payload, event_type, partition_key, headers, n) \
         ORDER BY e.n \
         ON CONFLICT (consumer, event_id) DO NOTHING",
    ))
    .bind(consumer)
    .bind(events.iter().map(|e| e.event_id).collect::<Vec<_>>())
    .bind(events.iter().map(|e| e.topic.as_str()).collect::<Vec<_>>())
    .bind(events.iter().map(|e| e.payload.as_str()).collect::<Vec<_>>())
    .bind(events.iter().map(|e| e.event_type.as_str()).collect::<Vec<_>>())
    .bind(events.iter().map(|e| e.key.as_deref()).collect::<Vec<_>>())
    .bind(events.iter().map(|e| e.headers_json()).collect::<Vec<_>>())
    .execute(conn)
    .await?;
    Ok(())
}

/// Parks a dedup-mode event that kept failing, on the host's own connection: it is stored in
/// the inbox (if it is not there yet) and parked there by `obx.park_event`, the one place
/// that parks an event in either mode, with a dead letter; later events of its key queue
/// behind it.
async fn park(conn: &mut PgConnection, consumer: &str, e: &Incoming, attempts: u32, error: &str) -> sqlx::Result<()> {
    let mut tx = sqlx::Connection::begin(conn).await?;
    store_in_inbox(&mut tx, consumer, e).await?;
    sqlx::query("SELECT obx.park_event($1, $2, $3, $4)")
        .bind(consumer)
        .bind(e.event_id)
        .bind(attempts as i32)
        .bind(storable(error))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    metrics::counter!("obx_dead_letters_total", "plugin" => consumer.to_string()).increment(1);
    tracing::error!(consumer, event_id = %e.event_id, attempts, error, "event parked in the dead-letter table");
    Ok(())
}

async fn quarantine(conn: &mut PgConnection, consumer: &str, m: &OwnedMessage, reason: &str) -> sqlx::Result<()> {
    const KEEP: usize = 64 * 1024;
    // jsonb cannot hold NUL, and a header that had one is among the reasons to be here; so
    // are headers of any size, of which the first 64 KiB are kept.
    let mut room = KEEP;
    let headers: std::collections::BTreeMap<String, String> = super::utf8_headers(m)
        .iter()
        .map(|(k, v)| {
            (
                clipped(&storable(k), 256).into_owned(),
                clipped(&storable(v), 1024).into_owned(),
            )
        })
        .take_while(|(k, v)| {
            room = room.saturating_sub(k.len() + v.len());
            room > 0
        })
        .collect();
    let headers = serde_json::to_value(headers).unwrap_or_default();
    sqlx::query(
        "INSERT INTO obx.quarantine (consumer, topic, kafka_partition, kafka_offset, key, value, headers, reason) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
    )
    .bind(consumer)
    .bind(m.topic())
    .bind(m.partition())
    .bind(m.offset())
    .bind(m.key().map(|k| &k[..k.len().min(KEEP)]))
    .bind(m.payload().map(|p| &p[..p.len().min(KEEP)]))
    .bind(headers)
    // A reason may quote a handler's error, which can hold a NUL: refused, the quarantine
    // would be tried for ever and hold its partition.
    .bind(storable(reason))
    .execute(conn)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::embedded::EmbeddedPostgres;
    use rdkafka::message::Timestamp;
    use sqlx::Connection;

    /// A quarantine whose reason quotes an error with a NUL in it (a handler's, at a refused
    /// park) is stored: Postgres refused the text, the insert was tried again for ever, and
    /// the message's partition moved no more.
    #[tokio::test]
    async fn a_reason_with_a_nul_is_stored() {
        let pg = EmbeddedPostgres::start(&[]).unwrap();
        let mut conn = PgConnection::connect(&pg.url("postgres")).await.unwrap();
        let pool = sqlx::PgPool::connect(&pg.url("postgres")).await.unwrap();
        crate::db::migrate(&pool).await.unwrap();
        pool.close().await;
        let m = OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            7,
            None,
        );
        quarantine(&mut conn, "c", &m, "refused: the handler said \"a\0b\"")
            .await
            .expect("the quarantine is stored");
        let reason: String = sqlx::query_scalar("SELECT reason FROM obx.quarantine WHERE consumer = 'c'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(reason, "refused: the handler said \"a\u{FFFD}b\"");
    }
}
