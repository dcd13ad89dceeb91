//! The TCPStore server: PyTorch's libuv `TCPStore` daemon, on io_uring or epoll.
//!
//! [`IoMode`] picks the kernel interface; `Auto` (the default) uses epoll where the host
//! refuses io_uring (module `io_mode`), and elsewhere whichever of the two measured
//! cheaper per request, once per process (module `calibrate`). Either way the server is N event
//! loops (module `direct` on io_uring, module `epoll` on epoll), each on its own thread
//! with its own `SO_REUSEPORT` listener, running its connections' requests to completion
//! against one engine behind a short lock (module `shared_engine`); only a wake-up owed
//! to another loop's connection crosses, batched. The default is one loop per CPU (at most
//! 16), and one on hosts of 2 CPUs or fewer. A connection's bytes are cut into requests
//! by its own incremental `rdzv_core::store::codec::RequestDecoder`, handed to the
//! `rdzv_core::store::engine::Engine`, the replies encoded, and the wake-ups the engine
//! owes other connections forwarded to them (module `session` holds what all share).
//! Nothing here decides what a request means. See `ARCHITECTURE.md` for the design and
//! the README's Performance section for the numbers.
//!
//! Bad input never costs another client anything: a decode error, a wrong magic or a
//! non-VALIDATE first message closes only that connection, lengths are checked against
//! the codec limits before any buffer grows, and a closed connection's waiters are
//! removed from the engine.

mod admission;
mod calibrate;
pub mod capacity;
mod closing;
mod direct;
mod epoll;
pub(crate) mod io_mode;
pub mod listener;
mod loop_config;
pub(crate) mod metrics;
mod poller;
mod session;
mod shared_engine;
mod spare_fd;

pub use io_mode::IoMode;

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use rdzv_core::store::access::AccessPolicy;
use rdzv_core::store::budget::Budget;
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
    /// Event loops. 0 (the default) runs one per CPU this process may use, at most
    /// [`DEFAULT_MAX_LOOPS`], and one on a host of 2 CPUs or fewer (its clients share
    /// them), on io_uring and epoll alike. Every loop serves its own connections against
    /// the shared engine; at most 256.
    pub threads: usize,
    /// Pin loop i to the i-th CPU this process may use. Off by default: pinned
    /// executors measured 5-10x worse on small VMs.
    pub pin: bool,
    /// Wire limits (PyTorch's libuv limits by default).
    pub limits: Limits,
    /// Memory limits: per value (`--max-value-bytes`), in total (`--max-store-bytes`),
    /// per connection (`--max-conn-bytes`) and the backpressure mark
    /// (`--out-high-water`); see `rdzv_core::store::budget` for the policy and the
    /// defaults.
    pub budget: Budget,
    /// Reuse a live server of this process on the same port instead of binding again
    /// (PyTorch's `multi_tenant=True`).
    pub multi_tenant: bool,
    /// How long shutdown waits for connections to flush their replies.
    pub drain_timeout: Duration,
    /// How long an idle loop keeps polling (its completion queue, or epoll without a
    /// timeout) before it sleeps in the kernel. Spinning saves the syscalls of going to
    /// sleep and waking up when requests arrive back to back, and costs CPU only while
    /// the server is busy or was within this window. The default, [`IdleSpin::Auto`],
    /// spins only where CPUs are spare.
    pub spin_before_park: IdleSpin,
    /// io_uring, epoll, or io_uring where the host allows it (the default).
    pub io: IoMode,
    /// Serve on this inherited, already-listening TCP socket instead of binding `host`
    /// and `port` (PyTorch's `master_listen_fd`; systemd socket activation). The server
    /// accepts on duplicates of it, one per event loop, and leaves the descriptor itself
    /// open. `multi_tenant` does not apply.
    pub listen_fd: Option<std::os::fd::RawFd>,
    /// Serve the server's figures and request-duration histograms in Prometheus' text
    /// format at `http://ADDR/metrics` (port 0 picks one: [`StoreServer::metrics_addr`]).
    /// Off by default; the loops record nothing for it then.
    pub metrics: Option<SocketAddr>,
    /// Who may connect (`--allow`) and which keys each token reaches (`--token-file`);
    /// open by default, as PyTorch's server is. See `rdzv_core::store::access`.
    pub access: AccessPolicy,
}

