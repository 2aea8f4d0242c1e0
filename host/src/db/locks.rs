//! The host's advisory-lock classes: the first key of the two-key form, derived from the
//! installation's random `lock_space` so that no plugin can know them in advance.
//!
//! * relay shards, and relay membership (`outbox::relay`);
//! * consumer partition leases, and consumer group membership (`inbox::lease`).
//!
//! `pg_locks` is readable by every session, so a plugin that got SQL past the policy could
//! still see these classes and take their locks (holding up publishing or consumption for
//! everyone, or shrinking every member's fair share): [`LockSpace::evict_intruders`] ends any
//! plugin session that holds one.

use anyhow::{Context, Result};
use sqlx::PgConnection;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockSpace {
    /// A relay shard's lease: the second key is the shard.
    pub shard: i32,
    /// A relay's membership: the second key is random, one per relay.
    pub member: i32,
    /// A consumer's partition lease: the second key is the `obx.consumer_partition` id.
    pub partition: i32,
    /// A consumer's group membership, held shared: the second key is the
    /// `obx.consumer_group` id.
    pub group: i32,
}

impl LockSpace {
    /// The four classes of `space`. They differ in at least one bit each, and stay
    /// non-negative (`pg_locks` shows the first key as an oid).
    pub const fn of(space: i32) -> LockSpace {
        let shard = space & 0x7fff_fffe;
        let partition = (space ^ 0x5555_5554) & 0x7fff_fffe;
        LockSpace {
            shard,
            member: shard | 1,
            partition,
            group: partition | 1,
        }
    }

    pub async fn load(conn: &mut PgConnection) -> Result<LockSpace> {
        let space: i32 = sqlx::query_scalar("SELECT lock_space FROM obx.installation")
            .fetch_one(conn)
            .await
            .context("reading the installation's lock space")?;
        Ok(LockSpace::of(space))
    }

    /// Terminates each plugin session (see [`super::terminate_plugin_holders`]) that holds a
    /// lock in one of the host's classes.
    pub async fn evict_intruders(&self, conn: &mut PgConnection) -> Result<()> {
        let classes = [self.shard, self.member, self.partition, self.group].map(i64::from);
        let lock = "l.classid::int8 = ANY($1)";
        for role in super::terminate_plugin_holders(conn, lock, &classes[..]).await? {
            tracing::warn!(role, "a plugin session held one of the host's locks; it was terminated");
            metrics::counter!("obx_relay_intruders_evicted_total").increment(1);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_classes_never_meet() {
        for space in [0, 1, -1, i32::MAX, i32::MIN, 0x5555_5554, 0x2aaa_aaab, 0x6f62_7800] {
            let l = LockSpace::of(space);
            let all = [l.shard, l.member, l.partition, l.group];
            for (i, a) in all.iter().enumerate() {
                assert!(*a >= 0, "{space:#x}: {all:?}");
                assert!(all[i + 1..].iter().all(|b| b != a), "{space:#x}: {all:?}");
            }
        }
    }
}
