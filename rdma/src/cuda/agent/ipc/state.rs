//! What `cuda_ipc` keeps per opened device ([`IpcState`]): the borrower's opened mappings
//! and the peers' opened loan events (each cached per pipe, [`super::mappings`]), and the
//! lender's pool of interprocess loan events. `DeviceState` owns one beside the other
//! channels' state; this module only makes it, and decides no loan (the lending and
//! borrowing are in [`super`]).

use std::sync::Mutex;

use crate::cuda::agent::driver::{DriverOpener, EventOpener, LoanEvent};
use crate::cuda::agent::ipc::mappings::IpcMappings;
use crate::cuda::memory::Gpu;

/// `cuda_ipc`'s caches on one device. Field order is drop order: the opened events and
/// mappings go before the pool of this process's loan events.
pub(in crate::cuda::agent) struct IpcState {
    /// The peers' `cuda_ipc` loan events opened here, per pipe (keyed like mappings, by a
    /// hash of the handle in place of the base: another handle is another event).
    pub(in crate::cuda::agent) opened_events: Mutex<IpcMappings<EventOpener>>,
    /// The peers' memory opened here, per pipe.
    pub(in crate::cuda::agent) mappings: Mutex<IpcMappings<DriverOpener>>,
    /// Interprocess events of settled `cuda_ipc` loans, for the next loans.
    pub(in crate::cuda::agent) loan_events: Mutex<Vec<LoanEvent>>,
}

impl IpcState {
    /// Empty caches on `gpu`: at most `mappings_per_device` mappings (and as many opened
    /// events) and `mapped_bytes_per_device` mapped bytes.
    pub(in crate::cuda::agent) fn new(
        gpu: &Gpu,
        mappings_per_device: usize,
        mapped_bytes_per_device: usize,
    ) -> IpcState {
        IpcState {
            opened_events: Mutex::new(IpcMappings::new(
                EventOpener { gpu: gpu.clone() },
                mappings_per_device,
                usize::MAX,
            )),
            mappings: Mutex::new(IpcMappings::new(
                DriverOpener { gpu: gpu.clone() },
                mappings_per_device,
                mapped_bytes_per_device,
            )),
            loan_events: Mutex::new(Vec::new()),
        }
    }
}