/// What an idle event loop does before it sleeps in the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdleSpin {
    /// Spin [`AUTO_SPIN`] where CPUs are spare (at least 4 usable, and at least twice
    /// as many as the server's loops), else sleep at once. On the 16-core H100 host one
    /// loop's ADD p50 went from 23–27 µs to 17–21.5 µs with a 50 µs spin; on a 2-vCPU VM
    /// spinning cut 64-connection throughput from 88k to 33k ops/s, since the clients
    /// need the CPU the loop spins on.
    #[default]
    Auto,
    /// Sleep at once (`--spin-us 0`).
    Off,
    /// Spin this long (`--spin-us N`).
    For(Duration),
}

/// How long [`IdleSpin::Auto`] spins where CPUs are spare.
pub const AUTO_SPIN: Duration = Duration::from_micros(50);

impl IdleSpin {
    /// The spin for a server of `loops` loops on a host where this process may use
    /// `cpus` CPUs; `None` sleeps at once.
    pub fn resolve(self, loops: usize, cpus: usize) -> Option<Duration> {
        match self {
            IdleSpin::Off => None,
            IdleSpin::For(spin) => (!spin.is_zero()).then_some(spin),
            IdleSpin::Auto => (cpus >= 4 && cpus >= 2 * loops).then_some(AUTO_SPIN),
        }
    }
}

/// Most epoll loops started when [`ServerOptions::threads`] is 0.
pub const DEFAULT_MAX_LOOPS: usize = 16;

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            host: None,
            port: DEFAULT_PORT,
            threads: 0,
            pin: false,
            limits: Limits::default(),
            budget: Budget::default(),
            multi_tenant: false,
            drain_timeout: Duration::from_secs(5),
            spin_before_park: IdleSpin::Auto,
            io: IoMode::default(),
            listen_fd: None,
            metrics: None,
            access: AccessPolicy::open(),
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
    /// The `--metrics` address cannot be listened on.
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// The bind error.
        #[source]
        source: io::Error,
    },
    /// The inherited socket of [`ServerOptions::listen_fd`] cannot be served on.
    #[error("cannot serve on the inherited file descriptor {fd}: {source}")]
    ListenFd {
        /// The descriptor.
        fd: std::os::fd::RawFd,
        /// What is wrong with it.
        #[source]
        source: io::Error,
    },
    /// A loop could not start (io_uring unavailable, memlock too low, no thread...).
    #[error("cannot start the store executor: {what}: {source}")]
    Executor {
        /// The step that failed, with what to do about it where that is known.
        what: &'static str,
        /// The system's error.
        #[source]
        source: io::Error,
    },
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

/// Counters the loops publish as they serve.
#[derive(Debug, Default)]
pub(crate) struct StatsCells {
    pub(crate) connections: AtomicUsize,
    pub(crate) waiters: AtomicUsize,
    pub(crate) keys: AtomicUsize,
    /// What `--metrics` serves; `None` (nothing recorded) without it.
    pub(crate) metrics: Option<metrics::Metrics>,
}

