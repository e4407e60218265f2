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
//! cost falls in time it would spend polling), the sampling thread and
//! every poller included, against the CPUs this process may use: a thread
//! polls only while that count is at most the CPU count. Where the count
//! cannot be read (or reads 0, which no real kernel reports to a running
//! reader), nobody polls. Clients take their polling time from
//! [`CLIENT_SPIN_ENV`].

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Longest time a sample of the run queue is trusted.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// When the last sample was taken, in microseconds since [`epoch`] plus
/// one (0: never).
static SAMPLED_AT: AtomicU64 = AtomicU64::new(0);
/// What the last sample said.
static SPARE: AtomicBool = AtomicBool::new(false);

/// Environment variable a client reads for how long it polls for a
/// reply, in microseconds (at most 1,000; 0 never polls). The Rust
/// [`super::Client`] and the Python client read it; the daemon's own
/// polling is its `native-spin` setting.
pub const CLIENT_SPIN_ENV: &str = "KVTIER_CLIENT_SPIN_US";

/// A client's polling time: [`CLIENT_SPIN_ENV`] when set to a number of
/// microseconds (capped at 1 ms), else [`super::DEFAULT_SPIN`].
pub fn client_spin() -> Duration {
    client_spin_from(std::env::var(CLIENT_SPIN_ENV).ok().as_deref())
}

/// [`client_spin`] for a given value of the variable (unparsable values
/// fall back to the default).
pub fn client_spin_from(value: Option<&str>) -> Duration {
    value
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(super::DEFAULT_SPIN, |us| {
            Duration::from_micros(us.min(1_000))
        })
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Tests only: `Some(answer)` makes [`may_poll`] give that answer without
/// sampling (a test of the polling paths cannot depend on the load).
#[doc(hidden)]
pub fn force_for_tests(answer: Option<bool>) {
    FORCED.store(
        match answer {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        },
        Ordering::Relaxed,
    );
}

/// [`force_for_tests`]'s answer: 0 none, 1 no, 2 yes.
static FORCED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether a thread about to poll may: the last sample found a CPU to
/// spare, taking a new sample first when the last is older than
/// [`SAMPLE_EVERY`] (one thread takes it; the others use the last one).
pub fn may_poll() -> bool {
    match FORCED.load(Ordering::Relaxed) {
        1 => return false,
        2 => return true,
        _ => {}
    }
    let now = epoch().elapsed().as_micros() as u64 + 1;
    let last = SAMPLED_AT.load(Ordering::Relaxed);
    let stale = last == 0 || now.saturating_sub(last) >= SAMPLE_EVERY.as_micros() as u64;
    if stale
        && SAMPLED_AT
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let spare = read_runnable().is_some_and(|runnable| spare_cpu(runnable, cpus()));
        SPARE.store(spare, Ordering::Relaxed);
    }
    SPARE.load(Ordering::Relaxed)
}

/// Whether `runnable` threads system-wide (the sampling thread, about to
/// poll, and every other poller among them) fit on `cpus` CPUs. Zero is
/// no reading (the sampler itself runs).
pub fn spare_cpu(runnable: usize, cpus: usize) -> bool {
    runnable != 0 && runnable <= cpus
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
    fn spares_a_cpu_only_when_every_runnable_thread_has_one() {
        // 2 CPUs, idle: the sampler alone runs.
        assert!(spare_cpu(1, 2));
        // The other end runs too (processing the request).
        assert!(spare_cpu(2, 2));
        // One more runnable thread, ours (another poller) or not: no.
        assert!(!spare_cpu(3, 2));
        assert!(spare_cpu(16, 16));
        assert!(!spare_cpu(17, 16));
        // Zero is no reading: the sampler itself is runnable.
        assert!(!spare_cpu(0, 2));
    }

    #[test]
    fn client_spin_reads_microseconds_and_caps_them() {
        assert_eq!(client_spin_from(None), crate::native::DEFAULT_SPIN);
        assert_eq!(client_spin_from(Some("0")), Duration::ZERO);
        assert_eq!(client_spin_from(Some(" 20 ")), Duration::from_micros(20));
        assert_eq!(client_spin_from(Some("5000")), Duration::from_millis(1));
        assert_eq!(client_spin_from(Some("x")), crate::native::DEFAULT_SPIN);
        assert_eq!(client_spin_from(Some("-1")), crate::native::DEFAULT_SPIN);
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
