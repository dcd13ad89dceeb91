//! `mpt`: one tensor split over several TCP connections, TensorPipe's
//! `mpt_uv` channel, so that one large transfer is not limited to what one connection and
//! one core can push.
//!
//! A transfer of `len` bytes is cut into contiguous stripes, one per connection used
//! ([`stripes`]: equal shares, the first connections take the remainder), each of at least
//! [`MptOptions::min_stripe_len`] bytes: a 1 MiB tensor goes whole over connection 0, since
//! starting the other connections costs more than they save. Each used connection carries a
//! 32-byte stripe header (magic, transfer id, offset, length) and then the stripe's bytes.
//! Both ends know `len` and the transfer id from the descriptor the agent sends over the
//! pipe, so the receiver checks every header against the stripe it expects before it reads
//! a byte of data into place: a peer cannot make it write outside the stripe, and a
//! connection that drifted out of step is an error, not a misplaced tensor.
//!
//! Connections are plain blocking `TcpStream`s with `TCP_NODELAY`; a transfer runs one
//! scoped thread per used connection on each side. Errors name the connection and its peer.
//!
//! Opening connections: the accepting side runs an [`MptListener`]; the connecting side
//! opens its connections with [`open_connections`], each starting with a [`ConnectionHello`] that
//! carries a token (which the agent passes in its pipe handshake) and the connection's
//! index. The listener sorts arrivals by token until [`MptListener::claim`] takes a
//! complete set. The connections of one pipe carry both directions ([`MptChannel::split`]).
//! A tensor's place in the pipe's frames is an [`MptDescriptor`]: the transfer id its
//! stripes carry. This module does not negotiate.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use rdzv_core::channel::mpt::{
    pieces, stripes, ConnectionHello, MptDescriptor, StripeHeader, MAX_CONNECTIONS,
    STRIPE_HEADER_LEN,
};

/// Tuning of the channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MptOptions {
    /// The fewest bytes a stripe carries: a transfer uses `len / min_stripe_len`
    /// connections (at least one, at most all). Both ends must use the same value.
    pub min_stripe_len: usize,
}

impl Default for MptOptions {
    fn default() -> Self {
        MptOptions {
            // Measured with `rdzv bench rpc --channel basic,mpt` on the 2-vCPU VM: with 256
            // KiB stripes a 1 MiB echo took 1276 µs against 439 µs inline (a thread started
            // per extra connection and transfer on each side); with 1 MiB stripes it takes
            // what inline takes, and 64 MiB still uses every connection.
            min_stripe_len: 1 << 20,
        }
    }
}

/// What can go wrong on a connection.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MptError {
    /// No connections were given.
    #[error("mpt channel has no connections")]
    NoConnections,
    /// The two ends disagree on the number of connections in use.
    #[error("mpt transfer {transfer_id} needs {needed} connections but only {available} are open")]
    TooFewConnections {
        /// The transfer.
        transfer_id: u64,
        /// Connections the transfer's stripes need.
        needed: usize,
        /// Connections open.
        available: usize,
    },
    /// A socket call failed.
    #[error("mpt connection {connection} (peer {peer}): {action} failed: {source}")]
    Io {
        /// The connection index.
        connection: usize,
        /// The connection's peer address.
        peer: String,
        /// What was being done.
        action: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A stripe header was not the one expected: the peer is out of step or not an mpt
    /// endpoint. The connection can no longer be trusted; the agent should re-create the
    /// pipe.
    #[error(
        "mpt connection {connection} (peer {peer}): expected the stripe {expected:?} of transfer \
         {transfer_id}, got {got}"
    )]
    UnexpectedStripe {
        /// The connection index.
        connection: usize,
        /// The connection's peer address.
        peer: String,
        /// The transfer expected.
        transfer_id: u64,
        /// `(offset, len)` expected.
        expected: (usize, usize),
        /// What arrived, described.
        got: String,
    },
    /// The [`StripeSink`] a transfer was received into refused a piece.
    #[error("mpt connection {connection}: the receiving side cannot take bytes {offset}..{end} of transfer {transfer_id}: {reason}")]
    Sink {
        /// The connection index.
        connection: usize,
        /// The transfer.
        transfer_id: u64,
        /// Where the piece starts in the transfer.
        offset: usize,
        /// Where it ends.
        end: usize,
        /// Why (the sink's words).
        reason: String,
    },
    /// A connection's thread panicked (a bug, reported instead of propagated).
    #[error("mpt connection {connection} thread panicked")]
    Panicked {
        /// The connection index.
        connection: usize,
    },
    /// A pipe's set of connections did not arrive at the [`MptListener`].
    #[error("mpt connections were not opened: {reason}")]
    Unclaimed {
        /// How many came, or why none will.
        reason: String,
    },
}

