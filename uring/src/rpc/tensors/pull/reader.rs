//! [`PipeReader`]: what one pipe reads tensors from, for its whole life.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use rdzv_core::negotiate::ChannelKind;

use crate::channel::cma::CmaPeer;
use crate::channel::ProcessIdentity;
use crate::rpc::device::{DeviceBuffer, DeviceError, Devices, PipeId};
use crate::rpc::error::{CallError, ChannelFailure};

/// What a pipe reads from: the peer process behind its cma descriptors, opened on first
/// use and then fixed for the pipe's life; and the device runtimes that borrowed lent
/// memory on it, told when it ends (dropped) so that they release what they kept for it.
#[derive(Debug)]
pub(crate) struct PipeReader {
    cma: Mutex<Option<Arc<CmaPeer>>>,
    id: PipeId,
    borrowed: std::sync::OnceLock<Devices>,
    /// Device tensors the pipe's mpt connections received into device memory as their frame
    /// arrived (`cuda_basic` over mpt), by transfer id, until the frame is sorted.
    arrived: Mutex<HashMap<u64, Result<DeviceBuffer, DeviceError>>>,
}

impl Default for PipeReader {
    fn default() -> Self {
        PipeReader {
            cma: Mutex::new(None),
            id: PipeId::next(),
            borrowed: std::sync::OnceLock::new(),
            arrived: Mutex::new(HashMap::new()),
        }
    }
}

impl Drop for PipeReader {
    fn drop(&mut self) {
        if let Some(devices) = self.borrowed.get() {
            devices.pipe_ended(self.id);
        }
    }
}

impl PipeReader {
    /// Keeps what mpt transfer `transfer_id` of a frame just received became on a device
    /// (its memory, or why the runtime failed it), for [`ReceivedTensors::sort`].
    pub(crate) fn arrived(&self, transfer_id: u64, memory: Result<DeviceBuffer, DeviceError>) {
        self.arrived
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(transfer_id, memory);
    }

    /// What mpt transfer `transfer_id` became on a device, if it arrived that way.
    pub(in crate::rpc::tensors) fn take_arrived(
        &self,
        transfer_id: u64,
    ) -> Option<Result<DeviceBuffer, DeviceError>> {
        self.arrived
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&transfer_id)
    }

    /// The pipe's id, for the device runtimes; notes that `devices` borrowed on it.
    pub(in crate::rpc::tensors) fn borrowing_pipe(&self, devices: &Devices) -> PipeId {
        let _ = self.borrowed.get_or_init(|| devices.clone());
        self.id
    }

    /// The cma peer for a descriptor naming `process`: the pipe's, opened now if it is the
    /// first. A descriptor naming another process than the pipe's first is refused.
    pub(super) fn cma_peer(
        &self,
        process: &ProcessIdentity,
        peer: &str,
    ) -> Result<Arc<CmaPeer>, CallError> {
        let mut slot = self.cma.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(open) = slot.as_ref() {
            if open.process() == process {
                return Ok(Arc::clone(open));
            }
            return Err(CallError::Channel {
                channel: ChannelKind::Cma.name(),
                peer: peer.to_string(),
                index: None,
                reason: ChannelFailure::OtherProcess {
                    named: process.pid,
                    reading: open.process().pid,
                },
            });
        }
        let opened = Arc::new(CmaPeer::open(process).map_err(|e| CallError::Channel {
            channel: ChannelKind::Cma.name(),
            peer: peer.to_string(),
            index: None,
            reason: ChannelFailure::OpenPeer(e),
        })?);
        *slot = Some(Arc::clone(&opened));
        Ok(opened)
    }
}
