//! How many HTTP connections the process's open-files limit leaves room for.
//!
//! Each connection is a descriptor, and so is each Postgres session, each Kafka socket, each
//! plugin file the watcher reads and each log. With the usual soft limit of 1,024 and the
//! default `http.max_connections` of 1,024, idle peers could take every descriptor, and the
//! host could then open no Postgres session (`EMFILE`). At start the soft limit is raised to
//! the hard limit (what the process may do without privileges), and the connections are
//! capped below it, leaving a reserve.

/// Descriptors kept for everything but HTTP connections, beyond the host's own pool: plugin
/// sessions, Kafka's sockets and wake-up pipes, plugin files, logs.
const RESERVE: u64 = 512;

/// Raises the open-files soft limit to the hard limit, and returns how many HTTP connections
/// fit below it: `wanted` (`http.max_connections`), or fewer, with a warning.
pub fn connection_cap(wanted: usize, pool: u32) -> usize {
    let Some(limit) = raise_open_files_limit() else {
        return wanted;
    };
    let cap = cap_below(wanted, limit, RESERVE + u64::from(pool));
    if cap < wanted {
        tracing::warn!(
            wanted,
            cap,
            open_files_limit = limit,
            "http.max_connections is more than the open-files limit leaves room for, beside Postgres \
             and Kafka; it is lowered (raise the hard limit, e.g. LimitNOFILE= in a systemd unit)"
        );
    }
    cap
}

/// The connections that fit under an open-files `limit`, keeping `reserve` descriptors (or,
/// under a small limit, three quarters of it) for the rest.
fn cap_below(wanted: usize, limit: u64, reserve: u64) -> usize {
    let room = limit.saturating_sub(reserve).max(limit / 4);
    wanted.min(usize::try_from(room).unwrap_or(usize::MAX)).max(1)
}

/// Sets the soft open-files limit to the hard one; returns the limit now in force, or `None`
/// if it could not be read (or is unlimited).
fn raise_open_files_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write only the struct given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    (limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::cap_below;

    #[test]
    fn connections_fit_under_the_open_files_limit_with_a_reserve() {
        // A generous limit: as configured.
        assert_eq!(cap_below(1024, 524_288, 528), 1024);
        // The usual soft limit, not raised (a hard limit of 1,024): the reserve is kept.
        assert_eq!(cap_below(1024, 1024, 528), 496);
        // A small limit: a quarter of it still serves.
        assert_eq!(cap_below(1024, 600, 528), 150);
        assert_eq!(cap_below(1024, 0, 528), 1);
        assert_eq!(cap_below(64, 1024, 528), 64);
    }
}
