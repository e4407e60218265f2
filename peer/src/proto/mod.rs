//! The sans-IO peer protocol: messages, framing, availability sync and
//! membership state machines.
//!
//! Nothing here does I/O, reads a clock or imports quinn: every function
//! that depends on time takes `now: Instant`. [`crate::transport`] drives
//! these machines over QUIC streams; the tests below drive them in memory
//! under virtual time.

pub mod codec;
pub mod frame;
pub mod health;
pub mod msg;
pub mod sync;

pub use codec::DecodeError;
pub use health::{Backoff, HealthConfig, PeerHealth, PeerState};
pub use msg::{FetchStatus, Message, Op};
pub use sync::{Publisher, RemoteSync, SyncAction, SyncPhase};

#[cfg(test)]
mod tests;
