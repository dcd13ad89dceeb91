//! Listening, connecting, and moving messages with the spin-then-sleep wake-up protocol.
//!
//! # Wake-up protocol
//!
//! Each side waits on two eventfds of its own: *data* (its inbox got a record) and
//! *space* (its outbox, the peer's inbox, got room). It signals the peer's two. A waiting
//! side first **spins** for [`ShmOptions::spin`], re-checking the ring with plain atomic
//! loads: a busy pair therefore never makes a syscall per message. Then it **sleeps**:
//!
//! ```text
//! consumer (waits for data)              producer (writes a record)
//!   sleeping.store(1, SeqCst)              copy record; head.store(h, Release)
//!   fence(SeqCst)                          fence(SeqCst)
//!   check head -> data? withdraw, take     if sleeping.load() == 1 && sleeping.swap(0) == 1
//!   poll(data eventfd, control socket)         write(consumer's data eventfd)
//! ```
//!
//! This is Dekker's pattern: each side stores its own word, fences, then loads the
//! other's. With a `SeqCst` fence between the store and the load on both sides, the two
//! loads cannot both miss the other's store, so either the consumer sees the record
//! before sleeping, or the producer sees the flag and signals; a wake-up cannot be lost.
//! The producer clears the flag with `swap` so a sleeping consumer costs one `write`
//! however many records arrive before it runs; a stale signal only makes the consumer
//! re-check the ring once. The same pattern, with `producer_waiting` and `tail`, wakes a
//! producer blocked on a full ring. Dropping a half sets its `*_closed` word and signals
//! unconditionally, so the other side never sleeps through a close.
//!
//! While sleeping, a side polls the control socket too: when the peer process dies the
//! kernel closes it, the poll returns, and the blocked call fails with
//! [`ShmError::PeerGone`] (after returning any message the peer published before dying).
//!
//! # Driving it from an event loop
//!
//! The blocking calls suit one thread per direction ([`ShmConnection::split`]). An
//! io_uring (or epoll) runtime instead calls [`ShmReceiver::try_recv`] (optionally
//! spinning), then [`ShmReceiver::arm_wakeup`]; if that returns `true` it submits a
//! poll (`IORING_OP_POLL_ADD`) on [`ShmReceiver::data_event_fd`] and
//! [`ShmReceiver::control_fd`], and when one fires calls
//! [`ShmReceiver::disarm_wakeup`] and `try_recv` again (a readable control socket means
//! the peer is gone once `try_recv` returns nothing). The sender side mirrors this with
//! [`ShmSender::try_send`], [`ShmSender::arm_space_wakeup`] and
//! [`ShmSender::space_event_fd`].
//!
//! This module does not negotiate transports, frame RPC messages or pass tensors: it
//! moves byte messages between two processes on one host.

use std::fmt;
use std::hint::spin_loop;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{
    accept_with, bind, connect, getsockname, listen, socket_with, AddressFamily, RecvFlags,
    SocketAddrUnix, SocketFlags, SocketType,
};

use super::bootstrap::{self, retry, Hello, ShmAddr};
use super::ring::{next_fragment, Consumer, Producer, TakenInto, RECORD_HEADER};
use super::segment::{valid_capacity, Segment};
use super::viability::HostIdentity;
use super::ShmError;

/// Spin iterations between two reads of the clock.
const SPIN_BATCH: u32 = 64;

/// Settings of one side of a connection.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ShmOptions {
    /// Bytes in our inbox ring (a power of two, 4 KiB to 1 GiB). Default 2 MiB,
    /// TensorPipe's size.
    pub inbox_capacity: usize,
    /// How long a blocked call spins before sleeping on its eventfd. Default 50 µs on
    /// hosts with at least 4 CPUs, else zero; zero sleeps at once (every
    /// message then costs a wake-up syscall when the peer waits).
    pub spin: Duration,
    /// The largest message we accept; the peer refuses to send larger ones. Default
    /// 1 GiB. Messages larger than the ring travel in fragments and are reassembled.
    pub max_message_len: usize,
    /// How long the bootstrap exchange may take. Default 10 s.
    pub handshake_timeout: Duration,
}

