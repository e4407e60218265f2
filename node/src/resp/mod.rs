//! The RESP2 endpoint: a Redis-compatible TCP listener for LMCache's
//! `resp://` remote backend and for `redis-cli` / `redis-benchmark`.
//!
//! Layout: [`parser`] is a sans-IO request parser over a byte buffer (fuzzed),
//! [`commands`] executes one parsed command against a [`NodeContext`] and
//! encodes the reply exactly as Redis 7 would, [`keys`] maps opaque RESP keys
//! to chunk ids (LMCache keys get one namespace per rank), and `server`
//! drives connections over tokio.
//!
//! Call order: [`check_bind`] before binding, then [`serve`] with the bound
//! listener and a shutdown future; `serve` returns after every connection task
//! has finished.

pub mod commands;
mod info;
pub mod keys;
pub mod parser;
pub mod reply;
mod server;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::NodeContext;

/// Options of the RESP endpoint.
#[derive(Clone, Debug)]
pub struct RespOptions {
    /// Password required by `AUTH` (for the `default` user). `None`: no
    /// authentication, which is only allowed on loopback addresses.
    /// Default: none.
    pub password: Option<String>,
    /// Largest value (bulk string) accepted, in bytes; a longer bulk length is
    /// refused with an error before anything is allocated. Default: 512 MiB.
    pub max_value: u64,
    /// Most client connections served at once; further ones get Redis's
    /// "max number of clients reached" error and are closed. Default: 1024.
    pub max_connections: usize,
    /// Most bytes of large values (64 KiB and more) being received at once
    /// over all connections (a value's buffer is taken at its announced
    /// length); a connection whose value would go past it gets an error and
    /// is closed. 0: the larger of 1 GiB and a quarter of the RAM budget.
    /// Default: 0.
    pub max_receiving: usize,
    /// Longest a large value's receive may go without bytes arriving; past
    /// it (or when the value arrives slower than 1 MiB/s on average after
    /// this much time) the client gets an error and is closed, giving its
    /// share of `max_receiving` back (two idle clients announcing 512 MiB
    /// each refused every other large SET for as long as they stayed: QA).
    /// Default: 30 s.
    pub value_timeout: std::time::Duration,
    /// How long a positive EXISTS keeps the key's bytes for its GET (see
    /// `commands::pin`); the bytes go when it runs out, also on a
    /// connection that sends nothing more. Default: 10 s.
    pub pin_ttl: std::time::Duration,
}

impl Default for RespOptions {
    fn default() -> Self {
        Self {
            password: None,
            max_value: 512 << 20,
            max_connections: 1024,
            max_receiving: 0,
            value_timeout: std::time::Duration::from_secs(30),
            pin_ttl: std::time::Duration::from_secs(10),
        }
    }
}

/// Errors of the RESP endpoint (not of single commands: those are replies).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RespError {
    /// A non-loopback listen address was configured without a password.
    #[error(
        "refusing to serve RESP on non-loopback address {addr} without a password: set a resp password, or listen on 127.0.0.1 / [::1]"
    )]
    InsecureBind {
        /// The refused address.
        addr: SocketAddr,
    },
    /// The options contradict themselves.
    #[error("invalid RESP option: {0}")]
    Config(String),
    /// Accepting connections failed.
    #[error("RESP listener I/O error while trying to {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Refuses a non-loopback bind address unless a password is configured.
pub fn check_bind(addr: &SocketAddr, password: Option<&str>) -> Result<(), RespError> {
    let has_password = password.is_some_and(|p| !p.is_empty());
    if addr.ip().is_loopback() || has_password {
        Ok(())
    } else {
        Err(RespError::InsecureBind { addr: *addr })
    }
}

/// Serves RESP2 on `listener` until `shutdown` completes, then closes every
/// connection at its next wait and returns once all connection tasks have
/// finished. A command still waiting then (a peer fetch, a SET waiting for
/// the disk writer under `backpressure`) goes unanswered: its client sees
/// the connection close and cannot count it as done (a SET whose store call
/// had begun may still land, before the store's final flush or not).
pub async fn serve(
    listener: tokio::net::TcpListener,
    ctx: Arc<NodeContext>,
    opts: RespOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RespError> {
    server::run(listener, ctx, opts, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_bind_refuses_public_addresses_without_password() {
        let lo: SocketAddr = "127.0.0.1:6380".parse().expect("addr");
        let lo6: SocketAddr = "[::1]:6380".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:6380".parse().expect("addr");
        assert!(check_bind(&lo, None).is_ok());
        assert!(check_bind(&lo6, None).is_ok());
        assert!(matches!(
            check_bind(&any, None),
            Err(RespError::InsecureBind { .. })
        ));
        assert!(check_bind(&any, Some("")).is_err());
        assert!(check_bind(&any, Some("pw")).is_ok());
    }
}
