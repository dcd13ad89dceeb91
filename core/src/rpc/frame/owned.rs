//! Frames that own their parts, for runtimes: [`OwnedFrame`] to send (a transport may
//! keep it until its write completes; its tensor buffers are whatever the runtime lends,
//! `B`), [`IncomingFrame`] received (copied out of the receive buffer, or read straight
//! into its own buffers). Both go through the same checks as the wire: an outgoing frame
//! is encoded by [`OutgoingFrame`], an incoming one was decoded by [`decode_frame`].

use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;

use super::{
    decode_frame, EncodeError, Frame, FrameKind, FrameLimits, OutgoingFrame, TensorDescriptor,
};

/// A frame to send, owning its parts; `B` holds each data-section entry's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedFrame<B> {
    /// The kind.
    pub kind: FrameKind,
    /// The message id.
    pub message_id: u64,
    /// The handler name (requests).
    pub handler: String,
    /// The metadata.
    pub metadata: Vec<u8>,
    /// The payload (the error text for errors, the postcard handshake for handshakes).
    pub payload: Vec<u8>,
    /// One descriptor per tensor.
    pub tensors: Vec<TensorDescriptor>,
    /// One entry per tensor, in order: the data of a `basic` tensor, the channel
    /// descriptor of any other (the frame's data section).
    pub tensor_data: Vec<B>,
}

impl<B: AsRef<[u8]>> OwnedFrame<B> {
    /// A frame of `kind` with every part empty.
    pub fn empty(kind: FrameKind, message_id: u64) -> OwnedFrame<B> {
        OwnedFrame {
            kind,
            message_id,
            handler: String::new(),
            metadata: Vec::new(),
            payload: Vec::new(),
            tensors: Vec::new(),
            tensor_data: Vec::new(),
        }
    }

    /// An error frame answering request `message_id` with `text`.
    pub fn error(message_id: u64, text: &str) -> OwnedFrame<B> {
        OwnedFrame {
            payload: text.as_bytes().to_vec(),
            ..OwnedFrame::empty(FrameKind::Error, message_id)
        }
    }

    /// Runs `f` with the borrowed view of this frame.
    pub fn with_outgoing<R>(&self, f: impl FnOnce(&OutgoingFrame<'_>) -> R) -> R {
        let data: Vec<&[u8]> = self.tensor_data.iter().map(AsRef::as_ref).collect();
        let frame = OutgoingFrame {
            kind: self.kind,
            message_id: self.message_id,
            handler: &self.handler,
            metadata: &self.metadata,
            payload: &self.payload,
            tensors: &self.tensors,
            tensor_data: &data,
        };
        f(&frame)
    }

    /// The whole frame's size on the wire.
    pub fn encoded_len(&self) -> usize {
        self.with_outgoing(|frame| frame.encoded_len())
    }

    /// Checks the frame and writes its header and descriptors (the rest follows as the
    /// frame's own buffers, [`body`](Self::body)).
    ///
    /// # Errors
    /// [`EncodeError`] if a receiver would not decode the frame.
    pub fn encode_head(&self) -> Result<Vec<u8>, EncodeError> {
        self.with_outgoing(|frame| {
            let mut head = vec![0; frame.head_len()];
            frame.encode_head(&mut head).map(|n| {
                head.truncate(n);
                head
            })
        })
    }

    /// Checks the frame against the limits a receiver applies, so that an oversized
    /// message fails alone instead of making the peer drop the pipe: the decoder checks
    /// every size in the header and the descriptors, which is all the head holds.
    ///
    /// # Errors
    /// [`EncodeError`] naming the size over its limit.
    pub fn check(&self, limits: &FrameLimits) -> Result<(), EncodeError> {
        let head = self.encode_head()?;
        decode_frame(&head, limits)
            .map(|_| ())
            .map_err(EncodeError::from)
    }

    /// The buffers that follow the head, in wire order.
    pub fn body(&self) -> impl Iterator<Item = &[u8]> + '_ {
        [
            self.handler.as_bytes(),
            self.metadata.as_slice(),
            self.payload.as_slice(),
        ]
        .into_iter()
        .chain(self.tensor_data.iter().map(AsRef::as_ref))
    }
}

