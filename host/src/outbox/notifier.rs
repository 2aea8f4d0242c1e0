//! The cross-host wake-up: tells the relays of other hosts that this host committed outbox
//! rows, so that they need not wait for their poll.
//!
//! A `NOTIFY` inside the command transactions would serialise their commits (Postgres takes
//! one lock for every committing notifier), so it is sent outside them, on a connection of
//! its own that does not wait for the disk: a lost notification only means a relay waits for
//! its poll. Commits that come within [`COALESCE`] of each other are told as one, and the
//! task wakes at most that often, whatever the commit rate. Nothing is sent while this host's
//! relay holds every shard, nor while no relay runs on the database at all (counted every
//! [`RECOUNT`]): a host serving commands with no relay anywhere pays no `NOTIFY` for them, and
//! then the task wakes at most once per [`IDLE_LOOK`], not after every commit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};
use tokio::sync::watch;

use crate::db::locks::LockSpace;

/// At most one wake-up of this task, and one `NOTIFY`, per this long.
const COALESCE: Duration = Duration::from_millis(2);
/// After a batch of commits with nobody to wake, how long the task does not listen for
/// commits: this host's relay losing a shard is followed by wake-ups at most this much later.
const IDLE_LOOK: Duration = Duration::from_millis(100);
/// How often the relays on the database are counted again (at a wake-up), and how often a
/// lost session is opened again. A relay that starts (or comes back) meanwhile misses the
/// wake-ups of at most this long and [`IDLE_LOOK`], and finds those rows at its poll.
const RECOUNT: Duration = Duration::from_secs(1);

/// The notifier's session, and what it last learnt.
struct Session {
    conn: PgConnection,
    channel: String,
    locks: LockSpace,
    /// Relays running on the database when last counted (`None`: the count failed, so any
    /// may run), and when that was.
    relays: Option<i64>,
    counted: Instant,
}

/// Runs until `shutdown`: after each batch of this host's commits (`signal`), wakes the other
/// relays. When it sent nothing (nobody to wake: `local_relay_owns_all`, or no relay counted
/// on the database; or no session), it does not listen for commits again for [`IDLE_LOOK`]:
/// commits then cost at most ten wake-ups of this task a second, not one each.
pub async fn run(
    database_url: String,
    mut signal: watch::Receiver<u64>,
    mut shutdown: watch::Receiver<bool>,
    local_relay_owns_all: Arc<AtomicBool>,
) {
    let mut notifier = Notifier {
        database_url,
        session: None,
        opened: None,
    };
    loop {
        tokio::select! {
            changed = signal.changed() => if changed.is_err() { break },
            _ = shutdown.changed() => break,
        }
        let told = match local_relay_owns_all.load(Ordering::Relaxed) {
            true => false,
            // The database may hang; shutting down must not wait for it.
            false => tokio::select! {
                told = notifier.notify() => told,
                _ = shutdown.changed() => break,
            },
        };
        // Commits made meanwhile stay pending, and are told as one when it listens again.
        tokio::select! {
            _ = tokio::time::sleep(if told { COALESCE } else { IDLE_LOOK }) => {}
            _ = shutdown.changed() => break,
        }
    }
}

/// The task's session, opened when first needed and again at most once per [`RECOUNT`].
struct Notifier {
    database_url: String,
    session: Option<Session>,
    opened: Option<Instant>,
}

impl Notifier {
    /// One wake-up of the other relays; whether a `NOTIFY` went out.
    async fn notify(&mut self) -> bool {
        let Some(s) = self.session().await else {
            return false;
        };
        match s.wake_relays().await {
            Ok(told) => told,
            Err(e) => {
                tracing::warn!(error = %e, "could not wake the other hosts' relays; they wait for their poll");
                self.session = None;
                false
            }
        }
    }

    async fn session(&mut self) -> Option<&mut Session> {
        if self.session.is_none() && self.opened.is_none_or(|t| t.elapsed() >= RECOUNT) {
            self.opened = Some(Instant::now());
            self.session = Session::open(&self.database_url).await;
        }
        self.session.as_mut()
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
        let relays = relays(&mut conn, locks).await;
        Some(Session {
            conn,
            channel,
            locks,
            relays,
            counted: Instant::now(),
        })
    }

