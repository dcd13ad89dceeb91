//! libibverbs, loaded at run time: with `sys::cuda`, the one place in the crate with
//! `unsafe` code. Re-exported as `ibv::sys`.
//!
//! Like NCCL's `ibvwrap` and TensorPipe's `IbvLib`, this module opens `libibverbs.so.1`
//! with the dynamic loader the first time a verb is needed (`verbs()`), looks up exactly the
//! entry points rdzv calls, and writes down by hand the few struct layouts it touches. No C
//! code is compiled and no header is read at build time: building rdzv needs Rust alone, and
//! a host without rdma-core gets a clear "cannot be loaded" reason instead of a crash.
//!
//! # ABI
//! The layouts follow rdma-core's `infiniband/verbs.h` (libibverbs ABI `IBVERBS_1.1`, the
//! symbol version of every exported verb used here, unchanged since rdma-core v13; the
//! header read was rdma-core v57's). They are checked at compile time against the sizes and
//! offsets of that header on 64-bit Linux, and against the real library by the tests that
//! `rdma/softroce/run` runs in a Soft-RoCE VM (`tests/verbs_sys.rs` calls each entry point).
//! Two entry points are optional, because older libraries lack them: `ibv_reg_dmabuf_mr`
//! (`IBVERBS_1.12`, rdma-core v34) and `_ibv_query_gid_ex` (`IBVERBS_1.11`, v32).
//!
//! # The verbs that are not symbols
//! `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq` and `ibv_req_notify_cq` are `static
//! inline` functions in `verbs.h` that call through the provider's table in the context
//! (`context->ops`); `ibv_query_port` is a macro that prefers the extended context's
//! `query_port` (which fills `active_speed_ex`) over the exported compatibility symbol. This
//! module does what the header does: it reads `ops` from `struct ibv_context` and, when the
//! context is extended (`abi_compat == UINTPTR_MAX`), the tail of `struct verbs_context`
//! that sits just before it. The classic post API was chosen over the extended one
//! (`ibv_qp_ex`, `ibv_wr_*`): it needs only the stable `ops` table (NCCL does the same),
//! works with every provider, and a connection posts at most two work requests at a time,
//! where the extended API saves nothing measurable.
//!
//! # What is safe here
//! Every libibverbs object is an RAII type ([`Context`], [`ProtectionDomain`],
//! [`MemoryRegion`], [`CompChannel`], [`CompletionQueue`], [`QueuePair`]) that keeps its
//! parents alive through an `Arc` and is destroyed in `Drop`. Registering arbitrary
//! addresses is `unsafe` and private to `sys` (`ProtectionDomain::reg_mr`); the safe registrations
//! ([`HostRegion`], [`SharedRegistration`], [`RegisteredVec`]) own their memory for as long
//! as the device may touch it. Posting work requests is safe: the device checks every key
//! against a registration and fails the work request otherwise, and registered memory is
//! only ever read or written by Rust as raw bytes (any bit pattern is valid), never through
//! a reference the device could invalidate. [`ReadTarget`] is the one contract a caller
//! implements for memory the device writes into.

use std::alloc::{self, Layout};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt;
use std::io;
use std::mem::{self, MaybeUninit};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::{Arc, OnceLock};

/// The shared object loaded at run time.
pub const LIBIBVERBS: &str = "libibverbs.so.1";

// --- layouts (verbs.h) ----------------------------------------------------------------

/// `union ibv_gid`: 16 bytes, 8-aligned (its `global` member holds two `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
struct IbvGid([u8; 16]);

/// `struct ibv_device`: opaque here (its name comes from `ibv_get_device_name`).
#[repr(C)]
struct IbvDevice {
    _opaque: [u8; 0],
}

