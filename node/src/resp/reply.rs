//! Reply encoding, byte for byte as Redis 7 writes RESP2 (or RESP3, after
//! `HELLO 3`: nulls, maps and verbatim strings differ), into an output
//! queue that keeps large values as separate `Bytes` segments so a GET reply
//! is written with one vectored write and no copy of the value.

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::{BufMut, Bytes, BytesMut};

/// Values at least this long are queued as their own segment (no copy);
/// shorter ones are copied into the small-reply buffer.
const SEGMENT_MIN: usize = 16 * 1024;

/// Queued reply bytes of one connection.
#[derive(Debug, Default)]
pub struct Output {
    small: BytesMut,
    segs: VecDeque<Bytes>,
    queued: usize,
    /// The connection switched to RESP3 (`HELLO 3`).
    resp3: bool,
}

impl Output {
    /// Encodes later replies as RESP3 (`true`) or RESP2.
    pub fn set_resp3(&mut self, on: bool) {
        self.resp3 = on;
    }

    /// Bytes queued and not yet written.
    pub fn pending(&self) -> usize {
        self.queued + self.small.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.pending() == 0
    }

    fn raw(&mut self, b: &[u8]) {
        self.small.put_slice(b);
    }

    fn seal_small(&mut self) {
        if !self.small.is_empty() {
            let s = self.small.split().freeze();
            self.queued += s.len();
            self.segs.push_back(s);
        }
    }

    /// `+<s>\r\n`
    pub fn simple(&mut self, s: &str) {
        self.raw(b"+");
        self.raw(s.as_bytes());
        self.raw(b"\r\n");
    }

    /// `+OK\r\n`
    pub fn ok(&mut self) {
        self.raw(b"+OK\r\n");
    }

    /// An error reply. Like Redis, a message starting with `-` carries its
    /// own code (`-NOAUTH ...`); any other gets `ERR `. CR and LF inside the
    /// message become spaces so the reply stays one line.
    pub fn error(&mut self, msg: impl AsRef<[u8]>) {
        let msg = msg.as_ref();
        self.raw(b"-");
        let body = match msg.strip_prefix(b"-") {
            Some(rest) => rest,
            None => {
                self.raw(b"ERR ");
                msg
            }
        };
        for &b in body {
            self.small
                .put_u8(if b == b'\r' || b == b'\n' { b' ' } else { b });
        }
        self.raw(b"\r\n");
    }

    /// `:<n>\r\n`
    pub fn integer(&mut self, n: i64) {
        self.raw(b":");
        self.raw(n.to_string().as_bytes());
        self.raw(b"\r\n");
    }

    /// `*<n>\r\n`
    pub fn array_header(&mut self, n: usize) {
        self.raw(b"*");
        self.raw(n.to_string().as_bytes());
        self.raw(b"\r\n");
    }

    /// `*-1\r\n` (RESP3: `_\r\n`)
    pub fn null_array(&mut self) {
        self.raw(if self.resp3 { b"_\r\n" } else { b"*-1\r\n" });
    }

    /// `$-1\r\n` (RESP3: `_\r\n`)
    pub fn null(&mut self) {
        self.raw(if self.resp3 { b"_\r\n" } else { b"$-1\r\n" });
    }

    /// A set of `n` elements follows: `~<n>\r\n`, or in RESP2 an array.
    pub fn set_header(&mut self, n: usize) {
        if self.resp3 {
            self.raw(b"~");
            self.raw(n.to_string().as_bytes());
            self.raw(b"\r\n");
        } else {
            self.array_header(n);
        }
    }

    /// A map of `pairs` key-value pairs follows: `%<pairs>\r\n`, or in
    /// RESP2 a flat array `*<2 pairs>\r\n`.
    pub fn map_header(&mut self, pairs: usize) {
        if self.resp3 {
            self.raw(b"%");
            self.raw(pairs.to_string().as_bytes());
            self.raw(b"\r\n");
        } else {
            self.array_header(2 * pairs);
        }
    }

