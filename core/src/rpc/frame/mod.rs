//! The RPC agent's wire format on one pipe: how a request, a response, an error, the
//! handshake and a goodbye become bytes and back.
//!
//! # Layout
//!
//! Every frame is a fixed 40-byte little-endian header, then its body:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `RZRP` ([`MAGIC`]) |
//! | 4 | 1 | version ([`VERSION`], 1) |
//! | 5 | 1 | kind ([`FrameKind`]) |
//! | 6 | 2 | flags, 0 in version 1 |
//! | 8 | 8 | message id |
//! | 16 | 4 | handler name length |
//! | 20 | 4 | metadata length |
//! | 24 | 8 | payload length |
//! | 32 | 4 | tensor count |
//! | 36 | 4 | reserved, 0 |
//!
//! The body is, in order: one 16-byte [`TensorDescriptor`] per tensor, the handler name
//! (UTF-8), the metadata, the payload, and the *data section*: one entry per tensor, in
//! descriptor order ([`TensorData`]). A tensor whose channel is [`ChannelKind::Basic`]
//! puts its bytes there (*inline data*); a tensor on any other channel puts its
//! *channel descriptor* there: the few bytes that channel's receiver needs to fetch the
//! data (cma: the exporting process, address and transfer id), opaque to this module.
//!
//! A tensor descriptor is:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 3 | source device: type, has-index (0/1), index |
//! | 3 | 3 | target device: type, has-index (0/1), index |
//! | 6 | 1 | channel ([`ChannelKind::index`]) |
//! | 7 | 1 | channel descriptor length: 0 for `basic`, at most [`FrameLimits::max_channel_descriptor`] |
//! | 8 | 8 | the tensor's byte length |
//!
//! so the data section's entry for a tensor is `len` bytes for `basic` and byte 7's
//! count otherwise. (Byte 7 was a reserved zero before channels ran; `basic`-only frames
//! are unchanged.)
//!
//! An [`FrameKind::Ack`] frame says "I finished reading the out-of-band tensors of your
//! frame with this message id": the sender may release (reuse, free) the buffers it
//! exported for them. Only responses are acknowledged this way, by the caller on its
//! client pipe: a request's buffers are released when its response or error arrives
//! (the callee reads a request's tensors before it runs the handler, so its answer
//! implies it finished reading), or when the pipe fails. A response with no out-of-band
//! tensors is not acknowledged.
//!
//! # Why this shape
//!
//! * The header is fixed-size and 8-byte aligned, and so are the descriptors that follow
//!   it: a receiver reads exactly [`HEADER_LEN`] bytes, then knows the size of everything
//!   else before any of it arrives, and can check it against [`FrameLimits`] before it
//!   allocates or waits for anything. A later RDMA transport can post a receive for the
//!   header and descriptors and then read the rest straight into its destination.
//! * Descriptors come *before* the name, metadata and payload (not after, as in
//!   TensorPipe's descriptor), so a receiver can allocate tensor storage on the right
//!   devices and start out-of-band channel transfers while the payload is still arriving.
//! * Tensor data of any channel but `basic` never enters the frame: it travels on the
//!   chosen channel (cma, mpt, CUDA IPC, ...); the frame carries only the channel's
//!   descriptor for it, whose length is in the tensor descriptor, so every size is still
//!   known once the descriptors arrived. `basic` means "the pipe's own connection"
//!   (TensorPipe's basic channel writes to the transport connection), so its bytes
//!   follow the payload inside the frame. Inline bytes and channel descriptors both count
//!   towards [`FrameLimits::max_inline_bytes`].
//! * Senders never copy: [`OutgoingFrame::encode_head`] writes only the header and the
//!   descriptors, and the name, metadata, payload and data section go out as further
//!   slices of one vectored write.
//!
//! The message id of a response or error is the id of the request it answers, and an
//! ack's is the id of the response it acknowledges. Handshake and goodbye frames carry id
//! 0, no handler name, no metadata and no tensors; a goodbye carries nothing at all, an
//! ack nothing but its id; responses and errors carry no handler name, and errors carry
//! no tensors (their payload is the UTF-8 error text). The handshake's payload is a
//! [`Handshake`] encoded with postcard.
//!
//! # Decoding
//!
//! [`decode_frame`] is a push decoder in the style of the TCPStore codec
//! (`store::codec`): give it all the unconsumed bytes, it answers
//! [`Decoded::Partial`] with a lower bound on the bytes still missing, or
//! [`Decoded::Complete`] with a [`Frame`] borrowed from the buffer and the number of bytes
//! it used. Errors are decided from complete fields only, as early as the field arrives,
//! and never change as more bytes arrive. [`FrameDecoder`] remembers the header and the
//! descriptors it already checked, so a frame that arrives in many pieces costs O(new
//! bytes) to decode. Nothing is allocated while decoding.
//!
//! Runtimes hold frames as [`OwnedFrame`] (to send, generic over their buffers) and
//! [`IncomingFrame`] (received), which go through the same encoder and decoder.
//!
//! This module does not read or write sockets, pick channels (see
//! [`crate::negotiate`]) or move out-of-band tensor data.

