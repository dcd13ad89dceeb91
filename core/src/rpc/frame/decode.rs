//! The push decoder: [`decode_frame`] and [`FrameDecoder`] (which remembers what it
//! checked), and the borrowed [`Frame`] they return.

use alloc::vec::Vec;

use super::encode::OutgoingFrame;
use super::error::{FrameError, FrameField};
use super::limits::FrameLimits;
use super::wire::{check_len, Header, TensorData, TensorDescriptor};
use super::{Decoded, FrameKind, DESCRIPTOR_LEN, HEADER_LEN};

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
