//! Replays the committed fuzz corpora (`fuzz/corpus/seeds/ibv_wire/`, `cuda_wire/`)
//! through the checks the cargo-fuzz targets run (`rdzv_rdma::fuzzing`), and throws
//! random bytes and mutated real records at them with proptest, so the properties hold in
//! every `cargo test`. No verbs device or GPU is needed.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use proptest::prelude::*;
use rdzv_rdma::cuda::ipc::{IpcMessage, OutboxInfo, HANDLE_LEN};
use rdzv_rdma::cuda::staging::encode_basic_header;
use rdzv_rdma::fuzzing::{cuda_wire, ibv_wire};
use rdzv_rdma::ibv::topology::{Gid, Mtu};
use rdzv_rdma::ibv::wire::{ConnectionInfo, LargeDescriptor, MessageImm};

fn corpus_dir() -> PathBuf {
    seeds("ibv_wire")
}

fn seeds(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus/seeds")
        .join(target)
}

/// Real `cuda_ipc` messages and a `cuda_basic` header: what the `cuda_wire` seeds were
/// made from.
fn cuda_samples() -> Vec<Vec<u8>> {
    let outbox = OutboxInfo {
        pid: 4242,
        outbox_id: 1,
        slot_count: 2,
        slot_len: 8 << 20,
        mem_handle: [7; HANDLE_LEN],
        event_handles: vec![[1; HANDLE_LEN], [2; HANDLE_LEN]],
    };
    vec![
        IpcMessage::Header { total: 64 << 20 }.encode(),
        IpcMessage::Chunk {
            slot: 1,
            offset: 8 << 20,
            len: 8 << 20,
            outbox: Some(Box::new(outbox)),
        }
        .encode(),
        IpcMessage::Chunk {
            slot: 0,
            offset: 0,
            len: 1,
            outbox: None,
        }
        .encode(),
        IpcMessage::Ack { slot: 1 }.encode(),
        encode_basic_header(1 << 20).to_vec(),
    ]
}

#[test]
fn every_cuda_seed_passes() {
    let entries = std::fs::read_dir(seeds("cuda_wire")).expect("corpus directory");
    let mut count = 0;
    for entry in entries {
        cuda_wire(&std::fs::read(entry.expect("entry").path()).expect("seed"));
        count += 1;
    }
    assert!(count >= 5, "the cuda_wire corpus has {count} seeds");
    for sample in cuda_samples() {
        cuda_wire(&sample);
    }
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
#[ignore = "writes fuzz/corpus/seeds/ibv_wire and cuda_wire"]
fn write_seeds() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).expect("mkdir");
    for (name, bytes) in ["record", "descriptor", "immediate"]
        .into_iter()
        .zip(samples())
    {
        std::fs::write(dir.join(name), bytes).expect("write seed");
    }
    let dir = seeds("cuda_wire");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let names = ["header", "chunk_outbox", "chunk", "ack", "basic_header"];
    for (name, bytes) in names.into_iter().zip(cuda_samples()) {
        std::fs::write(dir.join(name), bytes).expect("write seed");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(data in proptest::collection::vec(any::<u8>(), 0..96)) {
        ibv_wire(&data);
        cuda_wire(&data);
    }

    #[test]
    fn mutated_cuda_messages(which in 0usize..5, at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut sample = cuda_samples().swap_remove(which);
        let i = at.index(sample.len());
        sample[i] = byte;
        cuda_wire(&sample);
    }

    #[test]
    fn mutated_records(which in 0usize..3, at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut sample = samples().swap_remove(which);
        let i = at.index(sample.len());
        sample[i] = byte;
        ibv_wire(&sample);
    }
}
