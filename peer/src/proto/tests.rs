//! Two and three protocol endpoints in memory under virtual time.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::frame;
use super::health::{Backoff, HealthConfig, PeerHealth, PeerState};
use super::msg::{Message, Op};
use super::sync::{Publisher, RemoteSync, SyncAction, snapshot_messages};
use crate::id::{PeerChunkId, PeerNamespace};

fn id(i: u32) -> PeerChunkId {
    let mut key = [0u8; 32];
    key[..4].copy_from_slice(&i.to_le_bytes());
    PeerChunkId {
        ns: PeerNamespace([1; 16]),
        key,
        group: 0,
    }
}

/// A publishing node: its true set and its publisher.
struct Pub {
    set: BTreeMap<PeerChunkId, u64>,
    publisher: Publisher,
}

impl Pub {
    fn new(epoch: u64) -> Self {
        Self {
            set: BTreeMap::new(),
            publisher: Publisher::new(epoch, 4, Duration::from_millis(5)),
        }
    }
    fn add(&mut self, i: u32, now: Instant) {
        self.set.insert(id(i), u64::from(i));
        self.publisher.added(id(i), u64::from(i), now);
    }
    fn remove(&mut self, i: u32, now: Instant) {
        self.set.remove(&id(i));
        self.publisher.removed(id(i), now);
    }
    /// Snapshot at the current point (pending flushed first, as the
    /// transport does), as encoded frames.
    fn snapshot(&mut self, wire: &mut Wire) {
        if let Some(d) = self.publisher.flush() {
            wire.send(&d);
        }
        let entries = self.set.iter().map(|(k, v)| (*k, *v, true)).collect();
        for m in snapshot_messages(self.publisher.epoch(), self.publisher.seq(), entries) {
            wire.send(&m);
        }
    }
}

/// A one-way in-memory link carrying encoded frames, with loss injection.
#[derive(Default)]
struct Wire {
    q: VecDeque<Vec<u8>>,
    drop_next: usize,
}

impl Wire {
    fn send(&mut self, m: &Message) {
        if self.drop_next > 0 {
            self.drop_next -= 1;
            return;
        }
        self.q.push_back(frame::encode(m));
    }
}

/// A subscriber's view of one publisher.
#[derive(Default)]
struct View {
    sync: RemoteSync,
    set: BTreeMap<PeerChunkId, u64>,
    resyncs_requested: usize,
}

impl View {
    fn deliver(&mut self, wire: &mut Wire, now: Instant) {
        while let Some(f) = wire.q.pop_front() {
            let (m, used) = frame::decode(&f).expect("frames decode");
            assert_eq!(used, f.len());
            match self.sync.handle(m, now) {
                SyncAction::Clear => self.set.clear(),
                SyncAction::Add(e) => self.set.extend(e.into_iter().map(|(k, v, _)| (k, v))),
                SyncAction::Apply(ops) => {
                    for op in ops {
                        match op {
                            Op::Add(k, v) => {
                                self.set.insert(k, v);
                            }
                            Op::Remove(k) => {
                                self.set.remove(&k);
                            }
                            Op::Ram(..) => {}
                        }
                    }
                }
                SyncAction::RequestResync => self.resyncs_requested += 1,
                SyncAction::Synced | SyncAction::None => {}
            }
        }
    }
}

fn tick(p: &mut Pub, wire: &mut Wire, now: Instant) {
    while let Some(d) = p.publisher.poll_delta(now) {
        wire.send(&d);
    }
}

