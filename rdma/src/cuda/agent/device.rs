//! What the runtime keeps per opened device ([`DeviceState`]): its streams, its pools of
//! events, its caches (received memory, pinned buffers, opened `cuda_ipc` mappings and
//! events), and the copies every channel shares. The `cuda_basic` side is in
//! [`super::basic`], the `cuda_ipc` side in [`super::ipc`]; the driver adapters its
//! caches are built from in [`super::driver`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::safe::CudaStream;
use rdzv_core::device::Device;

use super::driver::{
    DeviceBacking, DriverOpener, EventOpener, LoanEvent, PinnedBacking, LOAN_EVENTS_UP_FRONT,
};
use super::tensor_memory::{CudaMemory, Storage};
use super::{lock, Cause, CudaOptions};
use crate::cuda::agent::ipc::mappings::IpcMappings;
use crate::cuda::caching_allocator::CachingAllocator;
use crate::cuda::error::CudaChannelError;
use crate::cuda::memory::{Gpu, RawEvent, StagingBuffer};

/// What the runtime keeps per opened device. Field order is drop order: opened events
/// and mappings first, then the staging buffers and events, the streams, the cached
/// blocks, the device.
pub(super) struct DeviceState {
    pub(super) device: Device,
    /// The peers' `cuda_ipc` loan events opened here, per pipe (keyed like mappings, by a
    /// hash of the handle in place of the base: another handle is another event).
    pub(super) opened_events: Mutex<IpcMappings<EventOpener>>,
    pub(super) mappings: Mutex<IpcMappings<DriverOpener>>,
    pub(super) staging: Mutex<Vec<StagingBuffer>>,
    pub(super) pinned: CachingAllocator<PinnedBacking>,
    /// Interprocess events of settled `cuda_ipc` loans, for the next loans.
    pub(super) loan_events: Mutex<Vec<LoanEvent>>,
    /// This process's own events (copies waited for, received memory's ready events).
    pub(super) events: Mutex<Vec<RawEvent>>,
    pub(super) streams: Vec<Arc<CudaStream>>,
    next_stream: AtomicUsize,
    pub(super) allocator: CachingAllocator<DeviceBacking>,
    pub(super) chunk: usize,
    pub(super) buffers: usize,
    /// [`CudaOptions::pending_hand_over`].
    pub(super) pending_hand_over: bool,
    pub(super) gpu: Gpu,
}

impl std::fmt::Debug for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceState")
            .field("device", &self.device)
            .field("allocator", &self.allocator)
            .field("mappings", &*lock(&self.mappings))
            .field("opened_events", &*lock(&self.opened_events))
            .field("streams", &self.streams.len())
            .finish_non_exhaustive()
    }
}

impl DeviceState {
    pub(super) fn open(
        device: Device,
        ordinal: usize,
        options: &CudaOptions,
    ) -> Result<DeviceState, CudaChannelError> {
        let gpu = Gpu::open(ordinal)?;
        let streams = (0..options.streams_per_device.max(1))
            .map(|_| gpu.new_stream())
            .collect::<Result<Vec<_>, _>>()?;
        let state = DeviceState {
            device,
            opened_events: Mutex::new(IpcMappings::new(
                EventOpener { gpu: gpu.clone() },
                options.ipc_mappings_per_device,
                usize::MAX,
            )),
            mappings: Mutex::new(IpcMappings::new(
                DriverOpener { gpu: gpu.clone() },
                options.ipc_mappings_per_device,
                options.ipc_mapped_bytes_per_device,
            )),
            staging: Mutex::new(Vec::new()),
            pinned: CachingAllocator::new(
                format!("{device} (pinned host memory for cuda_basic)"),
                PinnedBacking { gpu: gpu.clone() },
                options.staged_out_cap_bytes,
            ),
            loan_events: Mutex::new(Vec::new()),
            events: Mutex::new(Vec::new()),
            streams,
            next_stream: AtomicUsize::new(0),
            allocator: CachingAllocator::new(
                device.to_string(),
                DeviceBacking { gpu: gpu.clone() },
                options.cache_cap_bytes,
            ),
            chunk: options.staging_chunk_bytes.max(1),
            buffers: options.staging_buffers.max(1),
            pending_hand_over: options.pending_hand_over,
            gpu,
        };
        state.prepare_loan_events(LOAN_EVENTS_UP_FRONT);
        Ok(state)
    }

    /// The next of the device's streams.
    pub(super) fn stream(&self) -> &Arc<CudaStream> {
        let index = self.next_stream.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        &self.streams[index]
    }

    /// `len` bytes from the device's cache (nothing for 0 bytes).
    pub(super) fn alloc(&self, len: usize) -> Result<CudaMemory, Cause> {
        let storage = if len == 0 {
            Storage::Own(self.gpu.alloc(0)?)
        } else {
            Storage::Cached(self.allocator.allocate(len)?)
        };
        Ok(CudaMemory::new(self.device, len, storage))
    }

    /// One of this process's own events (made now if none is idle); the caller gives it
    /// back to `events` once it waited for it.
    pub(super) fn take_event(&self) -> Result<RawEvent, CudaChannelError> {
        match lock(&self.events).pop() {
            Some(event) => Ok(event),
            None => RawEvent::new(&self.gpu, false).map_err(CudaChannelError::from),
        }
    }
}
