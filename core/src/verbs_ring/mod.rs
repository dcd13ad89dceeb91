//! The verbs message ring's protocol: where a message goes in the peer's ring, when a
//! send must wait for credit or send-queue room, what a completion means, when to
//! acknowledge, and how a large message is read and when its buffer may go.
//!
//! Each side of an RC queue pair has a receive ring the peer writes into. A message of
//! up to the ring's length is one RDMA write-with-immediate (two writes when it wraps
//! past the end of the ring), whose immediate is its length ([`MessageImm`]). The
//! receiver acknowledges consumed messages by count with a zero-byte send-with-immediate,
//! which gives the sender its credit back ([`RingSender`], [`RingReceiver`]). A large
//! message goes as a [`LargeDescriptor`] through the ring: the receiver admits its length
//! ([`admit_large`]), READs the bytes from the sender's registered buffer, and only then
//! acknowledges; the sender holds the buffer until that acknowledgement.
//!
//! [`RingEndpoint`] is one side's machine. It does no I/O, touches no memory and keeps no
//! time (quinn-proto's shape): the runtime (`rdzv-rdma`'s `IbvConnection`) owns the
//! queue pair, the rings and the clock, and
//!
//! - asks [`send`](RingEndpoint::send) where a message goes ([`MessageWrites`]: which
//!   bytes to write at which ring offset, with which immediate, inline or staged), or
//!   hears `None`: wait for a completion and ask again;
//! - hands every work completion to [`handle_completion`](RingEndpoint::handle_completion);
//! - asks [`poll_arrival`](RingEndpoint::poll_arrival) for the next message
//!   ([`Arrival`]): bytes to copy out of its ring, a descriptor to admit and read
//!   ([`start_read`](RingEndpoint::start_read)), or a finished large message;
//! - posts what [`poll_transmit`](RingEndpoint::poll_transmit) returns ([`Transmit`]:
//!   receive work requests, acknowledgements, READs).
//!
//! **Polling order.** After each `handle_completion` batch, `poll_arrival`,
//! `start_read` or `poll_remote_read`, drain `poll_transmit`. The bytes of an
//! [`Arrival::Message`] or [`Arrival::Descriptor`] must be copied out of the ring
//! *before* that drain: the acknowledgement it may queue lets the peer overwrite them.
//!
//! The machine has no timers, so it takes no `now`: deadlines and the busy-poll/sleep
//! policy belong to the runtime's waits. Deliberately not here: registering memory,
//! copying bytes, the connection record and its exchange, reconnection.
//!
//! ```text
//!  one message, sender side                         receiver side
//!
//!  send(len) --no credit or no send-queue room--> None: wait for a completion
//!     | MessageWrites{seq}: 1-2 writes, the last carrying the immediate
//!     v
//!  [in flight] ---------- write-with-immediate ---------> handle_completion(WriteImm)
//!     |  (large: hold(seq, buffer))                             | poll_arrival
//!     |                                                         v
//!     |                               Message(placement): copy out  | Descriptor(placement)
//!     |                               ack due when a quarter of the |   copy out, admit_large,
//!     |                               ring or slots waits, or idle  |   start_read(buffer)
//!     |                                                         |   | Transmit::Read ...
//!     |                                                         |   v
//!     |                                                         | Large(buffer), ack at once
//!     v                                                         v
//!  handle_completion(SendImm) <------ send-with-immediate(count) -- Transmit::Ack{count}
//!  credit back; buffers held for messages up to the count released
//!
//!  a work request: posted (counted in sends_in_flight unless a receive)
//!     --> completed: success handled as above | failed: the endpoint is failed for
//!         good (failure() names the work request and the status), later calls see it
//! ```

mod credit;
mod message;
#[cfg(test)]
mod tests;

use alloc::collections::VecDeque;
use core::fmt;

pub use credit::{Placement, RingError, RingReceiver, RingSender};
pub use message::{
    admit_large, BadDescriptor, LargeDescriptor, MessageImm, DESCRIPTOR_LEN, MAX_RING_LEN,
};

/// Messages of at least this many bytes go zero-copy (descriptor in the ring, data by
/// RDMA READ); smaller ones are copied through the ring.
///
/// 16 KiB is where, on InfiniBand and RoCE NICs, one registration-cache hit plus a READ
/// round trip usually becomes cheaper than two memcpys (UCX and NCCL switch protocols in
/// the 8-64 KiB range). It has not been measured on hardware here: the only verbs stack
/// available is Soft-RoCE under TCG, whose timings say nothing about NICs. Re-measure with
/// `rdzv bench rpc --transport ibv` on real hardware.
pub const ZERO_COPY_THRESHOLD: usize = 16 * 1024;

