//! Fuzzes the RESP2 request parser: arbitrary bytes, fed in arbitrary
//! pieces, never panic, never allocate past what was given, and a direct
//! bulk read always gets back exactly what the parser asked for.
#![no_main]

use libfuzzer_sys::fuzz_target;
use node::resp::parser::{BytesMut, Parsed, RequestParser};

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    // First byte: piece size and limits.
    let piece = usize::from(first % 64) + 1;
    let mut p = RequestParser::new(if first & 0x80 != 0 { 1 << 20 } else { 100 });
    if first & 0x40 != 0 {
        p.set_limits(10, 16 * 1024);
    }
    let mut buf = BytesMut::new();
    let mut input = rest;
    for _ in 0..100_000 {
        match p.parse(&mut buf) {
            Ok(Parsed::Command(args)) => assert!(!args.is_empty()),
            Ok(Parsed::Incomplete) => {
                if input.is_empty() {
                    return;
                }
                let n = piece.min(input.len());
                buf.extend_from_slice(&input[..n]);
                input = &input[n..];
            }
            Ok(Parsed::DirectBulk(len)) => {
                let total = len + 2;
                let from_buf = buf.len().min(total);
                let mut d = BytesMut::with_capacity(total.min(from_buf + input.len()));
                d.extend_from_slice(&buf.split_to(from_buf));
                let need = (total - d.len()).min(input.len());
                d.extend_from_slice(&input[..need]);
                input = &input[need..];
                if d.len() < total {
                    return;
                }
                if p.finish_direct(d.freeze()).is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
});
