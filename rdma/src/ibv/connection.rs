//! One RC queue pair connected to a peer, moving small messages through registered rings.
//!
//! [`IbvConnection::connect`] opens the selected device, creates a protection domain, a
//! completion queue with a completion channel, an RC queue pair and two registered rings
//! (a receive ring the peer writes into, and a send staging ring that mirrors the peer's),
//! exchanges [`ConnectionInfo`] over any `Read + Write`
//! bootstrap stream and moves the queue pair through INIT → RTR → RTS.
//!
//! Messages: [`IbvConnection::send`] places a message in the peer's ring with one RDMA
//! write-with-immediate whose immediate is the length (two writes when it wraps), inline
//! when it fits the queue pair's `max_inline_data`, and otherwise staged in the registered
//! send ring. It blocks while the peer's ring or receive slots are full: credits come back
//! as zero-byte sends-with-immediate carrying the count of messages the peer consumed.
//! [`IbvConnection::recv`] copies the next message out of the receive ring and
//! acknowledges. Those rules are core's [`RingEndpoint`] (`rdzv_core::verbs_ring`): this
//! module posts the work requests it asks for, copies bytes, and hands it every completion.
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

use rdzv_core::verbs_ring::{
    Arrival, BadDescriptor, Completion, Fault, LargeDescriptor, MessageTooLarge, MessageWrites,
    Piece, Placement, QueueDepths, ReadRange, Received, RingConfig, RingEndpoint, RingError,
    Transmit, WorkFailure, WorkKind, DESCRIPTOR_LEN, MAX_RING_LEN,
};

use super::regcache::RegistrationCache;
use super::select::IbvSelection;
use super::topology::Mtu;
use super::wc_status::wc_status_name;
use super::wire::{self, ConnectionInfo, ExchangeError, MAX_24BIT};

/// Default receive ring size: 64 KiB per direction.
pub const DEFAULT_RING_LEN: u32 = 64 * 1024;
/// Default receive slots (messages in flight per direction).
pub const DEFAULT_RECV_SLOTS: u32 = 64;
/// Messages of at least this many bytes given to [`IbvConnection::send_buffer`] go zero-copy.
pub use rdzv_core::verbs_ring::ZERO_COPY_THRESHOLD;
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

impl From<BadDescriptor> for ConnectionError {
    fn from(bad: BadDescriptor) -> Self {
        let BadDescriptor {
            len,
            max,
            descriptor_len,
        } = bad;
        ConnectionError::BadDescriptor {
            len,
            max,
            descriptor_len,
        }
    }
}

impl From<MessageTooLarge> for ConnectionError {
    fn from(MessageTooLarge { len, max }: MessageTooLarge) -> Self {
        ConnectionError::MessageTooLarge { len, max }
    }
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
        let list = DeviceList::new().map_err(verb_err("ibv_get_device_list", dev))?;
        let index = list
            .find(dev)
            .ok_or_else(|| ConnectionError::DeviceNotFound { device: dev.into() })?;
        let context = list.open(index).map_err(verb_err("ibv_open_device", dev))?;
        let pd = context.alloc_pd().map_err(verb_err("ibv_alloc_pd", dev))?;
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
/// How [`IbvConnection::wait_once`] ended.
enum Waited {
    /// Completions were taken.
    Completed,
    /// The deadline passed first.
    DeadlinePassed,
    /// The completion channel or another descriptor woke the thread (or the sleep ended).
    Woke,
}

/// Completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 16;

/// A registration of a caller's buffer, which keeps the buffer alive so that the address
/// range cannot be freed or reused while registered.
type CachedRegion = SharedRegistration;

/// The ring protocol of one connection: it holds each zero-copy send's registration (and
/// buffer) until the peer acknowledges, and the registered buffer a zero-copy receive is
/// read into (`None` for an empty message) until every READ into it completed.
type Ring = RingEndpoint<Arc<CachedRegion>, Option<RegisteredVec>>;

/// One connected RC queue pair with a small-message ring per direction.
///
/// Field order is drop order: the queue pair goes first (the device stops touching the
/// rings), then the completion queue and channel, then the memory regions, then the ring
/// memory itself, then the buffers the ring protocol holds.
pub struct IbvConnection {
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    comp_channel: Arc<CompChannel>,
    recv_ring: HostRegion,
    send_ring: HostRegion,
    ring: Ring,
    registrations: RegistrationCache<Arc<CachedRegion>>,
    pd: Arc<ProtectionDomain>,
    _context: Arc<Context>,
    device: String,
    qpn: u32,
    peer: ConnectionInfo,
    max_inline: u32,
    /// CQ events received and not acknowledged with ibv_ack_cq_events.
    unacked_events: u32,
    armed: bool,
    spin: Duration,
}

impl fmt::Debug for IbvConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbvConnection")
            .field("device", &self.device)
            .field("qpn", &self.qpn)
            .field("peer", &self.peer)
            .field("max_inline", &self.max_inline)
            .field("ring", &self.ring)
            .field("armed", &self.armed)
            .finish_non_exhaustive()
    }
}

