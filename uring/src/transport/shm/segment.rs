//! The shared-memory segment under one ring: a sealed memfd mapped `MAP_SHARED`, a
//! header page of atomics and a power-of-two data region. This is the only module of the
//! shm transport with `unsafe` code.
//!
//! It decides the memory layout and how the mapping is reached: the header only through
//! `&RingHeader` (every field an atomic, so the peer process writing them concurrently is
//! allowed), the data region only through raw-pointer copies into and out of private
//! memory ([`Segment::read_wrapping`], [`Segment::write_wrapping`]); no Rust reference to
//! data bytes is ever created, so bytes the peer changes under us are only ever *copied*,
//! and they are validated after the copy, never in place. Every copy is bounded by the
//! capacity fixed when the segment was created or checked, never by a value read from
//! shared memory.
//!
//! A peer-created segment is mapped only after checking that its size is exactly the
//! header plus the announced capacity and that it carries `F_SEAL_SHRINK`: without the
//! seal the peer could truncate the file later and make our next access raise `SIGBUS`.
//!
//! It does not decide the record format, who writes which index, or how sides wake each
//! other up: that is [`super::ring`] and [`super::connection`].
#![allow(unsafe_code)]

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rustix::fs::{fcntl_add_seals, fcntl_get_seals, fstat, ftruncate, FileType, SealFlags};
use rustix::fs::{memfd_create, MemfdFlags};
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

use super::ShmError;

/// Bytes before the data region: one page holding the [`RingHeader`].
pub(crate) const HEADER_LEN: usize = 4096;
/// The smallest data region a ring may have.
pub(crate) const MIN_CAPACITY: usize = 4096;
/// The largest data region a ring may have (1 GiB).
pub(crate) const MAX_CAPACITY: usize = 1 << 30;

/// `"rdzv-shm"`, little-endian, in the first header word.
const MAGIC: u64 = u64::from_le_bytes(*b"rdzv-shm");
/// Version of the header layout and record format.
pub(crate) const LAYOUT_VERSION: u32 = 1;

/// One atomic alone on a 128-byte line (two 64-byte lines: the adjacent-line prefetcher
/// of x86 pulls pairs), so the producer's and the consumer's words never share one.
#[repr(C, align(128))]
pub(crate) struct Line<T>(pub(crate) T);

/// The header page of a ring. Only atomics: the peer writes some of these words at any
/// time, and the all-zero bytes of a fresh memfd are a valid value of every field.
#[repr(C)]
pub(crate) struct RingHeader {
    /// [`MAGIC`], written last by the creator.
    pub(crate) magic: Line<AtomicU64>,
    /// [`LAYOUT_VERSION`].
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

/// Whether `capacity` is a size a ring may have.
pub(crate) fn valid_capacity(capacity: u64) -> bool {
    capacity.is_power_of_two() && capacity >= MIN_CAPACITY as u64 && capacity <= MAX_CAPACITY as u64
}

/// A mapped ring segment. Unmapped on drop.
pub(crate) struct Segment {
    /// Start of the mapping (page-aligned, `HEADER_LEN + capacity` bytes long).
    base: NonNull<u8>,
    /// Bytes in the data region: a power of two, fixed at map time.
    capacity: usize,
}

// SAFETY: `Segment` owns its mapping exclusively (no other `Segment` points at it); the
// memory stays valid until `drop` unmaps it, whichever thread that happens on. The header
// is only accessed through atomics and the data through raw copies, so moving the owner
// to another thread cannot create a data race that a `Send` bound would have prevented.
unsafe impl Send for Segment {}

impl Segment {
    /// Creates a new sealed memfd of `HEADER_LEN + capacity` bytes, maps it and
    /// initialises the header. Returns the mapping and the fd to hand to the peer.
    pub(crate) fn create(capacity: usize) -> Result<(Segment, OwnedFd), ShmError> {
        if !valid_capacity(capacity as u64) {
            return Err(ShmError::InvalidOptions {
                detail: format!(
                    "ring capacity {capacity} is not a power of two in \
                     [{MIN_CAPACITY}, {MAX_CAPACITY}]"
                ),
            });
        }
        let len = HEADER_LEN + capacity;
        let fd = memfd_create(
            "rdzv-shm-inbox",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(ShmError::syscall("memfd_create"))?;
        ftruncate(&fd, len as u64).map_err(ShmError::syscall("ftruncate(memfd)"))?;
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(ShmError::syscall("fcntl(F_ADD_SEALS)"))?;
        let segment = Segment {
            base: map(&fd, len)?,
            capacity,
        };
        let header = segment.header();
        header.version.0.store(LAYOUT_VERSION, Ordering::Relaxed);
        header.capacity.0.store(capacity as u64, Ordering::Relaxed);
        header.magic.0.store(MAGIC, Ordering::Release);
        Ok((segment, fd))
    }

    /// Maps a segment the peer created, after checking that it is a sealed regular file of
    /// exactly `HEADER_LEN + capacity` bytes whose header names the same capacity.
    pub(crate) fn open(fd: &OwnedFd, capacity: u64) -> Result<Segment, ShmError> {
        let bad = |detail: String| ShmError::Handshake { detail };
        if !valid_capacity(capacity) {
            return Err(bad(format!(
                "peer announced ring capacity {capacity}, not a power of two in \
                 [{MIN_CAPACITY}, {MAX_CAPACITY}]"
            )));
        }
        // In range, so it fits a usize and the sum does not overflow.
        let capacity = capacity as usize;
        let len = HEADER_LEN + capacity;
        let stat = fstat(fd).map_err(ShmError::syscall("fstat(peer memfd)"))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(bad("peer's ring fd is not a regular file".into()));
        }
        if u64::try_from(stat.st_size).ok() != Some(len as u64) {
            return Err(bad(format!(
                "peer's ring segment has {} bytes, expected {len}",
                stat.st_size
            )));
        }
        let seals = fcntl_get_seals(fd).map_err(ShmError::syscall("fcntl(F_GET_SEALS)"))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(bad(
                "peer's ring segment is not sealed against shrinking".into()
            ));
        }
        let segment = Segment {
            base: map(fd, len)?,
            capacity,
        };
        let header = segment.header();
        if header.magic.0.load(Ordering::Acquire) != MAGIC
            || header.version.0.load(Ordering::Relaxed) != LAYOUT_VERSION
            || header.capacity.0.load(Ordering::Relaxed) != capacity as u64
        {
            return Err(bad(
                "peer's ring segment header does not match the handshake".into(),
            ));
        }
        Ok(segment)
    }

