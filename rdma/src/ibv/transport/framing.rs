//! How one RPC frame becomes messages on an [`IbvConnection`](super::super::connection::IbvConnection),
//! and back.
//!
//! A frame travels as a *first message* followed by zero or more *separate parts*:
//!
//! - the first message is the frame's head (header and tensor descriptors, from
//!   [`OwnedFrame::encode_head`]), the handler name, the metadata, and, in wire order,
//!   the body parts below [`SEPARATE_MIN`] bytes as long as they add up to at most
//!   [`FIRST_PARTS_MAX`] bytes;
//! - a separate part is the payload or a tensor's data-section entry of at least
//!   [`SEPARATE_MIN`] bytes, or a smaller one that no longer fits the first message's
//!   budget, alone in its message and in wire order: the connection moves a large one
//!   zero-copy (the peer's RDMA READ lands in the `Vec` that becomes the received part),
//!   so a large tensor is copied neither on the sending nor on the receiving side.
//!
//! Which parts are separate follows from the header and descriptors alone, so the
//! receiver knows after the first message how many parts follow and how long each is. A
//! zero-length message is the end of the stream ([`FIN`]): no first message or part is
//! ever empty.
//!
//! The first message is checked with the core's [`FrameDecoder`] and the caller's
//! [`FrameLimits`] before any part is accepted; a frame without separate parts is decoded
//! by the core in full and converted with [`IncomingFrame::from_frame`].
//!
//! What a peer can make this side allocate: the link's thread receives messages before
//! any receiver sees them, so it keeps a [`ReceiveGate`] that says how large the next
//! message may be *before* the connection allocates for it: a first message at most
//! [`first_message_max`] of the limits (a few MiB under [`FrameLimits::DEFAULT`], however
//! large the frame), and a separate part exactly the length that the frame's checked
//! header announced. A peer that claims a 1 GiB part therefore gets it only after sending
//! a header that announces it and passes the limits.
//!
//! This module moves no bytes over any wire and decides nothing about the frames'
//! meaning.

use rdzv_core::rpc::frame::{
    Decoded, EncodeError, Frame, FrameDecoder, FrameError, FrameLimits, Header, TensorDescriptor,
    DESCRIPTOR_LEN, HEADER_LEN,
};
use rdzv_uring::rpc::transport::{IncomingFrame, OwnedFrame};
use rdzv_uring::rpc::{HostBytes, TransportError};

/// Body parts of at least this many bytes travel as separate, zero-copy messages: the
/// connection's own zero-copy threshold, below which one copy through the ring is cheaper
/// than registering memory.
pub const SEPARATE_MIN: usize = super::super::connection::ZERO_COPY_THRESHOLD;

/// The most bytes of body parts below [`SEPARATE_MIN`] that one first message carries;
/// the small parts after them travel as separate messages (copied through the ring). It
/// bounds a first message, which is received before its header is checked.
pub const FIRST_PARTS_MAX: u64 = 1 << 20;

/// The end-of-stream message: empty.
pub const FIN: &[u8] = &[];

/// Which body parts travel alone: decided from their lengths, in wire order (payload,
/// then each tensor's data-section entry), the same way by the sender and the receiver.
#[derive(Debug, Default)]
struct Split {
    /// Bytes of small parts placed in the first message so far.
    small_in_first: u64,
}

impl Split {
    /// Whether the next part, of `len` bytes, travels alone; if not, it is counted as
    /// part of the first message.
    fn separate(&mut self, len: u64) -> bool {
        if len >= SEPARATE_MIN as u64 {
            return true;
        }
        match self
            .small_in_first
            .checked_add(len)
            .filter(|&n| n <= FIRST_PARTS_MAX)
        {
            Some(n) => {
                self.small_in_first = n;
                false
            }
            None => true,
        }
    }
}

/// The longest first message of a frame within `limits`: the head with the most tensors,
/// the longest handler name and metadata, and [`FIRST_PARTS_MAX`] bytes of small parts
/// (fewer when the limits allow less body).
pub fn first_message_max(limits: &FrameLimits) -> u64 {
    let body = limits.max_payload.saturating_add(limits.max_inline_bytes);
    (HEADER_LEN as u64)
        .saturating_add(u64::from(limits.max_tensors).saturating_mul(DESCRIPTOR_LEN as u64))
        .saturating_add(u64::from(limits.max_handler_name))
        .saturating_add(u64::from(limits.max_metadata))
        .saturating_add(FIRST_PARTS_MAX.min(body))
}

