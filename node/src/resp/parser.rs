//! A sans-IO RESP2 request parser over a byte buffer.
//!
//! It accepts what Redis 7 accepts: multibulk requests (`*N\r\n$L\r\n...`)
//! and inline commands (a text line split like `sdssplitargs`, quotes
//! included). It never panics and never allocates more than the bytes it has
//! been given, whatever the input says: a bulk length above the limit is an
//! error before anything is allocated.
//!
//! Large bulk arguments (at least [`DIRECT_READ_MIN`] bytes) that are not yet
//! fully buffered are handed back to the caller as [`Parsed::DirectBulk`], so
//! the caller can read the payload straight from the socket into a buffer of
//! the exact size (one copy) and give it back with
//! [`RequestParser::finish_direct`].

use bytes::Buf;
/// The buffer types the parser works on (re-exported for fuzzers and tools).
pub use bytes::{Bytes, BytesMut};

/// Longest inline request or multibulk/bulk header line (Redis's
/// `PROTO_INLINE_MAX_SIZE`).
pub const INLINE_MAX: usize = 64 * 1024;
/// Bulk arguments at least this long that are not fully buffered are read
/// directly by the caller ([`Parsed::DirectBulk`]).
pub const DIRECT_READ_MIN: usize = 64 * 1024;
/// Most arguments in one multibulk request when authenticated (Redis allows
/// up to `INT_MAX`; kvtier's commands never need more).
pub const MAX_ARGS: u64 = 1024 * 1024;
/// Limits before authentication, as Redis 7 applies them: at most 10
/// arguments of at most 16 KiB each.
pub const UNAUTH_MAX_ARGS: u64 = 10;
/// See [`UNAUTH_MAX_ARGS`].
pub const UNAUTH_MAX_BULK: u64 = 16 * 1024;

/// A malformed request. The server replies `-ERR Protocol error: <msg>` and
/// closes the connection, as Redis does.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A multibulk count that is not an integer, or is too large.
    #[error("invalid multibulk length")]
    InvalidMultibulkLength,
    /// A multibulk header line longer than [`INLINE_MAX`].
    #[error("too big mbulk count string")]
    TooBigMultibulkCount,
    /// An array element that is not a bulk string.
    #[error("expected '$', got '{0}'")]
    ExpectedDollar(char),
    /// A bulk length that is not an integer or is negative.
    #[error("invalid bulk length")]
    InvalidBulkLength,
    /// A bulk length above the configured limit (nothing was allocated).
    #[error("invalid bulk length {len} (values are limited to {max} bytes)")]
    BulkTooLarge {
        /// The announced length.
        len: u64,
        /// The limit in force.
        max: u64,
    },
    /// A whole request larger than the limit.
    #[error("request of more than {max} bytes")]
    RequestTooLarge {
        /// The limit in force.
        max: u64,
    },
    /// A bulk header line longer than [`INLINE_MAX`].
    #[error("too big bulk count string")]
    TooBigBulkCount,
    /// A bulk payload not followed by CRLF. Stricter than Redis 7, which
    /// skips the two bytes unchecked: a length that disagrees with the
    /// payload would otherwise shift every later request.
    #[error("bulk string not terminated by CRLF")]
    MissingCrlf,
    /// An inline request longer than [`INLINE_MAX`].
    #[error("too big inline request")]
    TooBigInline,
    /// An inline request with an unterminated quote.
    #[error("unbalanced quotes in request")]
    UnbalancedQuotes,
    /// [`RequestParser::finish_direct`] called with the wrong payload.
    #[error("direct bulk payload of {got} bytes where {expected} were announced")]
    DirectMismatch {
        /// Bytes expected (payload + CRLF).
        expected: usize,
        /// Bytes given.
        got: usize,
    },
}

/// What [`RequestParser::parse`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A complete command: its arguments, name first (never empty).
    Command(Vec<Bytes>),
    /// More bytes are needed.
    Incomplete,
    /// The next `len` bytes plus CRLF are one bulk argument. Read exactly
    /// `len + 2` bytes (starting with whatever is left in the buffer) and pass
    /// them to [`RequestParser::finish_direct`].
    DirectBulk(usize),
}

#[derive(Debug)]
struct ArrayState {
    remaining: u64,
    args: Vec<Bytes>,
    total: u64,
    direct: Option<usize>,
}

