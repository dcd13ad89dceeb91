//! [`BenchError`]: what every `rdzv bench` mode returns, each variant with what failed
//! and where, and the underlying error as its source.
//!
//! A leaf of the bench tree (it names only `cpu`'s error type, and `cpu` names no bench
//! module), so the harness, the drivers and the reports can all return it. It does not
//! decide how an error is shown (`main` prints the chain on one line).

use std::net::SocketAddr;
use std::path::PathBuf;

use rdzv_core::store::codec::DecodeError;

/// What can go wrong in a benchmark: measuring a store, running the RPC pair, drawing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// `--addr` did not resolve.
    #[error("cannot resolve the store address {addr}: {source}")]
    Resolve {
        /// What was given.
        addr: String,
        /// The resolver's error.
        #[source]
        source: std::io::Error,
    },
    /// The embedded server did not start.
    #[error("cannot start the embedded store server: {0}")]
    Server(#[from] rdzv_uring::server::ServerError),
    /// A connection could not be made.
    #[error("cannot connect to the store at {addr}: {source}")]
    Connect {
        /// The store.
        addr: SocketAddr,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// A socket (or epoll) call failed.
    #[error("cannot {what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The server's reply did not decode.
    #[error("malformed reply to {query}: {source}")]
    Decode {
        /// The query it answers.
        query: &'static str,
        /// The codec's error.
        #[source]
        source: DecodeError,
    },
    /// The server's reply decoded but was not what the protocol or the load expects.
    #[error("unexpected reply to {query}: expected {expected}")]
    UnexpectedReply {
        /// The query it answers.
        query: &'static str,
        /// What was expected.
        expected: &'static str,
    },
    /// Bytes arrived while no reply was owed.
    #[error("the server sent {len} bytes that answer no request")]
    UnexpectedBytes {
        /// How many.
        len: usize,
    },
    /// The server closed a connection in the middle of the load.
    #[error("the server closed the connection")]
    ServerClosed,
    /// CPU accounting (`--server-pid`) could not read a process's CPU time.
    #[error("cannot measure CPU time: {0}")]
    CpuTime(#[source] super::cpu::CpuTimeError),
    /// Not every connection was ready in time.
    #[error("only {ready} of {wanted} connections were ready after {seconds:.1} s")]
    SetupTimeout {
        /// Connections that had their PING answered.
        ready: usize,
        /// Connections wanted.
        wanted: usize,
        /// The limit.
        seconds: f64,
    },
    /// The open-file limit is too low for the run, even raised to its hard limit.
    #[error(
        "this run needs about {needed} open files but the limit is {limit} even after raising \
         the soft limit to the hard limit; raise the hard limit (`ulimit -Hn`, \
         /etc/security/limits.conf, or systemd LimitNOFILE)"
    )]
    FdLimit {
        /// Descriptors the run needs.
        needed: u64,
        /// The limit after raising.
        limit: u64,
    },
    /// A latency histogram could not be created or merged.
    #[error("latency histogram: {0}")]
    Histogram(String),
    /// The plot could not be drawn or written.
    #[error("cannot draw the plot: {0}")]
    Plot(String),
    /// A client thread panicked.
    #[error("a client thread panicked")]
    ClientThreadPanicked,
    /// An option's value is out of range.
    #[error("{0}")]
    InvalidArgument(String),
    /// `bench plot`'s input could not be read.
    #[error("cannot read {}: {source}", path.display())]
    ReadInput {
        /// The file (`-` for stdin).
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// `bench plot`'s input is not `bench store --json` output.
    #[error("{}: {reason}", path.display())]
    ParseInput {
        /// The file.
        path: PathBuf,
        /// Which line, and what is wrong with it.
        reason: String,
    },
    /// A socket call with `bench rpc`'s raw echo server failed.
    #[error("the raw echo server at {addr}: {what} failed: {source}")]
    RawEcho {
        /// The server.
        addr: SocketAddr,
        /// What was being done.
        what: &'static str,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The RPC benchmark's agent did not start.
    #[error("{0}")]
    Agent(#[source] Box<rdzv_uring::rpc::InitError>),
    /// An RPC call of the benchmark failed (the error names the peer).
    #[error("{0}")]
    Call(#[source] Box<rdzv_uring::rpc::CallError>),
    /// The agent did not leave its group.
    #[error("{0}")]
    Leave(#[source] Box<rdzv_uring::rpc::ShutdownError>),
    /// The store the two sides of `bench rpc` agree through failed.
    #[error("the benchmark's store at {addr}: {what}: {source}")]
    SessionStore {
        /// The store.
        addr: SocketAddr,
        /// What was being done (the key, where there is one).
        what: String,
        /// The store's error.
        #[source]
        source: Box<rdzv_uring::StoreError>,
    },
    /// A record the two sides of `bench rpc` exchange did not encode or decode.
    #[error("{what}: {source}")]
    Record {
        /// Which record, and which way.
        what: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// A CUDA call of the benchmark failed.
    #[error("{what}: {source}")]
    Cuda {
        /// What was being done, on which device.
        what: String,
        /// The driver's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// What came back is not what was sent.
    #[error("{what}: {source}")]
    Echo {
        /// Which echo or copy.
        what: String,
        /// How it differs.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// One (transport, channels) pair of `bench rpc` failed.
    #[error("{pair}: {source}")]
    Pair {
        /// The pair, as `transport/channels`.
        pair: String,
        /// What failed.
        #[source]
        source: Box<BenchError>,
    },
    /// Something is not as the run expects: the two sides of `bench rpc` disagree, one
    /// of them went away or failed (its reason arrives as text), or an answer has the
    /// wrong shape. The text says which.
    #[error("{0}")]
    Unexpected(String),
    /// `bench store simulate`: a reply or a wake-up was not what the protocol owes.
    #[error("simulation of {ranks} ranks: rank {rank}: {what}")]
    Simulation {
        /// Ranks simulated.
        ranks: usize,
        /// The rank whose request went wrong.
        rank: usize,
        /// What went wrong.
        what: String,
    },
}

impl BenchError {
    /// An option's value that is out of range, and why.
    pub(crate) fn invalid(why: impl Into<String>) -> BenchError {
        BenchError::InvalidArgument(why.into())
    }

    /// For `map_err`: doing `what` failed with the socket (or file, or thread) error.
    pub(crate) fn io(what: &'static str) -> impl Fn(std::io::Error) -> BenchError + Copy {
        move |source| BenchError::Io { what, source }
    }
}

impl From<rdzv_uring::rpc::InitError> for BenchError {
    fn from(source: rdzv_uring::rpc::InitError) -> BenchError {
        BenchError::Agent(Box::new(source))
    }
}

impl From<rdzv_uring::rpc::CallError> for BenchError {
    fn from(source: rdzv_uring::rpc::CallError) -> BenchError {
        BenchError::Call(Box::new(source))
    }
}

impl From<rdzv_uring::rpc::ShutdownError> for BenchError {
    fn from(source: rdzv_uring::rpc::ShutdownError) -> BenchError {
        BenchError::Leave(Box::new(source))
    }
}
