//! Tests that need a real verbs device (Soft-RoCE in the `rdma/softroce/run` VM).
//!
//! On a host without verbs (ENOSYS, no libibverbs, no active port) each test prints that
//! it is skipped and why, and passes. With `RDZV_SOFTROCE=1` (set inside the VM) a missing
//! device is a failure instead.

mod verbs_env;

use rdzv_rdma::ibv::{self, IbvConfig};

#[test]
fn probe_selects_rxe_with_its_ipv4_roce_v2_gid() {
    let Some(selection) = verbs_env::selection_or_skip("probe_selects_rxe") else {
        return;
    };
    println!("selected: {selection}");
    if verbs_env::in_softroce_vm() {
        assert_eq!(selection.device, "rxe0");
        assert_eq!(
            selection.gid.ipv4_mapped(),
            Some(std::net::Ipv4Addr::new(10, 0, 2, 15)),
            "{selection}"
        );
    }
    let again = ibv::probe(&IbvConfig {
        device: Some(selection.device.clone()),
        port: Some(selection.port),
        gid_index: Some(selection.gid_index),
    });
    assert!(again.is_viable(), "{again}");
}
