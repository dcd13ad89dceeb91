//! The single-executor store server as one io_uring event loop (the `io-uring` crate),
//! without glommio's reactor.
//!
//! Why it exists: for each sleep/wake cycle glommio makes about four `io_uring_enter`
//! calls and arms and cancels a timeout, and a store server on a quiet connection sleeps
//! and wakes once per request. Here the loop submits everything it owes (each
//! connection's next receive and its replies) and waits for the next completion in one
//! `io_uring_enter`, so one request costs one system call, and a busy server handles
//! every ready connection per call. `ARCHITECTURE.md` has the measurements.
//!
//! The loop owns the engine and a table of connections. Every connection has at most
//! one receive and one send in flight; the kernel reads from or writes into buffers the
//! connection owns, and a connection is freed only after both operations completed, so
//! no buffer is ever released while the kernel may still touch it. A connection that
//! must close (bad input, the engine refused it, end of stream, a socket error) leaves
//! the engine at once, so its waiters never linger; a pending receive is cancelled.
//!
//! Shutdown: when the stop flag is seen (checked at least every 50 ms) the loop stops
//! accepting, gives every connection `drain` to flush what it owes, then cancels what is
//! left and waits for the kernel to let go of the buffers.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};
use rdzv_core::store::codec::{Limits, RequestDecoder};
use rdzv_core::store::engine::Engine;
use rdzv_core::store::ConnId;

use super::session::{serve_frames, ReadBuf, Served};
use super::StatsCells;

/// Submission queue entries. Each connection has at most two operations in flight; a
/// full queue is submitted and refilled, so this bounds only the batch size.
const SQ_ENTRIES: u32 = 1024;
/// Completion queue entries (the kernel's maximum is 65536). The kernel keeps overflowing
/// completions (`IORING_FEAT_NODROP`), so more connections than this are still served.
const CQ_ENTRIES: u32 = 16384;
/// How often the stop flag is looked at while nothing happens.
const TICK: Duration = Duration::from_millis(50);
/// A connection whose unsent replies exceed this stops being read until the peer reads
/// them: a client that pipelines requests and never reads costs bounded memory.
const OUT_HIGH_WATER: usize = 4 << 20;
/// After a failed accept (out of descriptors, say), wait this long before the next one.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
/// How long, after the drain, the loop waits for the kernel to complete cancelled
/// operations before it gives their buffers up for lost (leaks them) rather than free
/// memory the kernel might still write.
const CANCEL_GRACE: Duration = Duration::from_secs(1);

/// What a completion is for, in the low byte of its user data; the connection's slot is
/// in the bits above.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Accept = 1,
    Recv = 2,
    Send = 3,
    Cancel = 4,
}

fn user_data(slot: usize, op: Op) -> u64 {
    ((slot as u64) << 8) | op as u64
}

fn decode_user_data(data: u64) -> Option<(usize, Op)> {
    let op = match data & 0xff {
        1 => Op::Accept,
        2 => Op::Recv,
        3 => Op::Send,
        4 => Op::Cancel,
        _ => return None,
    };
    Some((usize::try_from(data >> 8).ok()?, op))
}

/// Connection ids carry their slot in the low 32 bits and a sequence number above, so
/// that a wake-up for a connection that is gone never reaches the slot's next occupant.
fn conn_id(slot: usize, seq: u64) -> ConnId {
    ConnId((seq << 32) | (slot as u64 & 0xffff_ffff))
}

fn slot_of(id: ConnId) -> usize {
    (id.0 & 0xffff_ffff) as usize
}

/// One client connection.
struct Conn {
    fd: OwnedFd,
    id: ConnId,
    input: ReadBuf,
    /// Cuts `input` into requests, resuming a long key list where it stopped.
    decoder: RequestDecoder,
    /// Bytes owed and not yet handed to the kernel.
    out: Vec<u8>,
    /// Bytes handed to the kernel; it reads them until the send completes.
    sending: Vec<u8>,
    /// How much of `sending` has gone out.
    sent: usize,
    /// A receive into `input` is in flight (the kernel owns its spare bytes).
    recv_busy: bool,
    /// A send from `sending` is in flight (the kernel reads it).
    send_busy: bool,
    phase: Phase,
}