type PollCqFn = unsafe extern "C" fn(*mut IbvCq, c_int, *mut WorkCompletion) -> c_int;
type ReqNotifyCqFn = unsafe extern "C" fn(*mut IbvCq, c_int) -> c_int;
type PostSendFn = unsafe extern "C" fn(*mut IbvQp, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int;
type PostRecvFn = unsafe extern "C" fn(*mut IbvQp, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;
type QueryPortExFn = unsafe extern "C" fn(*mut IbvContext, u8, *mut IbvPortAttr, usize) -> c_int;

/// `struct ibv_context_ops`: 32 function pointers, of which the data path uses four.
#[repr(C)]
struct IbvContextOps {
    /// `_compat_query_device` … `_compat_create_cq` (indices 0 to 10).
    _before_poll_cq: [*mut c_void; 11],
    poll_cq: Option<PollCqFn>,
    req_notify_cq: Option<ReqNotifyCqFn>,
    /// `_compat_cq_event` … `_compat_destroy_qp` (13 to 24).
    _before_post_send: [*mut c_void; 12],
    post_send: Option<PostSendFn>,
    post_recv: Option<PostRecvFn>,
    /// `_compat_create_ah` … `_compat_async_event` (27 to 31).
    _after_post_recv: [*mut c_void; 5],
}

/// `struct ibv_context`.
#[repr(C)]
struct IbvContext {
    device: *mut IbvDevice,
    ops: IbvContextOps,
    cmd_fd: c_int,
    async_fd: c_int,
    num_comp_vectors: c_int,
    mutex: libc::pthread_mutex_t,
    abi_compat: *mut c_void,
}

/// The end of `struct verbs_context`, from `query_port` to `sz`, which lies immediately
/// before the `struct ibv_context` of an extended context. New fields are added at the
/// start of `verbs_context` ("grows up"), so this tail has the same layout in every
/// rdma-core release that has `query_port`.
#[repr(C)]
struct VerbsContextTail {
    query_port: Option<QueryPortExFn>,
    /// `advise_mr` … `close_xrcd`.
    _ops: [*mut c_void; 37],
    _abi_placeholder3: u64,
    /// The size of the provider's `verbs_context` from its first field to the end.
    sz: usize,
}

/// `verbs_get_ctx_op(ctx, query_port)` is usable when `sz` covers the field: at least
/// `sizeof(struct verbs_context) - offsetof(struct verbs_context, query_port)`.
const VERBS_CONTEXT_FROM_QUERY_PORT: usize =
    mem::size_of::<VerbsContextTail>() + mem::size_of::<IbvContext>();

/// `struct ibv_device_attr`: only `phys_port_cnt` is read, so the fields before it
/// (`fw_ver` … `local_ca_ack_delay`, 227 bytes) and the tail padding are written as bytes.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct IbvDeviceAttr {
    _before_phys_port_cnt: [u8; 227],
    phys_port_cnt: u8,
    _padding: [u8; 4],
}

/// `struct ibv_port_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
struct IbvPortAttr {
    state: c_uint,
    max_mtu: c_uint,
    active_mtu: c_uint,
    gid_tbl_len: c_int,
    port_cap_flags: u32,
    max_msg_sz: u32,
    bad_pkey_cntr: u32,
    qkey_viol_cntr: u32,
    pkey_tbl_len: u16,
    lid: u16,
    sm_lid: u16,
    lmc: u8,
    max_vl_num: u8,
    sm_sl: u8,
    subnet_timeout: u8,
    init_type_reply: u8,
    active_width: u8,
    active_speed: u8,
    phys_state: u8,
    link_layer: u8,
    flags: u8,
    port_cap_flags2: u16,
    active_speed_ex: u32,
}

/// `struct ibv_gid_entry`.
#[repr(C)]
#[derive(Clone, Copy)]
struct IbvGidEntry {
    gid: IbvGid,
    gid_index: u32,
    port_num: u32,
    gid_type: u32,
    ndev_ifindex: u32,
}

/// `struct ibv_pd`.
#[repr(C)]
struct IbvPd {
    context: *mut IbvContext,
    handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
struct IbvMr {
    context: *mut IbvContext,
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    handle: u32,
    lkey: u32,
    rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
struct IbvCompChannel {
    context: *mut IbvContext,
    fd: c_int,
    refcnt: c_int,
}

/// `struct ibv_cq` (the fields up to `cqe`; the rest is libibverbs' own).
#[repr(C)]
struct IbvCq {
    context: *mut IbvContext,
    channel: *mut IbvCompChannel,
    cq_context: *mut c_void,
    handle: u32,
    cqe: c_int,
}

/// `struct ibv_qp` (the fields up to `qp_type`; the rest is libibverbs' own).
#[repr(C)]
struct IbvQp {
    context: *mut IbvContext,
    qp_context: *mut c_void,
    pd: *mut IbvPd,
    send_cq: *mut IbvCq,
    recv_cq: *mut IbvCq,
    srq: *mut c_void,
    handle: u32,
    qp_num: u32,
    state: c_uint,
    qp_type: c_uint,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IbvQpCap {
    max_send_wr: u32,
    max_recv_wr: u32,
    max_send_sge: u32,
    max_recv_sge: u32,
    max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
struct IbvQpInitAttr {
    qp_context: *mut c_void,
    send_cq: *mut IbvCq,
    recv_cq: *mut IbvCq,
    srq: *mut c_void,
    cap: IbvQpCap,
    qp_type: c_uint,
    sq_sig_all: c_int,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IbvGlobalRoute {
    dgid: IbvGid,
    flow_label: u32,
    sgid_index: u8,
    hop_limit: u8,
    traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IbvAhAttr {
    grh: IbvGlobalRoute,
    dlid: u16,
    sl: u8,
    src_path_bits: u8,
    static_rate: u8,
    is_global: u8,
    port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IbvQpAttr {
    qp_state: c_uint,
    cur_qp_state: c_uint,
    path_mtu: c_uint,
    path_mig_state: c_uint,
    qkey: u32,
    rq_psn: u32,
    sq_psn: u32,
    dest_qp_num: u32,
    qp_access_flags: c_uint,
    cap: IbvQpCap,
    ah_attr: IbvAhAttr,
    alt_ah_attr: IbvAhAttr,
    pkey_index: u16,
    alt_pkey_index: u16,
    en_sqd_async_notify: u8,
    sq_draining: u8,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    min_rnr_timer: u8,
    port_num: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    alt_port_num: u8,
    alt_timeout: u8,
    rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IbvSge {
    addr: u64,
    length: u32,
    lkey: u32,
}

/// `struct ibv_send_wr`. The unions are written as their largest members: `wr` as the
/// `atomic` struct (whose first two fields are `rdma`'s `remote_addr`, and whose `rkey`
/// is `rdma.rkey`'s offset only for `rdma`, so both are set by [`IbvSendWr::set_rdma`]),
/// and the last one as `bind_mw`.
#[repr(C)]
#[derive(Clone, Copy)]
struct IbvSendWr {
    wr_id: u64,
    next: *mut IbvSendWr,
    sg_list: *mut IbvSge,
    num_sge: c_int,
    opcode: c_uint,
    send_flags: c_uint,
    /// `imm_data` (network byte order) or `invalidate_rkey`.
    imm_data: u32,
    /// `wr`: `rdma { u64 remote_addr; u32 rkey; }` in its first 12 bytes.
    wr: [u64; 4],
    /// `qp_type.xrc.remote_srqn`.
    remote_srqn: u32,
    /// `bind_mw` / `tso`.
    bind_mw: [u64; 6],
}

impl IbvSendWr {
    fn zeroed() -> Self {
        IbvSendWr {
            wr_id: 0,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            wr: [0; 4],
            remote_srqn: 0,
            bind_mw: [0; 6],
        }
    }

    /// `wr.rdma.remote_addr` and `wr.rdma.rkey` (at byte offsets 0 and 8 of the union).
    fn set_rdma(&mut self, remote_addr: u64, rkey: u32) {
        self.wr[0] = remote_addr;
        // Little or big endian, `rkey` is the first four bytes of the second word.
        let mut word = self.wr[1].to_ne_bytes();
        word[..4].copy_from_slice(&rkey.to_ne_bytes());
        self.wr[1] = u64::from_ne_bytes(word);
    }
}

/// `struct ibv_recv_wr`.
#[repr(C)]
struct IbvRecvWr {
    wr_id: u64,
    next: *mut IbvRecvWr,
    sg_list: *mut IbvSge,
    num_sge: c_int,
}

/// One work completion (`struct ibv_wc`), as [`CompletionQueue::poll`] fills it.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct WorkCompletion {
    wr_id: u64,
    status: c_uint,
    opcode: c_uint,
    vendor_err: u32,
    byte_len: u32,
    /// `imm_data` (network byte order) or `invalidated_rkey`.
    imm_data: u32,
    qp_num: u32,
    src_qp: u32,
    wc_flags: c_uint,
    pkey_index: u16,
    slid: u16,
    sl: u8,
    dlid_path_bits: u8,
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id)
            .field("status", &self.status)
            .field("opcode", &self.opcode)
            .field("vendor_err", &self.vendor_err)
            .field("byte_len", &self.byte_len)
            .finish_non_exhaustive()
    }
}

impl WorkCompletion {
    /// The work request's id.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }
    /// `ibv_wc.status` (0 is `IBV_WC_SUCCESS`; names in [`crate::ibv::wc_status`]).
    pub fn status(&self) -> u32 {
        self.status
    }
    /// `ibv_wc.opcode` (see [`WC_RECV`] and [`WC_RECV_RDMA_WITH_IMM`]).
    pub fn opcode(&self) -> u32 {
        self.opcode
    }
    /// `ibv_wc.vendor_err`.
    pub fn vendor_err(&self) -> u32 {
        self.vendor_err
    }
    /// Bytes received (receive completions).
    pub fn byte_len(&self) -> u32 {
        self.byte_len
    }
    /// The immediate data, in host byte order.
    pub fn imm_data(&self) -> u32 {
        u32::from_be(self.imm_data)
    }
    /// The local queue pair number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }
}

// Compile-time checks against verbs.h on 64-bit Linux (sizes and offsets from the header).
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<IbvContextOps>() == 256);
    assert!(offset_of!(IbvContext, ops) == 8);
    assert!(size_of::<VerbsContextTail>() == 320);
    assert!(size_of::<IbvDeviceAttr>() == 232);
    assert!(offset_of!(IbvDeviceAttr, phys_port_cnt) == 227);
    assert!(size_of::<IbvGlobalRoute>() == 24);
    assert!(size_of::<IbvPortAttr>() == 56);
    assert!(offset_of!(IbvPortAttr, active_speed_ex) == 52);
    assert!(size_of::<IbvGidEntry>() == 32);
    assert!(size_of::<IbvMr>() == 48);
    assert!(offset_of!(IbvMr, lkey) == 36);
    assert!(size_of::<IbvCompChannel>() == 16);
    assert!(offset_of!(IbvQp, qp_num) == 52);
    assert!(size_of::<IbvQpInitAttr>() == 64);
    assert!(size_of::<IbvAhAttr>() == 32);
    assert!(size_of::<IbvQpAttr>() == 144);
    assert!(offset_of!(IbvQpAttr, ah_attr) == 56);
    assert!(offset_of!(IbvQpAttr, pkey_index) == 120);
    assert!(offset_of!(IbvQpAttr, rate_limit) == 136);
    assert!(size_of::<IbvSge>() == 16);
    assert!(size_of::<IbvSendWr>() == 128);
    assert!(offset_of!(IbvSendWr, wr) == 40);
    assert!(offset_of!(IbvSendWr, bind_mw) == 80);
    assert!(size_of::<IbvRecvWr>() == 32);
    assert!(size_of::<WorkCompletion>() == 48);
    assert!(offset_of!(WorkCompletion, imm_data) == 24);
};
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
const _: () = assert!(std::mem::size_of::<IbvContext>() == 328);

// --- constants (verbs.h enums) --------------------------------------------------------

/// `IBV_WC_RECV`: a receive completion of a send.
pub const WC_RECV: u32 = 1 << 7;
/// `IBV_WC_RECV_RDMA_WITH_IMM`: a receive completion of an RDMA write with immediate.
pub const WC_RECV_RDMA_WITH_IMM: u32 = WC_RECV + 1;

const WR_RDMA_WRITE: c_uint = 0;
const WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
const WR_SEND_WITH_IMM: c_uint = 3;
const WR_RDMA_READ: c_uint = 4;
const SEND_SIGNALED: c_uint = 1 << 1;
const SEND_INLINE: c_uint = 1 << 3;

const QPT_RC: c_uint = 2;
const QPS_INIT: c_uint = 1;
const QPS_RTR: c_uint = 2;
const QPS_RTS: c_uint = 3;
const QPS_ERR: c_uint = 6;

const QP_STATE: c_int = 1 << 0;
const QP_ACCESS_FLAGS: c_int = 1 << 3;
const QP_PKEY_INDEX: c_int = 1 << 4;
const QP_PORT: c_int = 1 << 5;
const QP_AV: c_int = 1 << 7;
const QP_PATH_MTU: c_int = 1 << 8;
const QP_TIMEOUT: c_int = 1 << 9;
const QP_RETRY_CNT: c_int = 1 << 10;
const QP_RNR_RETRY: c_int = 1 << 11;
const QP_RQ_PSN: c_int = 1 << 12;
const QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
const QP_MIN_RNR_TIMER: c_int = 1 << 15;
const QP_SQ_PSN: c_int = 1 << 16;
const QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
const QP_CAP: c_int = 1 << 19;
const QP_DEST_QPN: c_int = 1 << 20;

/// `IBV_GID_TYPE_*` from `_ibv_query_gid_ex`.
pub const GID_TYPE_IB: u32 = 0;
/// RoCE v1 GID.
pub const GID_TYPE_ROCE_V1: u32 = 1;
/// RoCE v2 GID.
pub const GID_TYPE_ROCE_V2: u32 = 2;

/// Memory access rights of a registration or queue pair (`enum ibv_access_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// `IBV_ACCESS_LOCAL_WRITE`: the local device may write (receives, READ targets).
    pub const LOCAL_WRITE: AccessFlags = AccessFlags(1);
    /// `IBV_ACCESS_REMOTE_WRITE`: peers may RDMA WRITE into it.
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(1 << 1);
    /// `IBV_ACCESS_REMOTE_READ`: peers may RDMA READ from it.
    pub const REMOTE_READ: AccessFlags = AccessFlags(1 << 2);

    /// The raw bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Whether every flag of `other` is set.
    pub fn contains(self, other: AccessFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for AccessFlags {
    type Output = AccessFlags;
    fn bitor(self, rhs: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | rhs.0)
    }
}

// --- the library ----------------------------------------------------------------------

/// Why libibverbs cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LibraryError {
    /// The dynamic loader cannot load it.
    #[error("{detail}")]
    Load {
        /// The path or name tried.
        path: String,
        /// The loader's message (it names the path).
        detail: String,
    },
    /// It loads, but lacks an entry point rdzv needs.
    #[error("{library} has no symbol {symbol}: {detail} (rdma-core too old?)")]
    MissingSymbol {
        /// The library's name.
        library: &'static str,
        /// The symbol.
        symbol: &'static str,
        /// The loader's message.
        detail: String,
    },
}

static VERBS: OnceLock<Result<Verbs, LibraryError>> = OnceLock::new();

/// libibverbs, loaded on first use; why not when it cannot be loaded. The outcome is
/// cached for the life of the process.
fn verbs() -> Result<&'static Verbs, LibraryError> {
    VERBS
        .get_or_init(|| Verbs::load(LIBIBVERBS))
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether libibverbs can be loaded (and has every entry point rdzv needs); if not, why.
///
/// # Errors
/// [`LibraryError`]: the dynamic loader's message, or the missing symbol.
pub fn check_library() -> Result<(), LibraryError> {
    verbs().map(|_| ())
}

/// Loads the library at `path` and checks its entry points, without caching: what
/// [`check_library`] does for [`LIBIBVERBS`]. Exposed so that tests can give a path that
/// does not exist.
///
/// # Errors
/// As [`check_library`].
pub fn check_library_at(path: &str) -> Result<(), LibraryError> {
    Verbs::load(path).map(|_| ())
}

/// Declares `Verbs`, the entry points rdzv uses, each named once with its symbol and its
/// C prototype, and `Verbs::symbols`, which looks every one up in a loaded library: an
/// `optional` one is `None` when the library lacks it, any other is a
/// [`LibraryError::MissingSymbol`].
macro_rules! verbs {
    ($($(#[$doc:meta])* $field:ident $(($optional:ident))?: $name:literal => $ty:ty,)*) => {
        /// The entry points rdzv uses, looked up once in `libibverbs.so.1`.
        struct Verbs {
            $($(#[$doc])* $field: verbs!(@type $ty $(, $optional)?),)*
            /// Keeps the functions above mapped; never unloaded (it lives in a `static`).
            _library: libloading::Library,
        }

        impl Verbs {
            fn symbols(library: libloading::Library) -> Result<Verbs, LibraryError> {
                Ok(Verbs {
                    $($field: verbs!(@symbol library, $name $(, $optional)?),)*
                    _library: library,
                })
            }
        }
    };
    (@type $ty:ty) => { $ty };
    (@type $ty:ty, optional) => { Option<$ty> };
    (@symbol $library:ident, $name:literal) => {{
        // SAFETY: the type the symbol is read as is the C prototype of `$name` in
        // verbs.h (IBVERBS_1.1), written down in `Verbs`; the pointer stays valid while
        // the library is loaded, and `Verbs` keeps it loaded.
        let symbol = unsafe { $library.get(concat!($name, "\0").as_bytes()) };
        match symbol {
            Ok(symbol) => *symbol,
            Err(err) => {
                return Err(LibraryError::MissingSymbol {
                    library: LIBIBVERBS,
                    symbol: $name,
                    detail: err.to_string(),
                })
            }
        }
    }};
    (@symbol $library:ident, $name:literal, optional) => {{
        // SAFETY: as for a required symbol.
        let symbol = unsafe { $library.get(concat!($name, "\0").as_bytes()) };
        symbol.ok().map(|symbol| *symbol)
    }};
}

verbs! {
    get_device_list: "ibv_get_device_list" =>
        unsafe extern "C" fn(*mut c_int) -> *mut *mut IbvDevice,
    free_device_list: "ibv_free_device_list" => unsafe extern "C" fn(*mut *mut IbvDevice),
    get_device_name: "ibv_get_device_name" => unsafe extern "C" fn(*mut IbvDevice) -> *const c_char,
    open_device: "ibv_open_device" => unsafe extern "C" fn(*mut IbvDevice) -> *mut IbvContext,
    close_device: "ibv_close_device" => unsafe extern "C" fn(*mut IbvContext) -> c_int,
    query_device: "ibv_query_device" =>
        unsafe extern "C" fn(*mut IbvContext, *mut IbvDeviceAttr) -> c_int,
    /// The exported compatibility `ibv_query_port` (fills the fields before `flags`).
    query_port: "ibv_query_port" =>
        unsafe extern "C" fn(*mut IbvContext, u8, *mut IbvPortAttr) -> c_int,
    query_gid: "ibv_query_gid" =>
        unsafe extern "C" fn(*mut IbvContext, u8, c_int, *mut IbvGid) -> c_int,
    query_gid_ex(optional): "_ibv_query_gid_ex" =>
        unsafe extern "C" fn(*mut IbvContext, u32, u32, *mut IbvGidEntry, u32, usize) -> c_int,
    alloc_pd: "ibv_alloc_pd" => unsafe extern "C" fn(*mut IbvContext) -> *mut IbvPd,
    dealloc_pd: "ibv_dealloc_pd" => unsafe extern "C" fn(*mut IbvPd) -> c_int,
    reg_mr: "ibv_reg_mr" =>
        unsafe extern "C" fn(*mut IbvPd, *mut c_void, usize, c_int) -> *mut IbvMr,
    reg_dmabuf_mr(optional): "ibv_reg_dmabuf_mr" =>
        unsafe extern "C" fn(*mut IbvPd, u64, usize, u64, c_int, c_int) -> *mut IbvMr,
    dereg_mr: "ibv_dereg_mr" => unsafe extern "C" fn(*mut IbvMr) -> c_int,
    create_comp_channel: "ibv_create_comp_channel" =>
        unsafe extern "C" fn(*mut IbvContext) -> *mut IbvCompChannel,
    destroy_comp_channel: "ibv_destroy_comp_channel" =>
        unsafe extern "C" fn(*mut IbvCompChannel) -> c_int,
    get_cq_event: "ibv_get_cq_event" =>
        unsafe extern "C" fn(*mut IbvCompChannel, *mut *mut IbvCq, *mut *mut c_void) -> c_int,
    ack_cq_events: "ibv_ack_cq_events" => unsafe extern "C" fn(*mut IbvCq, c_uint),
    create_cq: "ibv_create_cq" => unsafe extern "C" fn(
        *mut IbvContext,
        c_int,
        *mut c_void,
        *mut IbvCompChannel,
        c_int,
    ) -> *mut IbvCq,
    destroy_cq: "ibv_destroy_cq" => unsafe extern "C" fn(*mut IbvCq) -> c_int,
    create_qp: "ibv_create_qp" =>
        unsafe extern "C" fn(*mut IbvPd, *mut IbvQpInitAttr) -> *mut IbvQp,
    modify_qp: "ibv_modify_qp" => unsafe extern "C" fn(*mut IbvQp, *mut IbvQpAttr, c_int) -> c_int,
    query_qp: "ibv_query_qp" =>
        unsafe extern "C" fn(*mut IbvQp, *mut IbvQpAttr, c_int, *mut IbvQpInitAttr) -> c_int,
    destroy_qp: "ibv_destroy_qp" => unsafe extern "C" fn(*mut IbvQp) -> c_int,
}

impl Verbs {
    fn load(path: &str) -> Result<Verbs, LibraryError> {
        // SAFETY: loading libibverbs runs its ELF constructors, which only initialise
        // libibverbs' own globals. Provider libraries are loaded by libibverbs itself later.
        let library =
            unsafe { libloading::Library::new(path) }.map_err(|err| LibraryError::Load {
                path: path.to_string(),
                detail: crate::error_chain::ErrorChain(&err).to_string(),
            })?;
        Verbs::symbols(library)
    }
}

/// The library, or `EOPNOTSUPP` naming why it cannot be loaded (for calls made without
/// [`check_library`] first).
fn lib() -> io::Result<&'static Verbs> {
    verbs().map_err(|detail| {
        io::Error::new(
            io::ErrorKind::Unsupported,
            format!("{LIBIBVERBS} cannot be loaded: {detail}"),
        )
    })
}

/// The error of a verb that returns an `int`: rdma-core returns the errno value itself,
/// older code returns -1 and sets `errno`.
fn rc_error(rc: c_int) -> io::Error {
    if rc > 0 {
        io::Error::from_raw_os_error(rc)
    } else {
        errno_error()
    }
}

/// `Ok` for a verb that returned 0, else its error ([`rc_error`]).
fn check_rc(rc: c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(rc_error(rc))
    }
}

/// Logs a destroying verb that failed in a `Drop` (nothing else can be done about it).
fn log_failure(verb: &str, rc: c_int) {
    if rc != 0 {
        tracing::debug!(error = %rc_error(rc), "{verb} failed");
    }
}

/// `errno` after a verb returned NULL (or -1), never "success".
fn errno_error() -> io::Error {
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(0) | None => io::Error::other("libibverbs failed without setting errno"),
        _ => err,
    }
}

fn non_null<T>(ptr: *mut T) -> io::Result<NonNull<T>> {
    NonNull::new(ptr).ok_or_else(errno_error)
}

/// Makes `$object`, an owned libibverbs object at `ptr` (an `Arc` to what it was made on
/// keeps that alive), `Send` (and `Sync` when asked), and destroys it on drop with the
/// verb `$destroy`, reached through `$verbs`.
macro_rules! verbs_object {
    ($object:ident, $destroy:ident via |$this:ident| $verbs:expr $(, $sync:ident)?) => {
        // SAFETY: the object is owned by this value, and rdma-core's verbs on it may be
        // called from any thread.
        unsafe impl Send for $object {}
        $(
            // SAFETY: as above: `&self` methods call only thread-safe verbs, and read only
            // fields not written after creation (keys, numbers, descriptors).
            unsafe impl $sync for $object {}
        )?
        impl Drop for $object {
            fn drop(&mut self) {
                let $this = &*self;
                // SAFETY: the object is alive and destroyed once, here; every object made
                // on it holds an `Arc` to it, so none is left (after a queue pair is
                // destroyed the device touches no memory its work requests named).
                log_failure(concat!("ibv_", stringify!($destroy)), unsafe {
                    ($verbs.$destroy)($this.ptr.as_ptr())
                });
            }
        }
    };
}

// --- devices and contexts -------------------------------------------------------------

/// The result of `ibv_get_device_list`, freed on drop.
pub struct DeviceList {
    verbs: &'static Verbs,
    list: NonNull<*mut IbvDevice>,
    len: usize,
}

impl fmt::Debug for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceList")
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceList {
    /// `ibv_get_device_list`.
    ///
    /// # Errors
    /// The library cannot be loaded (`Unsupported`), or the call failed (its errno:
    /// `ENOSYS` for a kernel without verbs).
    pub fn new() -> io::Result<DeviceList> {
        let verbs = lib()?;
        let mut len: c_int = 0;
        // SAFETY: the out-pointer is a live local; the returned array is owned by us until
        // ibv_free_device_list (Drop).
        let list = non_null(unsafe { (verbs.get_device_list)(&mut len) })?;
        Ok(DeviceList {
            verbs,
            list,
            len: usize::try_from(len).unwrap_or(0),
        })
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no device.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn device(&self, index: usize) -> Option<NonNull<IbvDevice>> {
        if index >= self.len {
            return None;
        }
        // SAFETY: the array holds `len` entries (and a NULL terminator) and lives until
        // Drop; `index < len`.
        NonNull::new(unsafe { *self.list.as_ptr().add(index) })
    }

    /// The kernel name of device `index` (`ibv_get_device_name`), if it exists.
    pub fn name(&self, index: usize) -> Option<String> {
        let device = self.device(index)?;
        // SAFETY: the device is an entry of the live list.
        let name = unsafe { (self.verbs.get_device_name)(device.as_ptr()) };
        if name.is_null() {
            return None;
        }
        // SAFETY: libibverbs returns a NUL-terminated name owned by the device, which lives
        // as long as the list; it is copied at once.
        Some(
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// The index of the device named `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        (0..self.len).find(|&i| self.name(i).as_deref() == Some(name))
    }

    /// `ibv_open_device` on device `index`.
    ///
    /// # Errors
    /// `ENODEV` for an index out of range, or the call's errno.
    pub fn open(&self, index: usize) -> io::Result<Arc<Context>> {
        let device = self
            .device(index)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENODEV))?;
        // SAFETY: the device is an entry of the live list; the context stays valid after
        // the list is freed (libibverbs keeps the device referenced while it is open).
        let ptr = non_null(unsafe { (self.verbs.open_device)(device.as_ptr()) })?;
        Ok(Arc::new(Context {
            verbs: self.verbs,
            ptr,
        }))
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        unsafe { (self.verbs.free_device_list)(self.list.as_ptr()) }
    }
}

/// An opened device (`struct ibv_context`), closed on drop once every object made on it
/// is gone (they hold an `Arc`).
pub struct Context {
    verbs: &'static Verbs,
    ptr: NonNull<IbvContext>,
}

verbs_object!(Context, close_device via |context| context.verbs, Sync);

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

/// The port attributes rdzv reads (`struct ibv_port_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// `state` (`enum ibv_port_state`).
    pub state: u32,
    /// `active_mtu` (`enum ibv_mtu`).
    pub active_mtu: u32,
    /// `gid_tbl_len`.
    pub gid_tbl_len: i32,
    /// `max_msg_sz`.
    pub max_msg_sz: u32,
    /// `lid`.
    pub lid: u16,
    /// `active_width`.
    pub active_width: u8,
    /// `active_speed`.
    pub active_speed: u8,
    /// `active_speed_ex` (0 where the library or provider does not report it).
    pub active_speed_ex: u32,
    /// `link_layer` (`IBV_LINK_LAYER_*`).
    pub link_layer: u8,
}

fn port_attr(raw: IbvPortAttr) -> PortAttr {
    PortAttr {
        state: raw.state,
        active_mtu: raw.active_mtu,
        gid_tbl_len: raw.gid_tbl_len,
        max_msg_sz: raw.max_msg_sz,
        lid: raw.lid,
        active_width: raw.active_width,
        active_speed: raw.active_speed,
        active_speed_ex: raw.active_speed_ex,
        link_layer: raw.link_layer,
    }
}

impl Context {
    /// `ibv_query_device`: the number of physical ports.
    ///
    /// # Errors
    /// The call's errno.
    pub fn phys_port_cnt(&self) -> io::Result<u8> {
        let mut attr = MaybeUninit::<IbvDeviceAttr>::zeroed();
        // SAFETY: the context is open; `attr` is a writable ibv_device_attr.
        check_rc(unsafe { (self.verbs.query_device)(self.ptr.as_ptr(), attr.as_mut_ptr()) })?;
        // SAFETY: zero-initialised, then filled by the call; every bit pattern is valid.
        Ok(unsafe { attr.assume_init() }.phys_port_cnt)
    }

    /// The extended context's `query_port`, as `verbs_get_ctx_op(ctx, query_port)` finds
    /// it.
    fn query_port_op(&self) -> Option<QueryPortExFn> {
        // SAFETY: the context is open; reading its `abi_compat` field.
        let abi_compat = unsafe { (*self.ptr.as_ptr()).abi_compat };
        if abi_compat as usize != usize::MAX {
            return None;
        }
        let tail = (self.ptr.as_ptr() as usize).checked_sub(mem::size_of::<VerbsContextTail>())?
            as *const VerbsContextTail;
        // SAFETY: `abi_compat == UINTPTR_MAX` marks a context embedded as the last field
        // of a `struct verbs_context`, whose fields `query_port` … `sz` immediately
        // precede it (verbs.h: "sz must be immediately before struct ibv_context").
        // `sz` is read first and `query_port` only when `sz` says the provider's struct
        // has it, as the header's macro does.
        unsafe {
            let sz = ptr::addr_of!((*tail).sz).read();
            if sz < VERBS_CONTEXT_FROM_QUERY_PORT {
                return None;
            }
            ptr::addr_of!((*tail).query_port).read()
        }
    }

    /// `ibv_query_port` as verbs.h defines it: the extended context's `query_port` with
    /// the full struct, else the exported compatibility symbol.
    ///
    /// # Errors
    /// The call's errno.
    pub fn query_port(&self, port: u8) -> io::Result<PortAttr> {
        self.query_port_with(self.query_port_op(), port)
    }

    /// `ibv_query_port` through `op`, the extended context's `query_port`, or through the
    /// exported compatibility symbol when `None`.
    fn query_port_with(&self, op: Option<QueryPortExFn>, port: u8) -> io::Result<PortAttr> {
        let mut attr = MaybeUninit::<IbvPortAttr>::zeroed();
        let (ctx, out) = (self.ptr.as_ptr(), attr.as_mut_ptr());
        check_rc(match op {
            // SAFETY: the context is open; `attr` is a writable ibv_port_attr of the size
            // passed.
            Some(op) => unsafe { op(ctx, port, out, mem::size_of::<IbvPortAttr>()) },
            // SAFETY: as above; the compatibility symbol writes a prefix of the struct.
            None => unsafe { (self.verbs.query_port)(ctx, port, out) },
        })?;
        // SAFETY: zero-initialised, then filled; every bit pattern of its integers is valid.
        Ok(port_attr(unsafe { attr.assume_init() }))
    }

    /// Both ways of querying a port, for checking the layouts against the library: the
    /// extended context's `query_port` (`None` when the context is not extended or the
    /// provider has none), and the exported compatibility symbol.
    #[doc(hidden)]
    pub fn query_port_both_ways(
        &self,
        port: u8,
    ) -> (Option<io::Result<PortAttr>>, io::Result<PortAttr>) {
        let extended = self
            .query_port_op()
            .map(|op| self.query_port_with(Some(op), port));
        (extended, self.query_port_with(None, port))
    }

    /// `ibv_query_gid`: GID `index` of `port`.
    ///
    /// # Errors
    /// The call's errno (`EINVAL` for an index that does not fit an `int`).
    pub fn query_gid(&self, port: u8, index: u32) -> io::Result<[u8; 16]> {
        let index =
            c_int::try_from(index).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let mut gid = IbvGid::default();
        // SAFETY: the context is open; `gid` is a writable `union ibv_gid`.
        check_rc(unsafe { (self.verbs.query_gid)(self.ptr.as_ptr(), port, index, &mut gid) })?;
        Ok(gid.0)
    }

    /// The GID's type (`GID_TYPE_*`) through `_ibv_query_gid_ex` (rdma-core v32+).
    ///
    /// # Errors
    /// `Unsupported` when the library lacks it, or the call's errno.
    pub fn query_gid_type(&self, port: u8, index: u32) -> io::Result<u32> {
        let Some(query) = self.verbs.query_gid_ex else {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "libibverbs has no _ibv_query_gid_ex (rdma-core before v32)",
            ));
        };
        let mut entry = MaybeUninit::<IbvGidEntry>::zeroed();
        // SAFETY: the context is open; `entry` is a writable ibv_gid_entry of the size
        // passed (what the header's ibv_query_gid_ex passes).
        check_rc(unsafe {
            query(
                self.ptr.as_ptr(),
                u32::from(port),
                index,
                entry.as_mut_ptr(),
                0,
                mem::size_of::<IbvGidEntry>(),
            )
        })?;
        // SAFETY: zero-initialised, then filled.
        Ok(unsafe { entry.assume_init() }.gid_type)
    }

    /// `ibv_alloc_pd`.
    ///
    /// # Errors
    /// The call's errno.
    pub fn alloc_pd(self: &Arc<Self>) -> io::Result<Arc<ProtectionDomain>> {
        // SAFETY: the context is open.
        let ptr = non_null(unsafe { (self.verbs.alloc_pd)(self.ptr.as_ptr()) })?;
        Ok(Arc::new(ProtectionDomain {
            ptr,
            context: Arc::clone(self),
        }))
    }

    /// `ibv_create_comp_channel`.
    ///
    /// # Errors
    /// The call's errno.
    pub fn create_comp_channel(self: &Arc<Self>) -> io::Result<Arc<CompChannel>> {
        // SAFETY: the context is open.
        let ptr = non_null(unsafe { (self.verbs.create_comp_channel)(self.ptr.as_ptr()) })?;
        Ok(Arc::new(CompChannel {
            ptr,
            context: Arc::clone(self),
        }))
    }

    /// `ibv_create_cq` with at least `cqe` entries, raising events on `channel`.
    ///
    /// # Errors
    /// The call's errno (`EINVAL` for a `cqe` that does not fit an `int`).
    pub fn create_cq(
        self: &Arc<Self>,
        cqe: u32,
        channel: &Arc<CompChannel>,
    ) -> io::Result<Arc<CompletionQueue>> {
        let cqe = c_int::try_from(cqe).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: the context and the channel (made on it) are alive; no CQ context.
        let ptr = non_null(unsafe {
            (self.verbs.create_cq)(
                self.ptr.as_ptr(),
                cqe,
                ptr::null_mut(),
                channel.ptr.as_ptr(),
                0,
            )
        })?;
        Ok(Arc::new(CompletionQueue {
            ptr,
            channel: Arc::clone(channel),
            context: Arc::clone(self),
        }))
    }

    fn ops(&self) -> &IbvContextOps {
        // SAFETY: the context is open and its ops table is never written after
        // ibv_open_device returned.
        unsafe { &(*self.ptr.as_ptr()).ops }
    }
}

// --- protection domains and memory ----------------------------------------------------

/// A protection domain (`ibv_alloc_pd`), deallocated when its last registration and queue
/// pair are gone.
pub struct ProtectionDomain {
    ptr: NonNull<IbvPd>,
    context: Arc<Context>,
}

verbs_object!(ProtectionDomain, dealloc_pd via |pd| pd.context.verbs, Sync);

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain").finish_non_exhaustive()
    }
}

