//! The TCPStore server: PyTorch's libuv `TCPStore` daemon, on glommio.
//!
//! Each executor thread runs an accept loop and one task per connection. A connection
//! task reads bytes, cuts them into requests with `rdzv_core::store::codec`, hands each to
//! the single `rdzv_core::store::engine::Engine`, encodes the reply, and forwards the
//! wake-ups the engine owes other connections to their tasks. Nothing here decides what a
//! request means. See `ARCHITECTURE.md` for why one engine owner (and the numbers).
//!
//! Bad input never costs another client anything: a decode error, a wrong magic or a
//! non-VALIDATE first message closes only that connection, lengths are checked against
//! the codec limits before any buffer grows, and a closed connection's waiters are
//! removed from the engine.

mod conn;
pub mod listener;

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream as StdTcpStream};
use std::os::fd::IntoRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use glommio::{LocalExecutorBuilder, Placement};
use rdzv_core::store::codec::Limits;

/// PyTorch's default TCPStore port (`kDefaultPort`).
pub const DEFAULT_PORT: u16 = 29500;

/// How the server is started.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Address to listen on; `None` listens on `[::]` (dual stack), else `0.0.0.0`.
    pub host: Option<String>,
    /// Port; 0 picks a free one (see [`StoreServer::port`]).
    pub port: u16,
    /// Pin the executor thread to a CPU. Off by default: pinned executors measured
    /// 5-10x worse on small VMs (see `ARCHITECTURE.md`).
    pub pin: bool,
    /// Wire limits (PyTorch's libuv limits by default).
    pub limits: Limits,
    /// Reuse a live server of this process on the same port instead of binding again
    /// (PyTorch's `multi_tenant=True`).
    pub multi_tenant: bool,
    /// How long shutdown waits for connections to flush their replies.
    pub drain_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            host: None,
            port: DEFAULT_PORT,
            pin: false,
            limits: Limits::default(),
            multi_tenant: false,
            drain_timeout: Duration::from_secs(5),
        }
    }
}

/// What can go wrong starting a server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// Resolving the host failed.
    #[error("cannot resolve store host {host}: {source}")]
    Resolve {
        /// The host.
        host: String,
        /// The resolver's error.
        #[source]
        source: io::Error,
    },
    /// No address could be bound (the message is PyTorch's).
    #[error("{source}")]
    Listen {
        /// The bind/listen error, listing every address tried.
        #[source]
        source: io::Error,
    },
    /// The executor thread could not start (io_uring unavailable, memlock too low...).
    #[error("cannot start the store executor: {0}")]
    Executor(String),
}

/// A snapshot of what the server holds, for monitoring and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Open client connections.
    pub connections: usize,
    /// Connections blocked in `WAIT` or `BARRIER`.
    pub waiters: usize,
    /// Keys in the key-value map (queues not counted).
    pub keys: usize,
}

/// Counters the executor publishes after every batch of requests.
#[derive(Debug, Default)]
pub(crate) struct StatsCells {
    pub(crate) connections: AtomicUsize,
    pub(crate) waiters: AtomicUsize,
    pub(crate) keys: AtomicUsize,
}

struct Shared {
    addr: SocketAddr,
    stats: Arc<StatsCells>,
    stopping: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// A running store server. Dropping the last handle shuts it down gracefully.
#[derive(Clone)]
pub struct StoreServer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TCPServer(addr={})", self.shared.addr)
    }
}

fn tenants() -> &'static Mutex<HashMap<u16, Weak<Shared>>> {
    static TENANTS: OnceLock<Mutex<HashMap<u16, Weak<Shared>>>> = OnceLock::new();
    TENANTS.get_or_init(|| Mutex::new(HashMap::new()))
}

impl StoreServer {
    /// Starts a server, or with `multi_tenant` returns the live one already serving
    /// `port` in this process.
    pub fn start(options: ServerOptions) -> Result<StoreServer, ServerError> {
        if options.multi_tenant && options.port != 0 {
            let mut registry = tenants().lock().unwrap_or_else(|p| p.into_inner());
            if let Some(shared) = registry.get(&options.port).and_then(Weak::upgrade) {
                if !shared.stopping.load(Ordering::Acquire) {
                    tracing::debug!(port = options.port, "reusing multi-tenant store server");
                    return Ok(StoreServer { shared });
                }
            }
            let server = Self::start_new(&options)?;
            registry.insert(server.port(), Arc::downgrade(&server.shared));
            return Ok(server);
        }
        let server = Self::start_new(&options)?;
        if options.multi_tenant {
            let mut registry = tenants().lock().unwrap_or_else(|p| p.into_inner());
            registry.insert(server.port(), Arc::downgrade(&server.shared));
        }
        Ok(server)
    }