/// The messages that carry `frame`, in order: the first message, then the separate parts.
///
/// # Errors
/// [`EncodeError`] when the core would not decode the frame.
pub fn split_frame(frame: OwnedFrame) -> Result<Vec<Vec<u8>>, EncodeError> {
    let head = frame.encode_head()?;
    let OwnedFrame {
        handler,
        metadata,
        payload,
        tensor_data,
        ..
    } = frame;
    let mut separate = Vec::new();
    let mut first = head;
    first.extend_from_slice(handler.as_bytes());
    first.extend_from_slice(&metadata);
    let mut split = Split::default();
    // A tensor a device runtime staged (`cuda_basic`) is copied into a message here.
    let tensor_data = tensor_data.into_iter().map(HostBytes::into_vec);
    for part in std::iter::once(payload).chain(tensor_data) {
        if split.separate(part.len() as u64) {
            separate.push(part);
        } else {
            first.extend_from_slice(&part);
        }
    }
    let mut messages = Vec::with_capacity(separate.len() + 1);
    messages.push(first);
    messages.extend(separate);
    Ok(messages)
}

/// What a first message says.
#[derive(Debug)]
pub enum FirstMessage {
    /// The whole frame (it had no separate parts).
    Complete(IncomingFrame),
    /// A frame waiting for its separate parts.
    Pending(PendingFrame),
}

/// A frame whose first message arrived and was checked; its separate parts follow.
#[derive(Debug)]
pub struct PendingFrame {
    first: Vec<u8>,
    header: Header,
    tensors: Vec<TensorDescriptor>,
    /// The lengths of the separate parts still expected, in order.
    expected: Vec<u64>,
    parts: Vec<Vec<u8>>,
    peer: String,
}

/// Turns a link's messages back into frames (a first message, then its separate parts),
/// for the executor's receiving half and a lane's alike.
#[derive(Debug)]
pub struct Assembler {
    /// A frame whose separate parts are still arriving.
    pending: Option<PendingFrame>,
    ended: bool,
    peer: String,
}

/// What one message gave.
#[derive(Debug)]
pub enum Fed {
    /// A whole frame.
    Frame(IncomingFrame),
    /// Nothing yet: more parts are due.
    More,
    /// The end of the stream, between frames.
    End,
}

impl Assembler {
    /// An assembler for messages from `peer`.
    pub fn new(peer: &str) -> Assembler {
        Assembler {
            pending: None,
            ended: false,
            peer: peer.to_string(),
        }
    }

    /// Whether the stream ended (at its end, or after an error it cannot resume from).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Takes the link's next `message` (`Ok(None)` at the end of the stream, `Err` when
    /// the link failed), checking a first message against `limits`.
    ///
    /// # Errors
    /// The link's error; a first message the core refuses; a part of another length
    /// than announced; the end of the stream inside a frame. Each ends the stream.
    pub fn feed(
        &mut self,
        message: Result<Option<Vec<u8>>, TransportError>,
        limits: FrameLimits,
    ) -> Result<Fed, TransportError> {
        let fed = self.take(message, limits);
        if fed.is_err() {
            // The stream cannot be resynchronised.
            self.ended = true;
            self.pending = None;
        }
        fed
    }

    fn take(
        &mut self,
        message: Result<Option<Vec<u8>>, TransportError>,
        limits: FrameLimits,
    ) -> Result<Fed, TransportError> {
        let Some(message) = message? else {
            self.ended = true;
            return match self.pending.take() {
                Some(pending) => Err(TransportError::Truncated {
                    peer: self.peer.clone(),
                    have: pending.received_len(),
                }),
                None => Ok(Fed::End),
            };
        };
        match self.pending.as_mut() {
            Some(pending) => pending.push(message)?,
            None => match decode_first(message, limits, &self.peer)? {
                FirstMessage::Complete(frame) => return Ok(Fed::Frame(frame)),
                FirstMessage::Pending(pending) => self.pending = Some(pending),
            },
        }
        if self.pending.as_ref().is_some_and(PendingFrame::is_complete) {
            if let Some(done) = self.pending.take() {
                return done.finish().map(Fed::Frame);
            }
        }
        Ok(Fed::More)
    }
}