/// Below this many CPUs the default is not to spin: in a ping-pong both sides' receivers
/// spin, and with two CPUs the thread they should wake finds none free until a spin ends
/// (`rdzv bench rpc` on a 2-CPU host: shm noop p50 130 µs with 50 µs spins, 39 µs
/// without).
const SPIN_MIN_CPUS: usize = 4;

/// 50 µs with at least [`SPIN_MIN_CPUS`] CPUs, else zero.
fn default_spin() -> Duration {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    if cpus >= SPIN_MIN_CPUS {
        Duration::from_micros(50)
    } else {
        Duration::ZERO
    }
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            inbox_capacity: 2 << 20,
            spin: default_spin(),
            max_message_len: 1 << 30,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

impl ShmOptions {
    fn validate(&self) -> Result<(), ShmError> {
        if !valid_capacity(self.inbox_capacity as u64) {
            return Err(ShmError::InvalidOptions {
                detail: format!(
                    "inbox_capacity {} is not a power of two between 4 KiB and 1 GiB",
                    self.inbox_capacity
                ),
            });
        }
        Ok(())
    }
}

/// Listens for shm connections on a UNIX `SOCK_SEQPACKET` socket.
pub struct ShmListener {
    socket: OwnedFd,
    addr: ShmAddr,
    options: ShmOptions,
    identity: HostIdentity,
}

impl ShmListener {
    /// Listens on `addr`. A path must not exist yet.
    pub fn bind(addr: &ShmAddr, options: ShmOptions) -> Result<ShmListener, ShmError> {
        Self::bind_socket_addr(&addr.to_socket_addr()?, addr.to_string(), options)
    }

    /// Listens on an abstract name the kernel picks (an empty address autobinds, as
    /// TensorPipe's listener does); [`ShmListener::local_addr`] tells which.
    pub fn bind_unnamed(options: ShmOptions) -> Result<ShmListener, ShmError> {
        Self::bind_socket_addr(&SocketAddrUnix::new_unnamed(), "(unnamed)".into(), options)
    }

    fn bind_socket_addr(
        addr: &SocketAddrUnix,
        shown: String,
        options: ShmOptions,
    ) -> Result<ShmListener, ShmError> {
        options.validate()?;
        let identity = HostIdentity::current().map_err(|e| ShmError::NotViable {
            source: Box::new(e),
        })?;
        let socket = new_socket()?;
        let fail = |op, errno: Errno| ShmError::Address {
            op,
            addr: shown.clone(),
            source: errno.into(),
        };
        bind(&socket, addr).map_err(|e| fail("bind", e))?;
        listen(&socket, 128).map_err(|e| fail("listen on", e))?;
        let bound = getsockname(&socket).map_err(|e| fail("getsockname of", e))?;
        let addr = SocketAddrUnix::try_from(bound)
            .ok()
            .and_then(|a| ShmAddr::from_socket_addr(&a))
            .ok_or_else(|| ShmError::Address {
                op: "read back",
                addr: shown.clone(),
                source: std::io::Error::other("not a named UNIX address"),
            })?;
        Ok(ShmListener {
            socket,
            addr,
            options,
            identity,
        })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> &ShmAddr {
        &self.addr
    }

    /// Waits for a peer to connect and runs the bootstrap exchange with it (bounded by
    /// [`ShmOptions::handshake_timeout`]).
    pub fn accept(&self) -> Result<ShmConnection, ShmError> {
        let socket = retry(|| accept_with(&self.socket, SocketFlags::CLOEXEC)).map_err(|e| {
            ShmError::Address {
                op: "accept on",
                addr: self.addr.to_string(),
                source: e.into(),
            }
        })?;
        establish(socket, &self.options, &self.identity)
    }
}

impl AsFd for ShmListener {
    /// The listening socket, readable when a peer is waiting to be accepted.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

impl fmt::Debug for ShmListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmListener")
            .field("addr", &self.addr)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// A bidirectional message connection over two shared-memory rings.
pub struct ShmConnection {
    sender: ShmSender,
    receiver: ShmReceiver,
    peer_pid: Option<u32>,
}

impl ShmConnection {
    /// Connects to a listener at `addr` and runs the bootstrap exchange.
    pub fn connect(addr: &ShmAddr, options: ShmOptions) -> Result<ShmConnection, ShmError> {
        options.validate()?;
        let identity = HostIdentity::current().map_err(|e| ShmError::NotViable {
            source: Box::new(e),
        })?;
        let socket = new_socket()?;
        let socket_addr = addr.to_socket_addr()?;
        retry(|| connect(&socket, &socket_addr)).map_err(|e| ShmError::Address {
            op: "connect to",
            addr: addr.to_string(),
            source: e.into(),
        })?;
        establish(socket, &options, &identity)
    }

    /// Sends one message; see [`ShmSender::send`].
    pub fn send(&mut self, message: &[u8]) -> Result<(), ShmError> {
        self.sender.send(message)
    }

    /// Sends one message if it fits now; see [`ShmSender::try_send`].
    pub fn try_send(&mut self, message: &[u8]) -> Result<bool, ShmError> {
        self.sender.try_send(message)
    }

    /// Receives one message; see [`ShmReceiver::recv`].
    pub fn recv(&mut self) -> Result<Vec<u8>, ShmError> {
        self.receiver.recv()
    }

    /// Receives one message, waiting at most `timeout`; see [`ShmReceiver::recv_timeout`].
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Vec<u8>, ShmError> {
        self.receiver.recv_timeout(timeout)
    }

    /// Receives one message into `buf`; see [`ShmReceiver::recv_into`].
    pub fn recv_into(&mut self, buf: &mut [u8]) -> Result<usize, ShmError> {
        self.receiver.recv_into(buf)
    }

    /// Receives one message if one is complete now; see [`ShmReceiver::try_recv`].
    pub fn try_recv(&mut self) -> Result<Option<Vec<u8>>, ShmError> {
        self.receiver.try_recv()
    }

    /// The peer's process id, as the kernel reported it for the socket (`SO_PEERCRED`).
    pub fn peer_pid(&self) -> Option<u32> {
        self.peer_pid
    }

    /// Splits the connection into halves that can be used from two threads.
    pub fn split(self) -> (ShmSender, ShmReceiver) {
        (self.sender, self.receiver)
    }
}

impl fmt::Debug for ShmConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmConnection")
            .field("peer_pid", &self.peer_pid)
            .field("sender", &self.sender)
            .field("receiver", &self.receiver)
            .finish()
    }
}

/// The sending half: writes into the peer's inbox.
pub struct ShmSender {
    producer: Producer,
    /// The peer's data eventfd, signalled when it sleeps and we published a record.
    peer_data: OwnedFd,
    /// Our space eventfd, waited on while the peer's inbox is full.
    space: OwnedFd,
    control: Arc<OwnedFd>,
    spin: Duration,
    peer_max_message_len: usize,
    broken: Option<ShmError>,
}

impl ShmSender {
    /// Sends one message (0 bytes up to the peer's `max_message_len`). Waits for room
    /// while the peer's inbox is full: spins, then sleeps until the peer frees room or is
    /// gone. Messages larger than the ring are sent in fragments as room appears. Returns
    /// once the message is in the peer's inbox, not once the peer has read it.
    pub fn send(&mut self, message: &[u8]) -> Result<(), ShmError> {
        self.check_sendable(message)?;
        let total = message.len();
        let mut sent = 0;
        loop {
            let n = match self.fragment(total - sent)? {
                Some(n) => n,
                None => {
                    self.wait_for_room(total - sent)?;
                    continue;
                }
            };
            let last = sent + n == total;
            self.push(
                message.get(sent..sent + n).unwrap_or(&[]),
                sent == 0,
                last,
                total,
            )?;
            sent += n;
            if last {
                return Ok(());
            }
        }
    }

    /// Sends one message if it fits the peer's inbox as a whole right now; `Ok(false)`
    /// when it does not (nothing was written). Messages that cannot fit a single record
    /// (more than the ring capacity minus 16 bytes) are refused with
    /// [`ShmError::MessageTooLarge`]; use [`ShmSender::send`] for those.
    pub fn try_send(&mut self, message: &[u8]) -> Result<bool, ShmError> {
        self.check_sendable(message)?;
        let largest = self.producer.capacity() - RECORD_HEADER;
        if message.len() > largest {
            return Err(ShmError::MessageTooLarge {
                len: message.len(),
                max: largest,
            });
        }
        let free = self.free()?;
        if next_fragment(free, message.len(), self.producer.capacity()) != Some(message.len()) {
            return Ok(false);
        }
        self.push(message, true, true, message.len())?;
        Ok(true)
    }

    /// The largest message the peer accepts.
    pub fn max_message_len(&self) -> usize {
        self.peer_max_message_len
    }

    /// Our space eventfd: readable after the peer frees room in its inbox while we have
    /// [`ShmSender::arm_space_wakeup`] armed.
    pub fn space_event_fd(&self) -> BorrowedFd<'_> {
        self.space.as_fd()
    }

    /// The control socket: readable (end-of-file) once the peer process is gone.
    pub fn control_fd(&self) -> BorrowedFd<'_> {
        self.control.as_fd()
    }

    /// For event loops: announces that we wait for room for a `len`-byte message. `true`:
    /// armed, wait for [`ShmSender::space_event_fd`]; `false`: room is there now
    /// (disarmed again). Call [`ShmSender::disarm_space_wakeup`] after waking.
    pub fn arm_space_wakeup(&mut self, len: usize) -> Result<bool, ShmError> {
        self.check()?;
        self.producer.announce_wait();
        if self.fragment(len)?.is_some() || self.producer.consumer_closed() {
            self.producer.withdraw_wait();
            return Ok(false);
        }
        Ok(true)
    }

    /// Withdraws [`ShmSender::arm_space_wakeup`] and drains the space eventfd.
    pub fn disarm_space_wakeup(&mut self) -> Result<(), ShmError> {
        self.producer.withdraw_wait();
        drain(&self.space)
    }

    fn check(&self) -> Result<(), ShmError> {
        match &self.broken {
            Some(error) => Err(error.replay()),
            None => Ok(()),
        }
    }

    fn check_sendable(&self, message: &[u8]) -> Result<(), ShmError> {
        self.check()?;
        if message.len() > self.peer_max_message_len {
            return Err(ShmError::MessageTooLarge {
                len: message.len(),
                max: self.peer_max_message_len,
            });
        }
        if self.producer.consumer_closed() {
            return Err(ShmError::PeerClosed);
        }
        Ok(())
    }

    fn fail(&mut self, error: ShmError) -> ShmError {
        self.broken = Some(error.replay());
        error
    }

    fn free(&mut self) -> Result<usize, ShmError> {
        self.producer.free().map_err(|e| self.fail(e))
    }

    fn fragment(&mut self, remaining: usize) -> Result<Option<usize>, ShmError> {
        let free = self.free()?;
        Ok(next_fragment(free, remaining, self.producer.capacity()))
    }

    fn push(
        &mut self,
        fragment: &[u8],
        first: bool,
        last: bool,
        total: usize,
    ) -> Result<(), ShmError> {
        self.producer
            .push_record(fragment, first, last, total as u64);
        if self.producer.consumer_needs_wake() {
            signal(&self.peer_data)?;
        }
        Ok(())
    }

    /// Blocks until a fragment of the `remaining` bytes can be written.
    fn wait_for_room(&mut self, remaining: usize) -> Result<(), ShmError> {
        if !self.spin.is_zero() {
            // No end (spin until something happens) if the spin time overflows.
            let until = Instant::now().checked_add(self.spin);
            loop {
                for _ in 0..SPIN_BATCH {
                    spin_loop();
                }
                if self.fragment(remaining)?.is_some() {
                    return Ok(());
                }
                if self.producer.consumer_closed()
                    || until.is_some_and(|until| Instant::now() >= until)
                {
                    break;
                }
            }
        }
        loop {
            self.producer.announce_wait();
            let room = self.fragment(remaining);
            if !matches!(room, Ok(None)) || self.producer.consumer_closed() {
                self.producer.withdraw_wait();
                return match room {
                    Ok(Some(_)) => Ok(()),
                    Err(e) => Err(e),
                    Ok(None) => Err(ShmError::PeerClosed),
                };
            }
            let woken = wait(&self.space, &self.control, None);
            self.producer.withdraw_wait();
            match woken {
                Ok(Woken::Event | Woken::TimedOut) => {
                    if self.fragment(remaining)?.is_some() {
                        return Ok(());
                    }
                }
                Ok(Woken::ControlClosed) => {
                    let error = if self.producer.consumer_closed() {
                        ShmError::PeerClosed
                    } else {
                        ShmError::PeerGone
                    };
                    return Err(self.fail(error));
                }
                Err(e) => return Err(self.fail(e)),
            }
        }
    }
}

