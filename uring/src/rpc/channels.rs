//! The agent's tensor channels: which channels this process can offer (with their domain
//! descriptors), how an outgoing tensor becomes a frame entry (inline bytes, or a
//! channel descriptor plus an export kept until the peer is done), and how a received
//! frame's channel descriptors become tensors again (the pull).
//!
//! The channels themselves are [`crate::channel`]'s `cma` and `xth`; the wire format (a
//! channel descriptor per out-of-band tensor in the frame's data section, and the
//! `Ack` frame) is `rdzv_core::rpc::frame`'s. This module decides, per tensor, between
//! the negotiated channel and `basic`: a tensor below the worker's
//! [`min_channel_bytes`](super::RpcOptions::min_channel_bytes) goes inline, because an
//! out-of-band transfer costs a descriptor, a system call (cma) or a table lookup (xth),
//! and for responses an extra ack frame. Which thread runs a pull is the lanes'
//! business (`lane`): requests are pulled on the handler pool's thread before the
//! handler runs (inline handlers: on the lane's reader), responses on the thread that
//! received them; when exports are released is the core's pipe machine's
//! (`rdzv_core::rpc::pipe`).
//!
//! A `cuda_basic` tensor leaves as the [`HostBytes`] its device runtime staged it into,
//! which the channels lend, stream or write inline where they are. One pulled over
//! `cma` or `xth` for a device is read chunk by chunk into its runtime's staging
//! (`Devices::receive_into`): each chunk goes to the device while the next is read.
//!
//! A receiver checks, before reading anything, that the channel a tensor names is the
//! one negotiated for its device pair on this pipe, that the descriptor decodes and
//! announces the tensor's length, and (cma) that every descriptor of a pipe names the
//! same process: a pipe reads from one peer process only.
//!
//! `mpt` works the other way round: the sender *pushes*. A tensor sent over mpt is
//! taken from the frame's exports (`FrameExports::take_streamed`) by the lane, which
//! writes its stripes on the pipe's
//! mpt lanes right after the frame, under the same send lock; the receiving lane reads
//! them as soon as it has read the frame, under its receive lock, and turns the entry
//! into an inline one. So the stripes on the lanes are always in frame order, no buffer
//! is lent and no ack is needed. Only a pipe served by a lane over tcp has mpt lanes;
//! any other sends its tensors inline instead.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::{ChannelKind, Negotiated, Role};
use rdzv_core::rpc::frame::TensorDescriptor;
pub(crate) use rdzv_core::rpc::lending::lends_device_memory;

use super::device::{DeviceLoan, Devices, HostBytes, PipeId, StagingIn, CUDA_BASIC_DESCRIPTOR};
use super::error::RpcError;
use super::message::Tensor;
use super::recycle;
use super::transport::OwnedFrame;
use crate::channel::buffer::prefer_huge_pages;
use crate::channel::cma::{self, CmaDescriptor, CmaExport, CmaPeer};
use crate::channel::mpt::MptDescriptor;
use crate::channel::next_transfer_id;
use crate::channel::xth::{self, XthDescriptor, XthExport};
use crate::channel::ProcessIdentity;

/// The domain descriptor of the basic channel: it runs over any transport.
pub(crate) const BASIC_DESCRIPTOR: &str = "basic:any";

/// Tensors smaller than this travel inline (`basic`) even where `cma` or `xth` was
/// negotiated.
///
/// Measured with `echo_bandwidth_by_channel` in `uring/tests/rpc_channels.rs` (release
/// build; two pairs of local processes over tcp, one sending everything inline and one
/// everything over cma, their echoes of one tensor interleaved; p50 of 51; three runs on
/// the shared 2-vCPU development VM): inline is faster up to 64 KiB (16 KiB: 225–266 µs
/// against 343–414 µs), 256 KiB is the crossover (506–697 against 504–643 µs), and cma
/// wins from there on (1 MiB: 959–1127 against 927–1027 µs; 4 MiB: 4.2–4.6 ms against
/// 3.2–3.6 ms; 64 MiB: 151–172 ms against 42–51 ms). The descriptor, the system call,
/// the extra thread hand-off and (for responses) the ack frame cost about 100–150 µs.
pub const DEFAULT_MIN_CHANNEL_BYTES: u64 = 256 * 1024;

/// Out-of-band tensors of at least this size are read by several threads at once, each
/// a slice of at least [`PARALLEL_SLICE_MIN`] bytes: a fresh destination buffer is
/// faulted in and filled in parallel (a fresh, huge-page-hinted 64 MiB buffer read over
/// cma on this project's 2-vCPU VM, best of 5: 17.6 ms with one thread, 10.3 ms with
/// two).
const PARALLEL_PULL_MIN: usize = 8 << 20;
/// The smallest slice one pulling thread reads.
const PARALLEL_SLICE_MIN: usize = 4 << 20;
/// The most threads one tensor's pull uses.
const PARALLEL_PULL_THREADS: usize = 4;

