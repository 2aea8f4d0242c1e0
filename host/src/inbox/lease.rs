//! Partition leases in Postgres: which host consumes which partition of a plugin's topics,
//! when `consumer.assignment = "leases"` (the default).
//!
//! Kafka's group coordinator notices a dead member only when its session times out (6 s at
//! the least on a stock broker), and then moves its partitions in a rebalance of several
//! phases. Postgres notices a killed host at once: its sessions end with its process, and
//! their advisory locks with them. So each consumer holds, on a connection of its own:
//! * its group's membership lock, shared, so that the members can count themselves;
//! * one exclusive lock per partition it consumes;
//!
//! and every step moves it toward its fair share, `ceil(partitions / members)`, the way the
//! relay shares its shards. The lock keys are ids from `obx.consumer_group` and
//! `obx.consumer_partition`, in the host's lock classes ([`LockSpace`]).
//!
//! Leases are about speed, not safety: when two hosts read one partition for a moment (a
//! hand-over past its bound, a lease session lost while its host lives), the dedup record or
//! the inbox's key keeps each event's effects once, and a key's events in order.

use std::collections::{BTreeSet, HashMap, HashSet};

use anyhow::{Context, Result};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

use crate::db::locks::LockSpace;

/// A topic's partition.
pub type Partition = (String, i32);

/// What a step changed.
#[derive(Debug, Default)]
pub struct Change {
    /// Newly leased: start reading them.
    pub acquired: Vec<Partition>,
    /// Beyond the fair share: hand them over ([`Leases::give_up`] once their work is done).
    pub surplus: Vec<Partition>,
    /// Leased by another consumer while this one's session was lost: stop reading them now.
    pub lost: Vec<Partition>,
}

pub struct Leases {
    options: PgConnectOptions,
    group: String,
    session: Option<Session>,
    ids: HashMap<Partition, i32>,
    held: BTreeSet<Partition>,
    /// Found taken by another consumer when a session was opened, and not reported yet (the
    /// step that opened it may have failed after).
    lost: Vec<Partition>,
}

struct Session {
    conn: PgConnection,
    locks: LockSpace,
    group_id: i32,
}

impl Leases {
    pub fn new(options: PgConnectOptions, group: &str) -> Leases {
        Leases {
            options,
            group: group.to_string(),
            session: None,
            ids: HashMap::new(),
            held: BTreeSet::new(),
            lost: Vec::new(),
        }
    }

    pub fn held(&self) -> &BTreeSet<Partition> {
        &self.held
    }

    /// One step toward the fair share of `partitions` (all of the group's topics). `leaving`
    /// are held partitions already being handed over. After an error the session is
    /// dropped, and the next step opens another.
    pub async fn step(&mut self, partitions: &[Partition], leaving: &HashSet<Partition>) -> Result<Change> {
        let mut change = Change::default();
        if self.session.is_none() {
            let lost = self.open().await?;
            self.lost.extend(lost);
        }
        if let Err(e) = self.share(partitions, leaving, &mut change).await {
            self.session = None;
            return Err(e);
        }
        change.lost = std::mem::take(&mut self.lost);
        Ok(change)
    }

    /// Opens a session, joins the group, and takes back the partitions held before, where
    /// they are still free. Returns those that are not.
    async fn open(&mut self) -> Result<Vec<Partition>> {
        let mut conn = PgConnection::connect_with(&self.options)
            .await
            .context("connecting for partition leases")?;
        let locks = LockSpace::load(&mut conn).await?;
        locks.evict_intruders(&mut conn).await?;
        // DO UPDATE, so that the row comes back even when another host inserted it first.
        let group_id: i32 = sqlx::query_scalar(
            "INSERT INTO obx.consumer_group (group_name) VALUES ($1) \
             ON CONFLICT (group_name) DO UPDATE SET group_name = EXCLUDED.group_name RETURNING id",
        )
        .bind(&self.group)
        .fetch_one(&mut conn)
        .await?;
        let joined: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock_shared($1, $2)")
            .bind(locks.group)
            .bind(group_id)
            .fetch_one(&mut conn)
            .await?;
        anyhow::ensure!(joined, "the group's membership lock is held exclusively");
        let before: Vec<i32> = self.held.iter().map(|p| self.ids[p]).collect();
        let kept: HashSet<i32> =
            sqlx::query_scalar("SELECT id FROM unnest($2::int[]) AS id WHERE pg_try_advisory_lock($1, id)")
                .bind(locks.partition)
                .bind(&before)
                .fetch_all(&mut conn)
                .await?
                .into_iter()
                .collect();
        let lost: Vec<Partition> = self
            .held
            .iter()
            .filter(|p| !kept.contains(&self.ids[*p]))
            .cloned()
            .collect();
        for p in &lost {
            self.held.remove(p);
        }
        self.session = Some(Session { conn, locks, group_id });
        Ok(lost)
    }

