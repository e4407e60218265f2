"""Pure-Python client of the kvtier daemon's native protocol.

The daemon listens on a Unix socket (``kvtier node start --socket PATH``).
Control messages are small binary frames (``node/PROTOCOL.md``); chunk bytes
travel through a shared-memory region owned by this client: a sealed memfd
that is mapped here and handed to the daemon once per connection. The daemon
copies bytes into the region on GET and out of it on PUT, exactly once.

Stable API (used by the vLLM connector)::

    from kvtier import KvtierClient, KvtierError, KvtierUnavailable

    with KvtierClient("/run/kvtier/kvtier.sock", region_size=256 << 20) as c:
        ns = c.hello({"model": "llama", "tp-size": 2, "rank": 0, ...})  # 16 bytes
        c.put(ns, [(key, payload_bytes)])                  # copied into the region
        c.region.buffer[0:n] = ...; c.put(ns, [(key, (0, n))])   # zero-copy PUT
        r = c.lookup(ns, keys)          # r.prefix, r.locations ("ram"/"disk"/"peer"/"miss")
        res = c.get(ns, keys, into=[(offset, capacity), ...])
        res[0].hit, res[0].status, res[0].offset, res[0].length, res[0].data (memoryview)
        c.cluster_lookup(record, ranks=[0, 1], keys=keys)  # .min_prefix, .ranks
        c.delete(ns, keys); c.flush(); c.stats()

Zero-copy into engine memory: ``client.region.buffer`` is a writable
``memoryview`` of the whole region, ``client.region.numpy()`` a numpy view
(when numpy is installed), and ``client.region.address`` its start address,
e.g. for ``torch.cuda.cudart().cudaHostRegister(address, size, 0)`` followed
by ``torch.frombuffer(region.buffer, dtype=torch.uint8)``: GET then writes
straight into pinned memory the GPU can DMA from.

Concurrency contract: do not modify a PUT range or read a GET range until
the call has returned. One client (one connection) must not be used from two
threads at once; open one client per thread.

Errors: :class:`KvtierError` (the daemon refused a request; ``.code`` is the
error name, e.g. ``"out-of-range"``), :class:`KvtierUnavailable` (cannot
connect, connection lost, timeout; the client is closed afterwards),
:class:`KvtierProtocolError` (a reply that does not decode).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, Union

from . import _frames as fr

__all__ = [
    "ClusterLookupResult",
    "GetResult",
    "KvtierClient",
    "KvtierError",
    "KvtierProtocolError",
    "KvtierUnavailable",
    "LookupResult",
    "RankPrefix",
    "Region",
]

DEFAULT_REGION_SIZE = 64 << 20
DEFAULT_TIMEOUT = 60.0

BytesLike = Union[bytes, bytearray, memoryview]
#: A PUT item value: bytes to copy into the region, or an (offset, length)
#: range already written in the region.
PutValue = Union[BytesLike, tuple[int, int]]


class KvtierError(Exception):
    """The daemon refused or failed a request.

    ``code`` is the protocol's error name (``"out-of-range"``, ``"no-space"``,
    ``"unknown-namespace"``, ...) or ``None`` for client-side errors.
    """

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(f"{message} ({code})" if code else message)
        self.code = code
        self.message = message


class KvtierUnavailable(KvtierError):
    """The daemon cannot be reached: connect failed, connection lost or timed out."""


class KvtierProtocolError(KvtierError):
    """A reply that does not decode: the connection is closed."""


@dataclass(frozen=True)
class LookupResult:
    """Result of :meth:`KvtierClient.lookup`."""

    prefix: int
    """Number of leading keys present."""
    locations: list[str]
    """Per key: ``"ram"``, ``"disk"``, ``"peer"`` or ``"miss"``."""


@dataclass(frozen=True)
class RankPrefix:
    """Per-rank part of a cluster lookup."""

    rank: int
    prefix: int
    """Longest prefix present anywhere in the cluster."""
    ram_prefix: int
    """Longest prefix in RAM on the rank's own node."""


