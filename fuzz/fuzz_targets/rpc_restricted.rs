#![no_main]
//! cargo-fuzz target; the checks live in `rdzv_core::fuzzing::rpc_restricted` so that the
//! corpus replay test (`core/tests/fuzz_corpus.rs`) runs exactly the same assertions.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| rdzv_core::fuzzing::rpc_restricted(data));
