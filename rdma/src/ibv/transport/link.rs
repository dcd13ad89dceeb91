//! The thread that owns one connection's [`IbvConnection`] and moves frames between it and
//! the agent's executor.
//!
//! The connection is blocking and not split into halves, so one thread drives both
//! directions with the connection's non-blocking calls: it posts the parts of queued frames
//! while the peer's ring has credit, takes arrived messages while the agent's receive
//! queue has room, and otherwise sleeps in [`IbvConnection::wait`] on the completion
//! connection, a wake-up socket (the agent queued a frame, read one, or dropped a half) and
//! the TCP bootstrap connection. A large write therefore never stops reads.
//!
//! Ending, per direction: closing (or dropping) the sending half queues [`FIN`] after
//! the last frame; once every send has completed and the peer has read every zero-copy
//! buffer, the thread writes one byte (`F`) on the bootstrap connection. A peer's `F`
//! followed by the end of the bootstrap connection is a graceful end (its `FIN` is in
//! the connection); the end of the bootstrap connection without `F` means the peer's process
//! is gone, and the link fails at once instead of waiting for the RDMA retry timers. A
//! failed work completion fails the link with the verb and its status
//! (`IBV_WC_RETRY_EXC_ERR`, ...).
//!
//! Receiving allocates only what the frames allow: before each message the thread asks
//! its [`ReceiveGate`] how large the next one may be ([`IbvConnection::try_recv_within`]):
//! a frame's first message is bounded by the frame limits alone, and a zero-copy part is
//! allocated only once the first message's header, checked against the limits, announced
//! exactly that length. A peer that claims more fails the link, with the claim and the
//! limit, before anything is allocated for it.
//!
//! Ownership: a frame's buffers move into the connection (`Arc`), which keeps them, and
//! their registrations, until the peer acknowledged reading them, whatever happens to the
//! agent's futures; the queue pair is destroyed (when the thread drops the connection)
//! before any of them is freed.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use std::time::{Duration, Instant};

use rdzv_core::rpc::frame::{EncodeError, FrameLimits};
use rdzv_uring::queue::Queue;
use rdzv_uring::rpc::transport::OwnedFrame;
use rdzv_uring::rpc::TransportError;

use super::framing::{split_frame, ReceiveGate, FIN};
use crate::error_chain::ErrorChain;
use crate::ibv::connection::{ConnectionError, IbvConnection};

