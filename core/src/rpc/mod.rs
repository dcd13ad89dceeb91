//! The pure foundation of the RPC agent (PyTorch's TensorPipe agent): every decision and
//! every wire format, with no I/O.
//!
//! | module | decides |
//! |---|---|
//! | [`name`] | which worker names and ids are valid; [`WorkerInfo`](name::WorkerInfo) |
//! | [`store_keys`] | the agent's store keys and values, and the checks on what it reads back |
//! | [`address`] | a worker's published address: its listeners' addresses, joined and looked up |
//! | [`frame`] | the frame format on one pipe, and the handshake inside it |
//! | [`lending`] | when buffers lent to the peer (cma, xth) come back, and which replies are acked |
//! | [`pipe`] | one pipe's protocol: which replies reach a call, what is acked, when lent buffers come back |
//! | [`rref`] | the RRef reference-counting protocol: owners, users, forks, and when an owner value is deleted |
//! | [`timeouts`] | which call times out next (`rpc_timeout`) |
//! | [`membership`] | the join/leave announcements of a dynamic group |
//! | [`startup`] | the static group's start-up and a dynamic newcomer's join, as state machines over the same operations |
//! | [`step`] | nothing: the actions the store-step machines ask for, their outcomes, and the group start-up hands over |
//! | [`shutdown`] | the graceful-shutdown (`join`) barrier protocol, as a state machine over store operations |
//! | [`token`] | the dynamic group's store token, taken and given back around a join or leave, as machines over the same operations |
//! | [`metrics`] | the agent's counters and per-peer network data, and their `get_metrics` listing |
//! | [`backend`] | the RPC backend registry (`register_backend`) |
//! | [`restricted`] | restricted mode's wire format: calls, results and exceptions as plain tagged values, no pickle |
//!
//! The runtime (`rdzv-uring`) owns sockets, the store client, clocks and threads: it moves
//! bytes and keeps time, and asks these modules what to do.

pub mod address;
pub mod auth;
pub mod backend;
pub mod frame;
pub mod lending;
pub mod membership;
pub mod metrics;
pub mod name;
pub mod pipe;
pub mod restricted;
pub mod rref;
pub mod shutdown;
pub mod startup;
pub mod step;
pub mod store_keys;
pub mod timeouts;
pub mod token;
