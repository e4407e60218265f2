//! Rate limits for log lines that a misconfigured peer repeats at every
//! reconnect attempt (a refused certificate, a failed handshake): the first
//! line for a reason goes out at warn, repeats within [`REPEAT_AFTER`] at
//! debug.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a reason stays quiet at warn after it was logged.
pub const REPEAT_AFTER: Duration = Duration::from_secs(600);
/// Reasons remembered at once; past it the memory starts over.
const MAX_REASONS: usize = 1024;

/// Whether a line for `reason` should go out at warn now (the first time,
/// or [`REPEAT_AFTER`] after the last time it did).
pub(crate) fn warn_now(reason: String) -> bool {
    static SEEN: OnceLock<Mutex<HashMap<String, Instant>>> = OnceLock::new();
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    if let Some(last) = seen.get(&reason) {
        if now.duration_since(*last) < REPEAT_AFTER {
            return false;
        }
    }
    if seen.len() >= MAX_REASONS {
        seen.clear();
    }
    seen.insert(reason, now);
    true
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_reason_is_warned_once_then_quiet() {
        assert!(super::warn_now("test: a".into()));
        assert!(!super::warn_now("test: a".into()));
        assert!(super::warn_now("test: b".into()));
    }
}