impl ProtectionDomain {
    /// `ibv_reg_mr` on `[addr, addr + len)`.
    ///
    /// # Errors
    /// The call's errno.
    ///
    /// # Safety
    /// The range must stay mapped until the returned region is dropped (deregistered), and
    /// if `access` lets the device write it, no Rust reference may view it meanwhile.
    pub(in crate::sys) unsafe fn reg_mr(
        self: &Arc<Self>,
        addr: u64,
        len: usize,
        access: AccessFlags,
    ) -> io::Result<MemoryRegion> {
        let access = c_int::try_from(access.0).unwrap_or(0);
        // SAFETY: the PD is alive; the caller keeps the range valid while registered.
        let ptr = non_null(unsafe {
            (self.context.verbs.reg_mr)(self.ptr.as_ptr(), addr as *mut c_void, len, access)
        })?;
        Ok(MemoryRegion {
            ptr,
            pd: Arc::clone(self),
        })
    }

    /// `ibv_reg_dmabuf_mr`: registers `len` bytes at `offset` of the dma-buf `fd`, at
    /// device address `iova`.
    ///
    /// # Errors
    /// `Unsupported` when the library lacks the verb (rdma-core before v34), or the call's
    /// errno.
    ///
    /// # Safety
    /// `fd` must be a dma-buf covering `[offset, offset + len)`, whose memory stays
    /// allocated until the region is dropped.
    pub(in crate::sys) unsafe fn reg_dmabuf_mr(
        self: &Arc<Self>,
        offset: u64,
        len: usize,
        iova: u64,
        fd: BorrowedFd<'_>,
        access: AccessFlags,
    ) -> io::Result<MemoryRegion> {
        let Some(reg) = self.context.verbs.reg_dmabuf_mr else {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        };
        let access = c_int::try_from(access.0).unwrap_or(0);
        // SAFETY: the PD is alive and `fd` open (borrowed); the caller guarantees the rest.
        let ptr =
            non_null(unsafe { reg(self.ptr.as_ptr(), offset, len, iova, fd.as_raw_fd(), access) })?;
        Ok(MemoryRegion {
            ptr,
            pd: Arc::clone(self),
        })
    }

