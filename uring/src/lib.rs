//! `rdzv-uring`: the runtime half of rdzv. It owns sockets, files, timers and threads,
//! and drives the pure `rdzv-core` with them.
//!
//! - [`server`]: the TCPStore server, byte-compatible with PyTorch's clients: its own
//!   event loops (`--threads N`) on io_uring, or on epoll where io_uring is refused,
//!   sharing one engine.
//! - [`store`]: the `Store` trait and its implementations: the TCP client, the file,
//!   prefix and hash stores.
//! - [`rendezvous`]: `rendezvous(url, rank, world_size)` for `tcp://`, `env://`,
//!   `file://` and registered schemes, driven by the core's plans.
//! - [`rpc`]: the RPC agent (TensorPipe's): the `tcp` and `shm` transports here, `ibv`
//!   and CUDA device runtimes plugged in from `rdzv-rdma`.
//! - [`shm`]: shared-memory rings between processes of one host, carrying byte
//!   messages (the RPC agent's `shm` transport runs on them).
//! - [`host`]: what identifies this host, boot and namespaces (for same-host channels).
//! - [`queue`]: the one queue between threads and executor tasks.
//! - [`channel`]: tensor channels for the RPC agent (`cma`, `xth`, `mpt`); their wire records are `rdzv_core::channel`'s.
//!
//! # Where the `unsafe` code is
//!
//! Only in `sys` (not public): the io_uring whose operations own their buffers, the
//! shared-memory segment mapping, `process_vm_readv`, the huge-page hint, a fallible
//! zeroed allocation and inherited descriptors. Every other module is built under
//! `#![deny(unsafe_code)]` and uses their safe wrappers.
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod channel;
pub mod host;
pub mod queue;
pub mod rendezvous;
pub mod rpc;
pub mod server;
pub mod shm;
pub mod store;
#[allow(unsafe_code)]
mod sys;

pub use server::{IoMode, ServerOptions, ServerStats, StoreServer};

/// The `tracing` target of lines written for a person waiting at a terminal ("connecting
/// to H:P, retrying for 28 s more: …"): the `rdzv` command prints them bare, without the
/// time, level and module a log line carries.
pub const NOTICE: &str = "rdzv::notice";
pub use store::{Store, StoreError};
