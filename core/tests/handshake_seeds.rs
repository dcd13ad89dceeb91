//! The `rpc_frame` fuzz target's handshake seeds (`fuzz/corpus/seeds/rpc_frame/handshake_*`)
//! are today's messages, so that the fuzzer starts from frames the agent really reads:
//! a hello with its nonce, answers with and without the listener's proof, the
//! connector's proof (and its absence), the welcome and a refusal. When the handshake
//! changes, `RDZV_WRITE_SEEDS=1 cargo test -p rdzv-core --test handshake_seeds` rewrites
//! them.

use std::path::PathBuf;

use rdzv_core::negotiate::{answer_brochure, ChannelKind, DeviceDescriptors, Offer, TransportKind};
use rdzv_core::rpc::frame::Handshake;
use rdzv_core::rpc::name::WorkerId;

/// The fuzz target reads its first byte as a mode; 0x10 leaves the stream as it is.
const MODE: u8 = 0x10;

fn offer(shm: &'static str) -> Offer<'static> {
    let mut offer = Offer::new();
    offer.add_transport(TransportKind::Shm, 200, shm).unwrap();
    offer.add_transport(TransportKind::Tcp, 0, "tcp:*").unwrap();
    offer
        .add_channel(ChannelKind::Basic, 0, DeviceDescriptors::cpu("any"))
        .unwrap();
    offer
        .add_channel(ChannelKind::Mpt, 100, DeviceDescriptors::cpu("any"))
        .unwrap();
    offer
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let (connector, listener) = (offer("shm:boot_ns"), offer("shm:boot_ns"));
    let brochure = connector.brochure();
    let answer = answer_brochure(&listener, &brochure).unwrap();
    let messages = [
        (
            "handshake_hello",
            Handshake::Hello {
                name: "worker1",
                id: WorkerId::from_i16(1),
                brochure,
                lanes_token: 0x0123_4567_89ab_cdef,
                challenge: [0xa5; 32],
            },
        ),
        (
            "handshake_answer",
            Handshake::Answer {
                name: "worker0",
                id: WorkerId::from_i16(0),
                answer,
                challenge: [0x5a; 32],
                proof: Some([0x3c; 32]),
            },
        ),
        (
            "handshake_answer_without_proof",
            Handshake::Answer {
                name: "worker0",
                id: WorkerId::from_i16(0),
                answer,
                challenge: [0x01; 32],
                proof: None,
            },
        ),
        (
            "handshake_proof",
            Handshake::Proof {
                proof: Some([0xc3; 32]),
            },
        ),
        ("handshake_proof_none", Handshake::Proof { proof: None }),
        ("handshake_welcome", Handshake::Welcome),
        (
            "handshake_refused",
            Handshake::Refused {
                reason: "RPC peer failed authentication",
            },
        ),
    ];
    messages
        .into_iter()
        .map(|(name, message)| {
            let mut bytes = vec![MODE];
            message.encode_to_vec(&mut bytes).unwrap();
            (name, bytes)
        })
        .collect()
}

#[test]
fn the_handshake_seeds_are_current() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/seeds/rpc_frame");
    let write = std::env::var_os("RDZV_WRITE_SEEDS").is_some();
    for (name, bytes) in seeds() {
        rdzv_core::fuzzing::rpc_frame(&bytes);
        let path = dir.join(name);
        if write {
            std::fs::write(&path, &bytes).unwrap();
            continue;
        }
        let held = std::fs::read(&path).unwrap_or_default();
        assert!(
            held == bytes,
            "{} is not today's {name}: run RDZV_WRITE_SEEDS=1 cargo test -p rdzv-core --test \
             handshake_seeds",
            path.display()
        );
    }
}