impl Drop for ShmSender {
    fn drop(&mut self) {
        self.producer.close();
        // Best effort: the peer may be gone already.
        let _ = signal(&self.peer_data);
    }
}

impl fmt::Debug for ShmSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmSender")
            .field("capacity", &self.producer.capacity())
            .field("peer_max_message_len", &self.peer_max_message_len)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

/// The receiving half: reads our inbox.
pub struct ShmReceiver {
    consumer: Consumer,
    /// Our data eventfd, waited on while the inbox is empty.
    data: OwnedFd,
    /// The peer's space eventfd, signalled when it waits for room and we freed some.
    peer_space: OwnedFd,
    control: Arc<OwnedFd>,
    spin: Duration,
    /// A reassembled message that did not fit the buffer given to `recv_into`.
    stash: Option<Vec<u8>>,
    broken: Option<ShmError>,
}

/// What a blocking receive produced from one look at the ring.
type Take<T> = Result<Option<T>, ShmError>;

impl ShmReceiver {
    /// Receives the next message, blocking until one is complete: spins, then sleeps
    /// on the data eventfd and the control socket. Fails with [`ShmError::PeerClosed`]
    /// once the peer dropped its sender and every message it sent was received, and with
    /// [`ShmError::PeerGone`] once its process died (likewise after the published ones).
    pub fn recv(&mut self) -> Result<Vec<u8>, ShmError> {
        if let Some(message) = self.stash.take() {
            return Ok(message);
        }
        self.receive(None, &mut |c| c.take_message())
    }

