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
//! | `io` | the I/O thread: one glommio executor with every pipe, the listener and the timer |
//! | [`transport`] | the transport seam (see there for how shm and ibv fit) |
//! | [`tcp`] | the `tcp` transport on glommio |
//! | [`shm`] | the `shm` transport: shared-memory rings, one thread per half |
//! | [`channels`] | which channels this process offers; tensors into frames (inline or exported) and back (pulled) |
//! | [`backend`] | the backend registry (`register_backend`, `TENSORPIPE`, `FAULTY_TENSORPIPE`) |
//! | [`client`] | the calling half, a clonable handle for threads and handlers |
//! | [`message`] | messages, handlers, futures |
//! | [`error`] | errors |
//!
//! Threads: the caller's threads enqueue calls into a mailbox and wait on futures; one
//! I/O thread (glommio, io_uring) runs every pipe, the accept loop and one timer for all
//! timeouts; `num_worker_threads` threads run handlers and enqueue their responses.
//!
//! In this increment: static and dynamic groups, the `shm` and `tcp` transports (shm
//! is negotiated between workers on one host; every pipe bootstraps over tcp, the
//! lowest-priority transport, and moves to shm when both sides offer it), the `xth`,
//! `cma` and `basic` channels (CPU tensors of at least
//! [`RpcOptions::min_channel_bytes`] move beside the pipe within a process or a host;
//! smaller ones, and all where no channel was negotiated, inline in the pipe's frames),
//! and fault injection for tests ([`FaultInjection`]). ibv, mpt and the CUDA channels
//! are not wired in yet; asking for them is an error that says so.

pub mod agent;
pub mod backend;
pub mod channels;
pub mod client;
pub mod error;
mod io;
pub mod message;
mod shared;
pub mod shm;
pub mod tcp;
pub mod transport;

pub use agent::{init_rpc, FaultInjection, RpcAgent, RpcOptions, DEFAULT_NUM_WORKER_THREADS};
pub use backend::{backend_registered, init_rpc_with_backend, register_backend};
pub use channels::DEFAULT_MIN_CHANNEL_BYTES;
pub use client::RpcClient;
pub use error::{RpcError, TransportError};
pub use message::{CallContext, Handler, Message, RpcFuture, Tensor};
