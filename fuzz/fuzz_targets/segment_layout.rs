//! Fuzzes the segment store's layout decoders (superblock, region slots,
//! batch records, rkyv entry lists): arbitrary bytes must be refused or
//! decode to values that re-encode to the same bytes; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tier::device::AlignedBuf;
use tier::layout::{
    ArchivedEntry, BATCH_FIXED, BatchHead, SealSlot, Superblock, decode_entries, decode_open_slot,
    encode_open_slot,
};

fuzz_target!(|data: &[u8]| {
    let mut block = vec![0u8; 4096];
    let n = data.len().min(4096);
    block[..n].copy_from_slice(&data[..n]);
    if let Ok(sb) = Superblock::decode(&block) {
        let mut again = [0u8; 64];
        sb.encode_into(&mut again);
        assert_eq!(&again[..44], &block[..44]);
    }
    if let Some(g) = decode_open_slot(&block, 0) {
        let mut again = vec![0u8; 4096];
        encode_open_slot(&mut again, 0, g);
        assert_eq!(&again[..28], &block[..28]);
    }
    if let Some(s) = SealSlot::decode(&block) {
        let mut again = vec![0u8; 4096];
        s.encode_into(&mut again);
        assert_eq!(&again[..44], &block[..44]);
    }
    if let Some(h) = BatchHead::decode(&block[..BATCH_FIXED]) {
        let mut again = [0u8; BATCH_FIXED];
        h.encode_into(&mut again);
        assert_eq!(&again[..40], &block[..40]);
    }
    // rkyv entry lists are validated (bytecheck) before use.
    let mut aligned = AlignedBuf::zeroed(data.len());
    aligned.copy_from_slice(data);
    if let Ok(list) = decode_entries(&aligned) {
        for e in list.iter() {
            let native = ArchivedEntry::to_native(e);
            let _ = native.record_len();
        }
    }
});
