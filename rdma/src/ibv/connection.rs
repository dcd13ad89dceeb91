//! One RC queue pair connected to a peer, moving small messages through registered rings.
//!
//! [`IbvConnection::connect`] opens the selected device, creates a protection domain, a
//! completion queue with a completion channel, an RC queue pair and two registered rings
//! (a receive ring the peer writes into, and a send staging ring that mirrors the peer's),
//! exchanges [`ConnectionInfo`] over any `Read + Write`
//! bootstrap stream and moves the queue pair through INIT → RTR → RTS.
//!
//! Messages: [`IbvConnection::send`] places a message in the peer's ring (see
//! [`ring`](super::ring)) with one RDMA write-with-immediate whose immediate is the length
//! (two writes when it wraps), inline when it fits the queue pair's `max_inline_data`, and
//! otherwise staged in the registered send ring. It blocks while the peer's ring or receive
//! slots are full: credits come back as zero-byte sends-with-immediate carrying the count
//! of messages the peer consumed. [`IbvConnection::recv`] copies the next message out of the
//! receive ring and acknowledges.
//!
//! Completions are busy-polled for [`ConnectionOptions::spin`], then the connection arms the
//! completion queue and sleeps on the completion channel's file descriptor. A failed work
//! completion fails the connection for good, with the operation and the status name (for
//! example `IBV_WC_RETRY_EXC_ERR`); every later call returns the same error.
//!
//! Ownership: the rings are owned by the connection and registered for its whole life; the
//! queue pair is destroyed first on drop, so the device never touches freed memory. Inline
//! sends copy the caller's bytes into the work request, so no caller buffer is ever held by
//! the device after `send` returns.
//!
//! Large messages are zero-copy: [`IbvConnection::send_buffer`] takes shared ownership of the
//! caller's buffer, registers it (through a [`RegistrationCache`] keyed by address range)
//! and sends only a [`LargeDescriptor`] through the ring; the receiver fetches the bytes
//! with RDMA READ straight into the `Vec` it returns, then acknowledges. The sender keeps
//! the buffer (and its registration) until that acknowledgement, so neither side copies
//! and no buffer is released while the device may still read or write it, even when the
//! caller times out or drops its own handle.
//!
//! Event loops that also wait for other things (the RPC transport's driver thread, in
//! [`transport`](super::transport)) use the non-blocking calls instead:
//! [`IbvConnection::try_send_owned`] (zero-copy above the threshold, registration not
//! cached: for buffers sent once), [`IbvConnection::try_recv`], and [`IbvConnection::wait`],
//! which sleeps on the completion channel *and* the caller's file descriptors.
//!
//! One-sided reads of memory the peer lent: [`IbvConnection::read_remote`] READs a range the
//! peer registered (address and rkey, learnt out of band) into caller-registered memory
//! (host or device). For that both sides' registrations must live in the protection
//! domain of their queue pair: [`IbvConnection::connect_in`] makes the connection in a shared
//! [`VerbsDomain`]. This is the data path of `cuda_gdr` ([`super::lending`]).
//!
//! Not here: a shared receive queue across peers, receiving ring messages into
//! caller-provided memory, and reconnection.

use std::collections::VecDeque;
use std::fmt;
use std::io::{self, Read, Write};
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::sys::{
    self, AccessFlags, CompChannel, CompletionQueue, Context, DeviceList, GlobalRoute, HostRegion,
    Local, ProtectionDomain, QpCaps, QueuePair, ReadTarget, RegisteredVec, RtrAttr, RtsAttr,
    SendOp, SendRequest, SharedRegistration, WorkCompletion,
};
use tracing::debug;

use super::regcache::RegistrationCache;
use super::ring::{Placement, RingError, RingReceiver, RingSender};
use super::select::IbvSelection;
use super::topology::Mtu;
use super::wc_status::wc_status_name;
use super::wire::{
    self, ConnectionInfo, ExchangeError, LargeDescriptor, MessageImm, DESCRIPTOR_LEN, MAX_24BIT,
    MAX_RING_LEN,
};

/// Default receive ring size: 64 KiB per direction.
pub const DEFAULT_RING_LEN: u32 = 64 * 1024;
/// Default receive slots (messages in flight per direction).
pub const DEFAULT_RECV_SLOTS: u32 = 64;
/// Messages of at least this many bytes given to [`IbvConnection::send_buffer`] go zero-copy
/// (descriptor in the ring, data by RDMA READ); smaller ones are copied through the ring.
///
/// 16 KiB is where, on InfiniBand and RoCE NICs, one registration-cache hit plus a READ
/// round trip usually becomes cheaper than two memcpys (UCX and NCCL switch protocols in
/// the 8-64 KiB range). It has not been measured on hardware here: the only verbs stack
/// available is Soft-RoCE under TCG, whose timings say nothing about NICs. Re-measure with
/// `rdzv bench rpc --transport ibv` on real hardware.
pub const ZERO_COPY_THRESHOLD: usize = 16 * 1024;
/// Registrations kept by the sender's cache.
pub const REGISTRATION_CACHE_ENTRIES: usize = 64;
/// How long a failed [`IbvConnection::read_remote`] waits for its other READs to be flushed.
pub const READ_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Inline data requested when creating the queue pair; the device may grant less.
pub const REQUESTED_MAX_INLINE: u32 = 256;

/// Tunables of one connection.
#[derive(Debug, Clone)]
pub struct ConnectionOptions {
    /// Receive ring size in bytes (a power of two): the largest message.
    pub ring_len: u32,
    /// Receive work requests for messages (messages in flight per direction).
    pub recv_slots: u32,
    /// How long to busy-poll the completion queue before sleeping on the connection.
    pub spin: Duration,
    /// Local ACK timeout exponent (`4.096 µs × 2^timeout`), 1 to 31.
    pub ack_timeout: u8,
    /// Transport retries before a send fails with `IBV_WC_RETRY_EXC_ERR`, 0 to 7.
    pub retry_count: u8,
    /// Largest zero-copy message this side accepts (the receiver allocates that much).
    pub max_large_message: u64,
}

impl Default for ConnectionOptions {
    fn default() -> Self {
        ConnectionOptions {
            ring_len: DEFAULT_RING_LEN,
            recv_slots: DEFAULT_RECV_SLOTS,
            spin: Duration::from_micros(50),
            ack_timeout: 14,
            retry_count: 7,
            max_large_message: 1 << 32,
        }
    }
}

/// A work completion that failed: which operation, and the status the device reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletionFailure {
    /// The operation whose work request failed (e.g. `RDMA write with immediate`).
    pub operation: &'static str,
    /// `ibv_wc.status`.
    pub status: u32,
    /// `ibv_wc.vendor_err`.
    pub vendor_err: u32,
    /// Device name.
    pub device: String,
    /// Local queue pair number.
    pub qpn: u32,
}

