//! Replays the committed fuzz corpus (`fuzz/corpus/seeds/channel_descriptors/`) through
//! the checks the cargo-fuzz target runs (`rdzv_uring::fuzzing`), and throws random bytes
//! and mutated real descriptors at them with proptest, so the properties hold in every
//! `cargo test`.

use std::path::PathBuf;

use proptest::prelude::*;
use rdzv_uring::channel::cma::CmaDescriptor;
use rdzv_uring::channel::mpt::{LaneHello, MptDescriptor, StripeHeader};
use rdzv_uring::channel::xth::XthDescriptor;
use rdzv_uring::channel::{ProcessIdentity, TransferAck};
use rdzv_uring::fuzzing::channel_descriptors;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/seeds/channel_descriptors")
}

/// Real encodings: what the seeds were made from.
fn samples() -> Vec<Vec<u8>> {
    let process = ProcessIdentity::current().expect("this process's identity");
    vec![
        TransferAck { transfer_id: 7 }.encode().to_vec(),
        XthDescriptor {
            process,
            length: 1 << 20,
            transfer_id: 3,
        }
        .encode()
        .to_vec(),
        CmaDescriptor {
            process,
            address: 0x7f00_0000_1000,
            length: 64 << 20,
            transfer_id: 9,
        }
        .encode()
        .to_vec(),
        StripeHeader {
            transfer_id: 4,
            offset: 1 << 20,
            len: 1 << 20,
        }
        .encode()
        .to_vec(),
        MptDescriptor { transfer_id: 11 }.encode().to_vec(),
        LaneHello {
            token: 0x5eed_0000_0000_0001,
            index: 2,
            count: 4,
        }
        .encode()
        .to_vec(),
    ]
}

#[test]
fn every_seed_passes() {
    let entries = std::fs::read_dir(corpus_dir()).expect("corpus directory");
    let mut count = 0;
    for entry in entries {
        let path = entry.expect("entry").path();
        channel_descriptors(&std::fs::read(&path).expect("seed"));
        count += 1;
    }
    assert!(
        count >= 3,
        "the channel_descriptors corpus has {count} seeds"
    );
}

#[test]
fn real_descriptors_pass() {
    for sample in samples() {
        channel_descriptors(&sample);
    }
}

/// Regenerates the seeds from the real encoders: `cargo test -p rdzv-uring --test
/// fuzz_corpus -- --ignored write_seeds`.
#[test]
#[ignore = "writes fuzz/corpus/seeds/channel_descriptors"]
fn write_seeds() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).expect("mkdir");
    let names = [
        "ack",
        "xth",
        "cma",
        "mpt",
        "mpt_descriptor",
        "mpt_lane_hello",
    ];
    for (name, bytes) in names.into_iter().zip(samples()) {
        std::fs::write(dir.join(name), bytes).expect("write seed");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(data in proptest::collection::vec(any::<u8>(), 0..128)) {
        channel_descriptors(&data);
    }

    #[test]
    fn mutated_descriptors(which in 0usize..6, at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut sample = samples().swap_remove(which);
        let i = at.index(sample.len());
        sample[i] = byte;
        channel_descriptors(&sample);
    }
}
