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

mod decode;
mod encode;
mod error;
mod handshake;
mod limits;
mod owned;
#[cfg(test)]
mod tests;
mod wire;

pub use decode::{decode_frame, Frame, FrameDecoder};
pub use encode::OutgoingFrame;
pub use error::{EncodeError, FrameError, FrameField};
pub use handshake::{decode_handshake, Handshake, HandshakeError};
pub use limits::FrameLimits;
pub use owned::{IncomingFrame, OwnedFrame};
pub use wire::{Header, TensorData, TensorDescriptor};

use core::fmt;

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
