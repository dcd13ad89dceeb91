//! A spare descriptor each loop keeps so that, out of descriptors (EMFILE, ENFILE), it
//! can still refuse a waiting client at once: close the spare, accept and close the
//! connection, open the spare again. Without it the client waits in the listen backlog
//! until its own timeout while accept fails in a loop. This module only juggles the
//! spare, accepts and closes, and counts; module `admission` decides when to use it and
//! logs (rate-limited).

use std::fs::File;
use std::io;
use std::os::fd::BorrowedFd;

/// The spare descriptor (`/dev/null`) and how many connections it refused.
#[derive(Debug)]
pub(super) struct SpareFd {
    spare: Option<File>,
    refused: u64,
}

impl SpareFd {
    /// Opens the spare (`None` inside when even that fails: refusals then fall back to
    /// the accept back-off).
    pub(super) fn open() -> SpareFd {
        SpareFd {
            spare: File::open("/dev/null").ok(),
            refused: 0,
        }
    }

    /// Whether an accept failed for lack of descriptors.
    pub(super) fn exhausted(error: &io::Error) -> bool {
        matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
    }

    /// Frees the spare, lets `accept` accept one waiting connection and drop it
    /// (`Ok(false)` when none waits), then reopens the spare. Returns whether a
    /// connection was refused.
    pub(super) fn refuse_one(&mut self, accept: impl FnOnce() -> io::Result<bool>) -> bool {
        if self.spare.take().is_none() {
            self.spare = File::open("/dev/null").ok();
            return false;
        }
        let refused = matches!(accept(), Ok(true));
        self.spare = File::open("/dev/null").ok();
        if refused {
            self.refused = self.refused.saturating_add(1);
        }
        refused
    }

    /// Connections refused so far.
    pub(super) fn refused(&self) -> u64 {
        self.refused
    }
}

/// Accepts one connection waiting on `listener` and closes it at once; `Ok(false)` when
/// none waits (the listener is looked at without blocking, whether or not it is in
/// non-blocking mode).
pub(super) fn accept_and_close(listener: BorrowedFd<'_>) -> io::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(&listener, PollFlags::IN)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    if rustix::event::poll(&mut fds, Some(&now))? == 0 {
        return Ok(false);
    }
    match rustix::net::accept_with(listener, rustix::net::SocketFlags::CLOEXEC) {
        Ok(accepted) => {
            drop(accepted);
            Ok(true)
        }
        // Gone between the poll and the accept (a non-blocking listener says so).
        Err(rustix::io::Errno::AGAIN) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spare_is_freed_for_the_accept_and_reopened() {
        let mut spare = SpareFd::open();
        assert!(spare.spare.is_some());
        assert!(spare.refuse_one(|| Ok(true)));
        assert!(!spare.refuse_one(|| Ok(false)));
        assert!(!spare.refuse_one(|| Err(io::Error::from_raw_os_error(libc::EMFILE))));
        assert_eq!(spare.refused(), 1);
        assert!(spare.spare.is_some(), "reopened");
        assert!(SpareFd::exhausted(&io::Error::from_raw_os_error(
            libc::EMFILE
        )));
        assert!(SpareFd::exhausted(&io::Error::from_raw_os_error(
            libc::ENFILE
        )));
        assert!(!SpareFd::exhausted(&io::Error::from_raw_os_error(
            libc::EINTR
        )));
    }
}