/// Incremental RESP2 request parser; one per connection.
#[derive(Debug)]
pub struct RequestParser {
    max_args: u64,
    max_bulk: u64,
    max_request: u64,
    state: Option<ArrayState>,
}

impl RequestParser {
    /// A parser accepting bulk strings up to `max_bulk` bytes.
    pub fn new(max_bulk: u64) -> Self {
        Self {
            max_args: MAX_ARGS,
            max_bulk,
            max_request: max_bulk.saturating_add(1 << 20),
            state: None,
        }
    }

    /// Sets the argument-count and bulk-length limits for requests that
    /// start after this call (e.g. the tighter limits before AUTH).
    pub fn set_limits(&mut self, max_args: u64, max_bulk: u64) {
        self.max_args = max_args;
        self.max_bulk = max_bulk;
        self.max_request = max_bulk.saturating_add(1 << 20);
    }

    /// Whether a request has been started but not completed.
    pub fn in_request(&self) -> bool {
        self.state.is_some()
    }

    /// Parses the next command from the front of `buf`, consuming its bytes.
    pub fn parse(&mut self, buf: &mut BytesMut) -> Result<Parsed, ProtocolError> {
        loop {
            if self.state.is_none() {
                let Some(&first) = buf.first() else {
                    return Ok(Parsed::Incomplete);
                };
                if first != b'*' {
                    match parse_inline(buf)? {
                        Inline::Incomplete => return Ok(Parsed::Incomplete),
                        Inline::Empty => continue,
                        Inline::Args(args) => return Ok(Parsed::Command(args)),
                    }
                }
                let Some((n, used)) = header_line(buf, ProtocolError::TooBigMultibulkCount)? else {
                    return Ok(Parsed::Incomplete);
                };
                let count = match n {
                    Some(c)
                        if c <= i64::from(i32::MAX) && (c <= 0 || c as u64 <= self.max_args) =>
                    {
                        c
                    }
                    _ => return Err(ProtocolError::InvalidMultibulkLength),
                };
                buf.advance(used);
                if count <= 0 {
                    // Redis ignores empty and null arrays.
                    continue;
                }
                self.state = Some(ArrayState {
                    remaining: count as u64,
                    args: Vec::with_capacity((count as usize).min(16)),
                    total: 0,
                    direct: None,
                });
            }
            let st = self.state.as_mut().expect("state set above");
            if let Some(len) = st.direct {
                return Ok(Parsed::DirectBulk(len));
            }
            while st.remaining > 0 {
                let Some(&first) = buf.first() else {
                    return Ok(Parsed::Incomplete);
                };
                let Some((n, used)) = header_line(buf, ProtocolError::TooBigBulkCount)? else {
                    return Ok(Parsed::Incomplete);
                };
                if first != b'$' {
                    return Err(ProtocolError::ExpectedDollar(printable(first)));
                }
                let len = match n {
                    Some(l) if l >= 0 => l as u64,
                    _ => return Err(ProtocolError::InvalidBulkLength),
                };
                if len > self.max_bulk {
                    return Err(ProtocolError::BulkTooLarge {
                        len,
                        max: self.max_bulk,
                    });
                }
                let total = st.total + len;
                if total > self.max_request {
                    return Err(ProtocolError::RequestTooLarge {
                        max: self.max_request,
                    });
                }
                // `len` fits in usize: it is at most max_bulk, itself bounded
                // by what the caller chose, and compared with a buffer length.
                let len = usize::try_from(len).map_err(|_| ProtocolError::InvalidBulkLength)?;
                let need = len.checked_add(2).ok_or(ProtocolError::InvalidBulkLength)?;
                if buf.len() - used >= need {
                    if &buf[used + len..used + len + 2] != b"\r\n" {
                        return Err(ProtocolError::MissingCrlf);
                    }
                    buf.advance(used);
                    let arg = if len < DIRECT_READ_MIN {
                        // Copy small arguments so they do not pin the read buffer.
                        let a = Bytes::copy_from_slice(&buf[..len]);
                        buf.advance(len);
                        a
                    } else {
                        buf.split_to(len).freeze()
                    };
                    buf.advance(2);
                    st.args.push(arg);
                    st.total = total;
                    st.remaining -= 1;
                    continue;
                }
                if len >= DIRECT_READ_MIN {
                    buf.advance(used);
                    st.total = total;
                    st.direct = Some(len);
                    return Ok(Parsed::DirectBulk(len));
                }
                // Header left in place; parsed again once the payload is in.
                return Ok(Parsed::Incomplete);
            }
            let st = self.state.take().expect("state set above");
            return Ok(Parsed::Command(st.args));
        }
    }

