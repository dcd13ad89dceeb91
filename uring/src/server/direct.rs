//! The store server on io_uring (the `io-uring` crate), thread-per-core: N loops, each
//! with its own ring and its own `SO_REUSEPORT` listener, all sharing one engine
//! (`shared_engine`), as the epoll loops do.
//!
//! Why its own loop rather than an async runtime: a runtime (glommio) makes about four
//! `io_uring_enter` calls per sleep and wake-up and arms and cancels a timeout, and a
//! store server on a quiet connection sleeps and wakes once per request. Here a loop
//! submits everything it owes the ring (an accept, and a receive for any connection
//! whose multishot receive is not running) and waits for the next completion in one
//! `io_uring_enter`, and a busy loop handles every ready connection per call. Replies
//! go out as soon as a connection's requests are served, with one non-blocking `send`;
//! only what a socket does not take goes to the ring, whose completion says when the
//! rest is gone. A ring send would cost the kernel the same work, plus a completion for
//! this loop to reap and match (about 230 instructions per request at 64 connections),
//! and at one connection its completion would end the next wait at once and take a turn
//! of its own. `docs/performance.md` has the measurements.
//!
//! A loop runs its connections' requests to completion itself: it locks the engine,
//! applies the requests that arrived, and unlocks; nothing hops to another thread. Only a
//! wake-up owed to a connection of another loop crosses: into that loop's inbox (under
//! the lock), then the target loop is woken through its eventfd, on which it always has
//! a poll in flight: once per turn however many wake-ups the turn routed to it. With one
//! loop the lock is never contended and no eventfd is ever written.
//!
//! Every connection has at most one receive and one send in flight. The receive is
//! multishot into the loop's pool of provided buffers where the kernel has both (6.0):
//! submitted once, it delivers every chunk that arrives. The loop serves a chunk's
//! requests in place when the connection's input holds nothing (the common case) and
//! copies onto the input only what is left of it (a request's start); otherwise it
//! copies the chunk onto the input. Either way the buffer goes back to the pool at once.
//! The receive is cancelled while the connection may not read (backpressure, its input
//! at the cap) and submitted again after. Where the kernel lacks them, or the pool ran
//! dry, a connection receives one shot at a time into its own input buffer. The ring
//! (`crate::sys::uring`) owns the buffer of each operation until its completion hands it
//! back, so no buffer is ever touched or released while the kernel may still use it; a
//! connection is freed only after both operations completed. A connection that must
//! close (bad input, the engine refused it, end of stream, a socket error) leaves the
//! engine at once, so its waiters never linger; a pending receive is cancelled.
//!
//! A batch serves its light connections (whose last turn was small) as their
//! completions come and sends their replies before it serves any heavy one; then the
//! heavy ones until the batch has produced its share of reply bytes (`session::Round`,
//! shared with epoll), the rest in the next batch: a good client is not queued behind a
//! burst of large GETs.
//!
//! Backpressure: a connection that owes its peer more than the budget's high-water mark
//! gets no more requests served and no receive queued until its sends have drained
//! below it (the core serve step says `Blocked`); then the requests it already sent are
//! served first. What happens at accept (`--allow`, out of descriptors, a new
//! connection's id and serve step) is module `admission`'s, shared with epoll.
//!
//! Shutdown: when the stop flag is seen (checked at least every 50 ms) the loop stops
//! accepting, gives every connection `drain` to flush what it owes, then cancels what is
//! left and waits for the kernel to let go of the buffers (what it never lets go of, the
//! ring leaks rather than frees).

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv_core::store::budget::Budget;
use rdzv_core::store::session::Session;
use rdzv_core::store::ConnId;

use super::admission::{Admission, Opened, Peer, Retry};
use super::loop_config::LoopConfig;
use super::session::{ConnInput, Pass, ReadBuf};
use super::shared_engine::{self, LoopWaker, Serving};
use crate::sys::uring::{Chunk, Completion, OpId, Ring as Uring, SendBuf};

/// Provided buffers per loop, and their size: 1 MiB that every connection's multishot
/// receive draws from (each chunk is copied out and its buffer given back in the same
/// turn). This is also how far a connection's input can pass its cap: the chunks that
/// arrived before the cancel of its receive took effect.
const POOL_BUFFERS: u16 = 256;
const POOL_BUFFER_SIZE: usize = 4096;

/// Submission queue entries. Each connection has at most two operations in flight; a
/// full queue is submitted and refilled, so this bounds only the batch size.
const SQ_ENTRIES: u32 = 1024;
/// Completion queue entries (the kernel's maximum is 65536). The kernel keeps overflowing
/// completions (`IORING_FEAT_NODROP`), so more connections than this are still served.
const CQ_ENTRIES: u32 = 16384;
/// How often the stop flag is looked at while nothing happens.
const TICK: Duration = Duration::from_millis(50);
/// How long, after the drain, the loop waits for the kernel to complete cancelled
/// operations before it gives their buffers up for lost (leaks them) rather than free
/// memory the kernel might still write.
const CANCEL_GRACE: Duration = Duration::from_secs(1);

/// Where a connection is in its life. Every phase but `Open` is out of the engine (the
/// transition removes it, so its waiters never outlive it).
///
/// ```text
///  accept ─► Open ─(bad input, refused, shutdown)─► Flushing ─(all sent)─► freed
///             │                                        │
///             └─(end of stream, socket error)─► Abandoned ◄─(socket error, drain over)
///                                                 └─(nothing in flight)─► freed
/// ```
///
/// What the kernel holds of the connection is apart from the phase, in [`Reading`] and
/// [`Writing`]: a connection is freed only when both are idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading requests and sending replies.
    Open,
    /// No more reads: send what is owed, then close.
    Flushing,
    /// The peer is gone: what is owed is dropped; waits only for the kernel to finish
    /// the operations in flight.
    Abandoned,
}

impl Phase {
    /// The phase after a close of kind `how`: `Abandoned` is never undone.
    fn closed(self, how: Close) -> Phase {
        match (self, how) {
            (Phase::Abandoned, _) | (_, Close::Abandon) => Phase::Abandoned,
            (_, Close::Flush) => Phase::Flushing,
        }
    }
}

/// A connection's receive side. The input buffer is the connection's while `Idle` and
/// while a multishot receive runs (chunks are copied onto it), and the ring's while a
/// one-shot receive is in flight (it comes back with the completion).
///
/// ```text
///  Idle ─(multishot queued)─► Multi ─(last completion)──────────────────────────► Idle
///   │                           └─(may not read: cancel queued)─► MultiCancelling ─┘
///   └─(one shot queued)─► Once ─(completion)─► Idle
///                           └─(closing: cancel queued)─► Cancelling ─(completion)─► Idle
/// ```
enum Reading {
    /// Nothing in flight: the received bytes not yet served.
    Idle(Input),
    /// A multishot receive into the pool is in flight; the input stays here.
    Multi { op: OpId, input: Input },
    /// The multishot receive was asked to stop; chunks may still come until its last
    /// completion.
    MultiCancelling(Input),
    /// A one-shot receive into the input buffer's spare bytes is in flight.
    Once(OpId),
    /// The one-shot receive was asked to stop (the connection is closing).
    Cancelling,
}

impl Reading {
    /// Nothing in flight.
    fn is_idle(&self) -> bool {
        matches!(self, Reading::Idle(_))
    }

    /// The input buffer, unless a one-shot receive holds it.
    fn input(&mut self) -> Option<&mut ReadBuf> {
        match self {
            Reading::Idle(input)
            | Reading::Multi { input, .. }
            | Reading::MultiCancelling(input) => Some(input),
            Reading::Once(_) | Reading::Cancelling => None,
        }
    }

    /// The input buffer, to hand to a receive; `None` (unchanged) unless idle.
    fn take_idle(&mut self) -> Option<Input> {
        match std::mem::replace(self, Reading::Cancelling) {
            Reading::Idle(input) => Some(input),
            other => {
                *self = other;
                None
            }
        }
    }

    /// The multishot receive is over: back to `Idle`.
    fn multi_over(&mut self) {
        if let Reading::Multi { .. } | Reading::MultiCancelling(_) = self {
            if let Reading::Multi { input, .. } | Reading::MultiCancelling(input) =
                std::mem::replace(self, Reading::Cancelling)
            {
                *self = Reading::Idle(input);
            }
        }
    }

