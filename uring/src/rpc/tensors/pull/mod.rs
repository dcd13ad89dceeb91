//! Received tensors out of a frame: inline bytes taken, out-of-band ones pulled over
//! their channel ([`ReceivedTensors::pull`]), in parallel slices when large, chunk by
//! chunk into a device runtime's staging for a device.
//!
//! What a pipe reads from is its [`PipeReader`] (`reader`); how one tensor's bytes are
//! read is `read`.

use std::fmt;
use std::sync::Arc;

use rdzv_core::device::Device;
use rdzv_core::negotiate::{ChannelKind, Negotiated, Role};
use rdzv_core::rpc::frame::TensorDescriptor;
pub(crate) use rdzv_core::rpc::lending::lends_device_memory;

use crate::channel::cma::{CmaDescriptor, CmaError};
use crate::channel::mpt::MptDescriptor;
use crate::channel::xth::{self, XthDescriptor, XthError};
use crate::rpc::device::Devices;
use crate::rpc::error::{CallError, ChannelFailure};
use crate::rpc::message::Tensor;

mod read;
mod reader;

use read::Pull;
#[cfg(test)]
pub(super) use read::{read_in_slices, PARALLEL_PULL_MIN};
pub(crate) use reader::PipeReader;

/// A received tensor: its bytes, or where to pull them from.
enum Incoming {
    Ready(Tensor),
    Cma {
        device: Device,
        descriptor: CmaDescriptor,
    },
    Xth {
        device: Device,
        descriptor: XthDescriptor,
    },
    /// Device memory lent over `channel` (`cuda_xth`, `cuda_ipc`, `cuda_gdr`), copied by
    /// this worker's runtime.
    Lent {
        device: Device,
        channel: ChannelKind,
        len: u64,
        descriptor: Vec<u8>,
    },
}

/// A received frame's tensors, in order; the out-of-band ones still have to be pulled,
/// and those for a device other than the CPU staged into its memory.
pub(crate) struct ReceivedTensors {
    items: Vec<Incoming>,
    reader: Arc<PipeReader>,
    devices: Devices,
    peer: String,
}

impl fmt::Debug for ReceivedTensors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceivedTensors")
            .field("tensors", &self.items.len())
            .field("pull_bytes", &self.pull_bytes())
            .field("peer", &self.peer)
            .finish()
    }
}

impl ReceivedTensors {
    /// Sorts a frame's tensors (descriptor and data-section entry): inline ones are
    /// ready; each out-of-band one is checked against what was `negotiated` on this pipe
    /// (this side playing `role`) and its descriptor decoded. A tensor for a device
    /// other than the CPU (`cuda_basic`) needs that device's runtime in `devices`.
    ///
    /// # Errors
    /// [`CallError::Channel`] for a channel that was not negotiated for the tensor's
    /// devices, a descriptor that does not decode or announces another length, or a
    /// target device this worker has no runtime for.
    pub(crate) fn sort(
        tensors: Vec<(TensorDescriptor, Vec<u8>)>,
        negotiated: &Negotiated,
        role: Role,
        source: (&Arc<PipeReader>, &Devices),
        peer: &str,
    ) -> Result<ReceivedTensors, CallError> {
        // What the frame's mpt connections already put in device memory, dropped if the
        // frame is refused (the memory would otherwise wait for the pipe's end).
        let streamed: Vec<u64> = tensors
            .iter()
            .filter(|(descriptor, _)| descriptor.channel == ChannelKind::Mpt)
            .filter_map(|(_, data)| MptDescriptor::decode(data).ok())
            .map(|d| d.transfer_id)
            .collect();
        let sorted = Self::sort_in_order(tensors, negotiated, role, source, peer);
        if sorted.is_err() {
            for transfer_id in streamed {
                drop(source.0.take_arrived(transfer_id));
            }
        }
        sorted
    }