@dataclass(frozen=True)
class ClusterLookupResult:
    """Result of :meth:`KvtierClient.cluster_lookup`."""

    min_prefix: int
    ranks: list[RankPrefix] = field(default_factory=list)


@dataclass(frozen=True)
class GetResult:
    """Per-key result of :meth:`KvtierClient.get`."""

    key: bytes
    status: str
    """``"hit-ram"``, ``"hit-disk"``, ``"hit-peer"``, ``"miss"`` or ``"too-small"``."""
    offset: int
    """Where in the region the chunk was (or would have been) written."""
    length: int
    """Bytes written (hit), bytes needed (too-small), 0 (miss)."""
    data: memoryview | None
    """For a hit, a view of the region at [offset, offset + length); valid
    until the region range is reused."""

    @property
    def hit(self) -> bool:
        return self.status.startswith("hit-")


class Region:
    """A shared-memory region: a memfd sealed against shrinking, mapped here.

    ``buffer`` is a writable memoryview of all of it; ``address`` its start
    address (for ``cudaHostRegister``); ``size`` its length.
    """

    def __init__(self, size: int, name: str = "kvtier-region") -> None:
        if size <= 0:
            raise ValueError("region size must be positive")
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # The daemon refuses regions that could shrink under its mapping.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            self._mmap = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        anchor = ctypes.c_char.from_buffer(self._mmap)
        self.address: int = ctypes.addressof(anchor)
        del anchor
        self.buffer: memoryview = memoryview(self._mmap)

    def view(self, offset: int, length: int) -> memoryview:
        """A view of [offset, offset + length)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range offset {offset} length {length} is outside the region of {self.size} bytes")
        return self.buffer[offset : offset + length]

    def numpy(self, dtype: Any = "uint8", offset: int = 0, count: int = -1) -> Any:
        """A numpy array over the region (no copy). Requires numpy."""
        import numpy as np

        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset)

    def close(self) -> None:
        """Unmaps and closes. Views handed out (numpy arrays, memoryviews)
        keep the mapping alive until they are gone."""
        if self.fd < 0:
            return
        self.buffer.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # exported views still alive: the mapping goes with them
        os.close(self.fd)
        self.fd = -1


class KvtierClient:
    """A connection to the kvtier daemon with its own shared-memory region.

    ``region_size`` bytes of shared memory are created and registered at
    connect (0: no region; PUT/GET then fail until :meth:`set_region`).
    ``timeout`` (seconds, ``None`` for none) bounds every reply.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        region_size: int = DEFAULT_REGION_SIZE,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self._next_id = 1
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._region: Region | None = None
        self.limits: dict[str, int] = {}
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(self.socket_path)
        except OSError as e:
            self._sock.close()
            self._sock = None
            raise KvtierUnavailable(
                f"cannot connect to the kvtier daemon at {self.socket_path}: {e} (is `kvtier node start` running?)"
            ) from e
        if region_size:
            try:
                self.set_region(Region(region_size))
            except BaseException:
                self.close()
                raise

    # --- plumbing ---------------------------------------------------------

    def __enter__(self) -> KvtierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the connection and the region."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._region is not None:
            self._region.close()
            self._region = None

    @property
    def closed(self) -> bool:
        return self._sock is None

    @property
    def region(self) -> Region:
        """The registered shared-memory region."""
        if self._region is None:
            raise KvtierError("no region is registered on this connection", "no-region")
        return self._region

    def _broken(self, what: str, e: BaseException | None) -> KvtierUnavailable:
        self.close()
        return KvtierUnavailable(f"{what}: {e}" if e else what)

    def _send(self, frame: bytes, fd: int | None = None) -> None:
        if self._sock is None:
            raise KvtierUnavailable("the client is closed")
        try:
            if fd is None:
                self._sock.sendall(frame)
            else:
                sent = socket.send_fds(self._sock, [frame], [fd])
                if sent < len(frame):
                    self._sock.sendall(frame[sent:])
        except socket.timeout as e:
            raise self._broken("timed out sending to the kvtier daemon", e) from e
        except OSError as e:
            raise self._broken("lost the connection to the kvtier daemon", e) from e

    def _recv_exact(self, n: int) -> bytes:
        assert self._sock is not None
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        try:
            while got < n:
                k = self._sock.recv_into(view[got:], n - got)
                if k == 0:
                    raise self._broken("the kvtier daemon closed the connection", None)
                got += k
        except socket.timeout as e:
            raise self._broken("timed out waiting for the kvtier daemon", e) from e
        except OSError as e:
            raise self._broken("lost the connection to the kvtier daemon", e) from e
        return bytes(buf)

    def _call(self, build: Any, *args: Any, fd: int | None = None) -> Any:
        req_id = self._next_id
        self._next_id += 1
        self._send(build(req_id, *args), fd)
        try:
            h = fr.decode_header(self._recv_exact(fr.HEADER_LEN))
            body = self._recv_exact(h.body_len)
            fr.check_body(h, body)
            reply = fr.decode_reply(h, body)
        except fr.FrameError as e:
            self.close()
            raise KvtierProtocolError(str(e)) from e
        if isinstance(reply, fr.ErrorReply):
            if h.req_id not in (req_id, 0):
                self.close()
                raise KvtierProtocolError(f"reply id {h.req_id} does not match request id {req_id}")
            if reply.name in ("malformed", "unsupported-version", "busy"):
                # The daemon closes the connection after these.
                self.close()
                raise KvtierUnavailable(reply.message, reply.name)
            raise KvtierError(reply.message, reply.name)
        if h.req_id != req_id:
            self.close()
            raise KvtierProtocolError(f"reply id {h.req_id} does not match request id {req_id}")
        return reply

    # --- ops --------------------------------------------------------------

    def ping(self) -> None:
        """Round trip with an empty body."""
        self._call(fr.ping)

    def hello(self, record: dict[str, Any]) -> bytes:
        """Registers a namespace record (kebab-case keys: ``model``,
        ``model-revision``, ``engine``, ``engine-version``, ``tp-size``,
        ``rank``, ``kv-dtype``, ``block-size``, ``chunk-tokens``,
        ``hash-algo``, ``layout``, ``format-version``, ``salt``, ``info``);
        returns its 16-byte namespace id. Unknown keys are refused."""
        reply = self._call(fr.hello, record)
        self.limits = {k: v for k, v in reply.items() if k != "ns"}
        return bytes(reply["ns"])

    def set_region(self, region: Region) -> None:
        """Registers ``region`` with the daemon (replacing the current one,
        which is closed). The client takes ownership of it."""
        self._call(fr.register_region, region.size, fd=region.fd)
        old, self._region = self._region, region
        if old is not None and old is not region:
            old.close()

    def lookup(self, ns: bytes, keys: Sequence[bytes], group: int = 0) -> LookupResult:
        """Longest present prefix of ``keys`` (32 bytes each) and where each
        key lives. Touches no disk and no network on the daemon."""
        prefix, locations = self._call(fr.lookup, ns, group, keys)
        return LookupResult(prefix, locations)

    def lookup_in_region(self, ns: bytes, offset: int, count: int, group: int = 0) -> LookupResult:
        """:meth:`lookup` of ``count`` keys (32 bytes each) already written at
        ``offset`` in the region: the keys travel in shared memory, not in the
        request frame (fewer copies for large batches)."""
        prefix, locations = self._call(fr.lookup_in_region, ns, group, offset, count)
        return LookupResult(prefix, locations)

    def cluster_lookup(
        self, record: dict[str, Any], ranks: Sequence[int], keys: Sequence[bytes], group: int = 0
    ) -> ClusterLookupResult:
        """Per-rank prefixes for the family of ``record`` (its rank is
        ignored) and their minimum."""
        min_prefix, ranks_out = self._call(fr.cluster_lookup, record, list(ranks), group, keys)
        return ClusterLookupResult(min_prefix, [RankPrefix(*r) for r in ranks_out])

    def put(
        self,
        ns: bytes,
        items: Iterable[tuple[bytes, PutValue]],
        group: int = 0,
        atomic: bool = False,
    ) -> list[str]:
        """Stores chunks. Each item is ``(key, value)`` where ``value`` is an
        ``(offset, length)`` range already written in the region (zero-copy)
        or bytes-like data, which is first copied into the region after the
        end of every range named in this call. Returns per item ``"ok"`` or
        an error name (e.g. ``"no-space"``); a request-level problem
        (unknown namespace, range outside the region) raises KvtierError and
        stores nothing. ``atomic``: all chunks become visible together or
        none do."""
        items = list(items)
        region = self.region
        ranges: list[tuple[bytes, int, int] | None] = []
        staged: list[tuple[int, BytesLike]] = []
        high = 0
        for i, (key, value) in enumerate(items):
            if isinstance(value, tuple):
                off, length = value
                ranges.append((key, off, length))
                high = max(high, off + length)
            else:
                ranges.append(None)
                staged.append((i, value))
        off = high
        for i, data in staged:
            mv = memoryview(data).cast("B")
            n = mv.nbytes
            if off + n > region.size:
                raise KvtierError(
                    f"PUT data ({off + n} bytes with the ranges named) does not fit the region of {region.size} bytes",
                    "too-large",
                )
            region.buffer[off : off + n] = mv
            ranges[i] = (items[i][0], off, n)
            off += n
        entries = [r for r in ranges if r is not None]
        codes = self._call(fr.put, ns, group, entries, atomic)
        return ["ok" if c == 0 else fr.ERROR_NAMES.get(c, "internal") for c in codes]

    def get(
        self,
        ns: bytes,
        keys: Sequence[bytes],
        group: int = 0,
        into: Sequence[tuple[int, int]] | None = None,
    ) -> list[GetResult]:
        """Reads chunks into the region. ``into`` gives one ``(offset,
        capacity)`` range per key; by default the region is split into equal
        consecutive ranges. Hits carry a memoryview of the bytes written."""
        region = self.region
        if into is None:
            if not keys:
                return []
            cap = region.size // len(keys)
            into = [(i * cap, cap) for i in range(len(keys))]
        if len(into) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(into)} destination ranges")
        entries = [(k, off, cap) for k, (off, cap) in zip(keys, into)]
        results = self._call(fr.get, ns, group, entries)
        out = []
        for (key, off, _cap), (status, length) in zip(entries, results):
            data = region.buffer[off : off + length] if status.startswith("hit-") else None
            out.append(GetResult(bytes(key), status, off, length, data))
        return out

    def get_bytes(self, ns: bytes, key: bytes, group: int = 0) -> bytes | None:
        """One chunk as bytes (a copy), or None on a miss."""
        r = self.get(ns, [key], group, into=[(0, self.region.size)])[0]
        if r.status == "too-small":
            raise KvtierError(f"chunk of {r.length} bytes does not fit the region of {self.region.size}", "too-large")
        return bytes(r.data) if r.data is not None else None

    def delete(self, ns: bytes, keys: Sequence[bytes], group: int = 0) -> list[bool]:
        """Removes chunks; per key whether it existed."""
        return list(self._call(fr.delete, ns, group, keys))

    def flush(self) -> dict[str, int]:
        """Returns once every chunk dirty at the call is durable:
        ``{"chunks", "bytes", "failed"}``."""
        return dict(self._call(fr.flush))

    def stats(self) -> dict[str, Any]:
        """Store and node counters (``node``, ``uptime-secs``, ``store``, ``counters``)."""
        return dict(self._call(fr.stats))

