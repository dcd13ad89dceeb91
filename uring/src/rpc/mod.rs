//! The RPC agent (PyTorch's TensorPipe agent), Rust-native: [`init_rpc`] joins a static
//! or dynamic group through any rendezvous URL, handlers are registered by name, and
//! [`RpcAgent::rpc_sync`], [`RpcAgent::rpc_async`] and [`RpcAgent::remote`] call them on
//! peers with a [`Message`] (metadata, payload, tensors tagged with a device).
//!
//! Every decision is the core's (`rdzv_core::rpc`, `rdzv_core::negotiate`,
//! `rdzv_core::device_map`): worker names, store keys and checks, the frame format and
//! handshake, transport and channel negotiation, timeouts, the `join` barrier protocol,
//! metrics. This module owns the threads, sockets, store client and clock.
//!
//! | module | does |
//! |---|---|
//! | [`agent`] | `init_rpc`, the user-facing handle, the worker pool, `join`/`shutdown` |
//! | `io` | the handshake thread: one glommio executor that accepts, connects, runs handshakes, then hands each pipe to a lane |
//! | `lane` | every pipe once its handshake is done, served by threads and driven by the core's pipe machine (`rdzv_core::rpc::pipe`) |
//! | `faults` | fault injection, a decorator on client lanes' senders |
//! | `outgoing` | messages into frames: each tensor's channel, what a frame lends, the receivers' limits |
//! | `mpt` | the `mpt` channel's extra connections per pipe, and when a pipe has them |
//! | `calls` | every call in flight, and the one timer thread for their deadlines |
//! | [`transport`] | the transport seam (see there for how shm and ibv fit) and [`TransportPlugin`] |
//! | [`tcp`] | the `tcp` transport on glommio, and on a blocking socket for lanes |
//! | [`shm`] | the `shm` transport: shared-memory rings |
//! | [`channels`] | which channels this process offers; tensors into frames (inline or exported) and back (pulled) |
//! | [`backend`] | the backend registry (`register_backend`, `TENSORPIPE`, `FAULTY_TENSORPIPE`) |
//! | [`client`] | the calling half, a clonable handle for threads and handlers |
//! | [`device`] | tensors in device memory, and [`DevicePlugin`], the seam for CUDA runtimes (`cuda_basic`) |
//! | [`message`] | messages, handlers, futures |
//! | [`error`] | errors |
//! | [`rref`] | remote references: `remote()`'s [`RRef`], `to_here`, forks, the core's RRef machine driven over reserved handlers |
//!
//! Threads: on a lane (every pipe, see `lane`) a caller's thread sends its own
//! request and, in `rpc_sync`, reads its own reply for a while; one reader thread per
//! pipe completes the other calls and runs [`Inline`] handlers; a call whose pipe is
//! not open yet goes through a mailbox to the I/O thread (glommio, io_uring), which
//! accepts, connects and handshakes. One timer thread
//! fails calls past their deadline; `num_worker_threads` threads run handlers and send
//! their responses.
//!
//! In this increment: static and dynamic groups, the `shm` and `tcp` transports (shm
//! is negotiated between workers on one host (shared memory permitting); every pipe
//! bootstraps over tcp, the lowest-priority transport, and moves to shm when both sides
//! offer it), the `xth`, `cma`, `mpt` and `basic` channels (CPU tensors of at least
//! [`RpcOptions::min_channel_bytes`] move beside the pipe within a process or a host,
//! or striped over [`RpcOptions::mpt_lanes`] extra TCP connections between hosts;
//! smaller ones, and all where no channel was negotiated, inline in the pipe's frames),
//! and fault injection for tests ([`FaultInjection`]). Other transports plug in through
//! [`TransportPlugin`] ([`RpcOptions::transport_plugins`]):
//! `rdzv_rdma::ibv::transport::IbvPlugin` provides `ibv`. CUDA tensors move when a CUDA
//! runtime is plugged in through [`DevicePlugin`] ([`RpcOptions::device_plugins`];
//! `rdzv_rdma::cuda::agent::CudaPlugin`): lent device to device over `cuda_xth`,
//! `cuda_ipc` or `cuda_gdr` where the runtime runs them, or staged through host memory
//! over the CPU channel (`cuda_basic`).

pub mod agent;
pub mod backend;
mod calls;
pub mod channels;
pub mod client;
pub mod device;
pub mod error;
mod faults;
mod io;
mod lane;
pub mod message;
mod mpt;
mod outgoing;
mod recycle;
pub mod rref;
mod shared;
pub mod shm;
pub mod tcp;
pub mod transport;

pub use agent::{init_rpc, FaultInjection, RpcAgent, RpcOptions, DEFAULT_NUM_WORKER_THREADS};
pub use backend::{backend_registered, init_rpc_with_backend, register_backend};
pub use channels::DEFAULT_MIN_CHANNEL_BYTES;
pub use client::RpcClient;
pub use device::{
    DeviceBuffer, DeviceLoan, DeviceMemory, DevicePlugin, DeviceRuntime, HostBytes, HostMemory,
    PipeId, StagedBytes, StagedReceive,
};
pub use error::{RpcError, TransportError};
pub use message::{CallContext, Handler, Inline, Message, RpcFuture, Tensor};
pub use mpt::DEFAULT_MPT_LANES;
pub use rdzv_core::rpc::rref::{DebugInfo as RRefDebugInfo, RetryOptions as RRefRetryOptions};
pub use rref::{RRef, RRefLeak, RRefShutdownReport, UserRRef};
pub use transport::TransportPlugin;
