"""Frame codec of the kvtier native protocol (version 1), pure Python.

Mirrors ``node/src/native/codec.rs``; the layout is specified in
``node/PROTOCOL.md``. Golden fixtures under ``node/tests/fixtures/frames/``
are checked by both implementations.
"""

from __future__ import annotations

import json
import operator
import struct
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

MAGIC = b"KVTN"
VERSION = 1
HEADER_LEN = 32
REPLY_BIT = 0x8000
FLAG_ATOMIC = 0x0001
FLAG_KEYS_IN_REGION = 0x0002

OP_PING = 1
OP_HELLO = 2
OP_REGISTER_REGION = 3
OP_LOOKUP = 4
OP_CLUSTER_LOOKUP = 5
OP_PUT = 6
OP_GET = 7
OP_DELETE = 8
OP_FLUSH = 9
OP_STATS = 10

#: Error codes (header status field) and their stable names.
ERROR_NAMES: dict[int, str] = {
    1: "malformed",
    2: "unsupported-version",
    3: "unknown-op",
    4: "bad-request",
    5: "too-large",
    6: "out-of-range",
    7: "no-region",
    8: "unknown-namespace",
    9: "store",
    10: "no-space",
    11: "unimplemented",
    12: "shutting-down",
    13: "busy",
    14: "internal",
}

#: LOOKUP location codes.
LOCATIONS = ("miss", "ram", "disk", "peer")
_LOCATION_CODES = bytes(range(len(LOCATIONS)))
#: GET status codes.
GET_STATUSES = ("miss", "hit-ram", "hit-disk", "hit-peer", "too-small")

_HEADER = struct.Struct("<4sHHHHIQII")
_HEADER_NO_CRC = struct.Struct("<4sHHHHIQI")
_NSG = struct.Struct("<16sHHI")
_ENTRY = struct.Struct("<32sQQ")
_GET_RESULT = struct.Struct("<B7xQ")
_HELLO_REPLY = struct.Struct("<16sHHIII Q".replace(" ", ""))
_RANK = struct.Struct("<III")


# --- CRC32C (Castagnoli) -------------------------------------------------


def _make_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _make_table()


def _slicing_tables() -> list[list[int]]:
    tables = [_TABLE]
    for _ in range(7):
        prev = tables[-1]
        tables.append([(prev[n] >> 8) ^ _TABLE[prev[n] & 0xFF] for n in range(256)])
    return tables


_T0, _T1, _T2, _T3, _T4, _T5, _T6, _T7 = _slicing_tables()


