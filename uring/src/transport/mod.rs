//! Transports for the RPC agent: how two endpoints move byte messages once negotiation
//! (`rdzv_core::negotiate`) picked one.
//!
//! - [`shm`]: shared-memory rings between processes on the same host.
//!
//! This module does not negotiate, frame RPC messages or move tensors.

pub mod shm;