/// The largest single READ, whatever the port allows.
const MAX_READ_CHUNK: u64 = 1 << 30;

/// What a work request is, kept in the top byte of its `wr_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkKind {
    /// A receive work request (for a message or an acknowledgement).
    Recv,
    /// A write (with or without immediate) of a ring message.
    Data,
    /// A credit acknowledgement (send-with-immediate).
    Ack,
    /// A READ of a large message into this side's buffer.
    Read,
    /// A one-sided READ of memory the peer lent ([`RingEndpoint::start_remote_read`]).
    RemoteRead,
    /// A `wr_id` this machine never gives out.
    Unknown,
}

impl WorkKind {
    const SHIFT: u32 = 56;

    /// The `wr_id` of a work request of this kind.
    pub const fn wr_id(self) -> u64 {
        let code: u64 = match self {
            WorkKind::Unknown => 0,
            WorkKind::Recv => 1,
            WorkKind::Data => 2,
            WorkKind::Ack => 3,
            WorkKind::Read => 4,
            WorkKind::RemoteRead => 5,
        };
        code << Self::SHIFT
    }

    /// The kind of a completed work request.
    pub const fn of(wr_id: u64) -> WorkKind {
        match wr_id >> Self::SHIFT {
            1 => WorkKind::Recv,
            2 => WorkKind::Data,
            3 => WorkKind::Ack,
            4 => WorkKind::Read,
            5 => WorkKind::RemoteRead,
            _ => WorkKind::Unknown,
        }
    }

    /// The operation, as an error message names it.
    pub const fn operation(self) -> &'static str {
        match self {
            WorkKind::Recv => "receive (ibv_post_recv)",
            WorkKind::Data => "RDMA write with immediate",
            WorkKind::Ack => "send with immediate (credit ack)",
            WorkKind::Read => "RDMA read (zero-copy receive)",
            WorkKind::RemoteRead => "RDMA read (one-sided)",
            WorkKind::Unknown => "unknown work request",
        }
    }
}

/// Work requests a queue pair must hold for a ring with `recv_slots` slots per direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueDepths {
    /// Receive work requests: the peer's messages in flight (at most its slots) and its
    /// acknowledgements (at most one per message it consumed and did not acknowledge).
    pub recv: u32,
    /// Send work requests: two writes per message, an ack per message received, and
    /// two spare.
    pub send: u32,
}

impl QueueDepths {
    /// The depths for `recv_slots` slots.
    pub const fn for_slots(recv_slots: u32) -> QueueDepths {
        QueueDepths {
            recv: 2 * recv_slots,
            send: 3 * recv_slots + 2,
        }
    }

    /// Completion queue entries for both.
    pub const fn completions(self) -> u32 {
        self.recv + self.send
    }
}

/// What a [`RingEndpoint`] is built from: both rings' geometry and the queue pair's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    /// This side's receive ring length (a power of two).
    pub ring_len: u32,
    /// Receive slots this side advertised.
    pub recv_slots: u32,
    /// The peer's receive ring length, from its connection record.
    pub peer_ring_len: u32,
    /// The peer's receive slots, from its connection record.
    pub peer_recv_slots: u32,
    /// Send work requests the queue pair holds.
    pub max_send_wr: u32,
    /// Inline data the queue pair supports.
    pub max_inline: u32,
    /// The largest message the port moves in one work request (READs are split at it).
    pub max_read_len: u64,
    /// Largest zero-copy message this side accepts.
    pub max_large_message: u64,
}

/// One write of a ring message: `len` bytes of the message from `start`, written at
/// `offset` of the peer's ring (and staged at the same offset of the send ring).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Ring offset.
    pub offset: u32,
    /// First byte of the message in this piece.
    pub start: u32,
    /// Bytes.
    pub len: u32,
}

impl Piece {
    /// The piece's bytes within the message.
    pub fn range(&self) -> core::ops::Range<usize> {
        self.start as usize..(self.start + self.len) as usize
    }
}

