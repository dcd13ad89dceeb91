//! Replays the committed fuzz corpus of the `--metrics` HTTP endpoint
//! (`fuzz/corpus/seeds/metrics_http/`) through the checks the cargo-fuzz target runs
//! (`rdzv_uring::fuzzing`), and throws random and mutated requests at them with
//! proptest, so the properties hold in every `cargo test`.

use std::path::PathBuf;

use proptest::prelude::*;
use rdzv_uring::fuzzing::metrics_http;

fn seeds() -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/seeds/metrics_http");
    let mut seeds = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        seeds.push(std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    }
    seeds
}

#[test]
fn every_metrics_http_seed_passes() {
    let seeds = seeds();
    assert!(
        seeds.len() >= 5,
        "the metrics_http corpus has {} seeds",
        seeds.len()
    );
    for seed in &seeds {
        metrics_http(seed);
    }
}

#[test]
fn heads_at_and_around_the_size_limit_pass() {
    for len in [8 * 1024 - 5, 8 * 1024 - 1, 8 * 1024, 8 * 1024 + 1, 20_000] {
        let mut head = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        head.resize(len, b'a');
        metrics_http(&head);
        head.truncate(len - 4);
        head.extend_from_slice(b"\r\n\r\n");
        metrics_http(&head);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_pass(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        metrics_http(&data);
    }

    #[test]
    fn mutated_seeds_pass(
        which in any::<prop::sample::Index>(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let seeds = seeds();
        let mut seed = seeds[which.index(seeds.len())].clone();
        for (at, byte) in edits {
            let i = at.index(seed.len().max(1));
            if let Some(b) = seed.get_mut(i) {
                *b = byte;
            }
        }
        seed.truncate(cut.index(seed.len() + 1));
        metrics_http(&seed);
    }
}
