//! The cross-host wake-up: tells the relays of other hosts that this host committed outbox
//! rows, so that they need not wait for their poll.
//!
//! A `NOTIFY` inside the command transactions would serialise their commits (Postgres takes
//! one lock for every committing notifier), so it is sent outside them, on a connection of
//! its own that does not wait for the disk: a lost notification only means a relay waits for
//! its poll. Commits that come within [`COALESCE`] of each other are told as one, and the
//! task wakes at most that often, whatever the commit rate. Nothing is sent while this host's
//! relay holds every shard, nor while no relay runs on the database at all (counted every
//! [`RECOUNT`]): a host serving commands with no relay anywhere pays no `NOTIFY` for them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};
use tokio::sync::watch;

use crate::db::locks::LockSpace;

/// At most one wake-up of this task, and one `NOTIFY`, per this long.
const COALESCE: Duration = Duration::from_millis(2);
/// How often the relays on the database are counted again. A relay that starts meanwhile
/// finds the rows it is given at its first claim.
const RECOUNT: Duration = Duration::from_secs(1);

/// The notifier's session, and what it last learnt.
struct Session {
    conn: PgConnection,
    channel: String,
    locks: LockSpace,
    /// Relays running on the database when last counted, and when that was.
    relays: i64,
    counted: Instant,
}

/// Runs until `shutdown`: after each batch of this host's commits (`signal`), wakes the other
/// relays unless `local_relay_owns_all`.
pub async fn run(
    database_url: String,
    mut signal: watch::Receiver<u64>,
    mut shutdown: watch::Receiver<bool>,
    local_relay_owns_all: Arc<AtomicBool>,
) {
    let mut session: Option<Session> = None;
    loop {
        tokio::select! {
            changed = signal.changed() => if changed.is_err() { break },
            _ = shutdown.changed() => break,
        }
        if !local_relay_owns_all.load(Ordering::Relaxed) {
            if session.is_none() {
                session = Session::open(&database_url).await;
            }
            if let Some(s) = session.as_mut() {
                if let Err(e) = s.wake_relays().await {
                    tracing::debug!(error = %e, "could not notify other relays");
                    session = None;
                }
            }
        }
        tokio::time::sleep(COALESCE).await;
    }
}

impl Session {
    async fn open(database_url: &str) -> Option<Session> {
        let options = crate::db::host_options(database_url, "obx-notifier")
            .ok()?
            .options([("synchronous_commit", "off")]);
        let mut conn = PgConnection::connect_with(&options).await.ok()?;
        let channel = crate::db::installation::notify_channel(&mut conn).await.ok()?;
        let locks = LockSpace::load(&mut conn).await.ok()?;
        let relays = super::relay::members(&mut conn, locks).await.ok()?;
        Some(Session {
            conn,
            channel,
            locks,
            relays,
            counted: Instant::now(),
        })
    }

    /// One `NOTIFY` on the relays' channel, if any relay runs.
    async fn wake_relays(&mut self) -> anyhow::Result<()> {
        if self.counted.elapsed() >= RECOUNT {
            self.relays = super::relay::members(&mut self.conn, self.locks).await?;
            self.counted = Instant::now();
        }
        if self.relays > 0 {
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(&self.channel)
                .execute(&mut self.conn)
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::embedded::EmbeddedPostgres;
    use crate::signal::Signal;
    use sqlx::postgres::PgListener;

    /// Whether a notification reaches `listener` within a while after a burst of commits.
    async fn woken_after_commits(signal: &Signal, listener: &mut PgListener) -> bool {
        for _ in 0..5 {
            signal.notify();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::timeout(Duration::from_millis(500), listener.recv())
            .await
            .is_ok()
    }

    /// Commits wake other hosts' relays only while some relay runs and this host's own does
    /// not hold every shard; a host with no relay anywhere sends nothing.
    #[tokio::test]
    async fn relays_are_woken_only_when_one_runs_and_the_local_one_does_not_hold_every_shard() {
        let pg = EmbeddedPostgres::start(&[]).unwrap();
        let url = pg.url("postgres");
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        crate::db::migrate(&pool).await.unwrap();
        let mut conn = pool.acquire().await.unwrap();
        let channel = crate::db::installation::notify_channel(&mut conn).await.unwrap();
        let mut listener = PgListener::connect(&url).await.unwrap();
        listener.listen(&channel).await.unwrap();
        let signal = Signal::default();
        let (stop, stopped) = watch::channel(false);
        let owns_all = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(run(url.clone(), signal.subscribe(), stopped, owns_all.clone()));

        assert!(!woken_after_commits(&signal, &mut listener).await, "no relay runs");

        // Another host's relay joins; the notifier sees it at its next count.
        let mut relay = PgConnection::connect(&url).await.unwrap();
        let locks = LockSpace::load(&mut relay).await.unwrap();
        super::super::relay::join(&mut relay, locks).await.unwrap();
        tokio::time::sleep(RECOUNT + Duration::from_millis(100)).await;
        assert!(woken_after_commits(&signal, &mut listener).await, "a relay runs");

        owns_all.store(true, Ordering::Relaxed);
        while tokio::time::timeout(Duration::from_millis(100), listener.recv())
            .await
            .is_ok()
        {}
        assert!(
            !woken_after_commits(&signal, &mut listener).await,
            "this host's relay holds every shard"
        );

        stop.send(true).unwrap();
        task.await.unwrap();
    }
}
