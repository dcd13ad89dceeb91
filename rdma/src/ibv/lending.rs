//! Lending registered memory to peers on other hosts, who fetch it with one-sided RDMA
//! READs: the data path of `cuda_gdr` (GPUDirect RDMA), with nothing CUDA in it, so the
//! same code moves host memory (and is tested that way on Soft-RoCE).
//!
//! - The lender runs a [`LendingEndpoint`]: a TCP listener whose accepted connections
//!   each bootstrap an RC queue pair ([`IbvConnection::connect_in`], in the endpoint's
//!   [`VerbsDomain`]) and keep it until the peer closes the TCP connection or the
//!   endpoint stops. The lender registers what it lends in that domain ([`HostRegion`]
//!   for host memory, `crate::cuda::gdr::GdrRegistrar` on [`VerbsDomain::pd`] for device
//!   memory) and tells the peer the endpoint's address, the memory's address, its rkey and
//!   length. Its CPU takes no part in a read.
//! - The borrower's [`Borrower`] keeps one connection per lender endpoint and reads a lent
//!   range into a [`ReadTarget`]: memory it registered in its own domain (a [`HostRegion`],
//!   or device memory). A failed read drops that connection, so the next one reconnects.
//!
//! Every wait is bounded ([`LendingOptions`]): connecting, the bootstrap exchange and each
//! read. A READ outside the lender's registration, or with a wrong key, fails with
//! `IBV_WC_REM_ACCESS_ERR` (named in the error), never by reading something else.
//!
//! This module does not decide what is lent or when a loan ends (the agent's lending rule
//! does), and does not encode descriptors (`rdzv_core::channel::cuda`).

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use tracing::debug;

use super::connection::{ConnectionError, ConnectionOptions, IbvConnection, VerbsDomain};
use super::select::IbvSelection;
use super::sys::AccessFlags;
pub use super::sys::{HostRegion, ReadTarget};

/// How often the endpoint's threads look at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Time limits of lending.
#[derive(Debug, Clone)]
pub struct LendingOptions {
    /// Connecting to a lender endpoint, and each step of the queue pair bootstrap.
    pub bootstrap_timeout: Duration,
    /// One read, all of its READs together.
    pub read_timeout: Duration,
}

impl Default for LendingOptions {
    fn default() -> Self {
        LendingOptions {
            bootstrap_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(60),
        }
    }
}

/// The connection options of a lending connection: no ring traffic, so small rings.
fn connection_options() -> ConnectionOptions {
    ConnectionOptions {
        ring_len: 4096,
        recv_slots: 4,
        ..ConnectionOptions::default()
    }
}

/// Errors of lending and borrowing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LendingError {
    /// The endpoint's listener could not be made.
    #[error("cannot listen for RDMA lending connections on {addr}")]
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The lender's endpoint could not be reached.
    #[error("cannot connect to the RDMA lending endpoint {lender}")]
    Connect {
        /// The lender's endpoint.
        lender: SocketAddr,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The queue pair could not be set up with the lender.
    #[error("RDMA queue pair setup with the lending endpoint {lender} failed")]
    Bootstrap {
        /// The lender's endpoint.
        lender: SocketAddr,
        /// Why.
        #[source]
        source: ConnectionError,
    },
    /// Host memory could not be registered.
    #[error("cannot register {len} bytes of host memory on RDMA device {device}")]
    Register {
        /// Bytes.
        len: usize,
        /// Device name.
        device: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A read failed (the status is in the source, e.g. `IBV_WC_REM_ACCESS_ERR`).
    #[error(
        "RDMA read of {len} bytes at {remote_addr:#x} (rkey {rkey:#x}) from the lending \
         endpoint {lender} failed"
    )]
    Read {
        /// The lender's endpoint.
        lender: SocketAddr,
        /// The lent address.
        remote_addr: u64,
        /// The key used.
        rkey: u32,
        /// Bytes.
        len: u64,
        /// Why.
        #[source]
        source: ConnectionError,
    },
}

