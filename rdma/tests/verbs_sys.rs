//! Checks `ibv::sys`' hand-written layouts and function table against the real libibverbs:
//! every entry point is called at least once on a loopback pair of RC queue pairs (run by
//! `rdma/softroce/run` in the Soft-RoCE VM). A wrong offset shows up here as a wrong
//! attribute, a rejected `ibv_modify_qp`, or a completion with the wrong id, status,
//! opcode or immediate.
//!
//! On a host without verbs the test prints why it is skipped.

mod verbs_env;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv_rdma::ibv::sys::{
    self, AccessFlags, CompChannel, CompletionQueue, DeviceList, GlobalRoute, HostRegion, Local,
    QpCaps, QueuePair, RegisteredVec, RtrAttr, RtsAttr, SendOp, SendRequest, SharedRegistration,
    WorkCompletion,
};
use rdzv_rdma::ibv::topology::{GidType, Mtu};
use rdzv_rdma::ibv::wc_status::{wc_status_name, WC_WR_FLUSH_ERR};
use rdzv_rdma::ibv::IbvSelection;

const BOUND: Duration = Duration::from_secs(20);
/// `IBV_PORT_ACTIVE`.
const PORT_ACTIVE: u32 = 4;
/// `IBV_WC_REM_ACCESS_ERR`.
const WC_REM_ACCESS_ERR: u32 = 10;

/// Takes completions from `cq` until `want` arrived (or fails after [`BOUND`]).
fn completions(cq: &CompletionQueue, want: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + BOUND;
    let mut got = Vec::new();
    let mut batch = [WorkCompletion::default(); 8];
    while got.len() < want {
        let n = cq.poll(&mut batch).expect("ibv_poll_cq");
        got.extend_from_slice(&batch[..n]);
        assert!(
            Instant::now() < deadline,
            "only {} of {want} completions within {BOUND:?}: {got:?}",
            got.len()
        );
    }
    got
}

fn by_id(wcs: &[WorkCompletion], wr_id: u64) -> WorkCompletion {
    *wcs.iter()
        .find(|wc| wc.wr_id() == wr_id)
        .unwrap_or_else(|| panic!("no completion for work request {wr_id}: {wcs:?}"))
}

fn assert_success(wc: &WorkCompletion) {
    assert_eq!(
        wc.status(),
        0,
        "work request {} failed with {:?}",
        wc.wr_id(),
        wc_status_name(wc.status())
    );
}

fn mtu_raw(mtu: Option<Mtu>) -> u32 {
    match mtu.unwrap_or(Mtu::B1024) {
        Mtu::B256 => 1,
        Mtu::B512 => 2,
        Mtu::B1024 => 3,
        Mtu::B2048 => 4,
        Mtu::B4096 => 5,
    }
}

/// Moves `qp` through RTR and RTS towards `peer_qpn` on the selection's own port and GID.
fn connect(qp: &QueuePair, peer_qpn: u32, sel: &IbvSelection) {
    let grh = (!sel.gid.is_zero()).then(|| GlobalRoute {
        dgid: sel.gid.0,
        sgid_index: u8::try_from(sel.gid_index).expect("GID index fits a byte"),
        hop_limit: 64,
    });
    qp.to_rtr(&RtrAttr {
        path_mtu: mtu_raw(sel.active_mtu),
        dest_qp_num: peer_qpn,
        rq_psn: 0x1234,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        port: sel.port,
        dlid: sel.lid,
        grh,
    })
    .expect("ibv_modify_qp(RTR)");
    qp.to_rts(&RtsAttr {
        sq_psn: 0x1234,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
    })
    .expect("ibv_modify_qp(RTS)");
}

fn queue_pair(pd: &Arc<sys::ProtectionDomain>, cq: &Arc<CompletionQueue>) -> QueuePair {
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    pd.create_rc_qp(cq, caps)
        .or_else(|_| {
            pd.create_rc_qp(
                cq,
                QpCaps {
                    max_inline_data: 0,
                    ..caps
                },
            )
        })
        .expect("ibv_create_qp")
}

/// Waits for an event on `channel` (after arming), takes and acknowledges it.
fn wait_for_event(channel: &CompChannel, cq: &CompletionQueue) {
    let fd = sys::comp_channel_fd(channel);
    let deadline = Instant::now() + BOUND;
    loop {
        let ready = sys::poll_readable(&[fd], 100).expect("poll on the completion channel");
        if ready.is_some_and(|r| r[0]) && channel.get_event() {
            cq.ack_events(1);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no completion event within {BOUND:?}"
        );
    }
}

