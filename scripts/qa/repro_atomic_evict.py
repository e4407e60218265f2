"""Repro attempt: an atomic group whose members leave RAM at different times (LRU eviction of one
member, the other still dirty in RAM), then kill -9.  After restart the group must be all-or-nothing.

usage: repro_atomic_evict.py [seed-v1|no-v1]
"""
import os, shutil, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qalib import Daemon, KvtierClient, NS_RECORDS

mode = sys.argv[1] if len(sys.argv) > 1 else "no-v1"
root = f"/tmp/qa-chaos-repro-evict-{mode}"
shutil.rmtree(root, ignore_errors=True)
os.makedirs(root)
BUDGET = 8 << 20
d = Daemon(root, ["--ram-budget", "8MiB", "--disk-budget", "256MiB", "--region-size", "16MiB",
                  "--idle-flush-after", "1h", "--write-policy", "backpressure"], 7692)
d.start()
A, B = b"A" * 32, b"B" * 32
SZ = 100_000
with KvtierClient(d.sock, region_size=16 << 20) as c:
    ns = c.hello(NS_RECORDS[0])
    if mode == "seed-v1":
        print("atomic put A=1 B=1:", c.put(ns, [(A, b"1" * SZ), (B, b"1" * SZ)], atomic=True), "flush:", c.flush())
    print("atomic put A=2 B=2:", c.put(ns, [(A, b"2" * SZ), (B, b"2" * SZ)], atomic=True))
    # B becomes more recently used than A
    c.get(ns, [B], into=[(0, 1 << 20)])
    s = c.stats()["store"]
    print("ram_bytes", s["ram_bytes"], "ram_chunks", s["ram_chunks"], "dirty", s["dirty_bytes"])
    # fillers: bring RAM just over budget so that only A (the LRU tail) is evicted
    room = BUDGET - s["ram_bytes"]
    fill = [room - 40_000 - 300 * 2]
    i = 0
    for n in fill:
        c.put(ns, [(bytes([0x46]) * 31 + bytes([i]), b"F" * (n // 2))])
        c.put(ns, [(bytes([0x47]) * 31 + bytes([i]), b"G" * (n - n // 2))])
        i += 1
    s = c.stats()["store"]
    print("after fill: ram_bytes", s["ram_bytes"], "ram_evictions", s["ram_evictions"], "spilled", s["spilled_chunks"])
    # push just past the budget
    c.put(ns, [(b"H" * 32, b"H" * 60_000)])
    time.sleep(0.6)
    s = c.stats()["store"]
    print("after push: ram_evictions", s["ram_evictions"], "spilled", s["spilled_chunks"], "disk_chunks", s["disk_chunks"],
          "dirty", s["dirty_bytes"])
    lr = c.lookup(ns, [A, B])
    print("locations A,B:", lr.locations)
d.kill9()
print("kill -9")
d.start()
with KvtierClient(d.sock, region_size=4 << 20) as c:
    ns = c.hello(NS_RECORDS[0])
    a, b = c.get_bytes(ns, A), c.get_bytes(ns, B)
    fa = (a or b"<miss>")[:1]
    fb = (b or b"<miss>")[:1]
    print("after restart: A =", fa, " B =", fb)
    if fa != fb or (mode == "seed-v1" and fa == b"<"):
        print("RESULT: VIOLATION (atomic group partially visible / flushed version lost)")
    else:
        print("RESULT: OK")
d.sigterm()
