//! The tcp transport's framing, over a byte stream read and written by blocking calls
//! (the socket of a pipe served by threads: its handshake, then its lane).
//!
//! Receiving reads into one buffer and lets the core's [`FrameDecoder`] check every
//! field against the [`FrameLimits`] as soon as it is complete; the buffer only grows by
//! what the decoder says is still missing, so a peer claiming a huge frame is refused
//! before anything of that size is allocated. When a frame carries many inline tensor
//! bytes, everything before them goes through the buffer (and the decoder's checks) and
//! the tensors are then read straight into their own buffers, without a copy. Sending
//! writes small frames (up to [`COALESCE_LIMIT`]) with one write and large ones as the
//! head followed by the frame's own buffers, without copying them.

use std::sync::Arc;

use rdzv_core::rpc::frame::{
    Decoded, FrameDecoder, FrameLimits, Header, TensorDescriptor, DESCRIPTOR_LEN, HEADER_LEN,
};
use std::io::{Read, Write};

use super::COALESCE_LIMIT;
use crate::rpc::error::TransportError;
use crate::rpc::recycle;
use crate::rpc::transport::{IncomingFrame, OwnedFrame};

/// How much the receive buffer asks the kernel for at least.
pub(super) const READ_CHUNK: usize = 64 * 1024;
/// A receive buffer above this size is shrunk back once it is drained.
const KEEP_BUFFER: usize = 1 << 20;
/// Frames with at least this many data-section bytes (inline tensors and channel
/// descriptors) have them read straight into each tensor's own buffer instead of
/// through the receive buffer.
const DIRECT_READ_MIN: u64 = 256 * 1024;

/// A pipe's sending half over the byte stream `W`.
pub(super) struct TcpSender<W> {
    pub(super) write: W,
    pub(super) peer: Arc<str>,
    /// The buffer small frames are coalesced in.
    pub(super) scratch: Vec<u8>,
}

impl<W: Write> TcpSender<W> {
    fn io_error(&self, source: std::io::Error) -> TransportError {
        TransportError::Io {
            op: "send to",
            peer: self.peer.to_string(),
            source,
        }
    }

    pub(super) fn send_frame(&mut self, frame: &OwnedFrame) -> Result<u64, TransportError> {
        let head = frame
            .encode_head()
            .map_err(|source| TransportError::Encode {
                peer: self.peer.to_string(),
                source,
            })?;
        let total = frame.encoded_len();
        if total <= COALESCE_LIMIT {
            let mut out = std::mem::take(&mut self.scratch);
            out.clear();
            out.extend_from_slice(&head);
            for part in frame.body() {
                out.extend_from_slice(part);
            }
            let written = self.write.write_all(&out);
            self.scratch = out;
            written.map_err(|e| self.io_error(e))?;
        } else {
            self.write.write_all(&head).map_err(|e| self.io_error(e))?;
            for part in frame.body().filter(|p| !p.is_empty()) {
                self.write.write_all(part).map_err(|e| self.io_error(e))?;
            }
        }
        self.write.flush().map_err(|e| self.io_error(e))?;
        Ok(total as u64)
    }
}

/// A pipe's receiving half over the byte stream `R`.
pub(super) struct TcpReceiver<R> {
    pub(super) read: R,
    pub(super) peer: Arc<str>,
    /// Received bytes not yet taken as frames: the first `filled` of it.
    pub(super) buf: Vec<u8>,
    pub(super) filled: usize,
}

impl<R> TcpReceiver<R> {
    pub(super) fn pending(&self) -> &[u8] {
        self.buf.get(..self.filled).unwrap_or_default()
    }

    /// Drops the first `used` bytes.
    pub(super) fn consume(&mut self, used: usize) {
        let used = used.min(self.filled);
        self.buf.copy_within(used..self.filled, 0);
        self.filled -= used;
        if self.buf.len() > KEEP_BUFFER && self.filled < READ_CHUNK {
            self.buf.truncate(READ_CHUNK.max(self.filled));
            self.buf.shrink_to_fit();
        }
    }
}

/// How a frame with large inline data is read: `fixed` bytes (header to payload)
/// through the buffer, then each tensor's data-section entry (its bytes, or its channel
/// descriptor) into its own buffer.
struct DirectPlan {
    header: Header,
    fixed: usize,
    tensors: Vec<TensorDescriptor>,
}

/// A [`DirectPlan`] if the header is known, its descriptors are all buffered, and the
/// frame's inline bytes are many.
fn direct_plan(header: Option<&Header>, pending: &[u8]) -> Option<DirectPlan> {
    let header = *header?;
    let count = usize::try_from(header.tensor_count).ok()?;
    let descriptors = pending.get(HEADER_LEN..HEADER_LEN + count.checked_mul(DESCRIPTOR_LEN)?)?;
    let tensors = descriptors
        .chunks_exact(DESCRIPTOR_LEN)
        .zip(0u32..)
        .map(|(bytes, i)| {
            let bytes: &[u8; DESCRIPTOR_LEN] = bytes.try_into().ok()?;
            TensorDescriptor::from_bytes(bytes, i).ok()
        })
        .collect::<Option<Vec<_>>>()?;
    let inline: u64 = tensors
        .iter()
        .map(TensorDescriptor::data_len)
        .fold(0u64, u64::saturating_add);
    if inline < DIRECT_READ_MIN {
        return None;
    }
    Some(DirectPlan {
        header,
        fixed: usize::try_from(header.fixed_len()).ok()?,
        tensors,
    })
}

