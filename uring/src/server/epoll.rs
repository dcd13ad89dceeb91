//! The store server on epoll (raw system calls, module `poller`), thread-per-core: for hosts where io_uring is
//! refused (Docker ≥ 25 and containerd 2 seccomp profiles, RHEL 9's
//! `kernel.io_uring_disabled`), and for many cores.
//!
//! N loops each own a `SO_REUSEPORT` listener (the kernel spreads new connections over
//! them) and the connections they accept, and run those connections' requests to
//! completion against the one engine all loops share (`shared_engine`): read, lock,
//! apply, unlock, write. Nothing hops to another thread on the way; only a wake-up owed
//! to a connection of another loop crosses, through that loop's inbox and its
//! waker.
//!
//! A round serves every ready connection (reads and requests), then writes every reply
//! it produced: the peers get one burst per round, as one io_uring submission gives them,
//! instead of being woken between two reads. Light connections (whose last turn was
//! small) are served first and their replies written before any heavy one is served;
//! then heavy ones until the round has produced its share of reply bytes
//! (`session::Round`, shared with io_uring), and the rest wait for the next round: a
//! good client is not queued behind a burst of large GETs. Accepts are taken
//! [`ACCEPTS_PER_ROUND`] at a time.
//!
//! Readiness is edge-triggered: a connection remembers that it may read or write more
//! until a call says `WouldBlock`. A connection reads at most [`READS_PER_TURN`] times
//! before the loop serves the others. Once it owes its peer more than the budget's
//! high-water mark, none of its requests are served and nothing is read until the peer
//! has read enough (the serve step says `Blocked`); then the requests already received
//! are served first. Replies are written at the end of the round, or at once when a
//! connection owes more than [`EAGER_WRITE`], so that a burst of large replies does not
//! pile up before the first byte goes out.
//!
//! What happens at accept (`--allow`, out of descriptors, a new connection's id and
//! serve step) is module `admission`'s, shared with io_uring.
//!
//! Shutdown: when the stop flag is seen (at least every 50 ms) the loop closes its
//! listener, every connection leaves the engine and flushes what it owes, for up to
//! `drain`; then the rest are dropped.

use std::io;
use std::net::TcpListener;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv_core::store::budget::Budget;
use rdzv_core::store::session::Session;
use rdzv_core::store::ConnId;
use rustix::event::epoll::EventFlags;
use rustix::net::SocketFlags;

use super::admission::{Admission, Opened, Peer, Retry};
use super::loop_config::LoopConfig;
use super::poller::{Poller, Readiness, LISTENER, WAKER};
use super::session::{ConnInput, Pass, ReadBuf};
use super::shared_engine::{self, Serving};

/// How often the stop flag is looked at while nothing happens.
const TICK: Duration = Duration::from_millis(50);
/// A connection that owes more than this is written at once rather than at the end of
/// the round, and yields its turn to the others after that write.
const EAGER_WRITE: usize = 256 << 10;
/// Connections accepted per round: an accept storm is taken in slices, with the ready
/// connections served between them.
const ACCEPTS_PER_ROUND: usize = 64;
/// Reads one connection may do before the loop turns to the others.
const READS_PER_TURN: usize = 16;
/// Readiness events taken per wait.
const EVENTS: usize = 1024;

/// Where a connection is in its life.
///
/// ```text
///  accept ──► Open ──(bad input, refused, shutdown)──► Flushing ──(all sent)──► gone
///              │                                           │
///              └──────(end of stream, socket error)────────┴──────────────────► gone
/// ```
/// A connection leaves the engine when it stops being `Open`, so its waiters never
/// outlive it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading requests, writing replies and wake-ups.
    Open,
    /// No more reads, out of the engine: write what is owed, then close.
    Flushing,
}

/// When `advance` writes what a connection is owed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writes {
    /// At once.
    Now,
    /// After every ready connection of this round was served.
    Defer,
}

/// What a connection does next, as seen after it was served.
enum Next {
    /// Wait for readiness.
    Wait,
    /// Has more to read but yielded to the others: serve it again next round.
    Again,
    /// Close and forget it (nothing more will be written).
    Close,
}

