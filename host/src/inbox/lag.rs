//! The consumers' lag as librdkafka reports it, kept for `/v1/status`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// The last consumer lag librdkafka reported, by (plugin, topic, partition): for `/v1/status`.
#[derive(Default)]
pub struct ConsumerLag(Mutex<BTreeMap<(String, String, i32), i64>>);

impl ConsumerLag {
    pub fn set(&self, plugin: &str, topic: &str, partition: i32, lag: i64) {
        let mut lags = self.0.lock().unwrap_or_else(|e| e.into_inner());
        lags.insert((plugin.to_string(), topic.to_string(), partition), lag);
    }

    /// Replaces `plugin`'s lags with `lags` (topic, partition, lag): the partitions it reads
    /// now. Returns the partitions it no longer reads, whose lag is now another host's.
    pub fn replace(&self, plugin: &str, lags: Vec<(String, i32, i64)>) -> Vec<(String, i32)> {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now: BTreeSet<(&str, i32)> = lags.iter().map(|(t, p, _)| (t.as_str(), *p)).collect();
        let gone: Vec<(String, i32)> = all
            .keys()
            .filter(|(pl, t, p)| pl == plugin && !now.contains(&(t.as_str(), *p)))
            .map(|(_, t, p)| (t.clone(), *p))
            .collect();
        for (topic, partition) in &gone {
            all.remove(&(plugin.to_string(), topic.clone(), *partition));
        }
        for (topic, partition, lag) in lags {
            all.insert((plugin.to_string(), topic, partition), lag);
        }
        gone
    }

    /// Total lag per plugin.
    pub fn per_plugin(&self) -> BTreeMap<String, i64> {
        let lags = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = BTreeMap::new();
        for ((plugin, _, _), lag) in lags.iter() {
            *out.entry(plugin.clone()).or_insert(0) += lag;
        }
        out
    }
}
