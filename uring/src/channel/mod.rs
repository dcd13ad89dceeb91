//! Tensor channels for the RPC agent: how a tensor's bytes move once negotiation
//! (`rdzv_core::negotiate`) picked a channel for a pair of devices.
//!
//! - [`cma`]: cross-memory attach between processes of one host. The receiver pulls
//!   the sender's bytes with `process_vm_readv`; nothing is copied through a socket.
//! - [`xth`]: both ends in one process; the receiver copies straight from the sender's
//!   buffer.
//! - [`mpt`]: a tensor striped over several TCP connections, for hosts that cannot share
//!   memory.
//!
//! `cma` and `xth` follow one shape, TensorPipe's: the sender *exports* a buffer
//! ([`cma::CmaExport`], [`xth::XthExport`]) and keeps it, unchanged, until the receiver
//! says it is done. The export yields a small serializable descriptor that the agent
//! sends over the pipe's transport; the receiver reads the bytes into its own buffer
//! and answers with a [`TransferAck`], which the agent sends back and hands to the
//! export to get the buffer back. Each channel also has a `viability()` check that
//! returns the domain descriptor to advertise in the brochure (two endpoints can use a
//! channel only if their descriptors are equal) or a reason why the channel cannot work
//! here.
//!
//! This module does not negotiate, frame, or send descriptors and acks: the agent moves
//! those over its pipe. The copies are synchronous calls; an agent on an async executor
//! runs large ones off its reactor thread or in slices ([`cma::CmaPeer::read_at`]).

pub mod buffer;
pub mod cma;
pub mod mpt;
pub mod process;
pub mod xth;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

pub use buffer::StableBytes;
pub use process::{IdentityError, ProcessIdentity};

/// The next transfer id of this process; ids are never reused within a process (a
/// 64-bit counter does not wrap in practice).
pub(crate) fn next_transfer_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The receiver's word that it finished reading an exported buffer: the export with
/// this transfer id may now give its buffer back. The agent sends it over the pipe
/// ([`TransferAck::encode`]) to the exporting side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransferAck {
    /// The transfer id of the descriptor that was read.
    pub transfer_id: u64,
}

/// What starts an encoded [`TransferAck`].
const ACK_MAGIC: [u8; 4] = *b"RDAK";

impl TransferAck {
    /// The encoded size: a 4-byte tag and the little-endian transfer id.
    pub const ENCODED_LEN: usize = 12;

    /// The wire form of this ack.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..4].copy_from_slice(&ACK_MAGIC);
        out[4..].copy_from_slice(&self.transfer_id.to_le_bytes());
        out
    }

    /// Parses an ack produced by [`TransferAck::encode`].
    pub fn decode(bytes: &[u8]) -> Result<TransferAck, DecodeError> {
        let bytes: &[u8; Self::ENCODED_LEN] =
            bytes.try_into().map_err(|_| DecodeError::WrongLength {
                what: "transfer ack",
                expected: Self::ENCODED_LEN,
                actual: bytes.len(),
            })?;
        let (magic, id) = bytes.split_at(4);
        if magic != ACK_MAGIC {
            return Err(DecodeError::BadTag {
                what: "transfer ack",
            });
        }
        let mut raw = [0u8; 8];
        raw.copy_from_slice(id);
        Ok(TransferAck {
            transfer_id: u64::from_le_bytes(raw),
        })
    }
}

/// Why bytes received from a peer are not a descriptor or an ack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The message has the wrong size.
    #[error("malformed {what}: expected {expected} bytes, got {actual}")]
    WrongLength {
        /// What was being decoded.
        what: &'static str,
        /// The size of a valid encoding.
        expected: usize,
        /// The size received.
        actual: usize,
    },
    /// The message does not start with the expected tag (another channel's message, or
    /// garbage).
    #[error("malformed {what}: unknown tag")]
    BadTag {
        /// What was being decoded.
        what: &'static str,
    },
}

/// An ack that does not belong to the export it was given to. The export comes back
/// unchanged, still holding its buffer.
pub struct UnexpectedAck<E> {
    /// The export, still waiting for its own ack.
    pub export: E,
    /// The transfer id the export expects.
    pub expected: u64,
    /// The transfer id of the ack received.
    pub received: u64,
}

impl<E> fmt::Debug for UnexpectedAck<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnexpectedAck")
            .field("expected", &self.expected)
            .field("received", &self.received)
            .finish_non_exhaustive()
    }
}

impl<E> fmt::Display for UnexpectedAck<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ack for transfer {} given to the export of transfer {}",
            self.received, self.expected
        )
    }
}

impl<E> std::error::Error for UnexpectedAck<E> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_round_trips() {
        let ack = TransferAck {
            transfer_id: 0x0102_0304_0506_0708,
        };
        assert_eq!(TransferAck::decode(&ack.encode()), Ok(ack));
    }

    #[test]
    fn ack_rejects_garbage() {
        assert_eq!(
            TransferAck::decode(&[0u8; 3]),
            Err(DecodeError::WrongLength {
                what: "transfer ack",
                expected: 12,
                actual: 3
            })
        );
        assert_eq!(
            TransferAck::decode(&[0u8; 12]),
            Err(DecodeError::BadTag {
                what: "transfer ack"
            })
        );
    }

    #[test]
    fn transfer_ids_are_unique() {
        let a = next_transfer_id();
        let b = next_transfer_id();
        assert_ne!(a, b);
    }
}
