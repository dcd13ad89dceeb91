#![no_main]
//! cargo-fuzz target; the checks live in `rdzv_uring::fuzzing::metrics_http` so that the
//! corpus replay test (`uring/tests/fuzz_corpus.rs`) runs exactly the same assertions.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| rdzv_uring::fuzzing::metrics_http(data));
