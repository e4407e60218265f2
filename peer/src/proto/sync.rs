//! Availability sync: the publisher (our side) and the per-peer receiver.
//!
//! Both are plain state machines: no I/O, no clock (callers pass `now`).
//!
//! The publisher numbers batches of local changes with a sequence number
//! under a random per-process `epoch`. A subscriber first gets a snapshot
//! taken at `(epoch, seq)`, then every delta `seq + 1, seq + 2, ...` in
//! order. A receiver that sees another epoch, a gap, or a delta before any
//! snapshot asks for a fresh snapshot ([`Message::Resync`]) and ignores
//! deltas until it begins. Applying is idempotent (add = insert,
//! remove = delete), so a snapshot that already reflects a later change is
//! harmless.

use std::time::{Duration, Instant};

use super::msg::{Message, Op};
use crate::id::PeerChunkId;

/// Most ops in one delta (keeps a delta frame far below the frame limit).
pub const MAX_DELTA_OPS: usize = 65_536;
/// Most entries in one snapshot part.
pub const SNAPSHOT_PART_ENTRIES: usize = 65_536;

/// Batches local availability changes into numbered deltas.
#[derive(Debug)]
pub struct Publisher {
    epoch: u64,
    seq: u64,
    pending: Vec<Op>,
    first_pending: Option<Instant>,
    max_batch: usize,
    max_delay: Duration,
}

impl Publisher {
    /// A publisher with a (random) `epoch`, flushing a batch when it holds
    /// `max_batch` changes or its oldest change is `max_delay` old.
    pub fn new(epoch: u64, max_batch: usize, max_delay: Duration) -> Self {
        Self {
            epoch,
            seq: 0,
            pending: Vec::new(),
            first_pending: None,
            max_batch: max_batch.clamp(1, MAX_DELTA_OPS),
            max_delay,
        }
    }

    /// This publisher's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Sequence number of the last delta produced.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Records that we now hold `id`.
    pub fn added(&mut self, id: PeerChunkId, len: u64, now: Instant) {
        self.push(Op::Add(id, len), now);
    }

    /// Records that we no longer hold `id`.
    pub fn removed(&mut self, id: PeerChunkId, now: Instant) {
        self.push(Op::Remove(id), now);
    }

    /// Records that our copy of `id` entered (`true`) or left its RAM.
    pub fn ram(&mut self, id: PeerChunkId, in_ram: bool, now: Instant) {
        self.push(Op::Ram(id, in_ram), now);
    }

    fn push(&mut self, op: Op, now: Instant) {
        self.first_pending.get_or_insert(now);
        self.pending.push(op);
    }

    /// Changes waiting for the next delta.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Whether the pending batch is full and should be flushed now.
    pub fn batch_full(&self) -> bool {
        self.pending.len() >= self.max_batch
    }

    /// When the pending batch must be flushed at the latest.
    pub fn deadline(&self) -> Option<Instant> {
        self.first_pending.map(|t| t + self.max_delay)
    }

    /// Returns the next delta if the batch is full or old enough.
    pub fn poll_delta(&mut self, now: Instant) -> Option<Message> {
        let due = self.deadline().is_some_and(|d| now >= d);
        if self.batch_full() || due {
            self.flush()
        } else {
            None
        }
    }

    /// Returns a delta with everything pending (up to [`MAX_DELTA_OPS`]),
    /// regardless of age; `None` if nothing is pending.
    pub fn flush(&mut self) -> Option<Message> {
        if self.pending.is_empty() {
            return None;
        }
        let ops: Vec<Op> = if self.pending.len() > MAX_DELTA_OPS {
            let rest = self.pending.split_off(MAX_DELTA_OPS);
            std::mem::replace(&mut self.pending, rest)
        } else {
            self.first_pending = None;
            std::mem::take(&mut self.pending)
        };
        self.seq += 1;
        Some(Message::Delta {
            epoch: self.epoch,
            seq: self.seq,
            ops,
        })
    }
}

/// Splits a snapshot taken at `(epoch, seq)` into frames: begin, parts, end.
pub fn snapshot_messages(
    epoch: u64,
    seq: u64,
    entries: Vec<(PeerChunkId, u64, bool)>,
) -> Vec<Message> {
    let mut out = Vec::with_capacity(2 + entries.len() / SNAPSHOT_PART_ENTRIES + 1);
    out.push(Message::SnapshotBegin {
        epoch,
        seq,
        total: entries.len() as u64,
    });
    let mut it = entries.into_iter().peekable();
    while it.peek().is_some() {
        let part: Vec<_> = it.by_ref().take(SNAPSHOT_PART_ENTRIES).collect();
        out.push(Message::SnapshotPart { entries: part });
    }
    out.push(Message::SnapshotEnd { seq });
    out
}