/// One client connection.
struct Conn {
    stream: OwnedFd,
    id: ConnId,
    phase: Phase,
    input: ReadBuf,
    /// Serves `input`: cuts it into requests (resuming a long key list where it
    /// stopped), holds the connection to its budget.
    session: Session,
    /// The serve step said `Blocked`: serve again (before reading) once drained.
    blocked: bool,
    /// In the loop's `again` list (at most once).
    deferred: bool,
    /// Its last turn produced little (`Round::count`): not deferred by the round's cap.
    /// False for a new connection until it has been served once.
    light: bool,
    /// Bytes owed; `out[sent..]` is not written yet.
    out: Vec<u8>,
    sent: usize,
    /// Readiness seen and not yet used up (edge-triggered).
    readable: bool,
    writable: bool,
    /// The peer's end of stream (or an error) was reported: read until `Ok(0)`, even
    /// after a short read, since no further edge will come.
    read_closed: bool,
}

impl Conn {
    fn unsent(&self) -> usize {
        self.out.len() - self.sent
    }
}

/// One loop's state.
struct Loop {
    /// Its index, the engine, the round, `now` and the wake-ups to deliver.
    serving: Serving,
    poll: Poller,
    listener: Option<TcpListener>,
    budget: Budget,
    /// What happens at accept: `--allow`, refusals, a new connection's serve step.
    admission: Admission,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    live: usize,
    /// Slots to serve this round (may repeat; serving is idempotent).
    dirty: Vec<usize>,
    /// Slots that yielded with more to do, in the order they yielded.
    again: Vec<usize>,
    /// Slots with replies to write at the end of this round.
    flush: Vec<usize>,
    accept_after: Option<Instant>,
    spin: Option<Duration>,
}

/// Everything a loop thread needs: the common config, its poller and its listener.
pub(super) struct LoopSetup {
    pub(super) config: LoopConfig,
    pub(super) poll: Poller,
    pub(super) listener: TcpListener,
}

/// Makes a loop's poller and the waker other loops use to reach it.
pub(super) fn poller() -> io::Result<(Poller, super::poller::Waker)> {
    Poller::new()
}

/// The thread body of an epoll loop on `socket`.
pub(super) fn loop_body(
    config: LoopConfig,
    socket: socket2::Socket,
    poll: Poller,
    stop: Arc<AtomicBool>,
) -> super::LoopBody {
    let listener = TcpListener::from(socket);
    let setup = LoopSetup {
        config,
        poll,
        listener,
    };
    Box::new(move || serve(setup, &stop))
}

/// Serves until `stop` is set, then drains for up to `setup.drain`.
pub(super) fn serve(setup: LoopSetup, stop: &AtomicBool) {
    let LoopSetup {
        config,
        poll,
        listener,
    } = setup;
    let parts = config.into_parts();
    let index = parts.serving.index;
    if let Err(error) = poll.add(&listener, LISTENER, EventFlags::IN) {
        tracing::error!(%error, loop_index = index, "cannot register the store listener");
        return;
    }
    let mut server = Loop {
        serving: parts.serving,
        poll,
        listener: Some(listener),
        budget: parts.budget,
        admission: parts.admission,
        conns: Vec::new(),
        free: Vec::new(),
        live: 0,
        dirty: Vec::new(),
        again: Vec::new(),
        flush: Vec::new(),
        accept_after: None,
        spin: parts.spin,
    };
    if let Err(error) = server.run(stop, parts.drain) {
        tracing::error!(%error, loop_index = index, "store event loop failed; closing its connections");
    }
    server.close_all();
}

