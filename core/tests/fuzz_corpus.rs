//! Replays the committed fuzz corpus (`fuzz/corpus/seeds/<target>/`) through the same
//! checks the cargo-fuzz targets run, and throws random bytes at them with proptest.
//! This keeps the fuzz properties enforced in `cargo test`, where cargo-fuzz (nightly
//! sanitizers) is not available.

use std::path::PathBuf;

use proptest::prelude::*;
use rdzv_core::fuzzing;

type Check = fn(&[u8]);

const TARGETS: [(&str, Check); 11] = [
    ("url", fuzzing::url),
    ("query", fuzzing::query),
    ("codec_request", fuzzing::codec_request),
    ("codec_response", fuzzing::codec_response),
    ("file_log", fuzzing::file_log),
    ("rpc_frame", fuzzing::rpc_frame),
    ("channel_descriptors", fuzzing::channel_descriptors),
    ("elastic", fuzzing::elastic),
    ("access", fuzzing::access),
    ("serve_step", fuzzing::serve_step),
    ("rpc_restricted", fuzzing::rpc_restricted),
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

/// Every target's seeds, read once.
fn seeds() -> &'static [Vec<Vec<u8>>] {
    static SEEDS: std::sync::OnceLock<Vec<Vec<Vec<u8>>>> = std::sync::OnceLock::new();
    SEEDS.get_or_init(|| {
        TARGETS
            .iter()
            .map(|(target, _)| {
                let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir(target))
                    .map(|dir| dir.filter_map(|e| e.ok().map(|e| e.path())).collect())
                    .unwrap_or_default();
                files.sort();
                files
                    .iter()
                    .filter_map(|path| std::fs::read(path).ok())
                    .collect()
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Real encodings with one byte changed: close to valid, where decoders are most
    /// likely to slip.
    #[test]
    fn mutated_seeds_never_break_their_target(
        which in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        for ((_, check), seeds) in TARGETS.iter().zip(seeds()) {
            if seeds.is_empty() {
                continue;
            }
            let mut seed = seeds[which.index(seeds.len())].clone();
            if !seed.is_empty() {
                let i = at.index(seed.len());
                seed[i] = byte;
            }
            check(&seed);
        }
    }

    #[test]
    fn random_bytes_never_break_a_target(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        for (_, check) in TARGETS {
            check(&data);
        }
    }
}