/// How to post one ring message ([`RingEndpoint::send`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageWrites {
    /// The message's sequence number (the first message is 0).
    pub seq: u64,
    /// Whether the pieces go inline in the work requests. Otherwise copy each piece into
    /// the send ring at its offset first and write from there.
    pub inline: bool,
    /// When the message wraps: the piece up to the end of the ring, written first and
    /// without immediate (RC keeps order, so the whole message is in place when the
    /// immediate arrives).
    pub to_end: Option<Piece>,
    /// The (last) piece, written with [`imm`](Self::imm); empty for an empty message.
    pub last: Piece,
    /// The immediate, host order.
    pub imm: u32,
}

impl MessageWrites {
    /// The pieces, in posting order.
    pub fn pieces(&self) -> impl Iterator<Item = Piece> {
        self.to_end.into_iter().chain(Some(self.last))
    }
}

/// A message longer than the peer's ring ([`RingEndpoint::send`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageTooLarge {
    /// Message length.
    pub len: usize,
    /// The peer's ring length.
    pub max: u32,
}

/// A work completion, as the runtime polled it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// `wr_id` (see [`WorkKind`]).
    pub wr_id: u64,
    /// `status`: 0 for success.
    pub status: u32,
    /// `vendor_err`.
    pub vendor_err: u32,
    /// What a receive completion received.
    pub received: Received,
}

/// What completed on a receive work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// The peer's write-with-immediate: a message, this immediate.
    WriteImm(u32),
    /// The peer's send-with-immediate: an acknowledgement of this many messages.
    SendImm(u32),
    /// Anything else (not a receive completion).
    Other,
}

/// A work request that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkFailure {
    /// What the work request was.
    pub kind: WorkKind,
    /// `status`.
    pub status: u32,
    /// `vendor_err`.
    pub vendor_err: u32,
}

/// What a completion broke ([`RingEndpoint::handle_completion`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A work request failed: the endpoint is failed for good.
    Completion(WorkFailure),
    /// The peer broke the ring protocol.
    Protocol(RingError),
}

/// An RDMA READ to post: `len` bytes from the peer's `remote_addr` (under `rkey`) to this
/// side's `local_addr` (under `lkey`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequest {
    /// Source address in the peer's memory.
    pub remote_addr: u64,
    /// The peer's key for it.
    pub rkey: u32,
    /// Destination address here.
    pub local_addr: u64,
    /// This side's key for it.
    pub lkey: u32,
    /// Bytes (one chunk of a larger read).
    pub len: u32,
}

/// A work request the protocol owes, for the runtime to post ([`RingEndpoint::poll_transmit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transmit {
    /// A receive work request with no scatter list ([`WorkKind::Recv`]): writes-with-immediate
    /// and zero-byte sends carry no payload into it.
    Recv,
    /// A zero-byte send-with-immediate of `count` ([`WorkKind::Ack`]).
    Ack {
        /// Messages consumed since the last acknowledgement.
        count: u32,
    },
    /// A READ of a large message ([`WorkKind::Read`]).
    Read(ReadRequest),
    /// A one-sided READ ([`WorkKind::RemoteRead`]).
    RemoteRead(ReadRequest),
}

impl Transmit {
    /// The `wr_id` to post it with.
    pub const fn wr_id(&self) -> u64 {
        match self {
            Transmit::Recv => WorkKind::Recv.wr_id(),
            Transmit::Ack { .. } => WorkKind::Ack.wr_id(),
            Transmit::Read(_) => WorkKind::Read.wr_id(),
            Transmit::RemoteRead(_) => WorkKind::RemoteRead.wr_id(),
        }
    }
}

/// The next message ([`RingEndpoint::poll_arrival`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Arrival<B> {
    /// A message at `placement` of this side's ring: copy it out before draining
    /// [`poll_transmit`](RingEndpoint::poll_transmit).
    Message(Placement),
    /// A [`LargeDescriptor`] at `placement`: copy it out, decode it, check it with
    /// [`admit`](RingEndpoint::admit), and start reading with
    /// [`start_read`](RingEndpoint::start_read).
    Descriptor(Placement),
    /// The large message read into this buffer is complete (its acknowledgement queued).
    Large(B),
}

/// A whole READ of `len` bytes, posted in chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRange {
    /// Source address in the peer's memory.
    pub remote_addr: u64,
    /// The peer's key for it.
    pub rkey: u32,
    /// Destination address here.
    pub local_addr: u64,
    /// This side's key for it.
    pub lkey: u32,
    /// Bytes.
    pub len: u64,
}

/// A READ under way: how much is posted, and how many chunks have not completed.
#[derive(Debug)]
struct Reading<B> {
    range: ReadRange,
    posted: u64,
    in_flight: u32,
    buf: B,
}