/// Where a connection is in its life. Every state but `Open` is out of the engine (the
/// transition removes it, so its waiters never outlive it).
///
/// ```text
///  accept ─► Open ─(bad input, refused, shutdown)─► Flushing ─(all sent)─► freed
///             │                                        │
///             └─(end of stream, socket error)─► Abandoned ◄─(socket error, drain over)
///                                                 └─(nothing in flight)─► freed
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading requests and sending replies.
    Open,
    /// No more reads: send what is owed, then close. `recv_cancelled`: the pending
    /// receive has been asked to stop.
    Flushing { recv_cancelled: bool },
    /// The peer is gone: what is owed is dropped; waits only for the kernel to finish
    /// the operations in flight.
    Abandoned { recv_cancelled: bool },
}

impl Phase {
    /// The phase after a close of kind `how`: `Abandoned` is never undone, and a
    /// cancelled receive stays cancelled.
    fn closed(self, how: Close) -> Phase {
        let recv_cancelled = self.recv_cancelled();
        match (self, how) {
            (Phase::Abandoned { .. }, _) | (_, Close::Abandon) => {
                Phase::Abandoned { recv_cancelled }
            }
            (_, Close::Flush) => Phase::Flushing { recv_cancelled },
        }
    }

    fn recv_cancelled(self) -> bool {
        match self {
            Phase::Open => false,
            Phase::Flushing { recv_cancelled } | Phase::Abandoned { recv_cancelled } => {
                recv_cancelled
            }
        }
    }
}

impl Conn {
    /// Done when nothing is in flight and nothing more will be sent.
    fn finished(&self) -> bool {
        let idle = !self.recv_busy && !self.send_busy;
        match self.phase {
            Phase::Open => false,
            Phase::Flushing { .. } => {
                idle && self.out.is_empty() && self.sent >= self.sending.len()
            }
            Phase::Abandoned { .. } => idle,
        }
    }
}

/// How a connection stops being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Close {
    /// Send what is owed first.
    Flush,
    /// Drop what is owed (the peer is gone, or time is up).
    Abandon,
}

/// The peer's address for log lines, looked up only when a line is written.
struct Peer<'a>(&'a OwnedFd);

impl fmt::Display for Peer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match socket2::SockRef::from(self.0)
            .peer_addr()
            .ok()
            .and_then(|a| a.as_socket())
        {
            Some(addr) => write!(f, "{addr}"),
            None => f.write_str("?"),
        }
    }
}

/// The loop's state.
struct Server {
    ring: IoUring,
    listener: OwnedFd,
    engine: Engine,
    limits: Limits,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    /// Slots to look at after this batch of completions.
    dirty: Vec<usize>,
    seq: u64,
    live: usize,
    accept_busy: bool,
    accept_cancel_sent: bool,
    accepting: bool,
    accept_after: Instant,
    stats: Arc<StatsCells>,
}

/// Creates the ring (the caller reports failure before saying the server is ready).
pub(super) fn ring() -> io::Result<IoUring> {
    IoUring::builder()
        .setup_cqsize(CQ_ENTRIES)
        .build(SQ_ENTRIES)
}

/// Serves `listener` until `stop` is set, then drains for up to `drain`.
pub(super) fn serve(
    ring: IoUring,
    listener: OwnedFd,
    limits: Limits,
    drain: Duration,
    stop: &AtomicBool,
    stats: Arc<StatsCells>,
) {
    let mut server = Server {
        ring,
        listener,
        engine: Engine::new(),
        limits,
        conns: Vec::new(),
        free: Vec::new(),
        dirty: Vec::new(),
        seq: 0,
        live: 0,
        accept_busy: false,
        accept_cancel_sent: false,
        accepting: true,
        accept_after: Instant::now(),
        stats,
    };
    if let Err(error) = server.run(stop, drain) {
        tracing::error!(%error, "store server event loop failed; closing every connection");
    }
    server.finish();
}

impl Server {
    fn run(&mut self, stop: &AtomicBool, drain: Duration) -> io::Result<()> {
        let mut drain_deadline = None;
        loop {
            if drain_deadline.is_none() && stop.load(Ordering::Acquire) {
                self.begin_shutdown()?;
                drain_deadline = Some(Instant::now() + drain);
            }
            if let Some(deadline) = drain_deadline {
                if (self.live == 0 && !self.accept_busy) || Instant::now() >= deadline {
                    return Ok(());
                }
            }
            self.maybe_accept()?;
            self.wait()?;
            self.complete()?;
            self.service_dirty()?;
            self.publish();
        }
    }