    /// Asks a running multishot receive to stop: the operation to cancel.
    fn stop_multi(&mut self) -> Option<OpId> {
        let Reading::Multi { op, .. } = *self else {
            return None;
        };
        if let Reading::Multi { input, .. } = std::mem::replace(self, Reading::Cancelling) {
            *self = Reading::MultiCancelling(input);
        }
        Some(op)
    }
}

/// A connection's input buffer, boxed: a one-shot receive moves it into the ring and
/// back with its completion, so the pointer moves, not the buffer's fields.
type Input = Box<ReadBuf>;

/// Replies handed to the kernel, and how much of them went out.
#[derive(Default)]
struct Outgoing {
    bytes: Vec<u8>,
    sent: usize,
}

impl Outgoing {
    /// Bytes not yet sent.
    fn unsent(&self) -> usize {
        self.bytes.len().saturating_sub(self.sent)
    }

    /// `n` more bytes went out. Once all did, it is empty again, and keeps no large
    /// reply's room for an idle connection.
    fn advance(&mut self, n: usize) {
        self.sent = self.sent.saturating_add(n).min(self.bytes.len());
        if self.unsent() == 0 {
            if self.bytes.capacity() > 1 << 20 {
                self.bytes = Vec::new();
            }
            self.bytes.clear();
            self.sent = 0;
        }
    }
}

/// What [`send_owed`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    /// Nothing to send, or a send is in flight already.
    Nothing,
    /// The non-blocking send took everything.
    Whole,
    /// The ring sends (the rest); its completion comes.
    Ring,
}

/// Hands what connection `slot` owes to the kernel, unless a send is in flight: with
/// one non-blocking `send` at once; what the socket does not take goes to the ring. An
/// error is the connection's end.
#[inline]
fn send_owed(ring: &mut Uring<Input, Outgoing>, conn: &mut Conn, slot: usize) -> io::Result<Sent> {
    let Writing::Idle(outgoing) = &mut conn.writing else {
        return Ok(Sent::Nothing);
    };
    if outgoing.unsent() == 0 {
        if conn.out.is_empty() {
            return Ok(Sent::Nothing);
        }
        std::mem::swap(&mut conn.out, &mut outgoing.bytes);
        conn.out.clear();
        outgoing.sent = 0;
    }
    send_now(&conn.fd, outgoing)?;
    let unsent = outgoing.unsent();
    if unsent == 0 {
        return Ok(Sent::Whole);
    }
    let outgoing = std::mem::take(outgoing);
    let op = ring.send(&conn.fd, outgoing, slot);
    conn.writing = Writing::InFlight { op, unsent };
    Ok(Sent::Ring)
}

/// The common case of `Server::service_dirty`: a connection that is reading and may go
/// on (below the `high_water` mark of what it owes) has only its replies to send
/// ([`send_owed`]); `None` when it is not that case.
#[inline]
fn send_reading(
    ring: &mut Uring<Input, Outgoing>,
    conn: &mut Conn,
    slot: usize,
    high_water: usize,
) -> Option<io::Result<Sent>> {
    let reading = conn.phase == Phase::Open
        && !conn.blocked
        && conn.parked.is_empty()
        && matches!(conn.reading, Reading::Multi { .. })
        && conn.owed() <= high_water;
    reading.then(|| send_owed(ring, conn, slot))
}

/// Sends what `outgoing` holds now, without blocking, as far as the socket takes it;
/// what is left (the socket was full) goes to the ring. An error is the connection's
/// end, as a failed send's completion is.
fn send_now(fd: &OwnedFd, outgoing: &mut Outgoing) -> io::Result<()> {
    let flags = rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL;
    let rest = outgoing.bytes.get(outgoing.sent..).unwrap_or_default();
    match rustix::net::send(fd, rest, flags) {
        Ok(n) => {
            outgoing.advance(n);
            Ok(())
        }
        Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => Ok(()),
        Err(error) => Err(error.into()),
    }
}

impl SendBuf for Outgoing {
    fn send_from(&self) -> (&Vec<u8>, usize) {
        (&self.bytes, self.sent)
    }
}

/// A connection's send side: the bytes being sent are the ring's while a send is in
/// flight. (`repr(u8)`: its state is a tag byte, looked at on every completion, rather
/// than a decoding of the buffer's capacity niche.)
#[repr(u8)]
enum Writing {
    /// Nothing in flight.
    Idle(Outgoing),
    /// A send is in flight, of `unsent` bytes.
    InFlight { op: OpId, unsent: usize },
}

impl Writing {
    fn is_idle(&self) -> bool {
        matches!(self, Writing::Idle(_))
    }

    /// Bytes handed to the kernel and not yet known to be sent.
    fn unsent(&self) -> usize {
        match self {
            Writing::Idle(outgoing) => outgoing.unsent(),
            Writing::InFlight { unsent, .. } => *unsent,
        }
    }
}

/// The listener's state.
///
/// ```text
///  Idle ─(accept queued)─► InFlight ─(completion)─► Idle
///   │                         └─(shutdown: cancel queued)─► Cancelling ─(completion)─┐
///   └─(shutdown)─► Stopped ◄────────────────────────────────────────────────────────┘
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Accepting {
    Idle,
    InFlight(OpId),
    Cancelling,
    Stopped,
}

impl Accepting {
    fn in_flight(self) -> bool {
        matches!(self, Accepting::InFlight(_) | Accepting::Cancelling)
    }
}

/// One client connection.
struct Conn {
    fd: Arc<OwnedFd>,
    id: ConnId,
    phase: Phase,
    reading: Reading,
    writing: Writing,
    /// Serves the input: cuts it into requests (resuming a long key list where it
    /// stopped), holds the connection to its budget.
    session: Session,
    /// The serve step said `Blocked`: serve again (before receiving) once drained.
    blocked: bool,
    /// In the loop's `again` list: its received requests wait for the next batch (the
    /// batch's reply cap), and no receive is queued until they are served.
    deferred: bool,
    /// Its last turn produced little (`Round::count`): not deferred by the batch's cap.
    light: bool,
    /// The pool was empty when its multishot receive last ran: the next receive is one
    /// shot into its own buffer.
    once: bool,
    /// In the loop's `dirty` list, to be looked at after this batch (at most once).
    queued: bool,
    /// Chunks its multishot receive delivered that its input had no room for yet (and
    /// how much of the first was copied): their buffers stay out of the pool, and its
    /// receive is stopped, until they are copied.
    parked: VecDeque<(Chunk, usize)>,
    /// Bytes owed and not yet handed to the kernel.
    out: Vec<u8>,
}

/// Puts a connection on the `dirty` list, once.
fn queue(dirty: &mut Vec<usize>, conn: &mut Conn, slot: usize) {
    if !conn.queued {
        conn.queued = true;
        dirty.push(slot);
    }
}

impl Conn {
    /// Bytes owed to the peer: not yet handed to the kernel, and in flight.
    fn owed(&self) -> usize {
        self.out.len().saturating_add(self.writing.unsent())
    }

    /// Nothing for `service_dirty` to do after its replies went out: reading, owing
    /// nothing, with no requests waiting to be served.
    fn settled(&self) -> bool {
        self.phase == Phase::Open
            && self.writing.is_idle()
            && self.writing.unsent() == 0
            && self.out.is_empty()
            && !self.blocked
            && !self.deferred
            && self.parked.is_empty()
            && matches!(self.reading, Reading::Multi { .. })
    }

