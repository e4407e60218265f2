//! When polling for the other end pays: the gate in front of
//! [`super::NativeOptions::spin`] and [`super::Client::set_spin`].
//!
//! Polling a socket instead of sleeping on it saves a thread wake-up, and
//! a wake-up is only expensive on a CPU that had nothing to do: a virtual
//! machine's idle CPU halts, and waking it costs tens of microseconds (a
//! round trip of two wake-ups measured 70 µs on the 2-core build machine
//! when idle, 5 µs when both ends polled). On a loaded machine the CPUs
//! never halt, wake-ups cost a few microseconds, and a poller only takes
//! a core from work that needs it (a round trip measured 24 µs blocking,
//! 42–96 µs polling, beside two busy loops; `docs/benchmarks.md`, session
//! 21). So a thread polls only while the system has a CPU to spare.
//!
//! "To spare" is read from the kernel's count of runnable threads (the
//! fourth field of `/proc/loadavg`, sampled at most every
//! [`SAMPLE_EVERY`] by whichever thread is about to poll, so the sample's
//! cost falls in time it would spend polling), minus the reader and this
//! process's own pollers, against the CPUs this process may run on. Where
//! the count cannot be read, nobody polls.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Longest time a sample of the run queue is trusted.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// When the last sample was taken, in microseconds since [`epoch`] plus
/// one (0: never).
static SAMPLED_AT: AtomicU64 = AtomicU64::new(0);
/// What the last sample said.
static SPARE: AtomicBool = AtomicBool::new(false);
/// Threads of this process polling right now.
static POLLING: AtomicUsize = AtomicUsize::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Whether a thread about to poll may: the last sample found a CPU to
/// spare, taking a new sample first when the last is older than
/// [`SAMPLE_EVERY`] (one thread takes it; the others use the last one).
pub fn may_poll() -> bool {
    let now = epoch().elapsed().as_micros() as u64 + 1;
    let last = SAMPLED_AT.load(Ordering::Relaxed);
    let stale = last == 0 || now.saturating_sub(last) >= SAMPLE_EVERY.as_micros() as u64;
    if stale
        && SAMPLED_AT
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let spare = read_runnable()
            .is_some_and(|runnable| spare_cpu(runnable, POLLING.load(Ordering::Relaxed), cpus()));
        SPARE.store(spare, Ordering::Relaxed);
    }
    SPARE.load(Ordering::Relaxed)
}

/// Whether `runnable` threads system-wide (the sampling thread and
/// `ours` pollers of this process among them) leave a CPU of `cpus` to
/// spare for one more poller.
pub fn spare_cpu(runnable: usize, ours: usize, cpus: usize) -> bool {
    let others = runnable.saturating_sub(1 + ours);
    others < cpus
}

/// Runnable threads system-wide (`/proc/loadavg`'s fourth field, before
/// the slash); `None` where it cannot be read.
fn read_runnable() -> Option<usize> {
    parse_runnable(&std::fs::read_to_string("/proc/loadavg").ok()?)
}

/// The count of runnable threads in a `/proc/loadavg` line
/// (`"0.05 0.10 0.20 3/412 9876"` → 3).
pub fn parse_runnable(loadavg: &str) -> Option<usize> {
    let field = loadavg.split_ascii_whitespace().nth(3)?;
    let (running, total) = field.split_once('/')?;
    total.parse::<usize>().ok()?;
    running.parse().ok()
}

/// Counts this thread among the process's pollers while it lives.
pub struct Polling(());

impl Polling {
    /// Starts counting.
    pub fn start() -> Self {
        POLLING.fetch_add(1, Ordering::Relaxed);
        Self(())
    }
}

impl Drop for Polling {
    fn drop(&mut self) {
        POLLING.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_runnable_count() {
        assert_eq!(parse_runnable("0.05 0.10 0.20 3/412 9876\n"), Some(3));
        assert_eq!(parse_runnable("1.50 0.60 0.22 12/92 2015"), Some(12));
        assert_eq!(parse_runnable("0.05 0.10 0.20"), None);
        assert_eq!(parse_runnable("0.05 0.10 0.20 3 9876"), None);
        assert_eq!(parse_runnable("0.05 0.10 0.20 x/412 9876"), None);
        assert_eq!(parse_runnable("0.05 0.10 0.20 3/y 9876"), None);
        assert_eq!(parse_runnable(""), None);
    }

    #[test]
    fn spares_a_cpu_only_when_others_leave_one() {
        // 2 CPUs, idle: the sampler alone runs.
        assert!(spare_cpu(1, 0, 2));
        // The other end polls too (another process): one CPU left.
        assert!(spare_cpu(2, 0, 2));
        // Two busy threads elsewhere take both CPUs.
        assert!(!spare_cpu(3, 0, 2));
        // Our own pollers do not count against us.
        assert!(spare_cpu(3, 2, 2));
        assert!(!spare_cpu(4, 1, 2));
        // A count below the sampler itself (a racy read) spares.
        assert!(spare_cpu(0, 3, 1));
    }

    #[test]
    fn samples_this_machine() {
        // On Linux the count is readable, and the answer is a boolean
        // either way; a second call within the interval reuses it.
        assert!(read_runnable().is_some(), "/proc/loadavg unreadable");
        let first = may_poll();
        let at = SAMPLED_AT.load(Ordering::Relaxed);
        assert_ne!(at, 0, "no sample was taken");
        let again = may_poll();
        if SAMPLED_AT.load(Ordering::Relaxed) == at {
            assert_eq!(first, again);
        }
    }
}
