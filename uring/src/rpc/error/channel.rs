//! [`ChannelFailure`]: why a tensor could not move over its channel, the reason of a
//! [`CallError::Channel`](super::CallError::Channel). The agent's own checks (a channel
//! that was not negotiated, a length that does not match) are variants with the values
//! involved; a failure of a channel or of the memory it needed (a [`CmaError`], an
//! [`XthError`](crate::channel::xth::XthError), a malformed descriptor) is carried as
//! the source, so [`error_chain`](super::error_chain) prints it once.

use std::error::Error;

use rdzv_core::channel::DecodeError;
use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::ChannelKind;
use rdzv_core::rpc::pipe::ReadError;

use crate::channel::cma::CmaError;

/// The cause of a failed read or export: a channel's own error.
pub type ChannelCause = Box<dyn Error + Send + Sync + 'static>;

/// Why a tensor could not move over its channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelFailure {
    /// The channel could not export the tensor for the peer to read.
    #[error("cannot export the tensor: {source}")]
    Export {
        /// The channel's error.
        #[source]
        source: ChannelCause,
    },
    /// The channel negotiated for the tensor is not one this build's agent exports.
    #[error("cannot export the tensor: the RPC agent of this build does not run this channel")]
    ExportNotRun,
    /// The export's descriptor does not fit in a frame (255 bytes at most).
    #[error("cannot export the tensor: its descriptor is over 255 bytes")]
    ExportDescriptorTooLong,
    /// A device runtime's loan descriptor does not fit in a frame (255 bytes at most).
    #[error("cannot lend it: its descriptor is over 255 bytes")]
    LoanDescriptorTooLong,
    /// A cma descriptor names another process than the one the pipe reads from.
    #[error("a descriptor names pid {named}, but this pipe reads from pid {reading}")]
    OtherProcess {
        /// The pid the descriptor names.
        named: u32,
        /// The pid the pipe reads from.
        reading: u32,
    },
    /// The peer process could not be opened for cma reads.
    #[error("{0}")]
    OpenPeer(#[source] CmaError),
    /// The tensor is for a device this worker has no runtime for.
    #[error("this worker has no {kind} runtime to receive on {device}")]
    NoRuntime {
        /// The device type.
        kind: DeviceType,
        /// The target device.
        device: Device,
    },
    /// The peer used a channel this pipe did not negotiate for the tensor's devices.
    #[error("the peer used it, but this pipe negotiated {} for {from} to {to}", agreed.map_or("no channel", ChannelKind::name))]
    NotNegotiated {
        /// The channel the pipe negotiated for the pair, if any.
        agreed: Option<ChannelKind>,
        /// The sender's device type.
        from: DeviceType,
        /// The receiver's device type.
        to: DeviceType,
    },
    /// The tensor's channel descriptor does not decode.
    #[error("{0}")]
    BadDescriptor(#[source] DecodeError),
    /// The descriptor announces another length than the frame.
    #[error("its descriptor announces {announced} bytes, the frame {frame}")]
    LengthMismatch {
        /// The descriptor's length.
        announced: u64,
        /// The frame's length.
        frame: u64,
    },
    /// The peer streamed the tensor over mpt, but this pipe has no mpt connections.
    #[error("the peer streamed it, but this pipe has no mpt connections")]
    NoConnections,
    /// What the mpt stripes became is not what the frame says.
    #[error("its stripes became {len} bytes on {device}, the frame says {expected_len} on {expected_device}")]
    StripesMismatch {
        /// The bytes received.
        len: usize,
        /// Where they were put.
        device: Device,
        /// The frame's length.
        expected_len: u64,
        /// The frame's device.
        expected_device: Device,
    },
    /// The channel is not one this worker runs.
    #[error("this worker does not run this channel")]
    NotRun,
    /// The tensor's length does not fit in this process's memory.
    #[error("the tensor does not fit in memory")]
    TooLarge,
    /// No buffer could be had for the tensor: the allocator refused `len` bytes.
    #[error("cannot allocate a {len}-byte buffer for it (out of memory)")]
    Allocate {
        /// The size asked for.
        len: usize,
    },
    /// Reading the tensor from the peer failed (a [`CmaError`], an xth error, a thread
    /// that could not start).
    #[error("{source}")]
    Read {
        /// The channel's error.
        #[source]
        source: ChannelCause,
    },
    /// What was read cannot be used (the pipe ended while it was read).
    #[error("{0}")]
    Unread(ReadError),
}

impl ChannelFailure {
    /// A failed read, caused by `source`.
    pub fn read(source: impl Into<ChannelCause>) -> ChannelFailure {
        ChannelFailure::Read {
            source: source.into(),
        }
    }
}
