//! A shared-memory ring segment's mapping: a sealed memfd mapped `MAP_SHARED` by two
//! processes, a header page of atomics ([`RingHeader`]) and a data region
//! (`shm::segment` builds the ring on it).
//!
//! The other process writes this memory at any time, so no Rust reference to its bytes
//! may exist except to atomics: the header is reached only as `&RingHeader` (every field
//! an atomic, for which any bit pattern is valid and concurrent writes are allowed), and
//! the data region only through bounds-checked copies into and out of private memory
//! ([`Mapping::read`], [`Mapping::write`]), which the caller validates after the copy.
//!
//! A file is mapped only if it is a regular file of exactly `HEADER_LEN + capacity`
//! bytes sealed against shrinking ([`Mapping::map`]): otherwise the peer could truncate
//! it later and make an access within the mapping raise `SIGBUS`.
//!
//! It does not decide the record format, the indices' meaning, or wake-ups.

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use rustix::fs::{fcntl_get_seals, fstat, FileType, SealFlags};
use rustix::io::Errno;
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

/// Bytes before the data region: one page holding the [`RingHeader`].
pub(crate) const HEADER_LEN: usize = 4096;

/// One atomic alone on a 128-byte line (two 64-byte lines: the adjacent-line prefetcher
/// of x86 pulls pairs), so the producer's and the consumer's words never share one.
#[repr(C, align(128))]
pub(crate) struct Line<T>(pub(crate) T);

/// The header page of a ring. Only atomics: the peer writes some of these words at any
/// time, and the all-zero bytes of a fresh memfd are a valid value of every field.
/// (Adding a field that is not an atomic would make [`Mapping::header`] unsound.)
#[repr(C)]
pub(crate) struct RingHeader {
    /// The layout's magic number, written last by the creator.
    pub(crate) magic: Line<AtomicU64>,
    /// The layout version.
    pub(crate) version: Line<AtomicU32>,
    /// Bytes in the data region (a power of two).
    pub(crate) capacity: Line<AtomicU64>,
    /// Bytes ever published by the producer (written by the producer only).
    pub(crate) head: Line<AtomicU64>,
    /// Bytes ever consumed by the consumer (written by the consumer only).
    pub(crate) tail: Line<AtomicU64>,
    /// 1 while the consumer is (about to be) blocked on its data eventfd.
    pub(crate) consumer_sleeping: Line<AtomicU32>,
    /// 1 while the producer is (about to be) blocked waiting for free space.
    pub(crate) producer_waiting: Line<AtomicU32>,
    /// 1 once the producer will write no more (its sender half was dropped).
    pub(crate) producer_closed: Line<AtomicU32>,
    /// 1 once the consumer will read no more (its receiver half was dropped).
    pub(crate) consumer_closed: Line<AtomicU32>,
}

const _: () = assert!(std::mem::size_of::<RingHeader>() <= HEADER_LEN);
const _: () = assert!(std::mem::align_of::<RingHeader>() <= HEADER_LEN);

/// Why a file was not mapped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MapError {
    /// A system call failed.
    #[error("{op} failed: {errno}")]
    Syscall {
        /// The call.
        op: &'static str,
        /// Its error.
        errno: Errno,
    },
    /// The file is not a sealed regular file of the expected size.
    #[error("{0}")]
    Refused(String),
}

/// A ring segment mapped shared, readable and writable: `HEADER_LEN + capacity` bytes.
/// Unmapped on drop.
pub(crate) struct Mapping {
    /// Start of the mapping (page-aligned, `HEADER_LEN + capacity` bytes long).
    base: NonNull<u8>,
    /// Bytes in the data region, fixed at map time.
    capacity: usize,
}

