//! CPU time spent while a suite runs: this process's (the host runs in it), and every
//! CPU's, so a run can say what a command cost in CPU as well as how many ran. On a machine
//! whose disk or neighbours move the rate from run to run, the CPU per command moves less.

use std::time::Duration;

/// CPU time used so far: by this process, and by every CPU (busy time, not idle or I/O wait).
#[derive(Clone, Copy)]
pub struct Cpu {
    process: Duration,
    machine: Duration,
}

/// CPU used between two readings, per command, in microseconds.
#[derive(Clone, Copy)]
pub struct PerCommand {
    pub host: f64,
    pub machine: f64,
}

impl Cpu {
    pub fn now() -> Cpu {
        Cpu {
            process: process_time(),
            machine: machine_busy_time(),
        }
    }

    /// What `commands` cost since `self`, per command.
    pub fn per_command(&self, commands: u64) -> PerCommand {
        let now = Cpu::now();
        let per = |d: Duration| d.as_secs_f64() * 1e6 / commands.max(1) as f64;
        PerCommand {
            host: per(now.process.saturating_sub(self.process)),
            machine: per(now.machine.saturating_sub(self.machine)),
        }
    }
}

/// User and system time of this process (all its threads).
fn process_time() -> Duration {
    // SAFETY: `getrusage` writes into the zeroed struct it is given, and nothing else.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
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
    // SAFETY: `sysconf` has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_micros(ticks * 1_000_000 / hz)
}