mod handshake;
mod owned;
#[cfg(test)]
mod tests;

pub use handshake::{decode_handshake, Handshake, HandshakeError};
pub use owned::{IncomingFrame, OwnedFrame};

use alloc::vec::Vec;
use core::fmt;

use crate::device::{Device, DeviceType};
use crate::negotiate::ChannelKind;
pub use crate::store::codec::Decoded;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"RZRP";
/// The wire format version this module speaks.
pub const VERSION: u8 = 1;
/// The size of the fixed header.
pub const HEADER_LEN: usize = 40;
/// The size of one tensor descriptor.
pub const DESCRIPTOR_LEN: usize = 16;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FrameKind {
    /// The pipe's first frame each way: a [`Handshake`] in the payload.
    Handshake,
    /// A call: handler name, metadata, payload and tensors.
    Request,
    /// The result of the request with the same message id.
    Response,
    /// The request with the same message id failed; the payload is the error text.
    Error,
    /// The sender is closing the pipe on purpose (graceful shutdown); the end of the
    /// stream that follows is expected.
    Goodbye,
    /// The sender finished reading the out-of-band tensors of the response with the same
    /// message id; their exported buffers may be released. Carries nothing else.
    Ack,
}

impl FrameKind {
    /// Every kind, in wire-byte order.
    pub const ALL: [FrameKind; 6] = [
        FrameKind::Handshake,
        FrameKind::Request,
        FrameKind::Response,
        FrameKind::Error,
        FrameKind::Goodbye,
        FrameKind::Ack,
    ];

    /// The byte on the wire.
    pub const fn to_byte(self) -> u8 {
        match self {
            FrameKind::Handshake => 1,
            FrameKind::Request => 2,
            FrameKind::Response => 3,
            FrameKind::Error => 4,
            FrameKind::Goodbye => 5,
            FrameKind::Ack => 6,
        }
    }

    /// The kind with this wire byte.
    pub fn from_byte(byte: u8) -> Option<FrameKind> {
        Self::ALL.into_iter().find(|k| k.to_byte() == byte)
    }

    /// A lowercase name for messages.
    pub const fn name(self) -> &'static str {
        match self {
            FrameKind::Handshake => "handshake",
            FrameKind::Request => "request",
            FrameKind::Response => "response",
            FrameKind::Error => "error",
            FrameKind::Goodbye => "goodbye",
            FrameKind::Ack => "ack",
        }
    }

    fn allows(self, field: FrameField) -> bool {
        match self {
            FrameKind::Request => true,
            FrameKind::Response => field != FrameField::HandlerName,
            FrameKind::Error => !matches!(field, FrameField::HandlerName | FrameField::Tensors),
            FrameKind::Handshake => field == FrameField::Payload,
            FrameKind::Goodbye => false,
            FrameKind::Ack => field == FrameField::MessageId,
        }
    }
}

impl fmt::Display for FrameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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

/// The largest frame a decoder accepts. A claimed size above a limit is an error as soon
/// as its field is complete; a size equal to the limit is accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct FrameLimits {
    /// Longest handler name, in bytes.
    pub max_handler_name: u32,
    /// Longest metadata, in bytes.
    pub max_metadata: u32,
    /// Longest payload, in bytes.
    pub max_payload: u64,
    /// Most tensors in one frame.
    pub max_tensors: u32,
    /// Largest single tensor, in bytes (inline or not: the receiver allocates it).
    pub max_tensor_bytes: u64,
    /// Most bytes in one frame's data section: inline tensor bytes plus channel
    /// descriptors.
    pub max_inline_bytes: u64,
    /// Longest channel descriptor of one tensor, in bytes (the wire field holds at most
    /// 255).
    pub max_channel_descriptor: u32,
}

impl FrameLimits {
    /// rdzv's defaults: 1 KiB handler names, 1 MiB metadata, 1 GiB payloads, 64 Ki
    /// tensors of at most 64 GiB each, 1 GiB of inline tensor data, channel descriptors
    /// up to the wire's 255 bytes.
    pub const DEFAULT: FrameLimits = FrameLimits {
        max_handler_name: 1024,
        max_metadata: 1024 * 1024,
        max_payload: 1 << 30,
        max_tensors: 64 * 1024,
        max_tensor_bytes: 64 << 30,
        max_inline_bytes: 1 << 30,
        max_channel_descriptor: u8::MAX as u32,
    };

    /// For a pipe's first frame: a handshake payload of at most 64 KiB and nothing else.
    pub const HANDSHAKE: FrameLimits = FrameLimits {
        max_handler_name: 0,
        max_metadata: 0,
        max_payload: 64 * 1024,
        max_tensors: 0,
        max_tensor_bytes: 0,
        max_inline_bytes: 0,
        max_channel_descriptor: 0,
    };