/// Where a receiver stands with one publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPhase {
    /// No usable snapshot; deltas are ignored until one begins.
    AwaitSnapshot {
        /// Whether we already asked for one (ask once per wait).
        requested: bool,
    },
    /// Receiving snapshot parts.
    InSnapshot {
        /// Publisher epoch.
        epoch: u64,
        /// Snapshot sequence number.
        seq: u64,
    },
    /// In sync up to `seq`.
    Synced {
        /// Publisher epoch.
        epoch: u64,
        /// Last applied sequence number.
        seq: u64,
    },
}

/// What the caller must do after feeding a message to [`RemoteSync`].
#[derive(Debug, PartialEq, Eq)]
pub enum SyncAction {
    /// Nothing.
    None,
    /// A snapshot begins: forget everything this peer was said to hold.
    Clear,
    /// Insert these entries (id, length, in RAM).
    Add(Vec<(PeerChunkId, u64, bool)>),
    /// Apply these ops in order.
    Apply(Vec<Op>),
    /// The snapshot is complete; the view is in sync.
    Synced,
    /// Send [`Message::Resync`] to the peer (its view here is stale).
    RequestResync,
}

/// Receiver side of the availability sync for one peer.
#[derive(Debug)]
pub struct RemoteSync {
    phase: SyncPhase,
    last_activity: Option<Instant>,
    gaps: u64,
}

impl Default for RemoteSync {
    fn default() -> Self {
        Self::new()
    }
}

impl RemoteSync {
    /// A receiver waiting for its first snapshot (which the publisher sends
    /// unasked after the hello).
    pub fn new() -> Self {
        Self {
            phase: SyncPhase::AwaitSnapshot { requested: true },
            last_activity: None,
            gaps: 0,
        }
    }

    /// Current phase.
    pub fn phase(&self) -> SyncPhase {
        self.phase
    }

    /// Whether the view is in sync.
    pub fn is_synced(&self) -> bool {
        matches!(self.phase, SyncPhase::Synced { .. })
    }

    /// When the last snapshot or delta was applied.
    pub fn last_activity(&self) -> Option<Instant> {
        self.last_activity
    }

    /// How many gaps or resets forced a new snapshot.
    pub fn gaps(&self) -> u64 {
        self.gaps
    }

    /// The connection was lost: wait for a new snapshot on the next one.
    pub fn reset(&mut self) {
        self.phase = SyncPhase::AwaitSnapshot { requested: true };
    }

    fn lost_track(&mut self) -> SyncAction {
        self.gaps += 1;
        match self.phase {
            SyncPhase::AwaitSnapshot { requested: true } => SyncAction::None,
            _ => {
                self.phase = SyncPhase::AwaitSnapshot { requested: true };
                SyncAction::RequestResync
            }
        }
    }

    /// Feeds one sync message (hello, ping and fetch messages are not sync
    /// messages and yield [`SyncAction::None`]).
    pub fn handle(&mut self, msg: Message, now: Instant) -> SyncAction {
        match msg {
            Message::SnapshotBegin { epoch, seq, .. } => {
                self.phase = SyncPhase::InSnapshot { epoch, seq };
                self.last_activity = Some(now);
                SyncAction::Clear
            }
            Message::SnapshotPart { entries } => match self.phase {
                SyncPhase::InSnapshot { .. } => {
                    self.last_activity = Some(now);
                    SyncAction::Add(entries)
                }
                _ => self.lost_track(),
            },
            Message::SnapshotEnd { seq } => match self.phase {
                SyncPhase::InSnapshot { epoch, seq: s } if s == seq => {
                    self.phase = SyncPhase::Synced { epoch, seq };
                    self.last_activity = Some(now);
                    SyncAction::Synced
                }
                _ => self.lost_track(),
            },
            Message::Delta { epoch, seq, ops } => match self.phase {
                SyncPhase::Synced { epoch: e, seq: s }
                    if e == epoch && seq == s.wrapping_add(1) =>
                {
                    self.phase = SyncPhase::Synced { epoch, seq };
                    self.last_activity = Some(now);
                    SyncAction::Apply(ops)
                }
                SyncPhase::Synced { epoch: e, seq: s } if e == epoch && seq <= s => {
                    // A duplicate of something already applied: harmless.
                    SyncAction::None
                }
                SyncPhase::AwaitSnapshot { requested: true } => SyncAction::None,
                _ => self.lost_track(),
            },
            _ => SyncAction::None,
        }
    }
}