    /// Like [`ShmReceiver::recv`], failing with [`ShmError::Timeout`] after `timeout`.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Vec<u8>, ShmError> {
        if let Some(message) = self.stash.take() {
            return Ok(message);
        }
        let deadline = Instant::now().checked_add(timeout);
        match self.receive(deadline, &mut |c| c.take_message()) {
            Err(ShmError::Timeout { .. }) => Err(ShmError::Timeout {
                ms: timeout.as_millis(),
            }),
            other => other,
        }
    }

    /// Receives the next message into `buf` and returns its length. A message longer than
    /// `buf` is kept for the next receive and reported as [`ShmError::BufferTooSmall`]
    /// with the length needed. A message that fits one record is copied straight from the
    /// ring, with no allocation.
    pub fn recv_into(&mut self, buf: &mut [u8]) -> Result<usize, ShmError> {
        let available = buf.len();
        if let Some(message) = self.stash.take() {
            return match buf.get_mut(..message.len()) {
                Some(out) => {
                    out.copy_from_slice(&message);
                    Ok(message.len())
                }
                None => {
                    let needed = message.len();
                    self.stash = Some(message);
                    Err(ShmError::BufferTooSmall { needed, available })
                }
            };
        }
        match self.receive(None, &mut |c| c.take_message_into(buf))? {
            TakenInto::Copied(n) => Ok(n),
            TakenInto::TooSmall { needed, kept } => {
                self.stash = kept;
                Err(ShmError::BufferTooSmall { needed, available })
            }
        }
    }

    /// Receives the next message if it is complete now, without blocking or syscalls
    /// (beyond signalling a waiting peer). `Ok(None)` when there is none yet;
    /// [`ShmError::PeerClosed`] when there is none and the peer dropped its sender.
    pub fn try_recv(&mut self) -> Result<Option<Vec<u8>>, ShmError> {
        if let Some(message) = self.stash.take() {
            return Ok(Some(message));
        }
        let take = &mut |c: &mut Consumer| c.take_message();
        if let Some(message) = self.attempt(take)? {
            return Ok(Some(message));
        }
        if self.consumer.producer_closed() {
            return self.finish(take, ShmError::PeerClosed).map(Some);
        }
        Ok(None)
    }

    /// Our data eventfd: readable after the peer published a record while we have
    /// [`ShmReceiver::arm_wakeup`] armed. Pollable by io_uring or epoll.
    pub fn data_event_fd(&self) -> BorrowedFd<'_> {
        self.data.as_fd()
    }

    /// The control socket: readable (end-of-file) once the peer process is gone.
    pub fn control_fd(&self) -> BorrowedFd<'_> {
        self.control.as_fd()
    }

    /// For event loops: announces that we are about to wait for data. `true`: armed,
    /// nothing is there, wait for [`ShmReceiver::data_event_fd`] (or the control socket);
    /// `false`: data (or a close) is there now, call [`ShmReceiver::try_recv`] (disarmed
    /// again). Call [`ShmReceiver::disarm_wakeup`] after waking.
    pub fn arm_wakeup(&mut self) -> Result<bool, ShmError> {
        self.check()?;
        if self.stash.is_some() {
            return Ok(false);
        }
        self.consumer.announce_sleep();
        if self.consumer.has_data() || self.consumer.producer_closed() {
            self.consumer.withdraw_sleep();
            return Ok(false);
        }
        Ok(true)
    }

    /// Withdraws [`ShmReceiver::arm_wakeup`] without draining the data eventfd (no
    /// system call): for a second reader that takes over from one asleep on the eventfd
    /// and polls the ring itself meanwhile.
    pub fn withdraw_wakeup(&mut self) {
        self.consumer.withdraw_sleep();
    }

    /// Withdraws [`ShmReceiver::arm_wakeup`] and drains the data eventfd.
    pub fn disarm_wakeup(&mut self) -> Result<(), ShmError> {
        self.consumer.withdraw_sleep();
        drain(&self.data)
    }

    fn check(&self) -> Result<(), ShmError> {
        match &self.broken {
            Some(error) => Err(error.replay()),
            None => Ok(()),
        }
    }

    fn fail(&mut self, error: ShmError) -> ShmError {
        self.broken = Some(error.replay());
        error
    }

    /// One look at the ring; signals the producer if it waits for room we freed.
    fn attempt<T>(&mut self, take: &mut dyn FnMut(&mut Consumer) -> Take<T>) -> Take<T> {
        self.check()?;
        let taken = take(&mut self.consumer).map_err(|e| self.fail(e));
        if self.consumer.take_producer_wake() {
            signal(&self.peer_space)?;
        }
        taken
    }

    /// After the peer closed or died: returns what it published before, or `error`.
    fn finish<T>(
        &mut self,
        take: &mut dyn FnMut(&mut Consumer) -> Take<T>,
        error: ShmError,
    ) -> Result<T, ShmError> {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        match self.attempt(take)? {
            Some(value) => Ok(value),
            None => Err(self.fail(error)),
        }
    }

    /// Spins, then sleeps, until `take` yields, the peer is gone, or `deadline` passes.
    fn receive<T>(
        &mut self,
        deadline: Option<Instant>,
        take: &mut dyn FnMut(&mut Consumer) -> Take<T>,
    ) -> Result<T, ShmError> {
        if let Some(value) = self.attempt(take)? {
            return Ok(value);
        }
        if !self.spin.is_zero() {
            // No end (spin until something happens) if the spin time overflows.
            let until = Instant::now().checked_add(self.spin);
            'spin: loop {
                for _ in 0..SPIN_BATCH {
                    if self.consumer.has_data() {
                        if let Some(value) = self.attempt(take)? {
                            return Ok(value);
                        }
                        continue 'spin;
                    }
                    spin_loop();
                }
                let now = Instant::now();
                if self.consumer.producer_closed()
                    || until.is_some_and(|until| now >= until)
                    || deadline.is_some_and(|d| now >= d)
                {
                    break;
                }
            }
        }
        loop {
            self.consumer.announce_sleep();
            let taken = self.attempt(take);
            if !matches!(taken, Ok(None)) {
                self.consumer.withdraw_sleep();
                return taken.and_then(|v| v.ok_or(ShmError::PeerClosed));
            }
            if self.consumer.producer_closed() {
                self.consumer.withdraw_sleep();
                return self.finish(take, ShmError::PeerClosed);
            }
            let woken = wait(&self.data, &self.control, deadline);
            self.consumer.withdraw_sleep();
            match woken {
                Ok(Woken::Event) => {
                    if let Some(value) = self.attempt(take)? {
                        return Ok(value);
                    }
                }
                Ok(Woken::ControlClosed) => {
                    let error = if self.consumer.producer_closed() {
                        ShmError::PeerClosed
                    } else {
                        ShmError::PeerGone
                    };
                    return self.finish(take, error);
                }
                Ok(Woken::TimedOut) => {
                    return match self.attempt(take)? {
                        Some(value) => Ok(value),
                        None => Err(ShmError::Timeout { ms: 0 }),
                    };
                }
                Err(e) => return Err(self.fail(e)),
            }
        }
    }
}

