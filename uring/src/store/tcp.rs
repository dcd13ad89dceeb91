//! `TcpStore`: a client of any TCPStore server (rdzv's, or PyTorch's libuv or legacy one).
//!
//! The client is plain blocking `std::net` I/O driven by `rdzv_core::store::codec`: a
//! store client has exactly one request in flight (PyTorch serialises them with
//! `activeOpLock_`), and a blocking `send` + `recv` pair is the cheapest round trip there
//! is (about 6 µs on loopback here, against about 20 µs through an io_uring executor).
//! It can optionally start a [`StoreServer`] in-process, as PyTorch's `is_master` does.
//!
//! Behaviour follows PyTorch's `TCPStore.cpp`: `VALIDATE` + `PING` on connect, retried
//! with exponential backoff and jitter until the timeout; user keys prefixed with `/`;
//! `get` is `WAIT` then `GET`; a timed-out wait runs the `CANCEL_WAIT` dance and leaves
//! the connection usable.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream as StdTcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdzv_core::store::codec::{self, AuthRequest, Decoded, Limits, PendingReply, AUTH_ACCEPTED};
use rdzv_core::store::{QueryType, Request, Response, StoreStats, WaitResponse, VALIDATION_MAGIC};

use super::{Store, StoreError, DEFAULT_TIMEOUT};
use crate::server::{ServerOptions, StoreServer};

/// PyTorch's client-side key prefix for user keys.
pub const KEY_PREFIX: &str = "/";
/// The key workers `ADD` to when they join a store with a fixed world size.
pub const INIT_KEY: &str = "init/";

/// How a [`TcpStore`] connects (PyTorch's `TCPStoreOptions`).
#[derive(Debug, Clone)]
pub struct TcpStoreOptions {
    /// Server host.
    pub host: String,
    /// Server port.
    pub port: u16,
    /// Host the server in this process (multi-tenant), then connect to it.
    pub is_master: bool,
    /// Number of workers, if fixed. With `wait_for_workers`, every client adds 1 to
    /// `init/` and the master waits until all have joined.
    pub world_size: Option<u32>,
    /// Wait for `world_size` workers at start (master side).
    pub wait_for_workers: bool,
    /// Timeout of connecting and of blocking calls.
    pub timeout: Duration,
    /// Reuse a live server of this process on the same port (`multi_tenant`).
    pub multi_tenant: bool,
    /// Wire limits applied to the server's replies.
    pub limits: Limits,
    /// The token sent in rdzv's `AUTH` query right after connecting, to a server with
    /// tokens (`store serve --token-file`). `None`: `RDZV_TOKEN`, else the first token of
    /// the file `RDZV_TOKEN_FILE`, else no `AUTH` (PyTorch's handshake).
    pub token: Option<StoreToken>,
    /// End the handshake with PyTorch's `PING` and wait for its echo (the default), so
    /// that `connect` returns only once the server has answered. `false` saves that round
    /// trip: `VALIDATE` goes out with no reply awaited, and a server that refuses the
    /// connection is seen by the first request instead (for clients, such as the elastic
    /// rendezvous' driver, whose first request follows at once).
    pub ping: bool,
}

/// A shared-secret token for a store server with tokens. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreToken(String);

impl std::fmt::Debug for StoreToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreToken(<redacted>)")
    }
}

impl StoreToken {
    /// A token given as text; it must be one a token file may hold (16 to 256 printable
    /// ASCII characters, no spaces).
    pub fn new(token: impl Into<String>) -> Result<StoreToken, StoreError> {
        let token = token.into();
        rdzv_core::store::access::client_token(token.as_bytes())
            .map_err(|e| StoreError::InvalidArgument(format!("the store token: {e}")))?;
        Ok(StoreToken(token.trim().to_string()))
    }

    /// The first token of a token file (a job can be given its own line of the server's
    /// file: `TOKEN [PREFIX]`, `#` comments).
    pub fn from_file(path: &std::path::Path) -> Result<StoreToken, StoreError> {
        let bytes = std::fs::read(path).map_err(|source| StoreError::File {
            op: "read the token file",
            path: path.to_path_buf(),
            source,
        })?;
        let token = rdzv_core::store::access::client_token(&bytes).map_err(|e| {
            StoreError::InvalidArgument(format!("token file {}: {e}", path.display()))
        })?;
        Ok(StoreToken(token.to_string()))
    }