    /// The header atomics.
    pub(crate) fn header(&self) -> &RingHeader {
        // SAFETY: the mapping is at least HEADER_LEN bytes, page-aligned (so aligned for
        // RingHeader, whose size and alignment are asserted <= HEADER_LEN above), readable
        // and writable, and lives as long as `self`. RingHeader holds only atomics, for
        // which every bit pattern is valid and concurrent writes by the peer process are
        // permitted through a shared reference.
        unsafe { &*self.base.as_ptr().cast::<RingHeader>() }
    }

    /// Bytes in the data region.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Copies `dst.len()` bytes out of the data region starting at ring position `pos`
    /// (taken modulo the capacity), wrapping at its end.
    pub(crate) fn read_wrapping(&self, pos: u64, dst: &mut [u8]) {
        let mut done = 0;
        let mut pos = pos;
        while done < dst.len() {
            let (offset, n) = self.span(pos, dst.len() - done);
            let Some(out) = dst.get_mut(done..done + n) else {
                return;
            };
            // SAFETY: `span` guarantees offset + n <= capacity, so the source range lies
            // inside the data region of our live mapping; `out` is n bytes of private
            // memory, which cannot overlap the mapping. Only raw pointers touch the shared
            // bytes, so the peer writing them concurrently changes what we copy, never the
            // validity of a reference.
            unsafe {
                std::ptr::copy_nonoverlapping(self.data_ptr().add(offset), out.as_mut_ptr(), n);
            }
            done += n;
            pos = pos.wrapping_add(n as u64);
        }
    }

    /// Copies `src` into the data region starting at ring position `pos` (taken modulo
    /// the capacity), wrapping at its end.
    pub(crate) fn write_wrapping(&self, pos: u64, src: &[u8]) {
        let mut done = 0;
        let mut pos = pos;
        while done < src.len() {
            let (offset, n) = self.span(pos, src.len() - done);
            let Some(chunk) = src.get(done..done + n) else {
                return;
            };
            // SAFETY: as in `read_wrapping`: the destination range offset..offset + n lies
            // inside the data region of our live, writable mapping, and `chunk` is private
            // memory that cannot overlap it.
            unsafe {
                std::ptr::copy_nonoverlapping(chunk.as_ptr(), self.data_ptr().add(offset), n);
            }
            done += n;
            pos = pos.wrapping_add(n as u64);
        }
    }

    /// The data-region offset of `pos` and how many of `want` bytes fit before the end.
    /// Always `offset + n <= capacity` and `n >= 1` when `want >= 1`.
    fn span(&self, pos: u64, want: usize) -> (usize, usize) {
        let mask = self.capacity as u64 - 1;
        // Masked by a capacity that fits a usize, so the cast is lossless.
        let offset = (pos & mask) as usize;
        (offset, want.min(self.capacity - offset))
    }

    fn data_ptr(&self) -> *mut u8 {
        // SAFETY: the mapping is HEADER_LEN + capacity bytes long, so HEADER_LEN is in
        // bounds of the same allocation.
        unsafe { self.base.as_ptr().add(HEADER_LEN) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base` and this length are exactly what `map` returned and used; no
        // reference derived from the mapping outlives `self` (`header` borrows `self`).
        // Failure can only mean bad arguments, which cannot happen; nothing to do then.
        let _ = unsafe { munmap(self.base.as_ptr().cast(), HEADER_LEN + self.capacity) };
    }
}

/// Maps `len` bytes of `fd` shared, readable and writable, prefaulted.
fn map(fd: &OwnedFd, len: usize) -> Result<NonNull<u8>, ShmError> {
    // SAFETY: a fresh mapping at an address of the kernel's choosing cannot alias any
    // existing Rust object. The caller checked (or set and sealed) the file size to be
    // exactly `len`, so no access within the mapping can fault with SIGBUS.
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
    .map_err(ShmError::syscall("mmap(memfd)"))?;
    NonNull::new(ptr.cast::<u8>()).ok_or(ShmError::Handshake {
        detail: "mmap returned a null mapping".into(),
    })
}
