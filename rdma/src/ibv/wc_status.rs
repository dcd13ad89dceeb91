//! Names of work-completion statuses (`enum ibv_wc_status`), for error messages.
//!
//! A failed completion is reported with its verb and the status constant's name (for
//! example `IBV_WC_RETRY_EXC_ERR`), the text users search for. The numbers are the verbs
//! ABI's (rdma-core `verbs.h`); this module only names them.

/// The `IBV_WC_*` name of a work-completion status, or `None` for a value this table does
/// not know (printed as a number by callers).
pub fn wc_status_name(status: u32) -> Option<&'static str> {
    Some(match status {
        0 => "IBV_WC_SUCCESS",
        1 => "IBV_WC_LOC_LEN_ERR",
        2 => "IBV_WC_LOC_QP_OP_ERR",
        3 => "IBV_WC_LOC_EEC_OP_ERR",
        4 => "IBV_WC_LOC_PROT_ERR",
        5 => "IBV_WC_WR_FLUSH_ERR",
        6 => "IBV_WC_MW_BIND_ERR",
        7 => "IBV_WC_BAD_RESP_ERR",
        8 => "IBV_WC_LOC_ACCESS_ERR",
        9 => "IBV_WC_REM_INV_REQ_ERR",
        10 => "IBV_WC_REM_ACCESS_ERR",
        11 => "IBV_WC_REM_OP_ERR",
        12 => "IBV_WC_RETRY_EXC_ERR",
        13 => "IBV_WC_RNR_RETRY_EXC_ERR",
        14 => "IBV_WC_LOC_RDD_VIOL_ERR",
        15 => "IBV_WC_REM_INV_RD_REQ_ERR",
        16 => "IBV_WC_REM_ABORT_ERR",
        17 => "IBV_WC_INV_EECN_ERR",
        18 => "IBV_WC_INV_EEC_STATE_ERR",
        19 => "IBV_WC_FATAL_ERR",
        20 => "IBV_WC_RESP_TIMEOUT_ERR",
        21 => "IBV_WC_GENERAL_ERR",
        22 => "IBV_WC_TM_ERR",
        23 => "IBV_WC_TM_RNDV_INCOMPLETE",
        _ => return None,
    })
}

/// `IBV_WC_WR_FLUSH_ERR`: the queue pair entered the error state with the request pending.
pub const WC_WR_FLUSH_ERR: u32 = 5;
/// `IBV_WC_RETRY_EXC_ERR`: the transport retry counter was exceeded (peer unreachable or
/// its queue pair is gone).
pub const WC_RETRY_EXC_ERR: u32 = 12;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_the_abi() {
        assert_eq!(wc_status_name(0), Some("IBV_WC_SUCCESS"));
        assert_eq!(wc_status_name(WC_WR_FLUSH_ERR), Some("IBV_WC_WR_FLUSH_ERR"));
        assert_eq!(
            wc_status_name(WC_RETRY_EXC_ERR),
            Some("IBV_WC_RETRY_EXC_ERR")
        );
        assert_eq!(wc_status_name(13), Some("IBV_WC_RNR_RETRY_EXC_ERR"));
        assert_eq!(wc_status_name(99), None);
    }
}