/// A lender's endpoint: accepts queue pair bootstraps from borrowers, in one verbs domain
/// where the lent memory is registered. Dropping it stops accepting, closes its queue
/// pairs and waits for its threads (each looks at a stop flag every 50 ms, and one still
/// bootstrapping a queue pair within the bootstrap timeout); memory
/// registered in its domain stays registered until its own registrations are dropped.
pub struct LendingEndpoint {
    domain: VerbsDomain,
    local: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl fmt::Debug for LendingEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LendingEndpoint")
            .field("device", &self.domain.device())
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl LendingEndpoint {
    /// Listens on `bind` (port 0 picks one) and serves queue pairs on `selection`'s port
    /// in `domain` (opened on the same device).
    ///
    /// # Errors
    /// [`LendingError::Listen`].
    pub fn start(
        selection: &IbvSelection,
        domain: VerbsDomain,
        bind: SocketAddr,
        options: &LendingOptions,
    ) -> Result<LendingEndpoint, LendingError> {
        let listen_err = |source| LendingError::Listen { addr: bind, source };
        let listener = TcpListener::bind(bind).map_err(listen_err)?;
        let local = listener.local_addr().map_err(listen_err)?;
        listener.set_nonblocking(true).map_err(listen_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let (selection, domain, stop) = (selection.clone(), domain.clone(), stop.clone());
            let timeout = options.bootstrap_timeout;
            thread::Builder::new()
                .name("rdzv-lending".into())
                .spawn(move || accept_loop(&listener, &selection, &domain, &stop, timeout))
                .map_err(listen_err)?
        };
        Ok(LendingEndpoint {
            domain,
            local,
            stop,
            accept: Some(accept),
        })
    }

    /// The address the endpoint listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The verbs domain lent memory must be registered in.
    pub fn domain(&self) -> &VerbsDomain {
        &self.domain
    }
}

impl Drop for LendingEndpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn accept_loop(
    listener: &TcpListener,
    selection: &IbvSelection,
    domain: &VerbsDomain,
    stop: &Arc<AtomicBool>,
    timeout: Duration,
) {
    let mut served: Vec<JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let (selection, domain, stop) = (selection.clone(), domain.clone(), stop.clone());
                let spawned = thread::Builder::new()
                    .name("rdzv-lending-qp".into())
                    .spawn(move || serve(stream, peer, &selection, &domain, &stop, timeout));
                match spawned {
                    Ok(handle) => served.push(handle),
                    Err(e) => debug!(%peer, error = %e, "cannot serve a lending connection"),
                }
                served.retain(|handle| !handle.is_finished());
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(STOP_POLL),
            Err(e) => {
                debug!(error = %e, "accepting a lending connection failed");
                thread::sleep(STOP_POLL);
            }
        }
    }
    for handle in served {
        let _ = handle.join();
    }
}

/// Bootstraps one queue pair with a borrower and keeps it until the borrower closes the
/// TCP connection or the endpoint stops.
fn serve(
    mut stream: TcpStream,
    peer: SocketAddr,
    selection: &IbvSelection,
    domain: &VerbsDomain,
    stop: &AtomicBool,
    timeout: Duration,
) {
    let setup = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(timeout)))
        .and_then(|()| stream.set_write_timeout(Some(timeout)));
    if let Err(e) = setup {
        debug!(%peer, error = %e, "cannot set up a lending connection");
        return;
    }
    let connection =
        match IbvConnection::connect_in(domain, selection, &mut stream, &connection_options()) {
            Ok(connection) => connection,
            Err(e) => {
                debug!(%peer, error = %e, "lending queue pair setup failed");
                return;
            }
        };
    debug!(%peer, qpn = connection.qp_number(), "lending queue pair ready");
    if let Err(e) = stream.set_read_timeout(Some(STOP_POLL)) {
        debug!(%peer, error = %e, "cannot poll the lending connection");
        return;
    }
    let mut byte = [0u8; 1];
    while !stop.load(Ordering::Relaxed) {
        match stream.read(&mut byte) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => break,
        }
    }
    debug!(%peer, "lending queue pair closed");
    drop(connection);
}

/// One cached connection to a lender: the queue pair, and the TCP stream whose close tells
/// the lender to drop its end.
struct Connection {
    connection: IbvConnection,
    _stream: TcpStream,
}

/// The borrowing side: one connection per lender endpoint, made on first use.
pub struct Borrower {
    selection: IbvSelection,
    domain: VerbsDomain,
    options: LendingOptions,
    connections: Mutex<HashMap<SocketAddr, Arc<Mutex<Connection>>>>,
}

impl fmt::Debug for Borrower {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Borrower")
            .field("device", &self.domain.device())
            .field("connections", &self.connections())
            .finish_non_exhaustive()
    }
}

impl Borrower {
    /// A borrower on `selection`'s port, reading into memory registered in `domain`.
    pub fn new(selection: &IbvSelection, domain: VerbsDomain, options: LendingOptions) -> Self {
        Borrower {
            selection: selection.clone(),
            domain,
            options,
            connections: Mutex::new(HashMap::new()),
        }
    }

    /// The verbs domain read targets must be registered in.
    pub fn domain(&self) -> &VerbsDomain {
        &self.domain
    }

    /// Lender endpoints with a cached connection.
    pub fn connections(&self) -> usize {
        self.cached().len()
    }

