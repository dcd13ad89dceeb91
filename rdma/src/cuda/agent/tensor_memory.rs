//! [`CudaMemory`], a CUDA tensor's memory, and its ready event: the point on a stream
//! after which its bytes are complete.

use std::any::Any;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::safe::CudaStream;
use rdzv_core::device::Device;
use rdzv_uring::rpc::{DeviceError, DeviceMemory, DeviceOp};

use super::driver::DeviceBacking;
use super::{cuda_ordinal, lock};
use crate::cuda::caching_allocator::CachedBlock;
use crate::cuda::error::CudaChannelError;
use crate::cuda::memory::{DeviceAllocation, DeviceRange, Gpu, RawEvent};

/// Where a [`CudaMemory`]'s bytes live.
#[derive(Debug)]
pub(super) enum Storage {
    /// An allocation of its own.
    Own(DeviceAllocation),
    /// A block of the runtime's caching allocator, back to it on drop.
    Cached(CachedBlock<DeviceBacking>),
}

/// A CUDA tensor's memory: on one device, the start of a `cuMemAlloc` allocation (its
/// own, or a block of the runtime's cache). Wrap it in a `DeviceBuffer` to make a
/// tensor of it.
///
/// **Ready event.** Memory written by work on a stream of the caller's can say so with
/// [`record_ready`](Self::record_ready) instead of synchronising that stream before the
/// agent sends it: the runtime then orders its own use after that point on the GPU
/// (`cuda_ipc`'s loan event is recorded after it, so the receiver's copy waits for the
/// producer without any host waiting), or waits for that one event (`cuda_xth`,
/// `cuda_gdr`, [`to_host`](Self::to_host)). Memory without a ready event must be
/// complete when the agent is handed it.
///
/// Memory the runtime hands over (a received tensor) is complete: its copy was waited
/// for; except with [`CudaOptions::pending_hand_over`](super::CudaOptions), where a
/// tensor received over `cuda_ipc` or `cuda_xth` is handed over with its copy running
/// and that copy's event as its ready event. Then
/// [`is_ready`](DeviceMemory::is_ready) (`cuEventQuery`) and
/// [`wait_ready_for`](DeviceMemory::wait_ready_for) say when the bytes are complete
/// (`rdzv_uring::rpc::Tensor::is_ready` and `wait_ready` ask the same), and
/// [`wait_ready_on`](Self::wait_ready_on) orders a stream of the consumer's after the copy
/// without blocking. Reading the bytes before either is a race with the copy.
#[derive(Debug)]
pub struct CudaMemory {
    pub(super) device: Device,
    pub(super) len: usize,
    /// Taken only in `drop`, to leak it when a copy may still write it.
    storage: Option<Storage>,
    /// Recorded after the work that produces the bytes (the producer's, or the copy's
    /// that fills received memory), if there is any to wait for.
    ready: Mutex<Option<Arc<RawEvent>>>,
}

impl CudaMemory {
    /// Memory of `len` bytes in `storage` on `device`, complete.
    pub(super) fn new(device: Device, len: usize, storage: Storage) -> CudaMemory {
        CudaMemory {
            device,
            len,
            storage: Some(storage),
            ready: Mutex::new(None),
        }
    }

    /// Marks the bytes as produced by the work enqueued so far on `stream` (a stream of
    /// this memory's device): records the memory's ready event there, replacing an
    /// earlier one. Later users of the memory order themselves after it.
    ///
    /// # Errors
    /// `stream` belongs to another device, or the driver refused the event.
    pub fn record_ready(&self, stream: &CudaStream) -> Result<(), CudaChannelError> {
        let gpu = self.allocation().gpu();
        gpu.check_stream(stream)?;
        let mut ready = lock(&self.ready);
        // An event someone else still holds (a wait in progress) is left to them.
        if ready.as_mut().and_then(Arc::get_mut).is_none() {
            *ready = Some(Arc::new(RawEvent::new(gpu, false)?));
        }
        match ready.as_ref() {
            Some(event) => event.record(stream).map_err(CudaChannelError::from),
            None => Ok(()),
        }
    }

    /// The ready event, if any (held by the caller, not under the lock, while it waits).
    pub(super) fn ready_event(&self) -> Option<Arc<RawEvent>> {
        lock(&self.ready).clone()
    }