    /// `ibv_create_qp`: an RC queue pair whose sends and receives complete on `cq`. The
    /// capabilities the device granted are in [`QueuePair::max_inline`].
    ///
    /// # Errors
    /// The call's errno.
    pub fn create_rc_qp(
        self: &Arc<Self>,
        cq: &Arc<CompletionQueue>,
        caps: QpCaps,
    ) -> io::Result<QueuePair> {
        let mut init = IbvQpInitAttr {
            qp_context: ptr::null_mut(),
            send_cq: cq.ptr.as_ptr(),
            recv_cq: cq.ptr.as_ptr(),
            srq: ptr::null_mut(),
            cap: IbvQpCap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the PD and CQ (same context) are alive; `init` is a valid init attr.
        let ptr =
            non_null(unsafe { (self.context.verbs.create_qp)(self.ptr.as_ptr(), &mut init) })?;
        Ok(QueuePair {
            ptr,
            cq: Arc::clone(cq),
            pd: Arc::clone(self),
        })
    }
}

/// A memory registration (`struct ibv_mr`), deregistered on drop.
pub struct MemoryRegion {
    ptr: NonNull<IbvMr>,
    pd: Arc<ProtectionDomain>,
}

verbs_object!(MemoryRegion, dereg_mr via |mr| mr.pd.context.verbs, Sync);

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl MemoryRegion {
    fn raw(&self) -> &IbvMr {
        // SAFETY: the registration is alive; its fields are not written after
        // registration.
        unsafe { self.ptr.as_ref() }
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.raw().lkey
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.raw().rkey
    }

    /// The registered start address.
    pub fn addr(&self) -> u64 {
        self.raw().addr as u64
    }

    /// `ibv_dereg_mr`; after an error the device may still access the memory, which the
    /// caller must then never free.
    fn deregister(self) -> io::Result<()> {
        let this = mem::ManuallyDrop::new(self);
        // SAFETY: the registration is alive and deregistered once (Drop does not run).
        let rc = unsafe { (this.pd.context.verbs.dereg_mr)(this.ptr.as_ptr()) };
        // SAFETY: `this` is not used again; its Arc is released here.
        drop(unsafe { ptr::read(&this.pd) });
        check_rc(rc)
    }
}

/// Why `what` (`region`, `buffer`) cannot be registered: it is empty.
fn empty_registration(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("an empty {what} cannot be registered"),
    )
}