impl Drop for ShmReceiver {
    fn drop(&mut self) {
        self.consumer.close();
        // Best effort: the peer may be gone already.
        let _ = signal(&self.peer_space);
    }
}

impl fmt::Debug for ShmReceiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmReceiver")
            .field("spin", &self.spin)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

fn new_socket() -> Result<OwnedFd, ShmError> {
    socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(ShmError::syscall("socket(AF_UNIX, SOCK_SEQPACKET)"))
}

fn new_eventfd() -> Result<OwnedFd, ShmError> {
    eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).map_err(ShmError::syscall("eventfd"))
}

/// Runs the bootstrap exchange on a connected socket (same steps on both sides).
fn establish(
    socket: OwnedFd,
    options: &ShmOptions,
    identity: &HostIdentity,
) -> Result<ShmConnection, ShmError> {
    bootstrap::set_timeouts(&socket, options.handshake_timeout)?;
    let (inbox, inbox_fd) = Segment::create(options.inbox_capacity)?;
    let data = new_eventfd()?;
    let space = new_eventfd()?;
    let hello = Hello {
        capacity: options.inbox_capacity as u64,
        max_message_len: options.max_message_len as u64,
        identity: identity.clone(),
    };
    bootstrap::send_hello(
        &socket,
        &hello,
        [inbox_fd.as_fd(), data.as_fd(), space.as_fd()],
    )?;
    let (peer, [peer_inbox, peer_data, peer_space]) = bootstrap::recv_hello(&socket)?;
    let checked = check_peer(identity, &peer, &peer_inbox, &peer_data, &peer_space);
    let producer = match checked {
        Ok(producer) => producer,
        Err(error) => {
            // Best effort: the peer learns why before the socket closes.
            let _ = bootstrap::send_verdict(&socket, Err(&error.to_string()));
            return Err(error);
        }
    };
    bootstrap::send_verdict(&socket, Ok(()))?;
    bootstrap::recv_verdict(&socket)?;
    let peer_pid = rustix::net::sockopt::socket_peercred(&socket)
        .ok()
        .and_then(|cred| u32::try_from(cred.pid.as_raw_pid()).ok());
    let control = Arc::new(socket);
    let sender = ShmSender {
        producer,
        peer_data,
        space,
        control: Arc::clone(&control),
        spin: options.spin,
        peer_max_message_len: usize::try_from(peer.max_message_len).unwrap_or(usize::MAX),
        broken: None,
    };
    let receiver = ShmReceiver {
        consumer: Consumer::new(inbox, options.max_message_len),
        data,
        peer_space,
        control,
        spin: options.spin,
        stash: None,
        broken: None,
    };
    Ok(ShmConnection {
        sender,
        receiver,
        peer_pid,
    })
}