struct Shared {
    addr: SocketAddr,
    /// The `--metrics` HTTP thread, if any.
    metrics: Mutex<Option<metrics::MetricsServer>>,
    /// The event loop chosen (never `Auto`).
    io: IoMode,
    stats: Arc<StatsCells>,
    stopping: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The loop threads' kernel ids, for their CPU time (`calibrate`).
    loop_tids: Mutex<Vec<i32>>,
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
        if options.multi_tenant && options.port != 0 && options.listen_fd.is_none() {
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
        if options.multi_tenant && options.listen_fd.is_none() {
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
        let epoll = match options.io {
            IoMode::Epoll => true,
            IoMode::IoUring => false,
            IoMode::Auto => match io_mode::probe_io_uring() {
                Ok(Ok(())) => calibrate::auto_choice() == IoMode::Epoll,
                Ok(Err(io_mode::Refusal(why))) => {
                    tracing::warn!("{why}; the store server runs on epoll instead");
                    true
                }
                Err(source) => {
                    return Err(ServerError::Executor {
                        what: "cannot create an io_uring (`--io epoll` runs without one)",
                        source,
                    })
                }
            },
        };
        let threads = match options.threads {
            0 => io_mode::default_loops(DEFAULT_MAX_LOOPS),
            n => n.min(shared_engine::MAX_LOOPS),
        };
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let spin = options.spin_before_park.resolve(threads, cpus);
        let sockets = match options.listen_fd {
            Some(fd) => listener::adopt_listener(fd, threads)
                .map_err(|source| ServerError::ListenFd { fd, source })?,
            None => listener::listen_group(&addrs, threads, listener::REQUESTED_BACKLOG)
                .map_err(|source| ServerError::Listen { source })?,
        };
        let addr = sockets
            .first()
            .and_then(|s| s.local_addr().ok())
            .and_then(|a| a.as_socket())
            .ok_or_else(|| ServerError::Executor {
                what: "cannot read the listening socket's address",
                source: io::Error::new(io::ErrorKind::AddrNotAvailable, "not an IP socket"),
            })?;
        if let Some(max) = listener::backlog_cap(listener::somaxconn(), listener::REQUESTED_BACKLOG)
        {
            tracing::info!(
                somaxconn = max,
                "the listen backlog is {max} (net.core.somaxconn); `--world-size` warns when \
                 more ranks than that may connect at once"
            );
        }
        let shared = Arc::new(Shared {
            addr,
            io: if epoll {
                IoMode::Epoll
            } else {
                IoMode::IoUring
            },
            stopping: Arc::new(AtomicBool::new(false)),
            stats: Arc::new(StatsCells {
                metrics: options.metrics.map(|_| metrics::Metrics::default()),
                ..StatsCells::default()
            }),
            threads: Mutex::new(Vec::new()),
            loop_tids: Mutex::new(Vec::new()),
            metrics: Mutex::new(None),
        });
        if let Some(metrics_addr) = options.metrics {
            let stats = Arc::clone(&shared.stats);
            // The engine's clock starts with its loops, a moment after this one.
            let started = std::time::Instant::now();
            let status = metrics::StatusSource::new(
                if epoll { "epoll" } else { "io_uring" },
                threads,
                options.access.clone(),
                Arc::clone(&shared.stats),
                started,
            );
            let server = metrics::MetricsServer::start(
                metrics_addr,
                move || {
                    let cells = &stats;
                    cells.metrics.as_ref().map_or_else(String::new, |m| {
                        m.render(
                            started.elapsed().as_millis() as u64,
                            [
                                cells.connections.load(Ordering::Relaxed),
                                cells.keys.load(Ordering::Relaxed),
                                cells.waiters.load(Ordering::Relaxed),
                            ],
                        )
                    })
                },
                Some(status),
            )
            .map_err(|source| ServerError::Metrics {
                addr: metrics_addr,
                source,
            })?;
            tracing::info!(addr = %server.local_addr(), "serving metrics at /metrics");
            *shared.metrics.lock().unwrap_or_else(|p| p.into_inner()) = Some(server);
        }
        let loops = LoopsOf {
            options,
            spin,
            sockets,
            shared: &shared,
        };
        let (handles, io) = if epoll {
            let poller = || {
                epoll::poller().map_err(|source| ServerError::Executor {
                    what: "cannot create an epoll instance",
                    source,
                })
            };
            (start_loops(loops, poller, epoll::loop_body)?, "epoll")
        } else {
            let ring = || {
                direct::ring().map_err(|source| ServerError::Executor {
                    what: "cannot create an io_uring (`--io epoll` runs without one)",
                    source,
                })
            };
            (start_loops(loops, ring, direct::loop_body)?, "io_uring")
        };
        *shared.threads.lock().unwrap_or_else(|p| p.into_inner()) = handles;
        tracing::info!(%addr, loops = threads, spin_us = spin.map_or(0, |s| s.as_micros() as u64), "store server listening ({io})");
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

    /// The kernel interface the server runs on: [`IoMode::IoUring`] or
    /// [`IoMode::Epoll`] ([`IoMode::Auto`] resolved at start).
    pub fn io_mode(&self) -> IoMode {
        self.shared.io
    }

    /// The CPU time its loop threads have run, in nanoseconds (each thread's
    /// `schedstat`; exact for loops asleep when it is read).
    pub(crate) fn loop_cpu_ns(&self) -> io::Result<u64> {
        let tids = self
            .shared
            .loop_tids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if tids.is_empty() {
            return Err(io::Error::other("the store loops have not started yet"));
        }
        tids.into_iter().try_fold(0u64, |sum, tid| {
            Ok(sum.saturating_add(calibrate::thread_cpu_ns(tid)?))
        })
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.shared.addr.port()
    }

    /// Stops accepting, lets every connection flush the replies it owes (up to the drain
    /// timeout), and waits for the loops to exit. Idempotent; every clone of a
    /// multi-tenant handle shares the same server.
    pub fn shutdown(&self) {
        shutdown_shared(&self.shared);
    }

    /// Where `GET /metrics` is served, when [`ServerOptions::metrics`] was set.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.shared
            .metrics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(metrics::MetricsServer::local_addr)
    }
}

/// Lets `--metrics`' `/status.json` read the engine (weakly: the loops own it).
fn attach_status(shared: &Shared, engine: &Arc<shared_engine::SharedEngine>) {
    if let Some(metrics) = &shared.stats.metrics {
        let engine = Arc::downgrade(engine);
        metrics.attach(Box::new(move |f| {
            engine
                .upgrade()
                .map(|engine| engine.turn(0, |engine, _| f(engine)))
                .is_some()
        }));
    }
}

/// What [`start_loops`] starts loops with: the options, the idle spin, one listening
/// socket per loop, and the server they serve.
struct LoopsOf<'a> {
    options: &'a ServerOptions,
    spin: Option<Duration>,
    sockets: Vec<socket2::Socket>,
    shared: &'a Arc<Shared>,
}