/// Page-aligned, zeroed heap memory, freed on drop.
struct PageMemory {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl PageMemory {
    fn new(len: usize) -> io::Result<PageMemory> {
        let layout = Layout::from_size_align(len, 4096)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too large"))?;
        if len == 0 {
            return Err(empty_registration("region"));
        }
        // SAFETY: the layout has a nonzero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
            .ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(PageMemory { ptr, layout })
    }
}

impl Drop for PageMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; the registration over it was
        // deregistered first (HostRegion's Drop), or the memory is leaked instead.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Page-aligned, zeroed host memory registered in a protection domain, which owns the
/// memory: what a connection's rings are, and what host memory is lent from and read into.
/// Rust code only copies bytes in and out of it ([`write_at`](Self::write_at),
/// [`read_at`](Self::read_at), [`to_vec`](Self::to_vec)); the device writes it according
/// to the registration's access rights.
pub struct HostRegion {
    /// `None` only while dropping.
    mr: Option<MemoryRegion>,
    memory: mem::ManuallyDrop<PageMemory>,
}

// SAFETY: a uniquely owned heap allocation and its registration; the memory is only
// accessed by raw byte copies.
unsafe impl Send for HostRegion {}
// SAFETY: `&self` methods only copy bytes out (raw copies, valid for any content).
unsafe impl Sync for HostRegion {}

impl fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl HostRegion {
    /// `len` (at least 1) zeroed bytes registered in `pd` with `access`.
    ///
    /// # Errors
    /// `InvalidInput` for 0 bytes, `OutOfMemory`, or `ibv_reg_mr`'s errno.
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        len: usize,
        access: AccessFlags,
    ) -> io::Result<HostRegion> {
        let memory = PageMemory::new(len)?;
        // SAFETY: the memory is owned by the region and freed only after the registration
        // is deregistered (Drop), and Rust never holds a reference into it.
        let mr = unsafe { pd.reg_mr(memory.ptr.as_ptr() as u64, len, access) }?;
        Ok(HostRegion {
            mr: Some(mr),
            memory: mem::ManuallyDrop::new(memory),
        })
    }

