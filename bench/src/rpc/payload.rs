//! The bytes every echo carries, and the check that they came back intact.
//!
//! A payload is a fixed pattern (period 251, so that no power-of-two offset repeats it)
//! whose first 8 bytes are overwritten with the iteration number: a reply that is
//! reordered, truncated, stale (from another iteration) or corrupted fails [`Payload::check`].
//! Building and checking happen outside the timed section. This module does not time or
//! move anything.

use crate::BenchError;

/// The pattern of one payload size.
#[derive(Debug, Clone)]
pub(super) struct Payload {
    base: Vec<u8>,
}

/// How many leading bytes carry the iteration number.
const STAMP: usize = 8;

impl Payload {
    /// A payload of `len` bytes.
    pub(super) fn new(len: usize) -> Payload {
        Payload {
            base: (0..len).map(|i| (i % 251) as u8 ^ 0xA5).collect(),
        }
    }

    /// [`check`](Self::check) as the bench's error: `what` came back different.
    pub(super) fn verify(&self, iter: u64, echoed: &[u8], what: &str) -> Result<(), BenchError> {
        self.check(iter, echoed).map_err(|source| BenchError::Echo {
            what: format!("{what} of iteration {iter}"),
            source: Box::new(source),
        })
    }

    /// The payload's length in bytes.
    pub(super) fn len(&self) -> usize {
        self.base.len()
    }

    /// The bytes sent in iteration `iter`.
    pub(super) fn message(&self, iter: u64) -> Vec<u8> {
        let mut bytes = self.base.clone();
        let stamp = iter.to_le_bytes();
        let n = bytes.len().min(STAMP);
        bytes[..n].copy_from_slice(&stamp[..n]);
        bytes
    }

    /// Whether `echoed` is exactly what iteration `iter` sent; the error says where it
    /// differs.
    pub(super) fn check(&self, iter: u64, echoed: &[u8]) -> Result<(), EchoMismatch> {
        if echoed.len() != self.base.len() {
            return Err(EchoMismatch::Length {
                iter,
                got: echoed.len(),
                sent: self.base.len(),
            });
        }
        let stamp = iter.to_le_bytes();
        let n = echoed.len().min(STAMP);
        let head_ok = echoed.get(..n) == stamp.get(..n);
        let tail_ok = echoed.get(n..) == self.base.get(n..);
        if head_ok && tail_ok {
            return Ok(());
        }
        let expected = self.message(iter);
        let at = expected
            .iter()
            .zip(echoed)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        Err(EchoMismatch::Bytes {
            iter,
            len: echoed.len(),
            at,
        })
    }
}

/// An echo that is not what was sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum EchoMismatch {
    /// It has another length.
    #[error("the echo of iteration {iter} returned {got} bytes instead of {sent}")]
    Length { iter: u64, got: usize, sent: usize },
    /// It differs at byte `at`.
    #[error("the echo of iteration {iter} ({len} bytes) differs from what was sent at byte {at}")]
    Bytes { iter: u64, len: usize, at: usize },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_differ_per_iteration() {
        for len in [0, 1, 7, 8, 9, 4096] {
            let payload = Payload::new(len);
            let a = payload.message(1);
            let b = payload.message(2);
            assert_eq!(a.len(), len);
            payload.check(1, &a).unwrap();
            payload.check(2, &b).unwrap();
            if len > 0 {
                assert!(payload.check(2, &a).is_err(), "stale echo of {len} bytes");
            }
        }
    }

    #[test]
    fn corruption_and_truncation_are_caught() {
        let payload = Payload::new(1000);
        let mut bytes = payload.message(5);
        bytes[700] ^= 1;
        let err = payload.check(5, &bytes).unwrap_err();
        assert_eq!(
            err,
            EchoMismatch::Bytes {
                iter: 5,
                len: 1000,
                at: 700
            }
        );
        assert!(err.to_string().contains("byte 700"), "{err}");
        let bytes = payload.message(5);
        let err = payload.check(5, &bytes[..999]).unwrap_err();
        assert!(
            err.to_string().contains("999 bytes instead of 1000"),
            "{err}"
        );
    }
}
