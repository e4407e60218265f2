//! Service manager notification: systemd's `sd_notify` datagram protocol,
//! spoken directly (no libsystemd). Under `Type=notify` systemd sets
//! `NOTIFY_SOCKET`; the daemon sends `READY=1` once every listener is bound
//! and the store is recovered, so units ordered after kvtier start only when
//! its socket answers, and `STOPPING=1` when a shutdown begins. Without
//! `NOTIFY_SOCKET` nothing is sent.

use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The variable systemd sets for `Type=notify` services.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// Where `NOTIFY_SOCKET` points: a path, or (with a leading `@`) a name in
/// the abstract namespace.
fn address(value: &str) -> std::io::Result<SocketAddr> {
    match value.strip_prefix('@') {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name.as_bytes())
        }
        None => SocketAddr::from_pathname(value),
    }
}

/// Sends `state` (newline-separated `KEY=VALUE` assignments) to the
/// service manager, when there is one. A failure is logged once per call
/// site's state and never stops the daemon: systemd then times the start
/// out, which its own log names.
pub fn notify(state: &str) {
    let Some(value) = std::env::var_os(NOTIFY_SOCKET) else {
        return;
    };
    let value = value.to_string_lossy();
    let sent = address(&value).and_then(|addr| {
        let sock = UnixDatagram::unbound()?;
        sock.send_to_addr(state.as_bytes(), &addr)
    });
    if let Err(e) = sent {
        tracing::warn!(socket = %value, error = %e, state = state.lines().next().unwrap_or(""),
            "could not notify the service manager (NOTIFY_SOCKET)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_abstract_names_are_told_apart() {
        let a = address("/run/systemd/notify").expect("path");
        assert_eq!(
            a.as_pathname(),
            Some(std::path::Path::new("/run/systemd/notify"))
        );
        use std::os::linux::net::SocketAddrExt;
        let b = address("@kvtier-test").expect("abstract");
        assert_eq!(b.as_abstract_name(), Some(&b"kvtier-test"[..]));
    }
}