/// One side of a verbs ring connection (see the module documentation).
///
/// `H` is what the runtime holds for a zero-copy message sent until the peer acknowledges
/// it (a registration and its buffer: dropped then). `B` is the buffer a large message is
/// read into, handed back in [`Arrival::Large`].
pub struct RingEndpoint<H, B> {
    tx: RingSender,
    rx: RingReceiver,
    max_send_wr: u32,
    max_inline: u32,
    max_read_len: u64,
    max_large_message: u64,
    /// Send work requests posted (or queued to be) and not completed.
    outstanding: u32,
    /// Messages sent, and messages the peer acknowledged.
    sent: u64,
    acked: u64,
    /// What zero-copy messages hold until acknowledged, by sequence number.
    held: VecDeque<(u64, H)>,
    /// Immediates of messages that arrived and were not taken yet.
    arrived: VecDeque<u32>,
    /// The large message being read.
    reading: Option<Reading<B>>,
    /// The one-sided READ being posted, and its chunks not completed.
    remote: Option<Reading<()>>,
    remote_in_flight: u32,
    transmits: VecDeque<Transmit>,
    failure: Option<WorkFailure>,
}

impl<H, B> fmt::Debug for RingEndpoint<H, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingEndpoint")
            .field("outstanding_sends", &self.outstanding)
            .field("free_bytes", &self.tx.free_bytes())
            .field("free_slots", &self.tx.free_slots())
            .field("unacked", &self.rx.unacked())
            .field("arrived", &self.arrived.len())
            .field("large_in_flight", &self.held.len())
            .field(
                "reading",
                &self
                    .reading
                    .as_ref()
                    .map(|r| (r.range.len, r.posted, r.in_flight)),
            )
            .field("failure", &self.failure)
            .finish_non_exhaustive()
    }
}

impl<H, B> RingEndpoint<H, B> {
    /// The endpoint of a connection whose record exchange gave `config`. The runtime
    /// posts [`QueueDepths::recv`] receive work requests before the peer may send.
    ///
    /// # Errors
    /// [`RingError::Geometry`] for a ring that is not a power of two, or no slots.
    pub fn new(config: RingConfig) -> Result<Self, RingError> {
        Ok(RingEndpoint {
            tx: RingSender::new(config.peer_ring_len, config.peer_recv_slots)?,
            rx: RingReceiver::new(config.ring_len, config.recv_slots)?,
            max_send_wr: config.max_send_wr,
            max_inline: config.max_inline,
            max_read_len: config.max_read_len.max(1),
            max_large_message: config.max_large_message,
            outstanding: 0,
            sent: 0,
            acked: 0,
            held: VecDeque::new(),
            arrived: VecDeque::new(),
            reading: None,
            remote: None,
            remote_in_flight: 0,
            transmits: VecDeque::new(),
            failure: None,
        })
    }

    /// The largest ring message: the peer's ring length.
    pub fn max_message_len(&self) -> u32 {
        self.tx.ring_len()
    }

    /// Whether a `len`-byte message goes zero-copy: from [`ZERO_COPY_THRESHOLD`] bytes, or
    /// when it does not fit the peer's ring.
    pub fn zero_copy(&self, len: usize) -> bool {
        len >= ZERO_COPY_THRESHOLD || len > self.tx.ring_len() as usize
    }

    /// Whether a ring message of `len` bytes can be sent now, without waiting for credit
    /// or send-queue room (the condition [`send`](Self::send) waits for).
    pub fn can_send(&self, len: usize) -> bool {
        u32::try_from(len).is_ok_and(|len| len <= self.tx.free_bytes())
            && self.tx.free_slots() > 0
            && self.outstanding + 3 <= self.max_send_wr
    }