/// A received frame, owning its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncomingFrame {
    /// The kind.
    pub kind: FrameKind,
    /// The message id.
    pub message_id: u64,
    /// The handler name.
    pub handler: String,
    /// The metadata.
    pub metadata: Vec<u8>,
    /// The payload.
    pub payload: Vec<u8>,
    /// Each tensor's descriptor and data-section entry: its bytes for a `basic` tensor,
    /// its channel descriptor for any other.
    pub tensors: Vec<(TensorDescriptor, Vec<u8>)>,
    /// The frame's size on the wire, plus what a runtime read beside it for the frame
    /// (the stripes of its mpt tensors).
    pub wire_len: u64,
}

impl IncomingFrame {
    /// Copies a decoded frame out of the receive buffer.
    pub fn from_frame(frame: &Frame<'_>) -> IncomingFrame {
        IncomingFrame {
            kind: frame.kind(),
            message_id: frame.message_id(),
            handler: frame.handler().to_string(),
            metadata: frame.metadata().to_vec(),
            payload: frame.payload().to_vec(),
            tensors: frame
                .tensors_with_data()
                .map(|(descriptor, data)| (descriptor, data.bytes().to_vec()))
                .collect(),
            wire_len: frame.as_bytes().len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::negotiate::ChannelKind;
    use crate::rpc::frame::Decoded;

    type Frame = OwnedFrame<Vec<u8>>;

    #[test]
    fn owned_frame_round_trips_through_the_decoder() {
        let frame = Frame {
            handler: "echo".into(),
            metadata: vec![1],
            payload: b"hello".to_vec(),
            tensors: vec![
                TensorDescriptor::inline(Device::cpu(), Device::cpu(), 3),
                TensorDescriptor {
                    channel: ChannelKind::Cma,
                    channel_descriptor_len: 2,
                    ..TensorDescriptor::inline(Device::cpu(), Device::cpu(), 1 << 20)
                },
            ],
            tensor_data: vec![vec![9, 8, 7], vec![1, 2]],
            ..Frame::empty(FrameKind::Request, 42)
        };
        let mut wire = frame.encode_head().unwrap_or_default();
        for part in frame.body() {
            wire.extend_from_slice(part);
        }
        assert_eq!(wire.len(), frame.encoded_len());
        assert_eq!(frame.check(&FrameLimits::DEFAULT), Ok(()));
        let decoded = match decode_frame(&wire, &FrameLimits::DEFAULT) {
            Ok(Decoded::Complete(f, n)) => {
                assert_eq!(n, wire.len());
                Some(IncomingFrame::from_frame(&f))
            }
            _ => None,
        };
        let Some(decoded) = decoded else {
            panic!("the frame did not decode");
        };
        assert_eq!(decoded.kind, FrameKind::Request);
        assert_eq!(decoded.message_id, 42);
        assert_eq!(decoded.handler, "echo");
        assert_eq!(decoded.metadata, vec![1]);
        assert_eq!(decoded.payload, b"hello".to_vec());
        assert_eq!(
            decoded.tensors.first().map(|t| t.1.clone()),
            Some(vec![9, 8, 7])
        );
        // A channel tensor's entry is its channel descriptor.
        assert_eq!(
            decoded.tensors.get(1).map(|t| (t.0.channel, t.1.clone())),
            Some((ChannelKind::Cma, vec![1, 2]))
        );
        assert_eq!(decoded.wire_len, wire.len() as u64);
    }

    #[test]
    fn data_must_match_descriptors_and_limits() {
        let mismatched = Frame {
            tensors: vec![TensorDescriptor::inline(Device::cpu(), Device::cpu(), 4)],
            tensor_data: vec![vec![1]],
            ..Frame::empty(FrameKind::Request, 1)
        };
        assert!(mismatched.encode_head().is_err());
        // Too big for what a receiver takes: refused before it is sent.
        let big = Frame {
            payload: vec![0; 100],
            ..Frame::empty(FrameKind::Request, 2)
        };
        let small = FrameLimits {
            max_payload: 10,
            ..FrameLimits::DEFAULT
        };
        assert!(big.check(&small).is_err());
        assert_eq!(big.check(&FrameLimits::DEFAULT), Ok(()));
        let error = Frame::error(7, "no such handler");
        assert_eq!(error.kind, FrameKind::Error);
        assert_eq!(error.message_id, 7);
        assert_eq!(error.payload, b"no such handler".to_vec());
    }
}
