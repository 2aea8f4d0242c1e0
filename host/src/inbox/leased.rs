//! A consumer whose partitions come from leases ([`lease`](super::lease)): it reads the
//! partitions of its topics from the broker, steps its leases every half second, and makes
//! the librdkafka consumer's assignment follow them.
//!
//! A partition taken over starts at the group's committed offset. A partition handed over is
//! paused first; its lanes finish what they hold (for [`HANDOVER_MAX`] at most), their
//! offsets are committed, and only then is it unassigned and its lease released, so that the
//! next owner starts where this one stopped.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::postgres::PgConnectOptions;

use super::lease::{Change, Leases, Partition};

/// How often the leases move toward the fair share.
pub const STEP_EVERY: Duration = Duration::from_millis(500);
/// How often the topics' partitions are read again.
const METADATA_EVERY: Duration = Duration::from_secs(5);
/// The longest a step or a broker question may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest a hand-over waits for its lanes. Past it the partition goes anyway; the
/// next owner's dedup (or the inbox) makes a message handled by both a no-op for one.
const HANDOVER_MAX: Duration = Duration::from_secs(10);

pub struct Leased {
    plugin: String,
    topics: Vec<String>,
    leases: Leases,
    partitions: Vec<Partition>,
    metadata_at: Option<Instant>,
    /// Partitions being handed over, since when.
    leaving: HashMap<Partition, Instant>,
    in_flight: Arc<InFlight>,
    failing: bool,
    /// Each partition held, with the number of the assignment that started its current
    /// tenure: a message read in an earlier tenure is not admitted (see [`Leased::tenure`]).
    tenures: HashMap<Partition, u64>,
    assignments: u64,
}

impl Leased {
    pub fn new(plugin: &str, group: &str, options: PgConnectOptions, topics: &[String]) -> Leased {
        Leased {
            plugin: plugin.to_string(),
            topics: topics.to_vec(),
            leases: Leases::new(
                crate::db::lease_holder(options.application_name("obx-consumer-leases")),
                group,
            ),
            partitions: Vec::new(),
            metadata_at: None,
            leaving: HashMap::new(),
            in_flight: Arc::new(InFlight::default()),
            failing: false,
            tenures: HashMap::new(),
            assignments: 0,
        }
    }

    /// Whether this partition's lease is held and it is not being handed over.
    pub fn owns(&self, topic: &str, partition: i32) -> bool {
        let p = (topic.to_string(), partition);
        self.leases.held().contains(&p) && !self.leaving.contains_key(&p)
    }

    /// The tenure in which this consumer owns the partition now, if it does. A partition
    /// handed over and leased back is assigned again, from the group's committed offset, in
    /// a new tenure: a message read in the old one must not be handled, or it would run
    /// ahead of the earlier messages read again.
    pub fn tenure(&self, topic: &str, partition: i32) -> Option<u64> {
        let p = (topic.to_string(), partition);
        self.tenures.get(&p).copied().filter(|_| self.owns(topic, partition))
    }

    /// Admits a message of this partition, read in `tenure`, to the lanes if the partition
    /// is still owned in that tenure, counting it as in flight until the returned value
    /// drops. A message not admitted is neither handled nor stored, so the partition's
    /// owner reads it again.
    pub fn admit(&self, topic: &str, partition: i32, tenure: u64) -> Option<Tracked> {
        (self.tenure(topic, partition) == Some(tenure)).then(|| self.in_flight.track((topic.to_string(), partition)))
    }

    /// Starts a tenure for each of `partitions`, just assigned.
    fn begin_tenures(&mut self, partitions: &[Partition]) {
        for p in partitions {
            self.assignments += 1;
            self.tenures.insert(p.clone(), self.assignments);
        }
    }

    /// Assigns a new client the partitions leased so far (the first client: none).
    pub fn resume<X: ConsumerContext, C: Consumer<X>>(&mut self, consumer: &C) {
        // The old client's hand-overs are reconsidered by the next step.
        self.leaving.clear();
        let held: Vec<Partition> = self.leases.held().iter().cloned().collect();
        if !held.is_empty() {
            tracing::info!(plugin = %self.plugin, partitions = %names(&held), "partitions leased (a new client)");
            assign(consumer, &held, &self.plugin);
        }
        self.begin_tenures(&held);
    }

