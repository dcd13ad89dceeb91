//! Outgoing tensors into a frame: inline bytes, or a channel descriptor plus the
//! buffer lent to the peer ([`FrameExports`]) until it is done with it.

use std::fmt;

use rdzv_core::device::Device;
use rdzv_core::negotiate::ChannelKind;
use rdzv_core::rpc::frame::TensorDescriptor;

use super::ChannelBytes;
use crate::channel::cma::CmaExport;
use crate::channel::mpt::MptDescriptor;
use crate::channel::next_transfer_id;
use crate::channel::xth::XthExport;
use crate::rpc::device::{DeviceLoan, Devices, HostBytes};
use crate::rpc::error::{CallError, ChannelFailure};
use crate::rpc::recycle;
use crate::rpc::transport::OwnedFrame;

/// A buffer lent to the peer over a channel.
pub(super) enum Export {
    Cma(CmaExport<HostBytes>),
    Xth(XthExport<HostBytes>),
    /// Device memory (`cuda_xth`, `cuda_ipc`, `cuda_gdr`): only dropped, never recycled.
    Device(DeviceLoan),
}

/// A frame's tensors to push over mpt, by transfer id, in frame order.
pub(crate) type Streamed = Vec<(u64, HostBytes)>;

/// The buffers one frame lent to the peer, held until the peer is done with them
/// (dropping the value releases them: the export is abandoned, which is right once the
/// peer acknowledged or can no longer read).
#[derive(Default)]
pub(crate) struct FrameExports {
    pub(super) exports: Vec<Export>,
    /// Tensors to push over mpt after the frame, by transfer id, in frame order.
    streamed: Streamed,
}

impl FrameExports {
    /// Whether the frame lent nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.exports.is_empty()
    }

    /// The tensors the frame sends over mpt, in frame order: the sender writes them on
    /// its mpt connections right after the frame.
    pub(crate) fn take_streamed(&mut self) -> Streamed {
        std::mem::take(&mut self.streamed)
    }

    /// Releases the buffers after the peer said it is done with them (a reply to the
    /// request, or the caller's ack), keeping large ones for the next receive
    /// (`super::recycle`). Buffers released because the pipe ended are only dropped
    /// (plain `Drop`): a peer still reading then fails (EFAULT) instead of reading a
    /// buffer that holds something else.
    pub(crate) fn recycle(mut self) {
        for export in self.exports.drain(..) {
            match export {
                // Staged bytes go back to their device runtime.
                Export::Cma(export) => export.abandon().into_owned().map_or((), recycle::give),
                Export::Xth(export) => export.abandon().into_owned().map_or((), recycle::give),
                Export::Device(loan) => drop(loan),
            }
        }
    }
}

impl Drop for FrameExports {
    fn drop(&mut self) {
        // The peer acknowledged, or can no longer read: the buffers are ours again.
        for export in self.exports.drain(..) {
            match export {
                Export::Cma(export) => drop(export.abandon()),
                Export::Xth(export) => drop(export.abandon()),
                Export::Device(loan) => drop(loan),
            }
        }
    }
}

impl fmt::Debug for FrameExports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrameExports")
            .field("count", &self.exports.len())
            .finish()
    }
}

/// Why a tensor could not be put into a frame.
fn export_failed(kind: ChannelKind, peer: &str, reason: ChannelFailure) -> CallError {
    CallError::Channel {
        channel: kind.name(),
        peer: peer.to_string(),
        index: None,
        reason,
    }
}

/// A channel's error exporting a tensor.
fn export_error(source: impl std::error::Error + Send + Sync + 'static) -> ChannelFailure {
    ChannelFailure::Export {
        source: Box::new(source),
    }
}

