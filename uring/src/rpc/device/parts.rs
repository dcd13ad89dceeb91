//! A received tensor on its way into device memory in parts that arrive in any order
//! ([`PartsIn`], from [`Devices::receive_parts`]): the sink `mpt`'s lanes read their
//! stripes into ([`StripeSink`]), each piece handed to the runtime's
//! [`PartedReceive`] as soon as its lane read it.

use rdzv_core::device::Device;
use rdzv_core::negotiate::ChannelKind;

use super::plugin::{PartBuffer, PartedReceive};
use super::runtimes::{check_made, Devices};
use super::{DeviceBuffer, DeviceError};
use crate::channel::mpt::StripeSink;

/// A tensor received onto `device` in parts (see the module docs).
pub(crate) struct PartsIn {
    parted: Box<dyn PartedReceive>,
    device: Device,
    len: usize,
}

impl std::fmt::Debug for PartsIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartsIn")
            .field("device", &self.device)
            .field("len", &self.len)
            .field("part_len", &self.parted.part_len())
            .finish()
    }
}

impl Devices {
    /// Where a `len`-byte tensor for `device` (not the CPU) carried by `mpt` is read:
    /// the runtime's parts, or `None` when it takes the bytes only whole (or has no
    /// runtime for `device`: the tensor is then refused when its frame is served).
    ///
    /// # Errors
    /// The runtime's: the caller reads the bytes whole instead.
    pub(crate) fn receive_parts(
        &self,
        device: Device,
        len: usize,
    ) -> Result<Option<PartsIn>, DeviceError> {
        let Some(runtime) = self.runtime(device.kind()) else {
            return Ok(None);
        };
        let parted = runtime
            .receive_parts(device, len)
            .map_err(|e| e.located(device, Some(ChannelKind::CudaBasic)))?;
        Ok(parted.map(|parted| PartsIn {
            parted,
            device,
            len,
        }))
    }
}

impl PartsIn {
    /// Every part was filled: the device memory, checked to be what was asked for.
    pub(crate) fn finish(self) -> Result<DeviceBuffer, DeviceError> {
        let PartsIn {
            parted,
            device,
            len,
        } = self;
        let memory = parted
            .finish()
            .map_err(|e| e.located(device, Some(ChannelKind::CudaBasic)))?;
        check_made(device, len as u64, &memory).map_err(|why| {
            DeviceError::new(super::DeviceOp::ReceiveStaged, why)
                .on(device)
                .over(ChannelKind::CudaBasic)
        })?;
        Ok(memory)
    }

    fn failed(&self, e: DeviceError) -> String {
        e.located(self.device, Some(ChannelKind::CudaBasic))
            .report()
    }
}

impl StripeSink for PartsIn {
    type Piece = Box<dyn PartBuffer>;

    fn piece_len(&self) -> usize {
        self.parted.part_len().max(1)
    }

    fn take(&self, offset: usize, len: usize) -> Result<Box<dyn PartBuffer>, String> {
        self.parted.part(offset, len).map_err(|e| self.failed(e))
    }

    fn bytes<'p>(&self, piece: &'p mut Box<dyn PartBuffer>) -> &'p mut [u8] {
        piece.bytes_mut()
    }

    fn put(&self, piece: Box<dyn PartBuffer>) -> Result<(), String> {
        self.parted.part_filled(piece).map_err(|e| self.failed(e))
    }
}
