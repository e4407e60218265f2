//! Fuzzes the native-protocol decoders: frames (magic, version, CRCs,
//! lengths) and every request and reply body. Decoding must never panic,
//! and a decoded request must survive an encode/decode round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use node::native::codec::{self, Decoded, Header, Limits, REPLY_BIT};

fuzz_target!(|data: &[u8]| {
    let limits = Limits { max_batch: 4096 };
    // A stream of frames, as the server reads it.
    let mut buf = data;
    for _ in 0..16 {
        match codec::decode_frame(buf, 1 << 20) {
            Ok(Decoded::Frame { header, body, len }) => {
                if let Ok(req) = codec::decode_request(&header, body, &limits) {
                    let mut out = Vec::new();
                    codec::encode_request(&mut out, header.id, &req);
                    let Ok(Decoded::Frame {
                        header: h2,
                        body: b2,
                        ..
                    }) = codec::decode_frame(&out, u32::MAX)
                    else {
                        panic!("re-encoded request does not decode")
                    };
                    assert_eq!(codec::decode_request(&h2, b2, &limits).as_ref(), Ok(&req));
                }
                let _ = codec::decode_reply(&header, body);
                buf = &buf[len..];
            }
            Ok(Decoded::Incomplete { need }) => {
                assert!(need > buf.len());
                break;
            }
            Err(_) => break,
        }
    }
    // Bodies directly (the CRCs above keep most inputs from reaching them):
    // first 2 bytes op, next 2 flags, the rest is the body.
    if data.len() >= 4 {
        let op = u16::from_le_bytes([data[0], data[1]]);
        let flags = u16::from_le_bytes([data[2], data[3]]);
        let body = &data[4..];
        let header = Header {
            op: op & !REPLY_BIT,
            flags,
            status: 0,
            body_len: body.len() as u32,
            id: 1,
        };
        let _ = codec::decode_request(&header, body, &limits);
        let reply = Header {
            op: op | REPLY_BIT,
            ..header
        };
        let _ = codec::decode_reply(&reply, body);
    }
});
