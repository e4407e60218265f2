//! kvtier-peer: the peer protocol between kvtier nodes (QUIC + mutual TLS).
//!
//! Owns: certificates, transport, membership, availability sync and chunk
//! fetch framing. Does not own: disks or the chunk store (the node crate
//! wires fetches to the tier).
//!
//! Not built yet: see docs/STATUS.md.