    /// Text as Redis sends INFO: a bulk string, or in RESP3 a verbatim
    /// string of format `txt` (`=<len + 4>\r\ntxt:<text>\r\n`).
    pub fn verbatim_text(&mut self, text: &[u8]) {
        if !self.resp3 {
            self.bulk(text);
            return;
        }
        self.raw(b"=");
        self.raw((text.len() + 4).to_string().as_bytes());
        self.raw(b"\r\ntxt:");
        self.raw(text);
        self.raw(b"\r\n");
    }

    /// `$<len>\r\n<bytes>\r\n`, copying the bytes.
    pub fn bulk(&mut self, b: &[u8]) {
        self.raw(b"$");
        self.raw(b.len().to_string().as_bytes());
        self.raw(b"\r\n");
        self.raw(b);
        self.raw(b"\r\n");
    }

    /// `$<len>\r\n<bytes>\r\n`; large values are queued without a copy.
    pub fn bulk_bytes(&mut self, b: Bytes) {
        if b.len() < SEGMENT_MIN {
            self.bulk(&b);
            return;
        }
        self.raw(b"$");
        self.raw(b.len().to_string().as_bytes());
        self.raw(b"\r\n");
        self.seal_small();
        self.queued += b.len();
        self.segs.push_back(b);
        self.raw(b"\r\n");
    }

    /// Fills `slices` with the queued segments, in order (at most its capacity).
    pub fn io_slices<'a>(&'a self, slices: &mut Vec<IoSlice<'a>>, max: usize) {
        slices.clear();
        for s in self.segs.iter().take(max) {
            slices.push(IoSlice::new(s));
        }
        if slices.len() < max && !self.small.is_empty() {
            slices.push(IoSlice::new(&self.small));
        }
    }

    /// Drops the first `n` written bytes.
    pub fn advance(&mut self, mut n: usize) {
        while n > 0 {
            if let Some(front) = self.segs.front_mut() {
                if n >= front.len() {
                    n -= front.len();
                    self.queued -= front.len();
                    self.segs.pop_front();
                } else {
                    let _ = front.split_to(n);
                    self.queued -= n;
                    n = 0;
                }
            } else {
                let take = n.min(self.small.len());
                let _ = self.small.split_to(take);
                n -= take;
                if take == 0 {
                    break;
                }
            }
        }
    }

    /// All queued bytes, concatenated (tests and tools).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.pending());
        for s in &self.segs {
            v.extend_from_slice(s);
        }
        v.extend_from_slice(&self.small);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_like_redis() {
        let mut o = Output::default();
        o.ok();
        o.error("unknown command 'x'\r\n");
        o.error("-NOAUTH Authentication required.");
        o.integer(-3);
        o.null();
        o.bulk(b"");
        o.array_header(0);
        assert_eq!(
            o.to_vec(),
            b"+OK\r\n-ERR unknown command 'x'  \r\n-NOAUTH Authentication required.\r\n:-3\r\n$-1\r\n$0\r\n\r\n*0\r\n"
        );
    }

    #[test]
    fn large_values_are_segments_and_advance_walks_them() {
        let mut o = Output::default();
        o.ok();
        let big = Bytes::from(vec![9u8; SEGMENT_MIN + 1]);
        o.bulk_bytes(big.clone());
        o.ok();
        let mut want = b"+OK\r\n$16385\r\n".to_vec();
        want.extend_from_slice(&big);
        want.extend_from_slice(b"\r\n+OK\r\n");
        assert_eq!(o.to_vec(), want);
        assert_eq!(o.pending(), want.len());
        for step in [3, 10, 16000, 300, 7] {
            o.advance(step);
        }
        let done = 3 + 10 + 16000 + 300 + 7;
        assert_eq!(o.to_vec(), want[done..]);
        o.advance(o.pending());
        assert!(o.is_empty());
    }
}
