//! [`LentBytes`]: host memory that a tensor's owner lends to the agent for a send, as
//! device memory on the CPU device (the message module's `Tensor::lent` makes a tensor of
//! it; a binding keeps its object alive inside the value, and the channels read the
//! bytes where they are).

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use rdzv_core::device::Device;

use super::{DeviceMemory, HostBytes, StagedBytes};

/// Bytes lent to the agent by their owner: a shared handle to a [`StagedBytes`] value
/// (its contract applies: the same slice on every call, at the same address, unchanged,
/// while the value lives). Dropping the last handle releases the loan, which is the
/// owner's cue that the agent no longer reads the memory.
///
/// The agent holds a handle until every channel is done with the bytes: an inline
/// frame until it is written, a `cma` or `xth` export until the peer acknowledged it
/// (a request's: its reply) or the pipe ended, an `mpt` stream until its stripes are
/// written. Whoever lends promises not to change the bytes meanwhile (torch asks the same
/// of a tensor passed to `rpc_async` until its future completes).
#[derive(Clone)]
pub struct LentBytes(Arc<dyn StagedBytes>);

impl LentBytes {
    /// A handle to `bytes`.
    pub fn new(bytes: impl StagedBytes) -> LentBytes {
        LentBytes(Arc::new(bytes))
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }

    /// The bytes as the host memory a channel reads (sharing the loan).
    pub(crate) fn host_bytes(&self) -> HostBytes {
        HostBytes::staged(self.clone())
    }
}

impl StagedBytes for LentBytes {
    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl DeviceMemory for LentBytes {
    fn device(&self) -> Device {
        Device::cpu()
    }

    fn len(&self) -> usize {
        self.0.bytes().len()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl fmt::Debug for LentBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LentBytes")
            .field("len", &self.0.bytes().len())
            .finish()
    }
}