/// The [`ConnectionError::Verb`] of `verb` failing on `device`, for `map_err`.
fn verb_err<'a, E: Into<io::Error>>(
    verb: &'static str,
    device: &'a str,
) -> impl FnOnce(E) -> ConnectionError + 'a {
    move |source| ConnectionError::Verb {
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

/// Posts one receive work request (no scatter list: write-with-immediate and zero-byte
/// sends carry no payload).
fn post_recv(qp: &QueuePair, device: &str) -> Result<(), ConnectionError> {
    qp.post_recv_empty(WorkKind::Recv.wr_id())
        .map_err(verb_err("ibv_post_recv", device))
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
        .map_err(verb_err("ibv_reg_mr (receive ring)", dev))?;
        let send_ring = HostRegion::register(&pd, ring_len, AccessFlags::LOCAL_WRITE)
            .map_err(verb_err("ibv_reg_mr (send ring)", dev))?;

        let comp_channel = context
            .create_comp_channel()
            .map_err(verb_err("ibv_create_comp_channel", dev))?;
        comp_channel
            .set_nonblocking()
            .map_err(verb_err("fcntl(O_NONBLOCK) on the completion channel", dev))?;
        let depths = QueueDepths::for_slots(options.recv_slots);
        let cq = context
            .create_cq(depths.completions(), &comp_channel)
            .map_err(verb_err("ibv_create_cq", dev))?;

        let build = |inline: u32| {
            pd.create_rc_qp(
                &cq,
                QpCaps {
                    max_send_wr: depths.send,
                    max_recv_wr: depths.recv,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: inline,
                },
            )
        };
        // A device without inline support rejects a nonzero request: retry without.
        let qp = match build(REQUESTED_MAX_INLINE) {
            Ok(qp) => qp,
            Err(_) => build(0).map_err(verb_err("ibv_create_qp", dev))?,
        };
        let max_inline = qp.max_inline().map_err(verb_err("ibv_query_qp", dev))?;
        let qpn = qp.qp_num();

        qp.to_init(
            selection.port,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .map_err(verb_err("ibv_modify_qp(INIT)", dev))?;
        // Receive work requests go in before the peer can possibly send.
        for _ in 0..depths.recv {
            post_recv(&qp, dev)?;
        }

        let ours = ConnectionInfo {
            lid: selection.lid,
            gid: selection.gid,
            qpn,
            psn: initial_psn(),
            mtu: selection.active_mtu.unwrap_or(Mtu::B1024),
            ring_addr: recv_ring.addr(),
            ring_len: options.ring_len,
            ring_rkey: recv_ring.rkey(),
            recv_slots: options.recv_slots,
        };
        let peer = wire::exchange(bootstrap, &ours)?;
        debug!(
            device = dev,
            qpn,
            peer_qpn = peer.qpn,
            "RDMA connection records exchanged"
        );
        let ring = RingEndpoint::new(RingConfig {
            ring_len: options.ring_len,
            recv_slots: options.recv_slots,
            peer_ring_len: peer.ring_len,
            peer_recv_slots: peer.recv_slots,
            max_send_wr: depths.send,
            max_inline,
            max_read_len: u64::from(selection.max_msg_size),
            max_large_message: options.max_large_message,
        })?;

        let grh = (!peer.gid.is_zero() && !selection.gid.is_zero()).then_some(GlobalRoute {
            dgid: peer.gid.0,
            sgid_index: gid_index,
            hop_limit: 64,
        });
        qp.to_rtr(&RtrAttr {
            path_mtu: verbs_mtu(ours.mtu.min(peer.mtu)),
            dest_qp_num: peer.qpn,
            rq_psn: peer.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            port: selection.port,
            dlid: peer.lid,
            grh,
        })
        .map_err(verb_err("ibv_modify_qp(RTR)", dev))?;
        qp.to_rts(&RtsAttr {
            sq_psn: ours.psn,
            timeout: options.ack_timeout,
            retry_cnt: options.retry_count,
            rnr_retry: 7,
            max_rd_atomic: 1,
        })
        .map_err(verb_err("ibv_modify_qp(RTS)", dev))?;

        // Neither side writes before the other is ready to receive.
        let mut byte = [1u8];
        bootstrap
            .write_all(&byte)
            .and_then(|()| bootstrap.flush())
            .and_then(|()| bootstrap.read_exact(&mut byte))
            .map_err(ConnectionError::Bootstrap)?;
        debug!(device = dev, qpn, max_inline, "RDMA connection ready");
        Ok(IbvConnection {
            qp,
            cq,
            comp_channel,
            recv_ring,
            send_ring,
            ring,
            registrations: RegistrationCache::new(REGISTRATION_CACHE_ENTRIES),
            pd,
            _context: context,
            device: dev.to_owned(),
            qpn,
            peer,
            max_inline,
            unacked_events: 0,
            armed: false,
            spin: options.spin,
        })
    }

    /// The largest message [`send`](Self::send) accepts: the peer's ring size.
    pub fn max_message_len(&self) -> usize {
        self.ring.max_message_len() as usize
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
    pub fn failure(&self) -> Option<CompletionFailure> {
        self.ring.failure().map(|f| self.completion_failure(f))
    }

    fn completion_failure(&self, failure: WorkFailure) -> CompletionFailure {
        CompletionFailure {
            operation: failure.kind.operation(),
            status: failure.status,
            vendor_err: failure.vendor_err,
            device: self.device.clone(),
            qpn: self.qpn,
        }
    }

    /// Sends one message through the ring (copied), blocking while the peer's ring has no
    /// room for it. Messages above [`max_message_len`](Self::max_message_len) need
    /// [`send_buffer`](Self::send_buffer).
    pub fn send(&mut self, msg: &[u8]) -> Result<(), ConnectionError> {
        self.send_ring_message(msg, false, None).map(drop)
    }

    /// [`send`](Self::send), giving up with [`ConnectionError::Timeout`] when no credit comes
    /// back within `timeout`. Nothing is sent then.
    pub fn send_timeout(&mut self, msg: &[u8], timeout: Duration) -> Result<(), ConnectionError> {
        self.send_ring_message(msg, false, Some((Instant::now() + timeout, timeout)))
            .map(drop)
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
        let bytes: &[u8] = (*buf).as_ref();
        if !self.ring.zero_copy(bytes.len()) {
            return self.send_ring_message(bytes, false, None).map(drop);
        }
        self.check_failed()?;
        self.send_zero_copy(buf, true, None)
    }

    /// Registers `buf` (from the cache when `cached` and it hits, else anew, cached when
    /// `cached`), sends its descriptor, and has the ring hold the registration (and the
    /// buffer) until the peer acknowledges the message.
    fn send_zero_copy<B>(
        &mut self,
        buf: Arc<B>,
        cached: bool,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<(), ConnectionError>
    where
        B: AsRef<[u8]> + Send + Sync + 'static,
    {
        let bytes: &[u8] = (*buf).as_ref();
        let (addr, len) = (bytes.as_ptr() as u64, bytes.len() as u64);
        let hit = cached
            .then(|| self.registrations.lookup(addr, len).map(Arc::clone))
            .flatten();
        let region = match hit {
            Some(region) => region,
            None => {
                let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = buf.clone();
                let region = Arc::new(
                    SharedRegistration::register(&self.pd, owner)
                        .map_err(verb_err("ibv_reg_mr (zero-copy send)", &self.device))?,
                );
                if cached {
                    // Displaced registrations still used by messages in flight stay alive
                    // in the ring until acknowledged.
                    drop(self.registrations.insert(addr, len, Arc::clone(&region)));
                }
                region
            }
        };
        let descriptor = LargeDescriptor {
            addr,
            len,
            rkey: region.rkey(),
        };
        let seq = self.send_ring_message(&descriptor.encode(), true, deadline)?;
        self.ring.hold(seq, region);
        Ok(())
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
        let zero_copy = self.ring.zero_copy(len);
        if !self
            .ring
            .can_send(if zero_copy { DESCRIPTOR_LEN } else { len })
        {
            return Ok(Err(buf));
        }
        if zero_copy {
            self.send_zero_copy(buf, false, None)?;
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
        self.ring.sends_in_flight()
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
        self.wait_once(Instant::now() + self.spin, deadline, also)
            .map(drop)
    }

    /// Takes completions: busy-polls until `spin_until`, then arms the completion queue
    /// and sleeps once on its channel and `also`, unless a completion came or `deadline`
    /// passed first.
    fn wait_once(
        &mut self,
        spin_until: Instant,
        deadline: Option<Instant>,
        also: &[BorrowedFd<'_>],
    ) -> Result<Waited, ConnectionError> {
        loop {
            if self.poll_once()? > 0 {
                return Ok(Waited::Completed);
            }
            let now = Instant::now();
            if deadline.is_some_and(|at| now >= at) {
                return Ok(Waited::DeadlinePassed);
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
            self.wait_event(deadline, also)?;
            return Ok(Waited::Woke);
        }
    }

    /// Asks for an event on the completion channel at the next completion.
    fn arm(&mut self) -> Result<(), ConnectionError> {
        self.cq
            .req_notify()
            .map_err(verb_err("ibv_req_notify_cq", &self.device))?;
        self.armed = true;
        Ok(())
    }

    /// Sends one ring message, waiting for credit; its sequence number.
    fn send_ring_message(
        &mut self,
        msg: &[u8],
        descriptor: bool,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<u64, ConnectionError> {
        self.check_failed()?;
        loop {
            if let Some(writes) = self.ring.send(msg.len(), descriptor)? {
                self.post_message(&writes, msg)?;
                return Ok(writes.seq);
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
            if self.ring.is_reading() {
                self.check_failed()?;
            }
            // The ring's bytes are copied out before the acknowledgement is posted.
            let (message, reading) = match self.ring.poll_arrival()? {
                Some(Arrival::Message(placement)) => (Some(self.read_ring(placement)), false),
                Some(Arrival::Descriptor(placement)) => {
                    let bytes = self.read_ring(placement);
                    let (source, len) = self.ring.admit(&bytes, max_large)?;
                    self.start_read(source, len)?;
                    (None, true)
                }
                // Deregistered before the memory is handed out; a buffer whose
                // deregistration failed is leaked and the message lost.
                Some(Arrival::Large(buf)) => {
                    (buf.map_or(Some(Vec::new()), RegisteredVec::into_vec), false)
                }
                None => (None, false),
            };
            self.post_transmits()?;
            if let Some(message) = message {
                return Ok(message);
            }
            if reading {
                continue;
            }
            self.check_failed()?;
            self.progress(deadline, "recv")?;
        }
    }

    /// Waits until every posted send has completed and the peer has read every zero-copy
    /// message (reporting the connection's failure, if any).
    pub fn flush(&mut self, timeout: Duration) -> Result<(), ConnectionError> {
        let deadline = Some((Instant::now() + timeout, timeout));
        while !self.ring.is_flushed() {
            self.check_failed()?;
            self.progress(deadline, "flush")?;
        }
        self.check_failed()
    }

    /// Zero-copy messages sent and not yet read by the peer (their buffers are held).
    pub fn large_in_flight(&self) -> usize {
        self.ring.large_in_flight()
    }

    /// Registrations held by the zero-copy send cache.
    pub fn cached_registrations(&self) -> usize {
        self.registrations.len()
    }

    /// The ring's bytes at `placement`. The peer's write-with-immediate for them has
    /// completed, and credits keep it from writing there until acknowledged.
    fn read_ring(&self, placement: Placement) -> Vec<u8> {
        let mut out = Vec::with_capacity(placement.len() as usize);
        let (offset, len) = placement.first;
        self.recv_ring
            .read_at(offset as usize, len as usize, &mut out);
        self.recv_ring
            .read_at(0, placement.wrapped as usize, &mut out);
        out
    }

    /// Allocates and registers the destination of a zero-copy message of `len` bytes
    /// (admitted) and starts reading.
    fn start_read(&mut self, source: LargeDescriptor, len: usize) -> Result<(), ConnectionError> {
        let buf = zeroed(len)?;
        let buf = if len == 0 {
            None
        } else {
            // The Vec moves into the ring and is only handed out after every READ into it
            // has completed, or freed after the queue pair is destroyed (field order of
            // IbvConnection).
            Some(
                RegisteredVec::register(&self.pd, buf)
                    .map_err(verb_err("ibv_reg_mr (zero-copy receive)", &self.device))?,
            )
        };
        let (addr, lkey) = buf.as_ref().map_or((0, 0), |b| (b.addr(), b.lkey()));
        self.ring.start_read(source, addr, lkey, buf);
        Ok(())
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
        match self.read_remote_into(&target, remote_addr, rkey, timeout) {
            Ok(()) => Ok(target),
            Err(err) => {
                if self.ring.remote_reads_in_flight() > 0 {
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
        // The destination range is the target's, registered under `lkey` and untouched
        // until every READ into it completed (or leaked).
        self.ring.start_remote_read(ReadRange {
            remote_addr,
            rkey,
            local_addr,
            lkey,
            len,
        });
        let result = self.await_remote_read(deadline);
        self.ring.stop_remote_read();
        if result.is_err() && self.ring.remote_reads_in_flight() > 0 {
            self.flush_remote_reads();
        }
        result
    }

    /// Posts the READs of the remote read under way and takes completions until they all
    /// completed.
    fn await_remote_read(
        &mut self,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<(), ConnectionError> {
        loop {
            let done = self.ring.poll_remote_read();
            self.post_transmits()?;
            if done {
                return Ok(());
            }
            self.check_failed()?;
            self.progress(deadline, "RDMA read")?;
        }
    }

    /// One-sided READs posted by [`read_remote`](Self::read_remote) whose completion has
    /// not arrived (nonzero only after a failed or timed-out read whose flush did not
    /// finish).
    pub fn remote_reads_in_flight(&self) -> u32 {
        self.ring.remote_reads_in_flight()
    }

    /// Moves the queue pair to the error state and takes completions until the posted
    /// READs are flushed, for at most [`READ_FLUSH_TIMEOUT`].
    fn flush_remote_reads(&mut self) {
        if let Err(e) = self.abort() {
            debug!(error = %e, "cannot move the queue pair to the error state");
        }
        let until = Instant::now() + READ_FLUSH_TIMEOUT;
        while self.ring.remote_reads_in_flight() > 0 {
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
            .map_err(verb_err("ibv_modify_qp(ERR)", &self.device))
    }

    fn check_failed(&self) -> Result<(), ConnectionError> {
        self.failure()
            .map_or(Ok(()), |failure| Err(ConnectionError::Completion(failure)))
    }

    /// Posts the writes of one ring message: each piece staged in the send ring first
    /// unless inline.
    fn post_message(&mut self, writes: &MessageWrites, msg: &[u8]) -> Result<(), ConnectionError> {
        if !writes.inline {
            for piece in writes.pieces() {
                self.send_ring
                    .write_at(piece.offset as usize, &msg[piece.range()]);
            }
        }
        let (rkey, base) = (self.peer.ring_rkey, self.peer.ring_addr);
        let (lkey, send_base) = (self.send_ring.lkey(), self.send_ring.addr());
        // A staged range is inside the registered send ring, which outlives the queue
        // pair, and credits keep it unchanged until the peer acknowledges.
        let local = |piece: Piece| {
            let bytes = &msg[piece.range()];
            if bytes.is_empty() {
                Local::None
            } else if writes.inline {
                Local::Inline(bytes)
            } else {
                Local::Registered {
                    addr: send_base + u64::from(piece.offset),
                    len: piece.len,
                    lkey,
                }
            }
        };
        let mut requests = Vec::with_capacity(2);
        if let Some(piece) = writes.to_end {
            requests.push(SendRequest {
                wr_id: WorkKind::Data.wr_id(),
                op: SendOp::Write {
                    remote_addr: base + u64::from(piece.offset),
                    rkey,
                },
                local: local(piece),
            });
        }
        requests.push(SendRequest {
            wr_id: WorkKind::Data.wr_id(),
            op: SendOp::WriteImm {
                remote_addr: base + u64::from(writes.last.offset),
                rkey,
                imm: writes.imm,
            },
            // A zero-length message: the immediate alone.
            local: local(writes.last),
        });
        self.qp.post_send(&requests).map_err(verb_err(
            "ibv_post_send (RDMA write with immediate)",
            &self.device,
        ))
    }

    /// Posts the work requests the ring owes: receives, acknowledgements and READs.
    fn post_transmits(&mut self) -> Result<(), ConnectionError> {
        while let Some(transmit) = self.ring.poll_transmit() {
            let wr_id = transmit.wr_id();
            let (op, local, verb) = match transmit {
                Transmit::Recv => {
                    post_recv(&self.qp, &self.device)?;
                    continue;
                }
                Transmit::Ack { count } => (
                    SendOp::SendImm { imm: count },
                    Local::None,
                    "ibv_post_send (credit ack)",
                ),
                // The destination lies inside a buffer registered under `lkey`: the ring's
                // zero-copy receive buffer, owned until this READ completes, or the target
                // of `read_remote`, leaked if the READ may outlive it.
                Transmit::Read(read) | Transmit::RemoteRead(read) => (
                    SendOp::Read {
                        remote_addr: read.remote_addr,
                        rkey: read.rkey,
                    },
                    Local::Registered {
                        addr: read.local_addr,
                        len: read.len,
                        lkey: read.lkey,
                    },
                    if matches!(transmit, Transmit::Read(_)) {
                        "ibv_post_send (RDMA read)"
                    } else {
                        "ibv_post_send (one-sided RDMA read)"
                    },
                ),
            };
            self.qp
                .post_send(&[SendRequest { wr_id, op, local }])
                .map_err(verb_err(verb, &self.device))?;
        }
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
            match self.wait_once(spin_until, deadline.map(|(at, _)| at), &[])? {
                Waited::Completed => return Ok(()),
                Waited::DeadlinePassed => {
                    let after = deadline.map_or(Duration::ZERO, |(_, after)| after);
                    return Err(ConnectionError::Timeout { operation, after });
                }
                Waited::Woke => {}
            }
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
            .map_err(verb_err("poll on the completion channel", &self.device))?;
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

    /// Polls the CQ once, hands what it returned to the ring and posts the receives it
    /// owes; the number of completions.
    fn poll_once(&mut self) -> Result<usize, ConnectionError> {
        let mut wcs = [WorkCompletion::default(); POLL_BATCH];
        let n = self
            .cq
            .poll(&mut wcs)
            .map_err(verb_err("ibv_poll_cq", &self.device))?;
        let mut first_error = None;
        for wc in &wcs[..n] {
            let received = match wc.opcode() {
                sys::WC_RECV_RDMA_WITH_IMM => Received::WriteImm(wc.imm_data()),
                sys::WC_RECV => Received::SendImm(wc.imm_data()),
                _ => Received::Other,
            };
            let completion = Completion {
                wr_id: wc.wr_id(),
                status: wc.status(),
                vendor_err: wc.vendor_err(),
                received,
            };
            let result = match self.ring.handle_completion(completion) {
                Ok(()) => self.post_transmits(),
                Err(Fault::Protocol(e)) => Err(ConnectionError::Protocol(e)),
                Err(Fault::Completion(first)) => {
                    let failure = self.completion_failure(WorkFailure {
                        kind: WorkKind::of(completion.wr_id),
                        status: completion.status,
                        vendor_err: completion.vendor_err,
                    });
                    debug!(%failure, "RDMA work completion failed");
                    Err(ConnectionError::Completion(self.completion_failure(first)))
                }
            };
            if let Err(err) = result {
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(n), Err)
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
