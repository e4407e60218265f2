//! Fuzzes the peer frame decoder: arbitrary bytes must decode to a typed
//! error or to a message whose encoding reproduces the consumed prefix;
//! bodies of every kind are also decoded without a valid frame around them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use peer::proto::frame;
use peer::proto::msg::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok((msg, used)) = frame::decode(data) {
        let enc = frame::encode(&msg);
        assert_eq!(enc.len(), used, "re-encoded length differs");
        assert_eq!(&data[..used], &enc[..], "re-encoding differs");
    }
    if let Some((&kind, body)) = data.split_first() {
        if let Ok(msg) = Message::decode_body(kind, body) {
            let mut out = Vec::new();
            msg.encode_body(&mut out);
            assert_eq!(out, body, "body re-encoding differs");
            assert_eq!(msg.kind(), kind);
        }
    }
});