    /// Done when nothing is in flight and nothing more will be sent.
    fn finished(&self) -> bool {
        let idle = self.reading.is_idle() && self.writing.is_idle();
        match self.phase {
            Phase::Open => false,
            Phase::Flushing => idle && self.out.is_empty() && self.writing.unsent() == 0,
            Phase::Abandoned => idle,
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

/// Wakes a loop from another thread: a write to the eventfd the loop polls.
pub(super) struct EventFdWaker(Arc<OwnedFd>);

impl LoopWaker for EventFdWaker {
    fn wake(&self) -> io::Result<()> {
        match rustix::io::write(self.0.as_fd(), &1u64.to_ne_bytes()) {
            // EAGAIN: the counter is saturated, so a wake-up is pending anyway.
            Ok(_) | Err(rustix::io::Errno::AGAIN) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// A loop's ring and the eventfd other loops wake it with.
pub(super) struct Ring {
    ring: Uring<Input, Outgoing>,
    wake_fd: Arc<OwnedFd>,
    /// Try multishot receives into provided buffers (false: one shot at a time, as on
    /// kernels without them).
    multishot: bool,
}

/// Creates a loop's ring and the waker other loops use to reach it (the caller reports
/// failure before saying the server is ready).
pub(super) fn ring() -> io::Result<(Ring, EventFdWaker)> {
    let ring = Uring::new(SQ_ENTRIES, CQ_ENTRIES)?;
    let fd = rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )?;
    let wake_fd = Arc::new(fd);
    Ok((
        Ring {
            ring,
            wake_fd: Arc::clone(&wake_fd),
            multishot: true,
        },
        EventFdWaker(wake_fd),
    ))
}

/// Everything a loop thread needs: the common config, its ring and its listener.
pub(super) struct LoopSetup {
    pub(super) config: LoopConfig,
    pub(super) ring: Ring,
    pub(super) listener: OwnedFd,
}

/// One loop's state.
struct Server {
    /// Its index, the engine, the round, `now` and the wake-ups to deliver.
    serving: Serving,
    ring: Uring<Input, Outgoing>,
    wake_fd: Arc<OwnedFd>,
    /// A poll on `wake_fd` is in flight.
    wake_polled: bool,
    listener: Arc<OwnedFd>,
    accepting: Accepting,
    accept_after: Instant,
    budget: Budget,
    /// What happens at accept: `--allow`, refusals, a new connection's serve step.
    admission: Admission,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    /// Slots to look at after this batch of completions (each once, by `Conn::queued`).
    dirty: Vec<usize>,
    live: usize,
    spin: Option<Duration>,
    /// Multishot receives into the pool work here (the kernel has both).
    multishot: bool,
    /// Accept with one multishot accept (Linux 5.19) rather than one accept per turn:
    /// a storm of connections is taken as fast as it arrives, not one per turn of the
    /// loop. Turned off by the first `EINVAL`.
    multishot_accept: bool,
    /// `serving.now_ms` was read in this batch (read at its first request).
    clock_read: bool,
    /// Connections whose requests wait for the next batch, in the order they were put off.
    again: Vec<usize>,
}

/// The thread body of an io_uring loop on `socket`.
pub(super) fn loop_body(
    config: LoopConfig,
    socket: socket2::Socket,
    ring: Ring,
    stop: Arc<AtomicBool>,
) -> super::LoopBody {
    let setup = LoopSetup {
        config,
        ring,
        listener: socket.into(),
    };
    Box::new(move || serve(setup, &stop))
}

/// Serves until `stop` is set, then drains for up to `setup.drain`.
pub(super) fn serve(setup: LoopSetup, stop: &AtomicBool) {
    let LoopSetup {
        config,
        ring: Ring {
            ring,
            wake_fd,
            multishot,
        },
        listener,
    } = setup;
    let parts = config.into_parts();
    let index = parts.serving.index;
    let mut ring = ring;
    if let Err(error) = ring.start_here() {
        tracing::error!(%error, loop_index = index, "cannot start the store loop's io_uring; closing");
        return;
    }
    if index == 0 && !ring.deferred() {
        tracing::info!("io_uring has no deferred task work here (Linux 6.1): each arriving packet may interrupt a running loop");
    }
    let multishot = multishot
        && match ring.provide_buffers(POOL_BUFFERS, POOL_BUFFER_SIZE) {
            Ok(()) => true,
            Err(error) => {
                if index == 0 {
                    tracing::info!(%error, "io_uring has no provided buffer rings here (Linux 5.19): one receive per request");
                }
                false
            }
        };
    let mut server = Server {
        serving: parts.serving,
        ring,
        wake_fd,
        wake_polled: false,
        listener: Arc::new(listener),
        accepting: Accepting::Idle,
        accept_after: Instant::now(),
        budget: parts.budget,
        admission: parts.admission,
        conns: Vec::new(),
        free: Vec::new(),
        dirty: Vec::new(),
        live: 0,
        spin: parts.spin,
        again: Vec::new(),
        multishot,
        multishot_accept: true,
        clock_read: false,
    };
    if let Err(error) = server.run(stop, parts.drain) {
        tracing::error!(%error, loop_index = index, "store event loop failed; closing its connections");
    }
    server.finish();
}

impl Server {
    fn run(&mut self, stop: &AtomicBool, drain: Duration) -> io::Result<()> {
        let mut drain_deadline = None;
        let mut busy_until = None;
        loop {
            if drain_deadline.is_none() && stop.load(Ordering::Acquire) {
                self.begin_shutdown();
                drain_deadline = Some(Instant::now() + drain);
            }
            if let Some(deadline) = drain_deadline {
                if (self.live == 0 && !self.accepting.in_flight()) || Instant::now() >= deadline {
                    return Ok(());
                }
            }
            self.poll_wakes();
            self.maybe_accept();
            // Requests put off by the last batch's cap: look for completions without
            // sleeping, then serve them.
            let spinning =
                !self.again.is_empty() || busy_until.is_some_and(|until| Instant::now() < until);
            self.wait(spinning)?;
            self.clock_read = false;
            self.serving.round.begin();
            if self.complete() > 0 {
                if let Some(spin) = self.spin {
                    busy_until = Some(Instant::now() + spin);
                }
            }
            // Light connections were served as their completions came; their replies
            // go to the kernel before the heavy ones are served (a system call only when
            // there are heavy ones).
            self.service_dirty();
            if !self.again.is_empty() {
                self.ring.submit()?;
                self.serve_put_off();
                self.service_dirty();
            }
        }
    }

    /// Submits what is queued and waits for one completion or the tick; or, while
    /// `spinning`, submits without waiting (and without a system call when nothing is
    /// queued): the completion queue is in shared memory.
    fn wait(&mut self, spinning: bool) -> io::Result<()> {
        if spinning {
            self.ring.submit()
        } else {
            self.ring.submit_and_wait(TICK)
        }
    }

    /// Keeps a poll on the eventfd in flight, so that another loop's wake reaches a
    /// loop asleep in `io_uring_enter`.
    fn poll_wakes(&mut self) {
        if self.wake_polled {
            return;
        }
        self.ring.poll_readable(&self.wake_fd);
        self.wake_polled = true;
    }

    fn maybe_accept(&mut self) {
        if self.accepting != Accepting::Idle || Instant::now() < self.accept_after {
            return;
        }
        let op = if self.multishot_accept {
            self.ring.accept_multi(&self.listener)
        } else {
            self.ring.accept(&self.listener)
        };
        self.accepting = Accepting::InFlight(op);
    }

    /// Reaps every completion there is; returns how many.
    fn complete(&mut self) -> usize {
        let mut reaped = 0;
        while let Some(completion) = self.ring.next_completion() {
            reaped += 1;
            {
                match completion {
                    Completion::Accepted { result, more } => self.accepted(result, more),
                    Completion::Received { token, result, buf } => {
                        self.received(token, result, buf)
                    }
                    Completion::Sent { token, result, buf } => self.sent(token, result, buf),
                    Completion::Polled { result, .. } => self.woken(result),
                    Completion::Arrived {
                        token,
                        result,
                        more,
                    } => self.arrived(token, result, more),
                }
            }
        }
        reaped
    }

    /// A connection accepted (or an accept that failed); `more`: the multishot accept
    /// goes on, so the listener stays as it is.
    fn accepted(&mut self, result: io::Result<OwnedFd>, more: bool) {
        let was = self.accepting;
        if !more {
            self.accepting = match was {
                Accepting::InFlight(_) => Accepting::Idle,
                _ => Accepting::Stopped,
            };
        }
        let fd = match result {
            Ok(fd) => fd,
            Err(error) => {
                if error.raw_os_error() == Some(libc::ECANCELED) {
                    return;
                }
                if error.raw_os_error() == Some(libc::EINVAL)
                    && self.multishot_accept
                    && matches!(was, Accepting::InFlight(_))
                {
                    // A kernel before 5.19: one accept at a time from the next turn.
                    self.multishot_accept = false;
                    if self.serving.index == 0 {
                        tracing::info!("io_uring has no multishot accept here (Linux 5.19): one accept per turn");
                    }
                    return;
                }
                if let Retry::After(pause) =
                    self.admission.accept_failed(&error, self.listener.as_fd())
                {
                    self.accept_after = Instant::now() + pause;
                }
                return;
            }
        };
        if !matches!(was, Accepting::InFlight(_)) {
            // Accepted just as shutdown began: close it unserved.
            return;
        }
        let Some(slot) = self
            .admission
            .admit(fd.as_fd(), &mut self.free, &mut self.conns)
        else {
            return;
        };
        let Opened { id, session, input } = self.admission.open(slot);
        if let Some(entry) = self.conns.get_mut(slot) {
            *entry = Some(Conn {
                fd: Arc::new(fd),
                id,
                phase: Phase::Open,
                reading: Reading::Idle(Box::new(input)),
                writing: Writing::Idle(Outgoing::default()),
                session,
                blocked: false,
                deferred: false,
                light: false,
                once: false,
                queued: true,
                parked: VecDeque::new(),
                out: Vec::new(),
            });
            self.live += 1;
            self.serving
                .stats
                .connections
                .fetch_add(1, Ordering::Relaxed);
            self.dirty.push(slot);
        }
    }

    /// Another loop routed wake-ups here: empty the eventfd, then the inbox (in that
    /// order, so that a wake-up routed in between is either taken now or raises the
    /// eventfd again).
    fn woken(&mut self, result: io::Result<()>) {
        self.wake_polled = false;
        if let Err(error) = result {
            if error.raw_os_error() != Some(libc::ECANCELED) {
                tracing::warn!(%error, loop_index = self.serving.index, "polling the wake-up eventfd failed");
            }
        }
        let mut count = [0u8; 8];
        // Non-blocking: EAGAIN only says another reader was faster (there is none).
        let _ = rustix::io::read(self.wake_fd.as_fd(), &mut count);
        self.serving.take_inbox();
        self.deliver();
    }

    fn received(&mut self, slot: usize, result: io::Result<usize>, mut input: Input) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        queue(&mut self.dirty, conn, slot);
        let n = match result {
            Ok(n) if n > 0 => n,
            result => {
                conn.reading = Reading::Idle(input);
                if let Err(error) = result {
                    if error.raw_os_error() != Some(libc::ECANCELED) {
                        tracing::debug!(peer = %Peer::of(&*conn.fd), %error, "store connection read failed");
                    }
                }
                // End of stream or an error: the peer is gone, nothing more can be sent.
                self.close(slot, Close::Abandon);
                return;
            }
        };
        if conn.phase != Phase::Open {
            // Read just before a close was decided: the bytes are not served.
            conn.reading = Reading::Idle(input);
            return;
        }
        let complete = input.received(n);
        conn.reading = Reading::Idle(input);
        if complete {
            self.serve_in_round(slot, Pass::Light);
        }
    }

    /// A multishot receive delivered a chunk, reached the end of the stream, or stopped.
    fn arrived(&mut self, slot: usize, result: io::Result<Option<Chunk>>, more: bool) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            if let Ok(Some(chunk)) = result {
                self.ring.recycle(chunk);
            }
            return;
        };
        let result = match result {
            Ok(Some(chunk))
                if chunk.len() > 0
                    && more
                    && conn.phase == Phase::Open
                    && conn.parked.is_empty()
                    && matches!(&conn.reading, Reading::Multi { input, .. } if input.held() == 0)
                    && !self.serving.round.defers(conn.light, Pass::Light) =>
            {
                // The common case: a reading connection that holds nothing, served in
                // this pass: its requests are served in the chunk, and its replies sent.
                self.serve_chunk(slot, chunk);
                return;
            }
            result => result,
        };
        queue(&mut self.dirty, conn, slot);
        if !more {
            conn.reading.multi_over();
        }
        let chunk = match result {
            Ok(Some(chunk)) if chunk.len() > 0 => chunk,
            Ok(end) => {
                if let Some(chunk) = end {
                    self.ring.recycle(chunk);
                }
                // End of stream: the peer is gone, nothing more can be sent.
                self.close(slot, Close::Abandon);
                return;
            }
            Err(error) => {
                match error.raw_os_error() {
                    // Cancelled, or stopped by the kernel (re-armed when it may read).
                    Some(libc::ECANCELED) | None => {}
                    // The pool was empty: one shot into its own buffer next.
                    Some(libc::ENOBUFS) => conn.once = true,
                    // A kernel before 6.0: no multishot receive.
                    Some(libc::EINVAL) if self.multishot => {
                        self.multishot = false;
                        tracing::info!(
                            loop_index = self.serving.index,
                            "io_uring has no multishot receive here (Linux 6.0): one receive per request"
                        );
                    }
                    Some(_) => {
                        tracing::debug!(peer = %Peer::of(&*conn.fd), %error, "store connection read failed");
                        self.close(slot, Close::Abandon);
                    }
                }
                return;
            }
        };
        if conn.phase != Phase::Open {
            // Read just before a close was decided: the bytes are not served.
            self.ring.recycle(chunk);
            return;
        }
        if conn.parked.is_empty() {
            // The input takes the whole chunk.
            if let Some(input) = conn.reading.input() {
                let copied = input.take_from(self.ring.chunk(&chunk));
                if copied == chunk.len() {
                    self.ring.recycle(chunk);
                    if input.ready() {
                        self.serve_in_round(slot, Pass::Light);
                    }
                    return;
                }
                conn.parked.push_back((chunk, copied));
                self.feed(slot);
                return;
            }
        }
        conn.parked.push_back((chunk, 0));
        self.feed(slot);
    }

    /// Copies the connection's parked chunks onto its input as far as the input takes
    /// them (it grows, to its cap, only for a request larger than it), serving whole
    /// requests as they complete; a chunk's buffer goes back to the pool once copied.
    /// What does not fit stays parked (its receive is stopped meanwhile, in
    /// `service_dirty`), so the input never holds more than it would with one-shot
    /// receives. Returns whether anything was copied or served.
    fn feed(&mut self, slot: usize) -> bool {
        let mut progress = false;
        loop {
            let Some(Some(conn)) = self.conns.get_mut(slot) else {
                return progress;
            };
            if conn.phase != Phase::Open {
                return progress;
            }
            let Some(input) = conn.reading.input() else {
                return progress;
            };
            let Some((chunk, offset)) = conn.parked.front_mut() else {
                return progress;
            };
            let bytes = self.ring.chunk(chunk).get(*offset..).unwrap_or_default();
            let copied = input.take_from(bytes);
            *offset += copied;
            if *offset >= chunk.len() {
                if let Some((chunk, _)) = conn.parked.pop_front() {
                    self.ring.recycle(chunk);
                }
            } else if copied == 0 && !(input.ready() && !conn.blocked && !conn.deferred) {
                // No room, and nothing to serve that would make some.
                return progress;
            }
            progress |= copied > 0;
            if input.ready() && !conn.blocked && !conn.deferred {
                let before = input.held();
                self.serve_in_round(slot, Pass::Light);
                let after = match self.conns.get_mut(slot) {
                    Some(Some(conn)) => conn.reading.input().map_or(0, |input| input.held()),
                    _ => return true,
                };
                if after < before {
                    progress = true;
                } else if copied == 0 {
                    return progress;
                }
            }
        }
    }

    /// Serves a connection's requests in this pass of the batch, or puts them off: a
    /// heavy one to the heavy pass, after the light replies were submitted, and to the
    /// next batch once this one has produced its share of reply bytes. A burst of large
    /// GETs does not hold up a small request.
    fn serve_in_round(&mut self, slot: usize, pass: Pass) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        if self.serving.round.defers(conn.light, pass) {
            if !conn.deferred {
                conn.deferred = true;
                self.again.push(slot);
            }
        } else {
            self.serve_connection(slot);
        }
    }

    /// Serves the connections the last batch put off (those still open), in order,
    /// until this batch's cap puts the rest off again.
    fn serve_put_off(&mut self) {
        if self.again.is_empty() {
            return;
        }
        let mut put_off = std::mem::take(&mut self.again);
        for slot in put_off.drain(..) {
            let Some(Some(conn)) = self.conns.get_mut(slot) else {
                continue;
            };
            conn.deferred = false;
            queue(&mut self.dirty, conn, slot);
            if conn.phase == Phase::Open && !conn.blocked {
                self.serve_in_round(slot, Pass::Heavy);
            }
        }
        if self.again.is_empty() {
            // Keep the list's room for the next burst.
            self.again = put_off;
        }
    }

    /// Runs the whole requests a connection has through the engine (not while its
    /// input buffer is with the kernel).
    fn serve_connection(&mut self, slot: usize) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        let owed = conn.owed();
        let Some(input) = conn.reading.input() else {
            return;
        };
        if !self.clock_read {
            self.clock_read = true;
            self.serving.now_ms = self.serving.shared.clock_ms();
        }
        let (served, light) = self.serving.serve(ConnInput {
            session: &mut conn.session,
            pending: input.pending(),
            owed,
            out: &mut conn.out,
            peer: &Peer::of(&*conn.fd),
        });
        input.served(&served);
        conn.blocked = served.blocked;
        conn.light = light;
        self.deliver();
        if served.close {
            self.close(slot, Close::Flush);
        }
    }

