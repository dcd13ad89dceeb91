//! Shared by the tests that need a verbs device: decides whether to run or skip.

use rdzv_rdma::ibv::{self, IbvSelection, IbvViability};

/// Set by `rdma/softroce/run` inside the VM: a missing device is then a failure.
pub(crate) const ENV_SOFTROCE: &str = "RDZV_SOFTROCE";

/// Whether this process runs inside the Soft-RoCE test VM.
pub(crate) fn in_softroce_vm() -> bool {
    std::env::var_os(ENV_SOFTROCE).is_some_and(|v| v == "1")
}

/// The probed device, or `None` after printing why `test` is skipped. Panics (fails the
/// test) when the device is missing inside the Soft-RoCE VM.
pub(crate) fn selection_or_skip(test: &str) -> Option<IbvSelection> {
    match ibv::probe_env() {
        IbvViability::Viable(selection) => Some(selection),
        not_viable => {
            assert!(
                !in_softroce_vm(),
                "{ENV_SOFTROCE}=1 but RDMA is {not_viable}"
            );
            println!(
                "SKIPPED {test}: RDMA is {not_viable} (run rdma/softroce/run for a verbs device)"
            );
            None
        }
    }
}