#[test]
fn snapshot_then_deltas_converge() {
    let t0 = Instant::now();
    let mut a = Pub::new(11);
    let mut wire = Wire::default();
    let mut b = View::default();
    for i in 0..10 {
        a.add(i, t0);
    }
    a.snapshot(&mut wire);
    b.deliver(&mut wire, t0);
    assert!(b.sync.is_synced());
    assert_eq!(b.set, a.set);

    // A full batch (>= 4 changes) flushes at once; a smaller one waits for
    // max_delay.
    let mut now = t0;
    for i in 10..15 {
        a.add(i, now);
    }
    tick(&mut a, &mut wire, now);
    b.deliver(&mut wire, now);
    assert_eq!(b.set, a.set, "full batch sent at once");
    a.add(15, now);
    a.add(16, now);
    a.remove(3, now);
    tick(&mut a, &mut wire, now);
    b.deliver(&mut wire, now);
    assert_ne!(b.set, a.set, "small batch waits for the delay");
    now += Duration::from_millis(5);
    tick(&mut a, &mut wire, now);
    b.deliver(&mut wire, now);
    assert_eq!(b.set, a.set);
    assert_eq!(b.resyncs_requested, 0);
}

#[test]
fn gap_triggers_resnapshot() {
    let t0 = Instant::now();
    let mut a = Pub::new(5);
    let mut wire = Wire::default();
    let mut b = View::default();
    a.add(1, t0);
    a.snapshot(&mut wire);
    b.deliver(&mut wire, t0);
    // Lose one delta.
    for i in 2..6 {
        a.add(i, t0);
    }
    wire.drop_next = 1;
    tick(&mut a, &mut wire, t0);
    for i in 6..10 {
        a.add(i, t0);
    }
    tick(&mut a, &mut wire, t0);
    b.deliver(&mut wire, t0);
    assert_eq!(b.resyncs_requested, 1, "gap detected once");
    assert!(!b.sync.is_synced());
    // Later deltas while waiting are ignored, and do not re-request.
    a.remove(1, t0);
    if let Some(d) = a.publisher.flush() {
        wire.send(&d);
    }
    b.deliver(&mut wire, t0);
    assert_eq!(b.resyncs_requested, 1);
    // The publisher answers the resync with a snapshot.
    a.snapshot(&mut wire);
    b.deliver(&mut wire, t0);
    assert!(b.sync.is_synced());
    assert_eq!(b.set, a.set);
    assert_eq!(b.sync.gaps(), 1);
}

#[test]
fn publisher_restart_new_epoch_resyncs() {
    let t0 = Instant::now();
    let mut a = Pub::new(1);
    let mut wire = Wire::default();
    let mut b = View::default();
    a.add(1, t0);
    a.add(2, t0);
    a.snapshot(&mut wire);
    b.deliver(&mut wire, t0);
    // A restarts with a new epoch and only chunk 2 on disk; a delta from
    // the new epoch (without a snapshot) is a reset.
    let mut a2 = Pub::new(2);
    a2.add(2, t0);
    a2.add(3, t0);
    if let Some(d) = a2.publisher.flush() {
        wire.send(&d);
    }
    b.deliver(&mut wire, t0);
    assert_eq!(b.resyncs_requested, 1);
    a2.snapshot(&mut wire);
    b.deliver(&mut wire, t0);
    assert_eq!(b.set, a2.set);
    assert!(!b.set.contains_key(&id(1)));
}