// SAFETY: a `Mapping` owns its mapping exclusively (no other `Mapping` or Rust object
// points at it); the memory stays valid until `drop` unmaps it, whichever thread that
// happens on. The header is only reached through atomics and the data through copies,
// so moving the owner to another thread creates no data race a `Send` bound would have
// prevented.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps `fd` shared, readable, writable and prefaulted, after checking that it is a
    /// regular file of exactly `HEADER_LEN + capacity` bytes sealed against shrinking.
    pub(crate) fn map(fd: &OwnedFd, capacity: usize) -> Result<Mapping, MapError> {
        let syscall = |op| move |errno| MapError::Syscall { op, errno };
        let len = HEADER_LEN.checked_add(capacity).ok_or_else(|| {
            MapError::Refused(format!(
                "a capacity of {capacity} bytes does not fit in memory"
            ))
        })?;
        let stat = fstat(fd).map_err(syscall("fstat(memfd)"))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(MapError::Refused("it is not a regular file".into()));
        }
        if u64::try_from(stat.st_size).ok() != Some(len as u64) {
            return Err(MapError::Refused(format!(
                "it has {} bytes, expected {len}",
                stat.st_size
            )));
        }
        let seals = fcntl_get_seals(fd).map_err(syscall("fcntl(F_GET_SEALS)"))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(MapError::Refused(
                "it is not sealed against shrinking".into(),
            ));
        }
        // SAFETY: a fresh mapping at an address of the kernel's choosing cannot alias
        // any existing Rust object. The file was just checked to be exactly `len` bytes
        // and sealed against shrinking, so it stays at least that long and no access
        // within the mapping can raise SIGBUS.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::POPULATE,
                fd.as_fd(),
                0,
            )
        }
        .map_err(syscall("mmap(memfd)"))?;
        let base = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| MapError::Refused("mmap returned a null mapping".into()))?;
        Ok(Mapping { base, capacity })
    }

    /// The header atomics.
    #[inline]
    pub(crate) fn header(&self) -> &RingHeader {
        // SAFETY: the mapping is at least HEADER_LEN bytes, page-aligned (so aligned for
        // RingHeader, whose size and alignment are asserted <= HEADER_LEN above), readable
        // and writable, and lives as long as `self`. RingHeader holds only atomics, for
        // which every bit pattern is valid and concurrent writes by the peer process are
        // permitted through a shared reference.
        unsafe { &*self.base.as_ptr().cast::<RingHeader>() }
    }

    /// Bytes in the data region.
    #[inline]
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Copies `dst.len()` bytes of the data region from `offset` into `dst`; `None`
    /// (nothing copied) when that range is not inside the data region.
    #[inline]
    pub(crate) fn read(&self, offset: usize, dst: &mut [u8]) -> Option<()> {
        let src = self.data_range(offset, dst.len())?;
        // SAFETY: `data_range` checked that `offset..offset + dst.len()` lies inside the
        // data region of this live mapping; `dst` is private memory borrowed exclusively,
        // which cannot overlap the mapping. Only a raw pointer touches the shared bytes,
        // so the peer writing them concurrently changes what we copy, never the validity
        // of a reference.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), dst.len()) };
        Some(())
    }

    /// Copies `src` into the data region from `offset`; `None` (nothing copied) when
    /// that range is not inside the data region.
    #[inline]
    pub(crate) fn write(&self, offset: usize, src: &[u8]) -> Option<()> {
        let dst = self.data_range(offset, src.len())?;
        // SAFETY: as in `read`: the destination range lies inside the data region of this
        // live, writable mapping (checked by `data_range`), and `src` is private memory
        // that cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_ptr(), src.len()) };
        Some(())
    }

    /// A pointer to `len` bytes of the data region from `offset`, if they are inside it.
    #[inline]
    fn data_range(&self, offset: usize, len: usize) -> Option<NonNull<u8>> {
        let end = offset.checked_add(len)?;
        if end > self.capacity {
            return None;
        }
        // `HEADER_LEN + offset <= HEADER_LEN + capacity`, the mapping's length, so the
        // address is inside the mapping (or one past its end when `len` is 0); wrapping
        // arithmetic needs no `unsafe` and the range check above makes it exact.
        NonNull::new(self.base.as_ptr().wrapping_add(HEADER_LEN + offset))
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base` and this length are exactly what `map` mapped; no reference
        // derived from the mapping outlives `self` (`header` borrows `self`, copies end
        // before they return). Failure can only mean bad arguments, which cannot
        // happen; nothing to do then.
        let _ = unsafe { munmap(self.base.as_ptr().cast(), HEADER_LEN + self.capacity) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::{fcntl_add_seals, ftruncate, memfd_create, MemfdFlags};
    use std::sync::atomic::Ordering;

    fn memfd(len: usize, seal: bool) -> OwnedFd {
        let fd = memfd_create("t", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .expect("memfd_create");
        ftruncate(&fd, len as u64).expect("ftruncate");
        if seal {
            fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).expect("seal");
        }
        fd
    }

    #[test]
    fn copies_are_bounds_checked() {
        let fd = memfd(HEADER_LEN + 4096, true);
        let map = Mapping::map(&fd, 4096).expect("map");
        assert_eq!(map.capacity(), 4096);
        assert_eq!(map.write(4090, b"abcdef"), Some(()));
        let mut got = [0u8; 6];
        assert_eq!(map.read(4090, &mut got), Some(()));
        assert_eq!(&got, b"abcdef");
        // One byte past the end, an offset past the end, and an overflowing range.
        assert_eq!(map.write(4091, b"abcdef"), None);
        assert_eq!(map.read(4091, &mut got), None);
        assert_eq!(map.read(5000, &mut []), None);
        assert_eq!(map.read(usize::MAX, &mut got), None);
        assert_eq!(map.write(usize::MAX - 2, b"abcdef"), None);
        // Empty copies at the very end are in bounds.
        assert_eq!(map.read(4096, &mut []), Some(()));
        // A refused copy wrote nothing.
        let mut tail = [0u8; 6];
        map.read(4090, &mut tail).expect("in bounds");
        assert_eq!(&tail, b"abcdef");
    }

    #[test]
    fn two_mappings_of_one_file_share_header_and_data() {
        let fd = memfd(HEADER_LEN + 4096, true);
        let a = Mapping::map(&fd, 4096).expect("map a");
        let b = Mapping::map(&fd, 4096).expect("map b");
        a.header().head.0.store(42, Ordering::Release);
        assert_eq!(b.header().head.0.load(Ordering::Acquire), 42);
        a.write(0, b"shared").expect("in bounds");
        let mut got = [0u8; 6];
        b.read(0, &mut got).expect("in bounds");
        assert_eq!(&got, b"shared");
    }

    #[test]
    fn only_sealed_files_of_the_exact_size_are_mapped() {
        let unsealed = memfd(HEADER_LEN + 4096, false);
        assert!(matches!(
            Mapping::map(&unsealed, 4096),
            Err(MapError::Refused(why)) if why.contains("sealed")
        ));
        let sealed = memfd(HEADER_LEN + 4096, true);
        assert!(matches!(
            Mapping::map(&sealed, 8192),
            Err(MapError::Refused(why)) if why.contains("bytes")
        ));
        assert!(matches!(
            Mapping::map(&sealed, usize::MAX),
            Err(MapError::Refused(_))
        ));
        let socket: OwnedFd = std::os::unix::net::UnixDatagram::unbound()
            .expect("socket")
            .into();
        assert!(matches!(
            Mapping::map(&socket, 4096),
            Err(MapError::Refused(why)) if why.contains("regular")
        ));
    }
}
