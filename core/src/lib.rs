//! `rdzv-core`: the pure, deterministic heart of rdzv.
//!
//! Everything in this crate is *sans-IO*: values, bytes and `now` go in, decisions and
//! bytes come out. It never touches a socket, a file, a clock or a thread, so it runs
//! unchanged on bare metal (`--no-default-features`), with a heap (`alloc`, the
//! default) or with `std`.
//!
//! | module | decides |
//! |---|---|
//! | [`url`] | how a rendezvous URL splits into parts (Python `urlparse` semantics) |
//! | [`query`] | how a query string becomes key/value pairs (`_query_to_dict`) |
//! | [`env`](mod@env) | the environment lookup seam the caller supplies |
//! | [`rendezvous`] | URL rewriting, the handler registry, static `tcp`/`env`/`file` plans and the elastic rendezvous state machine |
//! | [`device`] | `cpu`, `cuda`, `cuda:N` devices |
//! | [`channel`] | the tensor channels' wire records (cma/xth/mpt descriptors, acks, stripe headers, connection hellos) |
//! | [`device_map`] | device-map validation, reverse maps and device lists (alloc) |
//! | [`negotiate`] | which transport and channels two peers use |
//! | [`store`] | the TCPStore wire codec and the store state machine |
//! | [`rpc`] | the RPC agent's names, store layout, frames, timeouts, shutdown protocol and metrics (alloc) |
//! | [`verbs_ring`] | the verbs message ring: placement, credits, acknowledgements and large-message reads (alloc) |
#![no_std]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "alloc")]
extern crate alloc;
#[cfg(any(feature = "std", test))]
extern crate std;

pub mod channel;
pub mod device;
#[cfg(feature = "alloc")]
pub mod device_map;
pub mod env;
#[doc(hidden)]
pub mod fuzzing;
pub mod negotiate;
pub mod query;
pub mod rendezvous;
#[cfg(feature = "alloc")]
pub mod rpc;
pub mod store;
pub mod url;
#[cfg(feature = "alloc")]
pub mod verbs_ring;
