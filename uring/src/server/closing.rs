//! How a store connection is closed after its last whole reply without resetting it:
//! `close` on a socket whose receive queue still holds bytes (pipelined requests the
//! server will not serve) sends RST, and a reset makes the kernel drop what it has not
//! sent yet, cutting the last reply in the middle. So the loop first sends FIN after the
//! replies (`shutdown(SHUT_WR)`), then discards what the peer sent, and closes only then.
//! This module decides nothing about when; both loops call it once a closing connection
//! owes nothing more.

use std::os::fd::AsFd;

/// Most bytes discarded before closing anyway: a peer that keeps sending gets its reset.
const DISCARD_AT_MOST: usize = 256 << 10;

/// Sends FIN after everything queued, and empties the receive queue without blocking
/// (at most [`DISCARD_AT_MOST`] bytes), so that the close that follows sends no RST.
pub(super) fn finish(socket: impl AsFd) {
    let fd = socket.as_fd();
    let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Write);
    let mut sink = [0u8; 16 << 10];
    let mut discarded = 0;
    while discarded < DISCARD_AT_MOST {
        match rustix::net::recv(fd, &mut sink, rustix::net::RecvFlags::DONTWAIT) {
            Ok((0, _)) => return,
            Ok((n, _)) => discarded += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return,
        }
    }
}
