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
}

impl Leased {
    pub fn new(plugin: &str, group: &str, options: PgConnectOptions, topics: &[String]) -> Leased {
        Leased {
            plugin: plugin.to_string(),
            topics: topics.to_vec(),
            leases: Leases::new(options.application_name("obx-consumer-leases"), group),
            partitions: Vec::new(),
            metadata_at: None,
            leaving: HashMap::new(),
            in_flight: Arc::new(InFlight::default()),
            failing: false,
        }
    }

    /// Whether a message of this partition goes to the lanes: its lease is held, and it is
    /// not being handed over. (A message that does not is neither handled nor stored, so
    /// the partition's next owner reads it again.)
    pub fn takes(&self, topic: &str, partition: i32) -> bool {
        let p = (topic.to_string(), partition);
        self.leases.held().contains(&p) && !self.leaving.contains_key(&p)
    }

    /// Counts a message of this partition as in the lanes until the returned value drops.
    pub fn track(&self, topic: &str, partition: i32) -> Tracked {
        self.in_flight.track((topic.to_string(), partition))
    }

    /// Assigns a new client the partitions leased so far (the first client: none).
    pub fn resume<X: ConsumerContext, C: Consumer<X>>(&mut self, consumer: &C) {
        // The old client's hand-overs are reconsidered by the next step.
        self.leaving.clear();
        let held: Vec<Partition> = self.leases.held().iter().cloned().collect();
        if !held.is_empty() {
            tracing::info!(plugin = %self.plugin, partitions = %names(&held), "partitions leased (a new client)");
            if let Err(e) = consumer.incremental_assign(&list(&held)) {
                tracing::error!(plugin = %self.plugin, error = %e, "cannot assign leased partitions");
            }
        }
    }

    /// One step: the partitions (every 5 s), the leases, then the assignment. Returns
    /// false if partitions were lost: the consumer must start over with a new client.
    pub async fn step<X, C>(&mut self, consumer: &Arc<C>) -> bool
    where
        X: ConsumerContext + 'static,
        C: Consumer<X> + Send + Sync + 'static,
    {
        if self.partitions.is_empty() || self.metadata_at.is_none_or(|t| t.elapsed() >= METADATA_EVERY) {
            let (c, topics) = (consumer.clone(), self.topics.clone());
            if let Ok(Some(found)) = tokio::task::spawn_blocking(move || partitions_of(&*c, &topics)).await {
                self.partitions = found;
                self.metadata_at = Some(Instant::now());
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
        self.apply(consumer.as_ref(), change);
        self.hand_over(consumer).await;
        true
    }

    /// Logs the first of a run of failed steps. The consumer keeps its partitions meanwhile.
    fn failed(&mut self, error: String) -> Change {
        if !std::mem::replace(&mut self.failing, true) {
            tracing::warn!(plugin = %self.plugin, %error,
                "partition leases: a step failed (the consumer keeps its partitions, and retries)");
        }
        Change::default()
    }

    fn apply<X: ConsumerContext, C: Consumer<X>>(&mut self, consumer: &C, change: Change) {
        if !change.acquired.is_empty() {
            tracing::info!(plugin = %self.plugin, partitions = %names(&change.acquired), "partitions leased");
            if let Err(e) = consumer.incremental_assign(&list(&change.acquired)) {
                tracing::error!(plugin = %self.plugin, error = %e, "cannot assign leased partitions");
            }
        }
        if !change.surplus.is_empty() {
            tracing::info!(plugin = %self.plugin, partitions = %names(&change.surplus), "handing partitions over");
            let _ = consumer.pause(&list(&change.surplus));
            let now = Instant::now();
            self.leaving.extend(change.surplus.into_iter().map(|p| (p, now)));
        }
    }

    /// Partitions being handed over whose lanes are done (or past [`HANDOVER_MAX`]): their
    /// offsets are committed, then they are unassigned and their leases released.
    async fn hand_over<X, C>(&mut self, consumer: &Arc<C>)
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
            return;
        }
        let c = consumer.clone();
        let _ = tokio::task::spawn_blocking(move || c.commit_consumer_state(CommitMode::Sync)).await;
        let _ = consumer.incremental_unassign(&list(&done));
        for p in &done {
            self.leaving.remove(p);
        }
        if let Err(e) = self.leases.give_up(&done).await {
            tracing::debug!(plugin = %self.plugin, error = %e, "releasing leases (the session is gone, and they with it)");
        }
        tracing::info!(plugin = %self.plugin, partitions = %names(&done), "partitions handed over");
    }

    /// Releases every lease: call after the final offset commit.
    pub async fn close(self) {
        self.leases.close().await;
    }
}

/// The partitions of `topics`, or `None` if the broker did not answer. A topic that does
/// not exist yet has none.
fn partitions_of<X: ConsumerContext, C: Consumer<X>>(consumer: &C, topics: &[String]) -> Option<Vec<Partition>> {
    let mut found = Vec::new();
    for topic in topics {
        let metadata = consumer.fetch_metadata(Some(topic), ASK_TIMEOUT).ok()?;
        for t in metadata.topics().iter().filter(|t| t.error().is_none()) {
            found.extend(t.partitions().iter().map(|p| (t.name().to_string(), p.id())));
        }
    }
    found.sort();
    Some(found)
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