    /// No limits. Only for trusted peers.
    pub const UNLIMITED: FrameLimits = FrameLimits {
        max_handler_name: u32::MAX,
        max_metadata: u32::MAX,
        max_payload: u64::MAX,
        max_tensors: u32::MAX,
        max_tensor_bytes: u64::MAX,
        max_inline_bytes: u64::MAX,
        max_channel_descriptor: u32::MAX,
    };

    /// These limits with a different payload limit.
    pub const fn with_max_payload(mut self, bytes: u64) -> FrameLimits {
        self.max_payload = bytes;
        self
    }

    /// These limits with a different tensor count limit.
    pub const fn with_max_tensors(mut self, tensors: u32) -> FrameLimits {
        self.max_tensors = tensors;
        self
    }

    /// These limits with a different inline byte limit.
    pub const fn with_max_inline_bytes(mut self, bytes: u64) -> FrameLimits {
        self.max_inline_bytes = bytes;
        self
    }

    /// These limits with a different per-tensor byte limit.
    pub const fn with_max_tensor_bytes(mut self, bytes: u64) -> FrameLimits {
        self.max_tensor_bytes = bytes;
        self
    }

    /// These limits with a different channel descriptor length limit.
    pub const fn with_max_channel_descriptor(mut self, bytes: u32) -> FrameLimits {
        self.max_channel_descriptor = bytes;
        self
    }
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits::DEFAULT
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

/// One tensor as a frame announces it: where it comes from, where the receiver must put
/// it, the channel that carries it, its size in bytes, and the size of the channel
/// descriptor that stands for its data in the frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorDescriptor {
    /// The device the data is on at the sender.
    pub source: Device,
    /// The device the receiver allocates it on (PyTorch always sets a target device).
    pub target: Device,
    /// The channel that moves the data; `basic` means inline in the frame.
    pub channel: ChannelKind,
    /// The size in bytes.
    pub len: u64,
    /// The length of the channel descriptor in the frame's data section: 0 for `basic`
    /// (whose data is there instead); for other channels what their receiver needs (0
    /// for a channel that needs nothing).
    pub channel_descriptor_len: u8,
}

impl TensorDescriptor {
    /// A `basic` tensor (data inline in the frame) of `len` bytes.
    pub const fn inline(source: Device, target: Device, len: u64) -> Self {
        TensorDescriptor {
            source,
            target,
            channel: ChannelKind::Basic,
            len,
            channel_descriptor_len: 0,
        }
    }

    /// Whether its data travels inside the frame (the `basic` channel).
    pub fn is_inline(&self) -> bool {
        self.channel == ChannelKind::Basic
    }

    /// The size of its entry in the frame's data section: `len` for `basic`, the channel
    /// descriptor's length otherwise.
    pub fn data_len(&self) -> u64 {
        if self.is_inline() {
            self.len
        } else {
            u64::from(self.channel_descriptor_len)
        }
    }

    fn check(&self, tensor: u32) -> Result<(), FrameError> {
        if self.is_inline() && self.channel_descriptor_len != 0 {
            return Err(FrameError::NonZeroReserved {
                offset: 7,
                tensor: Some(tensor),
            });
        }
        if self.channel.carries(self.source.kind(), self.target.kind()) {
            Ok(())
        } else {
            Err(FrameError::ChannelMismatch {
                tensor,
                channel: self.channel,
                source: self.source.kind(),
                target: self.target.kind(),
            })
        }
    }

    /// The 16 wire bytes.
    pub fn to_bytes(&self) -> [u8; DESCRIPTOR_LEN] {
        let mut out = [0u8; DESCRIPTOR_LEN];
        let [s_type, s_has, s_index, t_type, t_has, t_index, channel, descriptor_len, len @ ..] =
            &mut out;
        *s_type = device_type_byte(self.source.kind());
        *s_has = u8::from(self.source.index().is_some());
        *s_index = self.source.index().unwrap_or(0);
        *t_type = device_type_byte(self.target.kind());
        *t_has = u8::from(self.target.index().is_some());
        *t_index = self.target.index().unwrap_or(0);
        *channel = channel_byte(self.channel);
        *descriptor_len = self.channel_descriptor_len;
        *len = self.len.to_le_bytes();
        out
    }

    /// Parses and checks 16 wire bytes; `tensor` is the descriptor's position, for errors.
    ///
    /// # Errors
    /// [`FrameError`] for an invalid device, unknown channel, a `basic` tensor with a
    /// channel descriptor length, or a channel that cannot serve the two device types.
    pub fn from_bytes(bytes: &[u8; DESCRIPTOR_LEN], tensor: u32) -> Result<Self, FrameError> {
        let [s_type, s_has, s_index, t_type, t_has, t_index, channel, descriptor_len, len @ ..] =
            *bytes;
        let source = device_from_bytes(s_type, s_has, s_index)
            .ok_or(FrameError::InvalidDevice { tensor })?;
        let target = device_from_bytes(t_type, t_has, t_index)
            .ok_or(FrameError::InvalidDevice { tensor })?;
        let channel = ChannelKind::ALL.get(usize::from(channel)).copied().ok_or(
            FrameError::UnknownChannel {
                tensor,
                byte: channel,
            },
        )?;
        let descriptor = TensorDescriptor {
            source,
            target,
            channel,
            len: u64::from_le_bytes(len),
            channel_descriptor_len: descriptor_len,
        };
        descriptor.check(tensor)?;
        Ok(descriptor)
    }
}