    fn mr(&self) -> &MemoryRegion {
        match &self.mr {
            Some(mr) => mr,
            None => unreachable!("the registration is only taken in Drop"),
        }
    }

    /// The start address (what a work request names).
    pub fn addr(&self) -> u64 {
        self.memory.ptr.as_ptr() as u64
    }

    /// The length in bytes (never zero).
    pub fn len(&self) -> usize {
        self.memory.layout.size()
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.mr().lkey()
    }

    /// The remote key, for a peer's one-sided access.
    pub fn rkey(&self) -> u32 {
        self.mr().rkey()
    }

    /// Copies `src` in at `offset`; false (nothing copied) when it does not fit.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> bool {
        if offset
            .checked_add(src.len())
            .is_none_or(|end| end > self.len())
        {
            return false;
        }
        // SAFETY: `[offset, offset + src.len())` is inside the allocation (checked above),
        // and `src` is a distinct Rust slice, so the ranges do not overlap.
        unsafe {
            ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.memory.ptr.as_ptr().add(offset),
                src.len(),
            )
        };
        true
    }

    /// Appends `len` bytes from `offset` to `out`; false (nothing appended) when the range
    /// is not inside the region.
    pub fn read_at(&self, offset: usize, len: usize, out: &mut Vec<u8>) -> bool {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return false;
        }
        out.reserve(len);
        // SAFETY: the source range is inside the allocation (checked above); the
        // destination has `len` spare bytes reserved, and `set_len` covers exactly the
        // bytes just copied (any byte value is a valid u8).
        unsafe {
            let dst = out.as_mut_ptr().add(out.len());
            ptr::copy_nonoverlapping(self.memory.ptr.as_ptr().add(offset), dst, len);
            out.set_len(out.len() + len);
        }
        true
    }

    /// A copy of the bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.read_at(0, self.len(), &mut out);
        out
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        let deregistered = self.mr.take().map_or(Ok(()), MemoryRegion::deregister);
        match deregistered {
            // SAFETY: dropped once, here; the device can no longer access it.
            Ok(()) => unsafe { mem::ManuallyDrop::drop(&mut self.memory) },
            Err(err) => tracing::warn!(
                error = %err,
                len = self.len(),
                "ibv_dereg_mr failed: the region's memory is leaked, not freed"
            ),
        }
    }
}

/// A caller's buffer registered for peers' RDMA READ only, kept alive by the registration
/// (field order: deregistered before the owner is released).
pub struct SharedRegistration {
    mr: MemoryRegion,
    _owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
}

impl fmt::Debug for SharedRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedRegistration")
            .field("mr", &self.mr)
            .finish_non_exhaustive()
    }
}

impl SharedRegistration {
    /// Registers the bytes of `owner` (non-empty) with `IBV_ACCESS_REMOTE_READ` only: the
    /// device never writes them.
    ///
    /// # Errors
    /// `InvalidInput` for an empty buffer, or `ibv_reg_mr`'s errno.
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    ) -> io::Result<SharedRegistration> {
        let bytes: &[u8] = (*owner).as_ref();
        if bytes.is_empty() {
            return Err(empty_registration("buffer"));
        }
        // SAFETY: the bytes belong to `owner`, which the registration keeps alive (and,
        // being shared, unmoved and unchanged) until after it is deregistered; the device
        // only reads them (REMOTE_READ without LOCAL_WRITE).
        let mr =
            unsafe { pd.reg_mr(bytes.as_ptr() as u64, bytes.len(), AccessFlags::REMOTE_READ) }?;
        Ok(SharedRegistration { mr, _owner: owner })
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

/// A `Vec` lent to the device as the destination of RDMA READs, handed back by
/// [`into_vec`](Self::into_vec) once deregistered.
pub struct RegisteredVec {
    mr: Option<MemoryRegion>,
    buf: mem::ManuallyDrop<Vec<u8>>,
}

impl fmt::Debug for RegisteredVec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredVec")
            .field("len", &self.buf.len())
            .finish_non_exhaustive()
    }
}

impl RegisteredVec {
    /// Registers `buf` (non-empty) with `IBV_ACCESS_LOCAL_WRITE`.
    ///
    /// # Errors
    /// `InvalidInput` for an empty buffer, or `ibv_reg_mr`'s errno (the buffer is dropped).
    pub fn register(pd: &Arc<ProtectionDomain>, mut buf: Vec<u8>) -> io::Result<RegisteredVec> {
        if buf.is_empty() {
            return Err(empty_registration("buffer"));
        }
        // SAFETY: the Vec's heap block is owned by the returned value, never resized or
        // read until it is deregistered (into_vec / Drop), and leaked if that fails.
        let mr =
            unsafe { pd.reg_mr(buf.as_mut_ptr() as u64, buf.len(), AccessFlags::LOCAL_WRITE) }?;
        Ok(RegisteredVec {
            mr: Some(mr),
            buf: mem::ManuallyDrop::new(buf),
        })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }

    /// Length.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Always false: empty buffers are not registered.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, MemoryRegion::lkey)
    }

    /// Deregisters and hands the bytes back; `None` (the memory leaked) when
    /// `ibv_dereg_mr` fails and the device might still write it.
    pub fn into_vec(mut self) -> Option<Vec<u8>> {
        let deregistered = self.mr.take().map_or(Ok(()), MemoryRegion::deregister);
        match deregistered {
            // SAFETY: the Vec is taken once; Drop then finds `mr` gone and the Vec moved
            // out (it does nothing more).
            Ok(()) => Some(unsafe { mem::ManuallyDrop::take(&mut self.buf) }),
            Err(err) => {
                tracing::warn!(error = %err, "ibv_dereg_mr failed: a READ buffer is leaked");
                self.buf = mem::ManuallyDrop::new(Vec::new());
                None
            }
        }
    }
}

impl Drop for RegisteredVec {
    fn drop(&mut self) {
        let Some(mr) = self.mr.take() else {
            // Taken by into_vec, which left `buf` moved out or replaced by an empty Vec
            // that owns nothing (leaked memory stays leaked).
            return;
        };
        match mr.deregister() {
            // SAFETY: dropped once, here.
            Ok(()) => unsafe { mem::ManuallyDrop::drop(&mut self.buf) },
            Err(err) => {
                tracing::warn!(error = %err, "ibv_dereg_mr failed: a READ buffer is leaked")
            }
        }
    }
}

/// Memory an RDMA READ may land in ([`crate::ibv::connection::IbvConnection::read_remote`]).
///
/// # Safety
/// `[addr(), addr() + len())` must be memory registered under `lkey()` with local write
/// access in the protection domain of the queue pair that reads into it, valid for as long
/// as the value lives, and not read or written through anything but the value.
pub unsafe trait ReadTarget: Send {
    /// The registration's local key.
    fn lkey(&self) -> u32;
    /// Where the memory starts (the address the registration uses: a device address for
    /// device memory).
    fn addr(&self) -> u64;
    /// Its length in bytes.
    fn len(&self) -> u64;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: the range is this region's own allocation, registered under `lkey` in the
// domain it was made in (a borrower makes it in its own domain with local write access);
// Rust only copies bytes out of it through `&self`, never while a read owns the region.
unsafe impl ReadTarget for HostRegion {
    fn lkey(&self) -> u32 {
        HostRegion::lkey(self)
    }

    fn addr(&self) -> u64 {
        HostRegion::addr(self)
    }

    fn len(&self) -> u64 {
        HostRegion::len(self) as u64
    }
}

// --- completions ----------------------------------------------------------------------

/// A completion channel (`ibv_create_comp_channel`): a file descriptor that becomes
/// readable when an armed completion queue gets a completion.
pub struct CompChannel {
    ptr: NonNull<IbvCompChannel>,
    context: Arc<Context>,
}

verbs_object!(CompChannel, destroy_comp_channel via |channel| channel.context.verbs, Sync);

impl fmt::Debug for CompChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompChannel")
            .field("fd", &self.as_raw_fd())
            .finish()
    }
}

impl AsRawFd for CompChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is alive; `fd` is not written after creation.
        unsafe { (*self.ptr.as_ptr()).fd }
    }
}