/// Adds `data` to `frame` as a tensor from `source` to `target` over `channel` (the one
/// negotiated for the pair): inline when the channel is `basic` or the tensor is below
/// `min_channel_bytes`, otherwise as an export whose descriptor goes into the frame and
/// whose buffer joins `exports` (for `mpt`: whose bytes join the tensors the lane pushes
/// after the frame). Counts the bytes per channel into `moved`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_tensor(
    frame: &mut OwnedFrame,
    exports: &mut FrameExports,
    moved: &mut ChannelBytes,
    data: HostBytes,
    source: Device,
    target: Device,
    channel: ChannelKind,
    min_channel_bytes: u64,
    peer: &str,
) -> Result<(), CallError> {
    let len = data.len() as u64;
    let out_of_band = channel != ChannelKind::Basic && len > 0 && len >= min_channel_bytes;
    if !out_of_band {
        frame
            .tensors
            .push(TensorDescriptor::inline(source, target, len));
        frame.tensor_data.push(data);
        moved.add(ChannelKind::Basic, len);
        return Ok(());
    }
    let (export, descriptor) = match channel {
        ChannelKind::Cma => {
            let export =
                CmaExport::new(data).map_err(|e| export_failed(channel, peer, export_error(e)))?;
            let descriptor = export.descriptor().encode().to_vec();
            (Export::Cma(export), descriptor)
        }
        ChannelKind::Xth => {
            let export =
                XthExport::new(data).map_err(|e| export_failed(channel, peer, export_error(e)))?;
            let descriptor = export.descriptor().encode().to_vec();
            (Export::Xth(export), descriptor)
        }
        ChannelKind::Mpt => {
            let transfer_id = next_transfer_id();
            let descriptor = MptDescriptor { transfer_id }.encode().to_vec();
            frame.tensors.push(TensorDescriptor {
                channel,
                channel_descriptor_len: MptDescriptor::ENCODED_LEN as u8,
                ..TensorDescriptor::inline(source, target, len)
            });
            frame.tensor_data.push(descriptor.into());
            exports.streamed.push((transfer_id, data));
            moved.add(channel, len);
            return Ok(());
        }
        other => return Err(export_failed(other, peer, ChannelFailure::ExportNotRun)),
    };
    let descriptor_len = u8::try_from(descriptor.len())
        .map_err(|_| export_failed(channel, peer, ChannelFailure::ExportDescriptorTooLong))?;
    frame.tensors.push(TensorDescriptor {
        channel,
        channel_descriptor_len: descriptor_len,
        ..TensorDescriptor::inline(source, target, len)
    });
    frame.tensor_data.push(descriptor.into());
    exports.exports.push(export);
    moved.add(channel, len);
    Ok(())
}

/// Adds tensor `index`'s device `memory` (on `source`) to `frame`, lent over the device
/// channel `channel` (`cuda_xth`, `cuda_ipc`, `cuda_gdr`) to `target`: its loan's
/// descriptor goes into the frame and the loan joins `exports`. Empty memory goes inline
/// (there is nothing to lend); a tensor without device memory is an error. Counts the
/// bytes into `moved`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_device_tensor(
    frame: &mut OwnedFrame,
    exports: &mut FrameExports,
    moved: &mut ChannelBytes,
    devices: &Devices,
    (index, memory): (usize, Option<&crate::rpc::device::DeviceBuffer>),
    (source, target): (Device, Device),
    channel: ChannelKind,
    peer: &str,
) -> Result<(), CallError> {
    let failed = |reason: ChannelFailure| CallError::Channel {
        channel: channel.name(),
        peer: peer.to_string(),
        index: Some(index),
        reason,
    };
    if memory.is_some_and(|m| m.is_empty()) {
        frame
            .tensors
            .push(TensorDescriptor::inline(source, target, 0));
        frame.tensor_data.push(HostBytes::default());
        return Ok(());
    }
    let loan = devices
        .lend(channel, source, memory)
        .map_err(|e| CallError::Device {
            channel: channel.name(),
            peer: peer.to_string(),
            index,
            source: Box::new(e),
        })?;
    let len = memory.map_or(0, |m| m.len() as u64);
    let descriptor_len = u8::try_from(loan.descriptor.len())
        .map_err(|_| failed(ChannelFailure::LoanDescriptorTooLong))?;
    frame.tensors.push(TensorDescriptor {
        channel,
        channel_descriptor_len: descriptor_len,
        ..TensorDescriptor::inline(source, target, len)
    });
    frame.tensor_data.push(loan.descriptor.clone().into());
    exports.exports.push(Export::Device(loan));
    moved.add(channel, len);
    Ok(())
}
