//! What the runtime keeps per opened device ([`DeviceState`]): what every channel shares
//! (its streams, this process's events, the cache of received memory) and, composed
//! beside it, each channel's own state, made and owned by that channel's module:
//! `cuda_ipc`'s mappings and loan events ([`super::ipc::state`]) and `cuda_basic`'s
//! staging pools ([`super::basic::state`]). The driver adapters the caches are built from
//! are in [`super::driver`]. It decides no channel's rule; it holds a loan's memory
//! until the channel's [`Settle`] says the borrower's copy is done ([`LoanHold`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::safe::CudaStream;
use rdzv_core::device::Device;
use rdzv_uring::rpc::DeviceBuffer;

use super::basic::state::BasicState;
use super::driver::{DeviceBacking, LOAN_EVENTS_UP_FRONT};
use super::ipc::state::IpcState;
use super::tensor_memory::{CudaMemory, Storage};
use super::{lock, Cause, CudaOptions};
use crate::cuda::caching_allocator::CachingAllocator;
use crate::cuda::error::CudaChannelError;
use crate::cuda::memory::{Gpu, RawEvent};
use crate::error_chain::ErrorChain;

/// What the runtime keeps per opened device. Field order is drop order: `cuda_ipc`'s
/// opened events and mappings and its loan events first, then `cuda_basic`'s staging
/// buffers and pinned blocks, this process's events, the streams, the cached blocks, the
/// device.
pub(super) struct DeviceState {
    pub(super) device: Device,
    /// `cuda_ipc`'s caches.
    pub(super) ipc: IpcState,
    /// `cuda_basic`'s pools.
    pub(super) basic: BasicState,
    /// This process's own events (copies waited for, received memory's ready events).
    pub(super) events: Mutex<Vec<RawEvent>>,
    pub(super) streams: Vec<Arc<CudaStream>>,
    next_stream: AtomicUsize,
    pub(super) allocator: CachingAllocator<DeviceBacking>,
    /// [`CudaOptions::pending_hand_over`].
    pub(super) pending_hand_over: bool,
    pub(super) gpu: Gpu,
}

impl std::fmt::Debug for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceState")
            .field("device", &self.device)
            .field("allocator", &self.allocator)
            .field("mappings", &*lock(&self.ipc.mappings))
            .field("opened_events", &*lock(&self.ipc.opened_events))
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
            ipc: IpcState::new(
                &gpu,
                options.ipc_mappings_per_device,
                options.ipc_mapped_bytes_per_device,
            ),
            basic: BasicState::new(
                &gpu,
                device,
                options.staged_out_cap_bytes,
                options.staging_chunk_bytes,
                options.staging_buffers,
            ),
            events: Mutex::new(Vec::new()),
            streams,
            next_stream: AtomicUsize::new(0),
            allocator: CachingAllocator::new(
                device.to_string(),
                DeviceBacking { gpu: gpu.clone() },
                options.cache_cap_bytes,
            ),
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

/// What a loan's hold waits for when the loan ends: the borrower's copy, by the rule of
/// the channel that lent.
pub(super) trait Settle: Send + 'static {
    /// The channel, for the warning of a loan that cannot be settled.
    const CHANNEL: &'static str;
    /// Why the copy cannot be waited for.
    type Error: std::error::Error + 'static;
    /// Waits for the borrower's copy, then gives back to `state` what the loan used.
    fn settle(self, state: &DeviceState) -> Result<(), Self::Error>;
}

/// A loan's hold: the memory, and what it waits for when the loan ends ([`Settle`]).
/// If that wait fails, a copy may still read the memory, so it is never freed or reused
/// (leaked, with a warning).
pub(super) struct LoanHold<S: Settle> {
    pub(super) settle: Option<S>,
    pub(super) memory: Option<DeviceBuffer>,
    pub(super) state: Arc<DeviceState>,
}

impl<S: Settle> Drop for LoanHold<S> {
    fn drop(&mut self) {
        let Some(settle) = self.settle.take() else {
            return;
        };
        if let Err(error) = settle.settle(&self.state) {
            tracing::warn!(
                error = %ErrorChain(&error),
                device = %self.state.device,
                "a {} loan's copy cannot be waited for: its memory is leaked",
                S::CHANNEL
            );
            std::mem::forget(self.memory.take());
        }
    }
}