    /// One step: the partitions (every 5 s), the leases, then the assignment. Returns
    /// false if partitions were lost: the consumer must start over with a new client.
    pub async fn step<X, C>(&mut self, consumer: &Arc<C>) -> bool
    where
        X: ConsumerContext + 'static,
        C: Consumer<X> + Send + Sync + 'static,
    {
        if self.partitions.is_empty() || self.metadata_at.is_none_or(|t| t.elapsed() >= METADATA_EVERY) {
            self.metadata_at = Some(Instant::now());
            let (c, topics, known) = (consumer.clone(), self.topics.clone(), self.partitions.clone());
            if let Ok(Some(found)) = tokio::task::spawn_blocking(move || partitions_of(&*c, &topics, &known)).await {
                self.partitions = found;
            }
        }
        let leaving: HashSet<Partition> = self.leaving.keys().cloned().collect();
        let stepped = tokio::time::timeout(ASK_TIMEOUT, self.leases.step(&self.partitions, &leaving)).await;
        let change = match stepped {
            Ok(Ok(change)) => {
                if std::mem::take(&mut self.failing) {
                    tracing::info!(plugin = %self.plugin, "partition leases work again");
                }
                change
            }
            Ok(Err(e)) => self.failed(format!("{e:#}")),
            Err(_) => {
                // Cut off mid-statement: the session's state is unknown.
                self.leases.reset();
                self.failed("timed out".into())
            }
        };
        if !change.lost.is_empty() {
            tracing::warn!(plugin = %self.plugin, partitions = %names(&change.lost),
                "partitions lost: another host leased them while this one's lease session was gone; \
                 starting over with a new client");
            return false;
        }
        self.apply(consumer.as_ref(), change) && self.hand_over(consumer).await
    }

    /// Logs the first of a run of failed steps. The consumer keeps its partitions meanwhile.
    fn failed(&mut self, error: String) -> Change {
        if !std::mem::replace(&mut self.failing, true) {
            tracing::warn!(plugin = %self.plugin, %error,
                "partition leases: a step failed (the consumer keeps its partitions, and retries)");
        }
        Change::default()
    }

    /// Returns false if the client's assignment could not follow the leases: the consumer
    /// then starts over with a new client, which is assigned exactly what is leased.
    fn apply<X: ConsumerContext, C: Consumer<X>>(&mut self, consumer: &C, change: Change) -> bool {
        if !change.acquired.is_empty() {
            tracing::info!(plugin = %self.plugin, partitions = %names(&change.acquired), "partitions leased");
            if !assign(consumer, &change.acquired, &self.plugin) {
                return false;
            }
            self.begin_tenures(&change.acquired);
        }
        if !change.surplus.is_empty() {
            tracing::info!(plugin = %self.plugin, partitions = %names(&change.surplus), "handing partitions over");
            let _ = consumer.pause(&list(&change.surplus));
            let now = Instant::now();
            self.leaving.extend(change.surplus.into_iter().map(|p| (p, now)));
        }
        true
    }