    fn start_new(options: &ServerOptions) -> Result<StoreServer, ServerError> {
        let addrs =
            listener::candidate_addrs(options.host.as_deref(), options.port).map_err(|source| {
                ServerError::Resolve {
                    host: options.host.clone().unwrap_or_default(),
                    source,
                }
            })?;
        let socket = listener::listen(&addrs, false, listener::REQUESTED_BACKLOG)
            .map_err(|source| ServerError::Listen { source })?;
        let addr = socket
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .ok_or_else(|| ServerError::Executor("listening socket has no address".into()))?;
        match listener::somaxconn() {
            Some(max) if (max as i64) < listener::REQUESTED_BACKLOG as i64 => tracing::warn!(
                somaxconn = max,
                "the listen backlog is capped at net.core.somaxconn={max}; connection storms \
                 of more ranks than that may see resets. Raise it with \
                 `sysctl -w net.core.somaxconn=65535`"
            ),
            _ => {}
        }
        let shared = Arc::new(Shared {
            addr,
            stopping: Arc::new(AtomicBool::new(false)),
            stats: Arc::new(StatsCells::default()),
            thread: Mutex::new(None),
        });
        let fd = socket.into_raw_fd();
        let limits = options.limits;
        let drain = options.drain_timeout;
        let placement = if options.pin {
            Placement::Fixed(0)
        } else {
            Placement::Unbound
        };
        let stop = Arc::clone(&shared.stopping);
        let stats = Arc::clone(&shared.stats);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let thread = std::thread::Builder::new()
            .name("rdzv-store".into())
            .spawn(move || {
                let built = LocalExecutorBuilder::new(placement)
                    .name("rdzv-store")
                    .io_memory(1 << 20)
                    .make();
                let executor = match built {
                    Ok(ex) => ex,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                executor.run(async move {
                    // SAFETY: `fd` is the listening socket created above; `into_raw_fd`
                    // gave up its ownership, and this is the only place that takes it.
                    let listener = unsafe {
                        <glommio::net::TcpListener as std::os::fd::FromRawFd>::from_raw_fd(fd)
                    };
                    let _ = ready_tx.send(Ok(()));
                    conn::serve(listener, limits, drain, stop, stats).await;
                });
            })
            .map_err(|e| ServerError::Executor(e.to_string()))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(ServerError::Executor(e));
            }
            Err(_) => {
                let _ = thread.join();
                return Err(ServerError::Executor(
                    "executor thread exited during start".into(),
                ));
            }
        }
        *shared.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
        tracing::info!(%addr, "store server listening");
        Ok(StoreServer { shared })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// What the server holds right now (connections, waiters, keys).
    pub fn stats(&self) -> ServerStats {
        let cells = &self.shared.stats;
        ServerStats {
            connections: cells.connections.load(Ordering::Relaxed),
            waiters: cells.waiters.load(Ordering::Relaxed),
            keys: cells.keys.load(Ordering::Relaxed),
        }
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.shared.addr.port()
    }

    /// Stops accepting, lets every connection flush the replies it owes (up to the drain
    /// timeout), and waits for the executor to exit. Idempotent; every clone of a
    /// multi-tenant handle shares the same server.
    pub fn shutdown(&self) {
        shutdown_shared(&self.shared);
    }
}

fn shutdown_shared(shared: &Shared) {
    if shared.stopping.swap(true, Ordering::AcqRel) {
        // Someone else is stopping it; still wait for the thread if we can.
    } else {
        // Wake the accept loop: it checks `stopping` after every accept.
        let wake = match shared.addr.ip() {
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), shared.addr.port())
            }
            IpAddr::V4(ip) if ip.is_unspecified() => {
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), shared.addr.port())
            }
            _ => shared.addr,
        };
        let _ = StdTcpStream::connect_timeout(&wake, Duration::from_secs(1));
    }
    let handle = shared
        .thread
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some(handle) = handle {
        if handle.thread().id() != std::thread::current().id() {
            let _ = handle.join();
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        shutdown_shared(self);
    }
}