#[test]
#[expect(
    clippy::needless_range_loop,
    reason = "from/to indices address a 3x3 mesh"
)]
fn three_nodes_full_mesh_converge() {
    let t0 = Instant::now();
    let mut pubs: Vec<Pub> = (0..3).map(|e| Pub::new(100 + e)).collect();
    // wires[from][to], views[to][from]
    let mut wires: Vec<Vec<Wire>> = (0..3)
        .map(|_| (0..3).map(|_| Wire::default()).collect())
        .collect();
    let mut views: Vec<Vec<View>> = (0..3)
        .map(|_| (0..3).map(|_| View::default()).collect())
        .collect();
    for (n, p) in pubs.iter_mut().enumerate() {
        for i in 0..5 {
            p.add(n as u32 * 1000 + i, t0);
        }
    }
    for from in 0..3 {
        for to in 0..3 {
            if from != to {
                pubs[from].snapshot(&mut wires[from][to]);
            }
        }
    }
    let mut now = t0;
    for step in 0..50u32 {
        now += Duration::from_millis(1);
        let n = (step % 3) as usize;
        pubs[n].add(n as u32 * 1000 + 100 + step, now);
        if step % 7 == 0 {
            pubs[n].remove(n as u32 * 1000 + step % 5, now);
        }
        for (from, p) in pubs.iter_mut().enumerate() {
            while let Some(d) = p.publisher.poll_delta(now) {
                for to in 0..3 {
                    if to != from {
                        wires[from][to].send(&d);
                    }
                }
            }
        }
        for to in 0..3 {
            for from in 0..3 {
                if to != from {
                    views[to][from].deliver(&mut wires[from][to], now);
                }
            }
        }
    }
    now += Duration::from_millis(10);
    for from in 0..3 {
        tick_all(&mut pubs[from], &mut wires[from], from, now);
    }
    for to in 0..3 {
        for from in 0..3 {
            if to != from {
                views[to][from].deliver(&mut wires[from][to], now);
                assert_eq!(views[to][from].set, pubs[from].set, "{to} sees {from}");
            }
        }
    }
}

fn tick_all(p: &mut Pub, wires: &mut [Wire], from: usize, now: Instant) {
    while let Some(d) = p.publisher.poll_delta(now) {
        for (to, w) in wires.iter_mut().enumerate() {
            if to != from {
                w.send(&d);
            }
        }
    }
}

fn cfg() -> HealthConfig {
    HealthConfig {
        ping_interval: Duration::from_millis(100),
        suspect_after: Duration::from_millis(300),
        down_after: Duration::from_millis(1000),
    }
}

#[test]
fn membership_transitions_under_virtual_time() {
    let t0 = Instant::now();
    let mut h = PeerHealth::new(cfg());
    assert_eq!(h.state(t0), PeerState::Down);
    h.on_connected(t0);
    assert_eq!(
        h.poll_transition(t0),
        Some((PeerState::Down, PeerState::Up))
    );
    let n = h.poll_ping(t0).expect("first ping due at once");
    assert_eq!(h.poll_ping(t0), None);
    let rtt = h.on_pong(n, t0 + Duration::from_millis(2));
    assert_eq!(rtt, Some(Duration::from_millis(2)));
    assert_eq!(
        h.on_pong(n, t0 + Duration::from_millis(3)),
        None,
        "stale pong"
    );
    // Silence: suspect after 300 ms, down after 1 s.
    let t = t0 + Duration::from_millis(305);
    assert_eq!(h.state(t), PeerState::Suspect);
    assert_eq!(
        h.poll_transition(t),
        Some((PeerState::Up, PeerState::Suspect))
    );
    assert!(h.next_timeout().expect("connected") <= t0 + Duration::from_millis(1005));
    let t = t0 + Duration::from_millis(1005);
    assert_eq!(h.state(t), PeerState::Down);
    assert_eq!(
        h.poll_transition(t),
        Some((PeerState::Suspect, PeerState::Down))
    );
    // Heard again: up.
    h.on_heard(t);
    assert_eq!(h.poll_transition(t), Some((PeerState::Down, PeerState::Up)));
    h.on_disconnected();
    assert_eq!(h.state(t), PeerState::Down);
    assert_eq!(h.poll_ping(t), None, "no pings while disconnected");
}

#[test]
fn backoff_grows_caps_and_resets() {
    let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let d: Vec<Duration> = (0..8).map(|_| b.next_delay(1.0)).collect();
    assert_eq!(d[0], Duration::from_millis(100));
    assert_eq!(d[1], Duration::from_millis(200));
    assert_eq!(d[4], Duration::from_millis(1600));
    assert_eq!(d[7], Duration::from_secs(2));
    let low = b.next_delay(0.0);
    assert_eq!(low, Duration::from_secs(1), "jitter keeps at least half");
    b.reset();
    assert_eq!(b.next_delay(0.0), Duration::from_millis(50));
}