/// Checks the peer's hello and fds and maps its inbox as our outbox.
fn check_peer(
    ours: &HostIdentity,
    peer: &Hello,
    inbox: &OwnedFd,
    data: &OwnedFd,
    space: &OwnedFd,
) -> Result<Producer, ShmError> {
    if &peer.identity != ours {
        return Err(ShmError::NotSameHost {
            ours: ours.descriptor().to_string(),
            theirs: peer.identity.descriptor().to_string(),
        });
    }
    for (fd, what) in [(data, "data"), (space, "space")] {
        if !is_eventfd(fd) {
            return Err(ShmError::Handshake {
                detail: format!("peer's {what} fd is not an eventfd"),
            });
        }
    }
    Producer::new(Segment::open(inbox, peer.capacity)?)
}

/// Whether `fd` is an eventfd (`/proc/self/fd/N` links to `anon_inode:[eventfd]`).
fn is_eventfd(fd: &OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|target| target.as_os_str() == "anon_inode:[eventfd]")
}

/// Adds one to an eventfd. A full counter already means a wake-up is pending.
fn signal(fd: &OwnedFd) -> Result<(), ShmError> {
    match retry(|| rustix::io::write(fd, &1u64.to_ne_bytes())) {
        Ok(_) | Err(Errno::AGAIN) => Ok(()),
        Err(errno) => Err(ShmError::syscall("write(eventfd)")(errno)),
    }
}

