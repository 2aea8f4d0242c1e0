//! Notices a consumer that is stuck: it holds partitions that the broker has newer messages
//! for, and for a while it has neither received a message nor finished one. Brokers have
//! bugs (one kept a dead member's group generation for 80 s, and its survivors waited), and
//! fetchers stop; leaving the group and joining it again is what a host can do about either.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::Offset;

/// How long a broker question of the check may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// When the consumer last made progress: received a message or finished one.
pub struct Progress {
    since: Instant,
    /// Milliseconds from `since`.
    last: AtomicU64,
}

impl Progress {
    pub fn new() -> Self {
        Progress {
            since: Instant::now(),
            last: AtomicU64::new(0),
        }
    }

    pub fn advanced(&self) {
        let now = self.since.elapsed().as_millis() as u64;
        self.last.fetch_max(now, Ordering::Relaxed);
    }

    /// How long there has been no progress, if longer than `bound`.
    pub fn idle_beyond(&self, bound: Duration) -> Option<Duration> {
        let idle = self
            .since
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last.load(Ordering::Relaxed)));
        (idle > bound).then_some(idle)
    }
}

/// Whether one of the consumer's assigned partitions has a message past the consumer's
/// position (or its group's committed offset, where it has fetched nothing yet). Asks the
/// broker, so it blocks: call it off the async runtime. A broker that does not answer gives
/// `false`: a rejoin does not help against an unreachable broker.
pub fn behind<C: Consumer<X>, X: rdkafka::consumer::ConsumerContext>(consumer: &C) -> bool {
    let Ok(assignment) = consumer.assignment() else {
        return false;
    };
    if assignment.count() == 0 {
        return false;
    }
    let positions = consumer.position().ok();
    let committed = consumer.committed(ASK_TIMEOUT).ok();
    let offset_in = |list: &Option<rdkafka::TopicPartitionList>, topic: &str, partition: i32| match list
        .as_ref()?
        .find_partition(topic, partition)?
        .offset()
    {
        Offset::Offset(n) => Some(n),
        _ => None,
    };
    for e in assignment.elements() {
        let (topic, partition) = (e.topic(), e.partition());
        // The first question the broker does not answer ends the check: asking about every
        // partition of an unreachable broker would hold the consumer's loop for minutes.
        let Ok((low, high)) = consumer.fetch_watermarks(topic, partition, ASK_TIMEOUT) else {
            return false;
        };
        let at = offset_in(&positions, topic, partition)
            .max(offset_in(&committed, topic, partition))
            .unwrap_or(low);
        if high > at {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_idle_only_past_its_bound() {
        let p = Progress::new();
        assert!(p.idle_beyond(Duration::from_secs(5)).is_none());
        std::thread::sleep(Duration::from_millis(30));
        assert!(p.idle_beyond(Duration::from_millis(10)).is_some());
        p.advanced();
        assert!(p.idle_beyond(Duration::from_millis(10)).is_none());
    }
}