fn invalid(peer: &str, reason: String) -> TransportError {
    TransportError::Io {
        op: "receive from",
        peer: peer.to_string(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, reason),
    }
}

/// `part` is the frame part whose checked header announced `len` bytes: its length must
/// be that.
fn check_part(peer: &str, len: u64, part: &[u8]) -> Result<(), TransportError> {
    if len == part.len() as u64 {
        return Ok(());
    }
    Err(invalid(
        peer,
        format!(
            "an RDMA frame part of {} bytes arrived where {len} were announced",
            part.len()
        ),
    ))
}

fn frame_error(peer: &str, source: FrameError) -> TransportError {
    TransportError::Frame {
        peer: peer.to_string(),
        source,
    }
}

/// Checks a frame's first message against `limits` and says what follows.
///
/// # Errors
/// [`TransportError::Frame`] when the core's decoder refuses it, and
/// [`TransportError::Io`] (invalid data) when its length does not match what its header
/// announces.
pub fn decode_first(
    first: Vec<u8>,
    limits: FrameLimits,
    peer: &str,
) -> Result<FirstMessage, TransportError> {
    let Parts {
        header,
        tensors,
        mut expected,
    } = match check_first(&first, limits, peer)? {
        FirstCheck::Complete(frame) => {
            return Ok(FirstMessage::Complete(IncomingFrame::from_frame(&frame)))
        }
        FirstCheck::Parts(parts) => parts,
    };
    expected.reverse();
    Ok(FirstMessage::Pending(PendingFrame {
        first,
        header,
        tensors,
        expected,
        parts: Vec::new(),
        peer: peer.to_string(),
    }))
}

/// What a checked first message says.
enum FirstCheck<'a> {
    /// The whole frame.
    Complete(Frame<'a>),
    /// The head of a frame whose separate parts follow.
    Parts(Parts),
}

/// A checked head, and the lengths of the separate parts that follow, in order.
struct Parts {
    header: Header,
    tensors: Vec<TensorDescriptor>,
    expected: Vec<u64>,
}

/// [`decode_first`]'s checks, without taking the message.
fn check_first<'a>(
    first: &'a [u8],
    limits: FrameLimits,
    peer: &str,
) -> Result<FirstCheck<'a>, TransportError> {
    let mut decoder = FrameDecoder::new(limits);
    match decoder.decode(first) {
        Err(source) => return Err(frame_error(peer, source)),
        Ok(Decoded::Complete(frame, used)) if used == first.len() => {
            return Ok(FirstCheck::Complete(frame))
        }
        Ok(Decoded::Complete(_, used)) => {
            return Err(invalid(
                peer,
                format!(
                    "an RDMA message of {} bytes holds a frame of {used} and more",
                    first.len()
                ),
            ))
        }
        Ok(Decoded::Partial(_)) => {}
    }
    let header = *decoder.header().ok_or_else(|| {
        invalid(
            peer,
            format!(
                "an RDMA message of {} bytes is shorter than a frame header",
                first.len()
            ),
        )
    })?;
    // Header, descriptors, handler name and metadata always travel in the first message;
    // with them there, the decoder has checked every descriptor and the name.
    let descriptors_end =
        HEADER_LEN as u64 + u64::from(header.tensor_count) * DESCRIPTOR_LEN as u64;
    let named_end = descriptors_end
        .saturating_add(u64::from(header.handler_len))
        .saturating_add(u64::from(header.metadata_len));
    let have = first.len() as u64;
    if have < named_end {
        return Err(invalid(
            peer,
            format!("an RDMA frame's first message of {have} bytes ends before its metadata ({named_end} bytes)"),
        ));
    }
    let mut tensors = Vec::with_capacity(usize::try_from(header.tensor_count).unwrap_or(0));
    for (index, chunk) in first
        .get(HEADER_LEN..usize::try_from(descriptors_end).unwrap_or(usize::MAX))
        .unwrap_or_default()
        .chunks_exact(DESCRIPTOR_LEN)
        .enumerate()
    {
        let bytes: &[u8; DESCRIPTOR_LEN] = chunk
            .try_into()
            .map_err(|_| frame_error(peer, FrameError::BadMagic))?;
        let index = u32::try_from(index).unwrap_or(u32::MAX);
        let descriptor =
            TensorDescriptor::from_bytes(bytes, index).map_err(|e| frame_error(peer, e))?;
        tensors.push(descriptor);
    }
    let mut expected = Vec::new();
    let mut in_first = named_end;
    let mut split = Split::default();
    // A tensor's data-section entry: its bytes (basic) or its connection's descriptor.
    for len in std::iter::once(header.payload_len).chain(tensors.iter().map(|t| t.data_len())) {
        if split.separate(len) {
            expected.push(len);
        } else {
            in_first = in_first.saturating_add(len);
        }
    }
    if have != in_first || expected.is_empty() {
        return Err(invalid(
            peer,
            format!(
                "an RDMA frame's first message has {have} bytes; its header announces {in_first} \
                 and {} separate parts",
                expected.len()
            ),
        ));
    }
    Ok(FirstCheck::Parts(Parts {
        header,
        tensors,
        expected,
    }))
}