#[test]
fn every_entry_point_on_a_loopback_pair() {
    let Some(sel) = verbs_env::selection_or_skip("every_entry_point_on_a_loopback_pair") else {
        return;
    };
    sys::check_library().expect("libibverbs loads with every entry point");

    // Devices, ports and GIDs.
    let list = DeviceList::new().expect("ibv_get_device_list");
    assert!(!list.is_empty());
    let index = list
        .find(&sel.device)
        .expect("the selected device is listed");
    assert_eq!(list.name(index).as_deref(), Some(sel.device.as_str()));
    let context = list.open(index).expect("ibv_open_device");
    drop(list); // an open context outlives the list
    assert!(context.phys_port_cnt().expect("ibv_query_device") >= sel.port);
    let port = context.query_port(sel.port).expect("ibv_query_port");
    println!("port attributes: {port:?}");
    assert_eq!(port.state, PORT_ACTIVE);
    assert_eq!(port.lid, sel.lid);
    assert_eq!(port.max_msg_sz, sel.max_msg_size);
    assert_eq!(Mtu::from_raw(port.active_mtu), sel.active_mtu);
    assert!(port.gid_tbl_len > 0);
    // The extended context's query_port (found through the verbs_context tail before the
    // context) and the exported compatibility symbol agree on every field both fill.
    let (extended, compat) = context.query_port_both_ways(sel.port);
    let compat = compat.expect("ibv_query_port (compatibility symbol)");
    match extended {
        Some(extended) => {
            let extended = extended.expect("verbs_context query_port");
            assert_eq!(extended, port);
            assert_eq!(
                rdzv_rdma::ibv::sys::PortAttr {
                    active_speed_ex: extended.active_speed_ex,
                    ..compat
                },
                extended
            );
        }
        None => {
            assert!(
                !verbs_env::in_softroce_vm(),
                "rdma-core's contexts are extended: verbs_context's query_port was not found"
            );
            assert_eq!(compat, port);
        }
    }
    let gid = context
        .query_gid(sel.port, sel.gid_index)
        .expect("ibv_query_gid");
    assert_eq!(gid, sel.gid.0);
    match context.query_gid_type(sel.port, sel.gid_index) {
        Ok(gid_type) => {
            if sel.gid_type == GidType::RoceV2 {
                assert_eq!(gid_type, sys::GID_TYPE_ROCE_V2);
            }
        }
        Err(e) => assert!(
            !verbs_env::in_softroce_vm(),
            "_ibv_query_gid_ex failed in the VM: {e}"
        ),
    }

    // Objects.
    let pd = context.alloc_pd().expect("ibv_alloc_pd");
    let channel = context
        .create_comp_channel()
        .expect("ibv_create_comp_channel");
    channel.set_nonblocking().expect("O_NONBLOCK");
    let cq = context.create_cq(64, &channel).expect("ibv_create_cq");
    let a = queue_pair(&pd, &cq);
    let b = queue_pair(&pd, &cq);
    assert_ne!(a.qp_num(), b.qp_num());
    let inline = a.max_inline().expect("ibv_query_qp");
    println!(
        "QPs {:#x} and {:#x}, max inline {inline}",
        a.qp_num(),
        b.qp_num()
    );
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    a.to_init(sel.port, access).expect("ibv_modify_qp(INIT)");
    b.to_init(sel.port, access).expect("ibv_modify_qp(INIT)");
    connect(&a, b.qp_num(), &sel);
    connect(&b, a.qp_num(), &sel);

    let mut src = HostRegion::register(&pd, 4096, AccessFlags::LOCAL_WRITE).expect("ibv_reg_mr");
    let dst = HostRegion::register(&pd, 4096, access).expect("ibv_reg_mr");
    assert_ne!(src.lkey(), dst.lkey());
    assert!(src.write_at(0, b"hello verbs"));

    // RDMA write (inline if the device allows), then write with immediate from registered
    // memory: one chain of two work requests.
    b.post_recv_empty(1).expect("ibv_post_recv");
    let first = if inline >= 7 {
        Local::Inline(b"inline!")
    } else {
        assert!(src.write_at(2048, b"inline!"));
        Local::Registered {
            addr: src.addr() + 2048,
            len: 7,
            lkey: src.lkey(),
        }
    };
    a.post_send(&[
        SendRequest {
            wr_id: 10,
            op: SendOp::Write {
                remote_addr: dst.addr() + 100,
                rkey: dst.rkey(),
            },
            local: first,
        },
        SendRequest {
            wr_id: 11,
            op: SendOp::WriteImm {
                remote_addr: dst.addr(),
                rkey: dst.rkey(),
                imm: 0xdead_beef,
            },
            local: Local::Registered {
                addr: src.addr(),
                len: 11,
                lkey: src.lkey(),
            },
        },
    ])
    .expect("ibv_post_send");
    let wcs = completions(&cq, 3);
    assert_success(&by_id(&wcs, 10));
    assert_success(&by_id(&wcs, 11));
    let recv = by_id(&wcs, 1);
    assert_success(&recv);
    assert_eq!(recv.opcode(), sys::WC_RECV_RDMA_WITH_IMM);
    assert_eq!(recv.imm_data(), 0xdead_beef);
    assert_eq!(recv.qp_num(), b.qp_num());
    assert_eq!(recv.byte_len(), 11);
    let mut landed = Vec::new();
    assert!(dst.read_at(0, 11, &mut landed));
    assert!(dst.read_at(100, 7, &mut landed));
    assert_eq!(landed, b"hello verbsinline!");

    // Send with immediate, waited for through the completion channel.
    cq.req_notify().expect("ibv_req_notify_cq");
    a.post_recv_empty(2).expect("ibv_post_recv");
    b.post_send(&[SendRequest {
        wr_id: 12,
        op: SendOp::SendImm { imm: 7 },
        local: Local::None,
    }])
    .expect("ibv_post_send");
    wait_for_event(&channel, &cq);
    let wcs = completions(&cq, 2);
    assert_success(&by_id(&wcs, 12));
    let recv = by_id(&wcs, 2);
    assert_success(&recv);
    assert_eq!(recv.opcode(), sys::WC_RECV);
    assert_eq!(recv.imm_data(), 7);
    assert_eq!(recv.qp_num(), a.qp_num());

    // RDMA READ from a caller's shared buffer into a registered Vec.
    let shared: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(b"read me, please".to_vec());
    let lent = SharedRegistration::register(&pd, Arc::clone(&shared)).expect("ibv_reg_mr");
    let target = RegisteredVec::register(&pd, vec![0; 15]).expect("ibv_reg_mr");
    let lent_addr = (*shared).as_ref().as_ptr() as u64;
    a.post_send(&[SendRequest {
        wr_id: 13,
        op: SendOp::Read {
            remote_addr: lent_addr,
            rkey: lent.rkey(),
        },
        local: Local::Registered {
            addr: target.addr(),
            len: 15,
            lkey: target.lkey(),
        },
    }])
    .expect("ibv_post_send (READ)");
    assert_success(&by_id(&completions(&cq, 1), 13));
    assert_eq!(target.into_vec().expect("ibv_dereg_mr"), b"read me, please");

    // A READ with a wrong key fails with a status, and the error state flushes receives.
    a.post_send(&[SendRequest {
        wr_id: 14,
        op: SendOp::Read {
            remote_addr: lent_addr,
            rkey: lent.rkey() ^ 0x5a5a,
        },
        local: Local::Registered {
            addr: src.addr(),
            len: 8,
            lkey: src.lkey(),
        },
    }])
    .expect("ibv_post_send (bad READ)");
    let failed = by_id(&completions(&cq, 1), 14);
    assert_ne!(failed.status(), 0, "a READ with a wrong rkey succeeded");
    println!(
        "bad READ: {:?} (vendor error {:#x})",
        wc_status_name(failed.status()),
        failed.vendor_err()
    );
    if verbs_env::in_softroce_vm() {
        assert_eq!(failed.status(), WC_REM_ACCESS_ERR);
    }
    b.post_recv_empty(3).expect("ibv_post_recv");
    b.to_error().expect("ibv_modify_qp(ERR)");
    assert_eq!(by_id(&completions(&cq, 1), 3).status(), WC_WR_FLUSH_ERR);

    // Destroyed in order: QPs, CQ, channel, regions, PD, context (the Arcs).
    drop((a, b));
    drop(cq);
    drop(channel);
    drop((src, dst, lent));
    drop(pd);
    drop(context);
}

#[test]
fn a_missing_library_is_a_reason_not_a_crash() {
    let err = sys::check_library_at("/nonexistent/libibverbs.so.1")
        .expect_err("a library that does not exist cannot load");
    assert!(
        err.to_string().contains("/nonexistent/libibverbs.so.1"),
        "{err}"
    );
    if sys::check_library().is_err() {
        let reason = rdzv_rdma::ibv::probe_env();
        let text = reason.to_string();
        println!("{text}");
        assert!(
            text.starts_with("not viable: libibverbs.so.1 cannot be loaded"),
            "{text}"
        );
    }
}
