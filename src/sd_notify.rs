//! systemd's readiness protocol (`sd_notify(3)`), without libsystemd: one datagram of
//! `KEY=VALUE` lines to the unix socket `$NOTIFY_SOCKET` names (a path, or `@name` in the
//! abstract namespace). `rdzv store serve` sends `READY=1` once it listens and
//! `STOPPING=1` when a signal starts its drain, so that a `Type=notify` unit
//! (`contrib/rdzv-store.service`) is started only when clients can connect.
//!
//! Without `$NOTIFY_SOCKET` (not under systemd, or not `Type=notify`) nothing is sent.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sends `state` (e.g. `"READY=1"`) to the service manager, if `$NOTIFY_SOCKET` names
/// one; returns whether it did.
///
/// # Errors
/// The socket could not be made or the datagram not sent; the error names the socket.
pub(crate) fn notify(state: &str) -> io::Result<bool> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(socket) if !socket.is_empty() => {
            notify_to(&socket.to_string_lossy(), state)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Sends `state` to the notify socket `socket` (`/path` or `@abstract`).
pub(crate) fn notify_to(socket: &str, state: &str) -> io::Result<()> {
    let named = |e: io::Error| io::Error::new(e.kind(), format!("NOTIFY_SOCKET {socket}: {e}"));
    let addr = match socket.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        None => SocketAddr::from_pathname(socket),
    }
    .map_err(named)?;
    let sender = UnixDatagram::unbound().map_err(named)?;
    let sent = sender
        .send_to_addr(state.as_bytes(), &addr)
        .map_err(named)?;
    if sent != state.len() {
        return Err(named(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("sent {sent} of {} bytes", state.len()),
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn received(socket: &UnixDatagram) -> String {
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 256];
        let n = socket.recv(&mut buf).expect("a datagram");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn a_state_reaches_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let manager = UnixDatagram::bind(&path).unwrap();
        notify_to(path.to_str().unwrap(), "READY=1").unwrap();
        assert_eq!(received(&manager), "READY=1");
        notify_to(path.to_str().unwrap(), "STOPPING=1").unwrap();
        assert_eq!(received(&manager), "STOPPING=1");
    }

    #[test]
    fn a_state_reaches_an_abstract_socket() {
        let name = format!("rdzv-test-notify-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let manager = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(&format!("@{name}"), "READY=1").unwrap();
        assert_eq!(received(&manager), "READY=1");
    }

    #[test]
    fn a_socket_nobody_binds_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nobody");
        let err = notify_to(path.to_str().unwrap(), "READY=1").unwrap_err();
        assert!(err.to_string().starts_with("NOTIFY_SOCKET "), "{err}");
        assert!(err.to_string().contains("nobody"), "{err}");
    }
}