    /// Makes `stream` wait (on the GPU) for the bytes to be complete: for the producer's
    /// ready event, if it recorded one.
    ///
    /// # Errors
    /// The driver's.
    pub fn wait_ready_on(&self, stream: &CudaStream) -> Result<(), CudaChannelError> {
        match self.ready_event() {
            Some(event) => event.wait_on(stream).map_err(CudaChannelError::from),
            None => Ok(()),
        }
    }

    /// Blocks until the bytes are complete (the ready event, if any).
    ///
    /// # Errors
    /// The driver's.
    pub fn wait_ready(&self) -> Result<(), CudaChannelError> {
        match self.ready_event() {
            Some(event) => event.synchronize().map_err(CudaChannelError::from),
            None => Ok(()),
        }
    }

    /// Makes `event` (recorded after the copy that fills the memory) its ready event.
    pub(super) fn set_ready(&self, event: Arc<RawEvent>) {
        *lock(&self.ready) = Some(event);
    }

    /// `len` bytes of uninitialised memory on `device` (a CUDA device).
    ///
    /// # Errors
    /// No such device, no driver, or out of memory.
    pub fn alloc(device: Device, len: usize) -> Result<CudaMemory, CudaChannelError> {
        let gpu = Gpu::open(cuda_ordinal(device)?)?;
        Ok(CudaMemory::new(device, len, Storage::Own(gpu.alloc(len)?)))
    }

    /// Memory on `device` holding a copy of `bytes`.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), or the copy failed.
    pub fn upload(device: Device, bytes: &[u8]) -> Result<CudaMemory, CudaChannelError> {
        let gpu = Gpu::open(cuda_ordinal(device)?)?;
        let mut allocation = gpu.alloc(bytes.len())?;
        allocation.copy_from_host(bytes)?;
        Ok(CudaMemory::new(
            device,
            bytes.len(),
            Storage::Own(allocation),
        ))
    }

    /// A host copy of the memory (a synchronous copy, after the ready event).
    ///
    /// # Errors
    /// The copy failed.
    pub fn to_host(&self) -> Result<Vec<u8>, CudaChannelError> {
        let mut bytes = vec![0u8; self.len];
        if self.len == 0 {
            return Ok(bytes);
        }
        self.wait_ready()?;
        self.allocation().copy_prefix_to_host(&mut bytes)?;
        Ok(bytes)
    }

    /// The allocation the memory starts (it may be longer than the tensor: a cached
    /// block is a whole size class).
    pub fn allocation(&self) -> &DeviceAllocation {
        // The storage is taken only in `drop`.
        let storage = self
            .storage
            .as_ref()
            .unwrap_or_else(|| unreachable!("a CudaMemory holds its storage until dropped"));
        match storage {
            Storage::Own(allocation) => allocation,
            Storage::Cached(block) => block.block(),
        }
    }

    /// The tensor's bytes: the first `len` of the allocation.
    pub fn range(&self) -> DeviceRange<'_> {
        let whole = self.allocation().range();
        whole.slice(0, self.len).unwrap_or(whole)
    }
}

/// Memory whose ready event is pending (a copy into it, or a producer, may still write
/// it) is waited for before it is freed or goes back to the cache; if that wait fails it
/// is leaked, never reused under a running copy.
impl Drop for CudaMemory {
    fn drop(&mut self) {
        let ready = self
            .ready
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(event) = ready else {
            return;
        };
        if let Err(e) = event.synchronize() {
            tracing::warn!(
                error = %crate::error_chain::ErrorChain(&e),
                device = %self.device,
                "a CUDA tensor's ready event cannot be waited for: its memory is leaked"
            );
            std::mem::forget(self.storage.take());
        }
    }
}

impl DeviceMemory for CudaMemory {
    fn device(&self) -> Device {
        self.device
    }

    fn len(&self) -> usize {
        self.len
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    /// `cuEventQuery` on the ready event; ready when there is none.
    fn is_ready(&self) -> Result<bool, DeviceError> {
        self.ready_event()
            .map_or(Ok(true), |event| event.query())
            .map_err(|e| DeviceError::new(DeviceOp::WaitReady, e).on(self.device))
    }

    /// Polls the ready event until it completed or `timeout` passed.
    fn wait_ready_for(&self, timeout: Duration) -> Result<bool, DeviceError> {
        self.ready_event()
            .map_or(Ok(true), |event| event.wait_for(timeout))
            .map_err(|e| DeviceError::new(DeviceOp::WaitReady, e).on(self.device))
    }
}