/// Resets an eventfd's counter.
fn drain(fd: &OwnedFd) -> Result<(), ShmError> {
    let mut counter = [0u8; 8];
    match retry(|| rustix::io::read(fd, &mut counter)) {
        Ok(_) | Err(Errno::AGAIN) => Ok(()),
        Err(errno) => Err(ShmError::syscall("read(eventfd)")(errno)),
    }
}

/// Why a sleep ended.
enum Woken {
    /// The eventfd was signalled (and has been drained).
    Event,
    /// The control socket reached end-of-file: the peer process closed it or died.
    ControlClosed,
    /// The deadline passed.
    TimedOut,
}

/// Sleeps until `event` is signalled, the control socket closes, or `deadline` passes.
fn wait(event: &OwnedFd, control: &OwnedFd, deadline: Option<Instant>) -> Result<Woken, ShmError> {
    loop {
        let timeout = match deadline {
            None => None,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(Woken::TimedOut);
                }
                Some(Timespec::try_from(left).unwrap_or(Timespec {
                    tv_sec: i64::MAX,
                    tv_nsec: 0,
                }))
            }
        };
        let mut fds = [
            PollFd::new(event, PollFlags::IN),
            PollFd::new(control, PollFlags::IN | PollFlags::RDHUP),
        ];
        match poll(&mut fds, timeout.as_ref()) {
            Ok(_) => {}
            Err(Errno::INTR) => continue,
            Err(errno) => return Err(ShmError::syscall("poll(eventfd, control socket)")(errno)),
        }
        let [event_poll, control_poll] = &fds;
        if !event_poll.revents().is_empty() {
            drain(event)?;
            return Ok(Woken::Event);
        }
        let control_events = control_poll.revents();
        if !control_events.is_empty() {
            let mut byte = [0u8; 1];
            match rustix::net::recv(control, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT) {
                Ok((0, _)) => return Ok(Woken::ControlClosed),
                Ok(_) => {
                    return Err(ShmError::Corrupted {
                        detail: "peer sent data on the control socket after the handshake".into(),
                    })
                }
                Err(Errno::AGAIN | Errno::INTR)
                    if !control_events
                        .intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR) => {}
                Err(_) => return Ok(Woken::ControlClosed),
            }
        }
    }
}