    /// The relays on the database, counted again if the last count is [`RECOUNT`] old.
    async fn count_relays(&mut self) -> Option<i64> {
        if self.counted.elapsed() >= RECOUNT {
            self.relays = relays(&mut self.conn, self.locks).await;
            self.counted = Instant::now();
        }
        self.relays
    }

    /// One `NOTIFY` on the relays' channel, unless no relay runs; whether it went out.
    async fn wake_relays(&mut self) -> sqlx::Result<bool> {
        if self.count_relays().await == Some(0) {
            return Ok(false);
        }
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(&self.channel)
            .execute(&mut self.conn)
            .await?;
        Ok(true)
    }
}

/// How many relays run on this database, on any host, whatever user it logs in as: the
/// sessions that hold a relay's membership lock, plugin sessions left out (a plugin that
/// takes that lock is evicted by the relays). `None` if the count failed: then the
/// notifications go out, since a needless one costs little and a missed one a poll.
async fn relays(conn: &mut PgConnection, locks: LockSpace) -> Option<i64> {
    let counted = sqlx::query_scalar(
        "SELECT count(*) FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid = $1::oid \
           AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) \
           AND NOT EXISTS (SELECT 1 FROM obx.plugin p WHERE p.role_name = a.usename)",
    )
    .bind(locks.member as i64)
    .fetch_one(conn)
    .await;
    match counted {
        Ok(n) => Some(n),
        Err(e) => {
            tracing::warn!(error = %e, "could not count the relays; waking them after every commit");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::embedded::EmbeddedPostgres;
    use crate::signal::Signal;
    use sqlx::postgres::PgListener;

    /// How long commits keep coming before a test says nobody was woken.
    const SETTLE: Duration = Duration::from_millis(600);

    /// Whether a notification reaches `listener` while commits keep coming for `within`.
    async fn woken_after_commits(signal: &Signal, listener: &mut PgListener, within: Duration) -> bool {
        let until = Instant::now() + within;
        while Instant::now() < until {
            signal.notify();
            if tokio::time::timeout(Duration::from_millis(20), listener.recv())
                .await
                .is_ok()
            {
                return true;
            }
        }
        false
    }

    /// The notifications that reach `listener` until none has for 100 ms.
    async fn drain(listener: &mut PgListener) -> u128 {
        let mut told = 0;
        while tokio::time::timeout(Duration::from_millis(100), listener.recv())
            .await
            .is_ok()
        {
            told += 1;
        }
        told
    }

    /// Commits wake other hosts' relays only while some relay runs and this host's own does
    /// not hold every shard; a host with no relay anywhere sends nothing. When this host's
    /// relay loses a shard the wake-ups resume after the idle pause, before the next count.
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

        assert!(
            !woken_after_commits(&signal, &mut listener, SETTLE).await,
            "no relay runs"
        );

        // Another host's relay joins; the notifier sees it at its next count.
        let mut relay = PgConnection::connect(&url).await.unwrap();
        let locks = LockSpace::load(&mut relay).await.unwrap();
        super::super::relay::join(&mut relay, locks).await.unwrap();
        assert!(
            woken_after_commits(&signal, &mut listener, Duration::from_secs(10)).await,
            "a relay runs"
        );

        // A burst of commits: one wake-up, and one notification, per COALESCE at most.
        drain(&mut listener).await;
        let burst = Instant::now();
        for _ in 0..2000 {
            signal.notify();
            tokio::task::yield_now().await;
        }
        let elapsed = burst.elapsed();
        let told = drain(&mut listener).await;
        let most = elapsed.as_millis() / COALESCE.as_millis() + 2;
        assert!(
            (1..=most).contains(&told),
            "{told} notifications for 2000 commits in {elapsed:?}"
        );

        owns_all.store(true, Ordering::Relaxed);
        drain(&mut listener).await;
        assert!(
            !woken_after_commits(&signal, &mut listener, SETTLE).await,
            "this host's relay holds every shard"
        );

        // It loses a shard: the wake-ups resume after the idle pause, not at the next count.
        owns_all.store(false, Ordering::Relaxed);
        let lost = Instant::now();
        assert!(
            woken_after_commits(&signal, &mut listener, Duration::from_secs(5)).await,
            "this host's relay no longer holds every shard"
        );
        let resumed = lost.elapsed();
        assert!(resumed < RECOUNT, "woken again after {resumed:?}");

        stop.send(true).unwrap();
        task.await.unwrap();
    }
}
