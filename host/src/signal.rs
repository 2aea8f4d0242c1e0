//! A wake-up shared by tasks in one process: the dispatcher tells the relay that outbox
//! rows were committed, the consumers tell the inbox processors that events were stored.
//! Every subscriber sees every notification after it subscribed; many notifications that
//! arrive while it is busy count as one.

use std::sync::Arc;

use tokio::sync::watch;

#[derive(Clone)]
pub struct Signal(Arc<watch::Sender<u64>>);

impl Default for Signal {
    fn default() -> Self {
        Signal(Arc::new(watch::channel(0).0))
    }
}

impl Signal {
    pub fn notify(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver whose `changed()` fires after each later notification.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.subscribe()
    }
}
