//! The runtime's adapters over the CUDA driver, below the device state and the channels:
//! what the generic caches ([`crate::cuda::caching_allocator`],
//! [`crate::cuda::agent::ipc::mappings`]) and the loan-event rules ([`crate::cuda::loan_events`])
//! are driven with on a real GPU (blocks from `cuMemAlloc` and `cuMemHostAlloc`, opened
//! IPC handles and events, a runtime stream), and the pool entry of a `cuda_ipc` loan
//! event.
//!
//! It decides no channel's protocol: `cuda_ipc`, `cuda_xth` and `cuda_basic` (in
//! [`super::ipc`], [`super::xth`], [`super::basic`]) decide when these are used.

use std::time::Duration;

use cudarc::driver::safe::CudaStream;
use rdzv_core::channel::cuda::IPC_HANDLE_LEN;

use crate::cuda::agent::ipc::mappings::MappingOpener;
use crate::cuda::caching_allocator::BackingAllocator;
use crate::cuda::error::CudaChannelError;
use crate::cuda::loan_events::{self, LoanStream};
use crate::cuda::memory::{
    DeviceAllocation, DeviceSource, Gpu, IpcMapping, RawEvent, StagingBuffer,
};

/// An interprocess event of the lender's pool, with its IPC handle.
#[derive(Debug)]
pub(super) struct LoanEvent {
    pub(super) event: RawEvent,
    pub(super) handle: [u8; IPC_HANDLE_LEN],
}

/// Loan events a device makes when it is opened (TensorPipe makes its outbox's events up
/// front too: creating an interprocess event while IPC handles are in use has been
/// seen to stall in the driver). More are made when more loans are in flight.
pub(super) const LOAN_EVENTS_UP_FRONT: usize = 8;

/// A runtime stream, as [`loan_events`] drives it.
pub(super) struct DriverStream<'a>(pub(super) &'a CudaStream);

/// How long a loan's release waits for the borrower's record before it gives up on the
/// memory (leaks it): a copy takes milliseconds, a borrower that died may never finish
/// (`cuda_xth`'s release waits as long for its borrower).
pub(super) const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Only the lender's release waits on the host ([`loan_events::settle_loan`]), for an
/// event the borrower records: bounded by `SETTLE_TIMEOUT`.
impl loan_events::LoanEvent for RawEvent {
    type Error = CudaChannelError;

    fn host_wait(&self) -> Result<(), CudaChannelError> {
        if self.wait_for(SETTLE_TIMEOUT)? {
            Ok(())
        } else {
            Err(CudaChannelError::EventTimeout {
                what: "a cuda_ipc loan",
                waited: SETTLE_TIMEOUT,
            })
        }
    }
}

impl LoanStream for DriverStream<'_> {
    type Error = CudaChannelError;
    type Event = RawEvent;

    fn wait(&mut self, event: &RawEvent) -> Result<(), CudaChannelError> {
        event.wait_on(self.0).map_err(CudaChannelError::from)
    }

    fn record(&mut self, event: &RawEvent) -> Result<(), CudaChannelError> {
        event.record(self.0).map_err(CudaChannelError::from)
    }

    fn drain(&mut self) -> Result<(), CudaChannelError> {
        let ordinal = self.0.context().ordinal();
        self.0
            .synchronize()
            .map_err(CudaChannelError::driver("cuStreamSynchronize", ordinal))
    }
}

/// Opens `cuda_ipc` memory handles on one device.
#[derive(Debug)]
pub(super) struct DriverOpener {
    pub(super) gpu: Gpu,
}

impl MappingOpener for DriverOpener {
    type Mapping = OpenedHandle;
    type Error = CudaChannelError;

    fn open(
        &mut self,
        handle: &[u8; IPC_HANDLE_LEN],
        _ordinal: usize,
    ) -> Result<OpenedHandle, CudaChannelError> {
        OpenedHandle::open(&self.gpu, handle)
    }

    fn mapped_len(mapping: &OpenedHandle) -> usize {
        mapping.len
    }
}

/// Opens `cuda_ipc` loan events on one device (`cuIpcOpenEventHandle`); dropping one
/// destroys this process's handle to it.
#[derive(Debug)]
pub(super) struct EventOpener {
    pub(super) gpu: Gpu,
}

impl MappingOpener for EventOpener {
    type Mapping = RawEvent;
    type Error = CudaChannelError;

    fn open(
        &mut self,
        handle: &[u8; IPC_HANDLE_LEN],
        _ordinal: usize,
    ) -> Result<RawEvent, CudaChannelError> {
        RawEvent::open_ipc(&self.gpu, handle).map_err(CudaChannelError::from)
    }

    fn mapped_len(_: &RawEvent) -> usize {
        0
    }
}

/// A peer's allocation mapped into this process by `cuIpcOpenMemHandle`, closed on drop.
pub(super) struct OpenedHandle {
    mapping: IpcMapping,
    /// The mapped allocation's length.
    len: usize,
}

impl OpenedHandle {
    /// Opens `handle` on `gpu` and reads how much it maps.
    pub(super) fn open(gpu: &Gpu, handle: &[u8; IPC_HANDLE_LEN]) -> Result<Self, CudaChannelError> {
        let mapping = IpcMapping::open(gpu, handle)?;
        if !mapping.starts_its_allocation() {
            return Err(CudaChannelError::protocol(
                "cuda_ipc descriptor",
                "its handle maps to the middle of an allocation",
            ));
        }
        let len = mapping.len();
        Ok(OpenedHandle { mapping, len })
    }

    /// `[offset, offset + len)` of the mapping, checked against what it maps: never
    /// trust the peer's geometry.
    pub(super) fn holding(
        &self,
        offset: usize,
        len: usize,
    ) -> Result<DeviceSource<'_>, CudaChannelError> {
        self.mapping.source().slice(offset, len).ok_or_else(|| {
            CudaChannelError::protocol(
                "cuda_ipc descriptor",
                format!(
                    "it lends {len} bytes at offset {offset} of an allocation of {}",
                    self.len
                ),
            )
        })
    }
}

/// `cuMemAlloc` blocks for a device's caching allocator.
#[derive(Debug)]
pub(super) struct DeviceBacking {
    pub(super) gpu: Gpu,
}

impl BackingAllocator for DeviceBacking {
    type Block = DeviceAllocation;
    type Error = CudaChannelError;

    fn allocate(&mut self, len: usize) -> Result<DeviceAllocation, CudaChannelError> {
        self.gpu.alloc(len).map_err(CudaChannelError::from)
    }
}

/// `cuMemHostAlloc` blocks for a device's cache of staged-out tensors.
pub(super) struct PinnedBacking {
    pub(super) gpu: Gpu,
}

impl BackingAllocator for PinnedBacking {
    type Block = StagingBuffer;
    type Error = CudaChannelError;

    fn allocate(&mut self, len: usize) -> Result<StagingBuffer, CudaChannelError> {
        StagingBuffer::new(&self.gpu, len).map_err(CudaChannelError::from)
    }
}
