//! `rdzv-rdma`: rdzv's RDMA (InfiniBand verbs) and CUDA layer.
//!
//! # What it does today
//!
//! It answers one question per technology: *can it be used on this host, and with what?*
//!
//! - [`ibv::probe`] checks that libibverbs loads ([`ibv::sys`] opens `libibverbs.so.1` at
//!   run time, as NCCL and TensorPipe do, so building needs no rdma-core), that the kernel
//!   has verbs support, and picks a device, port and GID: by
//!   `RDZV_IB_DEVICE` / `RDZV_IB_PORT` / `RDZV_IB_GID_INDEX` (or [`ibv::IbvConfig`]), or else
//!   the first device with an `ACTIVE` port, its RoCE v2 IPv4 GID on Ethernet or GID 0 and
//!   its LID on InfiniBand. TensorPipe hard-codes device 0, port 1 and GID 0 instead. The
//!   choice itself is a pure function ([`ibv::select::select`]) over a plain description of
//!   the host ([`ibv::topology`]), tested without hardware.
//! - [`cuda::probe`] checks that the CUDA driver library loads (cudarc, dynamically
//!   loaded, guarded against cudarc's panics), that `cuInit` succeeds and devices exist, and
//!   reports each device plus the GPUDirect RDMA prerequisites (dma-buf support, peer-memory
//!   kernel module) as separate facts.
//! - [`ViabilityReport`] combines both for `rdzv rdma probe`, with a human `Display` and a
//!   stable `key: value` field layout.
//!
//! Neither probe panics or aborts on a host without RDMA hardware, without rdma-core, or
//! without an NVIDIA driver: each returns "not viable" with the specific reason.
//!
//! # Moving bytes over verbs
//!
//! [`ibv::connection::IbvConnection`] connects one RC queue pair to a peer over any
//! `Read + Write` bootstrap stream (connection record: [`ibv::wire`]), sends small messages
//! through a registered ring per direction with RDMA write-with-immediate, credit acks and
//! inline data (core's `rdzv_core::verbs_ring` decides placement, credits and acks), and large ones
//! zero-copy: the peer fetches the registered user buffer with RDMA READ (registrations
//! cached by address range in [`ibv::regcache`]). Completions are busy-polled, then waited
//! for on a completion channel; a failed work completion fails the connection with its
//! operation and status name ([`ibv::wc_status`]).
//!
//! [`ibv::transport`] makes the connection the RPC agent's `ibv` transport: add
//! [`ibv::transport::IbvPlugin`] to `RpcOptions::transport_plugins` and list `"ibv"` in
//! `transports`; pipes bootstrap over tcp and move to ibv where both workers' ports can
//! reach each other, and large payloads and tensors travel zero-copy.
//!
//! The data path is tested on a real verbs stack by `rdma/softroce/run` (Soft-RoCE in a
//! qemu VM), an RPC exchange between two processes included; on hosts without verbs those
//! tests print why they are skipped.
//!
//! # What comes next (not implemented yet)
//!
//! - One shared CQ/SRQ across peers (today each pipe has its own queue pair, rings and
//!   thread), and receiving into caller-provided memory.
//! - The CUDA channels (`cuda_xth`, `cuda_ipc`, `cuda_gdr`, `cuda_basic`) have one
//!   implementation, the RPC agent's CUDA runtime ([`cuda::agent`]). `cuda_ipc`'s
//!   completion through IPC events is tested with a fake GPU only; its figures on a GPU
//!   are still to be measured.
//!
//! # Where the `unsafe` code is
//!
//! Only in `sys` (not public): `sys::ibv` (libibverbs, re-exported as [`ibv::sys`]) and
//! `sys::cuda` (the CUDA driver calls; its types are re-exported by [`cuda::memory`]).
//! Every other module is built under `#![deny(unsafe_code)]` and uses their safe
//! wrappers.
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod cuda;
mod error_chain;
#[doc(hidden)]
pub mod fuzzing;
pub mod ibv;
mod report;
#[allow(unsafe_code)]
mod sys;

pub use report::ViabilityReport;
