//! Received tensors out of a frame: inline bytes taken, out-of-band ones pulled over
//! their channel ([`ReceivedTensors::pull`]), in parallel slices when large, chunk by
//! chunk into a device runtime's staging for a device.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use rdzv_core::device::Device;
use rdzv_core::negotiate::{ChannelKind, Negotiated, Role};
use rdzv_core::rpc::frame::TensorDescriptor;
pub(crate) use rdzv_core::rpc::lending::lends_device_memory;

use crate::channel::buffer::prefer_huge_pages;
use crate::channel::cma::{CmaDescriptor, CmaError, CmaPeer};
use crate::channel::mpt::MptDescriptor;
use crate::channel::xth::{self, XthDescriptor, XthError};
use crate::channel::ProcessIdentity;
use crate::rpc::device::{DeviceBuffer, DeviceError, Devices, PipeId, StagingIn};
use crate::rpc::error::{CallError, ChannelCause, ChannelFailure};
use crate::rpc::message::Tensor;
use crate::rpc::recycle;

/// Out-of-band tensors of at least this size are read by several threads at once, each
/// a slice of at least [`PARALLEL_SLICE_MIN`] bytes: a fresh destination buffer is
/// faulted in and filled in parallel (a fresh, huge-page-hinted 64 MiB buffer read over
/// cma on this project's 2-vCPU VM, best of 5: 17.6 ms with one thread, 10.3 ms with
/// two).
pub(super) const PARALLEL_PULL_MIN: usize = 8 << 20;
/// The smallest slice one pulling thread reads.
const PARALLEL_SLICE_MIN: usize = 4 << 20;
/// The most threads one tensor's pull uses.
const PARALLEL_PULL_THREADS: usize = 4;

/// Fills `dst` with `read(offset, slice)` calls: for large buffers several slices at
/// once, the last on the calling thread and the others on scoped threads. The first
/// error wins.
pub(super) fn read_in_slices(
    dst: &mut [u8],
    read: impl Fn(u64, &mut [u8]) -> Result<(), ChannelCause> + Sync,
) -> Result<(), ChannelCause> {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(PARALLEL_PULL_THREADS)
        .min(dst.len() / PARALLEL_SLICE_MIN);
    if dst.len() < PARALLEL_PULL_MIN || threads < 2 {
        return read(0, dst);
    }
    let slice = dst.len().div_ceil(threads);
    let read = &read;
    std::thread::scope(|scope| {
        let mut parts: Vec<(u64, &mut [u8])> = dst
            .chunks_mut(slice)
            .enumerate()
            .map(|(index, part)| ((index * slice) as u64, part))
            .collect();
        let Some((last_offset, last)) = parts.pop() else {
            return Ok(());
        };
        let mut running = Vec::with_capacity(parts.len());
        for (offset, part) in parts {
            let started = std::thread::Builder::new()
                .name("rdzv-rpc-pull".into())
                .spawn_scoped(scope, move || read(offset, part))
                .map_err(|source| ChannelCause::from(SpawnFailed(source)));
            running.push(started);
        }
        let mut result = read(last_offset, last);
        for started in running {
            let outcome = started.and_then(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            });
            if result.is_ok() {
                result = outcome;
            }
        }
        result
    })
}

