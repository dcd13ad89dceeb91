//! `cuda_xth`'s two sides in the runtime: the driver half of [`crate::cuda::agent::xth::loans`].
//!
//! **Lending** ([`lend`]): a runtime stream waits for the memory's ready event and
//! records a fence (an event of this process's pool); the loan is registered in the
//! process's [`XTH_LOANS`] under the address the descriptor names. The hold
//! ([`XthHold`]) keeps the memory; when the loan ends it waits for the borrower's copy
//! (or the fence), then puts the fence back in the pool.
//!
//! **Borrowing** ([`borrow`]): claims the loan, copies on a runtime stream of the target
//! device after the fence (on the GPU: no host wait for the producer), and records an
//! event of this process after the copy. That event is waited for before the tensor is
//! handed over, or, with [`super::CudaOptions::pending_hand_over`], becomes the
//! received memory's ready event and the tensor is handed over with its copy running.

pub mod loans;

use std::sync::Arc;

use rdzv_core::channel::cuda::CudaXthDescriptor;
use rdzv_core::channel::ProcessIdentity;
use rdzv_uring::rpc::{DeviceBuffer, DeviceLoan};

use super::device::{DeviceState, LoanHold, Settle};
use super::driver::{DriverStream, SETTLE_TIMEOUT};
use super::lock;
use super::tensor_memory::CudaMemory;
use crate::cuda::error::CudaChannelError;
use crate::cuda::loan_events;
use crate::cuda::memory::{copy_unified_async, DeviceSource, RawEvent};
use loans::{XthEndError, XthKey, XthLoan, XthLoans};

/// The `cuda_xth` loans of this process (every agent's runtime lends and borrows here:
/// the channel never leaves the process).
pub(super) static XTH_LOANS: XthLoans<RawEvent> = XthLoans::new();

/// What a `cuda_xth` descriptor names.
fn key_of(descriptor: &CudaXthDescriptor) -> XthKey {
    XthKey {
        device: descriptor.device,
        address: descriptor.address,
        length: descriptor.length,
    }
}

/// Lends `own` (held by `memory`), of `state`'s device, to an agent of this process.
pub(super) fn lend(
    state: &Arc<DeviceState>,
    process: ProcessIdentity,
    memory: &DeviceBuffer,
    own: &CudaMemory,
) -> Result<DeviceLoan, CudaChannelError> {
    let fence = state.take_event()?;
    state.gpu.bind()?;
    {
        let ready = own.ready_event();
        let mut stream = DriverStream(state.stream());
        // On failure the event is dropped: it may hold a half-made record.
        loan_events::fence_loan(&mut stream, ready.as_deref(), &fence)?;
    }
    let descriptor = CudaXthDescriptor {
        process,
        address: own.range().ptr(),
        length: own.len as u64,
        device: u32::from(own.device.index().unwrap_or(0)),
    };
    let key = key_of(&descriptor);
    Ok(DeviceLoan {
        descriptor: descriptor.encode().to_vec(),
        hold: Box::new(LoanHold {
            settle: Some((key, XTH_LOANS.lend(key, fence))),
            memory: Some(memory.clone()),
            state: Arc::clone(state),
        }),
    })
}

/// A `cuda_xth` loan (its key and the loan) ends when the borrower's copy is done; the
/// fence goes back to this process's events.
impl Settle for (XthKey, Arc<XthLoan<RawEvent>>) {
    const CHANNEL: &'static str = "cuda_xth";
    type Error = XthEndError<CudaChannelError>;

    fn settle(self, state: &DeviceState) -> Result<(), Self::Error> {
        let (key, loan) = self;
        XTH_LOANS.end(key, &loan, SETTLE_TIMEOUT)?;
        if let Some(fence) = loan.into_fence() {
            lock(&state.events).push(fence);
        }
        Ok(())
    }
}

/// Copies the memory `lent` names into `memory` (fresh, of `state`'s device, as long),
/// after the lender's fence; returns once the copy is complete, or with the copy running
/// and its event as `memory`'s ready event under the pending hand-over.
pub(super) fn borrow(
    state: &DeviceState,
    lent: &CudaXthDescriptor,
    memory: &CudaMemory,
) -> Result<(), CudaChannelError> {
    let loan = XTH_LOANS.claim(key_of(lent)).ok_or_else(|| {
        CudaChannelError::protocol(
            "cuda_xth descriptor",
            format!(
                "no loan of {} bytes at {:#x} on CUDA device {} is held by this process (it \
                 ended, or the descriptor was not made here)",
                lent.length, lent.address, lent.device
            ),
        )
    })?;
    let started = state
        .gpu
        .bind()
        .map_err(CudaChannelError::from)
        .and_then(|()| state.take_event());
    let done = match started {
        Ok(done) => done,
        Err(e) => {
            loan.abandoned();
            return Err(e);
        }
    };
    // Only read: the lender holds the memory until its loan settled on `done`.
    let src = DeviceSource::named_by_peer(lent.address, memory.len);
    let dst = memory.range();
    let mut stream = DriverStream(state.stream());
    loans::copy_lent(&mut stream, &loan, &done, |s| {
        copy_unified_async(dst, src, s.0).map_err(CudaChannelError::from)
    })?;
    let done = Arc::new(done);
    memory.set_ready(Arc::clone(&done));
    loan.copied(Some(Arc::clone(&done)));
    if state.pending_hand_over {
        return Ok(());
    }
    // The tensor is complete when the agent hands it over.
    done.synchronize().map_err(CudaChannelError::from)
}
