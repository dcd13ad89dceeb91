//! Received shm messages into frames: each message is exactly one frame, checked by the
//! core's decoder; a large inline tensor keeps the message's own buffer.

use rdzv_core::rpc::frame::{decode_frame, Decoded, Frame, FrameLimits, TensorDescriptor};

use crate::rpc::error::TransportError;
use crate::rpc::transport::IncomingFrame;
use crate::shm::ShmError;

/// An shm error as an I/O error (the transport seam's errors carry I/O sources).
pub(super) fn shm_io(error: ShmError) -> std::io::Error {
    std::io::Error::other(error)
}

/// One received shm message (or the receiving error) as a frame: `Ok(None)` when the peer
/// closed. A message must hold exactly one frame.
pub(super) fn decode_message(
    received: Result<Vec<u8>, ShmError>,
    limits: FrameLimits,
    peer: &str,
) -> Result<Option<IncomingFrame>, TransportError> {
    let io_error = |source| TransportError::Io {
        op: "receive from",
        peer: peer.to_string(),
        source,
    };
    let message = match received {
        Ok(message) => message,
        Err(ShmError::PeerClosed) => return Ok(None),
        Err(e) => return Err(io_error(shm_io(e))),
    };
    match decode_frame(&message, &limits) {
        Ok(Decoded::Complete(frame, used)) if used == message.len() => {
            let Some(plan) = in_place_plan(&frame, &message) else {
                return Ok(Some(IncomingFrame::from_frame(&frame)));
            };
            Ok(Some(plan.finish(message)))
        }
        Ok(Decoded::Complete(_, used)) => Err(io_error(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "an shm message of {} bytes holds a frame of {used} and more",
                message.len()
            ),
        ))),
        Ok(Decoded::Partial(_)) => Err(TransportError::Truncated {
            peer: peer.to_string(),
            have: message.len(),
        }),
        Err(source) => Err(TransportError::Frame {
            peer: peer.to_string(),
            source,
        }),
    }
}

/// Tensors at least this large are moved to the front of the received message, which
/// becomes their buffer, instead of being copied into a new one (no fresh pages).
pub(super) const IN_PLACE_MIN: usize = 256 * 1024;

/// A received frame whose largest tensor keeps the message's buffer: every other part
/// is copied out first.
struct InPlacePlan {
    head: IncomingFrame,
    /// Where the largest tensor goes among `head.tensors`, its descriptor, and where its
    /// bytes are in the message.
    index: usize,
    descriptor: TensorDescriptor,
    range: std::ops::Range<usize>,
}

/// An [`InPlacePlan`] when the frame carries an inline tensor of at least
/// [`IN_PLACE_MIN`] bytes (the largest inline one keeps the buffer; channel descriptors
/// are copied like the other parts).
fn in_place_plan(frame: &Frame<'_>, message: &[u8]) -> Option<InPlacePlan> {
    let base = message.as_ptr() as usize;
    let parts: Vec<(TensorDescriptor, &[u8])> = frame
        .tensors_with_data()
        .map(|(descriptor, data)| (descriptor, data.bytes()))
        .collect();
    let (index, &(descriptor, data)) = parts
        .iter()
        .enumerate()
        .filter(|(_, (descriptor, _))| descriptor.is_inline())
        .max_by_key(|(_, (_, data))| data.len())?;
    if data.len() < IN_PLACE_MIN {
        return None;
    }
    let start = (data.as_ptr() as usize).checked_sub(base)?;
    let range = start..start.checked_add(data.len())?;
    // The slice must be the message's own bytes.
    if message.get(range.clone())?.as_ptr() != data.as_ptr() {
        return None;
    }
    let tensors = parts
        .iter()
        .enumerate()
        .map(|(i, &(d, bytes))| {
            (
                d,
                if i == index {
                    Vec::new()
                } else {
                    bytes.to_vec()
                },
            )
        })
        .collect();
    Some(InPlacePlan {
        head: IncomingFrame {
            kind: frame.kind(),
            message_id: frame.message_id(),
            handler: frame.handler().to_string(),
            metadata: frame.metadata().to_vec(),
            payload: frame.payload().to_vec(),
            tensors,
            wire_len: message.len() as u64,
        },
        index,
        descriptor,
        range,
    })
}

impl InPlacePlan {
    fn finish(self, mut message: Vec<u8>) -> IncomingFrame {
        let InPlacePlan {
            mut head,
            index,
            descriptor,
            range,
        } = self;
        let len = range.len();
        message.copy_within(range, 0);
        message.truncate(len);
        if let Some(slot) = head.tensors.get_mut(index) {
            *slot = (descriptor, message);
        }
        head
    }
}