def _crc32c_bytewise(data: bytes, crc: int = 0) -> int:
    table = _TABLE
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _crc32c_py(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C in pure Python, 8 bytes per step (slicing-by-8)."""
    data = bytes(data)
    n8 = len(data) - len(data) % 8
    t0, t1, t2, t3, t4, t5, t6, t7 = _T0, _T1, _T2, _T3, _T4, _T5, _T6, _T7
    crc ^= 0xFFFFFFFF
    for lo, hi in struct.iter_unpack("<II", data[:n8]):
        x = crc ^ lo
        crc = (
            t7[x & 0xFF]
            ^ t6[(x >> 8) & 0xFF]
            ^ t5[(x >> 16) & 0xFF]
            ^ t4[x >> 24]
            ^ t3[hi & 0xFF]
            ^ t2[(hi >> 8) & 0xFF]
            ^ t1[(hi >> 16) & 0xFF]
            ^ t0[hi >> 24]
        )
    for b in data[n8:]:
        crc = t0[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _fast_crc32c() -> tuple[Callable[[bytes], int], str] | None:
    # Optional accelerators: the stdlib has no CRC32C. Both packages compute
    # the same standard CRC32C; the pure-Python fallback is always correct.
    try:
        import google_crc32c  # type: ignore[import-not-found]

        # Without its C extension the package computes in Python, slower
        # than the slicing-by-8 code here.
        if google_crc32c.implementation == "c":
            return _bytes_only(google_crc32c.value), "google-crc32c"
    except ImportError:
        pass
    try:
        import crc32c as _c  # type: ignore[import-not-found]

        return _bytes_only(_c.crc32c), "crc32c"
    except ImportError:
        return None


def _bytes_only(value: Callable[[bytes], int]) -> Callable[[bytes | bytearray | memoryview], int]:
    """``value`` for any bytes-like data: a C CRC that takes ``bytes`` is
    given a copy of anything else (no copy, no extra call for ``bytes``,
    the frames' case: a wrapper per CRC cost ~0.2 us, three per request)."""

    def crc(data: bytes | bytearray | memoryview) -> int:
        return int(value(data if type(data) is bytes else bytes(data)))

    return crc


crc32c: Callable[[bytes], int]
#: Which CRC32C the frames use: an accelerator package or "pure Python".
CRC32C_IMPL: str
crc32c, CRC32C_IMPL = _fast_crc32c() or (_crc32c_py, "pure Python")


# --- errors ---------------------------------------------------------------


class FrameError(Exception):
    """A frame or body that does not decode (protocol violation)."""


# --- frames ---------------------------------------------------------------


class Header(NamedTuple):
    """A parsed, CRC-checked frame header (a named tuple: built for every
    reply, where a frozen dataclass cost ~0.8 us)."""

    op: int
    flags: int
    status: int
    body_len: int
    req_id: int
    body_crc: int


def encode_frame(op: int, flags: int, status: int, req_id: int, body: bytes) -> bytes:
    """One frame: header + body."""
    head = _HEADER_NO_CRC.pack(MAGIC, VERSION, op, flags, status, len(body), req_id, crc32c(body))
    return head + struct.pack("<I", crc32c(head)) + body


def decode_header(buf: bytes | bytearray | memoryview, max_body: int = 1 << 30) -> Header:
    """Checks magic, version, header CRC and the body limit of a 32-byte header."""
    if type(buf) is not bytes or len(buf) != HEADER_LEN:
        buf = bytes(buf[:HEADER_LEN])
    if buf[:4] != MAGIC[: len(buf[:4])]:
        raise FrameError(f"bad frame magic {buf[:4]!r} (expected b'KVTN')")
    if len(buf) < HEADER_LEN:
        raise FrameError(f"short header: {len(buf)} bytes")
    magic, version, op, flags, status, body_len, req_id, body_crc, header_crc = _HEADER.unpack(buf)
    if version != VERSION:
        raise FrameError(
            f"protocol version mismatch: the daemon speaks version {version}, "
            f"this client speaks version {VERSION}"
        )
    computed = crc32c(buf[:28])
    if computed != header_crc:
        raise FrameError(f"frame header CRC32C mismatch: stored {header_crc:#010x}, computed {computed:#010x}")
    if body_len > max_body:
        raise FrameError(f"frame body of {body_len} bytes exceeds the limit of {max_body}")
    return Header(op, flags, status, body_len, req_id, body_crc)


def check_body(h: Header, body: bytes) -> None:
    """Checks the body CRC."""
    computed = crc32c(body)
    if computed != h.body_crc:
        raise FrameError(f"frame body CRC32C mismatch: stored {h.body_crc:#010x}, computed {computed:#010x}")


# --- requests -------------------------------------------------------------


def _json_int(o: Any) -> int:
    """An integer type json does not know (numpy's, as `tp-size` or `rank`
    often come from a config): as a plain int; anything else is refused as
    json refuses it (QA: numpy integers raised TypeError)."""
    try:
        return operator.index(o)
    except TypeError:
        raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable") from None


def record_json(record: dict[str, Any]) -> bytes:
    """The namespace record as sent in HELLO / CLUSTER_LOOKUP (compact JSON, keys as given)."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False, default=_json_int).encode()


def check_key_list(keys: Sequence[bytes]) -> None:
    """Raises TypeError for one bytes object given where a list of keys goes."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raise TypeError("keys is a sequence of 32-byte keys, not one bytes object: wrap a single key in a list")


def _check_key(k: Any) -> None:
    if not isinstance(k, (bytes, bytearray, memoryview)):
        raise TypeError(f"keys are 32-byte bytes objects, got {type(k).__name__}")
    # A memoryview's len() counts items of its format and first dimension,
    # not bytes: a 32 x 2 view is 64 bytes.
    n = k.nbytes if isinstance(k, memoryview) else len(k)
    if n != 32:
        raise ValueError(f"keys are 32 bytes, got {n}")


def _keys(keys: Sequence[bytes]) -> bytes:
    check_key_list(keys)
    # Fast path for plain bytes keys (C loops; a 1,024-key LOOKUP spent
    # ~200 us checking keys one by one); anything else is checked key by key.
    n = len(keys)
    if list(map(type, keys)).count(bytes) == n and list(map(len, keys)).count(32) == n:
        return b"".join(keys)
    for k in keys:
        _check_key(k)
    return b"".join(bytes(k) for k in keys)


def _ns(ns: bytes) -> bytes:
    if len(ns) != 16:
        raise ValueError(f"namespace ids are 16 bytes, got {len(ns)}")
    return bytes(ns)


def ping(req_id: int) -> bytes:
    return encode_frame(OP_PING, 0, 0, req_id, b"")


def flush(req_id: int) -> bytes:
    return encode_frame(OP_FLUSH, 0, 0, req_id, b"")


def stats(req_id: int) -> bytes:
    return encode_frame(OP_STATS, 0, 0, req_id, b"")


def hello(req_id: int, record: dict[str, Any]) -> bytes:
    return encode_frame(OP_HELLO, 0, 0, req_id, record_json(record))


def register_region(req_id: int, length: int) -> bytes:
    return encode_frame(OP_REGISTER_REGION, 0, 0, req_id, struct.pack("<Q", length))


def lookup(req_id: int, ns: bytes, group: int, keys: Sequence[bytes]) -> bytes:
    return encode_frame(OP_LOOKUP, 0, 0, req_id, _NSG.pack(_ns(ns), group, 0, len(keys)) + _keys(keys))


def lookup_in_region(req_id: int, ns: bytes, group: int, offset: int, count: int) -> bytes:
    """LOOKUP of ``count`` 32-byte keys at ``offset`` in the connection's region."""
    body = _NSG.pack(_ns(ns), group, 0, count) + struct.pack("<Q", offset)
    return encode_frame(OP_LOOKUP, FLAG_KEYS_IN_REGION, 0, req_id, body)


def delete(req_id: int, ns: bytes, group: int, keys: Sequence[bytes]) -> bytes:
    return encode_frame(OP_DELETE, 0, 0, req_id, _NSG.pack(_ns(ns), group, 0, len(keys)) + _keys(keys))


def cluster_lookup(
    req_id: int, record: dict[str, Any], ranks: Sequence[int], group: int, keys: Sequence[bytes]
) -> bytes:
    rec = record_json(record)
    body = (
        struct.pack("<HHIII", group, 0, len(ranks), len(keys), len(rec))
        + struct.pack(f"<{len(ranks)}I", *ranks)
        + _keys(keys)
        + rec
    )
    return encode_frame(OP_CLUSTER_LOOKUP, 0, 0, req_id, body)


def _entries(ns: bytes, group: int, entries: Sequence[tuple[bytes, int, int]]) -> bytes:
    parts = [_NSG.pack(_ns(ns), group, 0, len(entries))]
    pack = _ENTRY.pack
    for key, offset, length in entries:
        _check_key(key)
        parts.append(pack(bytes(key), offset, length))
    return b"".join(parts)


def put(req_id: int, ns: bytes, group: int, entries: Sequence[tuple[bytes, int, int]], atomic: bool = False) -> bytes:
    return encode_frame(OP_PUT, FLAG_ATOMIC if atomic else 0, 0, req_id, _entries(ns, group, entries))


def get(req_id: int, ns: bytes, group: int, entries: Sequence[tuple[bytes, int, int]]) -> bytes:
    return encode_frame(OP_GET, 0, 0, req_id, _entries(ns, group, entries))


# --- replies --------------------------------------------------------------


@dataclass(frozen=True)
class ErrorReply:
    """The daemon refused or failed a request."""

    code: int
    name: str
    message: str


def _count(body: bytes, off: int, n: int, size: int, what: str) -> None:
    if off + n * size != len(body):
        raise FrameError(f"{what}: {n} entries of {size} bytes do not match a body of {len(body)} bytes")


def decode_reply(h: Header, body: bytes) -> Any:
    """Decodes a reply body by its op. Returns ErrorReply for error replies,
    else a value per op (see the client)."""
    if not h.op & REPLY_BIT:
        raise FrameError(f"op {h.op:#06x} lacks the reply bit")
    if h.status != 0:
        return ErrorReply(h.status, ERROR_NAMES.get(h.status, "internal"), body.decode("utf-8", "replace"))
    op = h.op & ~REPLY_BIT
    try:
        if op in (OP_PING,):
            if body:
                raise FrameError("PING reply has a body")
            return None
        if op == OP_HELLO:
            if len(body) != _HELLO_REPLY.size:
                raise FrameError(f"HELLO reply of {len(body)} bytes")
            ns, version, _r1, max_batch, max_frame, _r2, max_region = _HELLO_REPLY.unpack(body)
            return {
                "ns": ns,
                "version": version,
                "max_batch": max_batch,
                "max_frame": max_frame,
                "max_region": max_region,
            }
        if op == OP_REGISTER_REGION:
            if len(body) != 8:
                raise FrameError(f"REGISTER_REGION reply of {len(body)} bytes")
            return struct.unpack("<Q", body)[0]
        if op == OP_LOOKUP:
            prefix, n = struct.unpack_from("<II", body)
            _count(body, 8, n, 1, "LOOKUP")
            codes = body[8:]
            # Checked here, named on demand (LookupResult.locations): a list
            # of 1,024 names cost ~13 us per LOOKUP whose caller wanted the
            # prefix only.
            if codes.translate(None, _LOCATION_CODES):
                raise FrameError(f"LOOKUP reply with a location code over {len(LOCATIONS) - 1}")
            if prefix > n:
                raise FrameError(f"LOOKUP reply with a prefix of {prefix} over its {n} keys")
            return prefix, codes
        if op == OP_CLUSTER_LOOKUP:
            min_prefix, n = struct.unpack_from("<II", body)
            _count(body, 8, n, 12, "CLUSTER_LOOKUP")
            return min_prefix, [_RANK.unpack_from(body, 8 + 12 * i) for i in range(n)]
        if op == OP_PUT:
            (n,) = struct.unpack_from("<I", body)
            _count(body, 4, n, 2, "PUT")
            return list(struct.unpack_from(f"<{n}H", body, 4))
        if op == OP_GET:
            n, reserved = struct.unpack_from("<II", body)
            _count(body, 8, n, 16, "GET")
            out = []
            for i in range(n):
                status, length = _GET_RESULT.unpack_from(body, 8 + 16 * i)
                out.append((GET_STATUSES[status], length))
            return out
        if op == OP_DELETE:
            (n,) = struct.unpack_from("<I", body)
            _count(body, 4, n, 1, "DELETE")
            return [b != 0 for b in body[4:]]
        if op == OP_FLUSH:
            if len(body) != 24:
                raise FrameError(f"FLUSH reply of {len(body)} bytes")
            chunks, nbytes, failed = struct.unpack("<QQQ", body)
            return {"chunks": chunks, "bytes": nbytes, "failed": failed}
        if op == OP_STATS:
            return json.loads(body)
    except (struct.error, IndexError, ValueError) as e:
        raise FrameError(f"malformed reply body for op {op}: {e}") from e
    raise FrameError(f"unknown reply op {op}")