    /// `RDZV_TOKEN`, else the file named by `RDZV_TOKEN_FILE`, else `None`.
    pub fn from_env() -> Result<Option<StoreToken>, StoreError> {
        if let Some(token) = std::env::var("RDZV_TOKEN").ok().filter(|t| !t.is_empty()) {
            return StoreToken::new(token).map(Some);
        }
        match std::env::var_os("RDZV_TOKEN_FILE").filter(|p| !p.is_empty()) {
            Some(path) => StoreToken::from_file(std::path::Path::new(&path)).map(Some),
            None => Ok(None),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl TcpStoreOptions {
    /// A client of `host:port` with PyTorch's defaults (300 s timeout).
    pub fn client(host: impl Into<String>, port: u16) -> Self {
        TcpStoreOptions {
            host: host.into(),
            port,
            is_master: false,
            world_size: None,
            wait_for_workers: false,
            timeout: DEFAULT_TIMEOUT,
            multi_tenant: false,
            limits: Limits::PYTORCH,
            token: None,
            ping: true,
        }
    }
}

struct Conn {
    stream: StdTcpStream,
    buf: Vec<u8>,
    filled: usize,
    out: Vec<u8>,
}

/// A TCPStore client (and optionally its in-process server).
pub struct TcpStore {
    conn: Mutex<Conn>,
    peer: String,
    options: TcpStoreOptions,
    timeout: Mutex<Duration>,
    server: Option<StoreServer>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TCPStore(client=TCPClient(addr={}), server={})",
            self.peer,
            match &self.server {
                Some(s) => format!("TCPServer(port={})", s.port()),
                None => "<nullptr>".into(),
            }
        )
    }
}

fn prefixed(key: &str) -> String {
    let mut k = String::with_capacity(KEY_PREFIX.len() + key.len());
    k.push_str(KEY_PREFIX);
    k.push_str(key);
    k
}

/// Exponential backoff with jitter (PyTorch's `ExponentialBackoffWithJitter`, with a
/// shorter first interval: our server accepts thousands of connections per second).
struct Backoff {
    next: Duration,
    rng: fastrand::Rng,
}

impl Backoff {
    const INITIAL: Duration = Duration::from_millis(20);
    const MAX: Duration = Duration::from_secs(2);
    const MULTIPLIER: f64 = 1.5;
    const RANDOMIZATION: f64 = 0.5;

    fn new() -> Self {
        Backoff {
            next: Self::INITIAL,
            rng: fastrand::Rng::new(),
        }
    }

    fn next_delay(&mut self) -> Duration {
        let base = self.next.as_secs_f64();
        let jitter = base * Self::RANDOMIZATION * (2.0 * self.rng.f64() - 1.0);
        self.next = Duration::from_secs_f64((base * Self::MULTIPLIER).min(Self::MAX.as_secs_f64()));
        Duration::from_secs_f64((base + jitter).max(0.0))
    }
}

impl TcpStore {
    /// Connects to the server at `host:port` as a plain client.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TcpStore, StoreError> {
        let mut options = TcpStoreOptions::client(host, port);
        options.timeout = timeout;
        TcpStore::new(options)
    }

    /// Connects as [`connect`](Self::connect) does, but without the handshake's `PING`
    /// ([`TcpStoreOptions::ping`]): one request fewer, for a client whose first request
    /// follows at once and reports a refusal as well.
    pub fn connect_without_ping(
        host: &str,
        port: u16,
        timeout: Duration,
    ) -> Result<TcpStore, StoreError> {
        let mut options = TcpStoreOptions::client(host, port);
        options.timeout = timeout;
        options.ping = false;
        TcpStore::new(options)
    }

    /// Creates the store as `options` say: starts the server first if `is_master`,
    /// connects, and runs the worker-count handshake if asked to.
    pub fn new(options: TcpStoreOptions) -> Result<TcpStore, StoreError> {
        if options.world_size == Some(0) {
            return Err(StoreError::InvalidArgument(
                "TCPStore world size cannot be 0".into(),
            ));
        }
        let mut options = options;
        let server = if options.is_master {
            let server = StoreServer::start(ServerOptions {
                host: None,
                port: options.port,
                multi_tenant: options.multi_tenant,
                limits: options.limits,
                ..ServerOptions::default()
            })
            .map_err(|e| StoreError::Io {
                op: "start the store server on port",
                peer: options.port.to_string(),
                source: io::Error::new(
                    match &e {
                        crate::server::ServerError::Listen { source } => source.kind(),
                        _ => io::ErrorKind::Other,
                    },
                    e.to_string(),
                ),
            })?;
            options.port = server.port();
            Some(server)
        } else {
            None
        };
        let token = match options.token.clone() {
            Some(token) => Some(token),
            None => StoreToken::from_env()?,
        };
        let (conn, peer) = connect_validated(&options, token.as_ref())?;
        let store = TcpStore {
            conn: Mutex::new(conn),
            peer,
            timeout: Mutex::new(options.timeout),
            options,
            server,
        };
        if let (Some(world_size), true) = (store.options.world_size, store.options.wait_for_workers)
        {
            store.raw_add(INIT_KEY, 1)?;
            if store.options.is_master {
                store.wait_for_workers(world_size)?;
            }
        }
        Ok(store)
    }