/// How large the next message of a link may be, and whether it fits the frame it
/// belongs to: kept by the link's thread, which receives messages before any receiver
/// checks them, so that the connection allocates for a message no more than what the frame
/// limits and the frame's checked header allow (see the [module](self) docs).
///
/// It checks first messages against its own limits, which must be at least as wide as
/// those the receivers use (the RPC agent's widest are [`FrameLimits::DEFAULT`]); the
/// receivers check every frame again against theirs.
#[derive(Debug)]
pub struct ReceiveGate {
    limits: FrameLimits,
    /// The lengths of the separate parts still expected, the next one last.
    expected: Vec<u64>,
    peer: String,
}

impl ReceiveGate {
    /// A gate for the messages from `peer`, between frames.
    pub fn new(limits: FrameLimits, peer: &str) -> ReceiveGate {
        ReceiveGate {
            limits,
            expected: Vec::new(),
            peer: peer.to_string(),
        }
    }

    /// The most bytes the next message may have: [`first_message_max`] between frames,
    /// else the length the frame's header announced for its next separate part.
    pub fn next_limit(&self) -> u64 {
        match self.expected.last() {
            Some(&len) => len,
            None => first_message_max(&self.limits),
        }
    }

    /// What the next message is, for an error about it.
    pub fn expecting(&self) -> String {
        match self.expected.last() {
            Some(len) => format!(
                "the next separate part of a frame, whose checked header announced {len} bytes"
            ),
            None => format!(
                "the first message of a frame (at most {} bytes under the frame limits)",
                first_message_max(&self.limits)
            ),
        }
    }

    /// Takes the next message (not the end of the stream): checks a first message and
    /// notes the parts it announces, or checks a part's length.
    ///
    /// # Errors
    /// As [`decode_first`] for a first message; [`TransportError::Io`] (invalid data)
    /// for a part of another length than announced. The stream cannot go on after one.
    pub fn observe(&mut self, message: &[u8]) -> Result<(), TransportError> {
        match self.expected.pop() {
            Some(len) => check_part(&self.peer, len, message),
            None => {
                if let FirstCheck::Parts(parts) = check_first(message, self.limits, &self.peer)? {
                    self.expected = parts.expected;
                    self.expected.reverse();
                }
                Ok(())
            }
        }
    }
}

impl PendingFrame {
    /// Whether every separate part has arrived.
    pub fn is_complete(&self) -> bool {
        self.expected.is_empty()
    }

    /// The bytes received so far (first message and parts).
    pub fn received_len(&self) -> usize {
        self.parts
            .iter()
            .fold(self.first.len(), |n, part| n.saturating_add(part.len()))
    }