/// Opens `count` connections to the [`MptListener`] at `address` for the set `token`, each
/// with `TCP_NODELAY` and its hello sent, in index order.
///
/// # Errors
/// [`MptError::Io`] naming the connection that could not connect or send its hello.
pub fn open_connections(
    address: SocketAddr,
    token: u64,
    count: u16,
    timeout: Duration,
) -> Result<Vec<TcpStream>, MptError> {
    let count = count.clamp(1, MAX_CONNECTIONS);
    let mut connections = Vec::with_capacity(usize::from(count));
    for index in 0..count {
        let io = |action| {
            move |source| MptError::Io {
                connection: usize::from(index),
                peer: address.to_string(),
                action,
                source,
            }
        };
        let mut stream = TcpStream::connect_timeout(&address, timeout).map_err(io("connecting"))?;
        stream
            .set_nodelay(true)
            .map_err(io("setting TCP_NODELAY"))?;
        stream
            .write_all(
                &ConnectionHello {
                    token,
                    index,
                    count,
                }
                .encode(),
            )
            .map_err(io("sending the connection hello"))?;
        connections.push(stream);
    }
    Ok(connections)
}

/// How long an accepted connection has to send its [`ConnectionHello`].
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Sets of connections nobody claimed are dropped after this long.
const UNCLAIMED_TTL: Duration = Duration::from_secs(60);
/// At most this many accepted connections wait for their hello at once; more are
/// closed at once (a flood of silent connections costs no more than this many threads).
const MAX_PENDING_HELLOS: usize = 256;

/// Connections that arrived, by token.
#[derive(Default)]
struct Arrivals {
    sets: HashMap<u64, Arrival>,
    closed: bool,
}

struct Arrival {
    connections: Vec<Option<TcpStream>>,
    since: Instant,
}

impl Arrival {
    fn complete(&self) -> bool {
        self.connections.iter().all(Option::is_some)
    }
}