impl Loop {
    fn run(&mut self, stop: &AtomicBool, drain: Duration) -> io::Result<()> {
        let mut events = Vec::with_capacity(EVENTS);
        let mut deadline = None;
        let mut busy_until = Instant::now();
        loop {
            if deadline.is_none() && stop.load(Ordering::Acquire) {
                self.begin_shutdown();
                deadline = Some(Instant::now() + drain);
            }
            if let Some(deadline) = deadline {
                if self.live == 0 || Instant::now() >= deadline {
                    return Ok(());
                }
            }
            self.serving.now_ms = self.serving.shared.clock_ms();
            let mut timeout = TICK;
            if !self.again.is_empty() {
                timeout = Duration::ZERO;
            } else if self.spin.is_some() || self.accept_after.is_some() {
                // The clock is read a second time only when a spin or an accept pause
                // can shorten the wait (not per request on a loop that sleeps).
                let now = Instant::now();
                if now < busy_until {
                    timeout = Duration::ZERO;
                }
                if let Some(at) = self.accept_after {
                    timeout = timeout.min(at.saturating_duration_since(now));
                }
            }
            match self.poll.wait(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if !events.is_empty() {
                if let Some(spin) = self.spin {
                    busy_until = Instant::now() + spin;
                }
            }
            let mut woken = false;
            for event in &events {
                match event.data.u64() {
                    LISTENER => self.accept_after = Some(Instant::now()),
                    WAKER => woken = true,
                    token => {
                        let slot = usize::try_from(token).unwrap_or(usize::MAX);
                        if let Some(Some(conn)) = self.conns.get_mut(slot) {
                            let ready = Readiness::of(event.flags);
                            conn.readable |= ready.readable;
                            conn.writable |= ready.writable;
                            conn.read_closed |= ready.read_closed;
                            self.dirty.push(slot);
                        }
                    }
                }
            }
            if self.accept_after.is_some_and(|at| Instant::now() >= at) {
                self.accept();
            }
            if woken {
                self.serving.take_inbox();
                self.deliver();
            }
            // Serve every ready connection, then write all the replies: the peers see
            // one burst per round (as one io_uring submission gives them) instead of
            // being woken between two reads. Light connections first, and their replies
            // go out before the heavy ones are served (fresh events, then those that
            // yielded) until the round has produced its share of bytes; the rest wait a
            // round.
            self.serving.round.begin();
            while let Some(slot) = self.dirty.pop() {
                self.service_in_round(slot, Pass::Light);
            }
            while let Some(slot) = self.flush.pop() {
                self.flush_one(slot);
            }
            if !self.again.is_empty() {
                let mut yielded = std::mem::take(&mut self.again);
                for slot in yielded.drain(..) {
                    if let Some(Some(conn)) = self.conns.get_mut(slot) {
                        conn.deferred = false;
                    }
                    self.service_in_round(slot, Pass::Heavy);
                }
                while let Some(slot) = self.dirty.pop() {
                    self.service_in_round(slot, Pass::Heavy);
                }
                if self.again.is_empty() {
                    // Keep the list's room for the next burst.
                    self.again = yielded;
                }
            }
            while let Some(slot) = self.flush.pop() {
                self.flush_one(slot);
            }
        }
    }

    /// Accepts until the backlog is empty (edge-triggered), or backs off after an error.
    fn accept(&mut self) {
        self.accept_after = None;
        let mut accepted = 0;
        loop {
            if accepted == ACCEPTS_PER_ROUND {
                // More may wait (edge-triggered: no new event for them): next round.
                self.accept_after = Some(Instant::now());
                return;
            }
            accepted += 1;
            let Some(listener) = self.listener.as_ref() else {
                return;
            };
            let accepted =
                rustix::net::accept_with(listener, SocketFlags::NONBLOCK | SocketFlags::CLOEXEC);
            let stream = match accepted.map_err(io::Error::from) {
                Ok(stream) => stream,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(error) => match self.admission.accept_failed(&error, listener.as_fd()) {
                    Retry::Now => continue,
                    Retry::After(pause) => {
                        self.accept_after = Some(Instant::now() + pause);
                        return;
                    }
                },
            };
            let Some(slot) = self
                .admission
                .admit(stream.as_fd(), &mut self.free, &mut self.conns)
            else {
                continue;
            };
            if let Err(error) =
                self.poll
                    .add(&stream, slot as u64, EventFlags::IN | EventFlags::OUT)
            {
                if let Some(suppressed) = self.serving.warnings.allow(Instant::now()) {
                    tracing::warn!(%error, suppressed, "cannot register a store connection; closing it");
                }
                self.free.push(slot);
                continue;
            }
            let Opened { id, session, input } = self.admission.open(slot);
            if let Some(entry) = self.conns.get_mut(slot) {
                *entry = Some(Conn {
                    stream,
                    id,
                    phase: Phase::Open,
                    input,
                    session,
                    blocked: false,
                    deferred: false,
                    light: false,
                    out: Vec::new(),
                    sent: 0,
                    readable: true,
                    writable: true,
                    read_closed: false,
                });
                self.live += 1;
                self.serving
                    .stats
                    .connections
                    .fetch_add(1, Ordering::Relaxed);
                self.dirty.push(slot);
            }
        }
    }

    /// Appends wake-up bytes to the connections of this loop they are for, if those are
    /// still there and open, and empties `serving.wakes`.
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
                if conn.id == target && conn.phase == Phase::Open {
                    conn.out.push(byte);
                    self.dirty.push(slot);
                }
            }
        }
    }

    /// Serves a connection in this pass of the round, or defers it (a heavy one in the
    /// light pass, or once the round has produced its share of reply bytes).
    fn service_in_round(&mut self, slot: usize, pass: Pass) {
        let light =
            matches!(self.conns.get(slot), Some(Some(conn)) if conn.light && conn.unsent() == 0);
        if self.serving.round.defers(light, pass) {
            self.defer(slot);
        } else {
            self.service(slot, Writes::Defer);
        }
    }

    /// Puts a connection on the `again` list, once.
    fn defer(&mut self, slot: usize) {
        if let Some(Some(conn)) = self.conns.get_mut(slot) {
            if !conn.deferred {
                conn.deferred = true;
                self.again.push(slot);
            }
        }
    }

    /// Hands a served connection's replies to the kernel (the round's last pass). One
    /// that is open, not blocked and has nothing more to read can do nothing after the
    /// write, so it gets only the write; any other goes through [`Loop::service`].
    fn flush_one(&mut self, slot: usize) {
        if let Some(Some(conn)) = self.conns.get_mut(slot) {
            if conn.phase == Phase::Open && !conn.blocked && !conn.readable {
                if conn.unsent() > 0 && conn.writable {
                    if let Err(error) = write_out(conn) {
                        tracing::debug!(peer = %Peer::of(&conn.stream), %error, "store connection write failed");
                        self.close(slot);
                    }
                }
                return;
            }
        }
        self.service(slot, Writes::Now);
    }

    /// Reads, serves, writes one connection as far as it can go now.
    fn service(&mut self, slot: usize, writes: Writes) {
        let next = self.advance(slot, writes);
        if writes == Writes::Defer && !matches!(next, Next::Close) {
            if let Some(Some(conn)) = self.conns.get(slot) {
                if conn.unsent() > 0 && conn.writable {
                    self.flush.push(slot);
                }
            }
        }
        match next {
            Next::Wait => {}
            Next::Again => self.defer(slot),
            Next::Close => self.close(slot),
        }
    }

    fn advance(&mut self, slot: usize, writes: Writes) -> Next {
        let mut reads = 0;
        let mut produced_before = None;
        loop {
            let Some(Some(conn)) = self.conns.get_mut(slot) else {
                return Next::Wait;
            };
            // Write first: it may lift the high-water mark.
            let eager = conn.unsent() >= EAGER_WRITE.min(self.budget.out_high_water);
            if conn.unsent() > 0 && conn.writable && (writes == Writes::Now || eager) {
                match write_out(conn) {
                    Ok(()) => {}
                    Err(error) => {
                        tracing::debug!(peer = %Peer::of(&conn.stream), %error, "store connection write failed");
                        return Next::Close;
                    }
                }
            }
            if eager && conn.phase == Phase::Open {
                if let Some(before) = produced_before {
                    // This turn built a large reply: let the others have theirs.
                    if self.serving.round.produced() > before {
                        let more = conn.readable || conn.blocked;
                        return if more { Next::Again } else { Next::Wait };
                    }
                }
            }
            produced_before.get_or_insert(self.serving.round.produced());
            if conn.phase == Phase::Flushing {
                if conn.unsent() > 0 {
                    return Next::Wait;
                }
                // Every reply is with the kernel: FIN after them, no reset.
                super::closing::finish(&conn.stream);
                return Next::Close;
            }
            if conn.blocked {
                if conn.unsent() > self.budget.out_high_water {
                    return Next::Wait;
                }
                // Drained: serve what was received before reading more.
                conn.blocked = false;
                self.serve_connection(slot);
                continue;
            }
            if !conn.readable || conn.unsent() > self.budget.out_high_water {
                return Next::Wait;
            }
            if conn.input.is_full() {
                // Unreachable while the serve step bounds requests by the buffer's cap
                // (only a refused allocation gets here): the request cannot complete.
                return Next::Close;
            }
            if reads == READS_PER_TURN {
                return Next::Again;
            }
            reads += 1;
            let spare = conn.input.spare();
            let room = spare.len();
            let complete = match receive(&conn.stream, spare) {
                Ok(0) => return Next::Close,
                Ok(n) => {
                    // A short read emptied the socket: the next bytes raise a new edge,
                    // so no read is spent just to hear `WouldBlock` (as tokio does).
                    // An end of stream already reported raises none: read on to it.
                    if n < room && !conn.read_closed {
                        conn.readable = false;
                    }
                    conn.input.received(n)
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    conn.readable = false;
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    tracing::debug!(peer = %Peer::of(&conn.stream), %error, "store connection read failed");
                    return Next::Close;
                }
            };
            if complete {
                self.serve_connection(slot);
                // The socket is read dry and nothing else is owed this turn: what the
                // next pass of the loop would find, decided without it.
                if let Some(Some(conn)) = self.conns.get(slot) {
                    let eager = conn.unsent() >= EAGER_WRITE.min(self.budget.out_high_water);
                    if writes == Writes::Defer
                        && !eager
                        && !conn.readable
                        && !conn.blocked
                        && conn.phase == Phase::Open
                    {
                        return Next::Wait;
                    }
                }
            }
        }
    }

    /// Runs the whole requests a connection has through the engine.
    fn serve_connection(&mut self, slot: usize) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        let owed = conn.unsent();
        let (served, light) = self.serving.serve(ConnInput {
            session: &mut conn.session,
            pending: conn.input.pending(),
            owed,
            out: &mut conn.out,
            peer: &Peer::of(&conn.stream),
        });
        conn.input.served(&served);
        conn.blocked = served.blocked;
        conn.light = light;
        self.deliver();
        if served.close {
            self.leave_engine(slot);
        }
    }

    /// Takes an open connection out of the engine (its waiters go) and makes it flush.
    fn leave_engine(&mut self, slot: usize) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        if conn.phase != Phase::Open {
            return;
        }
        conn.phase = Phase::Flushing;
        let id = conn.id;
        self.serving.leave(id);
        self.deliver();
        self.dirty.push(slot);
    }

    /// Forgets a connection: out of the engine, deregistered, closed.
    fn close(&mut self, slot: usize) {
        self.leave_engine(slot);
        let Some(entry) = self.conns.get_mut(slot) else {
            return;
        };
        if let Some(conn) = entry.take() {
            let _ = self.poll.delete(&conn.stream);
            self.free.push(slot);
            self.live = self.live.saturating_sub(1);
            self.serving
                .stats
                .connections
                .fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn begin_shutdown(&mut self) {
        if let Some(listener) = self.listener.take() {
            let _ = self.poll.delete(&listener);
        }
        self.accept_after = None;
        for slot in 0..self.conns.len() {
            self.leave_engine(slot);
        }
    }

    /// After the loop: every connection still here is dropped.
    fn close_all(&mut self) {
        for slot in 0..self.conns.len() {
            self.close(slot);
        }
        tracing::debug!(loop_index = self.serving.index, "store loop stopped");
    }
}

/// One `recv` on the socket, as a raw system call (rustix): std's, through libc, is a
/// cancellation point that costs as much again in user space as the call itself.
#[inline]
fn receive(stream: &OwnedFd, into: &mut [u8]) -> io::Result<usize> {
    Ok(rustix::net::recv(stream, into, rustix::net::RecvFlags::empty())?.0)
}

/// One `send` (without `SIGPIPE`), as a raw system call, as [`receive`].
#[inline]
fn send(stream: &OwnedFd, bytes: &[u8]) -> io::Result<usize> {
    Ok(rustix::net::send(
        stream,
        bytes,
        rustix::net::SendFlags::NOSIGNAL,
    )?)
}

/// Writes what is owed until done or the socket is full.
#[inline]
fn write_out(conn: &mut Conn) -> io::Result<()> {
    while conn.sent < conn.out.len() {
        match send(&conn.stream, &conn.out[conn.sent..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                let asked = conn.out.len() - conn.sent;
                conn.sent += n;
                if n < asked {
                    // The socket buffer is full; a writable edge comes when it drains.
                    conn.writable = false;
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                conn.writable = false;
                break;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if conn.sent == conn.out.len() {
        if conn.out.capacity() > 1 << 20 {
            // Do not keep a large reply's room for an idle connection.
            conn.out = Vec::new();
        }
        conn.out.clear();
        conn.sent = 0;
    } else if conn.sent > 64 * 1024 && conn.sent * 2 > conn.out.len() {
        conn.out.drain(..conn.sent);
        conn.sent = 0;
    }
    Ok(())
}