/// A tensor's entry in a decoded frame's data section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorData<'a> {
    /// The tensor's bytes (`basic` channel).
    Inline(&'a [u8]),
    /// The descriptor its channel's receiver uses to fetch the bytes.
    Channel(&'a [u8]),
}

impl<'a> TensorData<'a> {
    /// The entry's bytes, whichever kind it is.
    pub fn bytes(&self) -> &'a [u8] {
        match *self {
            TensorData::Inline(bytes) | TensorData::Channel(bytes) => bytes,
        }
    }

    /// The inline data, if the tensor is `basic`.
    pub fn inline(&self) -> Option<&'a [u8]> {
        match *self {
            TensorData::Inline(bytes) => Some(bytes),
            TensorData::Channel(_) => None,
        }
    }
}

fn device_type_byte(kind: DeviceType) -> u8 {
    // Two device types: the index always fits.
    u8::try_from(kind.index()).unwrap_or(u8::MAX)
}

fn channel_byte(kind: ChannelKind) -> u8 {
    u8::try_from(kind.index()).unwrap_or(u8::MAX)
}

fn device_from_bytes(kind: u8, has_index: u8, index: u8) -> Option<Device> {
    let kind = DeviceType::ALL.get(usize::from(kind)).copied()?;
    let index = match has_index {
        0 if index == 0 => None,
        1 => Some(index),
        _ => return None,
    };
    Device::new(kind, index).ok()
}

/// The fixed header, parsed and checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Header {
    /// The frame kind.
    pub kind: FrameKind,
    /// The message id.
    pub message_id: u64,
    /// The handler name's length.
    pub handler_len: u32,
    /// The metadata's length.
    pub metadata_len: u32,
    /// The payload's length.
    pub payload_len: u64,
    /// The number of tensors.
    pub tensor_count: u32,
}

fn le_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let field: [u8; 4] = bytes.get(at..at + 4)?.try_into().ok()?;
    Some(u32::from_le_bytes(field))
}

fn le_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let field: [u8; 8] = bytes.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(field))
}

fn le_u16(bytes: &[u8], at: usize) -> Option<u16> {
    let field: [u8; 2] = bytes.get(at..at + 2)?.try_into().ok()?;
    Some(u16::from_le_bytes(field))
}

impl Header {
    /// Checks the header fields present in `bytes` (a prefix of a frame), in wire order,
    /// against the format and `limits`. Returns the header once all 40 bytes are there.
    fn check_prefix(bytes: &[u8], limits: &FrameLimits) -> Result<Option<Header>, FrameError> {
        if let Some(magic) = bytes.get(..4) {
            if magic != MAGIC {
                return Err(FrameError::BadMagic);
            }
        } else if !MAGIC.starts_with(bytes) {
            // Garbage is rejected from its first wrong byte.
            return Err(FrameError::BadMagic);
        }
        if let Some(&version) = bytes.get(4) {
            if version != VERSION {
                return Err(FrameError::UnsupportedVersion { version });
            }
        }
        let kind = match bytes.get(5) {
            Some(&byte) => {
                Some(FrameKind::from_byte(byte).ok_or(FrameError::UnknownKind { byte })?)
            }
            None => None,
        };
        if let Some(flags) = le_u16(bytes, 6) {
            if flags != 0 {
                return Err(FrameError::NonZeroReserved {
                    offset: 6,
                    tensor: None,
                });
            }
        }
        let not_allowed = |field| FrameError::NotAllowed {
            kind: kind.unwrap_or(FrameKind::Request),
            field,
        };
        let allows = |field| kind.is_none_or(|k| k.allows(field));
        let message_id = le_u64(bytes, 8);
        if let Some(id) = message_id {
            if id != 0 && !allows(FrameField::MessageId) {
                return Err(not_allowed(FrameField::MessageId));
            }
        }
        let handler_len = le_u32(bytes, 16);
        if let Some(len) = handler_len {
            check_len(
                FrameField::HandlerName,
                len.into(),
                limits.max_handler_name.into(),
            )?;
            if len != 0 && !allows(FrameField::HandlerName) {
                return Err(not_allowed(FrameField::HandlerName));
            }
        }
        let metadata_len = le_u32(bytes, 20);
        if let Some(len) = metadata_len {
            check_len(FrameField::Metadata, len.into(), limits.max_metadata.into())?;
            if len != 0 && !allows(FrameField::Metadata) {
                return Err(not_allowed(FrameField::Metadata));
            }
        }
        let payload_len = le_u64(bytes, 24);
        if let Some(len) = payload_len {
            check_len(FrameField::Payload, len, limits.max_payload)?;
            if len != 0 && !allows(FrameField::Payload) {
                return Err(not_allowed(FrameField::Payload));
            }
        }
        let tensor_count = le_u32(bytes, 32);
        if let Some(count) = tensor_count {
            check_len(FrameField::Tensors, count.into(), limits.max_tensors.into())?;
            if count != 0 && !allows(FrameField::Tensors) {
                return Err(not_allowed(FrameField::Tensors));
            }
        }
        if let Some(reserved) = le_u32(bytes, 36) {
            if reserved != 0 {
                return Err(FrameError::NonZeroReserved {
                    offset: 36,
                    tensor: None,
                });
            }
        }
        Ok(
            match (
                kind,
                message_id,
                handler_len,
                metadata_len,
                payload_len,
                tensor_count,
            ) {
                (Some(kind), Some(message_id), Some(h), Some(m), Some(p), Some(t))
                    if bytes.len() >= HEADER_LEN =>
                {
                    Some(Header {
                        kind,
                        message_id,
                        handler_len: h,
                        metadata_len: m,
                        payload_len: p,
                        tensor_count: t,
                    })
                }
                _ => None,
            },
        )
    }

