//! The crate's system interface: the one place in `rdzv-uring` allowed to contain
//! `unsafe` code (the crate root denies it everywhere else, as mio keeps its system
//! calls in `sys`). What the rest of the crate gets is safe functions and types whose
//! constructors and signatures uphold the invariants the `unsafe` blocks rely on.
//!
//! - [`uring`]: an io_uring whose operations own the buffers and descriptors the kernel
//!   touches until their completion (the store server's loop).
//! - [`shm`]: the mapping of a sealed shared-memory ring segment, its header of atomics
//!   and bounds-checked copies of its data region (the shm transport).
//! - [`memory`]: a fallible zeroed allocation and the huge-page hint for a buffer.
//! - [`clock`]: the monotonic clock in milliseconds, one call (the store loops' `now`).
//! - [`process`]: `process_vm_readv` into borrowed buffers (the cma channel).
//! - [`fd`]: borrowing a descriptor this process inherited by number (socket
//!   activation).
//!
//! Each `unsafe` block carries a `// SAFETY:` comment naming the invariant it relies on
//! and why it holds. This module decides no protocol.

pub(crate) mod clock;
pub(crate) mod fd;
pub(crate) mod memory;
pub(crate) mod process;
pub(crate) mod shm;
pub(crate) mod uring;
