"""kvtier chaos driver: parent controls one daemon (start / kill -9 / SIGTERM), N worker processes
run random ops on disjoint key sets and check every read against their model.

usage: chaos.py RUN_DIR --workers N --epochs E --seed S --port P -- <daemon args...>
"""
import argparse, json, multiprocessing as mp, os, random, signal, sys, time, traceback
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qalib import *  # noqa

MISS = ("miss",)
MEMBER_OPS = True


def V(v):
    return ("v", v)


class Key:
    __slots__ = ("kid", "ns", "group", "key", "versions", "hist", "floor", "floor_kind", "latest", "set")

    def __init__(self, kid, ns, group, key, aset=None):
        self.kid, self.ns, self.group, self.key, self.set = kid, ns, group, key, aset
        self.versions = {}  # version -> (length, txn)
        self.hist = []  # (seq, state, ack_mono or None, txn)
        self.floor = MISS  # state that must be reachable after a crash
        self.floor_kind = "initial"
        self.latest = {MISS}  # in-session acceptable states (miss always acceptable in-session)

    def since_floor(self):
        return [h for h in self.hist if h[0] > self.floor_seq] if hasattr(self, "floor_seq") else self.hist


class Worker:
    def __init__(self, wid, conn, flushing, rundir, seed, n_plain=120, n_sets=12):
        self.wid, self.conn, self.flushing = wid, conn, flushing
        self.rng = random.Random(seed * 1000 + wid)
        self.log = open(os.path.join(rundir, f"worker-{wid}.log"), "a", buffering=1)
        self.trace = open(os.path.join(rundir, f"worker-{wid}.trace"), "a", buffering=1)
        self.seq = 0
        self.version = 0
        self.txn = 0
        self.txns = {}  # txn -> [(kid, version, seq)]
        self.keys = []
        self.floor_seq = {}
        for i in range(n_plain):
            k = Key(len(self.keys), i % 2, (i // 2) % 2, key32(f"w{wid}-p{i // 4}"))
            self.keys.append(k)
        self.sets = []
        for s in range(n_sets):
            size = self.rng.randint(2, 5)
            ns, g = self.rng.randint(0, 1), self.rng.randint(0, 1)
            members = []
            for m in range(size):
                k = Key(len(self.keys), ns, g, key32(f"w{wid}-a{s}-{m}"), aset=s)
                self.keys.append(k)
                members.append(k)
            self.sets.append(members)
        for k in self.keys:
            self.floor_seq[k.kid] = 0
        self.ops = 0
        import collections
        self.cnt = collections.Counter()
        self.viol = 0
        self.soft = 0
        self.c = None
        self.nsids = None
        self.reclaim_seen = False
        self.epoch = 0
        self.heavy = False

    # ---------------------------------------------------------------- logging
    def V(self, kind, msg, **kw):
        self.viol += 1
        rec = {"t": time.time(), "epoch": self.epoch, "severity": "VIOLATION", "kind": kind, "msg": msg, **kw}
        self.log.write(json.dumps(rec, default=str) + "\n")

    def S(self, kind, msg, **kw):
        self.soft += 1
        rec = {"t": time.time(), "epoch": self.epoch, "severity": "suspicious", "kind": kind, "msg": msg, **kw}
        self.log.write(json.dumps(rec, default=str) + "\n")

    def T(self, s):
        self.trace.write(f"{time.monotonic():.4f} e{self.epoch} {s}\n")

    def keyhist(self, k):
        return {"kid": k.kid, "ns": k.ns, "group": k.group, "key": k.key.hex()[:16], "set": k.set,
                "floor": k.floor, "floor_kind": k.floor_kind, "floor_seq": self.floor_seq[k.kid],
                "hist": [(s, st, None if a is None else round(a, 4), t) for s, st, a, t in k.hist[-12:]]}

    # ---------------------------------------------------------------- payloads
    def new_put(self, k, length, txn=0):
        self.version += 1
        v = self.version
        k.versions[v] = (length, txn)
        return v, payload(self.wid, k.ns, k.group, k.key, v, txn, length)

    def identify(self, k, data):
        """-> set of versions of k whose payload equals data (empty: wrong bytes)."""
        n = len(data)
        if n >= HDR_LEN:
            d = describe(data)
            v = d.get("version")
            if v in k.versions and k.versions[v][0] == n:
                if bytes(data) == payload(self.wid, k.ns, k.group, k.key, v, k.versions[v][1], n):
                    return {v}
            return set()
        out = set()
        for v, (ln, t) in k.versions.items():
            if ln == n and bytes(data) == payload(self.wid, k.ns, k.group, k.key, v, t, n):
                out.add(v)
        return out

    def rand_len(self, small=False):
        r = self.rng.random()
        if small:
            return self.rng.choice([self.rng.randint(0, 63), self.rng.randint(64, 65536), self.rng.randint(65536, 600000)])
        if self.heavy:
            return self.rng.randint(256 << 10, 1 << 20)
        if r < 0.08:
            return self.rng.randint(0, 63)
        if r < 0.33:
            return self.rng.randint(64, 4096)
        if r < 0.73:
            return self.rng.randint(4097, 262144)
        if r < 0.97:
            return self.rng.randint(262145, 1 << 20)
        return self.rng.randint(1 << 20, 2 << 20)

    # ---------------------------------------------------------------- events
    def event(self, k, state, acked, txn=0):
        self.seq += 1
        k.hist.append((self.seq, state, acked, txn))
        if acked is not None:
            k.latest = {state}
        else:
            k.latest = k.latest | {state}
        return self.seq

    # ---------------------------------------------------------------- reading
    def read_keys(self, ks):
        """GET ks (same ns/group) -> list of (status, versions-set or None)."""
        out = []
        cap = 2 * (1 << 20) + 4096
        for i in range(0, len(ks), 16):
            chunk = ks[i:i + 16]
            res = self.c.get(self.nsids[chunk[0].ns], [k.key for k in chunk], group=chunk[0].group,
                             into=[(j * cap, cap) for j in range(len(chunk))])
            for k, r in zip(chunk, res):
                if r.status == "miss":
                    out.append(("miss", None))
                elif r.status.startswith("hit"):
                    data = bytes(r.data)
                    vs = self.identify(k, data)
                    if not vs:
                        self.V("wrong-bytes", "GET returned bytes that match no version put under this key",
                               status=r.status, got=describe(data), key=self.keyhist(k))
                    out.append((r.status, vs, data if not vs else None))
                else:
                    self.V("get-status", f"unexpected GET status {r.status}", key=self.keyhist(k))
                    out.append((r.status, None))
        return [(o[0], o[1]) for o in out]

    def check_insession(self, k, status, vs):
        if status == "miss" or vs is None or not vs:
            return
        ok = any(V(v) in k.latest for v in vs)
        if not ok:
            self.V("stale-in-session", "in-session GET returned a version other than the latest put",
                   status=status, got_versions=sorted(vs), latest=sorted(k.latest), key=self.keyhist(k))

    # ---------------------------------------------------------------- post-restart verification
    def verify_after_restart(self, down):
        kind, t_sig, strict = down["kind"], down["t"], down["strict"]
        self.reclaim_seen = self.reclaim_seen or down["reclaim"]
        groups = {}
        for k in self.keys:
            groups.setdefault((k.ns, k.group), []).append(k)
        observed = {}
        lookup_miss = set()
        for (ns, g), ks in groups.items():
            for i in range(0, len(ks), 256):
                part = ks[i:i + 256]
                lr = self.c.lookup(self.nsids[ns], [k.key for k in part], group=g)
                for k, loc in zip(part, lr.locations):
                    if loc == "miss":
                        lookup_miss.add(k.kid)
            res = self.read_keys(ks)
            for k, (st, vs) in zip(ks, res):
                observed[k.kid] = (st, vs)
        n_checked = 0
        for k in self.keys:
            st, vs = observed[k.kid]
            fs = self.floor_seq[k.kid]
            after = [h for h in k.hist if h[0] > fs]
            # SIGTERM at t_sig (strict): acts as a flush of every event acked before t_sig
            floor_state, floor_kind = k.floor, k.floor_kind
            if strict:
                acked_before = [h for h in after if h[2] is not None and h[2] < t_sig]
                if acked_before:
                    last = acked_before[-1]
                    floor_state, floor_kind = last[1], "sigterm"
                    after = [h for h in after if h[0] > last[0]]
            acceptable = {floor_state} | {h[1] for h in after}
            n_checked += 1
            if floor_kind in ("flush", "sigterm") and not self.reclaim_seen_at_floor(k):
                self.cnt["strict_" + ("deleted" if floor_state == MISS else "version")] += 1
            elif floor_kind in ("flush", "sigterm"):
                self.cnt["reclaimable_" + ("deleted" if floor_state == MISS else "version")] += 1
            if st == "miss":
                obs = MISS
                if MISS not in acceptable:
                    if self.reclaim_seen:
                        self.S("missing-reclaim-possible", "chunk required by the model is missing, but region reclaim happened in this data dir",
                               via=floor_kind, key=self.keyhist(k))
                    elif floor_kind in ("flush", "sigterm"):
                        self.V("lost-after-" + kind, f"chunk covered by a returned {floor_kind} is missing after {kind}+restart",
                               lookup_miss=k.kid in lookup_miss, key=self.keyhist(k))
                    else:
                        self.S("lost-observed", "chunk observed at the previous restart is missing now (no op since)",
                               key=self.keyhist(k))
            elif vs:
                good = [v for v in vs if V(v) in acceptable]
                if good:
                    obs = V(max(good))
                else:
                    obs = V(max(vs))
                    older = all(any(h[1] == V(v) and h[0] <= fs for h in k.hist) for v in vs)
                    if floor_state == MISS and floor_kind in ("flush", "sigterm"):
                        what = "deleted-resurrected"
                        msg = f"chunk deleted and covered by a returned {floor_kind} came back after {kind}+restart"
                    elif floor_kind in ("flush", "sigterm"):
                        what = "stale-after-" + kind
                        msg = f"older version served after {kind}+restart although a newer state was covered by {floor_kind}"
                    else:
                        what = "regressed-after-observed"
                        msg = "version differs from the state observed at the previous restart with no op since"
                    sev = self.V if floor_kind in ("flush", "sigterm") else self.S
                    sev(what, msg, got_versions=sorted(vs), acceptable=sorted(acceptable), older=older, key=self.keyhist(k))
                if k.kid in lookup_miss:
                    self.V("lookup-miss-but-get-hit", "LOOKUP said miss, GET right after hit (a miss should be exact)",
                           key=self.keyhist(k))
            else:
                obs = None  # wrong bytes, already reported
            observed[k.kid] = (st, vs, obs)
        # atomic groups: a txn visible in one member must be visible (or superseded) in all
        for txn, members in self.txns.items():
            vis = [kid for kid, v, s in members if observed[kid][2] == V(v)]
            if vis:
                self.cnt["atomic_groups_seen"] += 1
            if not vis or len(vis) == len(members):
                continue
            bad = []
            for kid, v, s in members:
                k = self.keys[kid]
                obs = observed[kid][2]
                if obs == V(v):
                    continue
                later = {h[1] for h in k.hist if h[0] > s}
                if obs in later:
                    continue
                bad.append((kid, obs))
            if bad:
                sev = self.S if self.reclaim_seen else self.V
                sev("atomic-partial", f"atomic group txn {txn} visible in some members, older/missing in others after {kind}+restart",
                    members=[self.keyhist(self.keys[kid]) for kid, v, s in members],
                    txn_versions=[(kid, v) for kid, v, s in members], bad=bad, reclaim_seen=self.reclaim_seen)
        # new floors: what was observed
        for k in self.keys:
            obs = observed[k.kid][2]
            if obs is None:
                continue
            k.floor, k.floor_kind = obs, "observed"
            self.floor_seq[k.kid] = self.seq
            k.latest = {obs}
        self.T(f"verified {n_checked} keys after {kind}")
        return n_checked

    def reclaim_seen_at_floor(self, k):
        return self.reclaim_seen

    # ---------------------------------------------------------------- ops
    def pick_plain(self, n=1):
        c = self.rng.randint(0, 3)
        cands = [k for k in self.keys[:120] if k.kid % 4 == c]
        return self.rng.sample(cands, min(n, len(cands)))

    def pick_any(self):
        if not MEMBER_OPS or self.rng.random() < 0.8:
            return self.pick_plain(1)[0]
        s = self.rng.choice(self.sets)
        return self.rng.choice(s)

    def op(self):
        r = self.rng.random()
        self.ops += 1
        if self.heavy:
            r = r * 0.45  # put-ish only
        if r < 0.30:
            k = self.pick_any()
            ln = self.rand_len()
            v, data = self.new_put(k, ln)
            self.T(f"put k{k.kid} v{v} len{ln}")
            self.inflight = [(k, V(v), 0)]
            codes = self.c.put(self.nsids[k.ns], [(k.key, data)], group=k.group)
            self.inflight = []
            if codes[0] == "ok":
                self.event(k, V(v), time.monotonic())
            else:
                self.T(f"put k{k.kid} v{v} code {codes[0]}")
                self.event(k, V(v), None)  # ambiguous
                k.latest |= {MISS}
        elif r < 0.38:
            ks = self.pick_plain(self.rng.randint(2, 6))
            items, vers = [], []
            for k in ks:
                v, data = self.new_put(k, self.rand_len(small=True))
                items.append((k.key, data))
                vers.append(v)
            self.T("putN " + " ".join(f"k{k.kid}v{v}" for k, v in zip(ks, vers)))
            self.inflight = [(k, V(v), 0) for k, v in zip(ks, vers)]
            codes = self.c.put(self.nsids[ks[0].ns], items, group=ks[0].group)
            self.inflight = []
            now = time.monotonic()
            for k, v, cd in zip(ks, vers, codes):
                if cd == "ok":
                    self.event(k, V(v), now)
                else:
                    self.event(k, V(v), None)
        elif r < 0.45:
            s = self.rng.randrange(len(self.sets))
            ms = self.sets[s]
            self.txn += 1
            txn = (self.wid << 24) | self.txn
            items, vers = [], []
            for k in ms:
                v, data = self.new_put(k, self.rand_len(small=True), txn)
                items.append((k.key, data))
                vers.append(v)
            self.T(f"atomic txn{txn} set{s} " + " ".join(f"k{k.kid}v{v}" for k, v in zip(ms, vers)))
            self.inflight = [(k, V(v), txn) for k, v in zip(ms, vers)]
            self.txns[txn] = [(k.kid, v, None) for k, v in zip(ms, vers)]
            try:
                codes = self.c.put(self.nsids[ms[0].ns], items, group=ms[0].group, atomic=True)
            except KvtierError as e:
                if isinstance(e, KvtierUnavailable):
                    raise
                self.T(f"atomic txn{txn} refused: {e}")
                self.inflight = []
                del self.txns[txn]
                return
            self.inflight = []
            now = time.monotonic()
            recs = []
            for k, v in zip(ms, vers):
                sq = self.event(k, V(v), now, txn)
                recs.append((k.kid, v, sq))
            self.txns[txn] = recs
            if any(cd != "ok" for cd in codes):
                self.V("atomic-codes", "atomic PUT returned mixed per-entry codes", codes=codes)
        elif r < 0.55:
            if self.rng.random() < 0.75:
                ks = self.pick_plain(self.rng.randint(1, 3))
            else:
                s = self.rng.choice(self.sets)
                ks = self.rng.sample(s, self.rng.randint(1, len(s))) if MEMBER_OPS else list(s)
            self.T("delete " + " ".join(f"k{k.kid}" for k in ks))
            self.inflight = [(k, MISS, 0) for k in ks]
            existed = self.c.delete(self.nsids[ks[0].ns], [k.key for k in ks], group=ks[0].group)
            self.inflight = []
            now = time.monotonic()
            for k, ex in zip(ks, existed):
                self.event(k, MISS, now)
        elif r < 0.75:
            if self.rng.random() < 0.7:
                ks = self.pick_plain(self.rng.randint(1, 6))
            else:
                ks = list(self.rng.choice(self.sets))
            res = self.read_keys(ks)
            self.T("get " + " ".join(f"k{k.kid}:{st}:{sorted(vs) if vs else ''}" for k, (st, vs) in zip(ks, res)))
            for k, (st, vs) in zip(ks, res):
                self.check_insession(k, st, vs)
        elif r < 0.81:
            ks = self.pick_plain(self.rng.randint(1, 8))
            lr = self.c.lookup(self.nsids[ks[0].ns], [k.key for k in ks], group=ks[0].group)
            locs = lr.locations
            pre = 0
            while pre < len(locs) and locs[pre] != "miss":
                pre += 1
            if lr.prefix != pre:
                self.V("lookup-prefix", "LOOKUP prefix disagrees with its locations", prefix=lr.prefix, locs=locs)
            missk = [k for k, l in zip(ks, locs) if l == "miss"]
            if missk:
                res = self.read_keys(missk)
                for k, (st, vs) in zip(missk, res):
                    if st != "miss":
                        self.V("lookup-miss-but-get-hit", "LOOKUP said miss, GET right after hit", key=self.keyhist(k), status=st)
            self.T("lookup " + " ".join(f"k{k.kid}:{l}" for k, l in zip(ks, locs)))
        elif r < 0.88:
            self.T("flush call")
            with self.flushing.get_lock():
                self.flushing.value += 1
            try:
                res = self.c.flush(timeout=120)
            finally:
                with self.flushing.get_lock():
                    self.flushing.value -= 1
            self.T(f"flush returned {res}")
            if res.get("failed", 0):
                self.S("flush-failed", "FLUSH reported failed chunks", res=res)
            else:
                for k in self.keys:
                    if k.hist and k.hist[-1][0] > self.floor_seq[k.kid]:
                        last = k.hist[-1]
                        if last[2] is not None:
                            k.floor, k.floor_kind = last[1], "flush"
                            self.floor_seq[k.kid] = last[0]
        elif r < 0.90:
            time.sleep(self.rng.uniform(0, 0.4))
        else:
            k = self.pick_any()
            res = self.read_keys([k])
            self.check_insession(k, *res[0])

    def summary(self):
        return {"wid": self.wid, "ops": self.ops, "violations": self.viol, "suspicious": self.soft,
                "keys": len(self.keys), "versions": self.version, "txns": len(self.txns), **self.cnt}


def worker_main(wid, conn, flushing, rundir, seed):
    w = Worker(wid, conn, flushing, rundir, seed)
    w.pending_down = None
    # the parent's "epoch" message carries the previous "down" info: patch recv to use stored one
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "exit":
                conn.send(("bye", w.summary()))
                return
            if msg[0] == "epoch":
                # re-dispatch through run()'s logic with our remembered down info
                msg = ("epoch", msg[1], msg[2], w.pending_down, msg[3])
                w._dispatch(msg)
    except Exception:
        with open(os.path.join(rundir, f"worker-{wid}.crash"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _dispatch(self, msg):
    _, self.epoch, sock, down, self.heavy = msg
    try:
        self.c = KvtierClient(sock, region_size=40 << 20, timeout=60)
        self.nsids = [self.c.hello(r) for r in NS_RECORDS]
        if down is not None:
            self.verify_after_restart(down)
        self.conn.send(("verified", self.wid))
    except Exception as e:
        self.S("verify-error", f"error during verification: {e!r}", tb=traceback.format_exc())
        self.conn.send(("verified", self.wid))
    self.inflight = []
    err = None
    while True:
        if self.conn.poll(0):
            m = self.conn.recv()
            if m[0] == "pause":
                err = "paused"
                break
        try:
            self.op()
        except (KvtierUnavailable, OSError, KvtierError) as e:
            err = repr(e)
            for k, st, txn in self.inflight:
                sq = self.event(k, st, None, txn)
                if txn and txn in self.txns:
                    self.txns[txn] = [(kid, v, sq if kid == k.kid else s) for kid, v, s in self.txns[txn]]
            self.T(f"op failed: {e!r}; in-flight: " + " ".join(f"k{k.kid}:{st}" for k, st, t in self.inflight))
            self.inflight = []
            break
    try:
        self.c.close()
    except Exception:
        pass
    self.c = None
    self.conn.send(("stopped", self.wid, err))
    m = self.conn.recv()
    assert m[0] == "down", m
    self.pending_down = m[1]
    self.T(f"down {m[1]}")


Worker._dispatch = _dispatch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rundir")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=7620, help="the daemon's HTTP port on 127.0.0.1 (0: any free one)")
    ap.add_argument("--evictions-only", type=int, default=0)
    ap.add_argument("--member-ops", type=int, default=1)
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--no-reclaim-budget", type=int, default=0, help="disk budget bytes if reclaim is not expected")
    argv = sys.argv[1:]
    i = argv.index("--")
    a = ap.parse_args(argv[:i])
    global MEMBER_OPS
    MEMBER_OPS = bool(a.member_ops)
    dargs = argv[i + 1:]
    os.makedirs(a.rundir, exist_ok=True)
    rng = random.Random(a.seed)
    d = Daemon(a.rundir, dargs, a.port)
    DAEMONS.append(d)
    flushing = mp.Value("i", 0)
    pipes, procs = [], []
    for w in range(a.workers):
        p_conn, c_conn = mp.Pipe()
        pr = mp.Process(target=worker_main, args=(w, c_conn, flushing, a.rundir, a.seed), daemon=True)
        pr.start()
        pipes.append(p_conn)
        procs.append(pr)
    plog = open(os.path.join(a.rundir, "parent.log"), "a", buffering=1)

    def P(s):
        plog.write(f"{time.time():.3f} {s}\n")
        print(s, flush=True)

    t_start = time.time()
    reclaim_seen = False
    cum_written = 0
    counts = {"kill9": 0, "sigterm": 0, "restarts": 0, "term_bad_rc": 0}
    for epoch in range(a.epochs):
        if time.time() - t_start > a.max_seconds:
            P("time budget reached")
            break
        st = d.start()
        counts["restarts"] += 1
        mode = rng.choices(["kill-random", "kill-flush", "kill-heavy", "kill-idle", "term-quiesced", "term-busy"],
                           [30, 20, 15, 10, 13, 12])[0]
        heavy = mode == "kill-heavy"
        for p in pipes:
            p.send(("epoch", epoch, d.sock, heavy))
        for p in pipes:
            m = p.recv()
            assert m[0] == "verified", m
        s0 = d.stats()
        P(f"epoch {epoch}: started in {st:.2f}s, mode {mode}, recovered chunks={s0['store']['disk_chunks'] if s0 else '?'} "
          f"disk_bytes={s0['store']['disk_bytes'] if s0 else '?'} damaged={s0['store']['damaged_metadata'] if s0 else '?'} "
          f"verify_failures={s0['store']['verify_failures'] if s0 else '?'}")
        last_stats = s0

        def poll_stats():
            nonlocal last_stats, reclaim_seen
            s = d.stats()
            if s:
                last_stats = s
                if s["store"]["region_evictions"] > 0:
                    reclaim_seen = True
                if not a.evictions_only and cum_written + s["store"]["disk_write_bytes"] > s["store"]["disk_budget"] * 0.6:
                    reclaim_seen = True

        strict = False
        t_sig = None
        if mode in ("kill-random", "kill-heavy", "term-busy"):
            dur = rng.uniform(0.3, 6.0) if mode != "kill-heavy" else rng.uniform(0.5, 3.0)
            t_end = time.monotonic() + dur
            while time.monotonic() < t_end - 0.5:
                time.sleep(0.4)
                poll_stats()
            time.sleep(max(0, t_end - time.monotonic()))
        elif mode == "kill-flush":
            t_end = time.monotonic() + 12
            n_seen = rng.randint(1, 3)
            seen = 0
            while time.monotonic() < t_end:
                if flushing.value > 0:
                    seen += 1
                    if seen >= n_seen:
                        time.sleep(rng.uniform(0, 0.03))
                        break
                    while flushing.value > 0 and time.monotonic() < t_end:
                        time.sleep(0.001)
                time.sleep(0.001)
            poll_stats()
        if mode in ("kill-idle", "term-quiesced"):
            time.sleep(rng.uniform(0.5, 4.0))
            for p in pipes:
                p.send(("pause",))
            for p in pipes:
                m = p.recv()
                assert m[0] == "stopped", m
            poll_stats()
            time.sleep(rng.uniform(0, 1.2) if mode == "kill-idle" else rng.uniform(0, 0.3))
        if mode.startswith("kill"):
            t_sig = d.kill9()
            counts["kill9"] += 1
            kind = "kill9"
        else:
            if mode == "term-busy":
                poll_stats()
            ss = last_stats["store"] if last_stats else {}
            strict = bool(last_stats) and ss.get("dropped_unwritten", 1) == 0 and ss.get("lost_writes", 1) == 0
            t_sig, rc, took = d.sigterm()
            counts["sigterm"] += 1
            kind = "sigterm"
            P(f"  SIGTERM rc={rc} took {took:.2f}s strict={strict}")
            if rc != 0:
                counts["term_bad_rc"] += 1
                P(f"  VIOLATION: SIGTERM exit code {rc}")
        if mode not in ("kill-idle", "term-quiesced"):
            for p in pipes:
                m = p.recv()
                assert m[0] == "stopped", m
        ss = last_stats["store"] if last_stats else {}
        cum_written += ss.get("disk_write_bytes", 0)
        P(f"  {kind} at {t_sig:.4f}; last stats: puts={ss.get('puts')} disk_bytes={ss.get('disk_bytes')} "
          f"region_evictions={ss.get('region_evictions')} dropped_unwritten={ss.get('dropped_unwritten')} "
          f"lost_writes={ss.get('lost_writes')} reclaimed_rewrites={ss.get('reclaimed_rewrites')} verify_failures={ss.get('verify_failures')}")
        down = {"kind": kind, "t": t_sig, "strict": strict, "reclaim": reclaim_seen}
        for p in pipes:
            p.send(("down", down))
    # final verification epoch
    st = d.start()
    counts["restarts"] += 1
    for p in pipes:
        p.send(("epoch", a.epochs, d.sock, False))
    for p in pipes:
        p.recv()
    for p in pipes:
        p.send(("pause",))
    for p in pipes:
        p.recv()
    s = d.stats()
    t_sig, rc, took = d.sigterm()
    P(f"final SIGTERM rc={rc} took {took:.2f}s; final stats store: " + json.dumps({k: s['store'][k] for k in (
        'disk_chunks', 'disk_bytes', 'region_evictions', 'dropped_unwritten', 'lost_writes', 'verify_failures', 'damaged_metadata', 'reclaimed_rewrites')} if s else {}))
    for p in pipes:
        p.send(("down", {"kind": "sigterm", "t": t_sig, "strict": False, "reclaim": reclaim_seen}))
    for p in pipes:
        p.send(("exit",))
    tot = {"ops": 0, "violations": 0, "suspicious": 0}
    for p in pipes:
        m = p.recv()
        P(f"worker summary {m[1]}")
        for k in tot:
            tot[k] += m[1][k]
    P(f"TOTAL {json.dumps({**tot, **counts, 'reclaim_seen': reclaim_seen, 'secs': round(time.time() - t_start, 1)})}")
    if tot["violations"] or counts["term_bad_rc"]:
        P(f"FAILED: see the VIOLATION lines of {a.rundir}/worker-*.log and {a.rundir}/parent.log")
        return 1
    return 0


def run():
    """main() with the daemon it started stopped on every way out (an
    exception, a hung worker's timeout sending SIGTERM)."""
    parent = os.getpid()

    def on_term(signum, frame):
        if os.getpid() != parent:
            os._exit(1)  # a worker (forked with this handler)
        raise SystemExit(f"chaos.py: signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        return main()
    finally:
        d = DAEMONS[0] if DAEMONS else None
        if d is not None and d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


DAEMONS = []


if __name__ == "__main__":
    mp.set_start_method("fork")
    sys.exit(run())
