//! Descriptors this process inherited by number (`--listen-fd N`, systemd's
//! `LISTEN_FDS`): no Rust object owns them, so they can only be borrowed from the raw
//! number, here, after checking that the number is open.

use std::os::fd::{BorrowedFd, RawFd};

/// Runs `f` with inherited descriptor `fd` borrowed; `None` when `fd` is not an open
/// descriptor of this process. `f` may duplicate it but must not assume it owns it.
pub(crate) fn with_inherited<T>(fd: RawFd, f: impl FnOnce(BorrowedFd<'_>) -> T) -> Option<T> {
    if fd < 0 {
        return None;
    }
    // SAFETY: F_GETFD only reads the descriptor table; a number that is not open fails
    // with EBADF, which is what this checks before anything borrows it.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
        return None;
    }
    // SAFETY: `fd` is open (checked just above). It was inherited: the process owns it
    // and no Rust object of this process does (the callers take it from the command
    // line or the environment, never from an `OwnedFd`), so nothing closes it while `f`
    // runs, and the borrow cannot outlive `f` (its lifetime is the closure's).
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    Some(f(borrowed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn open_descriptors_are_lent_and_closed_ones_refused() {
        let file = tempfile::tempfile().expect("tempfile");
        let raw = file.as_raw_fd();
        let same = with_inherited(raw, |fd| fd.as_raw_fd());
        assert_eq!(same, Some(raw));
        // (A number closed here could be reused at once by a test running beside this
        // one, so only numbers that are never open are tried.)
        assert_eq!(with_inherited(-1, |_| ()), None);
        assert_eq!(with_inherited(i32::MAX, |_| ()), None);
    }
}