    /// Places a ring message of `len` bytes (a descriptor when `descriptor`): its writes,
    /// or `None` while the peer's credits or the send queue are short (wait for a
    /// completion and ask again). The writes are counted as posted.
    ///
    /// # Errors
    /// [`MessageTooLarge`] above the peer's ring length: it would never fit.
    pub fn send(
        &mut self,
        len: usize,
        descriptor: bool,
    ) -> Result<Option<MessageWrites>, MessageTooLarge> {
        let max = self.tx.ring_len();
        let len32 = u32::try_from(len)
            .ok()
            .filter(|&l| l <= max)
            .ok_or(MessageTooLarge { len, max })?;
        // Two work requests at most, and room for the acknowledgements.
        if self.outstanding + 3 > self.max_send_wr {
            return Ok(None);
        }
        let Some(placement) = self.tx.reserve(len32) else {
            return Ok(None);
        };
        let imm = if descriptor {
            MessageImm::Descriptor(len32)
        } else {
            MessageImm::Inline(len32)
        };
        let (offset, first_len) = placement.first;
        let head = Piece {
            offset,
            start: 0,
            len: first_len,
        };
        let (to_end, last) = if placement.wrapped == 0 {
            (None, head)
        } else {
            let tail = Piece {
                offset: 0,
                start: first_len,
                len: placement.wrapped,
            };
            (Some(head), tail)
        };
        let writes = MessageWrites {
            seq: self.sent,
            inline: first_len.max(placement.wrapped) <= self.max_inline,
            to_end,
            last,
            imm: imm.encode(),
        };
        self.outstanding += 1 + u32::from(to_end.is_some());
        self.sent += 1;
        Ok(Some(writes))
    }

    /// Holds `held` until the peer acknowledges message `seq` (a descriptor just sent).
    pub fn hold(&mut self, seq: u64, held: H) {
        self.held.push_back((seq, held));
    }

    /// Zero-copy messages sent and not acknowledged (their buffers are held).
    pub fn large_in_flight(&self) -> usize {
        self.held.len()
    }

    /// Send work requests not completed yet (messages, READs and acknowledgements).
    pub fn sends_in_flight(&self) -> u32 {
        self.outstanding
    }

    /// Whether every send completed and every zero-copy message was acknowledged.
    pub fn is_flushed(&self) -> bool {
        self.outstanding == 0 && self.held.is_empty()
    }

    /// The first failed work request, if any: the endpoint is failed for good.
    pub fn failure(&self) -> Option<WorkFailure> {
        self.failure
    }

    /// Handles one work completion: counts it, records a failure, takes a message's
    /// immediate or applies an acknowledgement (releasing what the acknowledged
    /// messages held), and queues a new receive for each receive that completed.
    ///
    /// # Errors
    /// [`Fault::Completion`] for a failed work request (the first failure is kept and
    /// returned by [`failure`](Self::failure)); [`Fault::Protocol`] for an acknowledgement
    /// of more messages than are in flight.
    pub fn handle_completion(&mut self, completion: Completion) -> Result<(), Fault> {
        let kind = WorkKind::of(completion.wr_id);
        if kind != WorkKind::Recv {
            self.outstanding = self.outstanding.saturating_sub(1);
        }
        if kind == WorkKind::RemoteRead {
            self.remote_in_flight = self.remote_in_flight.saturating_sub(1);
        }
        if completion.status != 0 {
            let failure = *self.failure.get_or_insert(WorkFailure {
                kind,
                status: completion.status,
                vendor_err: completion.vendor_err,
            });
            return Err(Fault::Completion(failure));
        }
        match kind {
            WorkKind::Read => {
                if let Some(reading) = self.reading.as_mut() {
                    reading.in_flight = reading.in_flight.saturating_sub(1);
                }
                return Ok(());
            }
            WorkKind::Recv => {}
            _ => return Ok(()),
        }
        match completion.received {
            Received::WriteImm(imm) => self.arrived.push_back(imm),
            Received::SendImm(count) => {
                self.tx.acknowledge(count).map_err(Fault::Protocol)?;
                self.acked += u64::from(count);
                while self.held.front().is_some_and(|(seq, _)| *seq < self.acked) {
                    self.held.pop_front();
                }
            }
            Received::Other => {}
        }
        self.transmits.push_back(Transmit::Recv);
        Ok(())
    }

    /// Whether a large message is being read (no other message is taken until it is in).
    pub fn is_reading(&self) -> bool {
        self.reading.is_some()
    }

    /// The next message, if one has arrived; while a large message is being read, posts
    /// more of its READs and returns it once they all completed.
    ///
    /// # Errors
    /// [`RingError::Overrun`]: the peer wrote more than its credits allowed.
    pub fn poll_arrival(&mut self) -> Result<Option<Arrival<B>>, RingError> {
        if self.reading.is_some() {
            self.pump_read();
            let done = self
                .reading
                .as_ref()
                .is_some_and(|r| r.in_flight == 0 && r.posted == r.range.len);
            let Some(reading) = self.reading.take_if(|_| done) else {
                return Ok(None);
            };
            // At once: the sender holds the buffer until then.
            self.queue_ack(true);
            return Ok(Some(Arrival::Large(reading.buf)));
        }
        let Some(imm) = self.arrived.pop_front() else {
            return Ok(None);
        };
        let imm = MessageImm::decode(imm);
        let placement = self.rx.accept(imm.ring_len())?;
        Ok(Some(match imm {
            MessageImm::Inline(_) => {
                self.queue_ack(self.arrived.is_empty());
                Arrival::Message(placement)
            }
            MessageImm::Descriptor(_) => Arrival::Descriptor(placement),
        }))
    }

