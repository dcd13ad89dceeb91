//! The checks behind this crate's cargo-fuzz targets (`fuzz/fuzz_targets/ibv_wire.rs`,
//! `cuda_wire.rs`),
//! public so that `rdma/tests/fuzz_corpus.rs` replays the committed seeds and random
//! inputs through exactly the same assertions in every `cargo test`.
//!
//! What is checked: the parsers of bytes a peer sends (the RDMA connection record, the
//! large-message descriptor, the ring immediate) never panic, and whatever they accept
//! survives an encode/decode round trip unchanged. Nothing here touches a device.

use crate::ibv::wire::{ConnectionInfo, LargeDescriptor, MessageImm, DESCRIPTOR_LEN, ENCODED_LEN};

/// Feeds `data` to every peer-facing parser of the verbs wire format.
///
/// # Panics
/// When a parser breaks its contract (that is the finding).
pub fn ibv_wire(data: &[u8]) {
    if let Some(record) = data
        .get(..ENCODED_LEN)
        .and_then(|b| <&[u8; ENCODED_LEN]>::try_from(b).ok())
    {
        if let Ok(info) = ConnectionInfo::decode(record) {
            let again = ConnectionInfo::decode(&info.encode());
            assert_eq!(again.ok(), Some(info), "a decoded record must round-trip");
        }
    }
    match LargeDescriptor::decode(data) {
        Some(descriptor) => {
            assert_eq!(data.len(), DESCRIPTOR_LEN);
            assert_eq!(descriptor.encode().as_slice(), data);
        }
        None => assert_ne!(
            data.len(),
            DESCRIPTOR_LEN,
            "a descriptor of the right length decodes"
        ),
    }
    if let Some(word) = data.get(..4).and_then(|b| <[u8; 4]>::try_from(b).ok()) {
        let imm = u32::from_be_bytes(word);
        let message = MessageImm::decode(imm);
        assert_eq!(message.encode(), imm, "every immediate round-trips");
    }
}

/// Feeds `data` to the parsers of the CUDA channels' control messages (`cuda_ipc`
/// messages, the `cuda_basic` transfer header).
///
/// # Panics
/// When a parser breaks its contract (that is the finding).
pub fn cuda_wire(data: &[u8]) {
    use crate::cuda::ipc::IpcMessage;
    use crate::cuda::staging::{decode_basic_header, encode_basic_header, BASIC_HEADER_LEN};

    if let Ok(Some((message, used))) = IpcMessage::decode(data) {
        assert!(
            used <= data.len(),
            "consumed {used} of {} bytes",
            data.len()
        );
        let encoded = message.encode();
        assert_eq!(
            encoded.len(),
            used,
            "a message re-encodes to what was consumed"
        );
        match IpcMessage::decode(&encoded) {
            Ok(Some((again, n))) => {
                assert_eq!(again, message);
                assert_eq!(n, encoded.len());
            }
            other => panic!("a re-encoded message does not decode: {other:?}"),
        }
    }
    if let Some(header) = data
        .get(..BASIC_HEADER_LEN)
        .and_then(|b| <&[u8; BASIC_HEADER_LEN]>::try_from(b).ok())
    {
        if let Ok(total) = decode_basic_header(header) {
            assert_eq!(&encode_basic_header(total), header);
        }
    }
}
