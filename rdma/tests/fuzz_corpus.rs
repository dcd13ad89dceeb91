//! Replays the committed fuzz corpus (`fuzz/corpus/seeds/ibv_wire/`) through the checks
//! the cargo-fuzz target runs (`rdzv_rdma::fuzzing`), and throws random bytes and mutated
//! real records at them with proptest, so the properties hold in every `cargo test`. No verbs device or GPU is needed.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use proptest::prelude::*;
use rdzv_rdma::fuzzing::ibv_wire;
use rdzv_rdma::ibv::topology::{Gid, Mtu};
use rdzv_rdma::ibv::wire::{ConnectionInfo, LargeDescriptor, MessageImm};

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/seeds/ibv_wire")
}

/// Real encodings: what the seeds were made from.
fn samples() -> Vec<Vec<u8>> {
    let record = ConnectionInfo {
        lid: 0,
        gid: Gid::from(Ipv4Addr::new(10, 0, 2, 15)),
        qpn: 0x11,
        psn: 0xabcdef,
        mtu: Mtu::B1024,
        ring_addr: 0x7f00_1234_5000,
        ring_len: 1 << 16,
        ring_rkey: 0xdead_beef,
        recv_slots: 64,
    };
    let descriptor = LargeDescriptor {
        addr: 0x7f00_0000_0000,
        len: 64 << 20,
        rkey: 0x1234,
    };
    vec![
        record.encode().to_vec(),
        descriptor.encode().to_vec(),
        MessageImm::Descriptor(20).encode().to_be_bytes().to_vec(),
    ]
}

#[test]
fn every_seed_passes() {
    let entries = std::fs::read_dir(corpus_dir()).expect("corpus directory");
    let mut count = 0;
    for entry in entries {
        let path = entry.expect("entry").path();
        ibv_wire(&std::fs::read(&path).expect("seed"));
        count += 1;
    }
    assert!(count >= 3, "the ibv_wire corpus has {count} seeds");
}

#[test]
fn real_records_pass() {
    for sample in samples() {
        ibv_wire(&sample);
    }
}

/// Regenerates the seeds from the real encoders: `cargo test -p rdzv-rdma --test
/// fuzz_corpus -- --ignored write_seeds`.
#[test]
#[ignore = "writes fuzz/corpus/seeds/ibv_wire"]
fn write_seeds() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).expect("mkdir");
    for (name, bytes) in ["record", "descriptor", "immediate"]
        .into_iter()
        .zip(samples())
    {
        std::fs::write(dir.join(name), bytes).expect("write seed");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(data in proptest::collection::vec(any::<u8>(), 0..96)) {
        ibv_wire(&data);
    }

    #[test]
    fn mutated_records(which in 0usize..3, at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut sample = samples().swap_remove(which);
        let i = at.index(sample.len());
        sample[i] = byte;
        ibv_wire(&sample);
    }
}
