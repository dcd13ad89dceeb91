//! What a store loop does at its listener, once for both loops (`direct` on io_uring,
//! `epoll` on `mio`): a connection the kernel hands over is checked against `--allow`
//! (refused ones counted and logged, rate-limited), then given a slot, an id, a serve
//! step and a read buffer; an accept that failed says when to try again, and out of
//! descriptors (EMFILE, ENFILE) a waiting client is refused at once with the spare
//! descriptor (module `spare_fd`) instead of hanging in the backlog.
//!
//! It deliberately does not decide who may connect (core's `store::access` does), nor
//! when an accept is queued or read (readiness and the ring are the loops'), nor
//! anything about requests.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv_core::store::access::AccessPolicy;
use rdzv_core::store::budget::Budget;
use rdzv_core::store::codec::Limits;
use rdzv_core::store::session::Session;
use rdzv_core::store::ConnId;

use super::session::{ReadBuf, Throttle};
use super::shared_engine::{self, SharedEngine};
use super::spare_fd::{self, SpareFd};

/// After an accept failed for another reason than a refusal could cure, wait this long
/// before the next one (the kernel fails it before it looks at the backlog).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// When to accept again after a failed accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retry {
    /// At once: the failure was transient, or a waiting client was just refused.
    Now,
    /// After a pause.
    After(Duration),
}

/// A connection let in: the loop registers its socket and keeps these.
pub(super) struct Opened {
    pub(super) id: ConnId,
    pub(super) session: Session,
    pub(super) input: ReadBuf,
}

/// One loop's admission: its `--allow`/`--token-file` policy, the engine a connection
/// enters, the limits a new connection's serve step starts with, the spare descriptor
/// and the accept log's throttle.
pub(super) struct Admission {
    index: usize,
    shared: Arc<SharedEngine>,
    limits: Limits,
    budget: Budget,
    access: Option<Arc<AccessPolicy>>,
    spare: SpareFd,
    /// Accept failures and refusals at accept, one line a second.
    warnings: Throttle,
    /// Makes each connection id of this loop new (with its slot and loop).
    seq: u32,
}

impl Admission {
    pub(super) fn new(
        index: usize,
        shared: Arc<SharedEngine>,
        limits: Limits,
        budget: Budget,
        access: Option<Arc<AccessPolicy>>,
    ) -> Admission {
        Admission {
            index,
            shared,
            limits,
            budget,
            access,
            spare: SpareFd::open(),
            warnings: Throttle::default(),
            seq: 0,
        }
    }

    /// An accept on `listener` failed with `error`: refuses one waiting client if the
    /// failure is for lack of descriptors, logs (rate-limited, with how many clients were
    /// refused so far) and says when to accept again.
    pub(super) fn accept_failed(&mut self, error: &io::Error, listener: BorrowedFd<'_>) -> Retry {
        if matches!(
            error.kind(),
            io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
        ) {
            return Retry::Now;
        }
        let refused = SpareFd::exhausted(error)
            && self
                .spare
                .refuse_one(|| spare_fd::accept_and_close(listener));
        if let Some(suppressed) = self.warnings.allow(Instant::now()) {
            tracing::warn!(
                %error,
                suppressed,
                refused = self.spare.refused(),
                loop_index = self.index,
                "accept failed; refusing connections until descriptors free up"
            );
        }
        if refused {
            Retry::Now
        } else {
            // The backlog may still hold connections, and (edge-triggered, or a ring
            // that failed before looking) nothing says so: retry after a pause.
            Retry::After(ACCEPT_BACKOFF)
        }
    }

    /// A socket the kernel handed over: `None` when `--allow` refuses its peer (a peer
    /// already gone has no address and is refused too) or the loop's table is full,
    /// and the caller drops (closes) it. Else its slot in `conns`, with `TCP_NODELAY`
    /// set; the caller registers it, then calls [`Admission::open`] (or gives the slot
    /// back to `free`).
    pub(super) fn admit<C>(
        &mut self,
        socket: BorrowedFd<'_>,
        free: &mut Vec<usize>,
        conns: &mut Vec<Option<C>>,
    ) -> Option<usize> {
        if let Some(policy) = &self.access {
            let peer = peer_addr(socket);
            let admitted = peer.is_some_and(|peer| {
                self.shared
                    .admit(self.index, policy, peer.ip(), &mut self.warnings)
            });
            if !admitted {
                return None;
            }
        }
        let slot = shared_engine::free_slot(free, conns, self.index)?;
        if let Err(error) = socket2::SockRef::from(&socket).set_nodelay(true) {
            tracing::debug!(%error, "TCP_NODELAY failed");
        }
        Some(slot)
    }

    /// Enters the connection in `slot` into the engine: its id, its serve step (held to
    /// the token policy if there is one) and its read buffer (capped by the budget).
    pub(super) fn open(&mut self, slot: usize) -> Opened {
        self.seq = self.seq.wrapping_add(1);
        let id = shared_engine::conn_id(self.index, slot, self.seq);
        self.shared.turn(self.index, |engine, _| engine.connect(id));
        let session = Session::new(id, self.limits, self.budget);
        let session = match &self.access {
            Some(policy) => session.with_access(policy),
            None => session,
        };
        Opened {
            id,
            session,
            input: ReadBuf::new(self.budget.max_conn_bytes),
        }
    }
}

fn peer_addr(socket: BorrowedFd<'_>) -> Option<std::net::SocketAddr> {
    socket2::SockRef::from(&socket)
        .peer_addr()
        .ok()
        .and_then(|addr| addr.as_socket())
}

/// A connection's peer address for log lines, looked up only when a line is written.
pub(super) struct Peer<'a>(BorrowedFd<'a>);

impl<'a> Peer<'a> {
    pub(super) fn of(socket: &'a impl AsFd) -> Peer<'a> {
        Peer(socket.as_fd())
    }
}

impl fmt::Display for Peer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match peer_addr(self.0) {
            Some(addr) => write!(f, "{addr}"),
            None => f.write_str("?"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_transient_failure_retries_at_once_and_another_backs_off() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let stats = Arc::new(super::super::StatsCells::default());
        let shared = Arc::new(SharedEngine::new(Vec::new(), stats, Budget::default()));
        let mut admission = Admission::new(0, shared, Limits::default(), Budget::default(), None);
        let aborted = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(
            admission.accept_failed(&aborted, listener.as_fd()),
            Retry::Now
        );
        let other = io::Error::from_raw_os_error(libc::ENOBUFS);
        assert_eq!(
            admission.accept_failed(&other, listener.as_fd()),
            Retry::After(ACCEPT_BACKOFF)
        );
        // Out of descriptors with nobody waiting: nothing to refuse, so back off.
        let exhausted = io::Error::from_raw_os_error(libc::EMFILE);
        assert_eq!(
            admission.accept_failed(&exhausted, listener.as_fd()),
            Retry::After(ACCEPT_BACKOFF)
        );
        // With a client waiting, it is refused (accepted and closed) at once.
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert_eq!(
            admission.accept_failed(&exhausted, listener.as_fd()),
            Retry::Now
        );
        assert_eq!(admission.spare.refused(), 1);
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut byte = [0u8; 1];
        let read = std::io::Read::read(&mut &client, &mut byte);
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "the refused client sees its connection closed: {read:?}"
        );
    }

    #[test]
    fn the_peer_of_a_connected_socket_is_its_address() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_side, from) = listener.accept().unwrap();
        assert_eq!(Peer::of(&server_side).to_string(), from.to_string());
        assert_eq!(
            Peer::of(&client).to_string(),
            listener.local_addr().unwrap().to_string()
        );
    }
}