    fn wait_for_workers(&self, world_size: u32) -> Result<(), StoreError> {
        let timeout = self.timeout();
        let deadline = Instant::now() + timeout;
        loop {
            let joined = self.raw_add(INIT_KEY, 0)?;
            if joined >= i64::from(world_size) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(StoreError::InvalidArgument(format!(
                    "Timed out after {} seconds waiting for clients. {joined}/{world_size} clients joined.",
                    timeout.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The server's address as given.
    pub fn host(&self) -> &str {
        &self.options.host
    }

    /// The server's port (the real one, if this store started a server on port 0).
    pub fn port(&self) -> u16 {
        self.options.port
    }

    /// The in-process server, if this store started (or shares) one.
    pub fn server(&self) -> Option<&StoreServer> {
        self.server.as_ref()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends `request` and decodes its reply with `f` (the reply borrows the buffer).
    fn round_trip<T>(
        &self,
        request: &Request<'_>,
        pending: PendingReply,
        read_timeout: Option<Duration>,
        f: impl FnOnce(Response<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut conn = self.lock();
        send(&mut conn, request, &self.options.limits, &self.peer)?;
        conn.stream
            .set_read_timeout(read_timeout)
            .map_err(|source| self.io("set timeout on", source))?;
        let response = recv(&mut conn, pending, &self.options.limits, &self.peer)?;
        let (value, used) = response;
        let result = f(value);
        consume(&mut conn, used);
        result
    }

    /// One PING round trip: the server echoes a nonce.
    ///
    /// # Errors
    /// I/O errors, and [`StoreError::Protocol`] when the echo is not the nonce sent.
    pub fn ping(&self) -> Result<(), StoreError> {
        let nonce = std::process::id() ^ 0x5244_5a56;
        self.round_trip(
            &Request::Ping { nonce },
            reply(QueryType::Ping, 0),
            Some(self.timeout().max(Duration::from_millis(1))),
            |r| match r {
                Response::Pong(got) if got == nonce => Ok(()),
                other => Err(self.protocol(format!(
                    "Ping failed, invalid value returned from server. Expected: {nonce}, Got: {other:?}"
                ))),
            },
        )
    }

    /// Asks the server for its counters with rdzv's `STATS` query (connections, keys,
    /// waiters, queues, traffic, uptime and requests per query type).
    ///
    /// # Errors
    /// [`StoreError::Unsupported`] when the server closes the connection instead of
    /// answering, as PyTorch's TCPStore does with a query type it does not know (the
    /// connection is then unusable); I/O and protocol errors as for other requests.
    pub fn stats(&self) -> Result<StoreStats, StoreError> {
        let result = self.round_trip(
            &Request::Stats,
            reply(QueryType::Stats, 0),
            Some(self.timeout().max(Duration::from_millis(1))),
            |r| match r {
                Response::Stats(stats) => Ok(*stats),
                other => Err(self.protocol(format!("unexpected STATS reply {other:?}"))),
            },
        );
        result.map_err(|error| match error {
            StoreError::Closed { peer } => StoreError::Unsupported {
                peer,
                query: QueryType::Stats.name(),
            },
            StoreError::Io { peer, source, .. }
                if matches!(
                    source.kind(),
                    io::ErrorKind::ConnectionReset
                        | io::ErrorKind::BrokenPipe
                        | io::ErrorKind::ConnectionAborted
                ) =>
            {
                StoreError::Unsupported {
                    peer,
                    query: QueryType::Stats.name(),
                }
            }
            other => other,
        })
    }

    fn io(&self, op: &'static str, source: io::Error) -> StoreError {
        StoreError::Io {
            op,
            peer: self.peer.clone(),
            source,
        }
    }

    fn protocol(&self, detail: impl Into<String>) -> StoreError {
        StoreError::Protocol {
            peer: self.peer.clone(),
            detail: detail.into(),
        }
    }

    fn raw_add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let request = Request::Add {
            key: key.as_bytes(),
            delta,
        };
        self.round_trip(&request, reply(QueryType::Add, 0), None, |r| match r {
            Response::Int(v) => Ok(v),
            other => Err(self.protocol(format!("unexpected ADD reply {other:?}"))),
        })
    }

    /// `WAIT` on raw (already prefixed) keys with the CANCEL_WAIT dance on timeout.
    fn raw_wait(&self, keys: &[String], timeout: Duration) -> Result<(), StoreError> {
        let encoded = encode_key_list(keys);
        let list = rdzv_core::store::KeyList::new(keys.len(), &encoded)
            .ok_or_else(|| self.protocol("key list encoding"))?;
        let request = Request::Wait { keys: list };
        self.wait_reply(&request, timeout, || StoreError::Timeout {
            ms: timeout.as_millis(),
            keys: keys.to_vec(),
        })
    }

    /// Sends a WAIT or BARRIER and waits for STOP_WAITING; on timeout cancels.
    fn wait_reply(
        &self,
        request: &Request<'_>,
        timeout: Duration,
        timed_out: impl FnOnce() -> StoreError,
    ) -> Result<(), StoreError> {
        let mut conn = self.lock();
        send(&mut conn, request, &self.options.limits, &self.peer)?;
        // A zero timeout means "do not wait" (PyTorch TCPStore); the socket API needs a
        // non-zero value, so use the smallest one.
        let wait_for = timeout.max(Duration::from_millis(1));
        conn.stream
            .set_read_timeout(Some(wait_for))
            .map_err(|source| self.io("set timeout on", source))?;
        match recv(
            &mut conn,
            reply(QueryType::Wait, 0),
            &self.options.limits,
            &self.peer,
        ) {
            Ok((Response::Wait(WaitResponse::StopWaiting), used)) => {
                consume(&mut conn, used);
                Ok(())
            }
            Ok((other, _)) => {
                Err(self.protocol(format!("Stop_waiting response is expected, got {other:?}")))
            }
            Err(StoreError::Io { source, .. })
                if matches!(
                    source.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                self.cancel_wait(&mut conn)?;
                Err(timed_out())
            }
            Err(e) => Err(e),
        }
    }

    /// The CANCEL_WAIT dance of PyTorch's `doWait`: the server may have released us
    /// just before it saw the cancel, so a STOP_WAITING may come first.
    fn cancel_wait(&self, conn: &mut Conn) -> Result<(), StoreError> {
        send(conn, &Request::CancelWait, &self.options.limits, &self.peer)?;
        conn.stream
            .set_read_timeout(Some(self.timeout().max(Duration::from_millis(1))))
            .map_err(|source| self.io("set timeout on", source))?;
        let first = self.recv_wait_byte(conn)?;
        let last = match first {
            WaitResponse::WaitCanceled => first,
            WaitResponse::StopWaiting => self.recv_wait_byte(conn)?,
        };
        if last == WaitResponse::WaitCanceled {
            Ok(())
        } else {
            Err(self.protocol("wait_canceled response is expected"))
        }
    }

    fn recv_wait_byte(&self, conn: &mut Conn) -> Result<WaitResponse, StoreError> {
        let (response, used) = recv(
            conn,
            reply(QueryType::CancelWait, 0),
            &self.options.limits,
            &self.peer,
        )?;
        let byte = match response {
            Response::Wait(w) => Ok(w),
            other => Err(format!("{other:?}")),
        };
        consume(conn, used);
        byte.map_err(|other| {
            self.protocol(format!("wait_canceled response is expected, got {other}"))
        })
    }

    fn effective(&self, timeout: Option<Duration>) -> Duration {
        timeout.unwrap_or_else(|| self.timeout())
    }
}

/// What reply `query` gets (every query used here has one).
fn reply(query: QueryType, multi_get_keys: usize) -> PendingReply {
    PendingReply::new(query, multi_get_keys)
        .unwrap_or_else(|| unreachable!("{} has a reply in the TCPStore protocol", query.name()))
}

fn encode_key_list(keys: &[String]) -> Vec<u8> {
    let mut out = Vec::with_capacity(keys.iter().map(|k| k.len() + 8).sum());
    for k in keys {
        out.extend_from_slice(&(k.len() as u64).to_le_bytes());
        out.extend_from_slice(k.as_bytes());
    }
    out
}

fn send(
    conn: &mut Conn,
    request: &Request<'_>,
    limits: &Limits,
    peer: &str,
) -> Result<(), StoreError> {
    request
        .check_limits(limits)
        .map_err(|limit| StoreError::OverLimit {
            peer: peer.to_string(),
            limit,
        })?;
    conn.out.clear();
    request.encode_into(&mut conn.out);
    let Conn { stream, out, .. } = conn;
    stream.write_all(out).map_err(|source| StoreError::Io {
        op: "send to",
        peer: peer.to_string(),
        source,
    })
}

/// Reads until one reply of kind `pending` is complete; returns it (borrowing the
/// connection buffer) and how many bytes to consume afterwards.
fn recv<'c>(
    conn: &'c mut Conn,
    pending: PendingReply,
    limits: &Limits,
    peer: &str,
) -> Result<(Response<'c>, usize), StoreError> {
    loop {
        // Decide first (on an immutable view) whether a whole reply is here.
        let need = match codec::decode_response(pending, &conn.buf[..conn.filled], limits) {
            Ok(Decoded::Complete(_, used)) => Ok(used),
            Ok(Decoded::Partial(more)) => Err(more),
            Err(e) => {
                return Err(StoreError::Protocol {
                    peer: peer.to_string(),
                    detail: e.to_string(),
                })
            }
        };
        match need {
            Ok(_) => break,
            Err(more) => {
                let want = conn.filled + more.max(1);
                if conn.buf.len() < want {
                    let grow = want.max(conn.buf.len() * 2);
                    conn.buf.resize(grow, 0);
                }
                let Conn {
                    stream,
                    buf,
                    filled,
                    ..
                } = &mut *conn;
                match stream.read(&mut buf[*filled..]) {
                    Ok(0) => {
                        return Err(StoreError::Closed {
                            peer: peer.to_string(),
                        })
                    }
                    Ok(n) => *filled += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(source) => {
                        return Err(StoreError::Io {
                            op: "recv from",
                            peer: peer.to_string(),
                            source,
                        })
                    }
                }
            }
        }
    }
    match codec::decode_response(pending, &conn.buf[..conn.filled], limits) {
        Ok(Decoded::Complete(response, used)) => Ok((response, used)),
        _ => Err(StoreError::Protocol {
            peer: peer.to_string(),
            detail: "reply changed between two decodes".into(),
        }),
    }
}

fn consume(conn: &mut Conn, used: usize) {
    conn.buf.copy_within(used..conn.filled, 0);
    conn.filled -= used;
}

/// Connects, sends VALIDATE + PING and checks the echo, retrying with backoff until
/// `timeout` (PyTorch `TCPStore::TCPStore`).
fn connect_validated(
    options: &TcpStoreOptions,
    token: Option<&StoreToken>,
) -> Result<(Conn, String), StoreError> {
    let (host, port, timeout) = (options.host.as_str(), options.port, options.timeout);
    let deadline = Instant::now() + timeout;
    let mut backoff = Backoff::new();
    let mut tries = 0u32;
    // The last failure of an attempt that ran: an attempt cut off by the deadline before
    // it tried anything must not replace the real cause (ECONNREFUSED, say).
    let mut last_error = None;
    let started = Instant::now();
    // Whether the retrying was said (once, after a second of it: a long wait is not
    // silent).
    let mut said = false;
    loop {
        tries += 1;
        match try_connect(host, port, deadline, token, options.ping) {
            Ok(ok) => return Ok(ok),
            Err(Attempt::Failed(e)) => last_error = Some(e),
            Err(Attempt::NoTimeLeft) => {}
            // An attempt the deadline cut off does not hide an earlier real cause.
            Err(Attempt::CutShort(e)) => {
                last_error.get_or_insert(e);
            }
            // Trying again would send the same token: stop now.
            Err(Attempt::TokenRefused(peer)) => return Err(StoreError::TokenRefused { peer }),
        }
        let now = Instant::now();
        // Leave the next attempt some time of its own: one started at the deadline
        // could not even connect.
        let left = deadline.saturating_duration_since(now);
        if left < MIN_ATTEMPT {
            return Err(StoreError::ConnectTimeout {
                host: host.to_string(),
                port,
                ms: timeout.as_millis(),
                last_error: last_error.unwrap_or_else(|| {
                    format!("no attempt could run within the timeout ({tries} tried)")
                }),
            });
        }
        if !said && now.saturating_duration_since(started) >= RETRY_SAID_AFTER {
            said = true;
            tracing::warn!(
                target: crate::NOTICE,
                "{}",
                retrying_line(host, port, left, last_error.as_deref().unwrap_or(""))
            );
        }
        let delay = backoff.next_delay().min(left - MIN_ATTEMPT);
        tracing::debug!(
            host,
            port,
            tries,
            delay_ms = delay.as_millis() as u64,
            error = last_error.as_deref().unwrap_or(""),
            "TCP client failed to connect/validate; retrying"
        );
        std::thread::sleep(delay);
    }
}

/// The least time a connect attempt is started with; less than this left before the
/// deadline ends the retries with the last real error.
const MIN_ATTEMPT: Duration = Duration::from_millis(10);

/// How long a client retries connecting before it says so.
const RETRY_SAID_AFTER: Duration = Duration::from_secs(1);

/// What a client that keeps retrying says: "connecting to H:P, retrying for 28 s more:
/// CAUSE".
fn retrying_line(host: &str, port: u16, left: Duration, cause: &str) -> String {
    let mut line = format!(
        "connecting to {host}:{port}, retrying for {} s more",
        left.as_secs_f64().ceil()
    );
    if !cause.is_empty() {
        line.push_str(": ");
        line.push_str(cause);
    }
    line
}

/// Why one connect attempt failed.
enum Attempt {
    /// It ran and failed: the cause, for the final error.
    Failed(String),
    /// The deadline passed before it could try an address.
    NoTimeLeft,
    /// The deadline passed during the handshake: the cause only if no other is known.
    CutShort(String),
    /// The server at this address closed the connection on the `AUTH` query.
    TokenRefused(String),
}

/// One failed connect, said so that a refusal reads as one (never as a name lookup).
fn connect_failure(addr: &SocketAddr, e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => format!(
            "{addr}: connection refused (nothing listens there: is the store server running, on this port?)"
        ),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
            format!("{addr}: connect timed out (no answer: a firewall, or a host that is down?)")
        }
        _ => format!("{addr}: {e}"),
    }
}

fn try_connect(
    host: &str,
    port: u16,
    deadline: Instant,
    token: Option<&StoreToken>,
    ping: bool,
) -> Result<(Conn, String), Attempt> {
    let trimmed = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = (trimmed, port)
        .to_socket_addrs()
        .map_err(|e| Attempt::Failed(format!("cannot resolve {host}: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(Attempt::Failed(format!("{host} resolves to no address")));
    }
    let mut errors = Vec::new();
    // A handshake the deadline cut off: reported only if nothing better was seen.
    let mut cut_short = None;
    for addr in addrs {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            break;
        }
        match StdTcpStream::connect_timeout(&addr, remaining) {
            Ok(stream) => match handshake(stream, remaining, token, ping) {
                Ok(conn) => return Ok((conn, addr.to_string())),
                Err(Handshake::TokenRefused) => {
                    return Err(Attempt::TokenRefused(addr.to_string()))
                }
                Err(Handshake::Io(e)) if closed_by_peer(&e) => errors.push(format!(
                    "{addr}: the server closed the connection during the handshake (VALIDATE, PING: {e}): \
                     is it a TCPStore, and does it accept this client (--allow, --token-file: see its log)?"
                )),
                Err(Handshake::Io(e)) if timed_out(&e) => cut_short = Some(format!(
                    "{addr}: the server did not answer the handshake (VALIDATE, PING) within the {} ms left",
                    remaining.as_millis()
                )),
                Err(Handshake::Io(e)) => errors.push(format!("{addr}: handshake: {e}")),
            },
            Err(e) => errors.push(connect_failure(&addr, &e)),
        }
    }
    match (errors.is_empty(), cut_short) {
        (false, _) => Err(Attempt::Failed(errors.join("; "))),
        (true, Some(why)) => Err(Attempt::CutShort(why)),
        (true, None) => Err(Attempt::NoTimeLeft),
    }
}

/// Whether a handshake's read or write failed because the server closed the connection
/// (a close with our bytes unread reaches us as a reset).
fn closed_by_peer(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// Whether a handshake's read ran out of time.
fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Why a handshake failed.
enum Handshake {
    /// The server closed the connection instead of accepting the `AUTH` token.
    TokenRefused,
    /// Anything else.
    Io(io::Error),
}

impl From<io::Error> for Handshake {
    fn from(e: io::Error) -> Self {
        Handshake::Io(e)
    }
}

/// `AUTH` (with a token), then `VALIDATE` and (if `ping`) `PING`, in one write; checks
/// the `AUTH` reply byte and the echoed nonce.
fn handshake(
    stream: StdTcpStream,
    timeout: Duration,
    token: Option<&StoreToken>,
    ping: bool,
) -> Result<Conn, Handshake> {
    stream.set_nodelay(true)?;
    let mut conn = Conn {
        stream,
        buf: vec![0; 512],
        filled: 0,
        out: Vec::with_capacity(64),
    };
    let nonce = std::process::id();
    let mut frame = Vec::with_capacity(10);
    if let Some(token) = token {
        AuthRequest {
            token: token.as_bytes(),
        }
        .encode_into(&mut frame);
    }
    Request::Validate {
        magic: VALIDATION_MAGIC,
    }
    .encode_into(&mut frame);
    if ping {
        Request::Ping { nonce }.encode_into(&mut frame);
    }
    conn.stream.write_all(&frame)?;
    conn.stream
        .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
    if token.is_some() {
        let mut accepted = [0u8; 1];
        match conn.stream.read_exact(&mut accepted) {
            Ok(()) if accepted[0] == AUTH_ACCEPTED => {}
            Ok(()) => {
                return Err(Handshake::Io(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("AUTH reply byte {} is not AUTH_ACCEPTED (0)", accepted[0]),
                )))
            }
            Err(e) if closed_by_peer(&e) => return Err(Handshake::TokenRefused),
            Err(e) => return Err(e.into()),
        }
    }
    if !ping {
        conn.stream.set_read_timeout(None)?;
        return Ok(conn);
    }
    let mut echo = [0u8; 4];
    conn.stream.read_exact(&mut echo)?;
    let got = u32::from_le_bytes(echo);
    if got != nonce {
        let _ = conn.stream.shutdown(Shutdown::Both);
        return Err(Handshake::Io(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "Ping failed, invalid value returned from server. Expected: {nonce}, Got: {got}"
            ),
        )));
    }
    conn.stream.set_read_timeout(None)?;
    Ok(conn)
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let key = prefixed(key);
        let mut conn = self.lock();
        send(
            &mut conn,
            &Request::Set {
                key: key.as_bytes(),
                value,
            },
            &self.options.limits,
            &self.peer,
        )
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let key = prefixed(key);
        self.raw_wait(std::slice::from_ref(&key), self.timeout())?;
        self.round_trip(
            &Request::Get {
                key: key.as_bytes(),
            },
            reply(QueryType::Get, 0),
            None,
            |r| match r {
                Response::Value(v) => Ok(v.to_vec()),
                other => Err(self.protocol(format!("unexpected GET reply {other:?}"))),
            },
        )
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.raw_add(&prefixed(key), delta)
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let key = prefixed(key);
        self.round_trip(
            &Request::CompareSet {
                key: key.as_bytes(),
                expected,
                desired,
            },
            reply(QueryType::CompareSet, 0),
            None,
            |r| match r {
                Response::Value(v) => Ok(v.to_vec()),
                other => Err(self.protocol(format!("unexpected COMPARE_SET reply {other:?}"))),
            },
        )
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| prefixed(k)).collect();
        let encoded = encode_key_list(&keys);
        let list = rdzv_core::store::KeyList::new(keys.len(), &encoded)
            .ok_or_else(|| self.protocol("key list encoding"))?;
        self.round_trip(
            &Request::Check { keys: list },
            reply(QueryType::Check, 0),
            None,
            |r| match r {
                Response::Check(c) => Ok(c == rdzv_core::store::CheckResponse::Ready),
                other => Err(self.protocol(format!("unexpected CHECK reply {other:?}"))),
            },
        )
    }