impl CompletionFailure {
    /// The `IBV_WC_*` name of the status, if known.
    pub fn status_name(&self) -> Option<&'static str> {
        wc_status_name(self.status)
    }
}

impl fmt::Display for CompletionFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed with ", self.operation)?;
        match self.status_name() {
            Some(name) => f.write_str(name)?,
            None => write!(f, "status {}", self.status)?,
        }
        write!(
            f,
            " (vendor error {:#x}) on RDMA device {} QP {:#x}",
            self.vendor_err, self.device, self.qpn
        )
    }
}

/// Errors of an [`IbvConnection`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectionError {
    /// The selected device is not in the device list any more.
    #[error("RDMA device {device} is not present")]
    DeviceNotFound {
        /// Device name.
        device: String,
    },
    /// A verb failed when it was called.
    #[error("{verb} failed on RDMA device {device}")]
    Verb {
        /// The verb (`ibv_create_qp`, `ibv_modify_qp(RTR)`, `ibv_post_send`, …).
        verb: &'static str,
        /// Device name.
        device: String,
        /// errno, or why libibverbs could not be used.
        #[source]
        source: io::Error,
    },
    /// Exchanging connection records over the bootstrap stream failed.
    #[error("RDMA connection setup with the peer failed")]
    Exchange(#[from] ExchangeError),
    /// The final synchronisation over the bootstrap stream failed.
    #[error("RDMA connection setup: the peer did not confirm over the bootstrap stream")]
    Bootstrap(#[source] io::Error),
    /// A work completion failed; the connection is unusable from then on.
    #[error("{0}")]
    Completion(CompletionFailure),
    /// The peer broke the ring protocol.
    #[error("RDMA peer protocol violation")]
    Protocol(#[from] RingError),
    /// The peer's large-message descriptor is malformed or too large.
    #[error("the RDMA peer announced a large message of {len} bytes (limit {max}, descriptor {descriptor_len} bytes)")]
    BadDescriptor {
        /// Announced length (0 when the descriptor did not parse).
        len: u64,
        /// [`ConnectionOptions::max_large_message`], or the smaller limit the caller gave
        /// [`IbvConnection::try_recv_within`].
        max: u64,
        /// Ring bytes of the descriptor.
        descriptor_len: u32,
    },
    /// The message is larger than the peer's ring (use [`IbvConnection::send_buffer`]).
    #[error("a {len}-byte message exceeds the RDMA ring size of {max} bytes")]
    MessageTooLarge {
        /// Message length.
        len: usize,
        /// Ring size.
        max: u32,
    },
    /// Nothing happened within the caller's timeout.
    #[error("RDMA {operation} timed out after {after:?}")]
    Timeout {
        /// `send`, `recv` or `flush`.
        operation: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// The options are out of range.
    #[error("invalid RDMA connection options: {0}")]
    Options(&'static str),
    /// The memory for an admitted message could not be allocated.
    #[error("cannot allocate {len} bytes for a message from the RDMA peer")]
    OutOfMemory {
        /// The message's length.
        len: usize,
    },
}

/// `len` zeroed bytes, allocated fallibly: an admitted message of an impossible size is
/// the connection's error, not an abort.
fn zeroed(len: usize) -> Result<Vec<u8>, ConnectionError> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(len)
        .map_err(|_| ConnectionError::OutOfMemory { len })?;
    buf.resize(len, 0);
    Ok(buf)
}

/// An opened verbs device and one protection domain on it, shared by the connections made
/// with [`IbvConnection::connect_in`] and by the memory registered for one-sided READs
/// through them (a READ names memory by a key of the target queue pair's protection
/// domain). Clones share the device and the domain.
#[derive(Clone)]
pub struct VerbsDomain {
    pd: Arc<ProtectionDomain>,
    context: Arc<Context>,
    device: String,
}

impl fmt::Debug for VerbsDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsDomain")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl VerbsDomain {
    /// Opens `selection`'s device and allocates a protection domain on it.
    ///
    /// # Errors
    /// The device is gone, or `ibv_open_device` or `ibv_alloc_pd` failed.
    pub fn open(selection: &IbvSelection) -> Result<VerbsDomain, ConnectionError> {
        let dev = selection.device.as_str();
        let list = DeviceList::new().map_err(|e| verb_err("ibv_get_device_list", dev, e))?;
        let index = list
            .find(dev)
            .ok_or_else(|| ConnectionError::DeviceNotFound { device: dev.into() })?;
        let context = list
            .open(index)
            .map_err(|e| verb_err("ibv_open_device", dev, e))?;
        let pd = context
            .alloc_pd()
            .map_err(|e| verb_err("ibv_alloc_pd", dev, e))?;
        Ok(VerbsDomain {
            pd,
            context,
            device: dev.to_owned(),
        })
    }

    /// The protection domain (to register memory in it).
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        &self.device
    }
}

/// Kinds of work request, in the top byte of `wr_id`.
const WR_RECV: u64 = 1 << 56;
const WR_DATA: u64 = 2 << 56;
const WR_ACK: u64 = 3 << 56;
const WR_READ: u64 = 4 << 56;
const WR_REMOTE_READ: u64 = 5 << 56;
const WR_KIND_MASK: u64 = 0xff << 56;

/// Completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 16;

/// The ring's byte range `[offset, offset + len)` appended to `out`. The peer's
/// write-with-immediate for this range has completed, and credits keep it from writing
/// there until acknowledged.
fn read_ring(ring: &HostRegion, offset: u32, len: u32, out: &mut Vec<u8>) {
    ring.read_at(offset as usize, len as usize, out);
}

/// A registration of a caller's buffer, which keeps the buffer alive so that the address
/// range cannot be freed or reused while registered.
type CachedRegion = SharedRegistration;

/// A zero-copy message sent and not yet acknowledged: its registration (and buffer) stay.
struct LargeSend {
    seq: u64,
    _region: Arc<CachedRegion>,
}

/// An RDMA READ of a large message into memory the connection owns until it completes.
struct PendingRead {
    /// Destination, written by the device and handed back once every READ completed;
    /// `None` for an empty message.
    buf: Option<RegisteredVec>,
    source: LargeDescriptor,
    /// Bytes for which a READ was posted.
    posted: u64,
    /// READ work requests not completed yet.
    in_flight: u32,
}

/// One connected RC queue pair with a small-message ring per direction.
///
/// Field order is drop order: the queue pair goes first (the device stops touching the
/// rings), then the completion queue and channel, then the memory regions, then the ring
/// memory itself.
pub struct IbvConnection {
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    comp_channel: Arc<CompChannel>,
    recv_ring: HostRegion,
    send_ring: HostRegion,
    /// Zero-copy state, after the queue pair in drop order.
    pending_read: Option<PendingRead>,
    large_in_flight: VecDeque<LargeSend>,
    registrations: RegistrationCache<Arc<CachedRegion>>,
    pd: Arc<ProtectionDomain>,
    _context: Arc<Context>,
    device: String,
    qpn: u32,
    peer: ConnectionInfo,
    tx: RingSender,
    rx: RingReceiver,
    max_inline: u32,
    max_send_wr: u32,
    max_msg_size: u64,
    max_large_message: u64,
    outstanding_sends: u32,
    /// One-sided READs of [`IbvConnection::read_remote`] posted and not completed.
    remote_reads_in_flight: u32,
    /// Messages sent, and messages the peer acknowledged.
    sent_seq: u64,
    acked_seq: u64,
    /// Immediates (lengths) of messages that arrived and were not read yet.
    arrived: VecDeque<u32>,
    /// CQ events received and not acknowledged with ibv_ack_cq_events.
    unacked_events: u32,
    armed: bool,
    spin: Duration,
    failure: Option<CompletionFailure>,
}

impl fmt::Debug for IbvConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbvConnection")
            .field("device", &self.device)
            .field("qpn", &self.qpn)
            .field("peer", &self.peer)
            .field("max_inline", &self.max_inline)
            .field("failure", &self.failure)
            .field("outstanding_sends", &self.outstanding_sends)
            .field("free_bytes", &self.tx.free_bytes())
            .field("free_slots", &self.tx.free_slots())
            .field("unacked", &self.rx.unacked())
            .field("arrived", &self.arrived.len())
            .field("large_in_flight", &self.large_in_flight.len())
            .field(
                "pending_read",
                &self
                    .pending_read
                    .as_ref()
                    .map(|p| (p.source.len, p.posted, p.in_flight)),
            )
            .field("armed", &self.armed)
            .finish_non_exhaustive()
    }
}

