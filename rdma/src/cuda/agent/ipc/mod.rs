//! `cuda_ipc`'s two sides in the runtime.
//!
//! **Lending** ([`lend`]): the descriptor names the allocation by its IPC memory handle
//! (made once per allocation, cached with it) and base address, and carries the handle
//! of an interprocess event from the device's pool, recorded on a runtime stream after
//! the memory's ready event ([`crate::cuda::loan_events::fence_loan`]). The loan's hold
//! ([`IpcLoan`]) keeps the memory; when the loan ends it waits for the event's last
//! record (the borrower's, after its copy) and puts the event back in the pool.
//!
//! **Borrowing** ([`borrow`]): the mapping and the event are opened once per pipe, peer
//! and device ([`crate::cuda::agent::ipc::mappings`]: a new handle at a known base is a recycled
//! address, reopened); the copy waits on the lender's event on the GPU, then records it
//! and an event of this process, which is waited for before the tensor is handed over.

pub mod mappings;
pub(super) mod state;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use rdzv_core::channel::cuda::{CudaIpcDescriptor, IPC_HANDLE_LEN};
use rdzv_core::channel::ProcessIdentity;
use rdzv_uring::rpc::{DeviceBuffer, DeviceLoan, PipeId};

use super::device::{DeviceState, LoanHold, Settle};
use super::driver::{DriverStream, LoanEvent, OpenedHandle};
use super::lock;
use super::tensor_memory::CudaMemory;
use crate::cuda::agent::ipc::mappings::MappingKey;
use crate::cuda::error::CudaChannelError;
use crate::cuda::loan_events::{self};
use crate::cuda::memory::{copy_unified_async, DeviceSource, RawEvent};
use crate::error_chain::ErrorChain;

impl DeviceState {
    /// Fills the pool of loan events with `count`; one that cannot be made is left to
    /// the first loan that needs it (which then reports the driver's error).
    pub(super) fn prepare_loan_events(&self, count: usize) {
        let mut made = Vec::with_capacity(count);
        for _ in 0..count {
            match self.take_loan_event() {
                Ok(event) => made.push(event),
                Err(e) => {
                    tracing::debug!(
                        error = %ErrorChain(&e),
                        device = %self.device,
                        "no cuda_ipc loan event made up front"
                    );
                    break;
                }
            }
        }
        lock(&self.ipc.loan_events).extend(made);
    }

    /// An idle loan event, made now if the pool has none.
    fn take_loan_event(&self) -> Result<LoanEvent, CudaChannelError> {
        if let Some(event) = lock(&self.ipc.loan_events).pop() {
            return Ok(event);
        }
        // CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING, as an exported event needs.
        let event = RawEvent::new(&self.gpu, true)?;
        let handle = event.ipc_handle()?;
        Ok(LoanEvent { event, handle })
    }
}

/// Lends `own` (held by `memory`), of `state`'s device, to another process.
pub(super) fn lend(
    state: &Arc<DeviceState>,
    process: ProcessIdentity,
    memory: &DeviceBuffer,
    own: &CudaMemory,
) -> Result<DeviceLoan, CudaChannelError> {
    let handle = own.allocation().ipc_handle()?;
    let event = state.take_loan_event()?;
    state.gpu.bind()?;
    {
        let ready = own.ready_event();
        let mut stream = DriverStream(state.stream());
        // On failure the event is dropped: it may hold a half-made record.
        loan_events::fence_loan(&mut stream, ready.as_deref(), &event.event)?;
    }
    let descriptor = CudaIpcDescriptor {
        process,
        handle,
        offset: 0,
        length: own.len as u64,
        device: u32::from(own.device.index().unwrap_or(0)),
        base: own.allocation().range().ptr(),
        event: event.handle,
    };
    Ok(DeviceLoan {
        descriptor: descriptor.encode().to_vec(),
        hold: Box::new(LoanHold {
            settle: Some(event),
            memory: Some(memory.clone()),
            state: Arc::clone(state),
        }),
    })
}

/// A `cuda_ipc` loan ends when the borrower has recorded its event after its copy; the
/// event goes back to the pool.
impl Settle for LoanEvent {
    const CHANNEL: &'static str = "cuda_ipc";
    type Error = CudaChannelError;

    fn settle(self, state: &DeviceState) -> Result<(), CudaChannelError> {
        loan_events::settle_loan(&self.event)?;
        lock(&state.ipc.loan_events).push(self);
        Ok(())
    }
}

/// What `borrow` needs from the descriptor and the agent.
pub(super) struct Borrowing<'a> {
    pub(super) pipe: Option<PipeId>,
    pub(super) lent: &'a CudaIpcDescriptor,
    pub(super) offset: usize,
    pub(super) target: usize,
}