    /// Partitions being handed over whose lanes are done (or past [`HANDOVER_MAX`]): their
    /// offsets are committed, then they are unassigned and their leases released. Returns
    /// false if the client could not unassign them (start over, as for [`Leased::apply`]).
    async fn hand_over<X, C>(&mut self, consumer: &Arc<C>) -> bool
    where
        X: ConsumerContext + 'static,
        C: Consumer<X> + Send + Sync + 'static,
    {
        let done: Vec<Partition> = self
            .leaving
            .iter()
            .filter(|(p, since)| self.in_flight.count(p) == 0 || since.elapsed() >= HANDOVER_MAX)
            .map(|(p, _)| p.clone())
            .collect();
        if done.is_empty() {
            return true;
        }
        // Bounded: a broker that does not answer costs the next owner a few redeliveries
        // (dedup hits), not this consumer's loop.
        let c = consumer.clone();
        let commit = tokio::task::spawn_blocking(move || c.commit_consumer_state(CommitMode::Sync));
        let _ = tokio::time::timeout(ASK_TIMEOUT, commit).await;
        // Paused by the application, a partition would stay paused if it came back.
        let _ = consumer.resume(&list(&done));
        let unassigned = consumer.incremental_unassign(&list(&done));
        for p in &done {
            self.leaving.remove(p);
            self.tenures.remove(p);
        }
        match tokio::time::timeout(ASK_TIMEOUT, self.leases.give_up(&done)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::debug!(plugin = %self.plugin, error = %e, "releasing leases (the session is gone, and they with it)")
            }
            Err(_) => self.leases.reset(),
        }
        tracing::info!(plugin = %self.plugin, partitions = %names(&done), "partitions handed over");
        if let Err(e) = unassigned {
            tracing::warn!(plugin = %self.plugin, error = %e, "cannot unassign partitions handed over; starting over with a new client");
            return false;
        }
        true
    }

    /// Releases every lease: call after the final offset commit.
    pub async fn close(self) {
        self.leases.close().await;
    }
}

/// The partitions of `topics`, or `None` if the broker did not answer. A topic the broker
/// reports an error for (one that does not exist yet, a leader election) keeps the
/// partitions it had in `known`: a passing error must not shrink the share of every host.
fn partitions_of<X: ConsumerContext, C: Consumer<X>>(
    consumer: &C,
    topics: &[String],
    known: &[Partition],
) -> Option<Vec<Partition>> {
    let mut found = Vec::new();
    for topic in topics {
        let metadata = consumer.fetch_metadata(Some(topic), ASK_TIMEOUT).ok()?;
        for t in metadata.topics() {
            if t.error().is_none() {
                found.extend(t.partitions().iter().map(|p| (t.name().to_string(), p.id())));
            } else {
                found.extend(known.iter().filter(|(name, _)| name == t.name()).cloned());
            }
        }
    }
    found.sort();
    found.dedup();
    Some(found)
}

/// Adds `partitions` to the client's assignment, from their committed offsets, and not
/// paused. Logs and returns false if the client refuses.
fn assign<X: ConsumerContext, C: Consumer<X>>(consumer: &C, partitions: &[Partition], plugin: &str) -> bool {
    let tpl = list(partitions);
    match consumer.incremental_assign(&tpl) {
        Ok(()) => {
            let _ = consumer.resume(&tpl);
            true
        }
        Err(e) => {
            tracing::error!(plugin, error = %e, "cannot assign leased partitions");
            false
        }
    }
}

/// Partitions to assign, each from its committed offset.
fn list(partitions: &[Partition]) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for (topic, partition) in partitions {
        let _ = tpl.add_partition_offset(topic, *partition, Offset::Stored);
    }
    tpl
}

fn names(partitions: &[Partition]) -> String {
    let names: Vec<String> = partitions.iter().map(|(t, p)| format!("{t}[{p}]")).collect();
    names.join(" ")
}

/// Messages of each partition that are in the lanes.
#[derive(Default)]
struct InFlight(Mutex<HashMap<Partition, usize>>);

impl InFlight {
    fn track(self: &Arc<Self>, p: Partition) -> Tracked {
        *self.0.lock().expect("never poisoned").entry(p.clone()).or_default() += 1;
        Tracked {
            map: self.clone(),
            partition: p,
        }
    }

    fn count(&self, p: &Partition) -> usize {
        self.0.lock().expect("never poisoned").get(p).copied().unwrap_or(0)
    }
}

/// A message counted in its partition's [`InFlight`] until dropped.
pub struct Tracked {
    map: Arc<InFlight>,
    partition: Partition,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut counts = self.map.0.lock().expect("never poisoned");
        if let Some(n) = counts.get_mut(&self.partition) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.partition);
            }
        }
    }
}
