"""Repro: a flushed member of an atomic group is lost at restart when another member of the
same group was later overwritten (or deleted) on its own.

usage: python3 repro_atomic_member.py [overwrite|delete] [kill9|sigterm] [flush-between|no-flush-between]
"""
import os, shutil, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qalib import Daemon, KvtierClient, NS_RECORDS

variant = sys.argv[1] if len(sys.argv) > 1 else "overwrite"
stop = sys.argv[2] if len(sys.argv) > 2 else "kill9"
between = sys.argv[3] if len(sys.argv) > 3 else "no-flush-between"
root = f"/tmp/qa-chaos-repro-{variant}-{stop}-{between}"
shutil.rmtree(root, ignore_errors=True)
os.makedirs(root)
d = Daemon(root, ["--ram-budget", "8MiB", "--disk-budget", "64MiB"], 7690)
d.start()
A, B = b"A" * 32, b"B" * 32
with KvtierClient(d.sock, region_size=4 << 20) as c:
    ns = c.hello(NS_RECORDS[0])
    print("atomic put A=a1 B=b1:", c.put(ns, [(A, b"a1" * 100), (B, b"b1" * 100)], atomic=True))
    if between == "flush-between":
        print("flush:", c.flush())
    if variant == "overwrite":
        print("put A=a2 (plain):", c.put(ns, [(A, b"a2" * 100)]))
    else:
        print("delete A:", c.delete(ns, [A]))
    print("flush:", c.flush())
    print("before stop: A =", (c.get_bytes(ns, A) or b"<miss>")[:4], " B =", (c.get_bytes(ns, B) or b"<miss>")[:4])
if stop == "kill9":
    d.kill9()
else:
    print("SIGTERM ->", d.sigterm()[1:])
d.start()
with KvtierClient(d.sock, region_size=4 << 20) as c:
    ns = c.hello(NS_RECORDS[0])
    a, b = c.get_bytes(ns, A), c.get_bytes(ns, B)
    print("after restart: A =", (a or b"<miss>")[:4], " B =", (b or b"<miss>")[:4])
    exp_a = b"a2" * 100 if variant == "overwrite" else None
    ok = a == exp_a and b == b"b1" * 100
    print("RESULT:", "OK" if ok else "VIOLATION (expected A=%s, B=b1: B was covered by a returned FLUSH)" % ("a2" if exp_a else "<miss>"))
d.sigterm()
print("daemon log:", d.log_path)
