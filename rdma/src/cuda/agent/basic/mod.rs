//! `cuda_basic`'s side of the runtime: tensors staged out through pinned blocks the CPU
//! channel reads in place (or, over the cap, through the pinned slots into a `Vec`),
//! and received chunk by chunk ([`DriverStageIn`]) or whole through the slots. The
//! schedules are [`crate::cuda::agent::basic::chunk_plan`]'s; this file is their driver half.

pub mod chunk_plan;
pub(super) mod state;

use std::sync::Arc;

use rdzv_core::device::Device;
use rdzv_core::negotiate::ChannelKind;
use rdzv_uring::rpc::{DeviceBuffer, DeviceError, DeviceOp, HostBytes, StagedBytes, StagedReceive};

use super::device::DeviceState;
use super::driver::PinnedBacking;
use super::tensor_memory::CudaMemory;
use super::{lock, Cause};
use crate::cuda::caching_allocator::CachedBlock;
use crate::cuda::error::CudaChannelError;
use crate::cuda::memory::{CudaCallError, DeviceRange, StagingBuffer};
use crate::error_chain::ErrorChain;
use chunk_plan::{ChunkPlan, ChunkedStageIn, StageInError, StagingCopies};

impl DeviceState {
    /// `cuda_basic`'s sending side: `memory` (this device's, complete once its ready
    /// event fired) in a pinned block of the cache, or else in a `Vec`.
    pub(super) fn copy_to_host(&self, memory: &CudaMemory) -> Result<HostBytes, CudaChannelError> {
        memory.wait_ready()?;
        match self.stage_out_pinned(memory.range()) {
            Ok(Some(pinned)) => Ok(HostBytes::staged(pinned)),
            Ok(None) => self.stage_out(memory.range()).map(HostBytes::from),
            Err(e) => Err(e),
        }
    }

    /// `cuda_basic`'s receiving side for bytes that arrived whole.
    pub(super) fn copy_from_host(&self, bytes: &[u8]) -> Result<DeviceBuffer, Cause> {
        let memory = self.alloc(bytes.len())?;
        self.stage_in(memory.range(), bytes)?;
        Ok(DeviceBuffer::new(memory))
    }

    /// `cuda_basic`'s receiving side chunk by chunk: fresh memory for `len` bytes, and
    /// the slots its chunks go through.
    pub(super) fn receive_staged(
        self: Arc<Self>,
        len: usize,
    ) -> Result<Box<dyn StagedReceive>, Cause> {
        let memory = self.alloc(len)?;
        let plan = ChunkPlan::new(len, self.basic.chunk, self.basic.buffers);
        let slots = self.take_slots(plan.buffers_used())?;
        let chunk = self.basic.chunk;
        let device = self.device;
        Ok(Box::new(DriverStageIn {
            device,
            staging: Some(ChunkedStageIn::new(
                plan,
                OwnedStaging {
                    state: self,
                    slots,
                    memory,
                },
            )),
            chunk,
        }))
    }

    /// `count` staging slots (made now if the pool has fewer idle).
    fn take_slots(&self, count: usize) -> Result<Vec<StagingBuffer>, CudaChannelError> {
        let mut slots: Vec<StagingBuffer> = {
            let mut idle = lock(&self.basic.staging);
            let keep = idle.len().saturating_sub(count);
            idle.split_off(keep)
        };
        while slots.len() < count {
            slots.push(StagingBuffer::new(&self.gpu, self.basic.chunk)?);
        }
        Ok(slots)
    }

    /// One staging slot (from the pool, or made now).
    pub(super) fn take_slot(&self) -> Result<StagingBuffer, CudaChannelError> {
        let mut slots = self.take_slots(1)?;
        slots
            .pop()
            .ok_or(CudaChannelError::Call(CudaCallError::InvalidPool {
                slots: 0,
                slot_len: self.basic.chunk,
            }))
    }

    /// Puts slots back (their copies were waited for).
    pub(super) fn give_back(&self, slots: Vec<StagingBuffer>) {
        lock(&self.basic.staging).extend(slots);
    }

    /// Copies `src` (this device's) into host memory through the pinned slots: the
    /// device-to-host copy of chunk k+1 runs while the host copies chunk k out.
    fn stage_out(&self, src: DeviceRange<'_>) -> Result<Vec<u8>, CudaChannelError> {
        let mut out = Vec::with_capacity(src.len());
        self.staged(src, |plan, copies| {
            chunk_plan::stage_out(plan, copies, &mut out)
        })?;
        Ok(out)
    }