    fn sort_in_order(
        tensors: Vec<(TensorDescriptor, Vec<u8>)>,
        negotiated: &Negotiated,
        role: Role,
        (reader, devices): (&Arc<PipeReader>, &Devices),
        peer: &str,
    ) -> Result<ReceivedTensors, CallError> {
        let mut items = Vec::with_capacity(tensors.len());
        for (index, (descriptor, data)) in tensors.into_iter().enumerate() {
            let device = descriptor.target;
            if !device.is_cpu() && devices.runtime(device.kind()).is_none() {
                let channel = if lends_device_memory(descriptor.channel) {
                    descriptor.channel
                } else {
                    ChannelKind::CudaBasic
                };
                return Err(CallError::Channel {
                    channel: channel.name(),
                    peer: peer.to_string(),
                    index: Some(index),
                    reason: ChannelFailure::NoRuntime {
                        kind: device.kind(),
                        device,
                    },
                });
            }
            if descriptor.is_inline() {
                items.push(Incoming::Ready(Tensor {
                    device,
                    data,
                    memory: None,
                }));
                continue;
            }
            let channel = descriptor.channel;
            let refuse = |reason: ChannelFailure| CallError::Channel {
                channel: channel.name(),
                peer: peer.to_string(),
                index: Some(index),
                reason,
            };
            // cuda_basic's bytes come over the pipe's CPU channel.
            let agreed =
                negotiated.carrier_for(role, descriptor.target.kind(), descriptor.source.kind());
            if agreed != Some(channel) {
                return Err(refuse(ChannelFailure::NotNegotiated {
                    agreed,
                    from: descriptor.source.kind(),
                    to: descriptor.target.kind(),
                }));
            }
            let length_mismatch = |announced: u64| {
                refuse(ChannelFailure::LengthMismatch {
                    announced,
                    frame: descriptor.len,
                })
            };
            match channel {
                ChannelKind::Cma | ChannelKind::Xth => {
                    let decoded = if channel == ChannelKind::Cma {
                        CmaDescriptor::decode(&data).map(|descriptor| {
                            (descriptor.length, Incoming::Cma { device, descriptor })
                        })
                    } else {
                        XthDescriptor::decode(&data).map(|descriptor| {
                            (descriptor.length, Incoming::Xth { device, descriptor })
                        })
                    };
                    let (length, item) =
                        decoded.map_err(|e| refuse(ChannelFailure::BadDescriptor(e)))?;
                    if length != descriptor.len {
                        return Err(length_mismatch(length));
                    }
                    items.push(item);
                }
                // Its stripes are read off the mpt connections as the frame arrives, which
                // turns the entry into an inline one, or (a device tensor whose runtime
                // takes parts) into device memory kept by the reader; one still here
                // otherwise came on a pipe that has no mpt connections.
                ChannelKind::Mpt => {
                    let arrived = MptDescriptor::decode(&data)
                        .ok()
                        .and_then(|d| reader.take_arrived(d.transfer_id));
                    let memory = arrived
                        .ok_or_else(|| refuse(ChannelFailure::NoConnections))?
                        .map_err(|e| CallError::Device {
                            channel: ChannelKind::CudaBasic.name(),
                            peer: peer.to_string(),
                            index,
                            source: Box::new(e),
                        })?;
                    if memory.device() != device || memory.len() as u64 != descriptor.len {
                        return Err(refuse(ChannelFailure::StripesMismatch {
                            len: memory.len(),
                            device: memory.device(),
                            expected_len: descriptor.len,
                            expected_device: device,
                        }));
                    }
                    items.push(Incoming::Ready(Tensor::on_device(memory)));
                }
                // The runtime decodes and checks its own descriptors when it copies.
                kind if lends_device_memory(kind) => items.push(Incoming::Lent {
                    device,
                    channel: kind,
                    len: descriptor.len,
                    descriptor: data,
                }),
                _ => return Err(refuse(ChannelFailure::NotRun)),
            }
        }
        Ok(ReceivedTensors {
            items,
            reader: Arc::clone(reader),
            devices: devices.clone(),
            peer: peer.to_string(),
        })
    }