/// Starts one loop per socket, all sharing one engine: `new_poller` makes a loop's
/// poller (an io_uring or an epoll instance) and the waker other loops reach it by,
/// `body` its thread from the common config, its socket, its poller and the stop flag.
fn start_loops<P, W: shared_engine::LoopWaker + 'static>(
    loops: LoopsOf<'_>,
    new_poller: impl Fn() -> Result<(P, W), ServerError>,
    body: fn(loop_config::LoopConfig, socket2::Socket, P, Arc<AtomicBool>) -> LoopBody,
) -> Result<Vec<JoinHandle<()>>, ServerError> {
    let LoopsOf {
        options,
        spin,
        sockets,
        shared,
    } = loops;
    let mut pollers = Vec::new();
    let mut wakers: Vec<Box<dyn shared_engine::LoopWaker>> = Vec::new();
    for _ in 0..sockets.len() {
        let (poller, waker) = new_poller()?;
        pollers.push(poller);
        wakers.push(Box::new(waker));
    }
    let engine = Arc::new(shared_engine::SharedEngine::new(
        wakers,
        Arc::clone(&shared.stats),
        options.budget,
    ));
    attach_status(shared, &engine);
    let mut loops: Vec<LoopBody> = Vec::new();
    for (index, (socket, poller)) in sockets.into_iter().zip(pollers).enumerate() {
        let config = loop_config::LoopConfig {
            index,
            shared: Arc::clone(&engine),
            limits: options.limits,
            budget: options.budget,
            access: access_of(options),
            stats: Arc::clone(&shared.stats),
            drain: options.drain_timeout,
            spin,
        };
        loops.push(body(config, socket, poller, Arc::clone(&shared.stopping)));
    }
    spawn_loops(loops, options.pin, shared)
}

/// The loops' access policy: `None` when it is open (nothing to check).
fn access_of(options: &ServerOptions) -> Option<Arc<AccessPolicy>> {
    (!options.access.is_open()).then(|| Arc::new(options.access.clone()))
}

/// One event loop's thread body (io_uring or epoll).
pub(super) type LoopBody = Box<dyn FnOnce() + Send>;