impl CompChannel {
    /// Makes `ibv_get_cq_event` return `EAGAIN` instead of blocking.
    ///
    /// # Errors
    /// `fcntl`'s errno.
    pub fn set_nonblocking(&self) -> io::Result<()> {
        let fd = self.as_raw_fd();
        // SAFETY: fcntl on the channel's open descriptor, no pointers.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// `ibv_get_cq_event`: takes one event, if there is one (a non-blocking channel
    /// answers at once). The event must be acknowledged on its CQ
    /// ([`CompletionQueue::ack_events`]); true when one was taken.
    pub fn get_event(&self) -> bool {
        let mut cq = ptr::null_mut();
        let mut cq_context = ptr::null_mut();
        // SAFETY: the channel is alive; the out-pointers are live locals.
        let rc = unsafe {
            (self.context.verbs.get_cq_event)(self.ptr.as_ptr(), &mut cq, &mut cq_context)
        };
        rc == 0
    }
}

/// A completion queue (`ibv_create_cq`). Every event taken from its channel must be
/// acknowledged ([`ack_events`](Self::ack_events)) before it is dropped, or
/// `ibv_destroy_cq` waits forever.
pub struct CompletionQueue {
    ptr: NonNull<IbvCq>,
    channel: Arc<CompChannel>,
    context: Arc<Context>,
}

verbs_object!(CompletionQueue, destroy_cq via |cq| cq.context.verbs, Sync);

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

/// The provider's operation `verb` from `context->ops`, or `Unsupported` when it has none.
fn provider_op<F>(op: Option<F>, verb: &str) -> io::Result<F> {
    op.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::Unsupported,
            format!("the verbs provider has no {verb} operation"),
        )
    })
}

impl CompletionQueue {
    /// `ibv_poll_cq` (through `context->ops`): fills the front of `out`, returns how many.
    ///
    /// # Errors
    /// The provider's error (`ibv_poll_cq` returned a negative value).
    pub fn poll(&self, out: &mut [WorkCompletion]) -> io::Result<usize> {
        let poll = provider_op(self.context.ops().poll_cq, "poll_cq")?;
        let n = c_int::try_from(out.len()).unwrap_or(c_int::MAX);
        // SAFETY: the CQ is alive; `out` holds at least `n` writable ibv_wc entries.
        let rc = unsafe { poll(self.ptr.as_ptr(), n, out.as_mut_ptr()) };
        if rc < 0 {
            return Err(io::Error::other(format!("ibv_poll_cq returned {rc}")));
        }
        Ok((rc as usize).min(out.len()))
    }

    /// `ibv_req_notify_cq(cq, 0)` (through `context->ops`): an event at the next
    /// completion.
    ///
    /// # Errors
    /// The provider's errno.
    pub fn req_notify(&self) -> io::Result<()> {
        let notify = provider_op(self.context.ops().req_notify_cq, "req_notify_cq")?;
        // SAFETY: the CQ is alive.
        check_rc(unsafe { notify(self.ptr.as_ptr(), 0) })
    }

    /// `ibv_ack_cq_events`: acknowledges `count` events taken from the channel.
    pub fn ack_events(&self, count: u32) {
        // SAFETY: the CQ is alive; the caller took exactly this many events for it.
        unsafe { (self.context.verbs.ack_cq_events)(self.ptr.as_ptr(), count) }
    }
}

// --- queue pairs ----------------------------------------------------------------------

/// The capabilities asked for at `ibv_create_qp`.
#[derive(Debug, Clone, Copy, Default)]
pub struct QpCaps {
    /// Send work requests.
    pub max_send_wr: u32,
    /// Receive work requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive.
    pub max_recv_sge: u32,
    /// Inline bytes per send.
    pub max_inline_data: u32,
}

/// The global route header to the peer (RoCE, or InfiniBand across subnets).
#[derive(Debug, Clone, Copy)]
pub struct GlobalRoute {
    /// The peer's GID.
    pub dgid: [u8; 16],
    /// Our GID index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
}

/// The attributes of the move to ready-to-receive.
#[derive(Debug, Clone, Copy)]
pub struct RtrAttr {
    /// Path MTU (`enum ibv_mtu`: 1 = 256 … 5 = 4096).
    pub path_mtu: u32,
    /// The peer's queue pair number.
    pub dest_qp_num: u32,
    /// The peer's first packet sequence number.
    pub rq_psn: u32,
    /// RDMA READs the peer may have in flight towards us.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Our port.
    pub port: u8,
    /// The peer's LID.
    pub dlid: u16,
    /// The route header, when GIDs are used.
    pub grh: Option<GlobalRoute>,
}

/// The attributes of the move to ready-to-send.
#[derive(Debug, Clone, Copy)]
pub struct RtsAttr {
    /// Our first packet sequence number.
    pub sq_psn: u32,
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7: infinite).
    pub rnr_retry: u8,
    /// RDMA READs we may have in flight.
    pub max_rd_atomic: u8,
}

/// Where the local bytes of a send work request are.
#[derive(Debug, Clone, Copy)]
pub enum Local<'a> {
    /// No bytes (an immediate alone).
    None,
    /// Copied into the work request (`IBV_SEND_INLINE`): the slice is not held after
    /// [`QueuePair::post_send`] returns.
    Inline(&'a [u8]),
    /// Registered memory, named by address, length and local key.
    Registered {
        /// Start address.
        addr: u64,
        /// Bytes.
        len: u32,
        /// Local key of the registration containing the range.
        lkey: u32,
    },
}

