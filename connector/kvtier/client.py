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

Pipelining: ``submit_put`` / ``submit_get`` send a request and return a
:class:`Pending` at once; ``.wait()`` returns its result. Several requests in
flight on one connection let the daemon work on one while Python prepares
the next (the daemon answers in order)::

    pending = [c.submit_get(ns, [k], into=[(i * size, size)]) for i, k in enumerate(keys)]
    results = [p.wait()[0] for p in pending]

A submit waits for the oldest replies first while ``max_in_flight`` requests
(64) or about 32 KiB of replies are unread, so that the replies always fit
the socket's buffer (the daemon reads no request while a reply write
blocks). An interrupt (Ctrl-C) during ``wait()`` leaves the connection in
step, and the wait can be retried; one during a send closes the client.

Concurrency contract: do not modify a PUT range or read a GET range until
the call (or its ``wait()``) has returned. One client (one connection) must
not be used from two threads at once; open one client per thread. A client
does not survive ``fork()``: in the child it is closed (its requests would
share the parent's connection), so open a new one there.

Errors: :class:`KvtierError` (the daemon refused a request; ``.code`` is the
error name, e.g. ``"out-of-range"``), :class:`KvtierUnavailable` (cannot
connect, connection lost, timeout; the client is closed afterwards),
:class:`KvtierProtocolError` (a reply that does not decode).
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import mmap
import operator
import os
import select
import socket
import struct
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Sequence, TypeVar, Union

from . import _frames as fr

__all__ = [
    "ClusterLookupResult",
    "GetResult",
    "KvtierClient",
    "KvtierError",
    "KvtierProtocolError",
    "KvtierUnavailable",
    "LookupResult",
    "Pending",
    "RankPrefix",
    "Region",
]

DEFAULT_REGION_SIZE = 64 << 20
DEFAULT_TIMEOUT = 60.0
#: Requests a client keeps in flight at most (``submit_*``): one more waits
#: for the oldest reply first.
DEFAULT_MAX_IN_FLIGHT = 64
# Reply bytes a client lets pile up unread, at most (one larger reply is
# always allowed, alone). This client stops reading replies while a request
# send blocks; the daemon reads up to 16 MiB of requests ahead while a reply
# write blocks (daemons before that read none). Replies that fit the
# socket's buffer (a Unix socket's default is 208 KiB, counted with ~1 KiB
# of kernel overhead per message) keep the two from deadlocking with any
# daemon, and keep the replies waiting for this client small.
_REPLY_BUDGET = 32 << 10
_REPLY_OVERHEAD = 1 << 10

#: Environment variable giving a client's default polling time in
#: microseconds (at most 1,000; 0 never polls), as the Rust client reads it.
CLIENT_SPIN_ENV = "KVTIER_CLIENT_SPIN_US"


def _default_spin() -> float:
    value = os.environ.get(CLIENT_SPIN_ENV, "").strip()
    return min(int(value), 1000) * 1e-6 if value.isdigit() else 50e-6


#: Seconds a client polls for a reply before it sleeps on the socket, while
#: the system has a CPU to spare (see :func:`may_poll`); 0 never polls. As
#: the daemon's ``native-spin``: a reply that comes back within it costs no
#: wake-up of this thread, which on a virtual machine whose idle CPUs halt is
#: tens of microseconds. 50 us, or ``KVTIER_CLIENT_SPIN_US`` when set.
DEFAULT_SPIN = _default_spin()
# How long a sample of the run queue is trusted, in seconds.
_SAMPLE_EVERY = 0.02

T = TypeVar("T")
# Bytes read from the socket at once (more when a reply needs it).
_RECV_BUFFER = 64 << 10

# Every open client, to close in a forked child (`_after_fork_in_child`).
_LIVE: weakref.WeakSet[KvtierClient] = weakref.WeakSet()


def _close_after_fork() -> None:
    for client in list(_LIVE):
        client._after_fork_in_child()


os.register_at_fork(after_in_child=_close_after_fork)

BytesLike = Union[bytes, bytearray, memoryview]
#: A PUT item value: bytes to copy into the region, or an (offset, length)
#: range already written in the region.
PutValue = Union[BytesLike, tuple[int, int]]


class _SpinGate:
    """Whether polling pays: only while the system has a CPU to spare (the
    daemon's rule, ``node/src/native/spin.rs``). A poller takes a core from
    work that needs it on a loaded machine, where wake-ups are cheap anyway."""

    sampled_at = -1.0
    spare = False


def parse_runnable(loadavg: str) -> int | None:
    """The count of runnable threads in a ``/proc/loadavg`` line
    (``"0.05 0.10 0.20 3/412 9876"`` -> 3), ``None`` if it has none."""
    fields = loadavg.split()
    if len(fields) < 4 or "/" not in fields[3]:
        return None
    running, total = fields[3].split("/", 1)
    if not (running.isdigit() and total.isdigit()):
        return None
    return int(running)


def spare_cpu(runnable: int, cpus: int) -> bool:
    """Whether ``runnable`` threads system-wide (the sampling thread, about
    to poll, and every other poller among them) fit on ``cpus`` CPUs. Zero
    is no reading (the sampler itself runs)."""
    return 0 < runnable <= cpus


def usable_cpus() -> int:
    """CPUs this process may use: its affinity, bounded by a cgroup v2 CPU
    quota (``cpu.max``) where one is set, as Rust's
    ``available_parallelism`` counts them."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
        if path is not None:
            with open(f"/sys/fs/cgroup{path}/cpu.max") as f:
                quota, period = f.read().split()[:2]
            if quota != "max" and int(period) > 0:
                cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError, IndexError):
        pass
    return cpus


def may_poll() -> bool:
    """Whether a thread about to poll may: the last sample of the run queue
    (``/proc/loadavg``, taken at most every 20 ms) found every runnable
    thread a CPU."""
    g = _SpinGate
    now = time.monotonic()
    if now - g.sampled_at >= _SAMPLE_EVERY:
        g.sampled_at = now
        try:
            with open("/proc/loadavg") as f:
                runnable = parse_runnable(f.read())
        except OSError:
            runnable = None
        g.spare = runnable is not None and spare_cpu(runnable, usable_cpus())
    return g.spare


class KvtierError(Exception):
    """The daemon refused or failed a request.

    ``code`` is the protocol's error name (``"out-of-range"``, ``"no-space"``,
    ``"unknown-namespace"``, ...); for errors found by the client it is
    ``"too-large"`` (data that does not fit the region), ``"no-region"``, or
    ``None``.
    """

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(f"{message} ({code})" if code else message)
        self.code = code
        self.message = message


class KvtierUnavailable(KvtierError):
    """The daemon cannot be reached: connect failed, connection lost or timed out.

    ``closed_by_peer`` is True when the daemon closed the connection (end of
    stream, broken pipe, connection reset) before any byte of the reply
    arrived: the daemon restarted, or dropped the connection. The request may
    or may not have been carried out; an idempotent one (HELLO, LOOKUP, GET,
    a PUT of the same bytes under the same keys) can be sent again on a new
    connection. It is False for timeouts, failed connects and a connection
    lost in the middle of a reply. With several requests in flight, each
    of them is flagged, also one the daemon had answered (its reply went
    with the connection): retry only idempotent requests.
    """

    def __init__(self, message: str, code: str | None = None, closed_by_peer: bool = False) -> None:
        super().__init__(message, code)
        self.closed_by_peer = closed_by_peer


class KvtierProtocolError(KvtierError):
    """A reply that does not decode: the connection is closed."""


class LookupResult:
    """Result of :meth:`KvtierClient.lookup`: ``prefix``, the number of
    leading keys present, and ``locations``, per key ``"ram"``, ``"disk"``,
    ``"peer"`` or ``"miss"`` (named when first read: most callers want the
    prefix only). ``codes`` holds them as bytes, one per key, indexes into
    ``kvtier._frames.LOCATIONS``. Built from either: ``LookupResult(2,
    b"\\x01\\x01")`` or ``LookupResult(2, ["ram", "ram"])`` (or
    ``locations=[...]``). Read-only."""

    __slots__ = ("_prefix", "_codes", "_locations")

    def __init__(
        self, prefix: int, codes: bytes | Sequence[str] = b"", *, locations: Sequence[str] | None = None
    ) -> None:
        if locations is not None:
            codes = locations
        self._prefix = prefix
        self._locations: list[str] | None = None
        if isinstance(codes, (bytes, bytearray)):
            self._codes = bytes(codes)
        else:
            names = list(codes)
            try:
                self._codes = bytes(fr.LOCATIONS.index(n) for n in names)
            except ValueError:
                raise ValueError(f"locations are names of {fr.LOCATIONS}, got {names!r}") from None
            self._locations = names

    @property
    def prefix(self) -> int:
        return self._prefix

    @property
    def codes(self) -> bytes:
        return self._codes

    @property
    def locations(self) -> list[str]:
        if self._locations is None:
            names = fr.LOCATIONS
            self._locations = [names[c] for c in self._codes]
        return self._locations

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LookupResult):
            return NotImplemented
        return self._prefix == other._prefix and self._codes == other._codes

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LookupResult(prefix={self._prefix}, locations={self.locations!r})"


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
        # A region dropped without close() gives its descriptor (and so its
        # memory, once the mapping goes too) back when it is collected (QA:
        # a dropped client held its region's memory until the process ended).
        self._close_fd = weakref.finalize(self, os.close, self.fd)

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
        self._close_fd()
        self.fd = -1


def _identity(reply: Any) -> Any:
    return reply


def _pairs(items: Iterable[Any]) -> list[Any]:
    """PUT items as a list, each checked to be a ``(key, value)`` pair."""
    out = list(items)
    for i, item in enumerate(out):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"put items are (key, value) pairs; item {i} is a {type(item).__name__}")
    return out


def _bytes_view(data: Any) -> memoryview:
    """``data`` as a flat byte view, or a TypeError naming the fix."""
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise TypeError("PUT values must be C-contiguous buffers; copy it first (e.g. numpy.ascontiguousarray)")
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def _offset_in(mv: memoryview, region: Region) -> int | None:
    """Where ``mv``'s bytes lie in ``region``: their offset, -1 for a
    read-only view of it (no address at hand), None when they are not in it."""
    if mv.nbytes == 0:
        return None
    if mv.readonly:
        # A bytes object is never region memory; any other read-only buffer
        # (a read-only numpy view of the region...) may be, with no address
        # at hand: it is copied out.
        return None if isinstance(mv.obj, bytes) else -1
    address = ctypes.addressof(ctypes.c_char.from_buffer(mv))
    at = address - region.address
    return at if 0 <= at and at + mv.nbytes <= region.size else None


def _first_fit(ranges: list[tuple[int, int]], n: int, size: int) -> int | None:
    """The first offset where ``n`` bytes fit in ``[0, size)`` between the
    sorted ``(start, end)`` ``ranges``, or None."""
    off = 0
    for start, end in ranges:
        if off + n <= start:
            break
        off = max(off, end)
    return off if off + n <= size else None


def _peer_closed(e: OSError) -> bool:
    """Whether a socket error means that the daemon closed the connection."""
    return isinstance(e, (BrokenPipeError, ConnectionResetError))


def _put_codes(codes: Any) -> list[str]:
    return ["ok" if c == 0 else fr.ERROR_NAMES.get(c, "internal") for c in codes]


def _answers(replies: Any, n: int, op: str) -> Any:
    """``replies`` when it has one entry per key of the request, else a
    :class:`KvtierProtocolError` (QA: ``zip`` cut a short GET reply)."""
    if len(replies) != n:
        raise KvtierProtocolError(f"the daemon answered {len(replies)} entries to a {op} of {n}")
    return replies


class Pending(Generic[T]):
    """A request sent on a connection whose reply may not have been read yet
    (:meth:`KvtierClient.submit_put`, :meth:`KvtierClient.submit_get`).

    ``wait()`` reads replies (in order, those of earlier requests included)
    until this one's has arrived, and returns its result or raises its error.
    If the connection fails, every request in flight on it fails with
    :class:`KvtierUnavailable`.
    """

    __slots__ = ("_client", "req_id", "_op", "_decode", "_done", "_value", "_error", "_reply_bytes")

    def __init__(
        self, client: KvtierClient, req_id: int, decode: Callable[[Any], T], reply_bytes: int = 0, op: int = 0
    ) -> None:
        self._client = client
        self.req_id = req_id
        # The request's op (its reply must carry it; 0: none sent).
        self._op = op
        self._decode = decode
        self._reply_bytes = reply_bytes
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        """Whether the reply has been read (``wait()`` will not block)."""
        return self._done

    def wait(self) -> T:
        """The result; blocks until the reply has been read."""
        if not self._done:
            self._client._wait_for(self)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def _resolve(self, reply: Any) -> None:
        # An interrupt (Ctrl-C) while decoding leaves the request unresolved
        # and its reply unconsumed: a retried wait() decodes it again.
        try:
            self._value = self._decode(reply)
        except Exception as e:  # noqa: BLE001 - handed to wait()
            self._error = e
        self._done = True

    def _fail(self, error: BaseException) -> None:
        if self._done:
            # Resolved already (its reply was taken before an interrupt cut
            # the rest short): a later failure of the connection is not its.
            return
        self._error = error
        self._done = True


class KvtierClient:
    """A connection to the kvtier daemon with its own shared-memory region.

    ``region_size`` bytes of shared memory are created and registered at
    connect (0: no region; PUT/GET then fail until :meth:`set_region`).
    ``timeout`` (seconds, ``None`` for none) bounds every reply.
    ``max_in_flight`` bounds the requests sent and not yet answered.
    ``spin`` (seconds, at most 0.001) is how long a wait for a reply polls
    before it sleeps, only while the system has a CPU to spare (default
    50 us, or ``KVTIER_CLIENT_SPIN_US`` microseconds when set; 0 never
    polls).
    ``region``: a :class:`Region` to register instead of creating one of
    ``region_size`` bytes. It stays the caller's: :meth:`close` (and a lost
    connection) leave it open, so that it can be registered again on a new
    connection, bytes intact, after the daemon restarted.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        region_size: int = DEFAULT_REGION_SIZE,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        spin: float | None = None,
        region: Region | None = None,
    ) -> None:
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError("max_in_flight must be an integer of at least 1")
        if spin is None:
            spin = _default_spin()
        if not 0 <= spin <= 1e-3:
            raise ValueError("spin must be between 0 and 0.001 seconds")
        self.spin = spin
        self.socket_path = os.fspath(socket_path)
        self.max_in_flight = max_in_flight
        self._in_flight: collections.deque[Pending[Any]] = collections.deque()
        self._reply_bytes = 0  # estimated, of the requests in flight
        # Received and not yet decoded: buf[_rpos:_rend].
        self._rbuf = bytearray(_RECV_BUFFER)
        self._rpos = self._rend = 0
        self._next_id = 1
        # What a call on a closed client says.
        self._closed_why = "the client is closed"
        if timeout is not None and timeout <= 0:
            raise ValueError("timeout must be positive seconds, or None for none")
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._region: Region | None = None
        # Whether close() closes the region (False: the caller's, see `region`).
        self._owns_region = True
        self.limits: dict[str, int] = {}
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(self.socket_path)
            self._poller = select.poll()
            self._poller.register(self._sock, select.POLLIN)
        except OSError as e:
            self._sock.close()
            self._sock = None
            raise KvtierUnavailable(
                f"cannot connect to the kvtier daemon at {self.socket_path}: {e} (is `kvtier node start` running?)"
            ) from e
        _LIVE.add(self)
        if region is not None or region_size:
            try:
                if region is not None:
                    self.set_region(region, owned=False)
                else:
                    own = Region(region_size)
                    try:
                        self.set_region(own)
                    except BaseException:
                        own.close()
                        raise
            except BaseException:
                self.close()
                raise

    # --- plumbing ---------------------------------------------------------

    def __enter__(self) -> KvtierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the connection and the region. Requests still in flight
        fail with :class:`KvtierUnavailable`."""
        self._fail_in_flight(KvtierUnavailable("the client was closed with the request in flight"))
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._closed_why = "the client is closed (close() was called)"
        if self._region is not None:
            if self._owns_region:
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

    def _broken(self, what: str, e: BaseException | None, closed_by_peer: bool = False) -> KvtierUnavailable:
        """Closes the client; the error fails every request in flight too.
        ``closed_by_peer``: the daemon closed the connection, and no byte of
        a reply is buffered (see :class:`KvtierUnavailable`)."""
        err = KvtierUnavailable(
            f"{what}: {e}" if e else what, closed_by_peer=closed_by_peer and self._rend == self._rpos
        )
        err.__cause__ = e
        self._broken_in_flight(err)
        return err

    def _after_fork_in_child(self) -> None:
        """In a forked child: the socket is the parent's connection too (a
        request from here could take the parent's reply, or give the parent
        this one's), so the child's copy is closed and the client refuses
        every call. The parent's connection is untouched (no shutdown)."""
        if self._sock is None:
            return
        self._fail_in_flight(KvtierUnavailable("the process forked with the request in flight"))
        self._in_flight.clear()
        self._sock.close()
        self._sock = None
        self._closed_why = (
            "this client was opened by the parent of this process (fork()); open a new KvtierClient in this process"
        )
        if self._region is not None:
            if self._owns_region:
                self._region.close()
            self._region = None

    def _send(self, frame: bytes, fd: int | None = None) -> None:
        if self._sock is None:
            raise KvtierUnavailable(self._closed_why)
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
            said = self._parting_error()
            if said is not None:
                self._broken_in_flight(said)
                raise said from e
            raise self._broken("lost the connection to the kvtier daemon", e, _peer_closed(e)) from e

    def _parting_error(self) -> KvtierUnavailable | None:
        """The error the daemon sent before it closed the connection (``busy``
        past ``max-connections``), if one is waiting to be read."""
        assert self._sock is not None
        try:
            # A socket with a timeout waits for it even with MSG_DONTWAIT.
            if not self._poller.poll(0):
                return None
            data = self._sock.recv(4096 + fr.HEADER_LEN, socket.MSG_DONTWAIT)
            h = fr.decode_header(data[: fr.HEADER_LEN])
            body = data[fr.HEADER_LEN : fr.HEADER_LEN + h.body_len]
            fr.check_body(h, body)
            reply = fr.decode_reply(h, body)
        except (OSError, fr.FrameError, ValueError):
            return None
        if isinstance(reply, fr.ErrorReply):
            return KvtierUnavailable(reply.message, reply.name)
        return None

    def _fill(self, n: int) -> None:
        """Reads until at least ``n`` bytes are buffered (consuming none).
        Reads whatever the socket has, up to the buffer's size, so that one
        ``recv`` usually brings a whole reply, or several when pipelined."""
        assert self._sock is not None
        buf = self._rbuf
        while self._rend - self._rpos < n:
            if self._rpos:
                # Move what is left to the front (rarely more than a header).
                left = self._rend - self._rpos
                buf[:left] = buf[self._rpos : self._rend]
                self._rpos, self._rend = 0, left
            if len(buf) < n:
                buf.extend(bytes(n - len(buf)))
            if self.spin and may_poll():
                self._poll_for_reply()
            try:
                k = self._sock.recv_into(memoryview(buf)[self._rend :])
            except socket.timeout as e:
                raise self._broken("timed out waiting for the kvtier daemon", e) from e
            except OSError as e:
                raise self._broken("lost the connection to the kvtier daemon", e, _peer_closed(e)) from e
            if k == 0:
                raise self._broken("the kvtier daemon closed the connection", None, closed_by_peer=True)
            self._rend += k

    def _poll_for_reply(self) -> None:
        """Polls (without sleeping) for up to ``self.spin`` seconds until the
        socket has bytes to read."""
        deadline = time.perf_counter() + self.spin
        while not self._poller.poll(0) and time.perf_counter() < deadline:
            pass

    def _consume(self, n: int) -> None:
        self._rpos += n
        if self._rpos == self._rend:
            self._rpos = self._rend = 0
            if len(self._rbuf) > _RECV_BUFFER:
                # A large reply (STATS, a big LOOKUP) grew it: give the memory back.
                del self._rbuf[_RECV_BUFFER:]

    def _fail_in_flight(self, error: BaseException) -> None:
        while self._in_flight:
            self._in_flight.popleft()._fail(error)
        self._reply_bytes = 0

    def _pop_head(self) -> Pending[Any]:
        head = self._in_flight.popleft()
        self._reply_bytes -= head._reply_bytes
        return head

    def _check_open(self) -> None:
        if self._sock is None:
            raise KvtierUnavailable(self._closed_why)

    def _submit(
        self,
        decode: Callable[[Any], T],
        build: Any,
        *args: Any,
        fd: int | None = None,
        reply_bytes: int = 64,
    ) -> Pending[T]:
        """Sends one request whose reply is about ``reply_bytes`` long; the
        reply is read by ``wait()`` (or by a later call that needs the
        replies before it). Waits for the oldest replies first while
        ``max_in_flight`` requests, or the reply budget, are in flight."""
        self._check_open()
        reply_bytes += _REPLY_OVERHEAD
        while self._in_flight and (
            len(self._in_flight) >= self.max_in_flight or self._reply_bytes + reply_bytes > _REPLY_BUDGET
        ):
            self._wait_for(self._in_flight[0])
        self._check_open()
        req_id = self._next_id
        self._next_id += 1
        try:
            frame = build(req_id, *args)
        except struct.error as e:
            # An integer out of its field's range (a group over 65535, a
            # negative offset, a float): said in the caller's terms.
            raise ValueError(
                f"{e}: groups are 0..65535; ranks, offsets, lengths, capacities and counts are non-negative integers"
            ) from None
        # The op, from the frame's header (bytes 6..8).
        pending: Pending[T] = Pending(self, req_id, decode, reply_bytes, int.from_bytes(frame[6:8], "little"))
        # In flight from before the send: a send that fails fails it too.
        self._in_flight.append(pending)
        self._reply_bytes += reply_bytes
        try:
            self._send(frame, fd)
        except KvtierUnavailable:
            raise
        except BaseException:
            # Interrupted mid-send (Ctrl-C): part of a frame may be on the
            # wire, so the stream cannot be trusted any more.
            self._broken_in_flight(KvtierUnavailable("interrupted while sending a request; the connection is closed"))
            raise
        return pending

    def _wait_for(self, pending: Pending[Any]) -> None:
        while not pending._done:
            if not self._in_flight:
                # Only a closed client leaves a request neither answered nor in flight.
                pending._fail(KvtierUnavailable(self._closed_why))
                return
            self._read_reply()
        self._settle_head()

    def _settle_head(self) -> None:
        """Finishes taking a reply that an interrupt (Ctrl-C, a signal
        handler's exception) cut short after its request was resolved: the
        head of the queue is then done, its reply frame consumed or not yet
        (told by the frame's request id, which only its reply carries)."""
        while self._in_flight and self._in_flight[0]._done:
            head = self._in_flight[0]
            if self._rend - self._rpos >= fr.HEADER_LEN:
                h = fr.decode_header(bytes(self._rbuf[self._rpos : self._rpos + fr.HEADER_LEN]))
                if h.req_id == head.req_id and self._rend - self._rpos >= fr.HEADER_LEN + h.body_len:
                    self._consume(fr.HEADER_LEN + h.body_len)
            self._pop_head()

    def _read_reply(self) -> None:
        """Reads the reply of the oldest request in flight and resolves it.
        A reply that does not decode or belongs to another request closes
        the connection and fails every request in flight."""
        self._settle_head()
        if not self._in_flight:
            return
        head = self._in_flight[0]
        try:
            # Nothing is consumed until the reply is decoded and its request
            # resolved: an interrupted wait() can simply be retried (an
            # interrupt after the resolve is finished by `_settle_head`).
            self._fill(fr.HEADER_LEN)
            h = fr.decode_header(bytes(self._rbuf[self._rpos : self._rpos + fr.HEADER_LEN]))
            self._fill(fr.HEADER_LEN + h.body_len)
            start = self._rpos + fr.HEADER_LEN
            body = bytes(self._rbuf[start : start + h.body_len])
            fr.check_body(h, body)
            reply = fr.decode_reply(h, body)
        except fr.FrameError as e:
            self._broken_in_flight(KvtierProtocolError(str(e)))
            return
        except KvtierUnavailable as e:
            # _fill closed the client; the others fail with the cause.
            self._fail_in_flight(e)
            return
        if isinstance(reply, fr.ErrorReply):
            if h.req_id not in (head.req_id, 0):
                self._broken_in_flight(
                    KvtierProtocolError(f"reply id {h.req_id} does not match request id {head.req_id}")
                )
            elif reply.name in ("malformed", "unsupported-version", "busy"):
                # The daemon closes the connection after these.
                self._broken_in_flight(KvtierUnavailable(reply.message, reply.name))
            else:
                head._fail(KvtierError(reply.message, reply.name))
                self._consume(fr.HEADER_LEN + h.body_len)
                self._pop_head()
            return
        if h.req_id != head.req_id:
            self._broken_in_flight(KvtierProtocolError(f"reply id {h.req_id} does not match request id {head.req_id}"))
            return
        if h.op & ~fr.REPLY_BIT != head._op:
            # QA: a PING's reply to a LOOKUP raised TypeError, a DELETE's to
            # a PUT came back as codes.
            self._broken_in_flight(
                KvtierProtocolError(f"reply op {h.op & ~fr.REPLY_BIT} does not match request op {head._op}")
            )
            return
        head._resolve(reply)
        # Cut short between these steps, `_settle_head` ends the job.
        self._consume(fr.HEADER_LEN + h.body_len)
        self._pop_head()
        if isinstance(head._error, KvtierProtocolError):
            # A reply that does not fit its request (its decode said so):
            # nothing after it on this connection can be trusted.
            self._broken_in_flight(head._error)

    def _broken_in_flight(self, error: KvtierError) -> None:
        """Fails every request in flight with ``error`` and closes the
        client; later calls say why (QA: they said that close() was called)."""
        self._fail_in_flight(error)
        self.close()
        self._closed_why = f"the client is closed: {error}"

    def _call(self, build: Any, *args: Any, fd: int | None = None, reply_bytes: int = 64) -> Any:
        return self._submit(_identity, build, *args, fd=fd, reply_bytes=reply_bytes).wait()

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

    def set_region(self, region: Region, owned: bool = True) -> None:
        """Registers ``region`` with the daemon (replacing the current one,
        which is closed if the client owns it). The client takes ownership
        of it, unless ``owned`` is False (then it is never closed here)."""
        if region.fd < 0:
            raise ValueError("the region is closed")
        self._call(fr.register_region, region.size, fd=region.fd)
        old, old_owned = self._region, self._owns_region
        self._region, self._owns_region = region, owned
        if old is not None and old is not region and old_owned:
            old.close()

    def lookup(self, ns: bytes, keys: Sequence[bytes], group: int = 0) -> LookupResult:
        """Longest present prefix of ``keys`` (32 bytes each) and where each
        key lives. Touches no disk and no network on the daemon."""
        n = len(keys)
        return self._submit(
            lambda r: LookupResult(r[0], _answers(r[1], n, "LOOKUP")), fr.lookup, ns, group, keys, reply_bytes=40 + n
        ).wait()

    def lookup_in_region(self, ns: bytes, offset: int, count: int, group: int = 0) -> LookupResult:
        """:meth:`lookup` of ``count`` keys (32 bytes each) already written at
        ``offset`` in the region: the keys travel in shared memory, not in the
        request frame (fewer copies for large batches)."""
        return self._submit(
            lambda r: LookupResult(r[0], _answers(r[1], count, "LOOKUP")),
            fr.lookup_in_region,
            ns,
            group,
            offset,
            count,
            reply_bytes=40 + count,
        ).wait()

    def cluster_lookup(
        self, record: dict[str, Any], ranks: Sequence[int], keys: Sequence[bytes], group: int = 0
    ) -> ClusterLookupResult:
        """Per-rank prefixes for the family of ``record`` (its rank is
        ignored) and their minimum."""
        min_prefix, ranks_out = self._call(
            fr.cluster_lookup, record, list(ranks), group, keys, reply_bytes=40 + 12 * len(ranks)
        )
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
        or bytes-like data, which is first copied into the region where no
        range of this call lies (a value that is a view of the region, such
        as a GET result's ``data``, is stored from where it lies). Staging
        writes over earlier GET results' views outside those ranges. Returns per item ``"ok"`` or
        an error name (e.g. ``"no-space"``); a request-level problem
        (unknown namespace, range outside the region) raises KvtierError and
        stores nothing. ``atomic``: all chunks become visible together or
        none do."""
        items = _pairs(items)
        if any(not isinstance(value, tuple) for _, value in items):
            # Staged bytes go after the ranges of this call, wherever the
            # requests still in flight have theirs: wait for those first.
            self.wait_all()
        return self._submit_put(ns, items, group, atomic, stage=True).wait()

    def submit_put(
        self,
        ns: bytes,
        items: Iterable[tuple[bytes, tuple[int, int]]],
        group: int = 0,
        atomic: bool = False,
    ) -> Pending[list[str]]:
        """:meth:`put` of ``(key, (offset, length))`` ranges already written
        in the region, without waiting for the reply: returns a
        :class:`Pending` whose ``wait()`` gives the per-item codes. Leave the
        ranges alone until then."""
        return self._submit_put(ns, _pairs(items), group, atomic, stage=False)

    def _submit_put(
        self, ns: bytes, items: list[tuple[bytes, PutValue]], group: int, atomic: bool, stage: bool
    ) -> Pending[list[str]]:
        self._check_open()
        region = self.region
        ranges: list[tuple[bytes, int, int] | None] = []
        staged: list[tuple[int, BytesLike]] = []
        for i, (key, value) in enumerate(items):
            if isinstance(value, tuple):
                try:
                    # Any integer type (numpy's too), as the frame takes it.
                    off, length = (operator.index(x) for x in value)
                except (TypeError, ValueError):
                    raise TypeError(f"item {i}: a range is (offset, length), two integers; got {value!r}") from None
                ranges.append((key, off, length))
            elif not stage:
                raise TypeError("submit_put takes (offset, length) ranges in the region; use put() for bytes")
            else:
                ranges.append(None)
                staged.append((i, value))
        # A value that is a view of this region (a GET's `data`, a slice of
        # `region.buffer` or `region.numpy()`) is a zero-copy range already:
        # staging over it would store other bytes under its key.
        copies: list[tuple[int, BytesLike]] = []
        for i, data in staged:
            mv = _bytes_view(data)
            at = _offset_in(mv, region)
            if at is None:
                copies.append((i, mv))
            elif at < 0:
                # A read-only buffer that may be a view of the region (its
                # address is not at hand): copied out before any staging.
                copies.append((i, bytes(mv)))
            else:
                ranges[i] = (items[i][0], at, mv.nbytes)
        # Copies go where no range of this call lies: each after the one
        # before (one pass over the ranges; QA: a first-fit scan per copy
        # took 30 s for 16k small values), then first-fit in what was
        # skipped once the end of the region is reached.
        taken = sorted((r[1], r[1] + r[2]) for r in ranges if r is not None and r[2] > 0)
        placed: list[tuple[int, int]] = []
        off, t = 0, 0
        for i, data in copies:
            mv = memoryview(data).cast("B")
            n = mv.nbytes
            while t < len(taken) and taken[t][0] < off + n:
                off = max(off, taken[t][1])
                t += 1
            at = off
            if at + n > region.size:
                at = _first_fit(sorted(taken + placed), n, region.size)
                if at is None:
                    raise KvtierError(
                        f"PUT data ({n} bytes) does not fit the region of {region.size} bytes beside the other values of this call",
                        "too-large",
                    )
            else:
                off = at + n
            if n:
                placed.append((at, at + n))
            region.buffer[at : at + n] = mv
            ranges[i] = (items[i][0], at, n)
        entries = [r for r in ranges if r is not None]
        n, names = len(entries), _put_codes
        return self._submit(
            lambda codes: names(_answers(codes, n, "PUT")),
            fr.put,
            ns,
            group,
            entries,
            atomic,
            reply_bytes=36 + 2 * n,
        )

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
        return self.submit_get(ns, keys, group, into).wait()

    def submit_get(
        self,
        ns: bytes,
        keys: Sequence[bytes],
        group: int = 0,
        into: Sequence[tuple[int, int]] | None = None,
    ) -> Pending[list[GetResult]]:
        """:meth:`get` without waiting for the reply: returns a
        :class:`Pending` whose ``wait()`` gives the results. Do not read the
        ``into`` ranges until then, and give requests in flight together
        ranges that do not overlap."""
        self._check_open()
        fr.check_key_list(keys)
        region = self.region
        if into is None:
            if not keys:
                return self._done_pending([])
            # The whole region: no request in flight may be writing into it.
            self.wait_all()
            cap = region.size // len(keys)
            into = [(i * cap, cap) for i in range(len(keys))]
        if len(into) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(into)} destination ranges")
        entries = [(k, off, cap) for k, (off, cap) in zip(keys, into)]
        buffer = region.buffer

        def results(replies: Any) -> list[GetResult]:
            out = []
            for (key, off, cap), (status, length) in zip(entries, _answers(replies, len(entries), "GET")):
                hit = status.startswith("hit-")
                if hit and length > cap:
                    # A view past the range would show a neighbour's bytes.
                    raise KvtierProtocolError(f"the daemon wrote a hit of {length} bytes into a range of {cap}")
                data = buffer[off : off + length] if hit else None
                out.append(GetResult(bytes(key), status, off, length, data))
            return out

        return self._submit(results, fr.get, ns, group, entries, reply_bytes=40 + 16 * len(entries))

    def _done_pending(self, value: T) -> Pending[T]:
        p: Pending[T] = Pending(self, 0, _identity)
        p._resolve(value)
        return p

    def wait_all(self) -> None:
        """Reads the replies of every request in flight (their errors stay
        with their :class:`Pending`)."""
        while self._in_flight:
            self._wait_for(self._in_flight[-1])

    def get_bytes(self, ns: bytes, key: bytes, group: int = 0) -> bytes | None:
        """One chunk as bytes (a copy), or None on a miss. Uses the whole
        region: requests in flight are waited for first."""
        self.wait_all()
        r = self.get(ns, [key], group, into=[(0, self.region.size)])[0]
        if r.status == "too-small":
            raise KvtierError(f"chunk of {r.length} bytes does not fit the region of {self.region.size}", "too-large")
        return bytes(r.data) if r.data is not None else None

    def delete(self, ns: bytes, keys: Sequence[bytes], group: int = 0) -> list[bool]:
        """Removes chunks; per key whether it existed."""
        n = len(keys)
        return self._submit(
            lambda r: list(_answers(r, n, "DELETE")), fr.delete, ns, group, keys, reply_bytes=36 + n
        ).wait()

    def flush(self, timeout: float | None = None) -> dict[str, int]:
        """Returns once every chunk dirty at the call is durable:
        ``{"chunks", "bytes", "failed"}``. ``timeout`` (seconds) bounds the
        wait; by default it waits as long as the disk needs (a large dirty
        RAM tier takes minutes), whatever the client's own timeout. When it
        runs out the client is closed (the reply may still come)."""
        if timeout is not None and timeout <= 0:
            # 0 would make the socket non-blocking (QA: the connection broke).
            raise ValueError("timeout must be positive seconds, or None to wait as long as the disk needs")
        if self._sock is None:
            raise KvtierUnavailable(self._closed_why)
        sock, before = self._sock, self._sock.gettimeout()
        sock.settimeout(timeout)
        try:
            return dict(self._call(fr.flush))
        finally:
            if self._sock is sock:
                sock.settimeout(before)

    def stats(self) -> dict[str, Any]:
        """Store and node counters (``node``, ``uptime-secs``, ``store``, ``counters``)."""
        # Its size is unknown: alone in flight.
        return dict(self._call(fr.stats, reply_bytes=_REPLY_BUDGET))