/// Why a link failed: one variant per way, each with the connection's error where there is
/// one (shared: the failure goes to both halves).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// Moving the queue pair to the error state (on request) failed.
    #[error("{}", ErrorChain(.0.as_ref()))]
    Abort(#[source] Arc<ConnectionError>),
    /// Waiting for completions or wake-ups failed.
    #[error("{}", ErrorChain(.0.as_ref()))]
    Wait(#[source] Arc<ConnectionError>),
    /// A frame could not be split into messages.
    #[error("{}", ErrorChain(.0.as_ref()))]
    Split(#[source] Arc<EncodeError>),
    /// Posting a message failed.
    #[error("{}", ErrorChain(.0.as_ref()))]
    Send(#[source] Arc<ConnectionError>),
    /// Taking an arrived message failed; `expecting` is what the frame allowed next,
    /// for a descriptor the peer should not have sent.
    #[error("{}{}", .expecting.as_deref().map(|e| format!("receiving {e}: ")).unwrap_or_default(), ErrorChain(.source.as_ref()))]
    Receive {
        /// What the frame allowed next, for a bad descriptor.
        expecting: Option<String>,
        /// The connection's error.
        #[source]
        source: Arc<ConnectionError>,
    },
    /// A message broke the frame limits.
    #[error("{0}")]
    Refused(#[source] Arc<TransportError>),
    /// The bootstrap connection ended without the peer's `F`.
    #[error("the peer dropped the RDMA connection without ending it (its process is gone?)")]
    PeerGone,
    /// The peer ended, but its `FIN` did not arrive within [`FIN_GRACE`].
    #[error("the peer ended the RDMA connection but its last message did not arrive within {FIN_GRACE:?}")]
    LastMessageLate,
    /// The peer ended before this side ended its stream.
    #[error("the peer closed the RDMA connection before this side ended its stream")]
    ClosedEarly,
    /// The peer did not read the last zero-copy buffers within [`LINGER`].
    #[error(
        "the peer did not read this side's last {in_flight} zero-copy messages within {LINGER:?}"
    )]
    Linger {
        /// Zero-copy messages still unread.
        in_flight: usize,
    },
}

/// Messages waiting for the agent before the thread stops taking more from the connection
/// (the peer then waits for ring credit).
pub const INCOMING_BOUND: usize = 64;
/// How long a peer that announced its end (`F`) may take for its `FIN` to arrive.
pub const FIN_GRACE: Duration = Duration::from_secs(5);
/// How long, after this side's `FIN`, the peer may take to read the last zero-copy
/// buffers before the link gives up on it.
pub const LINGER: Duration = Duration::from_secs(30);

/// How often an idle link reports its state (at trace level).
const IDLE_REPORT: Duration = Duration::from_secs(10);

/// The byte that tells the peer, over the bootstrap connection, that this side's `FIN`
/// was delivered.
const FINISHED: u8 = b'F';

/// What the agent's halves and the link's thread share.
pub struct Link {
    /// Frames to send, from the sending half.
    pub outgoing: Queue<OwnedFrame>,
    /// Messages received (or the link's failure), for the receiving half.
    pub incoming: Queue<Result<Vec<u8>, LinkError>>,
    /// How the sending direction ended: `Ok` once the `FIN` was delivered.
    pub sent: Queue<Result<(), LinkError>>,
    /// Set when the receiving half is dropped: arriving messages are then discarded.
    receiver_gone: AtomicBool,
    /// Set by the thread when it stopped taking messages because `incoming` was full.
    stalled: AtomicBool,
    /// Set to have the thread move the queue pair to the error state.
    abort_requested: AtomicBool,
    /// Why the link failed, once it did.
    failure: Mutex<Option<LinkError>>,
    /// Written to wake the thread; the thread's end is `wake_rx`.
    wake_tx: UnixStream,
    wake_rx: UnixStream,
}

impl Link {
    fn new() -> io::Result<Link> {
        let (wake_tx, wake_rx) = UnixStream::pair()?;
        wake_tx.set_nonblocking(true)?;
        wake_rx.set_nonblocking(true)?;
        Ok(Link {
            outgoing: Queue::unbounded(),
            incoming: Queue::unbounded(),
            sent: Queue::unbounded(),
            receiver_gone: AtomicBool::new(false),
            stalled: AtomicBool::new(false),
            abort_requested: AtomicBool::new(false),
            failure: Mutex::new(None),
            wake_tx,
            wake_rx,
        })
    }

    /// Ends the sending direction: the thread sends what is queued, then the end of
    /// the stream.
    pub fn finish_sending(&self) {
        self.outgoing.close();
        self.wake();
    }

    /// Wakes the thread (it then looks at every queue).
    pub fn wake(&self) {
        // A full socket buffer means a wake-up is pending already.
        let _ = (&self.wake_tx).write(&[1]);
    }

    fn drain_wakeups(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.wake_rx).read(&mut buf), Ok(n) if n > 0) {}
    }

    /// Called by the receiving half after it took a message: wakes the thread if it
    /// stopped taking messages because the queue was full.
    pub fn took_message(&self) {
        if self.stalled.swap(false, Ordering::SeqCst) {
            self.wake();
        }
    }

    /// Whether `incoming` is full; if so, marks the thread as stalled (checking again
    /// after marking, so that a message taken meanwhile is never missed).
    fn incoming_full(&self) -> bool {
        if self.incoming.len() < INCOMING_BOUND {
            return false;
        }
        self.stalled.store(true, Ordering::SeqCst);
        if self.incoming.len() < INCOMING_BOUND {
            self.stalled.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Has the thread move the queue pair to the error state
    /// ([`IbvConnection::abort`]), as a failing device or link would: the work requests
    /// posted then complete with `IBV_WC_WR_FLUSH_ERR`, and the link fails with that
    /// status. For tests of the error path.
    pub fn abort_queue_pair(&self) {
        self.abort_requested.store(true, Ordering::SeqCst);
        self.wake();
    }

    /// Marks the receiving half as gone.
    pub fn drop_receiver(&self) {
        self.receiver_gone.store(true, Ordering::Release);
        self.wake();
    }

    fn receiver_gone(&self) -> bool {
        self.receiver_gone.load(Ordering::Acquire)
    }

    /// Why the link failed, if it did.
    pub fn failure(&self) -> Option<LinkError> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn fail(&self, reason: LinkError) {
        *self.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.clone());
        let _ = self.incoming.push(Err(reason.clone()));
        let _ = self.sent.push(Err(reason));
        self.close_all();
    }

    fn close_all(&self) {
        self.outgoing.close();
        self.incoming.close();
        self.sent.close();
    }
}

/// Starts the thread that drives `connection`, with `bootstrap` (the TCP connection the
/// connection was set up over) kept open to see the peer go. `limits` bound what the
/// thread receives before the receivers check it (see [`ReceiveGate`]): at least as
/// wide as any the receivers use.
///
/// # Errors
/// Creating the wake-up socket, making `bootstrap` non-blocking, or spawning the thread
/// failed.
pub fn start(
    connection: IbvConnection,
    bootstrap: TcpStream,
    peer: &str,
    limits: FrameLimits,
) -> io::Result<Arc<Link>> {
    bootstrap.set_read_timeout(None)?;
    bootstrap.set_write_timeout(None)?;
    bootstrap.set_nonblocking(true)?;
    let link = Arc::new(Link::new()?);
    let mut driver = Driver {
        connection,
        bootstrap,
        link: Arc::clone(&link),
        parts: VecDeque::new(),
        gate: ReceiveGate::new(limits, peer),
        fin_posted: None,
        sent_done: false,
        fin_received: false,
        peer_finished: false,
        bootstrap_ended: None,
    };
    let shown = peer.to_string();
    std::thread::Builder::new()
        .name("rdzv-ibv-link".into())
        .spawn(move || {
            let outcome = driver.run();
            match outcome {
                Ok(()) => driver.link.close_all(),
                Err(reason) => {
                    tracing::debug!(peer = %shown, %reason, "an ibv link failed");
                    driver.link.fail(reason);
                }
            }
            // The queue pair goes (with the connection) before the bootstrap connection
            // closes, so the peer sees the end only once nothing is posted here.
            let Driver {
                connection,
                bootstrap,
                ..
            } = driver;
            drop(connection);
            drop(bootstrap);
        })?;
    Ok(link)
}

struct Driver {
    connection: IbvConnection,
    bootstrap: TcpStream,
    link: Arc<Link>,
    /// The rest of the frame being sent.
    parts: VecDeque<Arc<Vec<u8>>>,
    /// How large the next message received may be.
    gate: ReceiveGate,
    /// When this side's `FIN` was posted.
    fin_posted: Option<Instant>,
    /// Whether the `FIN` was delivered and `F` written.
    sent_done: bool,
    fin_received: bool,
    /// Whether the peer wrote `F`.
    peer_finished: bool,
    /// When the bootstrap connection ended.
    bootstrap_ended: Option<Instant>,
}

impl Driver {
    fn run(&mut self) -> Result<(), LinkError> {
        loop {
            // Wake-ups are drained before the queues are read: one that comes later
            // keeps the socket readable, so `wait` returns at once.
            self.link.drain_wakeups();
            if self.link.abort_requested.swap(false, Ordering::SeqCst) {
                self.connection
                    .abort()
                    .map_err(|e| LinkError::Abort(Arc::new(e)))?;
            }
            // Receiving first: it takes the completions (credit acks among them), and
            // sending takes none, so nothing that arrives before `wait` is missed.
            let mut busy = self.receive_some()?;
            busy |= self.send_some()?;
            self.read_bootstrap();
            self.note_sent_done();
            if let Some(ended) = self.bootstrap_ended {
                // The peer's thread is gone: decide now, or within the grace period for
                // messages and completions that raced the end of the bootstrap connection.
                let late = ended.elapsed() >= FIN_GRACE;
                if !self.fin_received {
                    if !self.peer_finished {
                        return Err(LinkError::PeerGone);
                    }
                    if late {
                        return Err(LinkError::LastMessageLate);
                    }
                } else if self.sent_done {
                    return Ok(());
                } else if !self.link.outgoing.is_closed() || late {
                    return Err(LinkError::ClosedEarly);
                }
            }
            if self.sent_done && (self.fin_received || self.link.receiver_gone()) {
                return Ok(());
            }
            if let Some(posted) = self.fin_posted {
                if !self.sent_done && posted.elapsed() >= LINGER {
                    return Err(LinkError::Linger {
                        in_flight: self.connection.large_in_flight(),
                    });
                }
            }
            if busy {
                continue;
            }
            let timeout = match (self.bootstrap_ended, self.fin_posted) {
                (Some(ended), _) => Some(FIN_GRACE.saturating_sub(ended.elapsed())),
                (None, Some(posted)) if !self.sent_done => {
                    Some(LINGER.saturating_sub(posted.elapsed()))
                }
                _ => None,
            };
            let wake = self.link.wake_rx.as_fd();
            let since = Instant::now();
            // An idle link wakes now and then to say what it waits for.
            let timeout = timeout.unwrap_or(IDLE_REPORT);
            let waited = if self.bootstrap_ended.is_some() {
                self.connection.wait(&[wake], Some(timeout))
            } else {
                self.connection
                    .wait(&[wake, self.bootstrap.as_fd()], Some(timeout))
            };
            waited.map_err(|e| LinkError::Wait(Arc::new(e)))?;
            if since.elapsed() >= IDLE_REPORT {
                tracing::trace!(
                    parts = self.parts.len(),
                    outgoing = self.link.outgoing.len(),
                    incoming = self.link.incoming.len(),
                    fin_posted = self.fin_posted.is_some(),
                    sent_done = self.sent_done,
                    fin_received = self.fin_received,
                    connection = ?self.connection,
                    "an ibv link is idle"
                );
            }
        }
    }

    /// Posts what the peer's ring has credit for; `true` if anything was posted.
    fn send_some(&mut self) -> Result<bool, LinkError> {
        let mut busy = false;
        loop {
            if self.parts.is_empty() {
                // Read before popping: a frame queued before the close is then seen.
                let closed = self.link.outgoing.is_closed();
                match self.link.outgoing.try_pop() {
                    Some(frame) => {
                        let messages =
                            split_frame(frame).map_err(|e| LinkError::Split(Arc::new(e)))?;
                        self.parts = messages.into_iter().map(Arc::new).collect();
                        continue;
                    }
                    None if closed && self.fin_posted.is_none() => {
                        match self
                            .connection
                            .try_send_owned(Arc::new(FIN.to_vec()))
                            .map_err(|e| LinkError::Send(Arc::new(e)))?
                        {
                            Ok(()) => {
                                self.fin_posted = Some(Instant::now());
                                busy = true;
                            }
                            Err(_) => return Ok(busy),
                        }
                    }
                    None => {}
                }
                break;
            }
            let Some(part) = self.parts.pop_front() else {
                break;
            };
            match self
                .connection
                .try_send_owned(part)
                .map_err(|e| LinkError::Send(Arc::new(e)))?
            {
                Ok(()) => busy = true,
                Err(part) => {
                    self.parts.push_front(part);
                    return Ok(busy);
                }
            }
        }
        self.note_sent_done();
        Ok(busy)
    }

    /// Once the `FIN` is posted and every send completed (the peer read every zero-copy
    /// buffer), reports the sending direction's end, here and to the peer.
    fn note_sent_done(&mut self) {
        if self.fin_posted.is_some()
            && !self.sent_done
            && self.connection.sends_in_flight() == 0
            && self.connection.large_in_flight() == 0
        {
            self.sent_done = true;
            // Best effort: without it the peer fails its pipe instead of ending it.
            if let Err(e) = (&self.bootstrap).write(&[FINISHED]) {
                tracing::debug!(error = %e, "telling an ibv peer the stream ended failed");
            }
            let _ = self.link.sent.push(Ok(()));
            self.link.sent.close();
        }
    }

    /// Takes arrived messages while the agent has room for them; `true` if any came.
    fn receive_some(&mut self) -> Result<bool, LinkError> {
        let mut busy = false;
        while !self.fin_received {
            let gone = self.link.receiver_gone();
            if !gone && self.link.incoming_full() {
                break;
            }
            let received = self
                .connection
                .try_recv_within(self.gate.next_limit())
                .map_err(|e| LinkError::Receive {
                    expecting: matches!(e, ConnectionError::BadDescriptor { .. })
                        .then(|| self.gate.expecting()),
                    source: Arc::new(e),
                })?;
            match received {
                None => break,
                Some(message) if message.is_empty() => {
                    self.fin_received = true;
                    self.link.incoming.close();
                    busy = true;
                }
                Some(message) => {
                    busy = true;
                    let checked = self.gate.observe(&message);
                    if !gone {
                        // Refused only after a failure, which ends the thread anyway. A
                        // message the gate refused goes too: the receiver reports its own
                        // error for it, and then the link's failure.
                        let _ = self.link.incoming.push(Ok(message));
                    }
                    // Nothing bounds the messages after one the gate refused.
                    checked.map_err(|e| LinkError::Refused(Arc::new(e)))?;
                }
            }
        }
        Ok(busy)
    }

    /// Notes the peer's `F` and the end of the bootstrap connection.
    fn read_bootstrap(&mut self) {
        if self.bootstrap_ended.is_some() {
            return;
        }
        let mut buf = [0u8; 16];
        loop {
            match (&self.bootstrap).read(&mut buf) {
                Ok(0) => {
                    self.bootstrap_ended = Some(Instant::now());
                    return;
                }
                Ok(n) => {
                    if buf.get(..n).is_some_and(|b| b.contains(&FINISHED)) {
                        self.peer_finished = true;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::debug!(error = %e, "an ibv bootstrap connection failed");
                    self.bootstrap_ended = Some(Instant::now());
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wakeups_are_drained() {
        let link = Link::new().unwrap_or_else(|e| panic!("{e}"));
        for _ in 0..10_000 {
            link.wake();
        }
        link.drain_wakeups();
        let mut buf = [0u8; 1];
        assert!(matches!(
            (&link.wake_rx).read(&mut buf),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock
        ));
        link.fail(LinkError::PeerGone);
        assert!(matches!(link.failure(), Some(LinkError::PeerGone)));
        assert!(matches!(
            link.incoming.try_pop(),
            Some(Err(LinkError::PeerGone))
        ));
        assert_eq!(
            LinkError::PeerGone.to_string(),
            "the peer dropped the RDMA connection without ending it (its process is gone?)"
        );
        assert!(link.outgoing.is_closed());
    }
}