/// The length of the zero-copy message that `source` announces, if the receiver may
/// allocate that much: at most `max` bytes, addressable here, and not wrapping around the
/// sender's address space. Called before anything is allocated for the message.
///
/// # Errors
/// [`ConnectionError::BadDescriptor`] with the announced length and `max`.
pub(crate) fn admit_large(
    source: &LargeDescriptor,
    max: u64,
    descriptor_len: u32,
) -> Result<usize, ConnectionError> {
    let refused = ConnectionError::BadDescriptor {
        len: source.len,
        max,
        descriptor_len,
    };
    if source.len > max || source.addr.checked_add(source.len).is_none() {
        return Err(refused);
    }
    usize::try_from(source.len).map_err(|_| refused)
}

fn verb_err(verb: &'static str, device: &str, source: impl Into<io::Error>) -> ConnectionError {
    ConnectionError::Verb {
        verb,
        device: device.to_owned(),
        source: source.into(),
    }
}

/// `enum ibv_mtu`.
fn verbs_mtu(mtu: Mtu) -> u32 {
    match mtu {
        Mtu::B256 => 1,
        Mtu::B512 => 2,
        Mtu::B1024 => 3,
        Mtu::B2048 => 4,
        Mtu::B4096 => 5,
    }
}

/// A first packet sequence number that differs between connections.
fn initial_psn() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (nanos ^ std::process::id().rotate_left(12)) & MAX_24BIT
}

impl ConnectionOptions {
    /// Checks the options' ranges.
    fn check(&self) -> Result<(), ConnectionError> {
        if !self.ring_len.is_power_of_two()
            || self.ring_len > MAX_RING_LEN
            || (self.ring_len as usize) < DESCRIPTOR_LEN
        {
            return Err(ConnectionError::Options(
                "ring_len must be a power of two from 32 bytes to 1 GiB",
            ));
        }
        if self.recv_slots == 0 || self.recv_slots > 4096 {
            return Err(ConnectionError::Options(
                "recv_slots must be from 1 to 4096",
            ));
        }
        if self.ack_timeout == 0 || self.ack_timeout > 31 || self.retry_count > 7 {
            return Err(ConnectionError::Options(
                "ack_timeout must be 1 to 31 and retry_count 0 to 7",
            ));
        }
        Ok(())
    }
}

impl IbvConnection {
    /// Connects to the peer at the other end of `bootstrap`, which must call `connect` too
    /// (the exchange is symmetric). Blocks until both queue pairs are ready to send.
    pub fn connect<S: Read + Write + ?Sized>(
        selection: &IbvSelection,
        bootstrap: &mut S,
        options: &ConnectionOptions,
    ) -> Result<Self, ConnectionError> {
        options.check()?;
        let domain = VerbsDomain::open(selection)?;
        Self::connect_in(&domain, selection, bootstrap, options)
    }