impl<R: Read> TcpReceiver<R> {
    /// Finishes a frame whose first `plan.fixed` bytes are buffered (and checked by the
    /// decoder): the inline tensors are read into their own buffers.
    fn read_direct(&mut self, plan: DirectPlan) -> Result<IncomingFrame, TransportError> {
        let DirectPlan {
            header,
            fixed,
            tensors,
        } = plan;
        let truncated = |have: usize| TransportError::Truncated {
            peer: self.peer.to_string(),
            have,
        };
        let handler_start = HEADER_LEN + tensors.len() * DESCRIPTOR_LEN;
        let handler_end = handler_start + header.handler_len as usize;
        let metadata_end = handler_end + header.metadata_len as usize;
        let handler = self
            .buf
            .get(handler_start..handler_end)
            .and_then(|b| std::str::from_utf8(b).ok())
            .unwrap_or_default()
            .to_string();
        let metadata = self
            .buf
            .get(handler_end..metadata_end)
            .unwrap_or_default()
            .to_vec();
        let payload = self
            .buf
            .get(metadata_end..fixed)
            .unwrap_or_default()
            .to_vec();
        // Inline bytes that arrived with the fixed part (at most one read's worth).
        let mut early_at = fixed;
        let mut wire_len = fixed as u64;
        let mut received = Vec::with_capacity(tensors.len());
        for descriptor in tensors {
            let len = usize::try_from(descriptor.data_len()).map_err(|_| truncated(early_at))?;
            let mut data = recycle::try_take(len).map_err(|e| TransportError::Io {
                op: "receive a tensor from",
                peer: self.peer.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::OutOfMemory, e),
            })?;
            let early = self.buf.get(early_at..self.filled).unwrap_or_default();
            let take = early.len().min(len);
            if let (Some(dst), Some(src)) = (data.get_mut(..take), early.get(..take)) {
                dst.copy_from_slice(src);
            }
            early_at += take;
            if let Some(rest) = data.get_mut(take..) {
                self.read.read_exact(rest).map_err(|source| {
                    if source.kind() == std::io::ErrorKind::UnexpectedEof {
                        truncated(early_at)
                    } else {
                        TransportError::Io {
                            op: "receive from",
                            peer: self.peer.to_string(),
                            source,
                        }
                    }
                })?;
            }
            wire_len += descriptor.data_len();
            received.push((descriptor, data));
        }
        // Buffered bytes past `early_at` are the next frame's.
        self.consume(early_at);
        Ok(IncomingFrame {
            kind: header.kind,
            message_id: header.message_id,
            handler,
            metadata,
            payload,
            tensors: received,
            wire_len,
        })
    }
}

impl<R: Read> TcpReceiver<R> {
    /// The next frame, read as the module doc says.
    pub(super) fn recv_frame(
        &mut self,
        limits: FrameLimits,
    ) -> Result<Option<IncomingFrame>, TransportError> {
        {
            let mut decoder = FrameDecoder::new(limits);
            loop {
                let missing = if self.filled == 0 {
                    READ_CHUNK
                } else {
                    let peer = Arc::clone(&self.peer);
                    match decoder.decode(self.pending()) {
                        Ok(Decoded::Complete(frame, used)) => {
                            let incoming = IncomingFrame::from_frame(&frame);
                            self.consume(used);
                            return Ok(Some(incoming));
                        }
                        Ok(Decoded::Partial(missing)) => {
                            if let Some(plan) = direct_plan(decoder.header(), self.pending()) {
                                if self.filled >= plan.fixed {
                                    return self.read_direct(plan).map(Some);
                                }
                                // Read only up to the inline data.
                                plan.fixed - self.filled
                            } else {
                                missing
                            }
                        }
                        Err(source) => {
                            return Err(TransportError::Frame {
                                peer: peer.to_string(),
                                source,
                            })
                        }
                    }
                };
                // The decoder has checked every complete field against the limits, so
                // `missing` is a size the limits allow.
                let wanted = self.filled.saturating_add(missing.max(READ_CHUNK));
                if self.buf.len() < wanted {
                    self.buf.resize(wanted, 0);
                }
                let spare = self.buf.get_mut(self.filled..).unwrap_or_default();
                let n = self.read.read(spare).map_err(|source| TransportError::Io {
                    op: "receive from",
                    peer: self.peer.to_string(),
                    source,
                })?;
                if n == 0 {
                    return if self.filled == 0 {
                        Ok(None)
                    } else {
                        Err(TransportError::Truncated {
                            peer: self.peer.to_string(),
                            have: self.filled,
                        })
                    };
                }
                self.filled += n;
            }
        }
    }
}