    /// Checks a descriptor's bytes (from an [`Arrival::Descriptor`]) against
    /// `max_large` and this side's own limit: the message's source and length, before
    /// anything is allocated for it.
    ///
    /// # Errors
    /// [`BadDescriptor`] when it does not parse (length 0) or is refused.
    pub fn admit(
        &self,
        bytes: &[u8],
        max_large: u64,
    ) -> Result<(LargeDescriptor, usize), BadDescriptor> {
        let max = max_large.min(self.max_large_message);
        let descriptor_len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
        let source = LargeDescriptor::decode(bytes).ok_or(BadDescriptor {
            len: 0,
            max,
            descriptor_len,
        })?;
        let len = admit_large(&source, max, descriptor_len)?;
        Ok((source, len))
    }

    /// Starts reading the admitted message `source` into `buf`, registered at
    /// `local_addr` under `lkey` (unused for an empty message), and queues its first READs.
    pub fn start_read(&mut self, source: LargeDescriptor, local_addr: u64, lkey: u32, buf: B) {
        self.reading = Some(Reading {
            range: ReadRange {
                remote_addr: source.addr,
                rkey: source.rkey,
                local_addr,
                lkey,
                len: source.len,
            },
            posted: 0,
            in_flight: 0,
            buf,
        });
        self.pump_read();
    }

    /// Starts a one-sided READ of `range` (memory the peer lent), posted in chunks by
    /// [`poll_remote_read`](Self::poll_remote_read). One at a time.
    pub fn start_remote_read(&mut self, range: ReadRange) {
        self.remote = Some(Reading {
            range,
            posted: 0,
            in_flight: 0,
            buf: (),
        });
    }

    /// Queues more chunks of the one-sided READ as the send queue allows; whether all of
    /// it has been read (every chunk posted and completed).
    pub fn poll_remote_read(&mut self) -> bool {
        let Some(mut remote) = self.remote.take() else {
            return self.remote_in_flight == 0;
        };
        let before = remote.in_flight;
        self.pump(&mut remote, Transmit::RemoteRead);
        self.remote_in_flight += remote.in_flight - before;
        let done = remote.posted == remote.range.len && self.remote_in_flight == 0;
        if !done {
            self.remote = Some(remote);
        }
        done
    }

    /// Stops posting the one-sided READ (after an error); chunks already posted still
    /// count in [`remote_reads_in_flight`](Self::remote_reads_in_flight).
    pub fn stop_remote_read(&mut self) {
        self.remote = None;
    }

    /// One-sided READ chunks posted and not completed.
    pub fn remote_reads_in_flight(&self) -> u32 {
        self.remote_in_flight
    }

    /// The next work request to post.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// Queues an acknowledgement if one is due ([`RingReceiver::take_ack`]).
    fn queue_ack(&mut self, idle: bool) {
        if let Some(count) = self.rx.take_ack(idle) {
            self.outstanding += 1;
            self.transmits.push_back(Transmit::Ack { count });
        }
    }

    fn pump_read(&mut self) {
        if let Some(mut reading) = self.reading.take() {
            self.pump(&mut reading, Transmit::Read);
            self.reading = Some(reading);
        }
    }

    /// Queues READ chunks of `reading` while the send queue keeps room for an ack.
    fn pump<T>(&mut self, reading: &mut Reading<T>, wrap: fn(ReadRequest) -> Transmit) {
        let range = reading.range;
        while reading.posted < range.len && self.outstanding + 2 <= self.max_send_wr {
            let chunk = (range.len - reading.posted)
                .min(self.max_read_len)
                .min(MAX_READ_CHUNK);
            self.transmits.push_back(wrap(ReadRequest {
                remote_addr: range.remote_addr + reading.posted,
                rkey: range.rkey,
                local_addr: range.local_addr + reading.posted,
                lkey: range.lkey,
                len: chunk as u32,
            }));
            reading.posted += chunk;
            reading.in_flight += 1;
            self.outstanding += 1;
        }
    }
}