/// Copies the lent range into `memory` (fresh, of `state`'s device, as long), after the
/// lender's event; returns once the copy is complete.
pub(super) fn borrow(
    state: &DeviceState,
    how: Borrowing<'_>,
    memory: &CudaMemory,
) -> Result<(), CudaChannelError> {
    let lent = how.lent;
    state.gpu.bind()?;
    let copy = |mapping: &OpenedHandle, event: &RawEvent| -> Result<(), CudaChannelError> {
        let src = mapping.holding(how.offset, memory.len)?;
        copy_after_loan(state, memory, src, event)
    };
    match how.pipe {
        Some(pipe) => {
            let key = |base| MappingKey {
                pipe: pipe.get(),
                peer: lent.process,
                device: how.target,
                base,
            };
            let mapping = lock(&state.ipc.mappings).get(key(lent.base), &lent.handle)?;
            let event =
                lock(&state.ipc.opened_events).get(key(event_key(&lent.event)), &lent.event)?;
            copy(&mapping, &event)
        }
        None => {
            let mapping = OpenedHandle::open(&state.gpu, &lent.handle)?;
            let event = RawEvent::open_ipc(&state.gpu, &lent.event)?;
            copy(&mapping, &event)
        }
    }
}

/// The borrower's copy into `memory` on one of the device's streams, ordered by the
/// loan's event ([`loan_events::copy_after_loan`]), then waited for with an event of
/// this process; or, with [`super::CudaOptions::pending_hand_over`], left running with
/// that event as the memory's ready event.
fn copy_after_loan(
    state: &DeviceState,
    memory: &CudaMemory,
    src: DeviceSource<'_>,
    loan: &RawEvent,
) -> Result<(), CudaChannelError> {
    let done = state.take_event()?;
    let mut stream = DriverStream(state.stream());
    let dst = memory.range();
    loan_events::copy_after_loan(&mut stream, loan, &done, |s| {
        copy_unified_async(dst, src, s.0).map_err(CudaChannelError::from)
    })?;
    if state.pending_hand_over {
        memory.set_ready(Arc::new(done));
        return Ok(());
    }
    // The tensor is complete when the agent hands it over.
    done.synchronize()?;
    lock(&state.events).push(done);
    Ok(())
}

/// Where an opened event is kept: a hash of its handle stands in for a mapping's base
/// (a collision only reopens, as a recycled base does).
fn event_key(handle: &[u8; IPC_HANDLE_LEN]) -> u64 {
    let mut hasher = DefaultHasher::new();
    handle.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::agent::ipc::mappings::{IpcMappings, MappingOpener};

    /// Counts opens; an "event" is its handle's first byte.
    struct Counting(u64);

    impl MappingOpener for Counting {
        type Mapping = u8;
        type Error = String;
        fn open(&mut self, handle: &[u8; IPC_HANDLE_LEN], _: usize) -> Result<u8, String> {
            self.0 += 1;
            Ok(handle[0])
        }
        fn mapped_len(_: &u8) -> usize {
            0
        }
    }

    fn key(pipe: u64, handle: &[u8; IPC_HANDLE_LEN]) -> MappingKey {
        MappingKey {
            pipe,
            peer: ProcessIdentity {
                boot_id: [1; 16],
                pid_namespace: 2,
                user_namespace: 3,
                pid: 4,
                start_time: 5,
            },
            device: 0,
            base: event_key(handle),
        }
    }

    /// The borrower opens each of a lender's pooled events once per pipe: the same
    /// handle is a hit, another handle is another event (not a recycled one), and a
    /// pipe's end closes its events only.
    #[test]
    fn opened_events_are_kept_per_pipe_by_handle() {
        let mut events = IpcMappings::new(Counting(0), 8, usize::MAX);
        let (a, b) = ([1u8; IPC_HANDLE_LEN], [2u8; IPC_HANDLE_LEN]);
        assert_ne!(event_key(&a), event_key(&b));
        assert_eq!(event_key(&a), event_key(&[1u8; IPC_HANDLE_LEN]));
        for _ in 0..3 {
            assert_eq!(events.get(key(1, &a), &a).map(|e| *e), Ok(1));
            assert_eq!(events.get(key(1, &b), &b).map(|e| *e), Ok(2));
        }
        assert_eq!(events.get(key(2, &a), &a).map(|e| *e), Ok(1));
        let stats = events.stats();
        assert_eq!((stats.opens, stats.hits, stats.recycled), (3, 4, 0));
        events.close_pipe(1);
        assert_eq!(events.len(), 1);
    }
}
