//! Errors of the shm transport: [`ShmError`] and [`NotViable`], which hold each other
//! (a failed test allocation, a transport that cannot work here) and so share this leaf.

use std::io;

/// What an shm connection, listener or ring operation can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// A system call failed.
    #[error("{op} failed: {source}")]
    Syscall {
        /// The call ("memfd_create", "connect to @name", ...).
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Connecting to or binding a listener address failed.
    #[error("{op} shm address {addr} failed: {source}")]
    Address {
        /// What we were doing ("bind", "connect to").
        op: &'static str,
        /// The address, `@name` for an abstract one.
        addr: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The bootstrap exchange did not follow the protocol, or the peer's segment or file
    /// descriptors are unusable.
    #[error("shm handshake failed: {detail}")]
    Handshake {
        /// What was wrong.
        detail: String,
    },
    /// The peer refused our handshake, with its reason.
    #[error("shm peer rejected the handshake: {reason}")]
    Rejected {
        /// The reason the peer gave.
        reason: String,
    },
    /// The peer runs on another host or in another network namespace: shared memory
    /// between us is not possible (or not allowed).
    #[error("shm peer is not on this host (ours {ours}, theirs {theirs})")]
    NotSameHost {
        /// Our domain descriptor.
        ours: String,
        /// The peer's domain descriptor.
        theirs: String,
    },
    /// The peer wrote something into shared memory that breaks the ring protocol. The
    /// connection is unusable afterwards.
    #[error("shm ring shared with the peer is corrupted: {detail}")]
    Corrupted {
        /// What was inconsistent.
        detail: String,
    },
    /// The peer dropped its end: no more messages will come (after those already
    /// received), or messages can no longer be delivered.
    #[error("shm peer closed the connection")]
    PeerClosed,
    /// The peer process is gone: its control socket reached end-of-file without an
    /// orderly close (for example it was killed).
    #[error("shm peer process is gone (control socket closed)")]
    PeerGone,
    /// A receive with a timeout ran out of time.
    #[error("shm receive timed out after {ms} ms")]
    Timeout {
        /// The timeout, in milliseconds.
        ms: u128,
    },
    /// The message is larger than the peer accepts (its `max_message_len`).
    #[error("shm message of {len} bytes exceeds the peer's limit of {max} bytes")]
    MessageTooLarge {
        /// The message length.
        len: usize,
        /// The peer's limit.
        max: usize,
    },
    /// `recv_into` was given a buffer smaller than the next message; the message is kept
    /// and the next receive returns it.
    #[error("shm message of {needed} bytes does not fit a {available}-byte buffer")]
    BufferTooSmall {
        /// The message length.
        needed: usize,
        /// The buffer length.
        available: usize,
    },
    /// The shm transport cannot work in this process (see [`NotViable`]).
    #[error(transparent)]
    NotViable {
        /// Why.
        source: Box<NotViable>,
    },
    /// The options are not usable.
    #[error("invalid shm options: {detail}")]
    InvalidOptions {
        /// What was wrong.
        detail: String,
    },
}

impl ShmError {
    /// Wraps a rustix error from system call `op`.
    pub(crate) fn syscall(op: &'static str) -> impl FnOnce(rustix::io::Errno) -> ShmError {
        move |errno| ShmError::Syscall {
            op,
            source: errno.into(),
        }
    }

    /// A copy of an error that makes a connection unusable, to return on every later call.
    pub(crate) fn replay(&self) -> ShmError {
        match self {
            ShmError::Corrupted { detail } => ShmError::Corrupted {
                detail: detail.clone(),
            },
            ShmError::PeerGone => ShmError::PeerGone,
            ShmError::Syscall { op, source } => ShmError::Syscall {
                op,
                source: io::Error::new(source.kind(), source.to_string()),
            },
            _ => ShmError::PeerClosed,
        }
    }
}

/// Why the shm transport cannot be used in this process.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NotViable {
    /// The boot id or the network namespace could not be read.
    #[error("shm transport not viable: {source}")]
    Host {
        /// What failed.
        #[source]
        source: crate::host::IdentityError,
    },
    /// The test allocation of a shared-memory segment failed.
    #[error("shm transport not viable: test allocation of a 1 MiB segment failed: {source}")]
    Allocation {
        /// What failed.
        #[source]
        source: ShmError,
    },
}
