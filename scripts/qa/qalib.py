"""Shared helpers for the kvtier chaos QA driver (black box)."""
import hashlib, json, os, random, signal, socket, struct, subprocess, sys, time, urllib.request

_REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(_REPO, "connector"))
from kvtier.client import KvtierClient, KvtierError, KvtierUnavailable  # noqa: E402

# KVTIER_BIN is one of the variables the daemon ignores (any other KVTIER_*
# in the environment would stop it as an unknown key).
BIN = os.environ.get("KVTIER_BIN", os.path.join(_REPO, "target", "release", "kvtier"))
MAGIC = b"QAKV"
HDR = struct.Struct("<4sHBH32sQII")  # magic, worker, ns, group, key, version, txn, bodylen -> 57 bytes
HDR_LEN = 64

NS_RECORDS = [
    {"model": "qa-chaos", "tp-size": 2, "rank": 0},
    {"model": "qa-chaos", "tp-size": 2, "rank": 1},
]


def key32(tag):
    return hashlib.sha256(tag.encode()).digest()


def payload(worker, ns, group, key, version, txn, length):
    """Deterministic, self-describing payload of exactly `length` bytes."""
    if length >= HDR_LEN:
        body_len = length - HDR_LEN
        hdr = HDR.pack(MAGIC, worker, ns, group, key, version, txn, body_len).ljust(HDR_LEN, b"\0")
        body = random.Random((worker << 48) ^ version ^ 0x5A5A).randbytes(body_len)
        return hdr + body
    hdr = HDR.pack(MAGIC, worker, ns, group, key, version, txn, 0).ljust(HDR_LEN, b"\0")
    return hdr[:length]


def describe(data):
    """Best-effort decode of a payload header (for diagnosing wrong bytes)."""
    if len(data) >= 57 and data[:4] == MAGIC:
        m, w, ns, g, k, v, t, bl = HDR.unpack(bytes(data[:57]))
        return {"worker": w, "ns": ns, "group": g, "key": k.hex()[:16], "version": v, "txn": t, "bodylen": bl, "len": len(data)}
    return {"len": len(data), "head": bytes(data[:16]).hex()}


class Daemon:
    def __init__(self, root, args, http_port, log_name="daemon.log"):
        self.root = root
        self.data = os.path.join(root, "data")
        self.sock = os.path.join(root, "sock")
        self.args = args
        self.http_port = http_port
        self.log_path = os.path.join(root, log_name)
        self.proc = None
        self.starts = 0

    def cmdline(self):
        return [BIN, "node", "start", "--data-dir", self.data, "--socket", self.sock, "--resp-listen", "off",
                "--http-listen", f"127.0.0.1:{self.http_port}", "--disk-reserve", "0"] + self.args

    def start(self, timeout=60):
        self.starts += 1
        with open(self.log_path, "a") as f:
            f.write(f"\n===== QA start #{self.starts} at {time.time():.3f}: {' '.join(self.cmdline())}\n")
        logf = open(self.log_path, "a")
        self.proc = subprocess.Popen(["nice", "-n", "5"] + self.cmdline(), stdout=logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        logf.close()
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited at start rc={self.proc.returncode}; see {self.log_path}")
            try:
                c = KvtierClient(self.sock, region_size=0, timeout=5)
                c.ping()
                c.close()
                return time.time() - t0
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("daemon did not become ready")

    def kill9(self):
        t = time.monotonic()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.note(f"QA kill -9 sent at mono {t:.4f}")
        return t

    def sigterm(self, timeout=120):
        t = time.monotonic()
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            rc = "timeout"
        self.note(f"QA SIGTERM sent at mono {t:.4f}, rc={rc}, took {time.monotonic()-t:.2f}s")
        return t, rc, time.monotonic() - t

    def note(self, s):
        with open(self.log_path, "a") as f:
            f.write(f"===== {s}\n")

    def stats(self):
        try:
            c = KvtierClient(self.sock, region_size=0, timeout=10)
            s = c.stats()
            c.close()
            return s
        except Exception as e:
            return None
