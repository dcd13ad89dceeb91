//! Tensors in device memory (CUDA), and the seam through which a device runtime built
//! outside this crate plugs into the agent: [`DevicePlugin`].
//!
//! This crate knows no GPU. A tensor on a device other than the CPU holds a
//! [`DeviceBuffer`], a shared handle to memory the runtime owns ([`DeviceMemory`]). The
//! agent moves it over one of two kinds of channel, whichever the pipe negotiated for the
//! pair of device types (highest priority first: `cuda_xth` 400, `cuda_ipc` 300,
//! `cuda_gdr` 200, `cuda_basic` 0):
//!
//! - **lending** (`cuda_xth` within one process, `cuda_ipc` between processes of one
//!   host, `cuda_gdr` between hosts by GPUDirect RDMA): the sender's runtime lends the
//!   memory ([`DeviceRuntime::lend`]) and the frame
//!   carries the [`DeviceLoan`]'s descriptor; the receiver's runtime copies the lent
//!   range into fresh memory on the target device ([`DeviceRuntime::borrow`]), device to
//!   device, without the host. The loan is held like a `cma` buffer, by the rule of
//!   `rdzv_core::rpc::lending`: a request's until its reply, a response's until the
//!   caller's ack, and dropped unused when the pipe ends. A runtime offers these channels
//!   through [`DeviceRuntime::lending_channels`].
//! - **staging** (`cuda_basic`): the sender's runtime copies the tensor to host memory
//!   ([`DeviceRuntime::copy_to_host`]) that it owns ([`HostBytes`]: pinned buffers, say,
//!   given back to the runtime when the channel is done with them), the bytes travel
//!   like a CPU tensor's over the CPU channel the pipe negotiated (inline, `cma`, `xth`
//!   or `mpt`), which reads them where they are, and the receiver's runtime copies them
//!   into fresh memory on the target device. A runtime that can stage in chunks
//!   ([`DeviceRuntime::receive_staged`], a [`StagedReceive`]) is handed each chunk as
//!   soon as the `cma` or `xth` pull has read it, so the pull of chunk k+1 overlaps the
//!   host-to-device copy of chunk k. Bytes carried by `mpt` arrive in stripes read by
//!   several lane threads at once: a runtime that takes parts in any order
//!   ([`DeviceRuntime::receive_parts`], a [`PartedReceive`]) is handed each piece of a
//!   stripe as soon as its lane read it. Otherwise (and for bytes that arrived inline) it
//!   gets all the bytes at once ([`DeviceRuntime::copy_from_host`]). So
//!   `cuda_basic` runs over every transport and gains from every CPU channel. Every
//!   worker offers it for CPU memory (the CPU side of a CPU ↔ CUDA pair needs no GPU),
//!   and a worker with a CUDA runtime also for CUDA memory.
//!
//! **When a received tensor is ready.** A runtime may hand the agent memory whose copy
//! is still running (`rdzv_rdma`'s `CudaOptions::pending_hand_over`: `cuda_ipc` and
//! `cuda_xth` then never wait on the host). Such memory says so through
//! [`DeviceMemory::is_ready`] and [`DeviceMemory::wait_ready_for`] (on the tensor:
//! `Tensor::is_ready`, `Tensor::wait_ready`); a consumer that reads the bytes on the host,
//! or on a stream the runtime does not know, waits first, or orders its stream after
//! the memory's ready event (CUDA: `CudaMemory::wait_ready_on`). Memory that does not
//! say otherwise is complete when it is handed over, and CPU tensors always are.
//!
//! Every call of the seam fails with a [`DeviceError`]: the operation, the device, the
//! channel where there is one, and the runtime's own error as its source.
//!
//! `rdzv_rdma::cuda::agent::CudaPlugin` is the CUDA runtime (cudarc, loaded at run time).
//! A test can plug in a runtime that keeps "device" memory on the host: the agent cannot
//! tell, which is how its part is tested on machines without a GPU.