/// Fills `dst` with `read(offset, slice)` calls: for large buffers several slices at
/// once, the last on the calling thread and the others on scoped threads. The first
/// error wins.
fn read_in_slices(
    dst: &mut [u8],
    read: impl Fn(u64, &mut [u8]) -> Result<(), String> + Sync,
) -> Result<(), String> {
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
                .map_err(|e| format!("cannot start a thread to read with: {e}"));
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

/// The channels the RPC agent runs, in `ChannelKind::ALL` order (the lending CUDA
/// channels when a device runtime runs them: [`super::device`]).
pub(crate) const RUNNABLE: [ChannelKind; 8] = [
    ChannelKind::Xth,
    ChannelKind::Cma,
    ChannelKind::Mpt,
    ChannelKind::Basic,
    ChannelKind::CudaXth,
    ChannelKind::CudaIpc,
    ChannelKind::CudaGdr,
    ChannelKind::CudaBasic,
];

/// The domain descriptor of `mpt`: any two workers that reach each other over tcp can
/// use it (the connector chooses how many lanes to open).
pub(crate) const MPT_DESCRIPTOR: &str = "mpt:tcp";

/// The domain descriptor of `kind` in this process, or why it cannot run here. For cma
/// this runs TensorPipe's viability checks (and, under Yama `ptrace_scope` 1, lets any
/// process of this user read this one: call it only for a channel that will be
/// offered). The lending CUDA channels' descriptors are their runtime's, in `devices`.
pub(crate) fn domain_descriptor(kind: ChannelKind, devices: &Devices) -> Result<String, String> {
    match kind {
        ChannelKind::CudaXth | ChannelKind::CudaIpc | ChannelKind::CudaGdr => {
            devices.lending_descriptor(kind)
        }
        ChannelKind::Basic => Ok(BASIC_DESCRIPTOR.to_string()),
        ChannelKind::Mpt => Ok(MPT_DESCRIPTOR.to_string()),
        ChannelKind::CudaBasic => Ok(CUDA_BASIC_DESCRIPTOR.to_string()),
        ChannelKind::Cma => cma::viability()
            .map(|domain| domain.as_str().to_string())
            .map_err(|e| e.to_string()),
        ChannelKind::Xth => xth::viability()
            .map(|domain| domain.as_str().to_string())
            .map_err(|e| format!("xth channel not viable: {e}")),
        // Every channel is in `RUNNABLE`; nothing else asks.
        other => Err(format!(
            "channel {other} is not run by the RPC agent of this build"
        )),
    }
}

/// A buffer lent to the peer over a channel.
enum Export {
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
    exports: Vec<Export>,
    /// Tensors to push over mpt after the frame, by transfer id, in frame order.
    streamed: Streamed,
}

impl FrameExports {
    /// Whether the frame lent nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.exports.is_empty()
    }

    /// The tensors the frame sends over mpt, in frame order: the sender writes them on
    /// its mpt lanes right after the frame.
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

/// Bytes moved per channel by one frame's tensors, for the agent's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChannelBytes([u64; ChannelKind::COUNT]);

impl ChannelBytes {
    fn add(&mut self, kind: ChannelKind, bytes: u64) {
        if let Some(slot) = self.0.get_mut(kind.index()) {
            *slot = slot.saturating_add(bytes);
        }
    }

    /// Adds these counts to `totals`.
    pub(crate) fn add_to(&self, totals: &mut ChannelBytes) {
        for kind in ChannelKind::ALL {
            totals.add(kind, self.get(kind));
        }
    }

    /// The bytes counted for `kind`.
    pub(crate) fn get(&self, kind: ChannelKind) -> u64 {
        self.0.get(kind.index()).copied().unwrap_or(0)
    }

    /// Every channel with a non-zero count.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (ChannelKind, u64)> + '_ {
        ChannelKind::ALL
            .into_iter()
            .map(|kind| (kind, self.get(kind)))
            .filter(|&(_, bytes)| bytes > 0)
    }
}

