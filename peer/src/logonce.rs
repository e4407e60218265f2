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

/// `reason` with each run of ASCII digits as one `#`: the same reason when
/// its text carries a time or a count that changes at every attempt (QA:
/// an expired certificate's "19 seconds ago" made every refusal a new
/// reason, logged at warn every 2 s).
pub(crate) fn shape(reason: &str) -> String {
    let mut out = String::with_capacity(reason.len());
    let mut in_digits = false;
    for c in reason.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('#');
            }
            in_digits = true;
        } else {
            out.push(c);
            in_digits = false;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn reasons_that_differ_in_numbers_only_have_one_shape() {
        assert_eq!(
            super::shape("expired 19 seconds ago (at 1796583062)"),
            super::shape("expired 21 seconds ago (at 1796583064)")
        );
        assert_ne!(super::shape("BadSignature"), super::shape("UnknownIssuer"));
    }

    #[test]
    fn a_reason_is_warned_once_then_quiet() {
        assert!(super::warn_now("test: a".into()));
        assert!(!super::warn_now("test: a".into()));
        assert!(super::warn_now("test: b".into()));
    }
}