    /// Adds the next separate part.
    ///
    /// # Errors
    /// [`TransportError::Io`] (invalid data) when it is not the length announced, or
    /// when no part is expected.
    pub fn push(&mut self, part: Vec<u8>) -> Result<(), TransportError> {
        match self.expected.pop() {
            Some(len) => {
                check_part(&self.peer, len, &part)?;
                self.parts.push(part);
                Ok(())
            }
            None => Err(invalid(
                &self.peer,
                "an RDMA frame part arrived after the frame was complete".into(),
            )),
        }
    }

    /// The frame, once [complete](Self::is_complete).
    ///
    /// # Errors
    /// [`TransportError::Truncated`] when parts are missing; [`TransportError::Frame`]
    /// for a handler name that is not UTF-8.
    pub fn finish(self) -> Result<IncomingFrame, TransportError> {
        let wire_len = self.received_len() as u64;
        let PendingFrame {
            first,
            header,
            tensors,
            expected,
            parts,
            peer,
        } = self;
        if !expected.is_empty() {
            return Err(TransportError::Truncated {
                peer,
                have: usize::try_from(wire_len).unwrap_or(usize::MAX),
            });
        }
        let mut parts = parts.into_iter();
        let mut at = HEADER_LEN.saturating_add(tensors.len().saturating_mul(DESCRIPTOR_LEN));
        let mut split = Split::default();
        // `separable`: the payload and tensors may travel apart, the name and metadata never.
        let truncated = || TransportError::Truncated {
            peer: peer.clone(),
            have: first.len(),
        };
        let mut take = |len: u64, separable: bool| -> Result<Vec<u8>, TransportError> {
            if separable && split.separate(len) {
                return parts.next().ok_or_else(truncated);
            }
            let end = usize::try_from(len)
                .ok()
                .and_then(|len| at.checked_add(len))
                .filter(|&end| end <= first.len())
                .ok_or_else(truncated)?;
            let bytes = first.get(at..end).unwrap_or_default().to_vec();
            at = end;
            Ok(bytes)
        };
        let handler = String::from_utf8(take(u64::from(header.handler_len), false)?)
            .map_err(|_| frame_error(&peer, FrameError::HandlerNotUtf8))?;
        let metadata = take(u64::from(header.metadata_len), false)?;
        let payload = take(header.payload_len, true)?;
        let tensors = tensors
            .into_iter()
            .map(|descriptor| Ok((descriptor, take(descriptor.data_len(), true)?)))
            .collect::<Result<Vec<_>, TransportError>>()?;
        Ok(IncomingFrame {
            kind: header.kind,
            message_id: header.message_id,
            handler,
            metadata,
            payload,
            tensors,
            wire_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rdzv_core::device::Device;
    use rdzv_core::rpc::frame::FrameKind;

    fn tensor(len: usize) -> TensorDescriptor {
        TensorDescriptor::inline(Device::cpu(), Device::cpu(), len as u64)
    }

    fn frame(payload: usize, tensors: &[usize]) -> OwnedFrame {
        let fill = |n: usize, seed: usize| -> Vec<u8> {
            (0..n)
                .map(|i| (i * 7 + seed * 13 + (i >> 9)) as u8)
                .collect()
        };
        OwnedFrame {
            handler: "echo".into(),
            metadata: vec![1, 2, 3],
            payload: fill(payload, 99),
            tensors: tensors.iter().map(|&n| tensor(n)).collect(),
            tensor_data: tensors
                .iter()
                .enumerate()
                .map(|(i, &n)| fill(n, i).into())
                .collect(),
            ..OwnedFrame::empty(FrameKind::Request, 7)
        }
    }

    /// Splits, then receives the messages in order, each admitted by a link's gate
    /// first.
    fn round_trip(frame: &OwnedFrame, limits: FrameLimits) -> Result<IncomingFrame, String> {
        let messages = split_frame(frame.clone()).map_err(|e| e.to_string())?;
        let total: usize = messages.iter().map(Vec::len).sum();
        assert_eq!(total, frame.encoded_len());
        assert!(messages.iter().all(|m| !m.is_empty()));
        let mut gate = ReceiveGate::new(FrameLimits::DEFAULT, "peer");
        for (n, message) in messages.iter().enumerate() {
            let limit = gate.next_limit();
            assert!(message.len() as u64 <= limit, "message {n} over {limit}");
            if n > 0 {
                assert_eq!(message.len() as u64, limit, "part {n}");
            }
            gate.observe(message).map_err(|e| e.to_string())?;
        }
        // Between frames again.
        assert_eq!(gate.next_limit(), first_message_max(&FrameLimits::DEFAULT));
        let mut messages = messages.into_iter();
        let first = messages.next().ok_or("no first message")?;
        match decode_first(first, limits, "peer").map_err(|e| e.to_string())? {
            FirstMessage::Complete(done) => {
                assert!(messages.next().is_none());
                Ok(done)
            }
            FirstMessage::Pending(mut pending) => {
                for part in messages {
                    assert!(!pending.is_complete());
                    pending.push(part).map_err(|e| e.to_string())?;
                }
                assert!(pending.is_complete());
                pending.finish().map_err(|e| e.to_string())
            }
        }
    }

    fn check(frame: &OwnedFrame, got: &IncomingFrame) {
        assert_eq!(got.kind, frame.kind);
        assert_eq!(got.message_id, frame.message_id);
        assert_eq!(got.handler, frame.handler);
        assert_eq!(got.metadata, frame.metadata);
        assert!(got.payload == frame.payload, "payload differs");
        assert_eq!(got.tensors.len(), frame.tensors.len());
        for ((d, data), (want_d, want)) in got
            .tensors
            .iter()
            .zip(frame.tensors.iter().zip(&frame.tensor_data))
        {
            assert_eq!(d, want_d);
            assert!(data == want, "tensor of {} bytes differs", want.len());
        }
        assert_eq!(got.wire_len, frame.encoded_len() as u64);
    }

    #[test]
    fn small_frames_are_one_message_decoded_by_the_core() {
        let f = frame(10, &[0, 1, 100]);
        let messages = split_frame(f.clone()).unwrap_or_default();
        assert_eq!(messages.len(), 1);
        let got = round_trip(&f, FrameLimits::DEFAULT).unwrap_or_else(|e| panic!("{e}"));
        check(&f, &got);
    }

    #[test]
    fn large_parts_travel_alone_in_wire_order() {
        let f = frame(SEPARATE_MIN, &[3, 1 << 20, SEPARATE_MIN - 1, 8 << 20, 0]);
        let messages = split_frame(f.clone()).unwrap_or_default();
        let lens: Vec<usize> = messages.iter().map(Vec::len).collect();
        assert_eq!(lens.get(1..), Some(&[SEPARATE_MIN, 1 << 20, 8 << 20][..]));
        let got = round_trip(&f, FrameLimits::DEFAULT).unwrap_or_else(|e| panic!("{e}"));
        check(&f, &got);
    }

    #[test]
    fn large_metadata_stays_in_the_first_message() {
        let mut f = frame(SEPARATE_MIN + 1, &[SEPARATE_MIN]);
        f.metadata = vec![5; 3 * SEPARATE_MIN];
        let messages = split_frame(f.clone()).unwrap_or_default();
        assert_eq!(messages.len(), 3);
        let got = round_trip(&f, FrameLimits::DEFAULT).unwrap_or_else(|e| panic!("{e}"));
        check(&f, &got);
    }

    #[test]
    fn many_small_parts_overflow_the_first_message_into_their_own() {
        // 100 parts just below the zero-copy threshold: about 1.6 MiB of small parts.
        let f = frame(SEPARATE_MIN - 1, &[SEPARATE_MIN - 1; 99]);
        let messages = split_frame(f.clone()).unwrap_or_default();
        let first = messages.first().map_or(0, Vec::len) as u64;
        assert!(first <= first_message_max(&FrameLimits::DEFAULT), "{first}");
        let fit = FIRST_PARTS_MAX as usize / (SEPARATE_MIN - 1);
        assert_eq!(messages.len(), 1 + 100 - fit);
        assert!(messages
            .get(1..)
            .unwrap_or_default()
            .iter()
            .all(|m| m.len() == SEPARATE_MIN - 1));
        let got = round_trip(&f, FrameLimits::DEFAULT).unwrap_or_else(|e| panic!("{e}"));
        check(&f, &got);
    }

    #[test]
    fn a_first_message_is_bounded_by_the_limits_alone() {
        let default = first_message_max(&FrameLimits::DEFAULT);
        assert_eq!(
            default,
            HEADER_LEN as u64 + (64 << 10) * DESCRIPTOR_LEN as u64 + 1024 + (1 << 20) + (1 << 20)
        );
        assert!(default < 4 << 20, "{default}");
        // A handshake: a header and at most 64 KiB of payload.
        assert_eq!(
            first_message_max(&FrameLimits::HANDSHAKE),
            HEADER_LEN as u64 + (64 << 10)
        );
        let gate = ReceiveGate::new(FrameLimits::DEFAULT, "peer");
        assert_eq!(gate.next_limit(), default);
        let text = gate.expecting();
        assert!(text.contains(&format!("at most {default} bytes")), "{text}");
    }

    #[test]
    fn a_huge_part_is_refused_unless_a_checked_header_announced_it() {
        use crate::ibv::connection::ConnectionError;
        use rdzv_core::verbs_ring::{LargeDescriptor, DESCRIPTOR_LEN as LARGE_DESCRIPTOR_LEN};
        let admit_large = |source: &LargeDescriptor, max, descriptor_len| {
            rdzv_core::verbs_ring::admit_large(source, max, descriptor_len)
                .map_err(ConnectionError::from)
        };
        let claim = |len| LargeDescriptor {
            addr: 0x1000,
            len,
            rkey: 7,
        };
        let descriptor_len = LARGE_DESCRIPTOR_LEN as u32;
        let announced = 2 * SEPARATE_MIN as u64;
        let f = frame(2 * SEPARATE_MIN, &[1 << 20]);
        let messages = split_frame(f).unwrap_or_default();
        let mut gate = ReceiveGate::new(FrameLimits::DEFAULT, "peer");

        // Before any header: a zero-copy message claiming 1 TiB is refused on its claim
        // alone (allocating it would abort this test), naming the claim and the limit.
        let first_max = first_message_max(&FrameLimits::DEFAULT);
        let refused = admit_large(&claim(1 << 40), gate.next_limit(), descriptor_len);
        match &refused {
            Err(ConnectionError::BadDescriptor { len, max, .. }) => {
                assert_eq!((*len, *max), (1 << 40, first_max));
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        let text = refused.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            text.contains("1099511627776 bytes") && text.contains(&format!("limit {first_max}")),
            "{text}"
        );

        // The header announces a 32 KiB payload: exactly that is admitted next.
        let first = messages.first().cloned().unwrap_or_default();
        assert!(admit_large(
            &claim(first.len() as u64),
            gate.next_limit(),
            descriptor_len
        )
        .is_ok());
        gate.observe(&first).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(gate.next_limit(), announced);
        assert!(gate
            .expecting()
            .contains(&format!("announced {announced} bytes")));
        let refused = admit_large(&claim(1 << 30), gate.next_limit(), descriptor_len);
        assert!(
            matches!(refused, Err(ConnectionError::BadDescriptor { len, max, .. })
                if len == 1 << 30 && max == announced),
            "{refused:?}"
        );
        let text = refused.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            text.contains("1073741824 bytes") && text.contains("limit 32768"),
            "{text}"
        );
        assert_eq!(
            admit_large(&claim(announced), gate.next_limit(), descriptor_len).ok(),
            Some(announced as usize)
        );
        // A descriptor whose range wraps around the sender's address space.
        let wrapping = LargeDescriptor {
            addr: u64::MAX - 10,
            ..claim(announced)
        };
        assert!(admit_large(&wrapping, gate.next_limit(), descriptor_len).is_err());

        // A part shorter than announced (a ring message needs no admission) is refused
        // when it arrives.
        let mut short = ReceiveGate::new(FrameLimits::DEFAULT, "peer");
        short.observe(&first).unwrap_or_else(|e| panic!("{e}"));
        let e = short.observe(&[0; 100]).err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains("100 bytes") && e.contains("32768 were announced")),
            "{e:?}"
        );

        // The parts as announced, then the next frame's first message again.
        for part in messages.get(1..).unwrap_or_default() {
            assert_eq!(part.len() as u64, gate.next_limit());
            gate.observe(part).unwrap_or_else(|e| panic!("{e}"));
        }
        assert_eq!(gate.next_limit(), first_max);
    }

    #[test]
    fn a_header_claiming_a_part_over_the_limits_admits_nothing() {
        // A first message whose header claims a 64 GiB payload: refused by the core's
        // check of the header, so the part is never admitted.
        let payload = SEPARATE_MIN as u64 + 1;
        let messages = split_frame(frame(SEPARATE_MIN + 1, &[])).unwrap_or_default();
        let mut first = messages.first().cloned().unwrap_or_default();
        let at = first
            .get(..HEADER_LEN)
            .unwrap_or_default()
            .windows(8)
            .position(|w| w == payload.to_le_bytes())
            .unwrap_or_else(|| panic!("no payload length in the header"));
        first.splice(at..at + 8, (64u64 << 30).to_le_bytes());
        let mut gate = ReceiveGate::new(FrameLimits::DEFAULT, "peer");
        let e = gate.observe(&first).err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains("of 68719476736 is over the limit of 1073741824")),
            "{e:?}"
        );
        // Nothing was noted: the next message is bounded as a first message.
        assert_eq!(gate.next_limit(), first_message_max(&FrameLimits::DEFAULT));
    }

    #[test]
    fn limits_apply_to_the_first_message() {
        let f = frame(0, &[1 << 20]);
        let e = round_trip(&f, FrameLimits::HANDSHAKE).unwrap_err();
        assert!(e.starts_with("invalid frame from peer"), "{e}");
    }

    #[test]
    fn wrong_lengths_are_refused() {
        let f = frame(0, &[1 << 20, 1 << 20]);
        let messages = split_frame(f).unwrap_or_default();
        let first = messages.first().cloned().unwrap_or_default();
        // A first message with a byte more or less.
        for bad in [
            [first.as_slice(), &[0]].concat(),
            first[..first.len() - 1].to_vec(),
        ] {
            let e = decode_first(bad, FrameLimits::DEFAULT, "peer").err();
            assert!(
                matches!(
                    e,
                    Some(TransportError::Io { .. } | TransportError::Frame { .. })
                ),
                "{e:?}"
            );
        }
        let Ok(FirstMessage::Pending(mut pending)) =
            decode_first(first.clone(), FrameLimits::DEFAULT, "peer")
        else {
            panic!("expected a pending frame")
        };
        assert!(pending.push(vec![0; 5]).is_err());
        let Ok(FirstMessage::Pending(mut pending)) =
            decode_first(first, FrameLimits::DEFAULT, "peer")
        else {
            panic!("expected a pending frame")
        };
        assert!(pending.push(vec![0; 1 << 20]).is_ok());
        let received = pending.received_len();
        let e = pending.finish().err();
        assert!(
            matches!(e, Some(TransportError::Truncated { have, .. }) if have == received),
            "{e:?}"
        );
        // Garbage and an empty message.
        assert!(decode_first(vec![0; 64], FrameLimits::DEFAULT, "peer").is_err());
        assert!(decode_first(b"RZ".to_vec(), FrameLimits::DEFAULT, "peer").is_err());
        assert!(decode_first(Vec::new(), FrameLimits::DEFAULT, "peer").is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn any_frame_round_trips(
            payload in prop_oneof![0usize..64, SEPARATE_MIN - 2..SEPARATE_MIN + 2],
            tensors in proptest::collection::vec(
                prop_oneof![0usize..40, SEPARATE_MIN - 1..SEPARATE_MIN + 70_000],
                0..5,
            ),
        ) {
            let f = frame(payload, &tensors);
            let got = round_trip(&f, FrameLimits::DEFAULT);
            prop_assert!(got.is_ok(), "{got:?}");
            if let Ok(got) = got {
                check(&f, &got);
            }
        }

        #[test]
        fn arbitrary_first_messages_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut with_header = rdzv_core::rpc::frame::MAGIC.to_vec();
            with_header.extend_from_slice(&bytes);
            for candidate in [bytes, with_header] {
                if let Ok(FirstMessage::Pending(mut p)) =
                    decode_first(candidate, FrameLimits::DEFAULT, "peer")
                {
                    let _ = p.push(vec![0; SEPARATE_MIN]);
                    let _ = p.finish();
                }
            }
        }
    }
}
