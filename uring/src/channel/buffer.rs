//! Which buffers can be exported to a channel: those whose bytes stay at one address
//! while the export holds them.
//!
//! An export records the buffer's address once and sends it to the receiver, so the
//! bytes must not move when the export value moves: a `Vec<u8>`, a boxed or shared
//! slice, or a borrowed slice qualifies; an inline array (`[u8; N]`) does not, since it
//! moves with its owner. This module decides nothing else: it neither allocates nor
//! pins memory.

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
}
