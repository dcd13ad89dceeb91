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
//! The modules form layers, lowest first; each names only modules below it
//! (`uring/tests/rpc_layering.rs` checks this from the sources):
//!
//! | layer | modules | do |
//! |---|---|---|
//! | memory | [`error`], `recycle`, [`device`] | errors by what the caller can do ([`InitError`], [`CallError`], [`ShutdownError`], [`UsageError`]); recycled large buffers; tensors in device memory and [`DevicePlugin`], the seam for CUDA runtimes (`cuda_basic`) |
//! | calls | [`message`], [`rref`], [`client`], [`handler`] | messages and futures; the application's [`RRef`], which reaches the RRef runtime through the `RRefRuntime` seam; [`RpcClient`], which calls through the `Caller` seam and knows no pipe; [`CallContext`], [`Handler`], [`Inline`], [`Async`] |
//! | transports | [`transport`], [`tcp_transport`], [`shm_transport`] | the transport seam, four traits (an endpoint, a connection's sender, receiver and control; see there for how shm and ibv fit) and [`TransportPlugin`]; `tcp`, connected by tokio, then blocking sockets; `shm`, over the rings of [`crate::shm`] |
//! | tensors | [`tensors`], `mpt` | which channels this process offers; tensors into frames (inline or exported) and back (pulled); a pipe's mpt connections |
//! | options | [`options`], `faults` | [`RpcOptions`]; fault injection, a decorator on client lanes' senders |
//! | shared pieces | `offer`, `registry`, `counters`, `mailbox` | this worker's offer; the group and handlers; metrics, network data and channel bytes (`Counters`) and the call counts `join` freezes (`JoinGate`); commands for the I/O thread |
//! | in flight | `calls`, `outgoing` | every call in flight and the one timer thread for their deadlines; messages into frames (`Framer`) |
//! | pipes | `lane`, `dispatch`, `io` | every pipe once its handshake is done, served by threads: a `ClientLane` (this worker calls; core's `ClientPipe`) or an `InboundLane` (the peer calls; core's `InboundPipe`), each over one `LaneIo` (inside `lane`, `io` is below `client` and `inbound`, which know nothing of each other), with `LaneContext` (the lanes, the calls table, the framer, devices, mpt, faults) and `Server` (what an inbound lane serves with: handlers, call counts, RRef runtime, the handlers' client); how a call reaches its lane or the mailbox (`Dispatch`, the `Caller`: group, call counts, message ids and default timeout, lanes, mailbox); the handshake thread (one current-thread tokio executor on epoll: accept, connect, handshake, then a lane; `IoPieces`) |
//! | serving | `rref_runtime`, `pool` | the agent's RRefs: core's RRef machine behind one lock, the owner's values, the reserved `__rdzv_rref_*` handlers, the pump thread that sends the machine's messages, `to_here` waits (the pool hands them over), `join`'s settling and leak report; the worker pool |
//! | group | `deadline`, `drive`, [`agent`], `startup`, [`backend`] | a store whose waits end by a shutdown's deadline; one driver for the core's store-step machines (`join`, a leave, the dynamic group's token); the [`RpcAgent`] handle (calls, metrics, `join`/`shutdown`); [`init_rpc`]: probe and rank the options, then the static or dynamic start-up; the backend registry (`register_backend`, `TENSORPIPE`, `FAULTY_TENSORPIPE`) |
//!
//! Threads: on a lane (every pipe, see `lane`) a caller's thread sends its own
//! request and, in `rpc_sync`, reads its own reply for a while; one reader thread per
//! pipe completes the other calls and runs [`Inline`] handlers; a call whose pipe is
//! not open yet goes through a mailbox to the I/O thread (a current-thread tokio
//! runtime on epoll: the agent needs no io_uring), which accepts, connects and
//! handshakes (each handshake's wait for the peer's frame on a short-lived thread).
//! One timer thread
//! fails calls past their deadline; `num_worker_threads` threads run handlers and send
//! their responses.
//!
//! In this increment: static and dynamic groups, the `shm` and `tcp` transports (shm
//! is negotiated between workers on one host (shared memory permitting); every pipe
//! bootstraps over tcp, the lowest-priority transport, and moves to shm when both sides
//! offer it), the `xth`, `cma`, `mpt` and `basic` channels (CPU tensors of at least
//! [`RpcOptions::min_channel_bytes`] move beside the pipe within a process or a host,
//! or striped over [`RpcOptions::mpt_connections`] extra TCP connections between hosts;
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
pub mod client;
mod counters;
mod deadline;
pub mod device;
mod dispatch;
mod drive;
pub mod error;
mod faults;
pub mod handler;
mod io;
mod lane;
mod mailbox;
pub mod message;
mod mpt;
mod offer;
pub mod options;
mod outgoing;
mod pool;
mod recycle;
mod registry;
pub mod rref;
mod rref_runtime;
pub mod shm_transport;
mod startup;
pub mod tcp_transport;
pub mod tensors;
pub mod transport;

pub use agent::RpcAgent;
pub use backend::{backend_registered, init_rpc_with_backend, register_backend};
pub use client::RpcClient;
pub use device::{
    ChannelUnavailable, DeviceBuffer, DeviceError, DeviceErrorSource, DeviceLoan, DeviceMemory,
    DeviceOp, DevicePlugin, DeviceRuntime, HostBytes, HostMemory, PartBuffer, PartedReceive,
    PipeId, StagedBytes, StagedReceive, TensorMemoryError, UnavailableReason,
};
pub use error::{
    error_chain, CallError, CallErrorKind, ChannelCause, ChannelFailure, DevicesError, InitError,
    PipeFailure, RRefFailure, RRefWaitTimeout, RpcError, SharedCause, ShutdownError, StoreOpError,
    TransportError, UsageError,
};
pub use handler::{Async, CallContext, Handler, Inline, Reply};
pub use message::{
    collect_all, wait_all, AllFuture, LentBytes, Message, RpcFuture, RpcPromise, Tensor,
};
pub use mpt::DEFAULT_MPT_CONNECTIONS;
pub use options::{
    FaultInjection, InboundHandshakes, RpcOptions, RpcSecret, ValueReleased,
    DEFAULT_NUM_WORKER_THREADS,
};
pub use rdzv_core::rpc::rref::{DebugInfo as RRefDebugInfo, RetryOptions as RRefRetryOptions};
pub use recycle::give_received as recycle_received;
pub use rref::{RRef, RRefLeak, RRefShutdownReport, UserRRef};
pub use startup::init_rpc;
pub use tensors::DEFAULT_MIN_CHANNEL_BYTES;
pub use transport::TransportPlugin;