    /// The cached connections, locked.
    fn cached(&self) -> MutexGuard<'_, HashMap<SocketAddr, Arc<Mutex<Connection>>>> {
        self.connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Reads `target.len()` bytes the lender at `lender` lent at `remote_addr` under
    /// `rkey` into `target`, and hands it back filled.
    ///
    /// # Errors
    /// [`LendingError::Connect`] or [`LendingError::Bootstrap`] for the first read from a
    /// lender, [`LendingError::Read`] naming the work completion status. After a failed
    /// read whose READs could not all be flushed, `target` is leaked, never freed while
    /// the device may write into it.
    pub fn read_into<T: ReadTarget>(
        &self,
        lender: SocketAddr,
        target: T,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<T, LendingError> {
        let len = target.len();
        if len == 0 {
            return Ok(target);
        }
        let connection = self.connection(lender)?;
        let mut guard = connection.lock().unwrap_or_else(PoisonError::into_inner);
        // `target` is registered in this borrower's domain, in which every cached connection
        // is made (ReadTarget); the connection leaks it if READs into it may still be in
        // flight after a failure.
        let result =
            guard
                .connection
                .read_remote(target, remote_addr, rkey, self.options.read_timeout);
        result.map_err(|source| {
            drop(guard);
            self.forget(lender, &connection);
            LendingError::Read {
                lender,
                remote_addr,
                rkey,
                len,
                source,
            }
        })
    }

    /// Reads `len` lent bytes into fresh host memory.
    ///
    /// # Errors
    /// As [`read_into`](Self::read_into), or the host memory could not be registered.
    pub fn read_to_host(
        &self,
        lender: SocketAddr,
        remote_addr: u64,
        rkey: u32,
        len: usize,
    ) -> Result<Vec<u8>, LendingError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let region = HostRegion::new(&self.domain, len, AccessFlags::LOCAL_WRITE)?;
        let region = self.read_into(lender, region, remote_addr, rkey)?;
        Ok(region.to_vec())
    }

    /// The cached connection to `lender`, made now if there is none.
    fn connection(&self, lender: SocketAddr) -> Result<Arc<Mutex<Connection>>, LendingError> {
        if let Some(cached) = self.cached().get(&lender) {
            return Ok(Arc::clone(cached));
        }
        let timeout = self.options.bootstrap_timeout;
        let connect_err = |source| LendingError::Connect { lender, source };
        let mut stream = TcpStream::connect_timeout(&lender, timeout).map_err(connect_err)?;
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .and_then(|()| stream.set_nodelay(true))
            .map_err(connect_err)?;
        let connection = IbvConnection::connect_in(
            &self.domain,
            &self.selection,
            &mut stream,
            &connection_options(),
        )
        .map_err(|source| LendingError::Bootstrap { lender, source })?;
        debug!(%lender, qpn = connection.qp_number(), "borrowing queue pair ready");
        let made = Arc::new(Mutex::new(Connection {
            connection,
            _stream: stream,
        }));
        let mut connections = self.cached();
        // Another thread may have connected meanwhile: keep the first.
        Ok(Arc::clone(connections.entry(lender).or_insert(made)))
    }

    /// Drops the cached connection to `lender` if it is still `connection`.
    fn forget(&self, lender: SocketAddr, connection: &Arc<Mutex<Connection>>) {
        let mut connections = self.cached();
        if connections
            .get(&lender)
            .is_some_and(|cached| Arc::ptr_eq(cached, connection))
        {
            connections.remove(&lender);
        }
    }
}

impl HostRegion {
    /// `len` (at least 1) zeroed, page-aligned bytes registered in `domain` with `access`.
    ///
    /// # Errors
    /// [`LendingError::Register`] when `len` is 0, the memory cannot be allocated, or
    /// `ibv_reg_mr` fails.
    pub fn new(
        domain: &VerbsDomain,
        len: usize,
        access: AccessFlags,
    ) -> Result<HostRegion, LendingError> {
        HostRegion::register(domain.pd(), len, access).map_err(|source| LendingError::Register {
            len,
            device: domain.device().to_owned(),
            source,
        })
    }

    /// A registered copy of `bytes` (at least one), for lending with `access` (e.g.
    /// [`AccessFlags::REMOTE_READ`]).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn from_bytes(
        domain: &VerbsDomain,
        bytes: &[u8],
        access: AccessFlags,
    ) -> Result<HostRegion, LendingError> {
        let mut region = HostRegion::new(domain, bytes.len(), access)?;
        // No work request uses the region yet.
        region.write_at(0, bytes);
        Ok(region)
    }
}