/// Runs each loop on its own thread `rdzv-store-{index}` (pinned with `pin`). If a thread
/// cannot start, the loops already running are stopped and joined.
fn spawn_loops(
    loops: Vec<LoopBody>,
    pin: bool,
    shared: &Arc<Shared>,
) -> Result<Vec<JoinHandle<()>>, ServerError> {
    let mut handles = Vec::with_capacity(loops.len());
    let (started, ready) = std::sync::mpsc::channel();
    for (index, body) in loops.into_iter().enumerate() {
        let started = started.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("rdzv-store-{index}"))
            .spawn(move || {
                let _ = started.send(rustix::thread::gettid().as_raw_nonzero().get());
                drop(started);
                if pin {
                    pin_loop(index);
                }
                body()
            });
        match spawned {
            Ok(handle) => handles.push(handle),
            Err(source) => {
                shared.stopping.store(true, Ordering::Release);
                handles.into_iter().for_each(|h| drop(h.join()));
                return Err(ServerError::Executor {
                    what: "cannot start a store loop thread",
                    source,
                });
            }
        }
    }
    drop(started);
    // Each thread says its id first thing (a thread that died first closes its end).
    *shared.loop_tids.lock().unwrap_or_else(|p| p.into_inner()) = ready.iter().collect();
    Ok(handles)
}

/// Pins the calling loop thread to the `index`-th CPU this process may use (modulo
/// their number); a failure is logged and the loop runs unpinned.
fn pin_loop(index: usize) {
    let allowed = match rustix::thread::sched_getaffinity(None) {
        Ok(set) => set,
        Err(error) => {
            tracing::warn!(%error, loop_index = index, "cannot read the CPU affinity; the loop is not pinned");
            return;
        }
    };
    let cpus: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&cpu| allowed.is_set(cpu))
        .collect();
    let Some(&cpu) = cpus.get(index % cpus.len().max(1)) else {
        return;
    };
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    if let Err(error) = rustix::thread::sched_setaffinity(None, &set) {
        tracing::warn!(%error, loop_index = index, cpu, "cannot pin the store loop; it runs unpinned");
    }
}

fn shutdown_shared(shared: &Shared) {
    // The accept loops poll this flag every 50 ms.
    shared.stopping.store(true, Ordering::Release);
    if let Some(mut metrics) = shared
        .metrics
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
    {
        metrics.stop();
    }
    let handles = std::mem::take(&mut *shared.threads.lock().unwrap_or_else(|p| p.into_inner()));
    for handle in handles {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_spin_is_on_by_default_only_where_cpus_are_spare() {
        assert_eq!(IdleSpin::default(), IdleSpin::Auto);
        // The 2-vCPU VM: the clients need the other CPU.
        assert_eq!(IdleSpin::Auto.resolve(1, 2), None);
        // 16 cores: one loop spins, the default 16 loops do not.
        assert_eq!(IdleSpin::Auto.resolve(1, 16), Some(AUTO_SPIN));
        assert_eq!(IdleSpin::Auto.resolve(8, 16), Some(AUTO_SPIN));
        assert_eq!(IdleSpin::Auto.resolve(9, 16), None);
        assert_eq!(IdleSpin::Auto.resolve(16, 16), None);
        assert_eq!(IdleSpin::Auto.resolve(1, 3), None);
        // Explicit choices win.
        assert_eq!(IdleSpin::Off.resolve(1, 64), None);
        let us = Duration::from_micros(7);
        assert_eq!(IdleSpin::For(us).resolve(16, 2), Some(us));
        assert_eq!(IdleSpin::For(Duration::ZERO).resolve(1, 64), None);
    }

    /// Issue 27: the executor's error keeps the system error it wraps as its source.
    #[test]
    fn an_executor_error_keeps_its_source() {
        let error = ServerError::Executor {
            what: "cannot create an epoll instance",
            source: io::Error::from_raw_os_error(24),
        };
        let source = std::error::Error::source(&error).expect("a source");
        let io = source.downcast_ref::<io::Error>().expect("the io::Error");
        assert_eq!(io.raw_os_error(), Some(24));
        let shown = error.to_string();
        assert!(shown.contains("cannot create an epoll instance"), "{shown}");
    }
}
