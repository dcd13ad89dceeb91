//! `process_vm_readv(2)` (rustix has no wrapper): copies ranges of another process's
//! memory into buffers of this one. The local side is borrowed slices, so the kernel
//! writes only memory this call borrows exclusively; the remote side is plain numbers,
//! which the kernel checks against the other process's mappings (`EFAULT`).

use std::io::{self, IoSliceMut};

/// A range of the other process's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteRange {
    /// Its start address, in the other process.
    pub(crate) address: u64,
    /// Its length in bytes.
    pub(crate) len: usize,
}

/// Reads the `remote` ranges of process `pid` into the `local` buffers, in order (the
/// two lists are consumed as one stream of bytes each); returns how many bytes moved,
/// which may be fewer than asked (a remote page unmapped part-way, say). At most
/// `IOV_MAX` (1024) entries per side.
pub(crate) fn read_process_memory(
    pid: libc::pid_t,
    local: &mut [IoSliceMut<'_>],
    remote: &[RemoteRange],
) -> io::Result<usize> {
    let remote: Vec<libc::iovec> = remote
        .iter()
        .map(|range| libc::iovec {
            // The remote address is only a number to the kernel, which validates it
            // against the peer's mappings; it is never dereferenced here.
            iov_base: range.address as usize as *mut libc::c_void,
            iov_len: range.len,
        })
        .collect();
    // SAFETY: `IoSliceMut` is ABI-compatible with `iovec` on Unix (std documents it),
    // and each one is a `&mut [u8]` borrowed exclusively for this call, so the kernel
    // writes only memory this function may write, within those slices' lengths. The
    // remote iovecs are addresses in the other process, which the kernel checks (EFAULT)
    // and never dereferences in this one. Both arrays outlive the call; their lengths
    // are passed with them.
    let moved = unsafe {
        libc::process_vm_readv(
            pid,
            local.as_mut_ptr().cast::<libc::iovec>(),
            local.len() as libc::c_ulong,
            remote.as_ptr(),
            remote.len() as libc::c_ulong,
            0,
        )
    };
    usize::try_from(moved).map_err(|_| io::Error::last_os_error())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_its_own_memory_across_pieces() {
        let source = b"hello, world".to_vec();
        let base = source.as_ptr() as u64;
        let mut a = [0u8; 5];
        let mut b = [0u8; 7];
        let mut local = [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)];
        let remote = [
            RemoteRange {
                address: base,
                len: 7,
            },
            RemoteRange {
                address: base + 7,
                len: 5,
            },
        ];
        match read_process_memory(std::process::id() as libc::pid_t, &mut local, &remote) {
            Ok(moved) => {
                assert_eq!(moved, 12);
                assert_eq!(&a, b"hello");
                assert_eq!(&b, b", world");
            }
            // Refused by a seccomp profile or Yama on some CI hosts.
            Err(error) => eprintln!("skipped: process_vm_readv refused here ({error})"),
        }
    }

    #[test]
    fn a_bad_remote_address_is_an_error_not_a_crash() {
        let mut a = [0u8; 8];
        let mut local = [IoSliceMut::new(&mut a)];
        let remote = [RemoteRange { address: 8, len: 8 }];
        let result = read_process_memory(std::process::id() as libc::pid_t, &mut local, &remote);
        assert!(result.is_err(), "address 8 is never mapped: {result:?}");
        assert_eq!(a, [0; 8]);
    }
}
