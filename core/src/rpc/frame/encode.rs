//! [`OutgoingFrame`]: a frame to send, encoded as its head (header and descriptors) and
//! the slices that follow it, without copying them.

use alloc::vec::Vec;

use super::error::{EncodeError, FrameError, FrameField};
use super::limits::FrameLimits;
use super::wire::{Header, TensorDescriptor};
use super::{FrameKind, DESCRIPTOR_LEN, HEADER_LEN};

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
