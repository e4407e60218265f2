"""Focused stress: many 2..4-member atomic groups overwritten atomically at a high rate with
filler writes (RAM 8 MiB, so members are evicted/written at different times), kill -9 at a random
moment, restart, check every group's members carry the same group tag (or all miss).
Never flushes, never deletes, never writes a member alone.
usage: stress_atomic.py ROOT ITERATIONS SEED [extra daemon args]
"""
import os, random, shutil, struct, sys, threading, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qalib import Daemon, KvtierClient, KvtierUnavailable, KvtierError, NS_RECORDS, key32

root, iters, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
extra = sys.argv[4:]
shutil.rmtree(root, ignore_errors=True)
os.makedirs(root)
DISK = os.environ.get("DISK", "128MiB")
REGION = os.environ.get("REGION", "8MiB")
d = Daemon(root, ["--ram-budget", "8MiB", "--disk-budget", DISK, "--region-size", REGION, "--idle-flush-after", "1h"] + extra, 7695)
reclaims = 0
cum_written = 0
rng = random.Random(seed)
NSETS = 6
sets = [[key32(f"s{s}m{m}") for m in range(2 + s % 3)] for s in range(NSETS)]
tag = 0
MSIZES = [int(x) for x in os.environ.get("MSIZES", "100,5000,60000,300000,600000").split(",")]
SLEEP = float(os.environ.get("SLEEP", "0"))
FMIN, FMAX = int(os.environ.get("FMIN", 100000)), int(os.environ.get("FMAX", 900000))
hist = {}  # tag -> (set, epoch, acked)
log = open(os.path.join(root, "stress.log"), "a", buffering=1)
findings = 0

def val(t, k, n):
    return struct.pack("<QQ", 0xA70A, t) + k + bytes([t % 256]) * max(0, n - 48)

for it in range(iters):
    d.start()
    with KvtierClient(d.sock, region_size=16 << 20) as c:
        ns = c.hello(NS_RECORDS[0])
        # check
        res = {}
        for s, ks in enumerate(sets):
            tags = []
            for k in ks:
                b = c.get_bytes(ns, k)
                if b is None:
                    tags.append(None)
                else:
                    m, t = struct.unpack("<QQ", b[:16])
                    assert m == 0xA70A and b[16:48] == k and b == val(t, k, len(b)), "wrong bytes"
                    tags.append(t)
            if len(set(tags)) > 1:
                findings += 1
                kind = "newer-partial" if None not in tags else "member-missing"
                msg = f"[region reclaims seen so far: {reclaims}] iter {it} set {s}: PARTIAL ({kind}) tags={tags} " + " ".join(f"t{t}:{hist.get(t)}" for t in tags if t)
                print(msg, flush=True)
                log.write(msg + "\n")
    # run
    stop_at = time.monotonic() + rng.uniform(0.2, 2.5)
    c = KvtierClient(d.sock, region_size=16 << 20)
    ns = c.hello(NS_RECORDS[0])
    killer = threading.Timer(max(0, stop_at - time.monotonic()), d.kill9)
    killer.start()
    nops = 0
    written_this = 0
    try:
        while True:
            nops += 1
            if nops % 25 == 0:
                st = c.stats()["store"]
                last_st = st
                written_this = st["disk_write_bytes"]
                if st["region_evictions"]:
                    reclaims += 1
            r = rng.random()
            if SLEEP:
                time.sleep(SLEEP)
            if r < 0.6:
                s = rng.randrange(NSETS)
                tag += 1
                hist[tag] = (s, it, False)
                items = [(k, val(tag, k, rng.choice(MSIZES))) for k in sets[s]]
                c.put(ns, items, atomic=True)
                hist[tag] = (s, it, True)
            elif r < 0.9:
                c.put(ns, [(key32(f"f{rng.randrange(200)}"), bytes(rng.randint(FMIN, FMAX)))])
            else:
                s = rng.randrange(NSETS)
                c.get(ns, [sets[s][0]], into=[(0, 1 << 20)])
    except (KvtierUnavailable, KvtierError, OSError):
        pass
    killer.join()
    cum_written += written_this
    log.write(f"iter {it}: ops {nops} cum_written~{cum_written} reclaims_polls {reclaims}\n")
    c.close()
    if d.proc.poll() is None:
        d.kill9()
d.start()
print(f"done: {iters} kill -9 iterations, {tag} atomic puts, findings {findings}, disk written ~{cum_written} bytes, iterations with region reclaim seen {reclaims}")
d.sigterm()
