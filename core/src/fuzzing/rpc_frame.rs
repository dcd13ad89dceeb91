//! Fuzz checks for [`crate::rpc::frame`]: the RPC frame decoder and the handshake inside
//! it, fed arbitrary bytes.
//!
//! The first byte picks the mode: odd, the rest of the input follows a valid magic and
//! version (so the fuzzer reaches the fields behind them); even, the rest is taken as it
//! is. For every input: no panic; `Partial` asks for at least one byte; a complete frame
//! used at most the bytes given, re-encodes to exactly those bytes and decodes the same
//! from just those bytes; its handshake, if it is one, decodes without panicking and
//! re-encodes to a frame that decodes to the same message; decoding in two pieces split
//! at a point the data chooses (with the resuming decoder) gives what decoding it whole
//! gives, and the first piece never contradicts the whole; tighter limits never accept
//! something else. Every tensor's data-section entry (inline bytes or channel
//! descriptor) has the length its descriptor announces, and an ack is a bare header.

use super::{check_display, split_point};
use alloc::vec::Vec;

use crate::rpc::frame::{
    decode_frame, decode_handshake, Decoded, Frame, FrameDecoder, FrameError, FrameKind,
    FrameLimits, MAGIC, VERSION,
};

/// Decodes `data` (after the mode byte) as the start of an RPC pipe's byte stream.
pub fn rpc_frame(data: &[u8]) {
    // Membership payloads (what a dynamic group's peers send to internal handlers): an
    // accepted announcement re-encodes and decodes to itself.
    if let Ok(announcement) = crate::rpc::membership::JoinAnnouncement::decode(data) {
        let again = announcement
            .encode()
            .map_err(crate::rpc::membership::MembershipError::Malformed)
            .and_then(|bytes| crate::rpc::membership::JoinAnnouncement::decode(&bytes));
        assert_eq!(again.as_ref(), Ok(&announcement));
    }
    let _ = crate::rpc::membership::decode_leave(data);
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut stream = Vec::with_capacity(rest.len() + 5);
    if mode & 1 == 1 {
        stream.extend_from_slice(&MAGIC);
        stream.push(VERSION);
    }
    stream.extend_from_slice(rest);
    let data = stream.as_slice();

    let limits = FrameLimits::DEFAULT;
    let whole = decode_frame(data, &limits);
    check(data, &whole);

    let split = split_point(data);
    let head = data.get(..split).unwrap_or(data);
    let mut decoder = FrameDecoder::new(limits);
    let first = decoder.decode(head);
    assert_eq!(
        first,
        decode_frame(head, &limits),
        "resuming decoder, first piece"
    );
    check_prefix(&first, &whole, split, data.len());
    let second = decoder.decode(data);
    assert_eq!(second, whole, "resuming decoder after a split at {split}");

    let tight = tight_limits(mode);
    let strict = decode_frame(data, &tight);
    check(data, &strict);
    if let Ok(Decoded::Complete(..)) = strict {
        assert_eq!(strict, whole, "tight limits accepted a different frame");
    }
}

fn check(data: &[u8], result: &Result<Decoded<Frame<'_>>, FrameError>) {
    match result {
        Ok(Decoded::Partial(needed)) => assert!(*needed >= 1),
        Ok(Decoded::Complete(frame, consumed)) => {
            let consumed = *consumed;
            assert!(consumed >= crate::rpc::frame::HEADER_LEN && consumed <= data.len());
            let bytes = data.get(..consumed).unwrap_or(data);
            assert_eq!(frame.as_bytes(), bytes);
            assert_eq!(frame.tensors().count(), frame.tensor_count() as usize);
            // Every data-section entry is as long as its descriptor says, and of the
            // kind its channel says.
            let mut entries = 0usize;
            for (tensor, entry) in frame.tensors_with_data() {
                assert_eq!(entry.bytes().len() as u64, tensor.data_len());
                assert_eq!(entry.inline().is_some(), tensor.is_inline());
                entries += entry.bytes().len();
            }
            assert_eq!(entries, frame.data_section().len());
            if frame.kind() == FrameKind::Ack {
                assert_eq!(consumed, crate::rpc::frame::HEADER_LEN);
            }

            let (mut tensors, mut inline) = (Vec::new(), Vec::new());
            let outgoing = frame.to_outgoing(&mut tensors, &mut inline);
            assert_eq!(outgoing.encoded_len(), consumed);
            let mut out = Vec::new();
            assert_eq!(outgoing.encode_to_vec(&mut out), Ok(()));
            assert_eq!(out, bytes, "re-encoding is not canonical");
            let mut exact = alloc::vec![0u8; consumed];
            assert_eq!(outgoing.encode(&mut exact), Ok(consumed));
            assert_eq!(exact, bytes);

            let again = decode_frame(bytes, &FrameLimits::UNLIMITED);
            assert_eq!(again, Ok(Decoded::Complete(*frame, consumed)));

            if frame.kind() == FrameKind::Handshake {
                match decode_handshake(frame) {
                    Ok(message) => {
                        let mut encoded = Vec::new();
                        assert!(message.encode_to_vec(&mut encoded).is_ok());
                        let reread = decode_frame(&encoded, &FrameLimits::HANDSHAKE);
                        let Ok(Decoded::Complete(reread, _)) = reread else {
                            panic!("a re-encoded handshake does not decode: {reread:?}");
                        };
                        assert_eq!(decode_handshake(&reread), Ok(message));
                    }
                    Err(error) => check_display(&error),
                }
            }
        }
        Err(error) => check_display(error),
    }
}

/// A prefix's result never contradicts the whole's: a complete frame or an error is the
/// same, and a `Partial` hint never asks beyond the whole frame.
fn check_prefix(
    prefix: &Result<Decoded<Frame<'_>>, FrameError>,
    whole: &Result<Decoded<Frame<'_>>, FrameError>,
    split: usize,
    len_whole: usize,
) {
    match prefix {
        Ok(Decoded::Complete(..)) | Err(_) => assert_eq!(prefix, whole, "split at {split}"),
        Ok(Decoded::Partial(needed)) => match whole {
            Ok(Decoded::Complete(_, consumed)) => {
                assert!(
                    split + needed <= *consumed,
                    "hint {needed} at {split} overshoots"
                )
            }
            Ok(Decoded::Partial(more)) => assert!(split + needed <= len_whole + more),
            Err(_) => {}
        },
    }
}

/// Small limits chosen by the mode byte, so that limit errors are reached often.
fn tight_limits(mode: u8) -> FrameLimits {
    let pick = |shift: u8| u64::from((mode >> shift) & 3);
    FrameLimits::DEFAULT
        .with_max_payload(pick(1) * 8)
        .with_max_tensors((pick(3) as u32).min(2))
        .with_max_tensor_bytes(pick(5) * 4)
        .with_max_inline_bytes(pick(6) * 4)
        .with_max_channel_descriptor((pick(4) * 40) as u32)
}