    /// Copies `src` (this device's) into a pinned block of its own from the device's
    /// cache, for the CPU channel to read where it is; `None` when the block cannot be
    /// had (the cap, or no pinned memory left) or `src` is empty.
    fn stage_out_pinned(
        &self,
        src: DeviceRange<'_>,
    ) -> Result<Option<PinnedBytes>, CudaChannelError> {
        if src.is_empty() {
            return Ok(None);
        }
        let mut block = match self.basic.pinned.allocate(src.len()) {
            Ok(block) => block,
            Err(e) => {
                tracing::debug!(
                    error = %ErrorChain(&e),
                    "cuda_basic stages this tensor through pageable memory"
                );
                return Ok(None);
            }
        };
        // The block's own event orders the wait: only this stream's work up to here.
        let copied = self
            .gpu
            .bind()
            .map_err(CudaChannelError::from)
            .and_then(|()| {
                let stream = self.stream();
                let staged = block.block_mut();
                staged.download(src.source(), stream)?;
                staged.wait().map_err(CudaChannelError::from)
            });
        match copied {
            Ok(()) => Ok(Some(PinnedBytes {
                block,
                len: src.len(),
            })),
            Err(e) => {
                // The copy may still be writing the block: never hand it out again.
                std::mem::forget(block);
                Err(e)
            }
        }
    }

    /// Copies `bytes` into `dst` (this device's, as long as `bytes`) through the pinned
    /// slots: the host copy of chunk k+1 runs while chunk k goes host to device.
    fn stage_in(&self, dst: DeviceRange<'_>, bytes: &[u8]) -> Result<(), CudaChannelError> {
        if dst.len() != bytes.len() {
            return Err(CudaChannelError::Call(CudaCallError::LengthMismatch {
                sent: bytes.len() as u64,
                expected: dst.len() as u64,
            }));
        }
        self.staged(dst, |plan, copies| {
            chunk_plan::stage_in(plan, copies, bytes)
        })
    }

    /// Runs `copy`, a staged copy of all of `device` through the pinned slots (none for
    /// an empty range), with the device's context current.
    fn staged(
        &self,
        device: DeviceRange<'_>,
        copy: impl FnOnce(&ChunkPlan, &mut DriverStaging<'_, '_>) -> Result<(), CudaChannelError>,
    ) -> Result<(), CudaChannelError> {
        let plan = ChunkPlan::new(device.len(), self.basic.chunk, self.basic.buffers);
        if plan.chunks() == 0 {
            return Ok(());
        }
        let mut slots = self.take_slots(plan.buffers_used())?;
        let result = self
            .gpu
            .bind()
            .map_err(CudaChannelError::from)
            .and_then(|()| {
                let mut copies = DriverStaging {
                    state: self,
                    slots: &mut slots,
                    device,
                };
                copy(&plan, &mut copies)
            });
        self.finish_slots(slots, &result);
        result
    }

    /// After a staged copy: on success the slots are idle and go back to the pool; after
    /// an error a copy may still use one, so each is waited for first (and dropped if
    /// that fails too).
    fn finish_slots(&self, slots: Vec<StagingBuffer>, result: &Result<(), CudaChannelError>) {
        if result.is_ok() {
            self.give_back(slots);
            return;
        }
        let idle: Vec<StagingBuffer> = slots
            .into_iter()
            .filter_map(|mut slot| slot.wait().is_ok().then_some(slot))
            .collect();
        self.give_back(idle);
    }
}

/// A staged copy's driver side: pinned slots, the device range, asynchronous copies on
/// the device's streams, one event per slot (the slot's own).
struct DriverStaging<'a, 'r> {
    state: &'a DeviceState,
    slots: &'a mut [StagingBuffer],
    device: DeviceRange<'r>,
}

impl<'r> DriverStaging<'_, 'r> {
    /// The slot and the device range `[offset, offset + len)`, checked.
    fn place(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(&mut StagingBuffer, DeviceRange<'r>), CudaChannelError> {
        let range = self.device.slice(offset, len);
        let slot = self.slots.get_mut(buffer).filter(|slot| len <= slot.len());
        match (slot, range) {
            (Some(slot), Some(range)) => Ok((slot, range)),
            _ => Err(CudaChannelError::protocol(
                "cuda_basic staging plan",
                format!("{len} bytes at {offset} do not fit buffer {buffer} or the tensor"),
            )),
        }
    }
}

impl StagingCopies for DriverStaging<'_, '_> {
    type Error = CudaChannelError;

