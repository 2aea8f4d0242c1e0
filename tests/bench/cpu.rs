//! CPU time spent while a suite runs: this process's (the host runs in it), the Postgres
//! server's, the load generator's (wrk or pgbench, this process's children) and every CPU's,
//! so a run can say what a command cost in CPU as well as how many ran, and where. On a
//! machine whose disk or neighbours move the rate from run to run, the CPU per command moves
//! less.

use std::time::Duration;

/// CPU time used so far: by this process, by the Postgres server, by this process's children
/// that have ended, and by every CPU (busy time, not idle or I/O wait).
#[derive(Clone, Copy)]
pub struct Cpu {
    process: Duration,
    postgres: Duration,
    children: Duration,
    machine: Duration,
}

/// CPU used between two readings, per command, in microseconds.
#[derive(Clone, Copy)]
pub struct PerCommand {
    pub host: f64,
    /// The Postgres server this process started: its backends and its own processes, and
    /// the backends that ended in between.
    pub postgres: f64,
    /// Children of this process that ended in between: the load generator, run to its end.
    /// A Postgres server of this process that stops in between lands here too (its whole
    /// life), so a window that restarts the server says nothing of its load generator.
    pub load: f64,
    pub machine: f64,
}

impl Cpu {
    pub fn now() -> Cpu {
        Cpu {
            process: rusage_time(libc::RUSAGE_SELF),
            postgres: postgres_time(),
            children: rusage_time(libc::RUSAGE_CHILDREN),
            machine: machine_busy_time(),
        }
    }

    /// What `commands` cost since `self`, per command.
    pub fn per_command(&self, commands: u64) -> PerCommand {
        let now = Cpu::now();
        let per = |d: Duration| d.as_secs_f64() * 1e6 / commands.max(1) as f64;
        PerCommand {
            host: per(now.process.saturating_sub(self.process)),
            postgres: per(now.postgres.saturating_sub(self.postgres)),
            load: per(now.children.saturating_sub(self.children)),
            machine: per(now.machine.saturating_sub(self.machine)),
        }
    }
}

/// User and system time of this process (all its threads), or of its children that have
/// ended and been waited for.
fn rusage_time(who: libc::c_int) -> Duration {
    // SAFETY: `getrusage` writes into the zeroed struct it is given, and nothing else.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut usage);
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// User and system time of the Postgres server this process started (a `postgres` child of
/// this process, and the `postgres` processes that are its children), with what its ended
/// children used: the postmaster's ended children are the backends that have gone. From
/// `/proc`; another server on the machine (a system one, a test run's) is not counted.
fn postgres_time() -> Duration {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Duration::ZERO;
    };
    let processes: Vec<Postgres> = dir
        .flatten()
        .filter_map(|entry| std::fs::read_to_string(entry.path().join("stat")).ok())
        .filter_map(|stat| postgres_process(&stat))
        .collect();
    from_ticks(server_ticks(&processes, std::process::id()))
}

/// One `postgres` process, from its `/proc/<pid>/stat`.
#[derive(Debug, PartialEq)]
struct Postgres {
    pid: u32,
    parent: u32,
    /// User and system ticks, with its ended children's.
    ticks: u64,
}

/// The `postgres` process a `/proc/<pid>/stat` line describes, if it is one.
fn postgres_process(stat: &str) -> Option<Postgres> {
    // `pid (comm) state ppid …`: the name may hold spaces and parentheses, so fields count
    // from its last `)`. After it, the parent is the 2nd, and utime, stime, cutime and
    // cstime are the 12th to 15th.
    let (head, rest) = stat.rsplit_once(')')?;
    let pid = head.strip_suffix(" (postgres")?.trim().parse().ok()?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let parent = fields.get(1)?.parse().ok()?;
    let ticks = fields.get(11..15)?.iter().filter_map(|v| v.parse::<u64>().ok()).sum();
    Some(Postgres { pid, parent, ticks })
}

/// Ticks of the servers whose postmaster is a child of `me`, and of their processes.
fn server_ticks(processes: &[Postgres], me: u32) -> u64 {
    let postmasters: Vec<u32> = processes.iter().filter(|p| p.parent == me).map(|p| p.pid).collect();
    processes
        .iter()
        .filter(|p| p.parent == me || postmasters.contains(&p.parent))
        .map(|p| p.ticks)
        .sum()
}

/// Clock ticks (`/proc`'s unit) as a duration.
fn from_ticks(ticks: u64) -> Duration {
    // SAFETY: `sysconf` has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_micros(ticks * 1_000_000 / hz)
}

/// Busy time of every CPU since boot, from `/proc/stat` (zero where there is none).
fn machine_busy_time() -> Duration {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return Duration::ZERO;
    };
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return Duration::ZERO;
    };
    // user nice system idle iowait irq softirq steal ...: all but idle and iowait.
    let ticks: u64 = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .filter_map(|(_, v)| v.parse::<u64>().ok())
        .sum();
    from_ticks(ticks)
}

#[cfg(test)]
mod tests {
    use super::{postgres_process, server_ticks, Postgres};

    #[test]
    fn a_postgres_process_is_counted_with_its_ended_children() {
        // utime 120, stime 30, cutime 1000, cstime 200 (the postmaster's ended backends).
        let postmaster = "4242 (postgres) S 10 4242 4242 0 -1 4194560 900 7 0 0 120 30 1000 200 20 0 1 0";
        let backend = "4300 (postgres) S 4242 4242 4242 0 -1 0 0 0 0 0 70 10 0 0 20 0 1 0";
        let elsewhere = "500 (postgres) S 1 500 500 0 -1 0 0 0 0 0 9000 900 0 0 20 0 1 0";
        let parsed: Vec<Postgres> = [postmaster, backend, elsewhere]
            .iter()
            .map(|s| postgres_process(s).expect("a postgres process"))
            .collect();
        assert_eq!(
            parsed[0],
            Postgres {
                pid: 4242,
                parent: 10,
                ticks: 1350
            }
        );
        // The server started by process 10, not the one started by init.
        assert_eq!(server_ticks(&parsed, 10), 1350 + 80);
        let named_with_spaces = "77 (a (postgres) x) R 1 77 77 0 -1 0 0 0 0 0 5 5 0 0 20 0 1 0";
        assert_eq!(postgres_process(named_with_spaces), None);
        assert_eq!(
            postgres_process("99 (wrk) S 1 99 99 0 -1 0 0 0 0 0 500 100 0 0 20 0 1 0"),
            None
        );
        assert_eq!(postgres_process("garbage"), None);
    }
}