mod error;
mod host;
mod lent;
mod parts;
mod plugin;
mod runtimes;
#[cfg(test)]
mod tests;

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rdzv_core::device::Device;

pub use error::{
    ChannelUnavailable, DeviceError, DeviceErrorSource, DeviceOp, TensorMemoryError,
    UnavailableReason,
};
pub use host::{HostBytes, StagedBytes};
pub use lent::LentBytes;
pub use plugin::{
    DeviceLoan, DevicePlugin, DeviceRuntime, PartBuffer, PartedReceive, PipeId, StagedReceive,
};
pub(crate) use runtimes::{Devices, StagingIn, CUDA_BASIC_DESCRIPTOR};

/// Memory on a device, owned by a device runtime.
pub trait DeviceMemory: Send + Sync + fmt::Debug + 'static {
    /// The device it is on.
    fn device(&self) -> Device;
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Itself, for the runtime that made it to downcast.
    fn as_any(&self) -> &dyn Any;

    /// Whether the bytes are complete now: no copy into the memory, nor the producer
    /// that said so, is still running. Memory a runtime hands over with its copy still
    /// running (a received tensor under a pending hand-over) answers `false` until the
    /// copy is done. Default: always ready.
    ///
    /// # Errors
    /// The runtime cannot tell (a driver error): the bytes must not be trusted.
    fn is_ready(&self) -> Result<bool, DeviceError> {
        Ok(true)
    }

    /// Blocks until the bytes are complete, or `timeout` passed: whether they are.
    /// Default: always ready at once.
    ///
    /// # Errors
    /// As [`is_ready`](Self::is_ready).
    fn wait_ready_for(&self, timeout: Duration) -> Result<bool, DeviceError> {
        let _ = timeout;
        Ok(true)
    }
}

/// A shared handle to a tensor's device memory. Clones share the memory; two handles
/// are equal when they share it.
#[derive(Clone)]
pub struct DeviceBuffer(Arc<dyn DeviceMemory>);

impl DeviceBuffer {
    /// A handle to `memory`.
    pub fn new(memory: impl DeviceMemory) -> DeviceBuffer {
        DeviceBuffer(Arc::new(memory))
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.0.device()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the bytes are complete now ([`DeviceMemory::is_ready`]).
    ///
    /// # Errors
    /// The runtime cannot tell; the error names the device.
    pub fn is_ready(&self) -> Result<bool, DeviceError> {
        self.0
            .is_ready()
            .map_err(|e| e.located(self.device(), None))
    }

    /// Blocks until the bytes are complete, at most `timeout`: whether they are
    /// ([`DeviceMemory::wait_ready_for`]).
    ///
    /// # Errors
    /// As [`is_ready`](Self::is_ready).
    pub fn wait_ready(&self, timeout: Duration) -> Result<bool, DeviceError> {
        self.0
            .wait_ready_for(timeout)
            .map_err(|e| e.located(self.device(), None))
    }

    /// The memory.
    pub fn memory(&self) -> &dyn DeviceMemory {
        &*self.0
    }

    /// The memory as the runtime's own type, if it is one.
    pub fn downcast_ref<T: DeviceMemory>(&self) -> Option<&T> {
        self.0.as_any().downcast_ref::<T>()
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl PartialEq for DeviceBuffer {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.0), Arc::as_ptr(&other.0))
    }
}

impl Eq for DeviceBuffer {}

/// "Device" memory that lives on the host: for runtimes and tests on machines without
/// the device (the agent cannot tell it from real device memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMemory {
    device: Device,
    bytes: Vec<u8>,
}

impl HostMemory {
    /// `bytes`, said to be on `device`.
    pub fn new(device: Device, bytes: Vec<u8>) -> HostMemory {
        HostMemory { device, bytes }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl DeviceMemory for HostMemory {
    fn device(&self) -> Device {
        self.device
    }

    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
