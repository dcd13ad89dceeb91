//! Which buffers can be exported to a channel: those whose bytes stay at one address
//! while the export holds them.
//!
//! An export records the buffer's address once and sends it to the receiver, so the
//! bytes must not move when the export value moves: a `Vec<u8>`, a boxed or shared
//! slice, or a borrowed slice qualifies; an inline array (`[u8; N]`) does not, since it
//! moves with its owner. It also has the receiving side's hint for large destination
//! buffers ([`prefer_huge_pages`]). This module decides nothing else: it neither
//! allocates nor pins memory.

use std::rc::Rc;
use std::sync::Arc;

/// A byte buffer whose contents stay at the same address, with the same length and
/// unchanged, for as long as the value is held and not mutated through `&mut`.
///
/// Contract for implementors: every call to [`stable_bytes`](StableBytes::stable_bytes)
/// on one value returns the same slice (same address and length), and moving the
/// value does not move the bytes. Breaking it cannot make this process unsound (the
/// channels re-validate everything), but the receiver would read the wrong bytes.
pub trait StableBytes {
    /// The exported bytes.
    fn stable_bytes(&self) -> &[u8];
}

impl StableBytes for &[u8] {
    fn stable_bytes(&self) -> &[u8] {
        self
    }
}

impl StableBytes for &mut [u8] {
    fn stable_bytes(&self) -> &[u8] {
        self
    }
}

impl StableBytes for &Vec<u8> {
    fn stable_bytes(&self) -> &[u8] {
        self.as_slice()
    }
}

impl StableBytes for Vec<u8> {
    fn stable_bytes(&self) -> &[u8] {
        self.as_slice()
    }
}

impl StableBytes for Box<[u8]> {
    fn stable_bytes(&self) -> &[u8] {
        self
    }
}

impl StableBytes for Arc<[u8]> {
    fn stable_bytes(&self) -> &[u8] {
        self
    }
}

impl StableBytes for Arc<Vec<u8>> {
    fn stable_bytes(&self) -> &[u8] {
        self.as_slice()
    }
}

impl StableBytes for Rc<[u8]> {
    fn stable_bytes(&self) -> &[u8] {
        self
    }
}

/// Huge pages are asked for from buffers of this size on: glibc maps every allocation
/// above 32 MiB afresh (its largest dynamic mmap threshold), so such a buffer is always
/// faulted in during the copy; smaller ones are usually recycled heap memory, already
/// faulted in, where the hint only invites compaction.
pub const HUGE_PAGE_HINT_MIN: usize = 32 << 20;

/// Asks the kernel to back the 2 MiB-aligned interior of `buffer` with transparent huge
/// pages (`madvise(MADV_HUGEPAGE)`), before a channel writes a large tensor into it.
///
/// A freshly allocated large buffer (glibc maps every allocation above 32 MiB afresh)
/// is otherwise faulted in 4 KiB at a time while the copy runs: on this project's VMs
/// that costs more than the copy itself (64 MiB: 55–90 ms of faults against 25–40 ms of
/// `process_vm_readv` into a reused buffer). With the hint it is 32 faults. Only a hint:
/// where THP is disabled, or the call fails, nothing changes; buffers below
/// [`HUGE_PAGE_HINT_MIN`] are left alone.
pub fn prefer_huge_pages(buffer: &mut [u8]) {
    if buffer.len() < HUGE_PAGE_HINT_MIN {
        return;
    }
    let advised = crate::sys::memory::advise_huge_pages(buffer);
    if let Err(errno) = advised {
        tracing::debug!(%errno, "madvise(MADV_HUGEPAGE) failed; the copy faults 4 KiB pages");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address<B: StableBytes>(buffer: &B) -> usize {
        buffer.stable_bytes().as_ptr() as usize
    }

    #[test]
    fn moving_an_owned_buffer_keeps_its_bytes_in_place() {
        let buffer = vec![7u8; 64];
        let before = address(&buffer);
        let moved = Box::new(buffer);
        assert_eq!(address(&*moved), before);
        let shared: Arc<[u8]> = Arc::from(vec![1u8, 2, 3]);
        let before = address(&shared);
        let moved = shared;
        assert_eq!(address(&moved), before);
        assert_eq!(moved.stable_bytes(), &[1, 2, 3]);
    }

    #[test]
    fn huge_page_hints_keep_the_bytes() {
        let mut big: Vec<u8> = (0..HUGE_PAGE_HINT_MIN + 12_345).map(|i| i as u8).collect();
        let before = big.clone();
        prefer_huge_pages(&mut big);
        assert!(big == before);
        let mut small = vec![7u8; 100];
        prefer_huge_pages(&mut small);
        assert_eq!(small, vec![7u8; 100]);
        prefer_huge_pages(&mut []);
    }
}
