//! Fuzzes the chunk header decoder: arbitrary bytes must decode to a typed
//! error or to a header whose encoding reproduces the consumed prefix.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tier::format::ChunkHeader;

fuzz_target!(|data: &[u8]| {
    let peeked = ChunkHeader::peek_len(data);
    if let Ok(header) = ChunkHeader::decode(data) {
        let encoded = header.encode();
        assert_eq!(peeked.ok(), Some(encoded.len()), "peek_len disagrees with decode");
        assert!(data.len() >= encoded.len());
        assert_eq!(&data[..encoded.len()], &encoded[..], "re-encoding differs");
        // The decoded header accepts its own identity.
        assert!(header.check_identity(&header.id, header.name.as_deref()).is_ok());
    }
});