    async fn share(
        &mut self,
        partitions: &[Partition],
        leaving: &HashSet<Partition>,
        change: &mut Change,
    ) -> Result<()> {
        let s = self.session.as_mut().expect("opened");
        s.locks.evict_intruders(&mut s.conn).await?;
        let unknown: Vec<&Partition> = partitions.iter().filter(|p| !self.ids.contains_key(*p)).collect();
        if !unknown.is_empty() {
            self.ids.extend(partition_ids(&mut s.conn, s.group_id, &unknown).await?);
        }
        // Members are the host user's sessions: a plugin session is never counted.
        let members: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
               AND l.classid = $1::oid AND l.objid = $2::oid AND a.usename = current_user \
               AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())",
        )
        .bind(s.locks.group as i64)
        .bind(s.group_id as i64)
        .fetch_one(&mut s.conn)
        .await?;
        let fair = partitions.len().div_ceil(members.max(1) as usize);
        let staying = self.held.iter().filter(|p| !leaving.contains(*p)).count();
        if staying > fair {
            change.surplus = self
                .held
                .iter()
                .rev()
                .filter(|p| !leaving.contains(*p))
                .take(staying - fair)
                .cloned()
                .collect();
        } else if staying < fair {
            let free: Vec<i32> = partitions
                .iter()
                .filter(|p| !self.held.contains(*p))
                .filter_map(|p| self.ids.get(p).copied())
                .collect();
            // The LIMIT stops the scan: exactly the returned partitions were locked.
            let got: HashSet<i32> = sqlx::query_scalar(
                "SELECT id FROM unnest($2::int[]) AS id WHERE pg_try_advisory_lock($1, id) LIMIT $3",
            )
            .bind(s.locks.partition)
            .bind(&free)
            .bind((fair - staying) as i64)
            .fetch_all(&mut s.conn)
            .await?
            .into_iter()
            .collect();
            change.acquired = partitions
                .iter()
                .filter(|p| self.ids.get(*p).is_some_and(|id| got.contains(id)))
                .cloned()
                .collect();
            self.held.extend(change.acquired.iter().cloned());
        }
        Ok(())
    }

    /// Drops the session (its leases go with it); the next step opens another and takes
    /// back what it can.
    pub fn reset(&mut self) {
        self.session = None;
    }

    /// Releases the leases of `partitions`, whose work is done.
    pub async fn give_up(&mut self, partitions: &[Partition]) -> Result<()> {
        let ids: Vec<i32> = partitions.iter().filter_map(|p| self.ids.get(p)).copied().collect();
        for p in partitions {
            self.held.remove(p);
        }
        if let Some(s) = self.session.as_mut() {
            let released = sqlx::query("SELECT pg_advisory_unlock($1, id) FROM unnest($2::int[]) AS id")
                .bind(s.locks.partition)
                .bind(&ids)
                .execute(&mut s.conn)
                .await;
            if let Err(e) = released {
                self.session = None;
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Releases every lease and the membership, by ending the session.
    pub async fn close(mut self) {
        if let Some(s) = self.session.take() {
            let _ = s.conn.close().await;
        }
    }
}

/// The ids of the group's partitions, created where new.
async fn partition_ids(
    conn: &mut PgConnection,
    group_id: i32,
    partitions: &[&Partition],
) -> Result<Vec<(Partition, i32)>> {
    let topics: Vec<&str> = partitions.iter().map(|p| p.0.as_str()).collect();
    let numbers: Vec<i32> = partitions.iter().map(|p| p.1).collect();
    sqlx::query(
        "INSERT INTO obx.consumer_partition (group_id, topic, partition) \
         SELECT $1, t, n FROM unnest($2::text[], $3::int[]) AS u(t, n) \
         ON CONFLICT (group_id, topic, partition) DO NOTHING",
    )
    .bind(group_id)
    .bind(&topics)
    .bind(&numbers)
    .execute(&mut *conn)
    .await?;
    let rows: Vec<(String, i32, i32)> = sqlx::query_as(
        "SELECT topic, partition, id FROM obx.consumer_partition \
         WHERE group_id = $1 AND (topic, partition) IN (SELECT * FROM unnest($2::text[], $3::int[]))",
    )
    .bind(group_id)
    .bind(&topics)
    .bind(&numbers)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows.into_iter().map(|(t, n, id)| ((t, n), id)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::embedded::EmbeddedPostgres;
    use std::str::FromStr;
    use std::time::Duration;

    fn partitions(n: i32) -> Vec<Partition> {
        (0..n).map(|p| ("orders".to_string(), p)).collect()
    }

    /// Partitions whose lock some session holds, as Postgres sees them.
    async fn locked_by_anyone(url: &str) -> usize {
        let mut conn = PgConnection::connect(url).await.unwrap();
        let locks = LockSpace::load(&mut conn).await.unwrap();
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = $1::oid AND objsubid = 2",
        )
        .bind(locks.partition as i64)
        .fetch_one(&mut conn)
        .await
        .unwrap() as usize
    }

    /// Steps every member until none changes, handing surplus over at once.
    async fn settle(members: &mut [&mut Leases], all: &[Partition]) {
        for _ in 0..4 {
            for m in members.iter_mut() {
                let change = m.step(all, &HashSet::new()).await.unwrap();
                m.give_up(&change.surplus).await.unwrap();
            }
        }
    }

    /// Members share a group's partitions evenly, never two of them one partition; a member
    /// whose session ends (a killed host) leaves its partitions to the others at the next
    /// step; a member whose session was lost while it lived takes back only what is free.
    #[tokio::test]
    async fn members_share_partitions_and_take_over_a_dead_members_at_once() {
        let pg = EmbeddedPostgres::start(&[]).unwrap();
        let url = pg.url("postgres");
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        crate::db::migrate(&pool).await.unwrap();
        let options = PgConnectOptions::from_str(&url).unwrap();
        let all = partitions(6);
        let (mut a, mut b, mut c) = (
            Leases::new(options.clone(), "svc.inventory"),
            Leases::new(options.clone(), "svc.inventory"),
            Leases::new(options.clone(), "svc.inventory"),
        );
        // A first member takes everything before the others join.
        let first = a.step(&all, &HashSet::new()).await.unwrap();
        assert_eq!(first.acquired.len(), 6);
        settle(&mut [&mut a, &mut b, &mut c], &all).await;
        assert_eq!((a.held().len(), b.held().len(), c.held().len()), (2, 2, 2));
        let union: BTreeSet<&Partition> = a.held().iter().chain(b.held()).chain(c.held()).collect();
        assert_eq!(union.len(), 6, "one owner per partition");
        assert_eq!(locked_by_anyone(&url).await, 6);

        // Another group is counted apart: its one member takes all of its partitions.
        let mut other = Leases::new(options.clone(), "svc.payments");
        assert_eq!(other.step(&all, &HashSet::new()).await.unwrap().acquired.len(), 6);

        // C dies: its session ends, and A and B take its two partitions in their next steps.
        c.close().await;
        let mut taken = 0;
        for _ in 0..50 {
            taken += a.step(&all, &HashSet::new()).await.unwrap().acquired.len();
            taken += b.step(&all, &HashSet::new()).await.unwrap().acquired.len();
            if taken == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!((a.held().len(), b.held().len()), (3, 3));

        // A's session is lost while A lives; B takes A's partitions in the meantime.
        a.reset();
        tokio::time::sleep(Duration::from_millis(200)).await;
        settle(&mut [&mut b], &all).await;
        assert_eq!(b.held().len(), 6);
        let back = a.step(&all, &HashSet::new()).await.unwrap();
        assert_eq!(back.lost.len(), 3, "A must stop reading what B now holds");
        assert!(a.held().is_empty());
        settle(&mut [&mut a, &mut b], &all).await;
        assert_eq!((a.held().len(), b.held().len()), (3, 3));
        assert_eq!(locked_by_anyone(&url).await, 12, "6 of each group");
    }
}