/// A thread to read a slice of a tensor with could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot start a thread to read with: {0}")]
struct SpawnFailed(#[source] std::io::Error);

/// What a pipe reads from: the peer process behind its cma descriptors, opened on first
/// use and then fixed for the pipe's life; and the device runtimes that borrowed lent
/// memory on it, told when it ends (dropped) so that they release what they kept for it.
#[derive(Debug)]
pub(crate) struct PipeReader {
    cma: Mutex<Option<Arc<CmaPeer>>>,
    id: PipeId,
    borrowed: std::sync::OnceLock<Devices>,
    /// Device tensors the pipe's mpt lanes received into device memory as their frame
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
    pub(super) fn take_arrived(
        &self,
        transfer_id: u64,
    ) -> Option<Result<DeviceBuffer, DeviceError>> {
        self.arrived
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&transfer_id)
    }

    /// The pipe's id, for the device runtimes; notes that `devices` borrowed on it.
    pub(super) fn borrowing_pipe(&self, devices: &Devices) -> PipeId {
        let _ = self.borrowed.get_or_init(|| devices.clone());
        self.id
    }

    /// The cma peer for a descriptor naming `process`: the pipe's, opened now if it is the
    /// first. A descriptor naming another process than the pipe's first is refused.
    fn cma_peer(&self, process: &ProcessIdentity, peer: &str) -> Result<Arc<CmaPeer>, CallError> {
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
        // What the frame's mpt lanes already put in device memory, dropped if the frame
        // is refused (the memory would otherwise wait for the pipe's end).
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
                ChannelKind::Cma => {
                    let decoded = CmaDescriptor::decode(&data)
                        .map_err(|e| refuse(ChannelFailure::BadDescriptor(e)))?;
                    if decoded.length != descriptor.len {
                        return Err(length_mismatch(decoded.length));
                    }
                    items.push(Incoming::Cma {
                        device,
                        descriptor: decoded,
                    });
                }
                ChannelKind::Xth => {
                    let decoded = XthDescriptor::decode(&data)
                        .map_err(|e| refuse(ChannelFailure::BadDescriptor(e)))?;
                    if decoded.length != descriptor.len {
                        return Err(length_mismatch(decoded.length));
                    }
                    items.push(Incoming::Xth {
                        device,
                        descriptor: decoded,
                    });
                }
                // Its stripes are read off the lanes as the frame arrives, which turns
                // the entry into an inline one, or (a device tensor whose runtime takes
                // parts) into device memory kept by the reader; one still here otherwise
                // came on a pipe that has no lanes.
                ChannelKind::Mpt => {
                    let arrived = MptDescriptor::decode(&data)
                        .ok()
                        .and_then(|d| reader.take_arrived(d.transfer_id));
                    let memory = arrived
                        .ok_or_else(|| refuse(ChannelFailure::NoLanes))?
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

/// One tensor read from the peer over `channel` (cma or xth), into host memory or, for a
/// device, chunk by chunk into its runtime's staging.
struct Pull<'a> {
    devices: &'a Devices,
    channel: ChannelKind,
    index: usize,
    peer: &'a str,
}

impl Pull<'_> {
    /// Reads `length` bytes for `device` with `read(offset, part)`, whose error says
    /// whether the lender no longer holds the buffer (cma: its pages are unmapped,
    /// `EFAULT`; xth: the transfer is gone). A lender releases what it lent only after
    /// the ack, or when its pipe ends, so such a read overlapped the end of the pipe on
    /// the lender's side (a reset, a shutdown): the call fails with the pipe
    /// ([`CallError::PipeBroken`], retryable), not the channel.
    fn read(
        &self,
        device: Device,
        length: u64,
        read: impl Fn(u64, &mut [u8]) -> Result<(), (bool, ChannelCause)> + Sync,
    ) -> Result<Tensor, CallError> {
        let released = std::sync::atomic::AtomicBool::new(false);
        let read = |offset, part: &mut [u8]| {
            read(offset, part).map_err(|(gone, reason)| {
                if gone {
                    released.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                reason
            })
        };
        let or_released = |error: CallError| {
            if !released.load(std::sync::atomic::Ordering::Relaxed) {
                return error;
            }
            CallError::PipeBroken {
                peer: self.peer.to_string(),
                reason: format!(
                    "{} released a tensor it lent while it was read, which it does only when \
                     its end of the pipe ends or is reset ({error})",
                    self.peer
                ),
            }
        };
        let failed = |reason: ChannelFailure| CallError::Channel {
            channel: self.channel.name(),
            peer: self.peer.to_string(),
            index: None,
            reason,
        };
        let len = usize::try_from(length).map_err(|_| failed(ChannelFailure::TooLarge))?;
        if !device.is_cpu() {
            let memory = pull_staged(self.devices, device, len, read)
                .map_err(|e| or_released(e.into_error(self.channel, self.index, self.peer)))?;
            return Ok(Tensor::on_device(memory));
        }
        let mut data =
            recycle::try_take(len).map_err(|e| failed(ChannelFailure::Allocate { len: e.len }))?;
        prefer_huge_pages(&mut data);
        read_in_slices(&mut data, read)
            .map_err(|source| or_released(failed(ChannelFailure::Read { source })))?;
        Ok(Tensor {
            device,
            data,
            memory: None,
        })
    }
}

/// Why a staged pull failed: reading from the peer, or the device runtime.
#[derive(Debug)]
enum PullFailed {
    Read(ChannelCause),
    /// The device runtime's error.
    Staging(DeviceError),
}

impl PullFailed {
    /// The error of tensor `index`, read over `channel` from `peer`.
    fn into_error(self, channel: ChannelKind, index: usize, peer: &str) -> CallError {
        match self {
            PullFailed::Read(source) => CallError::Channel {
                channel: channel.name(),
                peer: peer.to_string(),
                index: Some(index),
                reason: ChannelFailure::Read { source },
            },
            PullFailed::Staging(e) => CallError::Device {
                channel: ChannelKind::CudaBasic.name(),
                peer: peer.to_string(),
                index,
                source: Box::new(e),
            },
        }
    }
}

/// Pulls a `len`-byte tensor for `device` (not the CPU) with `read(offset, part)`,
/// chunk by chunk into the device runtime's staging ([`StagingIn`]): each chunk goes
/// to the device as soon as it is read, while the next one is read. Dropping the
/// staging on a failure lets the runtime take back what it held.
fn pull_staged(
    devices: &Devices,
    device: Device,
    len: usize,
    read: impl Fn(u64, &mut [u8]) -> Result<(), ChannelCause> + Sync,
) -> Result<crate::rpc::device::DeviceBuffer, PullFailed> {
    let mut staging: StagingIn = devices
        .receive_into(device, len)
        .map_err(PullFailed::Staging)?;
    for (k, offset, _) in staging.chunks() {
        let buffer = staging.chunk_buffer(k).map_err(PullFailed::Staging)?;
        read_in_slices(buffer, |at, part| read(offset as u64 + at, part))
            .map_err(PullFailed::Read)?;
        staging.chunk_filled(k).map_err(PullFailed::Staging)?;
    }
    staging.finish().map_err(PullFailed::Staging)
}
