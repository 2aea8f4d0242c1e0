//! The server's places: at most `http.max_connections` connections at once, and, when every
//! place is taken and another peer is waiting, one connection asked to leave for it.
//!
//! Without that, peers that keep their connections (each sending a small request now and
//! then, within `http.header_read_timeout`) held every place for as long as they liked, and
//! every other caller, `/readyz` too, waited in the kernel's queue. The connection asked to
//! leave is the longest-held one serving no request, or, if every one is serving one, the
//! longest-held: it finishes the request it is serving (hyper's graceful shutdown) and
//! closes. A peer that keeps reconnecting then takes its turn with the others.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// How long a connection asked to leave has before another is asked too.
const ASK_NEXT_AFTER: std::time::Duration = std::time::Duration::from_millis(250);

pub struct Places {
    free: Arc<Semaphore>,
    /// The connections holding places, oldest first.
    held: Mutex<BTreeMap<u64, Arc<Holder>>>,
    next_id: AtomicU64,
}

/// What the server knows of one connection holding a place.
#[derive(Default)]
pub struct Holder {
    /// Requests it is serving.
    serving: AtomicUsize,
    /// Whether it was asked to leave.
    asked: std::sync::atomic::AtomicBool,
    leave: Notify,
}

/// A connection's place: given back when dropped.
pub struct Place {
    id: u64,
    holder: Arc<Holder>,
    places: Arc<Places>,
    _permit: OwnedSemaphorePermit,
}

impl Places {
    pub fn new(max_connections: usize) -> Arc<Places> {
        Arc::new(Places {
            free: Arc::new(Semaphore::new(max_connections)),
            held: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(0),
        })
    }

    /// A place for a connection just accepted: at once if one is free, or else when a
    /// connection asked to leave for it has left. One that has not left within
    /// [`ASK_NEXT_AFTER`] (a peer in the middle of a request's head, which hyper lets finish
    /// it) is followed by another.
    pub async fn take(self: &Arc<Self>) -> Place {
        let permit = loop {
            if let Ok(permit) = self.free.clone().try_acquire_owned() {
                break permit;
            }
            self.ask_one_to_leave();
            let freed = tokio::time::timeout(ASK_NEXT_AFTER, self.free.clone().acquire_owned()).await;
            if let Ok(permit) = freed {
                break permit.expect("the semaphore is never closed");
            }
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let holder = Arc::new(Holder::default());
        self.held.lock().unwrap().insert(id, holder.clone());
        Place {
            id,
            holder,
            places: self.clone(),
            _permit: permit,
        }
    }

    fn ask_one_to_leave(&self) {
        let held = self.held.lock().unwrap();
        let not_asked = || held.values().filter(|h| !h.asked.load(Ordering::Acquire));
        let idle = not_asked().find(|h| h.serving.load(Ordering::Acquire) == 0);
        if let Some(holder) = idle.or_else(|| not_asked().next()) {
            holder.asked.store(true, Ordering::Release);
            holder.leave.notify_one();
        }
    }
}

impl Place {
    /// Resolves once the connection is asked to leave.
    pub async fn asked_to_leave(&self) {
        self.holder.leave.notified().await
    }

    pub fn holder(&self) -> Arc<Holder> {
        self.holder.clone()
    }
}

impl Holder {
    /// Counts a request as served by this connection until the guard is dropped.
    pub fn serving(self: &Arc<Self>) -> Serving {
        self.serving.fetch_add(1, Ordering::AcqRel);
        Serving(self.clone())
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.places.held.lock().unwrap().remove(&self.id);
    }
}

/// A request being served; counted until dropped (answered, or cut).
pub struct Serving(Arc<Holder>);

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.serving.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Places;

    #[tokio::test]
    async fn a_full_server_asks_its_oldest_idle_connection_to_leave() {
        let places = Places::new(3);
        let (a, b, c) = (places.take().await, places.take().await, places.take().await);
        let _busy = a.holder().serving();
        let waiting = tokio::spawn({
            let places = places.clone();
            async move { places.take().await }
        });
        // `a` is serving a request: `b`, the oldest idle one, is asked.
        tokio::time::timeout(Duration::from_secs(1), b.asked_to_leave())
            .await
            .expect("b asked to leave");
        assert!(!waiting.is_finished(), "no place until b has left");
        drop(b);
        let d = tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("b's place taken")
            .unwrap();
        // All busy: the oldest is asked; while it stays, the next oldest.
        let (_c_busy, _d_busy) = (c.holder().serving(), d.holder().serving());
        let places2 = places.clone();
        let _waiting = tokio::spawn(async move { places2.take().await });
        tokio::time::timeout(Duration::from_secs(1), a.asked_to_leave())
            .await
            .expect("a asked to leave");
        tokio::time::timeout(Duration::from_secs(1), c.asked_to_leave())
            .await
            .expect("c asked to leave while a stays");
    }
}