    /// Parses and checks a complete header.
    ///
    /// # Errors
    /// [`FrameError`] for a bad field or a length over `limits`.
    pub fn parse(bytes: &[u8; HEADER_LEN], limits: &FrameLimits) -> Result<Header, FrameError> {
        Header::check_prefix(bytes, limits)?.ok_or(FrameError::BadMagic)
    }

    /// The 40 wire bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let parts: [(usize, &[u8]); 8] = [
            (0, &MAGIC),
            (4, &[VERSION, self.kind.to_byte()]),
            (8, &self.message_id.to_le_bytes()),
            (16, &self.handler_len.to_le_bytes()),
            (20, &self.metadata_len.to_le_bytes()),
            (24, &self.payload_len.to_le_bytes()),
            (32, &self.tensor_count.to_le_bytes()),
            (36, &[0; 4]),
        ];
        for (at, bytes) in parts {
            if let Some(dst) = out.get_mut(at..at + bytes.len()) {
                dst.copy_from_slice(bytes);
            }
        }
        out
    }

    /// Bytes from the start of the frame to the end of the payload: header, descriptors,
    /// handler name, metadata and payload (everything but inline tensor data).
    pub fn fixed_len(&self) -> u64 {
        // At most 40 + 16 * (2^32 - 1) + 2 * (2^32 - 1) + payload: saturate on payload.
        (HEADER_LEN as u64)
            .saturating_add(u64::from(self.tensor_count) * DESCRIPTOR_LEN as u64)
            .saturating_add(u64::from(self.handler_len))
            .saturating_add(u64::from(self.metadata_len))
            .saturating_add(self.payload_len)
    }

    fn descriptors_end(&self) -> u64 {
        HEADER_LEN as u64 + u64::from(self.tensor_count) * DESCRIPTOR_LEN as u64
    }
}

fn check_len(field: FrameField, claimed: u64, limit: u64) -> Result<(), FrameError> {
    if claimed > limit {
        Err(FrameError::OverLimit {
            field,
            claimed,
            limit,
        })
    } else {
        Ok(())
    }
}

/// A decoded frame, borrowed from the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    header: Header,
    descriptors: &'a [u8],
    handler: &'a str,
    metadata: &'a [u8],
    payload: &'a [u8],
    data: &'a [u8],
    raw: &'a [u8],
}

impl<'a> Frame<'a> {
    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The frame kind.
    pub fn kind(&self) -> FrameKind {
        self.header.kind
    }

    /// The message id.
    pub fn message_id(&self) -> u64 {
        self.header.message_id
    }

    /// The handler name (requests only; empty otherwise).
    pub fn handler(&self) -> &'a str {
        self.handler
    }

    /// The metadata.
    pub fn metadata(&self) -> &'a [u8] {
        self.metadata
    }

    /// The payload.
    pub fn payload(&self) -> &'a [u8] {
        self.payload
    }

    /// An error frame's text, if it is UTF-8.
    pub fn error_message(&self) -> Option<&'a str> {
        match self.header.kind {
            FrameKind::Error => core::str::from_utf8(self.payload).ok(),
            _ => None,
        }
    }

    /// How many tensors the frame announces.
    pub fn tensor_count(&self) -> u32 {
        self.header.tensor_count
    }

    /// The tensor descriptors, in order (all were checked while decoding).
    pub fn tensors(&self) -> impl Iterator<Item = TensorDescriptor> + 'a {
        self.descriptors
            .chunks_exact(DESCRIPTOR_LEN)
            .zip(0u32..)
            .filter_map(|(chunk, i)| {
                let bytes: &[u8; DESCRIPTOR_LEN] = chunk.try_into().ok()?;
                TensorDescriptor::from_bytes(bytes, i).ok()
            })
    }

    /// Every tensor with its entry in the data section: its bytes for `basic` tensors,
    /// its channel descriptor for tensors that travel on another channel.
    pub fn tensors_with_data(
        &self,
    ) -> impl Iterator<Item = (TensorDescriptor, TensorData<'a>)> + 'a {
        let mut rest = self.data;
        self.tensors().map(move |t| {
            let len = usize::try_from(t.data_len())
                .unwrap_or(usize::MAX)
                .min(rest.len());
            let (data, tail) = rest.split_at(len);
            rest = tail;
            if t.is_inline() {
                (t, TensorData::Inline(data))
            } else {
                (t, TensorData::Channel(data))
            }
        })
    }

    /// The whole data section: every tensor's inline data or channel descriptor,
    /// concatenated in descriptor order.
    pub fn data_section(&self) -> &'a [u8] {
        self.data
    }

    /// The frame's bytes exactly as received.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.raw
    }
}

