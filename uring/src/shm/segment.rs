//! The shared-memory segment under one ring: a sealed memfd mapped `MAP_SHARED`, a
//! header page of atomics and a power-of-two data region.
//!
//! It decides the segment's size rules, creates and seals the memfd, checks a peer's
//! segment against the handshake, and copies ring positions in and out with wrapping.
//! The mapping itself is `crate::sys::shm::Mapping` (the crate's `unsafe` code): the
//! header is reached only through `&RingHeader` (every field an atomic, so the peer
//! process writing them concurrently is allowed), the data region only through
//! bounds-checked copies into and out of private memory ([`Segment::read_wrapping`],
//! [`Segment::write_wrapping`]), so bytes the peer changes under us are only ever
//! *copied*, and validated after the copy, never in place. Every copy is bounded by the
//! capacity fixed when the segment was created or checked, never by a value read from
//! shared memory.
//!
//! A peer-created segment is mapped only if its size is exactly the header plus the
//! announced capacity and it carries `F_SEAL_SHRINK` (the mapping checks both): without
//! the seal the peer could truncate the file later and make our next access raise
//! `SIGBUS`.
//!
//! It does not decide the record format, who writes which index, or how sides wake each
//! other up: that is [`super::ring`] and [`super::connection`].

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;

use rustix::fs::{fcntl_add_seals, ftruncate, SealFlags};
use rustix::fs::{memfd_create, MemfdFlags};

use crate::sys::shm::{MapError, Mapping, RingHeader, HEADER_LEN};

use super::ShmError;

/// The smallest data region a ring may have.
pub(crate) const MIN_CAPACITY: usize = 4096;
/// The largest data region a ring may have (1 GiB).
pub(crate) const MAX_CAPACITY: usize = 1 << 30;

/// `"rdzv-shm"`, little-endian, in the first header word.
const MAGIC: u64 = u64::from_le_bytes(*b"rdzv-shm");
/// Version of the header layout and record format.
pub(crate) const LAYOUT_VERSION: u32 = 1;

/// Whether `capacity` is a size a ring may have.
pub(crate) fn valid_capacity(capacity: u64) -> bool {
    capacity.is_power_of_two() && capacity >= MIN_CAPACITY as u64 && capacity <= MAX_CAPACITY as u64
}

/// A mapped ring segment. Unmapped on drop.
pub(crate) struct Segment {
    mapping: Mapping,
}

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
            mapping: Mapping::map(&fd, capacity).map_err(|e| map_error(e, "our own"))?,
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
        let segment = Segment {
            mapping: Mapping::map(fd, capacity).map_err(|e| map_error(e, "peer's"))?,
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
    #[inline]
    pub(crate) fn header(&self) -> &RingHeader {
        self.mapping.header()
    }

    /// Bytes in the data region.
    #[inline]
    pub(crate) fn capacity(&self) -> usize {
        self.mapping.capacity()
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
            // `span` keeps offset + n within the capacity, so the copy is never refused.
            if self.mapping.read(offset, out).is_none() {
                return;
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
            // `span` keeps offset + n within the capacity, so the copy is never refused.
            if self.mapping.write(offset, chunk).is_none() {
                return;
            }
            done += n;
            pos = pos.wrapping_add(n as u64);
        }
    }

    /// The data-region offset of `pos` and how many of `want` bytes fit before the end.
    /// Always `offset + n <= capacity` and `n >= 1` when `want >= 1`.
    fn span(&self, pos: u64, want: usize) -> (usize, usize) {
        let capacity = self.capacity();
        let mask = capacity as u64 - 1;
        // Masked by a capacity that fits a usize, so the cast is lossless.
        let offset = (pos & mask) as usize;
        (offset, want.min(capacity - offset))
    }
}

/// A refused or failed mapping of `whose` ring segment as the transport reports it.
fn map_error(error: MapError, whose: &str) -> ShmError {
    match error {
        MapError::Syscall { op, errno } => ShmError::Syscall {
            op,
            source: errno.into(),
        },
        MapError::Refused(why) => ShmError::Handshake {
            detail: format!("{whose} ring segment cannot be mapped: {why}"),
        },
    }
}
