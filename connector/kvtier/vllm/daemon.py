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

#: Seconds between reconnection attempts to a daemon that is down (its
#: socket refuses the connection or is missing: a cheap try).
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


class RegionRefused(DaemonDown):
    """The daemon refuses the link's shared-memory region (longer than its
    `max-region`): a configuration error (`staging_bytes`) that no retry
    mends. The link never tries again."""


@dataclass
class RankPrefix:
    """One rank's answer to a cluster lookup."""

    rank: int
    prefix: int
    ram_prefix: int


def _client_module():
    from kvtier import client  # H3's pure-Python native client

    return client


def _unmap(region: Any) -> None:
    """Closes a shared-memory region."""
    try:
        region.close()
    except Exception:  # noqa: BLE001 - views of it keep the mapping alive
        pass


class DaemonLink:
    """A lazily (re)connected client with its shared-memory region.

    The region belongs to the link, not to one connection: when the daemon
    closed the connection (it restarted) the failed call is sent once more on
    a new connection with the same region, its bytes intact. Every call the
    link makes (HELLO, CLUSTER_LOOKUP, PUT of staged bytes, GET into a range)
    is idempotent, so that second try is safe. After any other failure
    (`fail`: a timeout, a bad reply) the region goes with the connection: a
    daemon that was only slow may still read or write it. It stays mapped
    (`retired`) until `release_retired`, once its user unregistered it.
    """

    def __init__(self, socket_path: str, region_size: int, timeout_ms: int, what: str, max_retry_s: float = RETRY_S):
        self.socket_path = socket_path
        self.region_size = region_size
        self.timeout_s = timeout_ms / 1000.0
        self.what = what
        self.max_retry_s = max_retry_s
        self._client: Any = None
        self._region: Any = None
        #: Namespace ids of this connection, and every record asked for (HELLO
        #: again on a new connection), by the record's canonical form.
        self._ns: dict[str, bytes] = {}
        self._records: dict[str, dict[str, Any]] = {}
        self._next_try = 0.0
        #: Failed calls in a row (reset by one that succeeds).
        self._fails = 0
        self._warned = False
        #: Why the daemon refused the region (RegionRefused), once it did.
        self.refused: str | None = None
        #: Regions `fail` dropped, still mapped until `release_retired`.
        self.retired: list[Any] = []
        # Guards connect/close only; each link is used by one thread at a time.
        self._lock = threading.Lock()

    def client(self) -> Any:
        """The connected client, or DaemonDown (RegionRefused for good)."""
        if self._client is not None:
            return self._client
        with self._lock:
            if self._client is not None:
                return self._client
            if self.refused is not None:
                raise RegionRefused(self.refused)
            now = time.monotonic()
            if now < self._next_try:
                raise DaemonDown(f"kvtier daemon at {self.socket_path} is down (retrying)")
            return self._connect(now)

    def _connect(self, now: float) -> Any:
        """Connects and registers the region (under the lock)."""
        mod = _client_module()
        try:
            if self.region_size and self._region is None:
                self._region = mod.Region(self.region_size, name="kvtier-staging")
            self._client = mod.KvtierClient(
                self.socket_path, region_size=0, timeout=self.timeout_s, region=self._region
            )
        except Exception as e:  # noqa: BLE001 - any failure means "down"
            if isinstance(e, mod.KvtierError) and not isinstance(e, mod.KvtierUnavailable) and e.code == "too-large":
                # Connected, and the daemon said no to the region's length.
                self.refused = (
                    f"the daemon at {self.socket_path} refuses a shared-memory region of "
                    f"{self.region_size} bytes for {self.what}: {e}"
                )
                self._close_region()
                raise RegionRefused(self.refused) from e
            if time.monotonic() - now < min(1.0, self.timeout_s / 2):
                # Refused or no socket: the daemon is not running, and asking
                # again costs nothing.
                delay = RETRY_S
            else:
                # At least RETRY_S apart, doubling up to the link's bound: a
                # stopped daemon accepts the connection and then costs a whole
                # timeout (the region's registration) per try.
                delay = min(self.max_retry_s, max(RETRY_S, FIRST_RETRY_S * 2 ** min(self._fails, 16)))
                self._fails += 1
            self._next_try = now + delay
            if not self._warned:
                logger.warning(
                    "kvtier: cannot reach the daemon at %s for %s (%s); the connector "
                    "is a no-op until it is up (retrying every %.0f s)",
                    self.socket_path, self.what, e, delay,
                )
                self._warned = True
            raise DaemonDown(str(e)) from e
        if self._warned:
            logger.warning("kvtier: daemon at %s is back for %s", self.socket_path, self.what)
            self._warned = False
        self._ns.clear()
        return self._client

    def _close_region(self) -> None:
        r, self._region = self._region, None
        if r is not None:
            _unmap(r)

    def fail(self, err: BaseException) -> None:
        """Drops the connection (and the region) after an error; the next
        call reconnects after a back-off that doubles with each failure in a
        row."""
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
        with self._lock:
            if self._client is None and self._region is not None:
                # Retired, not unmapped: the worker may still have it
                # registered with CUDA (`cudaHostRegister`), and a new region
                # mapped at its address would then be copied through the old
                # pinned pages (wrong bytes: review). `release_retired` unmaps
                # it once the worker has unregistered it.
                self.retired.append(self._region)
                self._region = None

    def release_retired(self) -> None:
        """Unmaps the regions `fail` retired (their users unregistered them)."""
        with self._lock:
            old, self.retired = self.retired, []
        for r in old:
            _unmap(r)

    def close(self) -> None:
        """Closes the connection and the regions (unregister them first)."""
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
        with self._lock:
            self._close_region()
        self.release_retired()

    def _call(self, op: Any, ns: bytes | None = None) -> Any:
        """`op(client, ns)`; when the daemon had closed the connection (it
        restarted) before answering, once more on a new connection, with the
        same region and the namespaces registered again. `op` must be
        idempotent."""
        c = self.client()
        try:
            r = op(c, ns)
        except _client_module().KvtierUnavailable as e:
            if not e.closed_by_peer:
                raise
            with self._lock:
                if self._client is c:
                    self._client = None
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
            logger.info("kvtier: the daemon closed the connection for %s (%s); reconnecting", self.what, e)
            old = dict(self._ns)
            with self._lock:
                c = self._client if self._client is not None else self._connect(time.monotonic())
            for key, record in self._records.items():
                self._ns[key] = bytes(c.hello(record))
            if ns is not None:
                # Namespace ids are a hash of the record: the same on the new daemon.
                ns = next((self._ns[k] for k, v in old.items() if v == ns and k in self._ns), ns)
            r = op(c, ns)
        self._fails = 0
        return r

    # ---- calls -------------------------------------------------------------

    def namespace(self, record: dict[str, Any]) -> bytes:
        """HELLO, cached per connection."""
        key = repr(sorted((k, repr(v)) for k, v in record.items()))
        self._records[key] = record
        ns = self._ns.get(key) if self._client is not None else None
        if ns is None:
            ns = self._call(lambda c, _: bytes(c.hello(record)))
            self._ns[key] = ns
        return ns

    def region(self) -> memoryview:
        """The shared-memory region (writable); the same object until the
        link drops its region (`fail`, `close`)."""
        self.client()
        return self._region.buffer

    def region_address(self) -> int:
        """Address of the region in this process (for cudaHostRegister)."""
        self.client()
        return int(self._region.address)

    def stats(self) -> dict[str, Any]:
        """The daemon's STATS."""
        return dict(self._call(lambda c, _: c.stats()))

    def cluster_lookup(self, record: dict[str, Any], ranks: list[int], keys: list[bytes], group: int) -> tuple[int, list[RankPrefix]]:
        """(min prefix over ranks, per-rank answers)."""
        r = self._call(lambda c, _: c.cluster_lookup(record, ranks, keys, group=group))
        return int(r.min_prefix), [RankPrefix(int(p.rank), int(p.prefix), int(p.ram_prefix)) for p in r.ranks]

    def put(self, ns: bytes, entries: list[tuple[bytes, int, int]], group: int) -> list[bool]:
        """PUT (key, offset, length) ranges of the region; per entry, stored or not."""
        items = [(k, (off, n)) for k, off, n in entries]
        r = self._call(lambda c, ns: c.put(ns, items, group=group), ns)
        return [s == "ok" for s in r]

    def get(self, ns: bytes, entries: list[tuple[bytes, int, int]], group: int) -> list[tuple[int, int]]:
        """GET into (key, offset, capacity) ranges; per entry (GET_* status, length)."""
        keys = [e[0] for e in entries]
        into = [(e[1], e[2]) for e in entries]
        r = self._call(lambda c, ns: c.get(ns, keys, group=group, into=into), ns)
        return [(_GET_STATUS.get(x.status, GET_MISS), int(x.length)) for x in r]


_GET_STATUS = {"miss": GET_MISS, "hit-ram": GET_RAM, "hit-disk": GET_DISK, "hit-peer": GET_PEER, "too-small": GET_TOO_SMALL}
