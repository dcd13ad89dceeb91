//! The checks behind this crate's cargo-fuzz target (`fuzz/fuzz_targets/ibv_wire.rs`),
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