    fn start_to_host(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError> {
        let stream = self.state.stream();
        let (slot, src) = self.place(buffer, offset, len)?;
        // The tensor stays alive for the whole staged copy; the slot's bytes are fenced
        // by its event until the plan waited for it.
        slot.download(src.source(), stream)
            .map_err(CudaChannelError::from)
    }

    fn start_to_device(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError> {
        let stream = self.state.stream();
        let (slot, dst) = self.place(buffer, offset, len)?;
        slot.upload(dst, stream).map_err(CudaChannelError::from)
    }

    fn wait(&mut self, buffer: usize) -> Result<(), CudaChannelError> {
        match self.slots.get_mut(buffer) {
            Some(slot) => slot.wait().map_err(CudaChannelError::from),
            None => Err(CudaChannelError::protocol(
                "cuda_basic staging plan",
                format!("no buffer {buffer}"),
            )),
        }
    }

    fn buffer(&mut self, buffer: usize) -> &mut [u8] {
        slot_bytes(&mut self.slots[..], buffer)
    }
}

/// The bytes of staging slot `buffer` (empty for a slot that does not exist or whose
/// copy is still running: the plan never asks for either).
fn slot_bytes(slots: &mut [StagingBuffer], buffer: usize) -> &mut [u8] {
    slots
        .get_mut(buffer)
        .and_then(StagingBuffer::bytes_mut)
        .unwrap_or_default()
}

/// A tensor staged out into a pinned block: the bytes the CPU channel reads. Dropping
/// it gives the block back to its device's cache.
struct PinnedBytes {
    block: CachedBlock<PinnedBacking>,
    len: usize,
}

impl StagedBytes for PinnedBytes {
    fn bytes(&self) -> &[u8] {
        // The block is at least `len` long (its size class); its copy was waited for.
        self.block
            .block()
            .bytes()
            .and_then(|bytes| bytes.get(..self.len))
            .unwrap_or_default()
    }
}

/// The copies of a chunked receive ([`DriverStageIn`]): the device's pinned slots, and
/// the fresh memory the tensor lands in.
struct OwnedStaging {
    state: Arc<DeviceState>,
    slots: Vec<StagingBuffer>,
    memory: CudaMemory,
}

impl OwnedStaging {
    fn driver(&mut self) -> DriverStaging<'_, '_> {
        DriverStaging {
            state: &self.state,
            slots: &mut self.slots,
            device: self.memory.range(),
        }
    }
}

impl StagingCopies for OwnedStaging {
    type Error = CudaChannelError;

    fn start_to_host(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError> {
        self.state.gpu.bind()?;
        self.driver().start_to_host(buffer, offset, len)
    }

    fn start_to_device(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError> {
        // The agent's pull runs on any thread: make the device's context current.
        self.state.gpu.bind()?;
        self.driver().start_to_device(buffer, offset, len)
    }

    fn wait(&mut self, buffer: usize) -> Result<(), CudaChannelError> {
        self.driver().wait(buffer)
    }

    fn buffer(&mut self, buffer: usize) -> &mut [u8] {
        slot_bytes(&mut self.slots[..], buffer)
    }
}

/// A tensor received over `cuda_basic` chunk by chunk (`DeviceRuntime::receive_staged`):
/// each chunk's host-to-device copy starts as soon as the agent filled its pinned slot.
/// Dropped unfinished, it waits for the copies it started, gives the slots back and the
/// memory to the cache; a slot (or the memory) whose copy cannot be waited for is never
/// reused (leaked).
struct DriverStageIn {
    device: Device,
    staging: Option<ChunkedStageIn<OwnedStaging>>,
    chunk: usize,
}

impl DriverStageIn {
    /// Runs `step` on the receive under way, with its error on this device.
    fn step<'s, T>(
        &'s mut self,
        step: impl FnOnce(
            &'s mut ChunkedStageIn<OwnedStaging>,
        ) -> Result<T, StageInError<CudaChannelError>>,
    ) -> Result<T, DeviceError> {
        let device = self.device;
        let staging = self.staging.as_mut().ok_or_else(|| {
            DeviceError::new(
                DeviceOp::ReceiveStaged,
                "this cuda_basic receive already finished (a bug of the caller's)",
            )
            .on(device)
        })?;
        step(staging).map_err(|error| {
            DeviceError::new(DeviceOp::ReceiveStaged, error)
                .on(device)
                .over(ChannelKind::CudaBasic)
        })
    }
}

impl StagedReceive for DriverStageIn {
    fn chunk_len(&self) -> usize {
        self.chunk
    }

    fn chunk_buffer(&mut self, k: usize) -> Result<&mut [u8], DeviceError> {
        self.step(|staging| staging.chunk_buffer(k))
    }

    fn chunk_filled(&mut self, k: usize) -> Result<(), DeviceError> {
        self.step(|staging| staging.chunk_filled(k))
    }

    fn finish(mut self: Box<Self>) -> Result<DeviceBuffer, DeviceError> {
        // On an error, dropping `self` settles the copies.
        self.step(ChunkedStageIn::finish)?;
        let staging = self.staging.take().ok_or_else(|| {
            DeviceError::new(
                DeviceOp::ReceiveStaged,
                "this cuda_basic receive already finished",
            )
        })?;
        let OwnedStaging {
            state,
            slots,
            memory,
        } = staging.into_copies();
        state.give_back(slots);
        Ok(DeviceBuffer::new(memory))
    }
}

impl Drop for DriverStageIn {
    fn drop(&mut self) {
        let Some(mut staging) = self.staging.take() else {
            return;
        };
        let idle = staging.settle();
        let OwnedStaging {
            state,
            slots,
            memory,
        } = staging.into_copies();
        let mut all_idle = true;
        let mut back = Vec::with_capacity(slots.len());
        for (slot, idle) in slots
            .into_iter()
            .zip(idle.into_iter().chain(std::iter::repeat(true)))
        {
            if idle {
                back.push(slot);
            } else {
                // A copy may still read it: never free or reuse it.
                all_idle = false;
                std::mem::forget(slot);
            }
        }
        state.give_back(back);
        if all_idle {
            drop(memory);
        } else {
            std::mem::forget(memory);
        }
    }
}
