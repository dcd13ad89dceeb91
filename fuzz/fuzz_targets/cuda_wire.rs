#![no_main]
//! cargo-fuzz target; the checks live in `rdzv_rdma::fuzzing::cuda_wire` so that the
//! corpus replay test (`rdma/tests/fuzz_corpus.rs`) runs exactly the same assertions.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| rdzv_rdma::fuzzing::cuda_wire(data));