    /// Completes a [`Parsed::DirectBulk`]: `data` holds exactly the announced
    /// length plus the trailing CRLF.
    pub fn finish_direct(&mut self, data: Bytes) -> Result<(), ProtocolError> {
        let Some(st) = self.state.as_mut() else {
            return Err(ProtocolError::DirectMismatch {
                expected: 0,
                got: data.len(),
            });
        };
        let Some(len) = st.direct else {
            return Err(ProtocolError::DirectMismatch {
                expected: 0,
                got: data.len(),
            });
        };
        if data.len() != len.saturating_add(2) {
            return Err(ProtocolError::DirectMismatch {
                expected: len.saturating_add(2),
                got: data.len(),
            });
        }
        if &data[len..] != b"\r\n" {
            return Err(ProtocolError::MissingCrlf);
        }
        st.args.push(data.slice(..len));
        st.direct = None;
        st.remaining -= 1;
        Ok(())
    }
}

fn printable(b: u8) -> char {
    if b.is_ascii_graphic() || b == b' ' {
        b as char
    } else {
        '?'
    }
}

/// Parses a `*N\r\n` / `$N\r\n` header at the front of `buf` (the type byte
/// is not checked here). `Ok(None)`: incomplete. On success: the integer
/// (`None` if it is not a valid one) and the bytes used.
fn header_line(
    buf: &[u8],
    too_big: ProtocolError,
) -> Result<Option<(Option<i64>, usize)>, ProtocolError> {
    let limit = buf.len().min(INLINE_MAX + 2);
    let Some(cr) = buf[..limit].iter().position(|&b| b == b'\r') else {
        if buf.len() > INLINE_MAX {
            return Err(too_big);
        }
        return Ok(None);
    };
    if cr + 1 >= buf.len() {
        return Ok(None);
    }
    if buf[cr + 1] != b'\n' {
        return Ok(Some((None, cr + 2)));
    }
    // `cr` may be 0 (a line that is only CRLF): no integer then.
    Ok(Some((buf.get(1..cr).and_then(string_to_i64), cr + 2)))
}

/// Redis's `string2ll`: optional '-', digits, no '+', no leading zeros, no
/// spaces, no overflow.
pub fn string_to_i64(s: &[u8]) -> Option<i64> {
    let (neg, digits) = match s {
        [b'-', rest @ ..] => (true, rest),
        _ => (false, s),
    };
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    if digits.len() > 1 && digits[0] == b'0' {
        return None;
    }
    if neg && digits == b"0" {
        return None;
    }
    let mut v: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?;
        v = if neg {
            v.checked_sub(i64::from(d - b'0'))?
        } else {
            v.checked_add(i64::from(d - b'0'))?
        };
    }
    Some(v)
}

enum Inline {
    Incomplete,
    Empty,
    Args(Vec<Bytes>),
}

fn parse_inline(buf: &mut BytesMut) -> Result<Inline, ProtocolError> {
    let limit = buf.len().min(INLINE_MAX + 1);
    let Some(nl) = buf[..limit].iter().position(|&b| b == b'\n') else {
        if buf.len() > INLINE_MAX {
            return Err(ProtocolError::TooBigInline);
        }
        return Ok(Inline::Incomplete);
    };
    let mut line = &buf[..nl];
    if let [rest @ .., b'\r'] = line {
        line = rest;
    }
    let args = split_args(line)?;
    buf.advance(nl + 1);
    Ok(if args.is_empty() {
        Inline::Empty
    } else {
        Inline::Args(args)
    })
}