struct Registry {
    arrivals: Mutex<Arrivals>,
    changed: Condvar,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Arrivals> {
        self.arrivals.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Files a connection that said `hello`; a connection that contradicts its set (another
    /// count, an index taken twice) is dropped.
    fn file(&self, hello: ConnectionHello, stream: TcpStream) {
        let mut arrivals = self.lock();
        if arrivals.closed {
            return;
        }
        arrivals
            .sets
            .retain(|_, set| set.since.elapsed() < UNCLAIMED_TTL);
        let set = arrivals.sets.entry(hello.token).or_insert_with(|| Arrival {
            connections: (0..hello.count).map(|_| None).collect(),
            since: Instant::now(),
        });
        let fits = set.connections.len() == usize::from(hello.count);
        match set.connections.get_mut(usize::from(hello.index)) {
            Some(slot @ None) if fits => {
                *slot = Some(stream);
            }
            _ => {
                tracing::warn!(
                    token = hello.token,
                    index = hello.index,
                    count = hello.count,
                    "an mpt connection contradicts its set; dropped"
                );
                return;
            }
        }
        drop(arrivals);
        self.changed.notify_all();
    }
}

/// Accepts mpt connections on a TCP port of its own and keeps them, sorted by token, until
/// the pipe they belong to claims them. One thread accepts; each connection's hello is
/// read on a short-lived thread of its own, so a silent connection holds up nothing.
pub struct MptListener {
    address: SocketAddr,
    registry: Arc<Registry>,
    stopping: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for MptListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MptListener")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl MptListener {
    /// Listens on an ephemeral port of `host`.
    ///
    /// # Errors
    /// The bind or the thread start failed.
    pub fn bind(host: IpAddr) -> io::Result<MptListener> {
        let listener = TcpListener::bind(SocketAddr::new(host, 0))?;
        let address = listener.local_addr()?;
        let registry = Arc::new(Registry {
            arrivals: Mutex::new(Arrivals::default()),
            changed: Condvar::new(),
        });
        let stopping = Arc::new(AtomicBool::new(false));
        let thread = {
            let registry = Arc::clone(&registry);
            let stopping = Arc::clone(&stopping);
            std::thread::Builder::new()
                .name("rdzv-mpt-accept".into())
                .spawn(move || accept_connections(&listener, &registry, &stopping))?
        };
        Ok(MptListener {
            address,
            registry,
            stopping,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Where connections connect to.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Takes the complete set of connections `token`, in index order, waiting up to
    /// `timeout` for the rest of it.
    ///
    /// # Errors
    /// [`MptError::Unclaimed`] when the set is not complete in time (saying how many
    /// connections came) or the listener closed.
    pub fn claim(&self, token: u64, timeout: Duration) -> Result<Vec<TcpStream>, MptError> {
        let deadline = Instant::now() + timeout;
        let mut arrivals = self.registry.lock();
        loop {
            if arrivals.closed {
                return Err(MptError::Unclaimed {
                    reason: "the connection listener closed".into(),
                });
            }
            if arrivals.sets.get(&token).is_some_and(Arrival::complete) {
                let set = arrivals.sets.remove(&token).map(|s| s.connections);
                return Ok(set.into_iter().flatten().flatten().collect());
            }
            let now = Instant::now();
            if now >= deadline {
                let (came, of) = arrivals.sets.remove(&token).map_or((0, 0), |set| {
                    (
                        set.connections.iter().flatten().count(),
                        set.connections.len(),
                    )
                });
                return Err(MptError::Unclaimed {
                    reason: format!(
                        "{came} of {of} connections arrived within {} ms",
                        timeout.as_millis()
                    ),
                });
            }
            arrivals = self
                .registry
                .changed
                .wait_timeout(arrivals, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Stops accepting, drops every unclaimed connection and fails waiting claims.
    pub fn close(&self) {
        if self.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            let mut arrivals = self.registry.lock();
            arrivals.closed = true;
            arrivals.sets.clear();
        }
        self.registry.changed.notify_all();
        // Wakes the accept call; the thread sees `stopping` and exits.
        let _ = TcpStream::connect_timeout(&self.address, Duration::from_secs(1));
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

impl Drop for MptListener {
    fn drop(&mut self) {
        self.close();
    }
}

/// One of the [`MAX_PENDING_HELLOS`] slots, given back on drop.
struct HelloSlot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for HelloSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn accept_connections(listener: &TcpListener, registry: &Arc<Registry>, stopping: &AtomicBool) {
    let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for stream in listener.incoming() {
        if stopping.load(Ordering::Acquire) {
            return;
        }
        let mut stream = match stream {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "accepting an mpt connection failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if pending.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING_HELLOS {
            pending.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("too many mpt connections waiting for their hello; one closed");
            continue;
        }
        let registry = Arc::clone(registry);
        // Counts down when the thread ends, or when its closure is dropped unrun.
        let done = HelloSlot(Arc::clone(&pending));
        let spawned = std::thread::Builder::new()
            .name("rdzv-mpt-hello".into())
            .spawn(move || {
                let _done = done;
                let mut raw = [0u8; ConnectionHello::ENCODED_LEN];
                let read = stream
                    .set_read_timeout(Some(HELLO_TIMEOUT))
                    .and_then(|()| stream.read_exact(&mut raw))
                    .and_then(|()| stream.set_read_timeout(None))
                    .and_then(|()| stream.set_nodelay(true));
                let peer = stream
                    .peer_addr()
                    .map_or_else(|_| "?".to_string(), |a| a.to_string());
                match read
                    .map_err(|e| e.to_string())
                    .and_then(|()| ConnectionHello::decode(&raw).map_err(|e| e.to_string()))
                {
                    Ok(hello) => registry.file(hello, stream),
                    Err(reason) => {
                        tracing::debug!(%peer, %reason, "not an mpt connection; dropped");
                    }
                }
            });
        if let Err(e) = spawned {
            // The closure (and its counter guard) was dropped with the error.
            tracing::warn!(error = %e, "cannot start a thread to read an mpt connection's hello");
        }
    }
}

/// One end of an mpt channel: its connections, connected to the same peer in the same order
/// on both sides.
#[derive(Debug)]
pub struct MptChannel {
    connections: Vec<TcpStream>,
    peers: Vec<String>,
    options: MptOptions,
}

impl MptChannel {
    /// An end over `connections` (connection `i` here must be connection `i` at the peer).
    /// Sets `TCP_NODELAY` on each.
    ///
    /// # Errors [`MptError::NoConnections`] for an empty list; [`MptError::Io`] if a
    /// connection has no peer (it is not connected).
    pub fn new(connections: Vec<TcpStream>, options: MptOptions) -> Result<MptChannel, MptError> {
        if connections.is_empty() {
            return Err(MptError::NoConnections);
        }
        let mut peers = Vec::with_capacity(connections.len());
        for (connection, stream) in connections.iter().enumerate() {
            let peer = stream.peer_addr().map_err(|source| MptError::Io {
                connection,
                peer: "?".into(),
                action: "reading the peer address",
                source,
            })?;
            let peer = peer.to_string();
            if let Err(source) = stream.set_nodelay(true) {
                return Err(MptError::Io {
                    connection,
                    peer,
                    action: "setting TCP_NODELAY",
                    source,
                });
            }
            peers.push(peer);
        }
        Ok(MptChannel {
            connections,
            peers,
            options,
        })
    }

    /// Number of connections.
    pub fn connections(&self) -> usize {
        self.connections.len()
    }

    /// Two ends over the same connections (duplicated sockets): one to send with and one to
    /// receive with, so that each direction has its own lock.
    ///
    /// # Errors
    /// [`MptError::Io`] if a socket cannot be duplicated.
    pub fn split(self) -> Result<(MptChannel, MptChannel), MptError> {
        let mut copies = Vec::with_capacity(self.connections.len());
        for (connection, stream) in self.connections.iter().enumerate() {
            copies.push(stream.try_clone().map_err(|source| MptError::Io {
                connection,
                peer: self.peers.get(connection).cloned().unwrap_or_default(),
                action: "duplicating the socket",
                source,
            })?);
        }
        let other = MptChannel {
            connections: copies,
            peers: self.peers.clone(),
            options: self.options,
        };
        Ok((self, other))
    }

    /// Shuts every connection down (both directions): a transfer blocked on one fails.
    pub fn shutdown(&self) {
        for stream in &self.connections {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }

    fn plan(&self, len: usize, transfer_id: u64) -> Result<Vec<(usize, usize)>, MptError> {
        let plan = stripes(len, self.connections.len(), self.options.min_stripe_len);
        if plan.len() > self.connections.len() {
            return Err(MptError::TooFewConnections {
                transfer_id,
                needed: plan.len(),
                available: self.connections.len(),
            });
        }
        Ok(plan)
    }

    /// Sends `data` as transfer `transfer_id`, each stripe on its connection in parallel.
    ///
    /// # Errors
    /// The first connection error, naming the connection.
    pub fn send(&mut self, transfer_id: u64, data: &[u8]) -> Result<(), MptError> {
        let plan = self.plan(data.len(), transfer_id)?;
        let peers = &self.peers;
        let work = self.connections.iter_mut().zip(plan).enumerate();
        run_connections(work, |connection, stream, (offset, len)| {
            let header = StripeHeader {
                transfer_id,
                offset: offset as u64,
                len: len as u64,
            };
            let io = |action| {
                move |source| MptError::Io {
                    connection,
                    peer: peers.get(connection).cloned().unwrap_or_default(),
                    action,
                    source,
                }
            };
            stream
                .write_all(&header.encode())
                .map_err(io("sending a stripe header"))?;
            let stripe = data.get(offset..offset + len).unwrap_or_default();
            stream.write_all(stripe).map_err(io("sending a stripe"))?;
            stream.flush().map_err(io("flushing a stripe"))
        })
    }

    /// Receives transfer `transfer_id` of `buf.len()` bytes into `buf`.
    ///
    /// # Errors The first connection error; [`MptError::UnexpectedStripe`] when a header is
    /// not the one this end expects (nothing is written outside that connection's stripe
    /// either way).
    pub fn recv(&mut self, transfer_id: u64, buf: &mut [u8]) -> Result<(), MptError> {
        let plan = self.plan(buf.len(), transfer_id)?;
        // Disjoint destination slices, one per used connection.
        let mut parts = Vec::with_capacity(plan.len());
        let mut rest = buf;
        for &(_, len) in &plan {
            let (part, tail) = rest.split_at_mut(len);
            parts.push(part);
            rest = tail;
        }
        let peers = &self.peers;
        let work = self
            .connections
            .iter_mut()
            .zip(plan.into_iter().zip(parts))
            .enumerate();
        run_connections(work, |connection, stream, ((offset, len), part)| {
            let peer = || peers.get(connection).cloned().unwrap_or_default();
            read_stripe_header(stream, connection, peer, transfer_id, (offset, len))?;
            stream.read_exact(part).map_err(|source| MptError::Io {
                connection,
                peer: peer(),
                action: "receiving a stripe",
                source,
            })
        })
    }
}

/// Where [`MptChannel::recv_with`] puts a transfer's bytes instead of one buffer: pieces
/// of at most [`piece_len`](Self::piece_len) bytes, none crossing a multiple of it
/// ([`pieces`]), each taken from the sink, filled by the connection that reads it and given
/// back. Connections read on threads of their own, so pieces are taken and given back from
/// several threads at once and in any order (within one connection, in order).
pub trait StripeSink: Sync {
    /// What one piece is read into.
    type Piece: Send;
    /// The longest piece (at least 1).
    fn piece_len(&self) -> usize;
    /// A piece for the `len` bytes at `offset` of the transfer (may wait for room).
    ///
    /// # Errors
    /// Why the bytes cannot be taken: the transfer fails with [`MptError::Sink`].
    fn take(&self, offset: usize, len: usize) -> Result<Self::Piece, String>;
    /// The piece's bytes, exactly as long as it was asked for.
    fn bytes<'p>(&self, piece: &'p mut Self::Piece) -> &'p mut [u8];
    /// The piece is filled.
    ///
    /// # Errors
    /// As [`take`](Self::take).
    fn put(&self, piece: Self::Piece) -> Result<(), String>;
}

impl MptChannel {
    /// Receives transfer `transfer_id` of `len` bytes into `sink`, each connection's stripe
    /// piece by piece as it arrives.
    ///
    /// # Errors
    /// As [`recv`](Self::recv), and [`MptError::Sink`] when the sink refuses a piece (the
    /// connection is then out of step: end the channel).
    pub fn recv_with<S: StripeSink>(
        &mut self,
        transfer_id: u64,
        len: usize,
        sink: &S,
    ) -> Result<(), MptError> {
        let plan = self.plan(len, transfer_id)?;
        let peers = &self.peers;
        let piece_len = sink.piece_len();
        let work = self.connections.iter_mut().zip(plan).enumerate();
        run_connections(work, |connection, stream, stripe| {
            let peer = || peers.get(connection).cloned().unwrap_or_default();
            read_stripe_header(stream, connection, peer, transfer_id, stripe)?;
            for (offset, n) in pieces(stripe, piece_len) {
                let refused = |reason| MptError::Sink {
                    connection,
                    transfer_id,
                    offset,
                    end: offset + n,
                    reason,
                };
                let mut piece = sink.take(offset, n).map_err(refused)?;
                let bytes = sink.bytes(&mut piece);
                if bytes.len() != n {
                    return Err(refused(format!(
                        "it gave a {}-byte buffer for {n} bytes",
                        bytes.len()
                    )));
                }
                stream.read_exact(bytes).map_err(|source| MptError::Io {
                    connection,
                    peer: peer(),
                    action: "receiving a stripe",
                    source,
                })?;
                sink.put(piece).map_err(refused)?;
            }
            Ok(())
        })
    }
}

/// Reads connection `connection`'s stripe header and checks it is `(offset, len)` of
/// `transfer_id`.
fn read_stripe_header(
    stream: &mut TcpStream,
    connection: usize,
    peer: impl Fn() -> String,
    transfer_id: u64,
    (offset, len): (usize, usize),
) -> Result<(), MptError> {
    let mut raw = [0u8; STRIPE_HEADER_LEN];
    stream.read_exact(&mut raw).map_err(|source| MptError::Io {
        connection,
        peer: peer(),
        action: "receiving a stripe header",
        source,
    })?;
    let expected = StripeHeader {
        transfer_id,
        offset: offset as u64,
        len: len as u64,
    };
    match StripeHeader::decode(&raw) {
        Some(header) if header == expected => Ok(()),
        other => Err(MptError::UnexpectedStripe {
            connection,
            peer: peer(),
            transfer_id,
            expected: (offset, len),
            got: match other {
                Some(h) => format!(
                    "transfer {} offset {} length {}",
                    h.transfer_id, h.offset, h.len
                ),
                None => "bytes that are no stripe header".into(),
            },
        }),
    }
}

/// Runs `f` for every connection of `work` on its own scoped thread (connection 0 on this
/// one) and returns the first error.
fn run_connections<'s, T: Send>(
    work: impl Iterator<Item = (usize, (&'s mut TcpStream, T))>,
    f: impl Fn(usize, &mut TcpStream, T) -> Result<(), MptError> + Sync,
) -> Result<(), MptError> {
    let mut work: Vec<(usize, (&mut TcpStream, T))> = work.collect();
    let first = if work.is_empty() {
        None
    } else {
        Some(work.remove(0))
    };
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .into_iter()
            .map(|(connection, (stream, item))| {
                (connection, scope.spawn(move || f(connection, stream, item)))
            })
            .collect();
        let mut result = match first {
            Some((connection, (stream, item))) => f(connection, stream, item),
            None => Ok(()),
        };
        for (connection, handle) in handles {
            let connection_result = handle
                .join()
                .unwrap_or(Err(MptError::Panicked { connection }));
            if result.is_ok() {
                result = connection_result;
            }
        }
        result
    })
}

#[cfg(test)]
mod sink_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn local() -> IpAddr {
        IpAddr::from([127, 0, 0, 1])
    }

    #[test]
    fn the_listener_hands_out_complete_sets_by_token() {
        let listener = MptListener::bind(local()).unwrap();
        let address = listener.address();
        // Two sets at once; a stray connection that says nothing useful is dropped.
        let mut stray = TcpStream::connect(address).unwrap();
        stray.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let a = open_connections(address, 1, 3, Duration::from_secs(5)).unwrap();
        let b = open_connections(address, 2, 2, Duration::from_secs(5)).unwrap();
        let got_b = listener.claim(2, Duration::from_secs(5)).unwrap();
        let got_a = listener.claim(1, Duration::from_secs(5)).unwrap();
        assert_eq!((got_a.len(), got_b.len()), (3, 2));
        // In index order: connection i here is connection i there.
        for (near, far) in a.iter().zip(&got_a) {
            assert_eq!(near.local_addr().unwrap(), far.peer_addr().unwrap());
        }
        let (mut near, mut far) = (
            MptChannel::new(a, MptOptions { min_stripe_len: 1 }).unwrap(),
            MptChannel::new(got_a, MptOptions { min_stripe_len: 1 }).unwrap(),
        );
        let data: Vec<u8> = (0..100_000).map(|i| (i % 253) as u8).collect();
        let mut got = vec![0u8; data.len()];
        std::thread::scope(|s| {
            let sender = s.spawn(|| near.send(5, &data));
            far.recv(5, &mut got).unwrap();
            sender.join().unwrap().unwrap();
        });
        assert_eq!(got, data);
        // A token already claimed, or never sent, times out saying what came.
        let err = listener
            .claim(1, Duration::from_millis(50))
            .unwrap_err()
            .to_string();
        assert!(err.contains("0 of 0 connections arrived"), "{err}");
        drop(b);
    }

    #[test]
    fn an_incomplete_set_times_out_and_closing_fails_waiters() {
        let listener = Arc::new(MptListener::bind(local()).unwrap());
        let address = listener.address();
        // One connection of a set of two.
        let mut lone = TcpStream::connect(address).unwrap();
        lone.write_all(
            &ConnectionHello {
                token: 8,
                index: 1,
                count: 2,
            }
            .encode(),
        )
        .unwrap();
        let err = listener
            .claim(8, Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(err.contains("1 of 2 connections arrived"), "{err}");
        // A waiting claim fails at once when the listener closes.
        let waiter = {
            let listener = Arc::clone(&listener);
            std::thread::spawn(move || listener.claim(9, Duration::from_secs(30)))
        };
        std::thread::sleep(Duration::from_millis(50));
        let started = Instant::now();
        listener.close();
        let err = waiter.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("closed"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(open_connections(address, 1, 1, Duration::from_secs(1))
            .and_then(|_| listener.claim(1, Duration::from_millis(10)))
            .is_err());
    }

    #[test]
    fn split_ends_share_the_connections_and_shutdown_stops_a_blocked_transfer() {
        let (a, b) = pair(2);
        let (mut a_send, mut a_recv) = a.split().unwrap();
        let (mut b_send, mut b_recv) = b.split().unwrap();
        let ping = vec![1u8; 5000];
        let pong = vec![2u8; 7000];
        let (mut got_ping, mut got_pong) = (vec![0u8; 5000], vec![0u8; 7000]);
        std::thread::scope(|s| {
            let t1 = s.spawn(|| a_send.send(1, &ping));
            let t2 = s.spawn(|| b_send.send(2, &pong));
            b_recv.recv(1, &mut got_ping).unwrap();
            a_recv.recv(2, &mut got_pong).unwrap();
            t1.join().unwrap().unwrap();
            t2.join().unwrap().unwrap();
        });
        assert_eq!((got_ping, got_pong), (ping, pong));
        // A receive blocked on a silent peer fails once the connections are shut down.
        let mut buf = vec![0u8; 4096];
        std::thread::scope(|s| {
            let blocked = s.spawn(|| b_recv.recv(3, &mut buf));
            std::thread::sleep(Duration::from_millis(50));
            b_send.shutdown();
            assert!(blocked.join().unwrap().is_err());
        });
    }

    fn pair(connections: usize) -> (MptChannel, MptChannel) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut near = Vec::new();
        let mut far = Vec::new();
        for _ in 0..connections {
            near.push(TcpStream::connect(addr).unwrap());
            far.push(listener.accept().unwrap().0);
        }
        let options = MptOptions {
            min_stripe_len: 1024,
        };
        (
            MptChannel::new(near, options).unwrap(),
            MptChannel::new(far, options).unwrap(),
        )
    }

    #[test]
    fn moves_bytes_over_four_connections() {
        let (mut a, mut b) = pair(4);
        for (id, len) in [(1u64, 0usize), (2, 1), (3, 5000), (4, 1 << 20)] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let mut got = vec![0u8; len];
            std::thread::scope(|s| {
                let sender = s.spawn(|| a.send(id, &data));
                b.recv(id, &mut got).unwrap();
                sender.join().unwrap().unwrap();
            });
            assert_eq!(got, data, "{len} bytes");
        }
    }

    #[test]
    fn a_stripe_of_another_transfer_is_refused() {
        let (mut a, mut b) = pair(2);
        let data = vec![9u8; 4096];
        let mut got = vec![0u8; 4096];
        std::thread::scope(|s| {
            let sender = s.spawn(|| a.send(7, &data));
            let err = b.recv(8, &mut got).unwrap_err();
            assert!(
                matches!(err, MptError::UnexpectedStripe { transfer_id: 8, .. }),
                "{err}"
            );
            let _ = sender.join();
        });
        assert!(got.iter().all(|&b| b == 0), "nothing was written");
    }

    #[test]
    fn a_closed_connection_names_itself() {
        let (a, mut b) = pair(2);
        drop(a);
        let mut got = vec![0u8; 4096];
        let err = b.recv(1, &mut got).unwrap_err().to_string();
        assert!(err.starts_with("mpt connection "), "{err}");
        assert!(err.contains("receiving a stripe header"), "{err}");
        assert!(matches!(
            MptChannel::new(Vec::new(), MptOptions::default()),
            Err(MptError::NoConnections)
        ));
    }
}
