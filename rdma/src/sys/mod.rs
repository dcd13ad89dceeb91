//! The crate's foreign calls: the one place in `rdzv-rdma` allowed to contain `unsafe`
//! code (the crate root denies it everywhere else, as mio keeps its system calls in `sys`).
//!
//! - [`ibv`]: libibverbs, loaded at run time with `libloading` (re-exported as
//!   `crate::ibv::sys`).
//! - [`cuda`]: the CUDA driver (`libcuda`, loaded at run time through cudarc's
//!   `dynamic-loading`): the owned resources (device, memory, pinned memory, events, IPC
//!   mappings), the asynchronous copies between them, and the GPUDirect RDMA registration
//!   of device memory with a NIC. Its types are re-exported by `crate::cuda::memory`.
//!
//! Each `unsafe` block carries a `// SAFETY:` comment naming the invariant it relies on;
//! what the rest of the crate gets is safe functions and types whose constructors uphold
//! those invariants. This module decides no protocol.

pub(crate) mod cuda;
pub(crate) mod driver_code;
pub mod ibv;