    /// How many bytes [`pull`](Self::pull) will copy: out-of-band tensors from the
    /// peer, and tensors into device memory.
    pub(crate) fn pull_bytes(&self) -> u64 {
        self.items
            .iter()
            .map(|item| {
                let (device, pulled, len) = match item {
                    Incoming::Ready(t) => (t.device, 0, t.data.len() as u64),
                    Incoming::Cma { device, descriptor } => (*device, 1, descriptor.length),
                    Incoming::Xth { device, descriptor } => (*device, 1, descriptor.length),
                    // Copied device to device: no staging.
                    Incoming::Lent { len, .. } => (Device::cpu(), 1, *len),
                };
                let staged = u64::from(!device.is_cpu());
                (pulled + staged) * len
            })
            .fold(0u64, u64::saturating_add)
    }

    /// Whether any tensor travels out of band (so the sender waits for an ack or a
    /// reply).
    pub(crate) fn has_out_of_band(&self) -> bool {
        self.items
            .iter()
            .any(|item| !matches!(item, Incoming::Ready(_)))
    }

    /// Reads every out-of-band tensor into a fresh buffer (blocking copies: cma's
    /// `process_vm_readv`, xth's memcpy, a device runtime's copy of lent device memory),
    /// stages tensors for a device into its memory, and returns all tensors in order.
    ///
    /// # Errors
    /// [`CallError::Channel`] naming the channel, the peer and why (the peer process is
    /// gone, ptrace access was refused, the export no longer exists, ...).
    pub(crate) fn pull(self) -> Result<Vec<Tensor>, CallError> {
        let ReceivedTensors {
            items,
            reader,
            devices,
            peer,
        } = self;
        let mut tensors = Vec::with_capacity(items.len());
        for item in items {
            let tensor = match item {
                Incoming::Ready(tensor) => tensor,
                Incoming::Cma { device, descriptor } => {
                    let source = reader.cma_peer(&descriptor.process, &peer)?;
                    let read = |offset, part: &mut [u8]| {
                        source
                            .read_at(&descriptor, offset, part)
                            .map_err(|e| (matches!(e, CmaError::BadAddress { .. }), e.into()))
                    };
                    let pull = Pull {
                        devices: &devices,
                        channel: ChannelKind::Cma,
                        index: tensors.len(),
                        peer: &peer,
                    };
                    pull.read(device, descriptor.length, read)?
                }
                Incoming::Xth { device, descriptor } => {
                    let read = |offset, part: &mut [u8]| {
                        xth::read_at(&descriptor, offset, part)
                            .map_err(|e| (matches!(e, XthError::UnknownTransfer { .. }), e.into()))
                    };
                    let pull = Pull {
                        devices: &devices,
                        channel: ChannelKind::Xth,
                        index: tensors.len(),
                        peer: &peer,
                    };
                    pull.read(device, descriptor.length, read)?
                }
                Incoming::Lent {
                    device,
                    channel,
                    len,
                    descriptor,
                } => {
                    let index = tensors.len();
                    let pipe = reader.borrowing_pipe(&devices);
                    let memory = devices
                        .borrow(pipe, channel, device, len, &descriptor)
                        .map_err(|e| CallError::Device {
                            channel: channel.name(),
                            peer: peer.clone(),
                            index,
                            source: Box::new(e),
                        })?;
                    tensors.push(Tensor {
                        device,
                        data: Vec::new(),
                        memory: Some(memory),
                    });
                    continue;
                }
            };
            tensors.push(if tensor.device.is_cpu() || tensor.memory.is_some() {
                tensor
            } else {
                let index = tensors.len();
                let (data, memory) = devices.stage_in(tensor.device, tensor.data).map_err(|e| {
                    CallError::Device {
                        channel: ChannelKind::CudaBasic.name(),
                        peer: peer.clone(),
                        index,
                        source: Box::new(e),
                    }
                })?;
                Tensor {
                    device: tensor.device,
                    data,
                    memory,
                }
            });
        }
        Ok(tensors)
    }
}
