//! Replays the committed fuzz corpus (`fuzz/corpus/seeds/<target>/`) through the same
//! checks the cargo-fuzz targets run, and throws random bytes at them with proptest.
//! This keeps the fuzz properties enforced in `cargo test`, where cargo-fuzz (nightly
//! sanitizers) is not available.

use std::path::PathBuf;

use proptest::prelude::*;
use rdzv_core::fuzzing;

type Check = fn(&[u8]);

const TARGETS: [(&str, Check); 6] = [
    ("url", fuzzing::url),
    ("query", fuzzing::query),
    ("codec_request", fuzzing::codec_request),
    ("codec_response", fuzzing::codec_response),
    ("file_log", fuzzing::file_log),
    ("rpc_frame", fuzzing::rpc_frame),
];

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus/seeds")
        .join(target)
}

#[test]
fn every_seed_passes_its_target() {
    for (target, check) in TARGETS {
        let dir = corpus_dir(target);
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot read corpus {}: {e}", dir.display()));
        let mut count = 0;
        for entry in entries {
            let path = entry.expect("corpus entry").path();
            let data = std::fs::read(&path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            check(&data);
            count += 1;
        }
        assert!(
            count > 0,
            "corpus for {target} at {} is empty",
            dir.display()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_break_a_target(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        for (_, check) in TARGETS {
            check(&data);
        }
    }
}
