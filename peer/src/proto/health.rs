//! Membership of one peer: liveness from pings, RTT, state thresholds, and
//! the reconnect backoff. No I/O, no clock: callers pass `now`.

use std::time::{Duration, Instant};

/// A peer's state as seen from here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PeerState {
    /// Connected and heard from recently; its entries are offered.
    Up,
    /// Connected but silent for longer than `suspect_after`; still offered,
    /// ranked after up peers.
    Suspect,
    /// Not connected, or silent for longer than `down_after`; never offered.
    Down,
}

impl PeerState {
    /// Lower-case name (`up`, `suspect`, `down`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Up => "up",
            Self::Suspect => "suspect",
            Self::Down => "down",
        }
    }
}

/// Liveness thresholds.
#[derive(Debug, Clone, Copy)]
pub struct HealthConfig {
    /// How often a ping goes out.
    pub ping_interval: Duration,
    /// Silence after which the peer is suspect.
    pub suspect_after: Duration,
    /// Silence after which the peer is down (and its connection dropped).
    pub down_after: Duration,
}

/// Liveness tracker for one peer.
#[derive(Debug)]
pub struct PeerHealth {
    cfg: HealthConfig,
    connected: bool,
    last_heard: Option<Instant>,
    next_ping: Option<Instant>,
    pending: Option<(u64, Instant)>,
    nonce: u64,
    srtt: Option<Duration>,
    reported: PeerState,
}

impl PeerHealth {
    /// A tracker for a peer not connected yet (state down).
    pub fn new(cfg: HealthConfig) -> Self {
        Self {
            cfg,
            connected: false,
            last_heard: None,
            next_ping: None,
            pending: None,
            nonce: 0,
            srtt: None,
            reported: PeerState::Down,
        }
    }

    /// The connection (and hello exchange) succeeded.
    pub fn on_connected(&mut self, now: Instant) {
        self.connected = true;
        self.last_heard = Some(now);
        self.next_ping = Some(now);
        self.pending = None;
    }

    /// The connection is gone.
    pub fn on_disconnected(&mut self) {
        self.connected = false;
        self.next_ping = None;
        self.pending = None;
    }

    /// Any message arrived from the peer.
    pub fn on_heard(&mut self, now: Instant) {
        self.last_heard = Some(now);
    }

    /// A pong arrived; returns the RTT sample if it answers the last ping.
    pub fn on_pong(&mut self, nonce: u64, now: Instant) -> Option<Duration> {
        self.on_heard(now);
        match self.pending {
            Some((n, sent)) if n == nonce => {
                self.pending = None;
                let sample = now.saturating_duration_since(sent);
                self.srtt = Some(match self.srtt {
                    None => sample,
                    Some(s) => (s * 7 + sample) / 8,
                });
                Some(sample)
            }
            _ => None,
        }
    }

    /// Returns a nonce to send in a ping if one is due.
    pub fn poll_ping(&mut self, now: Instant) -> Option<u64> {
        let due = self.next_ping.is_some_and(|t| now >= t);
        if !self.connected || !due {
            return None;
        }
        self.nonce = self.nonce.wrapping_add(1);
        self.pending = Some((self.nonce, now));
        self.next_ping = Some(now + self.cfg.ping_interval);
        Some(self.nonce)
    }

    /// Smoothed RTT from ping/pong, if measured.
    pub fn rtt(&self) -> Option<Duration> {
        self.srtt
    }

    /// Time since the peer was last heard from.
    pub fn silence(&self, now: Instant) -> Option<Duration> {
        self.last_heard.map(|t| now.saturating_duration_since(t))
    }

    /// State at `now`.
    pub fn state(&self, now: Instant) -> PeerState {
        if !self.connected {
            return PeerState::Down;
        }
        match self.silence(now) {
            Some(s) if s >= self.cfg.down_after => PeerState::Down,
            Some(s) if s >= self.cfg.suspect_after => PeerState::Suspect,
            _ => PeerState::Up,
        }
    }

    /// Returns `(old, new)` when the state changed since the last call.
    pub fn poll_transition(&mut self, now: Instant) -> Option<(PeerState, PeerState)> {
        let s = self.state(now);
        if s == self.reported {
            return None;
        }
        let old = std::mem::replace(&mut self.reported, s);
        Some((old, s))
    }

    /// The next instant at which something may change (a ping is due or a
    /// threshold passes); `None` when not connected.
    pub fn next_timeout(&self) -> Option<Instant> {
        if !self.connected {
            return None;
        }
        let heard = self.last_heard?;
        let mut t = heard + self.cfg.down_after;
        let suspect = heard + self.cfg.suspect_after;
        if self.reported == PeerState::Up {
            t = t.min(suspect);
        }
        if let Some(p) = self.next_ping {
            t = t.min(p);
        }
        Some(t)
    }
}

/// Exponential backoff with jitter for reconnects.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    /// Delays start at `base` and double up to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max,
            attempt: 0,
        }
    }

    /// The delay before the next attempt; `jitter` in `[0, 1)` (from the
    /// caller's RNG) picks a point in the upper half of the window.
    pub fn next_delay(&mut self, jitter: f64) -> Duration {
        let exp = self.base.saturating_mul(1u32 << self.attempt.min(20));
        let cap = exp.min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        cap.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
    }

    /// Attempts since the last success.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// A connection succeeded: start from `base` again.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}