fn hex_val(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// Splits an inline request like Redis's `sdssplitargs`: spaces separate
/// arguments; "double quotes" understand `\xHH`, `\n`, `\r`, `\t`, `\b`, `\a`
/// and `\<any>`; 'single quotes' understand `\'`. A closing quote must be
/// followed by a space or the end of the line.
pub fn split_args(line: &[u8]) -> Result<Vec<Bytes>, ProtocolError> {
    // A NUL ends the line, as it ends the C string Redis splits.
    let line = match line.iter().position(|&b| b == 0) {
        Some(nul) => &line[..nul],
        None => line,
    };
    let mut out = Vec::new();
    let mut i = 0;
    let n = line.len();
    let is_space = |b: u8| matches!(b, b' ' | b'\n' | b'\r' | b'\t' | 0x0b | 0x0c);
    loop {
        while i < n && is_space(line[i]) {
            i += 1;
        }
        if i >= n {
            return Ok(out);
        }
        let mut cur = Vec::new();
        let (mut inq, mut insq) = (false, false);
        loop {
            if inq {
                if i >= n {
                    return Err(ProtocolError::UnbalancedQuotes);
                }
                let c = line[i];
                if c == b'\\'
                    && i + 3 < n
                    && line[i + 1] == b'x'
                    && hex_val(line[i + 2]).is_some()
                    && hex_val(line[i + 3]).is_some()
                {
                    let hi = hex_val(line[i + 2]).unwrap_or(0);
                    let lo = hex_val(line[i + 3]).unwrap_or(0);
                    cur.push(hi * 16 + lo);
                    i += 3;
                } else if c == b'\\' && i + 1 < n {
                    i += 1;
                    cur.push(match line[i] {
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'b' => 0x08,
                        b'a' => 0x07,
                        other => other,
                    });
                } else if c == b'"' {
                    if i + 1 < n && !is_space(line[i + 1]) {
                        return Err(ProtocolError::UnbalancedQuotes);
                    }
                    i += 1;
                    break;
                } else {
                    cur.push(c);
                }
            } else if insq {
                if i >= n {
                    return Err(ProtocolError::UnbalancedQuotes);
                }
                let c = line[i];
                if c == b'\\' && i + 1 < n && line[i + 1] == b'\'' {
                    i += 1;
                    cur.push(b'\'');
                } else if c == b'\'' {
                    if i + 1 < n && !is_space(line[i + 1]) {
                        return Err(ProtocolError::UnbalancedQuotes);
                    }
                    i += 1;
                    break;
                } else {
                    cur.push(c);
                }
            } else {
                if i >= n {
                    break;
                }
                match line[i] {
                    b' ' | b'\n' | b'\r' | b'\t' => break,
                    b'"' => inq = true,
                    b'\'' => insq = true,
                    c => cur.push(c),
                }
            }
            i += 1;
        }
        out.push(Bytes::from(cur));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(input: &[u8], max: u64) -> Result<Vec<Vec<Bytes>>, ProtocolError> {
        let mut p = RequestParser::new(max);
        let mut buf = BytesMut::from(input);
        let mut out = vec![];
        loop {
            match p.parse(&mut buf)? {
                Parsed::Command(c) => out.push(c),
                Parsed::Incomplete => return Ok(out),
                Parsed::DirectBulk(len) => {
                    if buf.len() < len + 2 {
                        return Ok(out);
                    }
                    let d = buf.split_to(len + 2);
                    p.finish_direct(d.freeze())?;
                }
            }
        }
    }

    fn args(v: &[&[u8]]) -> Vec<Bytes> {
        v.iter().map(|a| Bytes::copy_from_slice(a)).collect()
    }

    #[test]
    fn multibulk_and_inline_and_pipeline() {
        let got = parse_all(
            b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\nPING\r\n\r\n*0\r\n*-1\r\nset a \"b c\"\r\n",
            100,
        )
        .unwrap();
        assert_eq!(
            got,
            vec![
                args(&[b"GET", b"k"]),
                args(&[b"PING"]),
                args(&[b"set", b"a", b"b c"])
            ]
        );
    }

    #[test]
    fn every_split_point_gives_the_same_commands() {
        let mut input = b"*3\r\n$3\r\nSET\r\n$2\r\nk1\r\n".to_vec();
        let big = vec![7u8; DIRECT_READ_MIN + 5];
        input.extend_from_slice(format!("${}\r\n", big.len()).as_bytes());
        input.extend_from_slice(&big);
        input.extend_from_slice(b"\r\nEXISTS k1 'x y'\n");
        let want = parse_all(&input, 1 << 20).unwrap();
        assert_eq!(want.len(), 2);
        assert_eq!(want[0][2].len(), big.len());
        for split in (0..input.len())
            .step_by(997)
            .chain([1, 2, 3, 20, input.len() - 1])
        {
            let mut p = RequestParser::new(1 << 20);
            let mut buf = BytesMut::from(&input[..split]);
            let mut rest = &input[split..];
            let mut out = vec![];
            for _ in 0..10_000 {
                match p.parse(&mut buf).unwrap() {
                    Parsed::Command(c) => out.push(c),
                    Parsed::Incomplete => {
                        if rest.is_empty() {
                            break;
                        }
                        let take = rest.len().min(4096);
                        buf.extend_from_slice(&rest[..take]);
                        rest = &rest[take..];
                    }
                    Parsed::DirectBulk(len) => {
                        let mut d = BytesMut::with_capacity(len + 2);
                        let from_buf = buf.len().min(len + 2);
                        d.extend_from_slice(&buf.split_to(from_buf));
                        let need = len + 2 - d.len();
                        d.extend_from_slice(&rest[..need]);
                        rest = &rest[need..];
                        p.finish_direct(d.freeze()).unwrap();
                    }
                }
            }
            assert_eq!(out, want, "split at {split}");
        }
    }

    /// Redis's messages, except where kvtier is stricter (a bulk payload not
    /// followed by CRLF, which Redis does not check).
    #[test]
    fn protocol_errors_match_redis() {
        let e = |i: &[u8]| parse_all(i, 1000).unwrap_err().to_string();
        assert_eq!(e(b"*x\r\n"), "invalid multibulk length");
        assert_eq!(e(b"*2\r\n+a\r\n"), "expected '$', got '+'");
        // Found by the fuzzer: an element that is only CRLF once panicked.
        assert_eq!(e(b"*5\r\n\r\n"), "expected '$', got '?'");
        assert_eq!(e(b"*1\r\n$-1\r\n"), "invalid bulk length");
        assert_eq!(e(b"*1\r\n$abc\r\n"), "invalid bulk length");
        assert_eq!(
            e(b"*1\r\n$1\r\nab\r\n"),
            "bulk string not terminated by CRLF"
        );
        assert_eq!(e(b"set a \"b\n"), "unbalanced quotes in request");
        assert_eq!(e(b"set a \"b\"c\n"), "unbalanced quotes in request");
        assert!(matches!(
            parse_all(b"*1\r\n$1001\r\n", 1000),
            Err(ProtocolError::BulkTooLarge {
                len: 1001,
                max: 1000
            })
        ));
        let long = vec![b'a'; INLINE_MAX + 1];
        assert_eq!(e(&long), "too big inline request");
        let mut long = b"*".to_vec();
        long.extend(vec![b'1'; INLINE_MAX + 1]);
        assert_eq!(e(&long), "too big mbulk count string");
    }

    #[test]
    fn unauthenticated_limits() {
        let mut p = RequestParser::new(1 << 20);
        p.set_limits(UNAUTH_MAX_ARGS, UNAUTH_MAX_BULK);
        let mut b = BytesMut::from(&b"*11\r\n"[..]);
        assert_eq!(p.parse(&mut b), Err(ProtocolError::InvalidMultibulkLength));
        let mut p = RequestParser::new(1 << 20);
        p.set_limits(UNAUTH_MAX_ARGS, UNAUTH_MAX_BULK);
        let mut b = BytesMut::from(&b"*1\r\n$16385\r\n"[..]);
        assert!(matches!(
            p.parse(&mut b),
            Err(ProtocolError::BulkTooLarge { .. })
        ));
    }

    #[test]
    fn split_args_escapes() {
        assert_eq!(
            split_args(b" a  \"\\x41\\n\" 'it\\'s' \"\"").unwrap(),
            args(&[b"a", b"A\n", b"it's", b""])
        );
        assert_eq!(split_args(b"   ").unwrap(), Vec::<Bytes>::new());
        // Found by the fuzzer: a NUL once looped forever pushing empty arguments.
        assert_eq!(split_args(b"\x01\x00").unwrap(), args(&[b"\x01"]));
        assert_eq!(split_args(b"get a\x00b c").unwrap(), args(&[b"get", b"a"]));
        assert_eq!(split_args(b"\x00").unwrap(), Vec::<Bytes>::new());
    }

    #[test]
    fn string_to_i64_is_strict() {
        assert_eq!(string_to_i64(b"0"), Some(0));
        assert_eq!(string_to_i64(b"-12"), Some(-12));
        assert_eq!(string_to_i64(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(string_to_i64(b"-9223372036854775808"), Some(i64::MIN));
        for bad in [
            &b""[..],
            b"-",
            b"+1",
            b"01",
            b"-0",
            b" 1",
            b"1 ",
            b"9223372036854775808",
        ] {
            assert_eq!(string_to_i64(bad), None, "{bad:?}");
        }
    }
}
