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
pub use process::{current_identity, IdentityError};
/// The wire records are the core's (`rdzv_core::channel`): descriptors, acks, identities.
pub use rdzv_core::channel::{DecodeError, ProcessIdentity, TransferAck};

/// The next transfer id of this process; ids are never reused within a process (a
/// 64-bit counter does not wrap in practice).
pub(crate) fn next_transfer_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
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
    fn transfer_ids_are_unique() {
        let a = next_transfer_id();
        let b = next_transfer_id();
        assert_ne!(a, b);
    }
}