    /// Submits what is queued and waits for one completion or the tick.
    fn wait(&mut self) -> io::Result<()> {
        let timeout = types::Timespec::from(TICK);
        let args = types::SubmitArgs::new().timespec(&timeout);
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => Ok(()),
            Err(e) => match e.raw_os_error() {
                // ETIME: the tick; EINTR: a signal; EBUSY: completions to reap first.
                Some(libc::ETIME | libc::EINTR | libc::EBUSY) => Ok(()),
                _ => Err(e),
            },
        }
    }

    /// Queues `entry`, submitting the queue first when it is full.
    ///
    /// # Safety
    /// Every buffer `entry` points to must stay valid, and not be moved or freed, until
    /// its completion has been reaped.
    unsafe fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: the caller guarantees the buffers' lifetime (this function's
            // contract).
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return Ok(());
            }
            match self.ring.submit() {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EINTR)) => {
                    // The completion queue is full: reap before submitting more.
                    self.complete()?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn maybe_accept(&mut self) -> io::Result<()> {
        if !self.accepting || self.accept_busy || Instant::now() < self.accept_after {
            return Ok(());
        }
        let entry = opcode::Accept::new(
            types::Fd(self.listener.as_raw_fd()),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
        .flags(libc::SOCK_CLOEXEC)
        .build()
        .user_data(user_data(0, Op::Accept));
        // SAFETY: no buffer: the peer address is not asked for.
        unsafe { self.push(&entry)? };
        self.accept_busy = true;
        Ok(())
    }

    /// Reaps every completion there is.
    fn complete(&mut self) -> io::Result<()> {
        loop {
            let batch: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result()))
                .collect();
            if batch.is_empty() {
                return Ok(());
            }
            for (data, result) in batch {
                match decode_user_data(data) {
                    Some((_, Op::Accept)) => self.accepted(result),
                    Some((slot, Op::Recv)) => self.received(slot, result),
                    Some((slot, Op::Send)) => self.sent(slot, result),
                    Some((_, Op::Cancel)) | None => {}
                }
            }
        }
    }

    fn accepted(&mut self, result: i32) {
        self.accept_busy = false;
        if result < 0 {
            let error = io::Error::from_raw_os_error(-result);
            if result != -libc::ECANCELED {
                tracing::warn!(%error, "accept failed");
                self.accept_after = Instant::now() + ACCEPT_BACKOFF;
            }
            return;
        }
        // SAFETY: a successful accept completion's result is a new descriptor that
        // nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(result as RawFd) };
        if !self.accepting {
            // Accepted just as shutdown began: close it unserved.
            return;
        }
        if let Err(error) = socket2::SockRef::from(&fd).set_nodelay(true) {
            tracing::debug!(%error, "TCP_NODELAY failed");
        }
        let slot = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        self.seq += 1;
        let id = conn_id(slot, self.seq);
        self.engine.connect(id);
        if let Some(entry) = self.conns.get_mut(slot) {
            *entry = Some(Conn {
                fd,
                id,
                input: ReadBuf::new(),
                decoder: RequestDecoder::new(self.limits),
                out: Vec::new(),
                sending: Vec::new(),
                sent: 0,
                recv_busy: false,
                send_busy: false,
                phase: Phase::Open,
            });
            self.live += 1;
            self.dirty.push(slot);
        }
    }

    fn received(&mut self, slot: usize, result: i32) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        conn.recv_busy = false;
        self.dirty.push(slot);
        if result <= 0 {
            if result < 0 && result != -libc::ECANCELED {
                let error = io::Error::from_raw_os_error(-result);
                tracing::debug!(peer = %Peer(&conn.fd), %error, "store connection read failed");
            }
            // End of stream or an error: the peer is gone, nothing more can be sent.
            self.close(slot, Close::Abandon);
            return;
        }
        if conn.phase != Phase::Open {
            // Read just before a close was decided: the bytes are not served.
            return;
        }
        conn.input.filled += result as usize;
        let id = conn.id;
        let mut out = std::mem::take(&mut conn.out);
        let mut others = Vec::new();
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        let Served { used, close, .. } = serve_frames(
            self.stats.metrics.as_ref(),
            &mut self.engine,
            &mut conn.decoder,
            id,
            &Peer(&conn.fd),
            conn.input.pending(),
            &mut out,
            |engine, own| {
                while let Some((target, wake)) = engine.poll_wakeup() {
                    if target == id {
                        own.push(wake as u8);
                    } else {
                        others.push((target, wake as u8));
                    }
                }
            },
        );
        if let Some(Some(conn)) = self.conns.get_mut(slot) {
            conn.input.consume(used);
            conn.out = out;
        }
        self.deliver(others);
        if close {
            self.close(slot, Close::Flush);
        }
    }

    /// Appends wake-up bytes to the connections they are for (if still there).
    fn deliver(&mut self, wakes: Vec<(ConnId, u8)>) {
        for (target, byte) in wakes {
            let slot = slot_of(target);
            if let Some(Some(conn)) = self.conns.get_mut(slot) {
                if conn.id == target && !matches!(conn.phase, Phase::Abandoned { .. }) {
                    conn.out.push(byte);
                    self.dirty.push(slot);
                }
            }
        }
    }

    fn sent(&mut self, slot: usize, result: i32) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        conn.send_busy = false;
        self.dirty.push(slot);
        if result < 0 {
            let error = io::Error::from_raw_os_error(-result);
            tracing::debug!(peer = %Peer(&conn.fd), %error, "store connection write failed");
            self.close(slot, Close::Abandon);
            return;
        }
        conn.sent += result as usize;
        if conn.sent >= conn.sending.len() {
            conn.sending.clear();
            conn.sent = 0;
        }
    }

    /// Stops reading a connection: out of the engine on leaving `Open` (handing out
    /// the wake-ups that releases), then `Flushing`, or `Abandoned` (which `Flush` never
    /// undoes).
    fn close(&mut self, slot: usize, how: Close) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        let was = conn.phase;
        conn.phase = was.closed(how);
        self.dirty.push(slot);
        if was != Phase::Open {
            return;
        }
        let id = conn.id;
        self.engine.disconnect(id);
        let mut others = Vec::new();
        while let Some((target, wake)) = self.engine.poll_wakeup() {
            if target != id {
                others.push((target, wake as u8));
            }
        }
        self.deliver(others);
    }

    /// Queues each touched connection's next receive and send, cancels what a closing
    /// connection no longer needs, and frees finished connections.
    fn service_dirty(&mut self) -> io::Result<()> {
        while let Some(slot) = self.dirty.pop() {
            let Some(Some(conn)) = self.conns.get_mut(slot) else {
                continue;
            };
            if conn.finished() {
                // Nothing in flight: the buffers and the descriptor can go.
                if let Some(entry) = self.conns.get_mut(slot) {
                    *entry = None;
                }
                self.free.push(slot);
                self.live = self.live.saturating_sub(1);
                continue;
            }
            let fd = types::Fd(conn.fd.as_raw_fd());
            let phase = conn.phase;
            if phase != Phase::Open && conn.recv_busy && !phase.recv_cancelled() {
                conn.phase = match phase {
                    Phase::Abandoned { .. } => Phase::Abandoned {
                        recv_cancelled: true,
                    },
                    _ => Phase::Flushing {
                        recv_cancelled: true,
                    },
                };
                let entry = opcode::AsyncCancel::new(user_data(slot, Op::Recv))
                    .build()
                    .user_data(user_data(slot, Op::Cancel));
                // SAFETY: a cancel points at no buffer.
                unsafe { self.push(&entry)? };
                continue;
            }
            let unsent = conn.out.len() + conn.sending.len().saturating_sub(conn.sent);
            if conn.phase == Phase::Open && !conn.recv_busy && unsent < OUT_HIGH_WATER {
                let spare = conn.input.spare();
                let len = u32::try_from(spare.len()).unwrap_or(u32::MAX);
                let entry = opcode::Recv::new(fd, spare.as_mut_ptr(), len)
                    .build()
                    .user_data(user_data(slot, Op::Recv));
                conn.recv_busy = true;
                // SAFETY: `spare` is the unfilled tail of this connection's input
                // buffer, which is neither read, resized nor freed while `recv_busy`
                // (the connection is freed only when `finished()`, which needs both
                // operations completed).
                unsafe { self.push(&entry)? };
            }
            let Some(Some(conn)) = self.conns.get_mut(slot) else {
                continue;
            };
            let abandoned = matches!(conn.phase, Phase::Abandoned { .. });
            if !conn.send_busy && !abandoned {
                if conn.sent >= conn.sending.len() && !conn.out.is_empty() {
                    std::mem::swap(&mut conn.out, &mut conn.sending);
                    conn.out.clear();
                    conn.sent = 0;
                }
                if let Some(rest) = conn.sending.get(conn.sent..).filter(|r| !r.is_empty()) {
                    let len = u32::try_from(rest.len()).unwrap_or(u32::MAX);
                    let entry = opcode::Send::new(fd, rest.as_ptr(), len)
                        .flags(libc::MSG_NOSIGNAL)
                        .build()
                        .user_data(user_data(slot, Op::Send));
                    conn.send_busy = true;
                    // SAFETY: `rest` lies in `sending`, which is not touched while
                    // `send_busy` and lives until the connection is `finished()`.
                    unsafe { self.push(&entry)? };
                }
            } else if abandoned && !conn.send_busy {
                conn.out.clear();
                conn.sending.clear();
                conn.sent = 0;
            }
            // A closing connection with nothing left in flight is freed next round.
            if let Some(Some(conn)) = self.conns.get(slot) {
                if conn.finished() {
                    self.dirty.push(slot);
                }
            }
        }
        Ok(())
    }

    fn begin_shutdown(&mut self) -> io::Result<()> {
        self.accepting = false;
        if self.accept_busy && !self.accept_cancel_sent {
            self.accept_cancel_sent = true;
            let entry = opcode::AsyncCancel::new(user_data(0, Op::Accept))
                .build()
                .user_data(user_data(0, Op::Cancel));
            // SAFETY: a cancel points at no buffer.
            unsafe { self.push(&entry)? };
        }
        // Every connection flushes what it owes, then closes.
        for slot in 0..self.conns.len() {
            self.close(slot, Close::Flush);
        }
        self.service_dirty()
    }

    /// After the loop: cancel whatever is still in flight and wait (briefly) until the
    /// kernel has let go of every buffer; connections it has not let go of are leaked,
    /// never freed under it.
    fn finish(&mut self) {
        let deadline = Instant::now() + CANCEL_GRACE;
        loop {
            for slot in 0..self.conns.len() {
                self.close(slot, Close::Abandon);
            }
            let busy = self
                .conns
                .iter()
                .flatten()
                .any(|c| c.recv_busy || c.send_busy);
            if !busy && !self.accept_busy {
                break;
            }
            if Instant::now() >= deadline {
                let stuck: Vec<Conn> = self.conns.drain(..).flatten().collect();
                tracing::warn!(
                    connections = stuck.len(),
                    "kernel operations did not complete after cancellation; leaking their buffers"
                );
                std::mem::forget(stuck);
                break;
            }
            // Sends are cancelled too: a peer that reads nothing must not hold us.
            for slot in 0..self.conns.len() {
                if let Some(Some(conn)) = self.conns.get(slot) {
                    if conn.send_busy {
                        let entry = opcode::AsyncCancel::new(user_data(slot, Op::Send))
                            .build()
                            .user_data(user_data(slot, Op::Cancel));
                        // SAFETY: a cancel points at no buffer.
                        if unsafe { self.push(&entry) }.is_err() {
                            break;
                        }
                    }
                }
            }
            if self.service_dirty().is_err() || self.wait().is_err() || self.complete().is_err() {
                // The ring itself failed; nothing more can be waited for.
                let stuck: Vec<Conn> = self.conns.drain(..).flatten().collect();
                std::mem::forget(stuck);
                break;
            }
        }
        self.live = self.conns.iter().flatten().count();
        self.publish();
        tracing::info!(unfinished = self.live, "store server stopped");
    }

    /// Publishes the counts for [`super::StoreServer::stats`].
    fn publish(&self) {
        self.stats.connections.store(self.live, Ordering::Relaxed);
        self.stats
            .waiters
            .store(self.engine.waiter_count(), Ordering::Relaxed);
        self.stats
            .keys
            .store(self.engine.num_keys(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_round_trips() {
        for slot in [0usize, 1, 4095, 1 << 40] {
            for op in [Op::Accept, Op::Recv, Op::Send, Op::Cancel] {
                assert_eq!(decode_user_data(user_data(slot, op)), Some((slot, op)));
            }
        }
        assert_eq!(decode_user_data(0), None);
        assert_eq!(decode_user_data(0x99), None);
    }

    #[test]
    fn closing_never_reopens_nor_unabandons() {
        let flushing = Phase::Flushing {
            recv_cancelled: false,
        };
        let abandoned = Phase::Abandoned {
            recv_cancelled: false,
        };
        assert_eq!(Phase::Open.closed(Close::Flush), flushing);
        assert_eq!(Phase::Open.closed(Close::Abandon), abandoned);
        assert_eq!(flushing.closed(Close::Abandon), abandoned);
        assert_eq!(abandoned.closed(Close::Flush), abandoned);
        let cancelled = Phase::Flushing {
            recv_cancelled: true,
        };
        assert_eq!(
            cancelled.closed(Close::Abandon),
            Phase::Abandoned {
                recv_cancelled: true
            }
        );
    }

    #[test]
    fn conn_ids_differ_per_occupant_of_a_slot() {
        let a = conn_id(7, 1);
        let b = conn_id(7, 2);
        assert_ne!(a, b);
        assert_eq!(slot_of(a), 7);
        assert_eq!(slot_of(b), 7);
    }
}
