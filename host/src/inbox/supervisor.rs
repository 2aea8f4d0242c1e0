//! Keeps one consumer running per active plugin with subscriptions, and makes consumers
//! follow the plugins: a plugin loaded starts one, a plugin unloaded stops its own, a new
//! version with other subscriptions restarts it. A version with the same subscriptions keeps
//! the running consumer, which takes each event to whatever version is active then. A
//! consumer that ended on its own (its plugin was away when an event came, a client it could
//! not make) is started again while its plugin is wanted, checked every [`RESTART_CHECK`],
//! after a wait that doubles while it keeps ending (up to [`RESTART_MAX`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::consumer::Consumer;
use crate::config::{ConsumerConfig, KafkaConfig};
use crate::dispatch::Dispatcher;
use crate::kafka::Brokers;
use crate::runtime::manifest::Subscription;
use crate::runtime::registry::Registry;
use crate::signal::Signal;

pub struct Supervisor {
    pub lag: Arc<crate::inbox::ConsumerLag>,
    pub service: String,
    pub dispatcher: Arc<Dispatcher>,
    pub registry: Arc<Registry>,
    pub brokers: Arc<Brokers>,
    pub kafka: KafkaConfig,
    pub config: ConsumerConfig,
    pub inbox: Signal,
}

/// How often the consumers are checked for one that ended on its own.
const RESTART_CHECK: Duration = Duration::from_secs(1);
/// The longest wait before a consumer that keeps ending is started again (the waits double
/// from [`RESTART_CHECK`]; one that ran this long first waits the shortest again).
const RESTART_MAX: Duration = Duration::from_secs(60);

struct Running {
    subscriptions: Vec<Subscription>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    started: Instant,
}

/// A plugin whose consumer ended on its own: how many times in a row, and when it may start
/// again. A consumer that cannot make its client ends at once, every time.
struct Restart {
    ended: u32,
    not_before: Instant,
    /// The subscriptions it ended with: a version with others starts at once.
    subscriptions: Vec<Subscription>,
}

impl Supervisor {
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut running: HashMap<String, Running> = HashMap::new();
        let mut restarts: HashMap<String, Restart> = HashMap::new();
        let mut changes = self.registry.changes();
        let mut check = tokio::time::interval(RESTART_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            self.sync(&mut running, &mut restarts).await;
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { break },
                _ = check.tick() => {}
                _ = shutdown.changed() => break,
            }
        }
        for (_, consumer) in running.drain() {
            stop(consumer).await;
        }
    }

    async fn sync(&self, running: &mut HashMap<String, Running>, restarts: &mut HashMap<String, Restart>) {
        let wanted: HashMap<String, Vec<Subscription>> = self
            .registry
            .plugins()
            .into_iter()
            .filter(|p| !p.manifest.subscriptions.is_empty())
            .map(|p| (p.manifest.name.clone(), p.manifest.subscriptions.clone()))
            .collect();
        let outdated: Vec<String> = running
            .iter()
            .filter(|(name, r)| wanted.get(*name) != Some(&r.subscriptions))
            .map(|(name, _)| name.clone())
            .collect();
        for name in outdated {
            if let Some(consumer) = running.remove(&name) {
                tracing::info!(plugin = %name, "stopping the consumer: the plugin's subscriptions changed or it was unloaded");
                stop(consumer).await;
            }
        }
        // Its plugin was away when an event came (unloaded and loaded again while this
        // supervisor was busy, or faster than it looked), or it could not make its client:
        // without this, the plugin's events waited for its next change of subscriptions.
        running.retain(|name, r| {
            let ended = r.task.is_finished();
            if ended && wanted.contains_key(name) {
                let before = restarts.get(name).filter(|_| r.started.elapsed() < RESTART_MAX);
                let ended_times = before.map_or(1, |b| b.ended.saturating_add(1));
                let wait = RESTART_CHECK
                    .saturating_mul(2u32.saturating_pow(ended_times - 1))
                    .min(RESTART_MAX);
                tracing::warn!(plugin = %name, times = ended_times, starting_in = ?wait,
                    "the plugin's consumer ended on its own; starting it again");
                metrics::counter!("obx_consumer_restarts_total", "plugin" => name.clone()).increment(1);
                let not_before = Instant::now() + wait;
                restarts.insert(
                    name.clone(),
                    Restart {
                        ended: ended_times,
                        not_before,
                        subscriptions: r.subscriptions.clone(),
                    },
                );
            }
            !ended
        });
        // A plugin unloaded, or a version with other subscriptions, waits for nothing.
        restarts.retain(|name, r| wanted.get(name) == Some(&r.subscriptions));
        for (name, subscriptions) in wanted {
            if running.contains_key(&name) || restarts.get(&name).is_some_and(|r| r.not_before > Instant::now()) {
                continue;
            }
            let (stop, stopped) = watch::channel(false);
            let consumer = Consumer {
                lag: self.lag.clone(),
                plugin: name.clone(),
                group: format!("{}.{}", self.service, name),
                dispatcher: self.dispatcher.clone(),
                registry: self.registry.clone(),
                brokers: self.brokers.clone(),
                kafka: self.kafka.clone(),
                config: self.config.clone(),
                inbox: self.inbox.clone(),
                shutdown: stopped,
            };
            running.insert(
                name,
                Running {
                    subscriptions,
                    stop,
                    task: tokio::spawn(consumer.run()),
                    started: Instant::now(),
                },
            );
        }
    }
}

/// Stops a consumer: it finishes the event in hand and commits its offsets.
async fn stop(consumer: Running) {
    let _ = consumer.stop.send(true);
    let _ = consumer.task.await;
}
