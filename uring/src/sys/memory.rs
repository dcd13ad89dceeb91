//! Memory the allocator or the kernel hands out: a fallible zeroed buffer (std has no
//! safe fallible `vec![0; len]`) and the transparent-huge-page hint for a buffer.

/// A fresh zeroed buffer of `len` bytes, or `None` if the allocator refuses. Like
/// `vec![0; len]` (calloc: the kernel's zero pages, nothing written) but fallible.
pub(crate) fn try_zeroed(len: usize) -> Option<Vec<u8>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).ok()?;
    // SAFETY: `layout` has a non-zero size (`len > 0`), as `alloc_zeroed` requires.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `len` u8s
    // (align 1, size `len`), all `len` bytes are initialised (zeroed), and the Vec takes
    // sole ownership with capacity and length `len`: what `from_raw_parts` requires.
    Some(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// The transparent huge page size on x86-64 and arm64 (4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back the 2 MiB-aligned interior of `buffer` with transparent huge
/// pages (`madvise(MADV_HUGEPAGE)`). `Ok` without a call when the buffer holds no whole
/// aligned huge page. Only a hint: no byte of `buffer` changes.
pub(crate) fn advise_huge_pages(buffer: &mut [u8]) -> rustix::io::Result<()> {
    let Some((first, len)) = huge_page_interior(buffer.as_mut_ptr() as usize, buffer.len()) else {
        return Ok(());
    };
    // `first - start` is inside the buffer (see `huge_page_interior`), so this pointer
    // keeps the buffer's provenance.
    let at = buffer
        .as_mut_ptr()
        .wrapping_add(first - buffer.as_ptr() as usize);
    // SAFETY: `at..at + len` lies inside `buffer`, which this function borrows
    // exclusively, and is page-aligned. MADV_HUGEPAGE only changes how the kernel backs
    // the range later (it neither frees nor changes any byte, nor the mapping's
    // permissions), so no reference into the buffer is invalidated.
    unsafe { rustix::mm::madvise(at.cast(), len, rustix::mm::Advice::LinuxHugepage) }
}

/// The first 2 MiB-aligned address in `start..start + len` and the length of the whole
/// huge pages from there, if there is at least one.
fn huge_page_interior(start: usize, len: usize) -> Option<(usize, usize)> {
    let end = start.checked_add(len)?;
    let first = start.checked_add(HUGE_PAGE - 1)? & !(HUGE_PAGE - 1);
    let last = end & !(HUGE_PAGE - 1);
    (last > first).then(|| (first, last - first))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_buffers_are_zero_and_absurd_sizes_fail() {
        assert_eq!(try_zeroed(0), Some(Vec::new()));
        let buffer = try_zeroed(1 << 20).expect("1 MiB");
        assert_eq!(buffer.len(), 1 << 20);
        assert!(buffer.iter().all(|&b| b == 0));
        assert_eq!(try_zeroed(usize::MAX), None);
        assert_eq!(try_zeroed(isize::MAX as usize), None);
    }

    #[test]
    fn the_interior_is_aligned_and_inside() {
        assert_eq!(huge_page_interior(0, HUGE_PAGE - 1), None);
        assert_eq!(
            huge_page_interior(1, 2 * HUGE_PAGE),
            Some((HUGE_PAGE, HUGE_PAGE))
        );
        assert_eq!(
            huge_page_interior(HUGE_PAGE, HUGE_PAGE),
            Some((HUGE_PAGE, HUGE_PAGE))
        );
        assert_eq!(huge_page_interior(HUGE_PAGE + 1, HUGE_PAGE), None);
        assert_eq!(huge_page_interior(usize::MAX - 5, 10), None);
    }

    #[test]
    fn advising_keeps_the_bytes() {
        let mut big: Vec<u8> = (0..3 * HUGE_PAGE + 12_345).map(|i| i as u8).collect();
        let before = big.clone();
        // THP may be disabled here: the hint may fail, the bytes never change.
        let _ = advise_huge_pages(&mut big);
        assert!(big == before);
        assert!(advise_huge_pages(&mut [1, 2, 3]).is_ok());
    }
}
