"""The connector's link to the local kvtier daemon (through `kvtier.client`).

One `DaemonLink` per use (scheduler lookups, worker saves, worker loads), each
with its own connection and shared-memory region, so no lock is shared
between the threads that use them. A daemon that is down is retried at most
every `RETRY_S` seconds; until then every call fails fast (a miss, or a
load error), never blocks the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvtier.vllm")

#: Seconds between reconnection attempts to a daemon that is down.
RETRY_S = 5.0
#: After a failed call the link waits FIRST_RETRY_S, doubling with every
#: failure in a row up to the link's `max_retry_s`: a daemon that hangs
#: (stopped, not dead) costs a whole timeout per try, on the engine's thread
#: for lookups, so the tries must thin out.
FIRST_RETRY_S = 0.2

#: GET entry status codes (node/PROTOCOL.md, GET).
GET_MISS, GET_RAM, GET_DISK, GET_PEER, GET_TOO_SMALL = 0, 1, 2, 3, 4


class DaemonDown(Exception):
    """No usable connection to the daemon right now."""


@dataclass
class RankPrefix:
    """One rank's answer to a cluster lookup."""

    rank: int
    prefix: int
    ram_prefix: int


def _client_module():
    from kvtier import client  # H3's pure-Python native client

    return client


class DaemonLink:
    """A lazily (re)connected client with its shared-memory region."""

    def __init__(self, socket_path: str, region_size: int, timeout_ms: int, what: str, max_retry_s: float = RETRY_S):
        self.socket_path = socket_path
        self.region_size = region_size
        self.timeout_s = timeout_ms / 1000.0
        self.what = what
        self.max_retry_s = max_retry_s
        self._client: Any = None
        self._ns: dict[str, bytes] = {}
        self._next_try = 0.0
        #: Failed calls in a row (reset by one that succeeds).
        self._fails = 0
        self._warned = False
        # Guards connect/close only; each link is used by one thread at a time.
        self._lock = threading.Lock()

    def client(self) -> Any:
        """The connected client, or DaemonDown."""
        if self._client is not None:
            return self._client
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_try:
                raise DaemonDown(f"kvtier daemon at {self.socket_path} is down (retrying)")
            try:
                mod = _client_module()
                self._client = mod.KvtierClient(
                    self.socket_path, region_size=self.region_size, timeout=self.timeout_s
                )
            except Exception as e:  # noqa: BLE001 - any failure means "down"
                # At least RETRY_S apart, doubling up to the link's bound: a
                # stopped daemon accepts the connection and then costs a whole
                # timeout (the region's registration) per try.
                delay = min(self.max_retry_s, max(RETRY_S, FIRST_RETRY_S * 2 ** min(self._fails, 16)))
                self._fails += 1
                self._next_try = now + delay
                if not self._warned:
                    logger.warning(
                        "kvtier: cannot reach the daemon at %s for %s (%s); the connector "
                        "is a no-op until it is up (retrying every %.0f s at first, then less often)",
                        self.socket_path, self.what, e, delay,
                    )
                    self._warned = True
                raise DaemonDown(str(e)) from e
            if self._warned:
                logger.warning("kvtier: daemon at %s is back for %s", self.socket_path, self.what)
                self._warned = False
            self._ns.clear()
            return self._client

    def fail(self, err: BaseException) -> None:
        """Drops the connection after an error; the next call reconnects after
        a back-off that doubles with each failure in a row."""
        with self._lock:
            c, self._client = self._client, None
            delay = min(self.max_retry_s, FIRST_RETRY_S * 2 ** min(self._fails, 16))
            self._fails += 1
            self._next_try = time.monotonic() + delay
        logger.warning("kvtier: daemon call for %s failed: %s (next try in %.1f s)", self.what, err, delay)
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        """Closes the connection."""
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass

    # ---- calls -------------------------------------------------------------

    def namespace(self, record: dict[str, Any]) -> bytes:
        """HELLO, cached per connection."""
        c = self.client()
        key = repr(sorted((k, repr(v)) for k, v in record.items()))
        ns = self._ns.get(key)
        if ns is None:
            ns = bytes(c.hello(record))
            self._ns[key] = ns
        return ns

    def region(self) -> memoryview:
        """The shared-memory region (writable)."""
        return self.client().region.buffer

    def region_address(self) -> int:
        """Address of the region in this process (for cudaHostRegister)."""
        return int(self.client().region.address)

    def cluster_lookup(self, record: dict[str, Any], ranks: list[int], keys: list[bytes], group: int) -> tuple[int, list[RankPrefix]]:
        """(min prefix over ranks, per-rank answers)."""
        r = self.client().cluster_lookup(record, ranks, keys, group=group)
        self._fails = 0
        return int(r.min_prefix), [RankPrefix(int(p.rank), int(p.prefix), int(p.ram_prefix)) for p in r.ranks]

    def put(self, ns: bytes, entries: list[tuple[bytes, int, int]], group: int) -> list[bool]:
        """PUT (key, offset, length) ranges of the region; per entry, stored or not."""
        r = self.client().put(ns, [(k, (off, n)) for k, off, n in entries], group=group)
        self._fails = 0
        return [s == "ok" for s in r]

    def get(self, ns: bytes, entries: list[tuple[bytes, int, int]], group: int) -> list[tuple[int, int]]:
        """GET into (key, offset, capacity) ranges; per entry (GET_* status, length)."""
        keys = [e[0] for e in entries]
        into = [(e[1], e[2]) for e in entries]
        r = self.client().get(ns, keys, group=group, into=into)
        self._fails = 0
        return [(_GET_STATUS.get(x.status, GET_MISS), int(x.length)) for x in r]


_GET_STATUS = {"miss": GET_MISS, "hit-ram": GET_RAM, "hit-disk": GET_DISK, "hit-peer": GET_PEER, "too-small": GET_TOO_SMALL}