/// What a send work request does.
#[derive(Debug, Clone, Copy)]
pub enum SendOp {
    /// `IBV_WR_RDMA_WRITE` to `remote_addr` under `rkey`.
    Write {
        /// Peer address.
        remote_addr: u64,
        /// Peer key.
        rkey: u32,
    },
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`; `imm` in host byte order.
    WriteImm {
        /// Peer address.
        remote_addr: u64,
        /// Peer key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
    /// `IBV_WR_SEND_WITH_IMM`; `imm` in host byte order.
    SendImm {
        /// Immediate data.
        imm: u32,
    },
    /// `IBV_WR_RDMA_READ` from `remote_addr` under `rkey` into the local range.
    Read {
        /// Peer address.
        remote_addr: u64,
        /// Peer key.
        rkey: u32,
    },
}

/// One signaled send work request.
#[derive(Debug, Clone, Copy)]
pub struct SendRequest<'a> {
    /// Returned in its completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// The local bytes.
    pub local: Local<'a>,
}

/// Work requests posted together by one [`QueuePair::post_send`].
pub const MAX_SEND_CHAIN: usize = 4;

/// An RC queue pair (`ibv_create_qp`), destroyed on drop: after that the device touches
/// none of the memory its work requests named.
pub struct QueuePair {
    ptr: NonNull<IbvQp>,
    cq: Arc<CompletionQueue>,
    pd: Arc<ProtectionDomain>,
}

verbs_object!(QueuePair, destroy_qp via |qp| qp.verbs());

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num())
            .finish_non_exhaustive()
    }
}

impl QueuePair {
    fn verbs(&self) -> &'static Verbs {
        self.pd.context.verbs
    }

    /// The queue pair number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP is alive; `qp_num` is not written after creation.
        unsafe { (*self.ptr.as_ptr()).qp_num }
    }

    /// `ibv_query_qp(IBV_QP_CAP)`: the inline data the device granted.
    ///
    /// # Errors
    /// The call's errno.
    pub fn max_inline(&self) -> io::Result<u32> {
        let mut attr = IbvQpAttr::default();
        let mut init = IbvQpInitAttr {
            qp_context: ptr::null_mut(),
            send_cq: ptr::null_mut(),
            recv_cq: ptr::null_mut(),
            srq: ptr::null_mut(),
            cap: IbvQpCap::default(),
            qp_type: 0,
            sq_sig_all: 0,
        };
        // SAFETY: the QP is alive; both out-structs are valid and writable.
        check_rc(unsafe {
            (self.verbs().query_qp)(self.ptr.as_ptr(), &mut attr, QP_CAP, &mut init)
        })?;
        Ok(init.cap.max_inline_data.max(attr.cap.max_inline_data))
    }

    fn modify(&self, attr: &mut IbvQpAttr, mask: c_int) -> io::Result<()> {
        // SAFETY: the QP is alive; `attr` is a valid ibv_qp_attr for `mask`.
        check_rc(unsafe { (self.verbs().modify_qp)(self.ptr.as_ptr(), attr, mask) })
    }

    /// `ibv_modify_qp` to INIT on `port` (P_Key index 0) with `access` for the peer.
    ///
    /// # Errors
    /// The call's errno.
    pub fn to_init(&self, port: u8, access: AccessFlags) -> io::Result<()> {
        let mut attr = IbvQpAttr {
            qp_state: QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: access.0,
            ..IbvQpAttr::default()
        };
        self.modify(
            &mut attr,
            QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS,
        )
    }

    /// `ibv_modify_qp` to RTR.
    ///
    /// # Errors
    /// The call's errno.
    pub fn to_rtr(&self, rtr: &RtrAttr) -> io::Result<()> {
        let mut ah_attr = IbvAhAttr {
            dlid: rtr.dlid,
            port_num: rtr.port,
            ..IbvAhAttr::default()
        };
        if let Some(grh) = rtr.grh {
            ah_attr.is_global = 1;
            ah_attr.grh = IbvGlobalRoute {
                dgid: IbvGid(grh.dgid),
                flow_label: 0,
                sgid_index: grh.sgid_index,
                hop_limit: grh.hop_limit,
                traffic_class: 0,
            };
        }
        let mut attr = IbvQpAttr {
            qp_state: QPS_RTR,
            path_mtu: rtr.path_mtu,
            dest_qp_num: rtr.dest_qp_num,
            rq_psn: rtr.rq_psn,
            max_dest_rd_atomic: rtr.max_dest_rd_atomic,
            min_rnr_timer: rtr.min_rnr_timer,
            ah_attr,
            ..IbvQpAttr::default()
        };
        self.modify(
            &mut attr,
            QP_STATE
                | QP_AV
                | QP_PATH_MTU
                | QP_DEST_QPN
                | QP_RQ_PSN
                | QP_MAX_DEST_RD_ATOMIC
                | QP_MIN_RNR_TIMER,
        )
    }

    /// `ibv_modify_qp` to RTS.
    ///
    /// # Errors
    /// The call's errno.
    pub fn to_rts(&self, rts: &RtsAttr) -> io::Result<()> {
        let mut attr = IbvQpAttr {
            qp_state: QPS_RTS,
            sq_psn: rts.sq_psn,
            timeout: rts.timeout,
            retry_cnt: rts.retry_cnt,
            rnr_retry: rts.rnr_retry,
            max_rd_atomic: rts.max_rd_atomic,
            ..IbvQpAttr::default()
        };
        self.modify(
            &mut attr,
            QP_STATE | QP_SQ_PSN | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// `ibv_modify_qp` to the error state: posted work requests complete with
    /// `IBV_WC_WR_FLUSH_ERR`.
    ///
    /// # Errors
    /// The call's errno.
    pub fn to_error(&self) -> io::Result<()> {
        let mut attr = IbvQpAttr {
            qp_state: QPS_ERR,
            ..IbvQpAttr::default()
        };
        self.modify(&mut attr, QP_STATE)
    }

    /// `ibv_post_send` (through `context->ops`) of up to [`MAX_SEND_CHAIN`] signaled work
    /// requests, chained in order.
    ///
    /// Safe because the device checks each local range against its key (a range outside
    /// the registration fails the work request with `IBV_WC_LOC_PROT_ERR`), every safe
    /// registration owns its memory until the device can no longer touch it, and inline
    /// bytes are copied during the call.
    ///
    /// # Errors
    /// `InvalidInput` for an empty or too long chain, or a READ without a registered local
    /// range; otherwise the provider's errno.
    pub fn post_send(&self, requests: &[SendRequest<'_>]) -> io::Result<()> {
        if requests.is_empty() || requests.len() > MAX_SEND_CHAIN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a send chain holds 1 to 4 work requests",
            ));
        }
        let post = provider_op(self.pd.context.ops().post_send, "post_send")?;
        let mut sges = [IbvSge::default(); MAX_SEND_CHAIN];
        let mut wrs = [IbvSendWr::zeroed(); MAX_SEND_CHAIN];
        for (i, request) in requests.iter().enumerate() {
            let wr = &mut wrs[i];
            wr.wr_id = request.wr_id;
            wr.send_flags = SEND_SIGNALED;
            match request.op {
                SendOp::Write { remote_addr, rkey } => {
                    wr.opcode = WR_RDMA_WRITE;
                    wr.set_rdma(remote_addr, rkey);
                }
                SendOp::WriteImm {
                    remote_addr,
                    rkey,
                    imm,
                } => {
                    wr.opcode = WR_RDMA_WRITE_WITH_IMM;
                    wr.imm_data = imm.to_be();
                    wr.set_rdma(remote_addr, rkey);
                }
                SendOp::SendImm { imm } => {
                    wr.opcode = WR_SEND_WITH_IMM;
                    wr.imm_data = imm.to_be();
                }
                SendOp::Read { remote_addr, rkey } => {
                    if !matches!(request.local, Local::Registered { .. }) {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidInput,
                            "an RDMA READ needs a registered local range",
                        ));
                    }
                    wr.opcode = WR_RDMA_READ;
                    wr.set_rdma(remote_addr, rkey);
                }
            }
            let (addr, length, lkey) = match request.local {
                Local::None => continue,
                Local::Inline(bytes) => {
                    let len = u32::try_from(bytes.len()).map_err(|_| {
                        io::Error::new(io::ErrorKind::InvalidInput, "inline data too long")
                    })?;
                    wr.send_flags |= SEND_INLINE;
                    (bytes.as_ptr() as u64, len, 0)
                }
                Local::Registered { addr, len, lkey } => (addr, len, lkey),
            };
            sges[i] = IbvSge { addr, length, lkey };
            wr.num_sge = 1;
        }
        let n = requests.len();
        let base = wrs.as_mut_ptr();
        let sge_base = sges.as_mut_ptr();
        for i in 0..n {
            // SAFETY: `i` and `i + 1` (when < n) are inside the arrays; the pointers are
            // into locals that outlive the call below.
            unsafe {
                let wr = &mut *base.add(i);
                if wr.num_sge > 0 {
                    wr.sg_list = sge_base.add(i);
                }
                if i + 1 < n {
                    wr.next = base.add(i + 1);
                }
            }
        }
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is alive; the chain of `n` work requests and their scatter lists
        // are valid for the call; inline bytes are copied by the provider during it, and
        // registered ranges are checked by the device against their keys.
        check_rc(unsafe { post(self.ptr.as_ptr(), base, &mut bad) })
    }

    /// `ibv_post_recv` (through `context->ops`) of one receive work request without a
    /// scatter list: for writes with immediate and zero-byte sends.
    ///
    /// # Errors
    /// The provider's errno.
    pub fn post_recv_empty(&self, wr_id: u64) -> io::Result<()> {
        let post = provider_op(self.pd.context.ops().post_recv, "post_recv")?;
        let mut wr = IbvRecvWr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is alive; the work request is valid for the call and names no
        // memory.
        check_rc(unsafe { post(self.ptr.as_ptr(), &mut wr, &mut bad) })
    }

    /// The completion queue of its sends and receives.
    pub fn cq(&self) -> &Arc<CompletionQueue> {
        &self.cq
    }
}

// --- descriptors ----------------------------------------------------------------------

/// `poll(2)` for readability of `fds` for at most `timeout_ms` (-1: no limit); the
/// `revents` of each, in order, or `None` on timeout. `EINTR` counts as a timeout.
///
/// # Errors
/// `poll`'s errno.
pub fn poll_readable(fds: &[BorrowedFd<'_>], timeout_ms: i32) -> io::Result<Option<Vec<bool>>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `pfds` is a valid array of `pfds.len()` pollfds whose descriptors are open
    // (borrowed for this call).
    let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::Interrupted {
            return Ok(None);
        }
        return Err(err);
    }
    if rc == 0 {
        return Ok(None);
    }
    Ok(Some(pfds.iter().map(|p| p.revents != 0).collect()))
}

/// A `BorrowedFd` for the completion channel's descriptor.
pub fn comp_channel_fd(channel: &CompChannel) -> BorrowedFd<'_> {
    // SAFETY: the descriptor is open while the channel lives, which the borrow ensures.
    unsafe { BorrowedFd::borrow_raw(channel.as_raw_fd()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        let err = check_library_at("/nonexistent/libibverbs.so.1").unwrap_err();
        assert!(matches!(err, LibraryError::Load { .. }), "{err:?}");
        assert!(
            err.to_string().contains("/nonexistent/libibverbs.so.1"),
            "{err}"
        );
    }

    #[test]
    fn a_library_without_the_verbs_names_the_missing_symbol() {
        // libc loads, but has no ibv_get_device_list.
        let err = check_library_at("libc.so.6").unwrap_err();
        assert!(
            matches!(
                err,
                LibraryError::MissingSymbol {
                    symbol: "ibv_get_device_list",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("has no symbol ibv_get_device_list"),
            "{err}"
        );
    }

    #[test]
    fn rdma_fields_land_where_verbs_h_puts_them() {
        let mut wr = IbvSendWr::zeroed();
        wr.set_rdma(0x1122_3344_5566_7788, 0xaabb_ccdd);
        // SAFETY: reading the bytes of a plain-data struct.
        let bytes: [u8; 128] = unsafe { mem::transmute(wr) };
        assert_eq!(&bytes[40..48], &0x1122_3344_5566_7788u64.to_ne_bytes());
        assert_eq!(&bytes[48..52], &0xaabb_ccddu32.to_ne_bytes());
    }

    #[test]
    fn access_flags_combine() {
        let both = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        assert_eq!(both.bits(), 5);
        assert!(both.contains(AccessFlags::REMOTE_READ));
        assert!(!both.contains(AccessFlags::REMOTE_WRITE));
    }

    #[test]
    fn host_region_copies_are_bounds_checked_without_a_device() {
        // PageMemory alone: registration needs a device.
        let memory = PageMemory::new(64).unwrap();
        assert_eq!(memory.layout.size(), 64);
        assert!(PageMemory::new(0).is_err());
    }

    #[test]
    fn poll_readable_reports_a_readable_pipe() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (reader, mut writer) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(poll_readable(&[reader.as_fd()], 0).unwrap(), None);
        writer.write_all(b"x").unwrap();
        assert_eq!(
            poll_readable(&[reader.as_fd()], 1000).unwrap(),
            Some(vec![true])
        );
    }
}
