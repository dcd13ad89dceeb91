//! Owned CUDA resources the channels are built from: an opened device ([`Gpu`]), device
//! memory from `cuMemAlloc` ([`DeviceAllocation`]), borrowed device ranges to write
//! ([`DeviceRange`]) or only read ([`DeviceSource`]), page-locked host memory
//! ([`PinnedHostBuffer`], and [`StagingBuffer`], which fences it with the event of its last
//! copy), raw events ([`RawEvent`], which unlike cudarc's `CudaEvent` can be created
//! interprocess) and opened CUDA IPC mappings ([`IpcMapping`]).
//!
//! They are defined, with every driver call they make, in the crate's `sys::cuda` module
//! (the one place in `rdzv-rdma` with `unsafe` code); this module is their public name.
//! [`Gpu::open`] never panics when the driver library is absent. This module moves no
//! bytes on its own and decides no protocol.

pub use crate::sys::cuda::{
    copy_device_async, copy_unified_async, CoveredDeviceMemory, CudaCallError, DeviceAllocation,
    DeviceRange, DeviceSource, DriverCode, Gpu, IpcMapping, PinnedHostBuffer, RawEvent,
    StagingBuffer,
};