/// How far a decoder got through the current frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Progress {
    header: Option<Header>,
    /// Descriptors checked so far.
    checked: u32,
    /// Data section bytes announced by the checked descriptors.
    data: u64,
}

fn decode_with<'a>(
    buf: &'a [u8],
    limits: &FrameLimits,
    progress: &mut Progress,
) -> Result<Decoded<Frame<'a>>, FrameError> {
    let header = match progress.header {
        Some(header) => header,
        None => match Header::check_prefix(buf.get(..HEADER_LEN).unwrap_or(buf), limits)? {
            Some(header) => {
                progress.header = Some(header);
                header
            }
            None => return Ok(Decoded::Partial(HEADER_LEN - buf.len().min(HEADER_LEN - 1))),
        },
    };

    // Check every descriptor that has fully arrived.
    while progress.checked < header.tensor_count {
        let Some(chunk) = usize::try_from(progress.checked)
            .ok()
            .and_then(|i| i.checked_mul(DESCRIPTOR_LEN))
            .and_then(|offset| offset.checked_add(HEADER_LEN))
            .and_then(|start| buf.get(start..start.checked_add(DESCRIPTOR_LEN)?))
        else {
            break;
        };
        let bytes: &[u8; DESCRIPTOR_LEN] = chunk.try_into().map_err(|_| FrameError::BadMagic)?;
        let tensor = TensorDescriptor::from_bytes(bytes, progress.checked)?;
        check_len(FrameField::TensorBytes, tensor.len, limits.max_tensor_bytes)?;
        check_len(
            FrameField::ChannelDescriptor,
            tensor.channel_descriptor_len.into(),
            limits.max_channel_descriptor.into(),
        )?;
        let total = progress.data.saturating_add(tensor.data_len());
        check_len(FrameField::InlineBytes, total, limits.max_inline_bytes)?;
        progress.data = total;
        progress.checked += 1;
    }

    let fixed = header.fixed_len();
    let have = buf.len() as u64;
    if progress.checked < header.tensor_count {
        return Ok(Decoded::Partial(missing(fixed, have)));
    }
    let total = fixed.saturating_add(progress.data);
    let total_usize = match usize::try_from(total) {
        Ok(n) if total != u64::MAX => n,
        _ => return Err(FrameError::TooLarge { total }),
    };
    // The handler name is checked as soon as it is all there.
    let handler_start = header.descriptors_end();
    let handler_end = handler_start + u64::from(header.handler_len);
    if have < handler_end {
        return Ok(Decoded::Partial(missing(total, have)));
    }
    let handler = slice(buf, handler_start, handler_end).ok_or(FrameError::BadMagic)?;
    let handler = core::str::from_utf8(handler).map_err(|_| FrameError::HandlerNotUtf8)?;
    if have < total {
        return Ok(Decoded::Partial(missing(total, have)));
    }
    let metadata_end = handler_end + u64::from(header.metadata_len);
    let payload_end = metadata_end + header.payload_len;
    let frame = (|| {
        Some(Frame {
            header,
            descriptors: slice(buf, HEADER_LEN as u64, handler_start)?,
            handler,
            metadata: slice(buf, handler_end, metadata_end)?,
            payload: slice(buf, metadata_end, payload_end)?,
            data: slice(buf, payload_end, total)?,
            raw: buf.get(..total_usize)?,
        })
    })()
    .ok_or(FrameError::TooLarge { total })?;
    *progress = Progress::default();
    Ok(Decoded::Complete(frame, total_usize))
}

fn slice(buf: &[u8], start: u64, end: u64) -> Option<&[u8]> {
    buf.get(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
}

fn missing(total: u64, have: u64) -> usize {
    usize::try_from(total.saturating_sub(have).max(1)).unwrap_or(usize::MAX)
}

/// Decodes one frame from the start of `buf` (all unconsumed bytes).
///
/// # Errors
/// [`FrameError`] as soon as a complete field is invalid or over `limits`.
pub fn decode_frame<'a>(
    buf: &'a [u8],
    limits: &FrameLimits,
) -> Result<Decoded<Frame<'a>>, FrameError> {
    decode_with(buf, limits, &mut Progress::default())
}

