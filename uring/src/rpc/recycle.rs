//! Large tensor buffers, recycled: a buffer the agent finished sending is kept (up to
//! [`MAX_KEPT`] of them, [`MAX_KEPT_BYTES`] in all) and the next large tensor received
//! is read into it instead of into fresh memory.
//!
//! Fresh memory for a 64 MiB tensor costs 16,384 page faults (and the kernel zeroing
//! each page) before the first byte lands; on our 2-CPU host that was most of the time
//! of a 64 MiB echo (`perf stat -e page-faults` on `rdzv bench rpc --sizes 64M`). A
//! recycled buffer is already mapped. Its old bytes are never seen: a receive either
//! overwrites all `len` bytes or fails and drops the buffer.
//!
//! Buffers come back from sends, and from received tensors whose user is done with them
//! ([`give_received`]: the Python binding hands received buffers to Python without a
//! copy, and gives them back when Python drops them).
//!
//! Only buffers of at least [`MIN_RECYCLED`] bytes are kept; this module decides nothing
//! else.

use std::sync::{Mutex, MutexGuard};

/// Buffers smaller than this are not worth keeping (the allocator reuses them anyway).
pub(super) const MIN_RECYCLED: usize = 1 << 20;
/// At most this many buffers are kept.
pub(super) const MAX_KEPT: usize = 4;
/// At most this many bytes (of capacity) are kept.
pub(super) const MAX_KEPT_BYTES: usize = 1 << 30;

static POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn pool() -> MutexGuard<'static, Vec<Vec<u8>>> {
    POOL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A buffer of exactly `len` bytes whose contents the caller overwrites entirely: a
/// recycled one if one is large enough, else a fresh zeroed one. `len` usually comes
/// from a peer (within the frame limits): a size this process cannot allocate is an
/// error for the caller to report, never an abort.
///
/// # Errors
/// [`AllocFailed`] when no recycled buffer fits and the allocator refuses `len` bytes.
pub(super) fn try_take(len: usize) -> Result<Vec<u8>, AllocFailed> {
    if let Some(buffer) = take_recycled(len) {
        return Ok(buffer);
    }
    crate::sys::memory::try_zeroed(len).ok_or(AllocFailed { len })
}

/// The allocator refused a buffer of `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cannot allocate a {len}-byte buffer for it (out of memory)")]
pub(crate) struct AllocFailed {
    /// The size asked for.
    pub len: usize,
}

/// A recycled buffer of exactly `len` bytes, if one is large enough.
fn take_recycled(len: usize) -> Option<Vec<u8>> {
    if len < MIN_RECYCLED {
        return None;
    }
    let mut buffer = {
        let mut pool = pool();
        // The smallest buffer that holds `len` without growing.
        let best = pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i)?;
        pool.swap_remove(best)
    };
    if buffer.len() >= len {
        buffer.truncate(len);
    } else {
        // Only the part past the old length is written (no reallocation).
        buffer.resize(len, 0);
    }
    Some(buffer)
}

/// [`try_take`], for tests.
#[cfg(test)]
fn take(len: usize) -> Vec<u8> {
    try_take(len).unwrap_or_else(|e| panic!("{e}"))
}

/// Keeps `buffer` for a later [`try_take`] if it is large and there is room; drops it
/// otherwise.
pub(super) fn give(buffer: Vec<u8>) {
    if buffer.capacity() < MIN_RECYCLED {
        return;
    }
    let mut pool = pool();
    let kept: usize = pool.iter().map(Vec::capacity).sum();
    if pool.len() < MAX_KEPT && kept.saturating_add(buffer.capacity()) <= MAX_KEPT_BYTES {
        pool.push(buffer);
    }
}

/// A received tensor's buffer that its user is done with (a binding whose object
/// owned it, say: the Python `ReceivedBuffer`), kept for the next large receive like a
/// sent one. Its bytes are never seen again: a receive overwrites all of them.
pub fn give_received(buffer: Vec<u8>) {
    give(buffer);
}

/// A sent tensor's buffer: a `Vec` to keep, or something else that is only dropped
/// (bytes a device runtime staged go back to it).
pub(super) trait Recyclable {
    /// The `Vec` to keep, if it is one.
    fn into_recyclable(self) -> Option<Vec<u8>>;
}

impl Recyclable for Vec<u8> {
    fn into_recyclable(self) -> Option<Vec<u8>> {
        Some(self)
    }
}

/// Gives every tensor buffer of a sent frame back.
pub(super) fn give_all<B: Recyclable>(buffers: Vec<B>) {
    for buffer in buffers {
        if let Some(buffer) = buffer.into_recyclable() {
            give(buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_come_back_with_the_asked_length() {
        // Tests share the pool: drain it first so the counts below are ours.
        pool().clear();
        let small = take(10);
        assert_eq!(small, vec![0u8; 10]);
        give(small);
        assert!(pool().is_empty());

        let len = MIN_RECYCLED * 2;
        let buffer = vec![7u8; len];
        let ptr = buffer.as_ptr();
        give(buffer);
        // A smaller request reuses it, truncated.
        let reused = take(MIN_RECYCLED + 1);
        assert_eq!(reused.as_ptr(), ptr);
        assert_eq!(reused.len(), MIN_RECYCLED + 1);
        give(reused);
        // A larger one grows it without reallocating when the capacity allows.
        let grown = take(len);
        assert_eq!(grown.len(), len);
        assert_eq!(grown.as_ptr(), ptr);
        // One that no kept buffer holds is fresh and zeroed.
        let fresh = take(len * 2);
        assert!(fresh.iter().all(|&b| b == 0));
        assert_eq!(take(0), Vec::<u8>::new());
        // A size no allocator can give is an error, not an abort.
        assert_eq!(
            try_take(usize::MAX >> 1).err(),
            Some(AllocFailed {
                len: usize::MAX >> 1
            })
        );

        // At most MAX_KEPT buffers are kept.
        for _ in 0..(MAX_KEPT + 3) {
            give(Vec::with_capacity(MIN_RECYCLED));
        }
        assert!(pool().len() <= MAX_KEPT);
    }
}