    /// Serves the whole requests of a chunk where the kernel put them, for a connection
    /// whose input holds nothing (the common case), and sends its replies at once
    /// ([`send_reading`]). Only what is left of the chunk (the start of a request, or
    /// requests a block left unserved) is copied onto the input, and the chunk goes back
    /// to the pool (or is parked when the input cannot take all of the rest yet).
    fn serve_chunk(&mut self, slot: usize, chunk: Chunk) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            self.ring.recycle(chunk);
            return;
        };
        let owed = conn.owed();
        let Some(input) = conn.reading.input() else {
            self.ring.recycle(chunk);
            return;
        };
        if !self.clock_read {
            self.clock_read = true;
            self.serving.now_ms = self.serving.shared.clock_ms();
        }
        let bytes = self.ring.chunk(&chunk);
        // No more at once than the input would have held (a buffer smaller than a chunk,
        // under a small per-connection cap): the budget sees what it saw with copies.
        let at_once = bytes.get(..input.size()).unwrap_or(bytes);
        let (served, light) = self.serving.serve(ConnInput {
            session: &mut conn.session,
            pending: at_once,
            owed,
            out: &mut conn.out,
            peer: &Peer::of(&*conn.fd),
        });
        conn.blocked = served.blocked;
        conn.light = light;
        let rest = bytes.get(served.used..).unwrap_or_default();
        let seen = at_once.len().saturating_sub(served.used);
        let whole = served.close || input.keep(rest, seen, served.needed) == rest.len();
        // The bytes kept past what the step saw may complete a request: served next.
        let again = !served.close && !served.blocked && input.ready();
        let sent = if whole {
            self.ring.recycle(chunk);
            // Its replies go out at once, as `service_dirty` would send them.
            (!served.close)
                .then(|| send_reading(&mut self.ring, conn, slot, self.budget.out_high_water))
                .flatten()
        } else {
            // The input cannot take the rest yet (a request larger than its buffer):
            // `feed` copies it on as the input grows.
            let kept = input.held();
            conn.parked.push_back((chunk, served.used + kept));
            None
        };
        self.deliver();
        match sent {
            // Nothing more for `service_dirty` to do for it.
            Some(Ok(_)) if !again => {}
            Some(Err(error)) => self.send_failed(slot, &error),
            None if served.close => self.close(slot, Close::Flush),
            _ => {
                self.requeue(slot);
                if !whole {
                    self.feed(slot);
                } else if again {
                    self.serve_in_round(slot, Pass::Light);
                }
            }
        }
    }

    /// A send failed: the connection's end.
    fn send_failed(&mut self, slot: usize, error: &io::Error) {
        if let Some(Some(conn)) = self.conns.get(slot) {
            tracing::debug!(peer = %Peer::of(&*conn.fd), %error, "store connection write failed");
        }
        self.close(slot, Close::Abandon);
    }

    /// Appends wake-up bytes to the connections of this loop they are for (if still
    /// there and not abandoned), and empties `serving.wakes`.
    #[inline]
    fn deliver(&mut self) {
        // The common case, inline: nothing to deliver.
        if !self.serving.wakes.is_empty() {
            self.deliver_wakes();
        }
    }

    fn deliver_wakes(&mut self) {
        for (target, byte) in self.serving.wakes.drain(..) {
            let slot = shared_engine::slot_of(target);
            if let Some(Some(conn)) = self.conns.get_mut(slot) {
                if conn.id == target && conn.phase != Phase::Abandoned {
                    conn.out.push(byte);
                    queue(&mut self.dirty, conn, slot);
                }
            }
        }
    }

    fn sent(&mut self, slot: usize, result: io::Result<usize>, mut outgoing: Outgoing) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        match result {
            Ok(n) => {
                outgoing.advance(n);
                conn.writing = Writing::Idle(outgoing);
                // The common case, a reply sent whole to a connection that is reading
                // and owes nothing more: nothing for `service_dirty` to do.
                if !conn.settled() {
                    queue(&mut self.dirty, conn, slot);
                }
            }
            Err(error) => {
                conn.writing = Writing::Idle(outgoing);
                self.send_failed(slot, &error);
            }
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
        queue(&mut self.dirty, conn, slot);
        if was != Phase::Open {
            return;
        }
        let id = conn.id;
        self.serving.leave(id);
        self.deliver();
    }

    /// Puts connection `slot` on the `dirty` list, once.
    fn requeue(&mut self, slot: usize) {
        if let Some(Some(conn)) = self.conns.get_mut(slot) {
            queue(&mut self.dirty, conn, slot);
        }
    }

    /// Queues each touched connection's next receive and send, cancels what a closing
    /// connection no longer needs, and frees finished connections.
    fn service_dirty(&mut self) {
        // Replies go out at once, with a non-blocking `send` each, rather than through
        // the ring (the module docs say why); the ring sends only what a socket does
        // not take.
        while let Some(slot) = self.dirty.pop() {
            let Some(Some(conn)) = self.conns.get_mut(slot) else {
                continue;
            };
            conn.queued = false;
            // The common case (what the rest below comes to for it). Sent whole, it is
            // settled (or put off, and in `again`).
            match send_reading(&mut self.ring, conn, slot, self.budget.out_high_water) {
                Some(Ok(_)) => continue,
                Some(Err(error)) => {
                    self.send_failed(slot, &error);
                    continue;
                }
                None => {}
            }
            if conn.finished() {
                for (chunk, _) in conn.parked.drain(..) {
                    self.ring.recycle(chunk);
                }
                // Nothing in flight: the buffers and the descriptor can go; a flushed
                // connection after a FIN, so that its last reply is not reset away.
                if conn.phase == Phase::Flushing {
                    super::closing::finish(&*conn.fd);
                }
                if let Some(entry) = self.conns.get_mut(slot) {
                    *entry = None;
                }
                self.free.push(slot);
                self.live = self.live.saturating_sub(1);
                self.serving
                    .stats
                    .connections
                    .fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            if conn.phase != Phase::Open {
                // Parked bytes are not served: their buffers go back to the pool.
                for (chunk, _) in conn.parked.drain(..) {
                    self.ring.recycle(chunk);
                }
                if let Reading::Once(op) = conn.reading {
                    conn.reading = Reading::Cancelling;
                    self.ring.cancel(op);
                    continue;
                }
                if let Some(op) = conn.reading.stop_multi() {
                    self.ring.cancel(op);
                }
            }
            let may_read = !conn.blocked && conn.owed() <= self.budget.out_high_water;
            if !may_read || !conn.parked.is_empty() {
                // Backpressure, or bytes its input has no room for yet: stop reading
                // until they are served.
                if let Some(op) = conn.reading.stop_multi() {
                    self.ring.cancel(op);
                }
            }
            if conn.phase == Phase::Open
                && conn.blocked
                && conn.reading.input().is_some()
                && conn.owed() <= self.budget.out_high_water
            {
                // Drained below the mark: serve what was received before reading more
                // (this pushes the slot again, and is looked at once more).
                conn.blocked = false;
                self.serve_in_round(slot, Pass::Light);
                self.requeue(slot);
                continue;
            }
            if conn.phase == Phase::Open
                && !conn.blocked
                && !conn.deferred
                && !conn.parked.is_empty()
                && conn.owed() <= self.budget.out_high_water
            {
                // Served (or drained) since its chunks were parked: copy on.
                if self.feed(slot) {
                    self.requeue(slot);
                } else {
                    // Unreachable while the serve step bounds requests by the input's
                    // cap (only a refused allocation gets here): it cannot complete.
                    self.close(slot, Close::Flush);
                }
                continue;
            }
            let full = match &mut conn.reading {
                Reading::Idle(input) => {
                    if input.is_full() {
                        // Chunks filled it exactly: make room (compact, or grow to the cap).
                        input.consume(0);
                    }
                    input.is_full()
                }
                _ => false,
            };
            if conn.phase == Phase::Open
                && !conn.blocked
                && !conn.deferred
                && !full
                && conn.owed() <= self.budget.out_high_water
                && conn.reading.is_idle()
                && conn.parked.is_empty()
            {
                let multi = if self.multishot && !std::mem::take(&mut conn.once) {
                    self.ring.recv_multi(&conn.fd, slot)
                } else {
                    None
                };
                match multi {
                    Some(op) => {
                        if let Some(input) = conn.reading.take_idle() {
                            conn.reading = Reading::Multi { op, input };
                        }
                    }
                    None => {
                        if let Some(input) = conn.reading.take_idle() {
                            conn.reading = Reading::Once(self.ring.recv(&conn.fd, input, slot));
                        }
                    }
                }
            } else if conn.phase == Phase::Open && full && !conn.blocked && !conn.deferred {
                // Unreachable while the serve step bounds requests by the buffer's cap
                // (only a refused allocation gets here): the request cannot complete.
                self.close(slot, Close::Flush);
                continue;
            }
            if conn.phase == Phase::Abandoned {
                if let Writing::Idle(outgoing) = &mut conn.writing {
                    conn.out.clear();
                    outgoing.bytes.clear();
                    outgoing.sent = 0;
                }
            } else {
                match send_owed(&mut self.ring, conn, slot) {
                    // Sent whole at once: no completion will come to look at it again,
                    // so it is looked at now if it waits for that (a blocked one has
                    // drained, or a closing one may be done).
                    Ok(Sent::Whole) if !conn.settled() => queue(&mut self.dirty, conn, slot),
                    Ok(_) => {}
                    Err(error) => {
                        self.send_failed(slot, &error);
                        continue;
                    }
                }
            }
            // A closing connection with nothing left in flight is freed next round.
            if conn.finished() {
                queue(&mut self.dirty, conn, slot);
            }
        }
    }

    fn begin_shutdown(&mut self) {
        match self.accepting {
            Accepting::InFlight(op) => {
                self.accepting = Accepting::Cancelling;
                self.ring.cancel(op);
            }
            Accepting::Idle => self.accepting = Accepting::Stopped,
            Accepting::Cancelling | Accepting::Stopped => {}
        }
        // Every connection flushes what it owes, then closes.
        for slot in 0..self.conns.len() {
            self.close(slot, Close::Flush);
        }
        self.service_dirty();
    }

    /// After the loop: cancel whatever is still in flight and wait (briefly) until the
    /// kernel has let go of every buffer. Connections it has not let go of are dropped;
    /// the ring keeps (and, when it is dropped, leaks) what the kernel still holds.
    /// (The eventfd poll holds no buffer.)
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
                .any(|c| !c.reading.is_idle() || !c.writing.is_idle());
            if !busy && !self.accepting.in_flight() {
                // Free what the last round finished.
                self.service_dirty();
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    connections = self.conns.iter().flatten().count(),
                    "kernel operations did not complete after cancellation; leaking their buffers"
                );
                self.drop_the_rest();
                break;
            }
            // Sends are cancelled too: a peer that reads nothing must not hold us.
            for conn in self.conns.iter().flatten() {
                if let Writing::InFlight { op, .. } = conn.writing {
                    self.ring.cancel(op);
                }
            }
            self.service_dirty();
            if self.wait(false).is_err() {
                // The ring itself failed; nothing more can be waited for.
                self.drop_the_rest();
                break;
            }
            self.complete();
        }
        tracing::debug!(loop_index = self.serving.index, "store loop stopped");
    }

    /// Gives up the connections the kernel may still hold: the ring keeps their
    /// buffers (leaked with it if never completed), the rest is freed.
    fn drop_the_rest(&mut self) {
        let stuck = self.conns.drain(..).flatten().count();
        self.serving
            .stats
            .connections
            .fetch_sub(stuck, Ordering::Relaxed);
        self.live = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::shared_engine::SharedEngine;
    use crate::server::StatsCells;
    use rdzv_core::store::codec::Limits;

    #[test]
    fn closing_never_reopens_nor_unabandons() {
        assert_eq!(Phase::Open.closed(Close::Flush), Phase::Flushing);
        assert_eq!(Phase::Open.closed(Close::Abandon), Phase::Abandoned);
        assert_eq!(Phase::Flushing.closed(Close::Abandon), Phase::Abandoned);
        assert_eq!(Phase::Flushing.closed(Close::Flush), Phase::Flushing);
        assert_eq!(Phase::Abandoned.closed(Close::Flush), Phase::Abandoned);
    }

    /// Two loops, each on its own port (so the test decides which loop serves which
    /// connection): a `WAIT` on loop 1 is released by a `SET` on loop 0. The wake-up
    /// crosses through loop 1's inbox and its eventfd, while loop 1 sleeps in
    /// `io_uring_enter`; both loops' connections are counted.
    #[test]
    fn a_wake_up_crosses_to_a_sleeping_loop() {
        crossing(true);
    }

    /// The same with one-shot receives, as on kernels without multishot receives or
    /// provided buffer rings.
    #[test]
    fn a_wake_up_crosses_to_a_sleeping_loop_with_one_shot_receives() {
        crossing(false);
    }

    /// A peer that pipelines 20,000 GETs of a 4 KiB value (80 MiB of replies, past the
    /// high-water mark many times over) before it reads anything gets every reply, in
    /// order: its receive stops while it owes too much, and chunks its input has no
    /// room for wait parked in the pool.
    #[test]
    fn a_peer_that_pipelines_before_it_reads_gets_every_reply() {
        for multishot in [true, false] {
            pipelined(multishot);
        }
    }

    /// A reply far larger than the socket takes at once: the non-blocking send takes what
    /// fits and the ring sends the rest, whole and in order, to a peer that starts reading
    /// late; the connection then serves its next request as before, and a peer that
    /// leaves in the middle of a reply is let go.
    #[test]
    fn a_reply_larger_than_the_socket_takes_goes_out_whole() {
        use std::io::{Read, Write};

        use rdzv_core::store::Request;

        for multishot in [true, false] {
            let budget = Budget::default();
            let (port, stop, thread, stats) = one_loop(multishot, budget);
            let value: Vec<u8> = (0..7 << 20).map(|i: u32| (i % 251) as u8).collect();
            let frame = validate_and_set(b"big", &value);
            let mut stream = connect(port);
            // (A SET has no reply.)
            stream.write_all(&frame).unwrap();
            for round in 0..2 {
                let mut get = Vec::new();
                Request::Get { key: b"big" }.encode_into(&mut get);
                stream.write_all(&get).unwrap();
                // The socket fills while nobody reads.
                std::thread::sleep(Duration::from_millis(100));
                let mut reply = vec![0u8; 8 + value.len()];
                stream
                    .read_exact(&mut reply)
                    .unwrap_or_else(|e| panic!("GET {round} (multishot {multishot}): {e}"));
                assert_eq!(
                    u64::from_le_bytes(reply[..8].try_into().unwrap()),
                    value.len() as u64
                );
                assert!(reply[8..] == value[..], "GET {round}: the bytes differ");
            }
            // A peer that leaves with most of a reply unread.
            let mut get = Vec::new();
            Request::Get { key: b"big" }.encode_into(&mut get);
            stream.write_all(&get).unwrap();
            let mut some = [0u8; 4096];
            stream.read_exact(&mut some).unwrap();
            drop(stream);
            let deadline = Instant::now() + Duration::from_secs(10);
            while stats.connections.load(Ordering::Relaxed) != 0 {
                assert!(Instant::now() < deadline, "the connection was never let go");
                std::thread::sleep(Duration::from_millis(10));
            }
            stop.store(true, Ordering::Release);
            thread.join().unwrap();
        }
    }

    /// A client's first bytes: `VALIDATE`, then a `SET` of `key` (which has no reply).
    fn validate_and_set(key: &[u8], value: &[u8]) -> Vec<u8> {
        use rdzv_core::store::{Request, VALIDATION_MAGIC};

        let mut frame = Vec::new();
        Request::Validate {
            magic: VALIDATION_MAGIC,
        }
        .encode_into(&mut frame);
        Request::Set { key, value }.encode_into(&mut frame);
        frame
    }

    /// A client of the loop on `port` that gives up reading after 20 s.
    fn connect(port: u16) -> std::net::TcpStream {
        let stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stream
    }

    /// One loop on its own port with `budget`: its port, its stop flag, its thread and
    /// its counters.
    fn one_loop(
        multishot: bool,
        budget: Budget,
    ) -> (
        u16,
        Arc<AtomicBool>,
        std::thread::JoinHandle<()>,
        Arc<StatsCells>,
    ) {
        let stats = Arc::new(StatsCells::default());
        let (mut ring, waker) = ring().expect("an io_uring");
        ring.multishot = multishot;
        let shared = Arc::new(SharedEngine::new(
            vec![Box::new(waker) as Box<dyn LoopWaker>],
            Arc::clone(&stats),
            budget,
        ));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let setup = LoopSetup {
            config: LoopConfig {
                index: 0,
                shared,
                limits: Limits::default(),
                budget,
                access: None,
                stats: Arc::clone(&stats),
                drain: Duration::from_secs(1),
                spin: None,
            },
            ring,
            listener: listener.into(),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || serve(setup, &stop))
        };
        (port, stop, thread, stats)
    }

    /// Under a per-connection cap smaller than a pool chunk (so an input buffer smaller
    /// than one), requests that straddle the most the serve step sees at once from a
    /// chunk are served whole: what a chunk served in place leaves over is kept (or
    /// parked and fed on), and a request completed by the bytes kept past what the step
    /// saw is served without waiting for more.
    #[test]
    fn a_cap_smaller_than_a_chunk_serves_requests_across_it() {
        use std::io::{Read, Write};
        use std::net::TcpStream;

        use rdzv_core::store::{KeyList, Request, WaitResponse, VALIDATION_MAGIC};

        for multishot in [true, false] {
            let budget = Budget {
                max_conn_bytes: 3000,
                ..Budget::default()
            };
            let (port, stop, thread, stats) = one_loop(multishot, budget);
            let mut stream = connect(port);
            let get = |stream: &mut TcpStream, key: &[u8], value: &[u8]| {
                let mut get = Vec::new();
                Request::Get { key }.encode_into(&mut get);
                stream.write_all(&get).unwrap();
                let mut reply = vec![0u8; 8 + value.len()];
                stream.read_exact(&mut reply).unwrap_or_else(|e| {
                    panic!("GET {:?} (multishot {multishot}): {e}", key[0] as char)
                });
                assert_eq!(
                    u64::from_le_bytes(reply[..8].try_into().unwrap()),
                    value.len() as u64
                );
                assert!(reply[8..] == *value, "GET {:?}: the bytes differ", key[0]);
            };
            // A first round trip, after which the connection is light (its chunks are
            // served in place).
            stream.write_all(&validate_and_set(b"a", b"x")).unwrap();
            get(&mut stream, b"a", b"x");
            // One write of SETs; with nothing more arriving on this connection, another
            // one's WAIT on the last key is released, and then each value reads back.
            let sets = |stream: &mut TcpStream, values: &[(&[u8], usize)]| {
                let values: Vec<(&[u8], Vec<u8>)> = values
                    .iter()
                    .map(|&(key, len)| (key, vec![key[0]; len]))
                    .collect();
                let mut frame = Vec::new();
                for (key, value) in &values {
                    Request::Set { key, value }.encode_into(&mut frame);
                }
                stream.write_all(&frame).unwrap();
                let last = values.last().unwrap().0;
                let mut other = connect(port);
                let mut wait = Vec::new();
                Request::Validate {
                    magic: VALIDATION_MAGIC,
                }
                .encode_into(&mut wait);
                let encoded = [&1u64.to_le_bytes()[..], last].concat();
                Request::Wait {
                    keys: KeyList::new(1, &encoded).unwrap(),
                }
                .encode_into(&mut wait);
                other.write_all(&wait).unwrap();
                let mut stop_waiting = [0u8; 1];
                other.read_exact(&mut stop_waiting).unwrap_or_else(|e| {
                    panic!("WAIT {:?} (multishot {multishot}): {e}", last[0] as char)
                });
                assert_eq!(stop_waiting[0], WaitResponse::StopWaiting as u8);
                drop(other);
                for (key, value) in &values {
                    get(stream, key, value);
                }
            };
            // 3,954 bytes (one chunk): a SET near the cap, and two more, the first of
            // which starts before the 3,000 bytes the step sees at once and ends after
            // them. Every request in the chunk is served before its rest is kept.
            sets(&mut stream, &[(b"b", 2900), (b"c", 900), (b"d", 100)]);
            // 4,068 bytes: a small SET, then one of 2,950 bytes that the step cannot
            // finish within its 3,000, so the chunk is parked with the rest unread.
            sets(&mut stream, &[(b"e", 82), (b"f", 2932), (b"g", 1000)]);
            drop(stream);
            stop.store(true, Ordering::Release);
            thread.join().unwrap();
            assert_eq!(stats.connections.load(Ordering::Relaxed), 0);
        }
    }

    /// One step of [`any_split_under_any_cap_gets_the_model_replies`]: a SET (no reply),
    /// a GET of a key set before (its value), or an ADD on a counter (its new value).
    #[derive(Debug, Clone)]
    enum Step {
        Set { key: u8, len: usize },
        Get { key: u8 },
        Add { key: u8, delta: i64 },
    }

    use proptest::prelude::Strategy as _;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

        /// Requests of any size under the per-connection cap, written in pieces cut
        /// anywhere (so chunks end inside requests, hold several, hold more than the
        /// step sees at once, or hold one's end and the next one's start), get the
        /// replies a model gives, in order, on multishot and one-shot receives; and the
        /// last of them is served with nothing more arriving (another connection's GET
        /// of the key it sets is answered).
        #[test]
        fn any_split_under_any_cap_gets_the_model_replies(
            cap in 1_500usize..5_000,
            burst in proptest::collection::vec(0usize..5_000, 0..8),
            steps in proptest::collection::vec(
                proptest::prop_oneof![
                    (0u8..3, 0usize..5_000).prop_map(|(key, len)| Step::Set { key, len }),
                    (0u8..3).prop_map(|key| Step::Get { key }),
                    (0u8..2, -9i64..10).prop_map(|(key, delta)| Step::Add { key, delta }),
                ],
                0..60,
            ),
            cuts in proptest::collection::vec(1usize..6_000, 1..30),
            multishot in proptest::bool::ANY,
        ) {
            use std::collections::HashMap;
            use std::io::{Read, Write};

            use rdzv_core::store::{Request, VALIDATION_MAGIC};

            let budget = Budget {
                max_conn_bytes: cap,
                out_high_water: cap / 2,
                ..Budget::default()
            };
            let mut frame = Vec::new();
            Request::Validate { magic: VALIDATION_MAGIC }.encode_into(&mut frame);
            let mut values: HashMap<u8, Vec<u8>> = HashMap::new();
            // First a burst of SETs, each as large as the cap allows, many caps in all:
            // nothing is owed while they are served.
            for (i, len) in burst.iter().enumerate() {
                let value = vec![b'A' + (i % 26) as u8; (*len).min(cap - 64)];
                Request::Set { key: &[b'k', 0], value: &value }.encode_into(&mut frame);
                values.insert(0, value);
            }
            // Then requests with replies and, from the model, those replies. The cap holds
            // a connection's unserved requests and unsent replies, and the writer sends
            // without waiting: these steps are taken while all of them fit it.
            let start = frame.len();
            let mut expected = Vec::new();
            let mut counters: HashMap<u8, i64> = HashMap::new();
            for (i, step) in steps.iter().enumerate() {
                let mut request = Vec::new();
                let mut reply = Vec::new();
                match *step {
                    Step::Set { key, len } => {
                        let value = vec![b'a' + (i % 26) as u8; len.min(cap / 4)];
                        Request::Set { key: &[b'k', key], value: &value }.encode_into(&mut request);
                        values.insert(key, value);
                    }
                    Step::Get { key } => {
                        // A GET of a missing key waits: only keys set before.
                        let Some(value) = values.get(&key) else { continue };
                        Request::Get { key: &[b'k', key] }.encode_into(&mut request);
                        reply.extend_from_slice(&(value.len() as u64).to_le_bytes());
                        reply.extend_from_slice(value);
                    }
                    Step::Add { key, delta } => {
                        Request::Add { key: &[b'n', key], delta }.encode_into(&mut request);
                        let counter = counters.entry(key).or_insert(0);
                        *counter += delta;
                        reply.extend_from_slice(&counter.to_le_bytes());
                    }
                }
                if frame.len() - start + expected.len() + request.len() + reply.len() > cap - 64 {
                    break;
                }
                frame.extend_from_slice(&request);
                expected.extend_from_slice(&reply);
            }
            Request::Set { key: b"done", value: b"1" }.encode_into(&mut frame);

            let (port, stop, thread, stats) = one_loop(multishot, budget);
            let mut stream = connect(port);
            stream.set_nodelay(true).unwrap();
            let mut writer = stream.try_clone().unwrap();
            let writing = std::thread::spawn(move || -> std::io::Result<()> {
                let mut rest = &frame[..];
                for cut in cuts.iter().cycle() {
                    if rest.is_empty() {
                        break;
                    }
                    let (piece, after) = rest.split_at((*cut).min(rest.len()));
                    writer.write_all(piece)?;
                    rest = after;
                    // Apart in time, so that pieces arrive as chunks of their own.
                    std::thread::sleep(Duration::from_micros(300));
                }
                Ok(())
            });
            let mut got = vec![0u8; expected.len()];
            let read = stream.read_exact(&mut got);
            let written = writing.join().unwrap();
            // The last request, served though nothing comes after it: another
            // connection's GET of its key (which waits for the key) is answered.
            let mut other = connect(port);
            let mut get = Vec::new();
            Request::Validate { magic: VALIDATION_MAGIC }.encode_into(&mut get);
            Request::Get { key: b"done" }.encode_into(&mut get);
            other.write_all(&get).unwrap();
            let mut done = [0u8; 9];
            let last = other.read_exact(&mut done);
            drop((stream, other));
            stop.store(true, Ordering::Release);
            thread.join().unwrap();
            proptest::prop_assert!(written.is_ok(), "writing (multishot {}): {:?}", multishot, written);
            proptest::prop_assert!(read.is_ok(), "replies (multishot {}): {:?}", multishot, read);
            proptest::prop_assert!(got == expected, "the replies differ from the model's");
            proptest::prop_assert!(last.is_ok(), "the last request (multishot {}): {:?}", multishot, last);
            proptest::prop_assert_eq!(&done[..], &[1, 0, 0, 0, 0, 0, 0, 0, b'1'][..]);
            proptest::prop_assert_eq!(stats.connections.load(Ordering::Relaxed), 0);
        }
    }

    fn pipelined(multishot: bool) {
        use std::io::{Read, Write};

        use rdzv_core::store::Request;

        let budget = Budget {
            out_high_water: 64 << 10,
            ..Budget::default()
        };
        let (port, stop, thread, stats) = one_loop(multishot, budget);
        let mut stream = connect(port);
        let value = vec![b'v'; 4096];
        let mut frame = validate_and_set(b"k", &value);
        let count = 20_000;
        for _ in 0..count {
            Request::Get { key: b"k" }.encode_into(&mut frame);
        }
        // Written by another thread: the server stops reading while the replies wait.
        let mut writer = stream.try_clone().unwrap();
        let writing = std::thread::spawn(move || writer.write_all(&frame));
        std::thread::sleep(Duration::from_millis(200));
        let mut reply = vec![0u8; 8 + value.len()];
        for i in 0..count {
            stream
                .read_exact(&mut reply)
                .unwrap_or_else(|e| panic!("reply {i} of {count} (multishot {multishot}): {e}"));
            assert_eq!(u64::from_le_bytes(reply[..8].try_into().unwrap()), 4096);
            assert!(reply[8..].iter().all(|&b| b == b'v'));
        }
        writing.join().unwrap().unwrap();
        drop(stream);
        stop.store(true, Ordering::Release);
        thread.join().unwrap();
        assert_eq!(stats.connections.load(Ordering::Relaxed), 0);
    }

    fn crossing(multishot: bool) {
        use std::io::{Read, Write};
        use std::net::TcpStream;

        use rdzv_core::store::{KeyList, Request, WaitResponse, VALIDATION_MAGIC};

        /// A bare PyTorch-protocol client, so that the server's tests use no store client
        /// (`store::tcp` sits above the server: it can host one).
        fn validated(port: u16, timeout: Duration) -> TcpStream {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
            stream.set_read_timeout(Some(timeout)).unwrap();
            let mut frame = Vec::new();
            Request::Validate {
                magic: VALIDATION_MAGIC,
            }
            .encode_into(&mut frame);
            Request::Ping { nonce: 7 }.encode_into(&mut frame);
            stream.write_all(&frame).unwrap();
            let mut echo = [0u8; 4];
            stream.read_exact(&mut echo).unwrap();
            assert_eq!(u32::from_le_bytes(echo), 7, "PING echoes its nonce");
            stream
        }

        let stats = Arc::new(StatsCells::default());
        let mut rings = Vec::new();
        let mut wakers: Vec<Box<dyn LoopWaker>> = Vec::new();
        for _ in 0..2 {
            let (mut ring, waker) = ring().expect("an io_uring");
            ring.multishot = multishot;
            rings.push(ring);
            wakers.push(Box::new(waker));
        }
        let shared = Arc::new(SharedEngine::new(
            wakers,
            Arc::clone(&stats),
            Budget::default(),
        ));
        let stop = Arc::new(AtomicBool::new(false));
        let mut ports = Vec::new();
        let mut threads = Vec::new();
        for (index, ring) in rings.into_iter().enumerate() {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            ports.push(listener.local_addr().unwrap().port());
            let setup = LoopSetup {
                config: LoopConfig {
                    index,
                    shared: Arc::clone(&shared),
                    limits: Limits::default(),
                    budget: Budget::default(),
                    access: None,
                    stats: Arc::clone(&stats),
                    drain: Duration::from_secs(1),
                    spin: None,
                },
                ring,
                listener: listener.into(),
            };
            let stop = Arc::clone(&stop);
            threads.push(std::thread::spawn(move || serve(setup, &stop)));
        }
        let timeout = Duration::from_secs(10);
        let waiter_port = ports[1];
        let waiter = std::thread::spawn(move || {
            let mut stream = validated(waiter_port, timeout);
            let key = b"crossing";
            let mut encoded = (key.len() as u64).to_le_bytes().to_vec();
            encoded.extend_from_slice(key);
            let mut frame = Vec::new();
            Request::Wait {
                keys: KeyList::new(1, &encoded).unwrap(),
            }
            .encode_into(&mut frame);
            stream.write_all(&frame).unwrap();
            let mut stop_waiting = [0xffu8; 1];
            stream
                .read_exact(&mut stop_waiting)
                .map(|()| stop_waiting[0])
        });
        let deadline = Instant::now() + timeout;
        while stats.waiters.load(Ordering::Relaxed) == 0 {
            assert!(Instant::now() < deadline, "the WAIT never registered");
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut setter = validated(ports[0], timeout);
        assert_eq!(stats.connections.load(Ordering::Relaxed), 2);
        let mut frame = Vec::new();
        Request::Set {
            key: b"crossing",
            value: b"1",
        }
        .encode_into(&mut frame);
        setter.write_all(&frame).unwrap();
        let stop_waiting = waiter
            .join()
            .unwrap()
            .expect("the SET on loop 0 released the WAIT on loop 1");
        assert_eq!(stop_waiting, WaitResponse::StopWaiting as u8);
        drop(setter);
        assert_eq!(stats.waiters.load(Ordering::Relaxed), 0);
        stop.store(true, Ordering::Release);
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(stats.connections.load(Ordering::Relaxed), 0, "all closed");
    }
}