/// A resuming frame decoder: it remembers the header and the descriptors already checked
/// between calls. Hand it all unconsumed bytes from the start of the current frame each
/// time (the same bytes as before, plus what arrived); after a complete frame or an
/// error it starts afresh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameDecoder {
    limits: FrameLimits,
    progress: Progress,
}

impl FrameDecoder {
    /// A decoder applying `limits`.
    pub fn new(limits: FrameLimits) -> FrameDecoder {
        FrameDecoder {
            limits,
            progress: Progress::default(),
        }
    }

    /// The header of the frame in progress, once its 40 bytes have arrived: a caller that
    /// wants to read the payload or tensor data straight into its own buffers learns the
    /// sizes here.
    pub fn header(&self) -> Option<&Header> {
        self.progress.header.as_ref()
    }

    /// Decodes the frame at the start of `buf`.
    ///
    /// # Errors
    /// [`FrameError`] as [`decode_frame`].
    pub fn decode<'a>(&mut self, buf: &'a [u8]) -> Result<Decoded<Frame<'a>>, FrameError> {
        let result = decode_with(buf, &self.limits, &mut self.progress);
        if result.is_err() {
            self.progress = Progress::default();
        }
        result
    }

    /// Forgets the frame in progress.
    pub fn reset(&mut self) {
        self.progress = Progress::default();
    }
}

/// A frame to send, borrowing its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutgoingFrame<'a> {
    /// The kind.
    pub kind: FrameKind,
    /// The message id (the request's, for responses and errors; the response's for
    /// acks; 0 for handshakes and goodbyes).
    pub message_id: u64,
    /// The handler name (requests only).
    pub handler: &'a str,
    /// The metadata.
    pub metadata: &'a [u8],
    /// The payload.
    pub payload: &'a [u8],
    /// The tensors.
    pub tensors: &'a [TensorDescriptor],
    /// One slice per tensor, in order: the data of a `basic` tensor, the channel
    /// descriptor of any other (of its descriptor's `channel_descriptor_len`).
    pub tensor_data: &'a [&'a [u8]],
}

impl<'a> OutgoingFrame<'a> {
    /// A frame of `kind` with every part empty.
    pub const fn empty(kind: FrameKind, message_id: u64) -> Self {
        OutgoingFrame {
            kind,
            message_id,
            handler: "",
            metadata: &[],
            payload: &[],
            tensors: &[],
            tensor_data: &[],
        }
    }

    /// A request to `handler`.
    pub const fn request(
        message_id: u64,
        handler: &'a str,
        metadata: &'a [u8],
        payload: &'a [u8],
    ) -> Self {
        OutgoingFrame {
            handler,
            metadata,
            payload,
            ..Self::empty(FrameKind::Request, message_id)
        }
    }

    /// The response to request `message_id`.
    pub const fn response(message_id: u64, metadata: &'a [u8], payload: &'a [u8]) -> Self {
        OutgoingFrame {
            metadata,
            payload,
            ..Self::empty(FrameKind::Response, message_id)
        }
    }

    /// Request `message_id` failed with `message`.
    pub const fn error(message_id: u64, message: &'a str) -> Self {
        OutgoingFrame {
            payload: message.as_bytes(),
            ..Self::empty(FrameKind::Error, message_id)
        }
    }

    /// A goodbye.
    pub const fn goodbye() -> Self {
        Self::empty(FrameKind::Goodbye, 0)
    }

    /// The ack of the out-of-band tensors of response `message_id`.
    pub const fn ack(message_id: u64) -> Self {
        Self::empty(FrameKind::Ack, message_id)
    }