    /// As [`connect`](Self::connect), with the queue pair in `domain`'s protection
    /// domain, so that memory registered there ([`VerbsDomain::pd`]) can be the target of
    /// the peer's one-sided READs ([`read_remote`](Self::read_remote)), and this side's
    /// READs can land in it. `domain` must be opened on `selection`'s device.
    pub fn connect_in<S: Read + Write + ?Sized>(
        domain: &VerbsDomain,
        selection: &IbvSelection,
        bootstrap: &mut S,
        options: &ConnectionOptions,
    ) -> Result<Self, ConnectionError> {
        options.check()?;
        if domain.device != selection.device {
            return Err(ConnectionError::Options(
                "the verbs domain is open on another device than the selection's",
            ));
        }
        let dev = selection.device.as_str();
        let gid_index = u8::try_from(selection.gid_index)
            .map_err(|_| ConnectionError::Options("GID index above 255"))?;
        let context = Arc::clone(&domain.context);
        let pd = Arc::clone(&domain.pd);

        let ring_len = options.ring_len as usize;
        let recv_ring = HostRegion::register(
            &pd,
            ring_len,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )
        .map_err(|e| verb_err("ibv_reg_mr (receive ring)", dev, e))?;
        let send_ring = HostRegion::register(&pd, ring_len, AccessFlags::LOCAL_WRITE)
            .map_err(|e| verb_err("ibv_reg_mr (send ring)", dev, e))?;

        let comp_channel = context
            .create_comp_channel()
            .map_err(|e| verb_err("ibv_create_comp_channel", dev, e))?;
        comp_channel
            .set_nonblocking()
            .map_err(|e| verb_err("fcntl(O_NONBLOCK) on the completion channel", dev, e))?;
        let max_recv_wr = 2 * options.recv_slots;
        let max_send_wr = 3 * options.recv_slots + 2;
        let cq = context
            .create_cq(max_recv_wr + max_send_wr, &comp_channel)
            .map_err(|e| verb_err("ibv_create_cq", dev, e))?;

        let build = |inline: u32| {
            pd.create_rc_qp(
                &cq,
                QpCaps {
                    max_send_wr,
                    max_recv_wr,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: inline,
                },
            )
        };
        // A device without inline support rejects a nonzero request: retry without.
        let qp = match build(REQUESTED_MAX_INLINE) {
            Ok(qp) => qp,
            Err(_) => build(0).map_err(|e| verb_err("ibv_create_qp", dev, e))?,
        };
        let max_inline = qp
            .max_inline()
            .map_err(|e| verb_err("ibv_query_qp", dev, e))?;
        let qpn = qp.qp_num();

        qp.to_init(
            selection.port,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .map_err(|e| verb_err("ibv_modify_qp(INIT)", dev, e))?;

        let mut connection = IbvConnection {
            qp,
            cq,
            comp_channel,
            recv_ring,
            send_ring,
            pending_read: None,
            large_in_flight: VecDeque::new(),
            registrations: RegistrationCache::new(REGISTRATION_CACHE_ENTRIES),
            pd,
            _context: context,
            device: dev.to_owned(),
            qpn,
            // Replaced once the peer's record is in.
            peer: ConnectionInfo {
                lid: 0,
                gid: selection.gid,
                qpn: 0,
                psn: 0,
                mtu: Mtu::B256,
                ring_addr: 0,
                ring_len: options.ring_len,
                ring_rkey: 0,
                recv_slots: options.recv_slots,
            },
            tx: RingSender::new(options.ring_len, options.recv_slots)?,
            rx: RingReceiver::new(options.ring_len, options.recv_slots)?,
            max_inline,
            max_send_wr,
            max_msg_size: u64::from(selection.max_msg_size.max(1)),
            max_large_message: options.max_large_message,
            outstanding_sends: 0,
            remote_reads_in_flight: 0,
            sent_seq: 0,
            acked_seq: 0,
            arrived: VecDeque::new(),
            unacked_events: 0,
            armed: false,
            spin: options.spin,
            failure: None,
        };
        // Receive work requests go in before the peer can possibly send.
        for _ in 0..max_recv_wr {
            connection.post_recv()?;
        }

        let ours = ConnectionInfo {
            lid: selection.lid,
            gid: selection.gid,
            qpn,
            psn: initial_psn(),
            mtu: selection.active_mtu.unwrap_or(Mtu::B1024),
            ring_addr: connection.recv_ring.addr(),
            ring_len: options.ring_len,
            ring_rkey: connection.recv_ring.rkey(),
            recv_slots: options.recv_slots,
        };
        let peer = wire::exchange(bootstrap, &ours)?;
        debug!(
            device = dev,
            qpn,
            peer_qpn = peer.qpn,
            "RDMA connection records exchanged"
        );
        connection.tx = RingSender::new(peer.ring_len, peer.recv_slots)?;
        connection.peer = peer;

        let grh = (!peer.gid.is_zero() && !selection.gid.is_zero()).then_some(GlobalRoute {
            dgid: peer.gid.0,
            sgid_index: gid_index,
            hop_limit: 64,
        });
        connection
            .qp
            .to_rtr(&RtrAttr {
                path_mtu: verbs_mtu(ours.mtu.min(peer.mtu)),
                dest_qp_num: peer.qpn,
                rq_psn: peer.psn,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
                port: selection.port,
                dlid: peer.lid,
                grh,
            })
            .map_err(|e| verb_err("ibv_modify_qp(RTR)", dev, e))?;
        connection
            .qp
            .to_rts(&RtsAttr {
                sq_psn: ours.psn,
                timeout: options.ack_timeout,
                retry_cnt: options.retry_count,
                rnr_retry: 7,
                max_rd_atomic: 1,
            })
            .map_err(|e| verb_err("ibv_modify_qp(RTS)", dev, e))?;

        // Neither side writes before the other is ready to receive.
        let mut byte = [1u8];
        bootstrap
            .write_all(&byte)
            .and_then(|()| bootstrap.flush())
            .and_then(|()| bootstrap.read_exact(&mut byte))
            .map_err(ConnectionError::Bootstrap)?;
        debug!(device = dev, qpn, max_inline, "RDMA connection ready");
        Ok(connection)
    }

    /// The largest message [`send`](Self::send) accepts: the peer's ring size.
    pub fn max_message_len(&self) -> usize {
        self.tx.ring_len() as usize
    }

    /// Inline data the queue pair supports; messages up to this size are sent inline.
    pub fn max_inline(&self) -> u32 {
        self.max_inline
    }

    /// This side's queue pair number.
    pub fn qp_number(&self) -> u32 {
        self.qpn
    }

    /// The peer's connection record.
    pub fn peer(&self) -> &ConnectionInfo {
        &self.peer
    }

    /// The failure that ended the connection, if any.
    pub fn failure(&self) -> Option<&CompletionFailure> {
        self.failure.as_ref()
    }

    /// Sends one message through the ring (copied), blocking while the peer's ring has no
    /// room for it. Messages above [`max_message_len`](Self::max_message_len) need
    /// [`send_buffer`](Self::send_buffer).
    pub fn send(&mut self, msg: &[u8]) -> Result<(), ConnectionError> {
        self.send_ring_message(msg, false, None)
    }

    /// [`send`](Self::send), giving up with [`ConnectionError::Timeout`] when no credit comes
    /// back within `timeout`. Nothing is sent then.
    pub fn send_timeout(&mut self, msg: &[u8], timeout: Duration) -> Result<(), ConnectionError> {
        self.send_ring_message(msg, false, Some((Instant::now() + timeout, timeout)))
    }

    /// Sends `buf`, zero-copy when it has at least [`ZERO_COPY_THRESHOLD`] bytes or does
    /// not fit the ring: the buffer is registered (or found in the registration cache) and
    /// the peer reads it with RDMA READ. The connection keeps `buf` alive and registered until
    /// the peer acknowledges the message, whatever the caller does with its own handle.
    /// Blocks only for ring credit, like [`send`](Self::send); [`flush`](Self::flush) waits
    /// for the peer to have read everything.
    pub fn send_buffer<B>(&mut self, buf: Arc<B>) -> Result<(), ConnectionError>
    where
        B: AsRef<[u8]> + Send + Sync + 'static,
    {
        self.send_buffer_deadline(buf, None)
    }

    /// [`send_buffer`](Self::send_buffer) with a timeout on waiting for ring credit.
    pub fn send_buffer_timeout<B>(
        &mut self,
        buf: Arc<B>,
        timeout: Duration,
    ) -> Result<(), ConnectionError>
    where
        B: AsRef<[u8]> + Send + Sync + 'static,
    {
        self.send_buffer_deadline(buf, Some((Instant::now() + timeout, timeout)))
    }

    fn send_buffer_deadline<B>(
        &mut self,
        buf: Arc<B>,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<(), ConnectionError>
    where
        B: AsRef<[u8]> + Send + Sync + 'static,
    {
        let bytes: &[u8] = (*buf).as_ref();
        if bytes.len() < ZERO_COPY_THRESHOLD && bytes.len() <= self.tx.ring_len() as usize {
            return self.send_ring_message(bytes, false, deadline);
        }
        self.check_failed()?;
        let (addr, len) = (bytes.as_ptr() as u64, bytes.len() as u64);
        let region = self.register_for_send(buf, true)?;
        self.send_descriptor(
            LargeDescriptor {
                addr,
                len,
                rkey: region.rkey(),
            },
            region,
            deadline,
        )
    }

    /// The registration of `buf` for the peer's RDMA READ: from the cache when `cached`
    /// and it hits, else a new one (cached when `cached`).
    fn register_for_send<B>(
        &mut self,
        buf: Arc<B>,
        cached: bool,
    ) -> Result<Arc<CachedRegion>, ConnectionError>
    where
        B: AsRef<[u8]> + Send + Sync + 'static,
    {
        let bytes: &[u8] = (*buf).as_ref();
        let (addr, len) = (bytes.as_ptr() as u64, bytes.len() as u64);
        if cached {
            if let Some(region) = self.registrations.lookup(addr, len) {
                return Ok(Arc::clone(region));
            }
        }
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = buf.clone();
        let region = Arc::new(
            SharedRegistration::register(&self.pd, owner)
                .map_err(|e| verb_err("ibv_reg_mr (zero-copy send)", &self.device, e))?,
        );
        if cached {
            // Displaced registrations still used by messages in flight stay alive
            // through their LargeSend.
            drop(self.registrations.insert(addr, len, Arc::clone(&region)));
        }
        Ok(region)
    }

    /// Sends `descriptor` (a buffer inside `region`) and keeps the registration (and the
    /// buffer) until the peer acknowledges the message.
    fn send_descriptor(
        &mut self,
        descriptor: LargeDescriptor,
        region: Arc<CachedRegion>,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<(), ConnectionError> {
        self.send_ring_message(&descriptor.encode(), true, deadline)?;
        self.large_in_flight.push_back(LargeSend {
            seq: self.sent_seq - 1,
            _region: region,
        });
        Ok(())
    }

    /// Whether a ring message of `len` bytes can be posted now, without waiting for
    /// credit or send queue room (the condition [`send`](Self::send) waits for).
    fn has_credit(&self, len: usize) -> bool {
        u32::try_from(len).is_ok_and(|len| len <= self.tx.free_bytes())
            && self.tx.free_slots() > 0
            && self.outstanding_sends + 3 <= self.max_send_wr
    }

    /// Sends `buf` if the peer's ring has room for it now, and gives it back otherwise
    /// (nothing is registered or posted then): like [`send_buffer`](Self::send_buffer),
    /// zero-copy from [`ZERO_COPY_THRESHOLD`] bytes or when it does not fit the ring, but
    /// the registration is not cached, so the buffer is released as soon as the peer has
    /// read it. For buffers sent once, such as the RPC transport's frames.
    ///
    /// # Errors
    /// The connection's failure, or a failed verb.
    pub fn try_send_owned<B>(&mut self, buf: Arc<B>) -> Result<Result<(), Arc<B>>, ConnectionError>
    where
        B: AsRef<[u8]> + Send + Sync + 'static,
    {
        self.check_failed()?;
        let len = (*buf).as_ref().len();
        let zero_copy = len >= ZERO_COPY_THRESHOLD || len > self.tx.ring_len() as usize;
        if !self.has_credit(if zero_copy { DESCRIPTOR_LEN } else { len }) {
            return Ok(Err(buf));
        }
        if zero_copy {
            let bytes: &[u8] = (*buf).as_ref();
            let (addr, len) = (bytes.as_ptr() as u64, bytes.len() as u64);
            let region = self.register_for_send(buf, false)?;
            let descriptor = LargeDescriptor {
                addr,
                len,
                rkey: region.rkey(),
            };
            self.send_descriptor(descriptor, region, None)?;
        } else {
            self.send_ring_message((*buf).as_ref(), false, None)?;
        }
        Ok(Ok(()))
    }

    /// The next message if one has arrived (and, for a zero-copy message, its RDMA READ
    /// has completed), without waiting; takes the completions that are there.
    ///
    /// # Errors
    /// As [`recv`](Self::recv).
    pub fn try_recv(&mut self) -> Result<Option<Vec<u8>>, ConnectionError> {
        self.try_recv_within(u64::MAX)
    }

    /// [`try_recv`](Self::try_recv), refusing a zero-copy message of more than
    /// `max_large` bytes (or [`ConnectionOptions::max_large_message`], if smaller) before
    /// anything is allocated or registered for it. The caller gives the limit that what
    /// it received so far allows for the *next* message (the RPC transport: the exact
    /// length that a validated frame header announced); a message already being read was
    /// checked against the limit given when its descriptor arrived.
    ///
    /// # Errors
    /// As [`recv`](Self::recv); [`ConnectionError::BadDescriptor`] with the announced length
    /// and the limit for a refused message.
    pub fn try_recv_within(&mut self, max_large: u64) -> Result<Option<Vec<u8>>, ConnectionError> {
        match self.recv_deadline(Some((Instant::now(), Duration::ZERO)), max_large) {
            Ok(message) => Ok(Some(message)),
            Err(ConnectionError::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Send work requests not completed yet (messages, READs and credit acks).
    pub fn sends_in_flight(&self) -> u32 {
        self.outstanding_sends
    }

    /// Sleeps until a work completion arrives, one of `also` becomes readable, or
    /// `timeout` passes (`None`: no limit), after busy-polling for
    /// [`ConnectionOptions::spin`]. Completions it takes are handled; the caller then tries
    /// its sends and receives again. Returns at once when a completion was waiting.
    ///
    /// # Errors
    /// The connection's failure, or a failed verb or `poll`.
    pub fn wait(
        &mut self,
        also: &[BorrowedFd<'_>],
        timeout: Option<Duration>,
    ) -> Result<(), ConnectionError> {
        self.check_failed()?;
        let deadline = timeout.map(|t| Instant::now() + t);
        let spin_until = Instant::now() + self.spin;
        loop {
            if self.poll_once()? > 0 {
                return Ok(());
            }
            let now = Instant::now();
            if deadline.is_some_and(|at| now >= at) {
                return Ok(());
            }
            if now < spin_until {
                std::hint::spin_loop();
                continue;
            }
            if !self.armed {
                self.arm()?;
                // A completion that slipped in before arming raises no event: poll again.
                continue;
            }
            return self.wait_event(deadline, also);
        }
    }

    /// Asks for an event on the completion channel at the next completion.
    fn arm(&mut self) -> Result<(), ConnectionError> {
        self.cq
            .req_notify()
            .map_err(|e| verb_err("ibv_req_notify_cq", &self.device, e))?;
        self.armed = true;
        Ok(())
    }

    fn send_ring_message(
        &mut self,
        msg: &[u8],
        descriptor: bool,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<(), ConnectionError> {
        self.check_failed()?;
        let len = u32::try_from(msg.len())
            .ok()
            .filter(|&len| len <= self.tx.ring_len())
            .ok_or(ConnectionError::MessageTooLarge {
                len: msg.len(),
                max: self.tx.ring_len(),
            })?;
        let imm = if descriptor {
            MessageImm::Descriptor(len)
        } else {
            MessageImm::Inline(len)
        };
        loop {
            // Two work requests at most, and room for the acknowledgements.
            if self.outstanding_sends + 3 <= self.max_send_wr {
                if let Some(placement) = self.tx.reserve(len) {
                    self.post_message(placement, msg, imm)?;
                    self.sent_seq += 1;
                    return Ok(());
                }
            }
            self.progress(deadline, "send")?;
        }
    }

    /// Receives the next message, blocking until one arrives (and, for a zero-copy
    /// message, until its RDMA READ completed).
    pub fn recv(&mut self) -> Result<Vec<u8>, ConnectionError> {
        self.recv_deadline(None, u64::MAX)
    }

    /// [`recv`](Self::recv) giving up with [`ConnectionError::Timeout`] after `timeout`. A
    /// zero-copy read under way continues, and the next `recv` returns its message.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Vec<u8>, ConnectionError> {
        self.recv_deadline(Some((Instant::now() + timeout, timeout)), u64::MAX)
    }

    fn recv_deadline(
        &mut self,
        deadline: Option<(Instant, Duration)>,
        max_large: u64,
    ) -> Result<Vec<u8>, ConnectionError> {
        loop {
            if self.pending_read.is_some() {
                self.check_failed()?;
                self.pump_read()?;
                if let Some(message) = self.take_finished_read() {
                    // Acknowledge at once: the sender holds the buffer until then.
                    if let Some(count) = self.rx.take_ack(true) {
                        self.post_ack(count)?;
                    }
                    return Ok(message);
                }
                self.progress(deadline, "recv")?;
                continue;
            }
            if let Some(imm) = self.arrived.pop_front() {
                let imm = MessageImm::decode(imm);
                let placement = self.rx.accept(imm.ring_len())?;
                let mut out = Vec::with_capacity(imm.ring_len() as usize);
                read_ring(
                    &self.recv_ring,
                    placement.first.0,
                    placement.first.1,
                    &mut out,
                );
                read_ring(&self.recv_ring, 0, placement.wrapped, &mut out);
                match imm {
                    MessageImm::Inline(_) => {
                        if let Some(count) = self.rx.take_ack(self.arrived.is_empty()) {
                            self.post_ack(count)?;
                        }
                        return Ok(out);
                    }
                    MessageImm::Descriptor(descriptor_len) => {
                        let max = max_large.min(self.max_large_message);
                        let source = LargeDescriptor::decode(&out).ok_or(
                            ConnectionError::BadDescriptor {
                                len: 0,
                                max,
                                descriptor_len,
                            },
                        )?;
                        let len = admit_large(&source, max, descriptor_len)?;
                        self.start_read(source, len)?;
                        continue;
                    }
                }
            }
            self.check_failed()?;
            self.progress(deadline, "recv")?;
        }
    }

    /// Waits until every posted send has completed and the peer has read every zero-copy
    /// message (reporting the connection's failure, if any).
    pub fn flush(&mut self, timeout: Duration) -> Result<(), ConnectionError> {
        let deadline = Some((Instant::now() + timeout, timeout));
        while self.outstanding_sends > 0 || !self.large_in_flight.is_empty() {
            self.check_failed()?;
            self.progress(deadline, "flush")?;
        }
        self.check_failed()
    }

    /// Zero-copy messages sent and not yet read by the peer (their buffers are held).
    pub fn large_in_flight(&self) -> usize {
        self.large_in_flight.len()
    }

    /// Registrations held by the zero-copy send cache.
    pub fn cached_registrations(&self) -> usize {
        self.registrations.len()
    }

    /// Allocates and registers the destination of a zero-copy message of `len` bytes
    /// ([admitted](admit_large)) and starts reading.
    fn start_read(&mut self, source: LargeDescriptor, len: usize) -> Result<(), ConnectionError> {
        let buf = zeroed(len)?;
        let buf = if len == 0 {
            None
        } else {
            // The Vec moves into `pending_read` and is only handed out after every READ
            // into it has completed, or freed after the queue pair is destroyed (field
            // order of IbvConnection).
            Some(
                RegisteredVec::register(&self.pd, buf)
                    .map_err(|e| verb_err("ibv_reg_mr (zero-copy receive)", &self.device, e))?,
            )
        };
        self.pending_read = Some(PendingRead {
            buf,
            source,
            posted: 0,
            in_flight: 0,
        });
        self.pump_read()
    }

    /// Posts READs for the rest of the pending message, as far as the send queue allows.
    fn pump_read(&mut self) -> Result<(), ConnectionError> {
        let Some(pending) = self.pending_read.as_mut() else {
            return Ok(());
        };
        let Some(buf) = pending.buf.as_ref() else {
            return Ok(());
        };
        let (dst, lkey) = (buf.addr(), buf.lkey());
        while pending.posted < pending.source.len && self.outstanding_sends + 2 <= self.max_send_wr
        {
            let chunk = (pending.source.len - pending.posted)
                .min(self.max_msg_size)
                .min(1 << 30);
            // The destination range lies inside `pending.buf`, registered under `lkey` and
            // owned by the connection until this READ completes.
            self.qp
                .post_send(&[SendRequest {
                    wr_id: WR_READ,
                    op: SendOp::Read {
                        remote_addr: pending.source.addr + pending.posted,
                        rkey: pending.source.rkey,
                    },
                    local: Local::Registered {
                        addr: dst + pending.posted,
                        len: chunk as u32,
                        lkey,
                    },
                }])
                .map_err(|e| verb_err("ibv_post_send (RDMA read)", &self.device, e))?;
            pending.posted += chunk;
            pending.in_flight += 1;
            self.outstanding_sends += 1;
        }
        Ok(())
    }

    /// The pending message, once every READ into it has completed.
    fn take_finished_read(&mut self) -> Option<Vec<u8>> {
        let done = self
            .pending_read
            .as_ref()
            .is_some_and(|p| p.in_flight == 0 && p.posted == p.source.len);
        if !done {
            return None;
        }
        let PendingRead { buf, .. } = self.pending_read.take()?;
        match buf {
            // Deregistered before the memory is handed out; a buffer whose deregistration
            // failed is leaked and the message lost, which the peer's flush reports.
            Some(buf) => buf.into_vec(),
            None => Some(Vec::new()),
        }
    }

    /// Reads `target.len()` bytes at `remote_addr` of the peer's memory, registered there
    /// under `rkey`, into `target` (memory registered in this connection's protection domain
    /// with local write access: [`ReadTarget`]) with one-sided RDMA READs (split at the
    /// port's largest message), and hands `target` back once every READ has completed. The
    /// peer's CPU takes no part; the ring protocol is untouched, so a connection can carry
    /// messages and READs alike.
    ///
    /// # Errors
    /// - [`ConnectionError::Completion`] when a READ fails, naming the status: a wrong key or
    ///   a range outside the peer's registration is `IBV_WC_REM_ACCESS_ERR`, a peer gone
    ///   is `IBV_WC_RETRY_EXC_ERR`. The connection is failed from then on.
    /// - [`ConnectionError::Timeout`] after `timeout`: the queue pair is then moved to the
    ///   error state and the READs still posted are flushed.
    /// - [`ConnectionError::Verb`] when posting fails, [`ConnectionError::Options`] for a range
    ///   that wraps around.
    ///
    /// On an error after which READs may still be in flight
    /// ([`remote_reads_in_flight`](Self::remote_reads_in_flight) above zero: the flush did
    /// not finish), `target` is leaked, never freed while the device may write into it.
    pub fn read_remote<T: ReadTarget>(
        &mut self,
        target: T,
        remote_addr: u64,
        rkey: u32,
        timeout: Duration,
    ) -> Result<T, ConnectionError> {
        let result = self.read_remote_into(&target, remote_addr, rkey, timeout);
        match result {
            Ok(()) => Ok(target),
            Err(err) => {
                if self.remote_reads_in_flight > 0 {
                    std::mem::forget(target);
                }
                Err(err)
            }
        }
    }

    fn read_remote_into<T: ReadTarget>(
        &mut self,
        target: &T,
        remote_addr: u64,
        rkey: u32,
        timeout: Duration,
    ) -> Result<(), ConnectionError> {
        self.check_failed()?;
        let (lkey, local_addr, len) = (target.lkey(), target.addr(), target.len());
        if remote_addr.checked_add(len).is_none() || local_addr.checked_add(len).is_none() {
            return Err(ConnectionError::Options("the RDMA read range wraps around"));
        }
        let deadline = Some((Instant::now() + timeout, timeout));
        let mut posted = 0u64;
        let result = 'reading: loop {
            while posted < len && self.outstanding_sends + 2 <= self.max_send_wr {
                let chunk = (len - posted).min(self.max_msg_size).min(1 << 30);
                // The destination range is the target's, registered under `lkey` and
                // untouched until every READ into it completed (or leaked).
                let request = SendRequest {
                    wr_id: WR_REMOTE_READ,
                    op: SendOp::Read {
                        remote_addr: remote_addr + posted,
                        rkey,
                    },
                    local: Local::Registered {
                        addr: local_addr + posted,
                        len: chunk as u32,
                        lkey,
                    },
                };
                if let Err(e) = self.qp.post_send(&[request]) {
                    break 'reading Err(verb_err(
                        "ibv_post_send (one-sided RDMA read)",
                        &self.device,
                        e,
                    ));
                }
                posted += chunk;
                self.remote_reads_in_flight += 1;
                self.outstanding_sends += 1;
            }
            if posted == len && self.remote_reads_in_flight == 0 {
                break Ok(());
            }
            if let Err(e) = self.check_failed() {
                break Err(e);
            }
            if let Err(e) = self.progress(deadline, "RDMA read") {
                break Err(e);
            }
        };
        if result.is_err() && self.remote_reads_in_flight > 0 {
            self.flush_remote_reads();
        }
        result
    }

    /// One-sided READs posted by [`read_remote`](Self::read_remote) whose completion has
    /// not arrived (nonzero only after a failed or timed-out read whose flush did not
    /// finish).
    pub fn remote_reads_in_flight(&self) -> u32 {
        self.remote_reads_in_flight
    }

    /// Moves the queue pair to the error state and takes completions until the posted
    /// READs are flushed, for at most [`READ_FLUSH_TIMEOUT`].
    fn flush_remote_reads(&mut self) {
        if let Err(e) = self.abort() {
            debug!(error = %e, "cannot move the queue pair to the error state");
        }
        let until = Instant::now() + READ_FLUSH_TIMEOUT;
        while self.remote_reads_in_flight > 0 {
            match self.progress(Some((until, READ_FLUSH_TIMEOUT)), "RDMA read flush") {
                Err(ConnectionError::Timeout { .. }) => break,
                Err(ConnectionError::Verb { .. }) => break,
                _ => {}
            }
        }
    }

    /// Moves the queue pair to the error state: pending work requests complete with
    /// `IBV_WC_WR_FLUSH_ERR`, and the peer's next transfers fail. Used to abort a
    /// connection (and by tests to exercise the error path).
    pub fn abort(&mut self) -> Result<(), ConnectionError> {
        self.qp
            .to_error()
            .map_err(|e| verb_err("ibv_modify_qp(ERR)", &self.device, e))
    }

    fn check_failed(&self) -> Result<(), ConnectionError> {
        match &self.failure {
            Some(failure) => Err(ConnectionError::Completion(failure.clone())),
            None => Ok(()),
        }
    }

    fn post_recv(&mut self) -> Result<(), ConnectionError> {
        // No scatter list: write-with-immediate and zero-byte sends carry no payload.
        self.qp
            .post_recv_empty(WR_RECV)
            .map_err(|e| verb_err("ibv_post_recv", &self.device, e))
    }

    fn post_message(
        &mut self,
        placement: Placement,
        msg: &[u8],
        imm: MessageImm,
    ) -> Result<(), ConnectionError> {
        let (offset, first_len) = placement.first;
        let (head, tail) = msg.split_at((first_len as usize).min(msg.len()));
        let inline = head.len().max(tail.len()) <= self.max_inline as usize;
        if !inline {
            self.send_ring.write_at(offset as usize, head);
            self.send_ring.write_at(0, tail);
        }
        let imm = imm.encode();
        let (rkey, base) = (self.peer.ring_rkey, self.peer.ring_addr);
        let lkey = self.send_ring.lkey();
        let send_base = self.send_ring.addr();
        // The range is inside the registered send ring, which outlives the queue pair, and
        // credits keep it unchanged until the peer acknowledges.
        fn local(
            inline: bool,
            send_base: u64,
            lkey: u32,
            dst_offset: u32,
            bytes: &[u8],
        ) -> Local<'_> {
            if bytes.is_empty() {
                Local::None
            } else if inline {
                Local::Inline(bytes)
            } else {
                Local::Registered {
                    addr: send_base + u64::from(dst_offset),
                    len: bytes.len() as u32,
                    lkey,
                }
            }
        }
        let mut requests = Vec::with_capacity(2);
        // The piece at the end of the ring first: RC keeps order, so when the immediate
        // arrives the whole message is in place.
        if !tail.is_empty() {
            requests.push(SendRequest {
                wr_id: WR_DATA,
                op: SendOp::Write {
                    remote_addr: base + u64::from(offset),
                    rkey,
                },
                local: local(inline, send_base, lkey, offset, head),
            });
        }
        let (dst_offset, data) = if tail.is_empty() {
            (offset, head)
        } else {
            (0, tail)
        };
        requests.push(SendRequest {
            wr_id: WR_DATA,
            op: SendOp::WriteImm {
                remote_addr: base + u64::from(dst_offset),
                rkey,
                imm,
            },
            // A zero-length message: the immediate alone.
            local: local(inline, send_base, lkey, dst_offset, data),
        });
        self.qp
            .post_send(&requests)
            .map_err(|e| verb_err("ibv_post_send (RDMA write with immediate)", &self.device, e))?;
        self.outstanding_sends += requests.len() as u32;
        Ok(())
    }

    fn post_ack(&mut self, count: u32) -> Result<(), ConnectionError> {
        self.qp
            .post_send(&[SendRequest {
                wr_id: WR_ACK,
                op: SendOp::SendImm { imm: count },
                local: Local::None,
            }])
            .map_err(|e| verb_err("ibv_post_send (credit ack)", &self.device, e))?;
        self.outstanding_sends += 1;
        Ok(())
    }

    /// Takes completions: busy-polls for the spin time, then sleeps on the completion
    /// channel until something completes or the deadline passes.
    fn progress(
        &mut self,
        deadline: Option<(Instant, Duration)>,
        operation: &'static str,
    ) -> Result<(), ConnectionError> {
        let spin_until = Instant::now() + self.spin;
        loop {
            if self.poll_once()? > 0 {
                return Ok(());
            }
            let now = Instant::now();
            if let Some((at, after)) = deadline {
                if now >= at {
                    return Err(ConnectionError::Timeout { operation, after });
                }
            }
            if now < spin_until {
                std::hint::spin_loop();
                continue;
            }
            if !self.armed {
                self.arm()?;
                // A completion that slipped in before arming raises no event: poll again.
                continue;
            }
            self.wait_event(deadline.map(|(at, _)| at), &[])?;
        }
    }

    /// Sleeps until the completion channel has an event, one of `also` is readable, or
    /// `deadline`; consumes the completion channel's event.
    fn wait_event(
        &mut self,
        deadline: Option<Instant>,
        also: &[BorrowedFd<'_>],
    ) -> Result<(), ConnectionError> {
        let timeout_ms = match deadline {
            None => -1,
            Some(at) => {
                let left = at.saturating_duration_since(Instant::now());
                i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX)
            }
        };
        let mut fds = Vec::with_capacity(also.len() + 1);
        fds.push(sys::comp_channel_fd(&self.comp_channel));
        fds.extend_from_slice(also);
        let ready = sys::poll_readable(&fds, timeout_ms)
            .map_err(|e| verb_err("poll on the completion channel", &self.device, e))?;
        if !ready.is_some_and(|ready| ready.first().copied().unwrap_or(false)) {
            return Ok(());
        }
        // The connection is non-blocking, so this finds nothing if the event was already
        // taken.
        if self.comp_channel.get_event() {
            self.armed = false;
            self.unacked_events += 1;
            if self.unacked_events >= 64 {
                self.ack_events();
            }
        }
        Ok(())
    }

    fn ack_events(&mut self) {
        if self.unacked_events > 0 {
            // Exactly this many events were taken for this CQ.
            self.cq.ack_events(self.unacked_events);
            self.unacked_events = 0;
        }
    }

    /// Polls the CQ once and handles what it returned; the number of completions.
    fn poll_once(&mut self) -> Result<usize, ConnectionError> {
        let mut wcs = [WorkCompletion::default(); POLL_BATCH];
        let n = self
            .cq
            .poll(&mut wcs)
            .map_err(|e| verb_err("ibv_poll_cq", &self.device, e))?;
        let mut first_error = None;
        for wc in &wcs[..n] {
            if let Err(err) = self.handle_completion(wc) {
                first_error.get_or_insert(err);
            }
        }
        match first_error {
            Some(err) => Err(err),
            None => Ok(n),
        }
    }

    fn handle_completion(&mut self, wc: &WorkCompletion) -> Result<(), ConnectionError> {
        let kind = wc.wr_id() & WR_KIND_MASK;
        if kind != WR_RECV {
            self.outstanding_sends = self.outstanding_sends.saturating_sub(1);
        }
        if kind == WR_REMOTE_READ {
            self.remote_reads_in_flight = self.remote_reads_in_flight.saturating_sub(1);
        }
        if wc.status() != 0 {
            let operation = match kind {
                WR_RECV => "receive (ibv_post_recv)",
                WR_DATA => "RDMA write with immediate",
                WR_ACK => "send with immediate (credit ack)",
                WR_READ => "RDMA read (zero-copy receive)",
                WR_REMOTE_READ => "RDMA read (one-sided)",
                _ => "unknown work request",
            };
            let failure = CompletionFailure {
                operation,
                status: wc.status(),
                vendor_err: wc.vendor_err(),
                device: self.device.clone(),
                qpn: self.qpn,
            };
            debug!(%failure, "RDMA work completion failed");
            let failure = self.failure.get_or_insert(failure).clone();
            return Err(ConnectionError::Completion(failure));
        }
        if kind == WR_READ {
            if let Some(pending) = self.pending_read.as_mut() {
                pending.in_flight = pending.in_flight.saturating_sub(1);
            }
        }
        if kind != WR_RECV {
            return Ok(());
        }
        let imm = wc.imm_data();
        match wc.opcode() {
            sys::WC_RECV_RDMA_WITH_IMM => self.arrived.push_back(imm),
            sys::WC_RECV => {
                self.tx.acknowledge(imm)?;
                self.acked_seq += u64::from(imm);
                while self
                    .large_in_flight
                    .front()
                    .is_some_and(|large| large.seq < self.acked_seq)
                {
                    self.large_in_flight.pop_front();
                }
            }
            _ => {}
        }
        self.post_recv()
    }
}

impl Drop for IbvConnection {
    fn drop(&mut self) {
        // Unacknowledged CQ events would make ibv_destroy_cq wait forever.
        self.ack_events();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_impossible_allocation_is_an_error() {
        assert_eq!(zeroed(3).map_err(|e| e.to_string()), Ok(vec![0, 0, 0]));
        let err = zeroed(usize::MAX).expect_err("cannot be allocated");
        assert!(
            err.to_string()
                .contains(&format!("cannot allocate {} bytes", usize::MAX)),
            "{err}"
        );
    }

    #[test]
    fn failure_display_names_the_status() {
        let failure = CompletionFailure {
            operation: "RDMA write with immediate",
            status: 12,
            vendor_err: 0x81,
            device: "rxe0".into(),
            qpn: 0x11,
        };
        assert_eq!(
            failure.to_string(),
            "RDMA write with immediate failed with IBV_WC_RETRY_EXC_ERR (vendor error 0x81) \
             on RDMA device rxe0 QP 0x11"
        );
        let unknown = CompletionFailure {
            status: 77,
            ..failure
        };
        assert!(unknown.to_string().contains("failed with status 77"));
    }

    #[test]
    fn psn_is_24_bits() {
        assert!(initial_psn() <= MAX_24BIT);
    }
}