    fn wait(&self, keys: &[&str], timeout: Option<Duration>) -> Result<(), StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| prefixed(k)).collect();
        self.raw_wait(&keys, self.effective(timeout))
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        let key = prefixed(key);
        self.round_trip(
            &Request::DeleteKey {
                key: key.as_bytes(),
            },
            reply(QueryType::DeleteKey, 0),
            None,
            |r| match r {
                Response::Int(n) => Ok(n == 1),
                other => Err(self.protocol(format!("unexpected DELETE_KEY reply {other:?}"))),
            },
        )
    }

    fn num_keys(&self) -> Result<i64, StoreError> {
        self.round_trip(
            &Request::GetNumKeys,
            reply(QueryType::GetNumKeys, 0),
            None,
            |r| match r {
                Response::Int(n) => Ok(n),
                other => Err(self.protocol(format!("unexpected GETNUMKEYS reply {other:?}"))),
            },
        )
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let key = prefixed(key);
        let mut conn = self.lock();
        send(
            &mut conn,
            &Request::Append {
                key: key.as_bytes(),
                value,
            },
            &self.options.limits,
            &self.peer,
        )
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| prefixed(k)).collect();
        self.raw_wait(&keys, self.timeout())?;
        let encoded = encode_key_list(&keys);
        let list = rdzv_core::store::KeyList::new(keys.len(), &encoded)
            .ok_or_else(|| self.protocol("key list encoding"))?;
        self.round_trip(
            &Request::MultiGet { keys: list },
            reply(QueryType::MultiGet, keys.len()),
            None,
            |r| match r {
                Response::Values(values) => Ok(values.into_iter().map(<[u8]>::to_vec).collect()),
                other => Err(self.protocol(format!("unexpected MULTI_GET reply {other:?}"))),
            },
        )
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let mut encoded = Vec::new();
        for (k, v) in pairs {
            let k = prefixed(k);
            encoded.extend_from_slice(&(k.len() as u64).to_le_bytes());
            encoded.extend_from_slice(k.as_bytes());
            encoded.extend_from_slice(&(v.len() as u64).to_le_bytes());
            encoded.extend_from_slice(v);
        }
        let list = rdzv_core::store::PairList::new(pairs.len(), &encoded)
            .ok_or_else(|| self.protocol("pair list encoding"))?;
        let mut conn = self.lock();
        send(
            &mut conn,
            &Request::MultiSet { pairs: list },
            &self.options.limits,
            &self.peer,
        )
    }

    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let key = prefixed(key);
        let mut conn = self.lock();
        send(
            &mut conn,
            &Request::QueuePush {
                key: key.as_bytes(),
                value,
            },
            &self.options.limits,
            &self.peer,
        )
    }

    fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>, StoreError> {
        let key = prefixed(key);
        if block {
            self.raw_wait(std::slice::from_ref(&key), self.timeout())?;
        }
        self.round_trip(
            &Request::QueuePop {
                key: key.as_bytes(),
            },
            reply(QueryType::QueuePop, 0),
            None,
            |r| match r {
                Response::QueuePop { value: Some(v), .. } => Ok(v.to_vec()),
                Response::QueuePop { value: None, .. } => Err(StoreError::QueueEmpty),
                other => Err(self.protocol(format!("unexpected QUEUE_POP reply {other:?}"))),
            },
        )
    }

    fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        let key = prefixed(key);
        self.round_trip(
            &Request::QueueLen {
                key: key.as_bytes(),
            },
            reply(QueryType::QueueLen, 0),
            None,
            |r| match r {
                Response::Int(n) => Ok(n),
                other => Err(self.protocol(format!("unexpected QUEUE_LEN reply {other:?}"))),
            },
        )
    }

    fn list_keys(&self) -> Result<Vec<String>, StoreError> {
        self.round_trip(
            &Request::ListKeys,
            reply(QueryType::ListKeys, 0),
            None,
            |r| match r {
                Response::Keys(keys) => Ok(keys
                    .into_iter()
                    .filter_map(|k| k.strip_prefix(KEY_PREFIX.as_bytes()))
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .collect()),
                other => Err(self.protocol(format!("unexpected LIST_KEYS reply {other:?}"))),
            },
        )
    }

    fn barrier(
        &self,
        key: &str,
        world_size: i64,
        timeout: Option<Duration>,
    ) -> Result<(), StoreError> {
        let raw = prefixed(key);
        let timeout = self.effective(timeout);
        let request = Request::Barrier {
            key: raw.as_bytes(),
            world_size,
        };
        self.wait_reply(&request, timeout, || StoreError::BarrierTimeout {
            ms: timeout.as_millis(),
            key: key.to_string(),
        })
    }

    fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_timeout(&self, timeout: Duration) {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner()) = timeout;
    }

    fn clone_store(&self) -> Result<Box<dyn Store>, StoreError> {
        let mut options = self.options.clone();
        options.is_master = false;
        options.wait_for_workers = false;
        options.timeout = self.timeout();
        Ok(Box::new(TcpStore::new(options)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_that_keeps_retrying_says_for_how_long() {
        assert_eq!(
            retrying_line(
                "10.0.0.1",
                29500,
                Duration::from_millis(27_400),
                "10.0.0.1:29500: connection refused"
            ),
            "connecting to 10.0.0.1:29500, retrying for 28 s more: 10.0.0.1:29500: connection refused"
        );
        assert_eq!(
            retrying_line("h", 1, Duration::from_secs(3), ""),
            "connecting to h:1, retrying for 3 s more"
        );
    }

    /// Nothing listens: the error says "connection refused" after the timeout, and the
    /// last retry does not replace that cause with one that ran out of time.
    #[test]
    fn a_refused_connect_says_so_after_the_timeout() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        for ms in [1, 35, 250] {
            let started = Instant::now();
            let err = TcpStore::connect("127.0.0.1", port, Duration::from_millis(ms)).unwrap_err();
            match &err {
                StoreError::ConnectTimeout { last_error, .. } => {
                    assert!(last_error.contains("connection refused"), "{ms} ms: {err}");
                    assert!(!last_error.contains("no address"), "{err}");
                }
                other => panic!("{ms} ms: {other}"),
            }
            assert!(started.elapsed() < Duration::from_millis(ms) + Duration::from_secs(1));
        }
    }

    /// Without the PING, VALIDATE goes out alone and the next bytes on the wire are the
    /// first request's; with it (the default), the PING sits in between.
    #[test]
    fn a_connection_without_ping_sends_validate_then_the_first_request() {
        for ping in [false, true] {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            let server = std::thread::spawn(move || {
                let (mut stream, _) = listener.accept().unwrap();
                let mut validate = [0u8; 5];
                stream.read_exact(&mut validate).unwrap();
                assert_eq!(validate[0], QueryType::Validate as u8);
                let mut next = [0u8; 1];
                stream.read_exact(&mut next).unwrap();
                if next[0] == QueryType::Ping as u8 {
                    let mut nonce = [0u8; 4];
                    stream.read_exact(&mut nonce).unwrap();
                    stream.write_all(&nonce).unwrap();
                    stream.read_exact(&mut next).unwrap();
                }
                // The ADD: its key and delta, then the new value as the reply.
                let mut rest = [0u8; 8 + 2 + 8];
                stream.read_exact(&mut rest).unwrap();
                stream.write_all(&7i64.to_le_bytes()).unwrap();
                (next[0], rest)
            });
            let mut options = TcpStoreOptions::client("127.0.0.1", port);
            options.timeout = Duration::from_secs(10);
            options.ping = ping;
            let store = TcpStore::new(options).unwrap();
            assert_eq!(store.add("k", 7).unwrap(), 7);
            let (first, rest) = server.join().unwrap();
            assert_eq!(first, QueryType::Add as u8, "ping: {ping}");
            assert_eq!(&rest[8..10], b"/k", "ping: {ping}");
        }
    }

    #[test]
    fn over_limit_requests_are_not_sent() {
        let limits = Limits::PYTORCH;
        let big = vec![0u8; 8 * 1024 * 1024 + 1];
        let err = Request::Set {
            key: b"/k",
            value: &big,
        }
        .check_limits(&limits)
        .unwrap_err();
        let shown = StoreError::OverLimit {
            peer: "h:1".into(),
            limit: err,
        }
        .to_string();
        assert!(
            shown.contains("SET value length 8388609 exceeds the limit of 8388608"),
            "{shown}"
        );
    }

    #[test]
    fn backoff_grows_with_jitter_and_caps() {
        let mut b = Backoff::new();
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(10) && first <= Duration::from_millis(30));
        for _ in 0..50 {
            let d = b.next_delay();
            assert!(d <= Backoff::MAX.mul_f64(1.0 + Backoff::RANDOMIZATION));
        }
    }

    #[test]
    fn query_types_match_pytorch() {
        assert_eq!(QueryType::Validate.as_u8(), 0);
        assert_eq!(QueryType::Barrier.as_u8(), 18);
    }
}