    /// This frame with these tensors and their data-section entries (one slice per
    /// tensor: the data of a `basic` one, the channel descriptor of any other).
    pub const fn with_tensors(
        mut self,
        tensors: &'a [TensorDescriptor],
        tensor_data: &'a [&'a [u8]],
    ) -> Self {
        self.tensors = tensors;
        self.tensor_data = tensor_data;
        self
    }

    /// Checks the frame and builds its header.
    ///
    /// # Errors
    /// [`EncodeError`] if the decoder would reject the frame's shape (limits aside) or the
    /// tensor data does not match the descriptors.
    pub fn header(&self) -> Result<Header, EncodeError> {
        let too_long = |field, claimed: usize, limit: u64| {
            EncodeError::Invalid(FrameError::OverLimit {
                field,
                claimed: claimed as u64,
                limit,
            })
        };
        let header = Header {
            kind: self.kind,
            message_id: self.message_id,
            handler_len: u32::try_from(self.handler.len()).map_err(|_| {
                too_long(FrameField::HandlerName, self.handler.len(), u32::MAX.into())
            })?,
            metadata_len: u32::try_from(self.metadata.len()).map_err(|_| {
                too_long(FrameField::Metadata, self.metadata.len(), u32::MAX.into())
            })?,
            payload_len: self.payload.len() as u64,
            tensor_count: u32::try_from(self.tensors.len())
                .map_err(|_| too_long(FrameField::Tensors, self.tensors.len(), u32::MAX.into()))?,
        };
        Header::check_prefix(&header.to_bytes(), &FrameLimits::UNLIMITED)
            .map_err(EncodeError::Invalid)?;
        if self.tensor_data.len() != self.tensors.len() {
            return Err(EncodeError::DataCount {
                expected: self.tensors.len(),
                given: self.tensor_data.len(),
            });
        }
        for ((tensor, data), index) in self.tensors.iter().zip(self.tensor_data).zip(0u32..) {
            tensor.check(index).map_err(EncodeError::Invalid)?;
            if data.len() as u64 != tensor.data_len() {
                return Err(EncodeError::DataLength {
                    tensor: index,
                    expected: tensor.data_len(),
                    given: data.len(),
                });
            }
        }
        Ok(header)
    }

    /// The size of the header and descriptors: what [`encode_head`](Self::encode_head)
    /// writes.
    pub fn head_len(&self) -> usize {
        HEADER_LEN.saturating_add(self.tensors.len().saturating_mul(DESCRIPTOR_LEN))
    }

    /// The size of the whole frame.
    pub fn encoded_len(&self) -> usize {
        self.tensor_data.iter().fold(
            self.head_len()
                .saturating_add(self.handler.len())
                .saturating_add(self.metadata.len())
                .saturating_add(self.payload.len()),
            |n, d| n.saturating_add(d.len()),
        )
    }

    /// Writes the header and the descriptors only, for a vectored write whose further
    /// slices are the handler name, the metadata, the payload and the data section (see
    /// [`slices`](Self::slices)). Returns the bytes written.
    ///
    /// # Errors
    /// [`EncodeError::InsufficientSize`] if `buf` is shorter than
    /// [`head_len`](Self::head_len), or the errors of [`header`](Self::header).
    pub fn encode_head(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let header = self.header()?;
        let needed = self.head_len();
        let available = buf.len();
        let out = buf
            .get_mut(..needed)
            .ok_or(EncodeError::InsufficientSize { needed, available })?;
        let (head, descriptors) = out.split_at_mut(HEADER_LEN);
        head.copy_from_slice(&header.to_bytes());
        for (dst, tensor) in descriptors
            .chunks_exact_mut(DESCRIPTOR_LEN)
            .zip(self.tensors)
        {
            dst.copy_from_slice(&tensor.to_bytes());
        }
        Ok(needed)
    }

    /// The slices that follow the head on the wire, in order.
    pub fn slices(&self) -> impl Iterator<Item = &'a [u8]> + 'a {
        [self.handler.as_bytes(), self.metadata, self.payload]
            .into_iter()
            .chain(self.tensor_data.iter().copied())
    }

    /// Writes the whole frame into `buf`. Returns the bytes written.
    ///
    /// # Errors
    /// [`EncodeError::InsufficientSize`] naming [`encoded_len`](Self::encoded_len) if
    /// `buf` is too short, or the errors of [`header`](Self::header).
    pub fn encode(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let needed = self.encoded_len();
        if buf.len() < needed {
            self.header()?;
            return Err(EncodeError::InsufficientSize {
                needed,
                available: buf.len(),
            });
        }
        let mut at = self.encode_head(buf)?;
        for part in self.slices() {
            let end = at + part.len();
            if let Some(dst) = buf.get_mut(at..end) {
                dst.copy_from_slice(part);
            }
            at = end;
        }
        Ok(at)
    }

    /// Appends the whole frame to `out`.
    ///
    /// # Errors
    /// The errors of [`header`](Self::header); `out` is unchanged then.
    pub fn encode_to_vec(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        self.header()?;
        let start = out.len();
        out.resize(start + self.head_len(), 0);
        if let Some(head) = out.get_mut(start..) {
            self.encode_head(head)?;
        }
        for part in self.slices() {
            out.extend_from_slice(part);
        }
        Ok(())
    }
}

impl<'a> Frame<'a> {
    /// The frame as an [`OutgoingFrame`] (to forward or re-encode it), given room for its
    /// descriptors and data-section slices.
    pub fn to_outgoing<'b>(
        &self,
        tensors: &'b mut Vec<TensorDescriptor>,
        data: &'b mut Vec<&'a [u8]>,
    ) -> OutgoingFrame<'b>
    where
        'a: 'b,
    {
        tensors.clear();
        data.clear();
        for (tensor, entry) in self.tensors_with_data() {
            tensors.push(tensor);
            data.push(entry.bytes());
        }
        OutgoingFrame {
            kind: self.header.kind,
            message_id: self.header.message_id,
            handler: self.handler,
            metadata: self.metadata,
            payload: self.payload,
            tensors,
            tensor_data: data,
        }
    }
}
