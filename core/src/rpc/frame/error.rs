//! What can be wrong with a frame: the fields the limits name ([`FrameField`]), a received
//! frame that breaks the format or a limit ([`FrameError`]), and a frame that cannot be
//! encoded ([`EncodeError`]).

use core::fmt;

use crate::device::DeviceType;
use crate::negotiate::ChannelKind;

use super::{FrameKind, VERSION};

/// A part of a frame, for errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FrameField {
    /// The message id.
    MessageId,
    /// The handler name.
    HandlerName,
    /// The metadata.
    Metadata,
    /// The payload.
    Payload,
    /// The tensors (their count).
    Tensors,
    /// One tensor's byte length.
    TensorBytes,
    /// The total size of the data section (inline tensor bytes and channel
    /// descriptors).
    InlineBytes,
    /// One tensor's channel descriptor length.
    ChannelDescriptor,
}

impl FrameField {
    /// How the field is named in messages.
    pub const fn name(self) -> &'static str {
        match self {
            FrameField::MessageId => "message id",
            FrameField::HandlerName => "handler name",
            FrameField::Metadata => "metadata",
            FrameField::Payload => "payload",
            FrameField::Tensors => "tensor count",
            FrameField::TensorBytes => "tensor size",
            FrameField::InlineBytes => "tensor data section",
            FrameField::ChannelDescriptor => "channel descriptor length",
        }
    }
}

impl fmt::Display for FrameField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why bytes are not a valid frame. Every variant means the peer is broken, hostile or
/// speaks another version; the pipe cannot be resynchronised and should be closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not [`MAGIC`]: this is not an rdzv RPC pipe.
    BadMagic,
    /// The version byte is not [`VERSION`].
    UnsupportedVersion {
        /// The version received.
        version: u8,
    },
    /// The kind byte names no [`FrameKind`].
    UnknownKind {
        /// The byte received.
        byte: u8,
    },
    /// A flags or reserved field is not zero.
    NonZeroReserved {
        /// Offset of the field in the header, or in the descriptor for descriptor bytes.
        offset: usize,
        /// The tensor whose descriptor it is, for descriptor bytes.
        tensor: Option<u32>,
    },
    /// A length or count is above its limit.
    OverLimit {
        /// The field.
        field: FrameField,
        /// What the peer claimed.
        claimed: u64,
        /// The limit.
        limit: u64,
    },
    /// This kind of frame may not carry this field (it must be empty or zero).
    NotAllowed {
        /// The frame kind.
        kind: FrameKind,
        /// The field.
        field: FrameField,
    },
    /// A descriptor names a device that does not exist (unknown type, a CPU index other
    /// than 0, an index byte without the has-index flag).
    InvalidDevice {
        /// The tensor.
        tensor: u32,
    },
    /// A descriptor names an unknown channel.
    UnknownChannel {
        /// The tensor.
        tensor: u32,
        /// The channel byte.
        byte: u8,
    },
    /// A descriptor's channel cannot move data between its two device types (see
    /// [`ChannelKind::carries`]).
    ChannelMismatch {
        /// The tensor.
        tensor: u32,
        /// The channel.
        channel: ChannelKind,
        /// The source device type.
        source: DeviceType,
        /// The target device type.
        target: DeviceType,
    },
    /// The handler name is not UTF-8.
    HandlerNotUtf8,
    /// The whole frame is larger than this machine can address.
    TooLarge {
        /// The frame's size in bytes, saturated at `u64::MAX`.
        total: u64,
    },
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Invalid RPC frame: ")?;
        match *self {
            FrameError::BadMagic => f.write_str("bad magic (the peer is not an rdzv RPC agent)"),
            FrameError::UnsupportedVersion { version } => write!(
                f,
                "unsupported wire format version {version} (this side speaks {VERSION})"
            ),
            FrameError::UnknownKind { byte } => write!(f, "unknown frame kind {byte}"),
            FrameError::NonZeroReserved { offset, tensor } => match tensor {
                Some(t) => write!(
                    f,
                    "reserved byte {offset} of tensor {t}'s descriptor is not zero"
                ),
                None => write!(f, "reserved header bytes at offset {offset} are not zero"),
            },
            FrameError::OverLimit {
                field,
                claimed,
                limit,
            } => write!(f, "{field} of {claimed} is over the limit of {limit}"),
            FrameError::NotAllowed { kind, field } => {
                write!(f, "a {kind} frame cannot carry a {field}")
            }
            FrameError::InvalidDevice { tensor } => {
                write!(f, "tensor {tensor} names an invalid device")
            }
            FrameError::UnknownChannel { tensor, byte } => {
                write!(f, "tensor {tensor} names unknown channel {byte}")
            }
            FrameError::ChannelMismatch {
                tensor,
                channel,
                source,
                target,
            } => write!(
                f,
                "tensor {tensor} uses channel {channel}, which cannot move data from {source} \
                 to {target}"
            ),
            FrameError::HandlerNotUtf8 => f.write_str("the handler name is not UTF-8"),
            FrameError::TooLarge { total } => {
                write!(f, "a frame of {total} bytes does not fit in memory")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for FrameError {}

/// Why a frame could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EncodeError {
    /// The buffer is too small; `needed` bytes are required.
    InsufficientSize {
        /// Bytes needed.
        needed: usize,
        /// Bytes available.
        available: usize,
    },
    /// The frame breaks a rule the decoder enforces (a field its kind may not carry, a
    /// channel that cannot serve a tensor's devices, a length that does not fit its field).
    Invalid(FrameError),
    /// `tensor_data` does not hold one slice per tensor.
    DataCount {
        /// Tensors.
        expected: usize,
        /// Slices given.
        given: usize,
    },
    /// A tensor's data slice does not have the length its descriptor announces (the
    /// tensor's length for `basic`, the channel descriptor length otherwise).
    DataLength {
        /// The tensor.
        tensor: u32,
        /// The length the descriptor announces.
        expected: u64,
        /// The slice's length.
        given: usize,
    },
    /// postcard could not serialize a handshake.
    Handshake(postcard::Error),
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EncodeError::InsufficientSize { needed, available } => write!(
                f,
                "buffer too small for an RPC frame: {needed} bytes needed, {available} available"
            ),
            EncodeError::Invalid(e) => write!(f, "cannot encode RPC frame: {e}"),
            EncodeError::DataCount { expected, given } => write!(
                f,
                "cannot encode RPC frame: {expected} tensors but {given} data slices"
            ),
            EncodeError::DataLength {
                tensor,
                expected,
                given,
            } => write!(
                f,
                "cannot encode RPC frame: tensor {tensor} announces {expected} bytes of data \
                 but its slice is {given} bytes"
            ),
            EncodeError::Handshake(e) => write!(f, "cannot encode RPC handshake: {e}"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for EncodeError {}

impl From<FrameError> for EncodeError {
    fn from(e: FrameError) -> Self {
        EncodeError::Invalid(e)
    }
}