/// Why a tensor could not be put into a frame.
fn export_failed(kind: ChannelKind, peer: &str, reason: impl fmt::Display) -> RpcError {
    RpcError::Channel {
        channel: kind.name(),
        peer: peer.to_string(),
        reason: format!("cannot export the tensor: {reason}"),
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
) -> Result<(), RpcError> {
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
            let export = CmaExport::new(data).map_err(|e| export_failed(channel, peer, e))?;
            let descriptor = export.descriptor().encode().to_vec();
            (Export::Cma(export), descriptor)
        }
        ChannelKind::Xth => {
            let export = XthExport::new(data).map_err(|e| export_failed(channel, peer, e))?;
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
        other => {
            return Err(export_failed(
                other,
                peer,
                "the RPC agent of this build does not run this channel",
            ))
        }
    };
    let descriptor_len = u8::try_from(descriptor.len())
        .map_err(|_| export_failed(channel, peer, "its descriptor is over 255 bytes"))?;
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
    (index, memory): (usize, Option<&super::device::DeviceBuffer>),
    (source, target): (Device, Device),
    channel: ChannelKind,
    peer: &str,
) -> Result<(), RpcError> {
    let failed = |reason: &dyn fmt::Display| RpcError::Channel {
        channel: channel.name(),
        peer: peer.to_string(),
        reason: format!("tensor {index}: cannot lend it: {reason}"),
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
        .map_err(|e| failed(&e))?;
    let len = memory.map_or(0, |m| m.len() as u64);
    let descriptor_len = u8::try_from(loan.descriptor.len())
        .map_err(|_| failed(&"its descriptor is over 255 bytes"))?;
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

/// What a pipe reads from: the peer process behind its cma descriptors, opened on first
/// use and then fixed for the pipe's life; and the device runtimes that borrowed lent
/// memory on it, told when it ends (dropped) so that they release what they kept for it.
#[derive(Debug)]
pub(crate) struct PipeReader {
    cma: Mutex<Option<Arc<CmaPeer>>>,
    id: PipeId,
    borrowed: std::sync::OnceLock<Devices>,
}

impl Default for PipeReader {
    fn default() -> Self {
        PipeReader {
            cma: Mutex::new(None),
            id: PipeId::next(),
            borrowed: std::sync::OnceLock::new(),
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
    /// The pipe's id, for the device runtimes; notes that `devices` borrowed on it.
    fn borrowing_pipe(&self, devices: &Devices) -> PipeId {
        let _ = self.borrowed.get_or_init(|| devices.clone());
        self.id
    }

    /// The cma peer for a descriptor naming `process`: the pipe's, opened now if it is the
    /// first. A descriptor naming another process than the pipe's first is refused.
    fn cma_peer(&self, process: &ProcessIdentity, peer: &str) -> Result<Arc<CmaPeer>, RpcError> {
        let mut slot = self.cma.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(open) = slot.as_ref() {
            if open.process() == process {
                return Ok(Arc::clone(open));
            }
            return Err(RpcError::Channel {
                channel: ChannelKind::Cma.name(),
                peer: peer.to_string(),
                reason: format!(
                    "a descriptor names pid {}, but this pipe reads from pid {}",
                    process.pid,
                    open.process().pid
                ),
            });
        }
        let opened = Arc::new(CmaPeer::open(process).map_err(|e| RpcError::Channel {
            channel: ChannelKind::Cma.name(),
            peer: peer.to_string(),
            reason: e.to_string(),
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
    /// [`RpcError::Channel`] for a channel that was not negotiated for the tensor's
    /// devices, a descriptor that does not decode or announces another length, or a
    /// target device this worker has no runtime for.
    pub(crate) fn sort(
        tensors: Vec<(TensorDescriptor, Vec<u8>)>,
        negotiated: &Negotiated,
        role: Role,
        (reader, devices): (&Arc<PipeReader>, &Devices),
        peer: &str,
    ) -> Result<ReceivedTensors, RpcError> {
        let mut items = Vec::with_capacity(tensors.len());
        for (index, (descriptor, data)) in tensors.into_iter().enumerate() {
            let device = descriptor.target;
            if !device.is_cpu() && devices.runtime(device.kind()).is_none() {
                let channel = if lends_device_memory(descriptor.channel) {
                    descriptor.channel
                } else {
                    ChannelKind::CudaBasic
                };
                return Err(RpcError::Channel {
                    channel: channel.name(),
                    peer: peer.to_string(),
                    reason: format!(
                        "tensor {index}: this worker has no {} runtime to receive on {device}",
                        device.kind()
                    ),
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
            let refuse = |reason: String| RpcError::Channel {
                channel: channel.name(),
                peer: peer.to_string(),
                reason: format!("tensor {index}: {reason}"),
            };
            // cuda_basic's bytes come over the pipe's CPU channel.
            let agreed =
                negotiated.carrier_for(role, descriptor.target.kind(), descriptor.source.kind());
            if agreed != Some(channel) {
                return Err(refuse(format!(
                    "the peer used it, but this pipe negotiated {} for {} to {}",
                    agreed.map_or("no channel", ChannelKind::name),
                    descriptor.source.kind(),
                    descriptor.target.kind()
                )));
            }
            let length_mismatch = |announced: u64| {
                refuse(format!(
                    "its descriptor announces {announced} bytes, the frame {}",
                    descriptor.len
                ))
            };
            match channel {
                ChannelKind::Cma => {
                    let decoded =
                        CmaDescriptor::decode(&data).map_err(|e| refuse(e.to_string()))?;
                    if decoded.length != descriptor.len {
                        return Err(length_mismatch(decoded.length));
                    }
                    items.push(Incoming::Cma {
                        device,
                        descriptor: decoded,
                    });
                }
                ChannelKind::Xth => {
                    let decoded =
                        XthDescriptor::decode(&data).map_err(|e| refuse(e.to_string()))?;
                    if decoded.length != descriptor.len {
                        return Err(length_mismatch(decoded.length));
                    }
                    items.push(Incoming::Xth {
                        device,
                        descriptor: decoded,
                    });
                }
                // Its stripes are read off the lanes as the frame arrives, which turns
                // the entry into an inline one; one still here came on a pipe that has
                // no lanes.
                ChannelKind::Mpt => {
                    return Err(refuse(
                        "the peer streamed it, but this pipe has no mpt lanes".into(),
                    ))
                }
                // The runtime decodes and checks its own descriptors when it copies.
                kind if lends_device_memory(kind) => items.push(Incoming::Lent {
                    device,
                    channel: kind,
                    len: descriptor.len,
                    descriptor: data,
                }),
                _ => return Err(refuse("this worker does not run this channel".into())),
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
    /// [`RpcError::Channel`] naming the channel, the peer and why (the peer process is
    /// gone, ptrace access was refused, the export no longer exists, ...).
    pub(crate) fn pull(self) -> Result<Vec<Tensor>, RpcError> {
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
                    let failed = |reason: String| RpcError::Channel {
                        channel: ChannelKind::Cma.name(),
                        peer: peer.clone(),
                        reason,
                    };
                    let len = usize::try_from(descriptor.length)
                        .map_err(|_| failed("the tensor does not fit in memory".into()))?;
                    let source = reader.cma_peer(&descriptor.process, &peer)?;
                    if !device.is_cpu() {
                        let memory = pull_staged(&devices, device, len, |offset, part| {
                            source
                                .read_at(&descriptor, offset, part)
                                .map_err(|e| e.to_string())
                        })
                        .map_err(|e| e.into_error(ChannelKind::Cma, tensors.len(), &peer))?;
                        tensors.push(Tensor::on_device(memory));
                        continue;
                    }
                    let mut data = recycle::try_take(len).map_err(|e| failed(e.to_string()))?;
                    prefer_huge_pages(&mut data);
                    read_in_slices(&mut data, |offset, part| {
                        source
                            .read_at(&descriptor, offset, part)
                            .map_err(|e| e.to_string())
                    })
                    .map_err(failed)?;
                    Tensor {
                        device,
                        data,
                        memory: None,
                    }
                }
                Incoming::Xth { device, descriptor } => {
                    let failed = |reason: String| RpcError::Channel {
                        channel: ChannelKind::Xth.name(),
                        peer: peer.clone(),
                        reason,
                    };
                    let len = usize::try_from(descriptor.length)
                        .map_err(|_| failed("the tensor does not fit in memory".into()))?;
                    let read = |offset, part: &mut [u8]| {
                        xth::read_at(&descriptor, offset, part).map_err(|e| e.to_string())
                    };
                    if !device.is_cpu() {
                        let memory = pull_staged(&devices, device, len, read)
                            .map_err(|e| e.into_error(ChannelKind::Xth, tensors.len(), &peer))?;
                        tensors.push(Tensor::on_device(memory));
                        continue;
                    }
                    let mut data = recycle::try_take(len).map_err(|e| failed(e.to_string()))?;
                    prefer_huge_pages(&mut data);
                    read_in_slices(&mut data, read).map_err(failed)?;
                    Tensor {
                        device,
                        data,
                        memory: None,
                    }
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
                        .map_err(|reason| RpcError::Channel {
                            channel: channel.name(),
                            peer: peer.clone(),
                            reason: format!("tensor {index}: {reason}"),
                        })?;
                    tensors.push(Tensor {
                        device,
                        data: Vec::new(),
                        memory: Some(memory),
                    });
                    continue;
                }
            };
            tensors.push(if tensor.device.is_cpu() {
                tensor
            } else {
                let index = tensors.len();
                let (data, memory) =
                    devices
                        .stage_in(tensor.device, tensor.data)
                        .map_err(|reason| RpcError::Channel {
                            channel: ChannelKind::CudaBasic.name(),
                            peer: peer.clone(),
                            reason: format!("tensor {index}: {reason}"),
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

/// Why a staged pull failed: reading from the peer, or the device runtime.
#[derive(Debug)]
enum PullFailed {
    Read(String),
    Staging(String),
}

impl PullFailed {
    /// The error of tensor `index`, read over `channel` from `peer`.
    fn into_error(self, channel: ChannelKind, index: usize, peer: &str) -> RpcError {
        let (channel, reason) = match self {
            PullFailed::Read(reason) => (channel, reason),
            PullFailed::Staging(reason) => (ChannelKind::CudaBasic, reason),
        };
        RpcError::Channel {
            channel: channel.name(),
            peer: peer.to_string(),
            reason: format!("tensor {index}: {reason}"),
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
    read: impl Fn(u64, &mut [u8]) -> Result<(), String> + Sync,
) -> Result<super::device::DeviceBuffer, PullFailed> {
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

/// The channel the pipe uses between two CPUs, for the agent's per-peer accessor.
pub(crate) fn cpu_channel(negotiated: &Negotiated, role: Role) -> Option<ChannelKind> {
    negotiated.channel_for(role, DeviceType::Cpu, DeviceType::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::device::{
        DeviceBuffer, DevicePlugin, DeviceRuntime, HostMemory, StagedBytes, StagedReceive,
    };
    use rdzv_core::negotiate::{
        accept_answer, answer_brochure, DeviceDescriptors, Offer, TransportKind,
    };
    use rdzv_core::rpc::frame::FrameKind;

    /// Both ends of a pipe offering `channels` (kind, descriptor) and tcp.
    fn negotiate(channels: &[(ChannelKind, &str)]) -> Negotiated {
        let build = || {
            let mut offer = Offer::new();
            offer
                .add_transport(TransportKind::Tcp, 0, "tcp:*")
                .map_err(|e| e.to_string())?;
            for &(kind, descriptor) in channels {
                offer
                    .add_channel(
                        kind,
                        kind.default_priority(),
                        DeviceDescriptors::cpu(descriptor),
                    )
                    .map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(offer)
        };
        let (listener, connector) = match (build(), build()) {
            (Ok(l), Ok(c)) => (l, c),
            (Err(e), _) | (_, Err(e)) => panic!("offer: {e}"),
        };
        let answer =
            answer_brochure(&listener, &connector.brochure()).unwrap_or_else(|e| panic!("{e}"));
        accept_answer(&connector, &answer).unwrap_or_else(|e| panic!("{e}"))
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    /// A sent frame's tensor entries, as the receiving side gets them.
    fn entries(frame: &OwnedFrame) -> Vec<(TensorDescriptor, Vec<u8>)> {
        frame
            .tensors
            .iter()
            .copied()
            .zip(frame.tensor_data.iter().map(|d| d.to_vec()))
            .collect()
    }

    #[test]
    fn small_tensors_stay_inline_and_large_ones_are_exported() {
        let xth = domain_descriptor(ChannelKind::Xth, &Devices::default())
            .unwrap_or_else(|e| panic!("{e}"));
        let negotiated = negotiate(&[(ChannelKind::Xth, &xth), (ChannelKind::Basic, "basic:any")]);
        assert_eq!(
            cpu_channel(&negotiated, Role::Connector),
            Some(ChannelKind::Xth)
        );
        let mut frame = OwnedFrame::empty(FrameKind::Request, 1);
        let mut exports = FrameExports::default();
        let mut moved = ChannelBytes::default();
        for data in [Vec::new(), pattern(10), pattern(5000)] {
            add_tensor(
                &mut frame,
                &mut exports,
                &mut moved,
                data.into(),
                Device::cpu(),
                Device::cpu(),
                ChannelKind::Xth,
                100,
                "peer",
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
        assert_eq!(frame.tensors.len(), 3);
        assert!(frame.tensors[0].is_inline() && frame.tensors[1].is_inline());
        assert_eq!(frame.tensors[2].channel, ChannelKind::Xth);
        assert_eq!(
            usize::from(frame.tensors[2].channel_descriptor_len),
            XthDescriptor::ENCODED_LEN
        );
        assert_eq!(moved.get(ChannelKind::Basic), 10);
        assert_eq!(moved.get(ChannelKind::Xth), 5000);
        assert!(!exports.is_empty());
        assert!(frame.encode_head().is_ok());

        // The receiving side pulls the exported one and gets every tensor back in order.
        let reader = Arc::new(PipeReader::default());
        let received = ReceivedTensors::sort(
            entries(&frame),
            &negotiated,
            Role::Listener,
            (&reader, &Devices::default()),
            "peer",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(received.has_out_of_band());
        assert_eq!(received.pull_bytes(), 5000);
        let tensors = received.pull().unwrap_or_else(|e| panic!("{e}"));
        let datas: Vec<Vec<u8>> = tensors.into_iter().map(|t| t.data).collect();
        assert_eq!(datas, vec![Vec::new(), pattern(10), pattern(5000)]);

        // Once the exports are released, the descriptor no longer reads.
        drop(exports);
        let again = ReceivedTensors::sort(
            entries(&frame),
            &negotiated,
            Role::Listener,
            (&reader, &Devices::default()),
            "peer",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let err = again.pull().map(|_| ()).expect_err("released export");
        let text = err.to_string();
        assert!(text.contains("xth") && text.contains("peer"), "{text}");
    }

    #[test]
    fn cma_round_trip_and_refusals() {
        let cma = match domain_descriptor(ChannelKind::Cma, &Devices::default()) {
            Ok(cma) => cma,
            Err(reason) => {
                eprintln!("skipped: cma is not viable here: {reason}");
                return;
            }
        };
        let negotiated = negotiate(&[(ChannelKind::Cma, &cma), (ChannelKind::Basic, "basic:any")]);
        let mut frame = OwnedFrame::empty(FrameKind::Response, 3);
        let mut exports = FrameExports::default();
        let mut moved = ChannelBytes::default();
        add_tensor(
            &mut frame,
            &mut exports,
            &mut moved,
            pattern(1 << 20).into(),
            Device::cpu(),
            Device::cpu(),
            ChannelKind::Cma,
            DEFAULT_MIN_CHANNEL_BYTES,
            "peer",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(frame.tensors[0].channel, ChannelKind::Cma);
        let entries = entries(&frame);
        let reader = Arc::new(PipeReader::default());
        let received = ReceivedTensors::sort(
            entries.clone(),
            &negotiated,
            Role::Connector,
            (&reader, &Devices::default()),
            "w1",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let tensors = received.pull().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            tensors.first().map(|t| t.data.clone()),
            Some(pattern(1 << 20))
        );

        // A channel this pipe did not negotiate is refused before anything is read.
        let basic_only = negotiate(&[(ChannelKind::Basic, "basic:any")]);
        let err = ReceivedTensors::sort(
            entries.clone(),
            &basic_only,
            Role::Connector,
            (&reader, &Devices::default()),
            "w1",
        )
        .expect_err("not negotiated");
        assert!(err.to_string().contains("negotiated basic"), "{err}");

        // A descriptor announcing another length is refused.
        let mut lying = entries.clone();
        lying[0].0.len += 1;
        assert!(ReceivedTensors::sort(
            lying,
            &negotiated,
            Role::Connector,
            (&reader, &Devices::default()),
            "w1"
        )
        .is_err());

        // A descriptor naming another process than the pipe's is refused by name.
        let mut other = CmaDescriptor::decode(&entries[0].1).unwrap_or_else(|e| panic!("{e}"));
        other.process.pid = other.process.pid.wrapping_add(1);
        let mut forged = entries.clone();
        forged[0].1 = other.encode().to_vec();
        let err = ReceivedTensors::sort(
            forged,
            &negotiated,
            Role::Connector,
            (&reader, &Devices::default()),
            "w1",
        )
        .and_then(ReceivedTensors::pull)
        .map(|_| ())
        .expect_err("other process");
        let text = err.to_string();
        assert!(
            text.contains("cma") && text.contains("w1") && text.contains("pid"),
            "{text}"
        );

        // A gone peer fails with the channel, the peer and the reason.
        let fresh = Arc::new(PipeReader::default());
        let mut gone = CmaDescriptor::decode(&entries[0].1).unwrap_or_else(|e| panic!("{e}"));
        gone.process.start_time = gone.process.start_time.wrapping_add(1);
        let mut dead = entries;
        dead[0].1 = gone.encode().to_vec();
        let err = ReceivedTensors::sort(
            dead,
            &negotiated,
            Role::Connector,
            (&fresh, &Devices::default()),
            "w1",
        )
        .and_then(ReceivedTensors::pull)
        .map(|_| ())
        .expect_err("gone");
        let text = err.to_string();
        assert!(
            text.contains("cma") && text.contains("w1") && text.contains("gone"),
            "{text}"
        );
        drop(exports);
    }

    #[test]
    fn slices_cover_the_buffer_once() {
        for len in [
            0,
            10,
            PARALLEL_PULL_MIN - 1,
            PARALLEL_PULL_MIN,
            3 * PARALLEL_PULL_MIN + 7,
        ] {
            let mut dst = vec![0u8; len];
            let calls = std::sync::atomic::AtomicUsize::new(0);
            read_in_slices(&mut dst, |offset, part| {
                calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                for (i, byte) in part.iter_mut().enumerate() {
                    *byte = byte.wrapping_add(((offset as usize + i) % 251) as u8 + 1);
                }
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{e}"));
            let expected: Vec<u8> = (0..len).map(|i| (i % 251) as u8 + 1).collect();
            assert!(dst == expected, "{len} bytes");
            assert!(calls.into_inner() >= usize::from(len > 0).max(1));
        }
        let mut dst = vec![0u8; 2 * PARALLEL_PULL_MIN];
        let failed = read_in_slices(&mut dst, |offset, _| {
            if offset > 0 {
                Err(format!("slice at {offset} failed"))
            } else {
                Ok(())
            }
        });
        let parallel = std::thread::available_parallelism().map_or(1, usize::from) > 1;
        assert_eq!(failed.is_err(), parallel);
    }

    #[test]
    fn unknown_channels_are_not_viable() {
        let none = Devices::default();
        assert_eq!(
            domain_descriptor(ChannelKind::Basic, &none).as_deref(),
            Ok(BASIC_DESCRIPTOR)
        );
        assert_eq!(
            domain_descriptor(ChannelKind::Mpt, &none).as_deref(),
            Ok(MPT_DESCRIPTOR)
        );
        let err = domain_descriptor(ChannelKind::CudaGdr, &none).expect_err("no runtime");
        assert!(err.contains("device_plugins"), "{err}");
        let err = domain_descriptor(ChannelKind::CudaIpc, &none).expect_err("no runtime");
        assert!(err.contains("device_plugins"), "{err}");
    }

    /// Counts the pipes the runtime was told ended.
    #[derive(Default)]
    struct EndCounting(Mutex<Vec<PipeId>>);

    impl DeviceRuntime for EndCounting {
        fn device_count(&self) -> usize {
            1
        }
        fn copy_to_host(&self, _: &crate::rpc::DeviceBuffer) -> Result<HostBytes, String> {
            Err("unused".into())
        }
        fn copy_from_host(
            &self,
            _: Device,
            _: Vec<u8>,
        ) -> Result<crate::rpc::DeviceBuffer, String> {
            Err("unused".into())
        }
        fn pipe_ended(&self, pipe: PipeId) {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(pipe);
        }
    }

    struct Plugin(Arc<EndCounting>);

    impl DevicePlugin for Plugin {
        fn device_type(&self) -> DeviceType {
            DeviceType::Cuda
        }
        fn open(&self) -> Result<Arc<dyn DeviceRuntime>, String> {
            Ok(Arc::clone(&self.0) as Arc<dyn DeviceRuntime>)
        }
    }

    #[test]
    fn a_pipe_that_borrowed_tells_the_runtime_when_it_ends() {
        let runtime = Arc::new(EndCounting::default());
        let plugin: Arc<dyn DevicePlugin> = Arc::new(Plugin(Arc::clone(&runtime)));
        let devices = Devices::open(&[plugin]).unwrap_or_else(|e| panic!("{e}"));
        let ended = |r: &EndCounting| r.0.lock().unwrap_or_else(PoisonError::into_inner).clone();

        let idle = PipeReader::default();
        drop(idle);
        assert!(
            ended(&runtime).is_empty(),
            "a pipe that borrowed nothing is not reported"
        );

        let reader = PipeReader::default();
        let pipe = reader.borrowing_pipe(&devices);
        assert_eq!(reader.borrowing_pipe(&devices), pipe, "one id per pipe");
        let other = PipeReader::default();
        assert_ne!(other.borrowing_pipe(&devices), pipe);
        drop(reader);
        assert_eq!(ended(&runtime), [pipe], "reported once, when it ends");
    }

    /// What the fake staging runtime did, in order.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Step {
        /// Chunk `chunk`'s buffer `buffer` was handed to the pull.
        Handed { chunk: usize, buffer: usize },
        /// Its copy to the device started.
        Started { chunk: usize, buffer: usize },
        /// Its copy to the device completed.
        Done { chunk: usize, buffer: usize },
    }

    /// The fake runtime's books, shared with the test.
    #[derive(Debug, Default)]
    struct Books {
        log: Vec<Step>,
        /// Pinned receive buffers handed to receives and not yet given back.
        buffers_out: usize,
        /// Staged-out tensors alive.
        staged_out: usize,
        /// The chunk whose copy fails to start.
        fail_chunk: Option<usize>,
    }

    /// A runtime whose "device" memory is on the host, that stages out into "pinned"
    /// buffers of its own and receives in chunks (when `chunked`) through `buffers`
    /// buffers of `chunk` bytes whose copies land only when waited for: a buffer handed
    /// out again before its copy completed would put the wrong bytes on the device.
    struct ChunkRuntime {
        books: Arc<Mutex<Books>>,
        chunk: usize,
        buffers: usize,
        chunked: bool,
    }

    fn lock_books(books: &Mutex<Books>) -> std::sync::MutexGuard<'_, Books> {
        books.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Staged-out bytes of the fake runtime.
    struct FakePinned {
        bytes: Vec<u8>,
        books: Arc<Mutex<Books>>,
    }

    impl StagedBytes for FakePinned {
        fn bytes(&self) -> &[u8] {
            &self.bytes
        }
    }

    impl Drop for FakePinned {
        fn drop(&mut self) {
            lock_books(&self.books).staged_out -= 1;
        }
    }

    /// A chunked receive of the fake runtime.
    struct FakeReceive {
        books: Arc<Mutex<Books>>,
        device: Device,
        chunk: usize,
        memory: Vec<u8>,
        buffers: Vec<Vec<u8>>,
        /// Per buffer: the copy started and not completed (chunk, offset, len).
        pending: Vec<Option<(usize, usize, usize)>>,
        next: usize,
    }

    impl FakeReceive {
        fn complete(&mut self, buffer: usize) {
            if let Some((chunk, offset, len)) = self.pending[buffer].take() {
                self.memory[offset..offset + len].copy_from_slice(&self.buffers[buffer][..len]);
                lock_books(&self.books)
                    .log
                    .push(Step::Done { chunk, buffer });
            }
        }
    }

    impl StagedReceive for FakeReceive {
        fn chunk_len(&self) -> usize {
            self.chunk
        }
        fn chunk_buffer(&mut self, k: usize) -> Result<&mut [u8], String> {
            if k != self.next {
                return Err(format!("chunk {k} out of order"));
            }
            let buffer = k % self.buffers.len();
            self.complete(buffer);
            lock_books(&self.books)
                .log
                .push(Step::Handed { chunk: k, buffer });
            let len = self.chunk.min(self.memory.len() - k * self.chunk);
            // Stale bytes, so that a chunk not filled shows.
            self.buffers[buffer].fill(0xee);
            Ok(&mut self.buffers[buffer][..len])
        }
        fn chunk_filled(&mut self, k: usize) -> Result<(), String> {
            if lock_books(&self.books).fail_chunk == Some(k) {
                return Err(format!("fake cuMemcpyHtoDAsync failed for chunk {k}"));
            }
            let buffer = k % self.buffers.len();
            let offset = k * self.chunk;
            let len = self.chunk.min(self.memory.len() - offset);
            assert!(self.pending[buffer].is_none(), "buffer {buffer} busy");
            self.pending[buffer] = Some((k, offset, len));
            lock_books(&self.books)
                .log
                .push(Step::Started { chunk: k, buffer });
            self.next += 1;
            Ok(())
        }
        fn finish(mut self: Box<Self>) -> Result<DeviceBuffer, String> {
            for buffer in 0..self.buffers.len() {
                self.complete(buffer);
            }
            if self.next != self.memory.len().div_ceil(self.chunk) {
                return Err("not every chunk was filled".into());
            }
            let memory = std::mem::take(&mut self.memory);
            Ok(DeviceBuffer::new(HostMemory::new(self.device, memory)))
        }
    }

    impl Drop for FakeReceive {
        fn drop(&mut self) {
            for buffer in 0..self.buffers.len() {
                self.complete(buffer);
            }
            lock_books(&self.books).buffers_out -= self.buffers.len();
        }
    }

    impl DeviceRuntime for ChunkRuntime {
        fn device_count(&self) -> usize {
            1
        }
        fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<HostBytes, String> {
            let memory = memory
                .downcast_ref::<HostMemory>()
                .ok_or("foreign memory")?;
            lock_books(&self.books).staged_out += 1;
            Ok(HostBytes::staged(FakePinned {
                bytes: memory.bytes().to_vec(),
                books: Arc::clone(&self.books),
            }))
        }
        fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, String> {
            Ok(DeviceBuffer::new(HostMemory::new(device, bytes)))
        }
        fn receive_staged(
            &self,
            device: Device,
            len: usize,
        ) -> Result<Option<Box<dyn StagedReceive>>, String> {
            if !self.chunked {
                return Ok(None);
            }
            lock_books(&self.books).buffers_out += self.buffers;
            Ok(Some(Box::new(FakeReceive {
                books: Arc::clone(&self.books),
                device,
                chunk: self.chunk,
                memory: vec![0; len],
                buffers: vec![vec![0; self.chunk]; self.buffers],
                pending: vec![None; self.buffers],
                next: 0,
            })))
        }
    }

    struct ChunkPlugin(Arc<ChunkRuntime>);

    impl DevicePlugin for ChunkPlugin {
        fn device_type(&self) -> DeviceType {
            DeviceType::Cuda
        }
        fn open(&self) -> Result<Arc<dyn DeviceRuntime>, String> {
            Ok(Arc::clone(&self.0) as Arc<dyn DeviceRuntime>)
        }
    }

    /// The fake runtime, opened as a worker's devices.
    fn chunk_devices(chunk: usize, buffers: usize, chunked: bool) -> (Devices, Arc<Mutex<Books>>) {
        let books = Arc::new(Mutex::new(Books::default()));
        let runtime = Arc::new(ChunkRuntime {
            books: Arc::clone(&books),
            chunk,
            buffers,
            chunked,
        });
        let plugin: Arc<dyn DevicePlugin> = Arc::new(ChunkPlugin(runtime));
        let devices = Devices::open(&[plugin]).unwrap_or_else(|e| panic!("{e}"));
        (devices, books)
    }

    /// Both ends offering `kind` (CPU memory) and `cuda_basic` for CPU and CUDA memory.
    fn negotiate_cuda_basic(kind: ChannelKind, descriptor: &str) -> Negotiated {
        let build = || {
            let mut offer = Offer::new();
            offer
                .add_transport(TransportKind::Tcp, 0, "tcp:*")
                .map_err(|e| e.to_string())?;
            offer
                .add_channel(
                    kind,
                    kind.default_priority(),
                    DeviceDescriptors::cpu(descriptor),
                )
                .map_err(|e| e.to_string())?;
            offer
                .add_channel(
                    ChannelKind::CudaBasic,
                    ChannelKind::CudaBasic.default_priority(),
                    DeviceDescriptors::cpu(CUDA_BASIC_DESCRIPTOR)
                        .with(DeviceType::Cuda, CUDA_BASIC_DESCRIPTOR),
                )
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(offer)
        };
        let (listener, connector) = match (build(), build()) {
            (Ok(l), Ok(c)) => (l, c),
            (Err(e), _) | (_, Err(e)) => panic!("offer: {e}"),
        };
        let answer =
            answer_brochure(&listener, &connector.brochure()).unwrap_or_else(|e| panic!("{e}"));
        accept_answer(&connector, &answer).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A `cuda:0` tensor of `bytes` staged out by `devices` and put in a frame over
    /// `kind` (always out of band).
    fn staged_frame(
        devices: &Devices,
        bytes: &[u8],
        kind: ChannelKind,
    ) -> (OwnedFrame, FrameExports) {
        let memory = DeviceBuffer::new(HostMemory::new(Device::cuda(0), bytes.to_vec()));
        let staged = devices
            .stage_out(Device::cuda(0), Vec::new(), Some(&memory))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(staged.is_staged());
        let mut frame = OwnedFrame::empty(FrameKind::Request, 1);
        let mut exports = FrameExports::default();
        add_tensor(
            &mut frame,
            &mut exports,
            &mut ChannelBytes::default(),
            staged,
            Device::cuda(0),
            Device::cuda(0),
            kind,
            1,
            "peer",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        (frame, exports)
    }

    /// The address of the bytes the frame's first export lends.
    fn lent_address(exports: &FrameExports) -> usize {
        match exports.exports.first() {
            Some(Export::Cma(export)) => export.descriptor().address as usize,
            Some(Export::Xth(export)) => export.bytes().as_ptr() as usize,
            _ => panic!("no cma or xth export"),
        }
    }

    /// Receives `frame` on a pipe that `negotiated`, with `devices`.
    fn pull_with(
        frame: &OwnedFrame,
        negotiated: &Negotiated,
        devices: &Devices,
    ) -> Result<Vec<Tensor>, RpcError> {
        let reader = Arc::new(PipeReader::default());
        ReceivedTensors::sort(
            entries(frame),
            negotiated,
            Role::Listener,
            (&reader, devices),
            "peer",
        )?
        .pull()
    }

    fn device_bytes(tensor: &Tensor) -> Vec<u8> {
        tensor
            .memory
            .as_ref()
            .and_then(|m| m.downcast_ref::<HostMemory>())
            .map(|m| m.bytes().to_vec())
            .unwrap_or_else(|| panic!("no host-memory tensor: {tensor:?}"))
    }

    /// Staged out, the CPU channel lends the runtime's own bytes (no copy), and they go
    /// back to the runtime when the exports are released; staged in, the pull fills
    /// the runtime's chunks in order, each chunk's copy starts as soon as it is filled
    /// and runs while the next chunk is read, and no buffer is handed out again before
    /// its copy completed. Every byte arrives.
    #[test]
    fn staged_tensors_are_lent_in_place_and_pulled_chunk_by_chunk() {
        let xth = domain_descriptor(ChannelKind::Xth, &Devices::default())
            .unwrap_or_else(|e| panic!("{e}"));
        let negotiated = negotiate_cuda_basic(ChannelKind::Xth, &xth);
        assert_eq!(
            negotiated.carrier_for(Role::Listener, DeviceType::Cuda, DeviceType::Cuda),
            Some(ChannelKind::Xth)
        );
        let mut kinds = vec![(ChannelKind::Xth, negotiated)];
        if let Ok(cma) = domain_descriptor(ChannelKind::Cma, &Devices::default()) {
            kinds.push((
                ChannelKind::Cma,
                negotiate_cuda_basic(ChannelKind::Cma, &cma),
            ));
        } else {
            eprintln!("cma is not viable here: only xth carries the staged tensors");
        }
        for (kind, negotiated) in &kinds {
            for (len, chunk, buffers) in [(1000, 64, 3), (1000, 100, 2), (64, 64, 2), (7, 64, 1)] {
                let (devices, books) = chunk_devices(chunk, buffers, true);
                let source = pattern(len);
                let (frame, exports) = staged_frame(&devices, &source, *kind);
                // The export lends the staged bytes themselves.
                let staged = match exports.exports.first() {
                    Some(Export::Cma(export)) => export.bytes().as_ptr() as usize,
                    Some(Export::Xth(export)) => export.bytes().as_ptr() as usize,
                    _ => panic!("{kind}: not exported"),
                };
                assert_eq!(lent_address(&exports), staged);
                assert_eq!(lock_books(&books).staged_out, 1);

                let tensors = pull_with(&frame, negotiated, &devices)
                    .unwrap_or_else(|e| panic!("{kind} {len}/{chunk}/{buffers}: {e}"));
                assert_eq!(tensors.len(), 1);
                assert_eq!(tensors[0].device, Device::cuda(0));
                assert!(tensors[0].data.is_empty());
                assert!(
                    device_bytes(&tensors[0]) == source,
                    "{kind} {len}: bytes differ"
                );
                exports.recycle();
                let books = lock_books(&books);
                assert_eq!(books.staged_out, 0, "the staged bytes went back");
                assert_eq!(books.buffers_out, 0, "the receive buffers went back");

                // The order: every chunk handed, started and done once, in order; a
                // buffer handed again only after its previous chunk's copy was done;
                // and (with two buffers or more) chunk k's copy still running while
                // chunk k + 1 is read.
                let at = |step: Step| {
                    books
                        .log
                        .iter()
                        .position(|s| *s == step)
                        .unwrap_or_else(|| panic!("{step:?} missing: {:?}", books.log))
                };
                let chunks = len.div_ceil(chunk);
                assert_eq!(books.log.len(), 3 * chunks, "{:?}", books.log);
                for k in 0..chunks {
                    let buffer = k % buffers;
                    let handed = at(Step::Handed { chunk: k, buffer });
                    let started = at(Step::Started { chunk: k, buffer });
                    let done = at(Step::Done { chunk: k, buffer });
                    assert!(handed < started && started < done, "{:?}", books.log);
                    if k >= buffers {
                        let before = at(Step::Done {
                            chunk: k - buffers,
                            buffer,
                        });
                        assert!(before < handed, "buffer {buffer} reused early");
                    }
                    if buffers >= 2 && k + 1 < chunks {
                        let next = at(Step::Handed {
                            chunk: k + 1,
                            buffer: (k + 1) % buffers,
                        });
                        assert!(started < next && next < done, "no overlap: {:?}", books.log);
                    }
                }
            }
        }
    }

    /// A runtime without chunked receives gets the pulled bytes whole, as before; an
    /// empty staged tensor needs no chunk.
    #[test]
    fn a_runtime_without_chunks_gets_the_bytes_whole() {
        let xth = domain_descriptor(ChannelKind::Xth, &Devices::default())
            .unwrap_or_else(|e| panic!("{e}"));
        let negotiated = negotiate_cuda_basic(ChannelKind::Xth, &xth);
        let (devices, books) = chunk_devices(64, 2, false);
        let source = pattern(1000);
        let (frame, exports) = staged_frame(&devices, &source, ChannelKind::Xth);
        let tensors = pull_with(&frame, &negotiated, &devices).unwrap_or_else(|e| panic!("{e}"));
        assert!(device_bytes(&tensors[0]) == source);
        assert!(lock_books(&books).log.is_empty());
        drop(exports);
        assert_eq!(lock_books(&books).staged_out, 0);

        let (devices, books) = chunk_devices(64, 2, true);
        let mut staging = devices
            .receive_into(Device::cuda(0), 0)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(staging.chunks().is_empty());
        assert!(staging.chunk_buffer(0).is_err());
        let memory = staging.finish().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((memory.device(), memory.len()), (Device::cuda(0), 0));
        assert_eq!(lock_books(&books).buffers_out, 0);
    }

    /// A copy failing in the middle, or a read failing, fails that pull alone, naming
    /// the channel and the tensor, and gives every buffer back; the next pull works.
    #[test]
    fn a_failure_in_the_middle_fails_only_that_pull_and_returns_every_buffer() {
        let xth = domain_descriptor(ChannelKind::Xth, &Devices::default())
            .unwrap_or_else(|e| panic!("{e}"));
        let negotiated = negotiate_cuda_basic(ChannelKind::Xth, &xth);
        let (devices, books) = chunk_devices(100, 3, true);
        let source = pattern(1000);

        lock_books(&books).fail_chunk = Some(4);
        let (frame, exports) = staged_frame(&devices, &source, ChannelKind::Xth);
        let err = pull_with(&frame, &negotiated, &devices).expect_err("chunk 4 fails");
        let text = err.to_string();
        assert!(
            text.contains("cuda_basic")
                && text.contains("tensor 0")
                && text.contains("failed for chunk 4"),
            "{text}"
        );
        assert_eq!(lock_books(&books).buffers_out, 0, "every buffer went back");
        assert!(lock_books(&books)
            .log
            .iter()
            .all(|s| !matches!(s, Step::Started { chunk, .. } if *chunk >= 4)));

        // A read failing after some chunks: the export is gone.
        lock_books(&books).fail_chunk = None;
        drop(exports);
        let err = pull_with(&frame, &negotiated, &devices).expect_err("export released");
        assert!(err.to_string().contains("xth"), "{err}");
        assert_eq!(lock_books(&books).buffers_out, 0, "every buffer went back");
        assert_eq!(lock_books(&books).staged_out, 0);

        // The next tensor goes through.
        let (frame, exports) = staged_frame(&devices, &source, ChannelKind::Xth);
        let tensors = pull_with(&frame, &negotiated, &devices).unwrap_or_else(|e| panic!("{e}"));
        assert!(device_bytes(&tensors[0]) == source);
        drop(exports);
        assert_eq!(lock_books(&books).buffers_out, 0);
        assert_eq!(lock_books(&books).staged_out, 0);
    }

    /// Over mpt the staged bytes are streamed, and inline they are written with the
    /// frame, from where the runtime staged them; they go back to it once sent.
    #[test]
    fn staged_bytes_stream_over_mpt_and_go_inline_in_place() {
        let (devices, books) = chunk_devices(64, 2, true);
        let source = pattern(500);
        let (frame, mut exports) = staged_frame(&devices, &source, ChannelKind::Mpt);
        assert_eq!(frame.tensors[0].channel, ChannelKind::Mpt);
        let streamed = exports.take_streamed();
        assert_eq!(streamed.len(), 1);
        assert!(streamed[0].1.is_staged() && streamed[0].1 == source);
        assert_eq!(lock_books(&books).staged_out, 1);
        recycle::give_all(streamed.into_iter().map(|(_, data)| data).collect());
        assert_eq!(lock_books(&books).staged_out, 0);

        let (frame, exports) = staged_frame(&devices, &source, ChannelKind::Basic);
        assert!(frame.tensors[0].is_inline() && exports.is_empty());
        assert!(frame.tensor_data[0].is_staged() && frame.tensor_data[0] == source);
        let body: Vec<&[u8]> = frame.body().collect();
        assert_eq!(
            body.last().map(|part| part.as_ptr()),
            Some(frame.tensor_data[0].as_ptr()),
            "the frame writes the staged bytes themselves"
        );
        assert_eq!(lock_books(&books).staged_out, 1);
        recycle::give_all(frame.tensor_data);
        assert_eq!(lock_books(&books).staged_out, 0);
    }
}
