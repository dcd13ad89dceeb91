//! Tensors in device memory (CUDA), and the seam through which a device runtime built
//! outside this crate plugs into the agent: [`DevicePlugin`].
//!
//! This crate knows no GPU. A tensor on a device other than the CPU holds a
//! [`DeviceBuffer`], a shared handle to memory the runtime owns ([`DeviceMemory`]). The
//! agent moves it over one of two kinds of channel, whichever the pipe negotiated for the
//! pair of device types (highest priority first: `cuda_xth` 400, `cuda_ipc` 300,
//! `cuda_gdr` 200, `cuda_basic` 0):
//!
//! - **lending** (`cuda_xth` within one process, `cuda_ipc` between processes of one
//!   host, `cuda_gdr` between hosts by GPUDirect RDMA): the sender's runtime lends the
//!   memory ([`DeviceRuntime::lend`]) and the frame
//!   carries the [`DeviceLoan`]'s descriptor; the receiver's runtime copies the lent
//!   range into fresh memory on the target device ([`DeviceRuntime::borrow`]), device to
//!   device, without the host. The loan is held like a `cma` buffer, by the rule of
//!   `rdzv_core::rpc::lending`: a request's until its reply, a response's until the
//!   caller's ack, and dropped unused when the pipe ends. A runtime offers these channels
//!   through [`DeviceRuntime::lending_channels`].
//! - **staging** (`cuda_basic`): the sender's runtime copies the tensor to host memory
//!   ([`DeviceRuntime::copy_to_host`]) that it owns ([`HostBytes`]: pinned buffers, say,
//!   given back to the runtime when the channel is done with them), the bytes travel
//!   like a CPU tensor's over the CPU channel the pipe negotiated (inline, `cma`, `xth`
//!   or `mpt`), which reads them where they are, and the receiver's runtime copies them
//!   into fresh memory on the target device. A runtime that can stage in chunks
//!   ([`DeviceRuntime::receive_staged`], a [`StagedReceive`]) is handed each chunk as
//!   soon as the `cma` or `xth` pull has read it, so the pull of chunk k+1 overlaps the
//!   host-to-device copy of chunk k; otherwise (and for bytes that arrived inline or over
//!   `mpt`) it gets all the bytes at once ([`DeviceRuntime::copy_from_host`]). So
//!   `cuda_basic` runs over every transport and gains from every CPU channel. Every
//!   worker offers it for CPU memory (the CPU side of a CPU ↔ CUDA pair needs no GPU),
//!   and a worker with a CUDA runtime also for CUDA memory.
//!
//! `rdzv_rdma::cuda::agent::CudaPlugin` is the CUDA runtime (cudarc, loaded at run time).
//! A test can plug in a runtime that keeps "device" memory on the host: the agent cannot
//! tell, which is how its part is tested on machines without a GPU.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::ChannelKind;

use crate::channel::StableBytes;

/// Memory on a device, owned by a device runtime.
pub trait DeviceMemory: Send + Sync + fmt::Debug + 'static {
    /// The device it is on.
    fn device(&self) -> Device;
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Itself, for the runtime that made it to downcast.
    fn as_any(&self) -> &dyn Any;
}

/// A shared handle to a tensor's device memory. Clones share the memory; two handles
/// are equal when they share it.
#[derive(Clone)]
pub struct DeviceBuffer(Arc<dyn DeviceMemory>);

impl DeviceBuffer {
    /// A handle to `memory`.
    pub fn new(memory: impl DeviceMemory) -> DeviceBuffer {
        DeviceBuffer(Arc::new(memory))
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.0.device()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The memory.
    pub fn memory(&self) -> &dyn DeviceMemory {
        &*self.0
    }

    /// The memory as the runtime's own type, if it is one.
    pub fn downcast_ref<T: DeviceMemory>(&self) -> Option<&T> {
        self.0.as_any().downcast_ref::<T>()
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl PartialEq for DeviceBuffer {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.0), Arc::as_ptr(&other.0))
    }
}

impl Eq for DeviceBuffer {}

/// "Device" memory that lives on the host: for runtimes and tests on machines without
/// the device (the agent cannot tell it from real device memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMemory {
    device: Device,
    bytes: Vec<u8>,
}

impl HostMemory {
    /// `bytes`, said to be on `device`.
    pub fn new(device: Device, bytes: Vec<u8>) -> HostMemory {
        HostMemory { device, bytes }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl DeviceMemory for HostMemory {
    fn device(&self) -> Device {
        self.device
    }

    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Host memory a device runtime staged a tensor into, owned by the runtime (pinned
/// buffers from its pool, say): see [`HostBytes::staged`].
///
/// Contract for implementors: [`bytes`](StagedBytes::bytes) returns the same slice on
/// every call, and the bytes stay at that address, unchanged, while the value lives (a
/// channel lends the address to the peer). Dropping the value gives the memory back to
/// the runtime.
pub trait StagedBytes: Send + Sync + 'static {
    /// The bytes.
    fn bytes(&self) -> &[u8];
}

/// A tensor's bytes in host memory, on their way out: a plain `Vec`, or memory a device
/// runtime staged the tensor into ([`StagedBytes`]). The CPU channels read either where
/// it is (inline frames, `cma`, `xth`, `mpt`), so a `cuda_basic` tensor is copied once,
/// device to host, and never again on the sending side.
pub struct HostBytes(HostRepr);

enum HostRepr {
    Owned(Vec<u8>),
    Staged(Box<dyn StagedBytes>),
}

impl HostBytes {
    /// Bytes a runtime staged into its own memory; dropping the value gives it back.
    pub fn staged(bytes: impl StagedBytes) -> HostBytes {
        HostBytes(HostRepr::Staged(Box::new(bytes)))
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.0 {
            HostRepr::Owned(bytes) => bytes,
            HostRepr::Staged(staged) => staged.bytes(),
        }
    }

    /// Whether a runtime's memory holds them (not a `Vec`).
    pub fn is_staged(&self) -> bool {
        matches!(self.0, HostRepr::Staged(_))
    }

    /// The `Vec`, when they are one (for the agent's recycled buffers); staged bytes are
    /// dropped, which gives their memory back to the runtime.
    pub fn into_owned(self) -> Option<Vec<u8>> {
        match self.0 {
            HostRepr::Owned(bytes) => Some(bytes),
            HostRepr::Staged(_) => None,
        }
    }

    /// The bytes as a `Vec`: the `Vec` they are, or a copy of staged bytes (which go back
    /// to their runtime).
    pub fn into_vec(self) -> Vec<u8> {
        match self.0 {
            HostRepr::Owned(bytes) => bytes,
            HostRepr::Staged(staged) => staged.bytes().to_vec(),
        }
    }
}

impl From<Vec<u8>> for HostBytes {
    fn from(bytes: Vec<u8>) -> HostBytes {
        HostBytes(HostRepr::Owned(bytes))
    }
}

impl Default for HostBytes {
    fn default() -> HostBytes {
        HostBytes::from(Vec::new())
    }
}

impl std::ops::Deref for HostBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for HostBytes {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl StableBytes for HostBytes {
    fn stable_bytes(&self) -> &[u8] {
        // A Vec's heap bytes do not move with it; staged bytes promise the same.
        self.as_slice()
    }
}

/// A copy; staged bytes are copied into a `Vec` (the copy holds no runtime memory).
impl Clone for HostBytes {
    fn clone(&self) -> HostBytes {
        HostBytes::from(self.as_slice().to_vec())
    }
}

impl PartialEq for HostBytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for HostBytes {}

impl PartialEq<Vec<u8>> for HostBytes {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialEq<HostBytes> for Vec<u8> {
    fn eq(&self, other: &HostBytes) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialEq<[u8]> for HostBytes {
    fn eq(&self, other: &[u8]) -> bool {
        self.as_slice() == other
    }
}

impl fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            HostRepr::Owned(bytes) => fmt::Debug::fmt(bytes, f),
            HostRepr::Staged(staged) => f
                .debug_struct("HostBytes")
                .field("staged_len", &staged.bytes().len())
                .finish(),
        }
    }
}

/// A tensor being received into device memory chunk by chunk (`cuda_basic`), made by
/// [`DeviceRuntime::receive_staged`]. The agent asks for chunk 0's buffer, fills it,
/// says so, then chunk 1's, and so on in order; the runtime starts each chunk's copy to
/// the device as soon as it is filled, and hands out a buffer again only once the copy
/// that used it is done. Chunk k is bytes `[k * chunk_len, min((k + 1) * chunk_len,
/// len))` of the tensor.
///
/// Dropping it before [`finish`](Self::finish) abandons the tensor (the pull failed):
/// the runtime waits for the copies it started and takes its buffers and the device
/// memory back.
pub trait StagedReceive: Send {
    /// The length of every chunk but the last (at least 1).
    fn chunk_len(&self) -> usize;

    /// Chunk `k`'s buffer, exactly as long as the chunk, for the agent to fill; waits
    /// until no copy uses it.
    ///
    /// # Errors
    /// A chunk out of order, or why waiting for the buffer's previous copy failed.
    fn chunk_buffer(&mut self, k: usize) -> Result<&mut [u8], String>;

    /// Chunk `k`'s buffer is filled: its copy to the device may start.
    ///
    /// # Errors
    /// A chunk out of order, or why the copy could not be started.
    fn chunk_filled(&mut self, k: usize) -> Result<(), String>;

    /// Every chunk was filled: waits for the last copies and returns the memory.
    ///
    /// # Errors
    /// Chunks left unfilled, or why a copy failed.
    fn finish(self: Box<Self>) -> Result<DeviceBuffer, String>;
}

/// A device runtime built outside this crate, handed to the agent in
/// `RpcOptions::device_plugins`.
pub trait DevicePlugin: Send + Sync {
    /// The device type it serves (only [`DeviceType::Cuda`] is accepted).
    fn device_type(&self) -> DeviceType;

    /// Opens the runtime: once per `init_rpc`.
    ///
    /// # Errors
    /// Why the devices cannot be used in this process (no driver, no device, ...): the
    /// agent logs it and offers `cuda_basic` for CPU memory only.
    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, String>;
}

/// What the agent asks of an opened device runtime. Every call blocks (copies are
/// synchronous) and may run on any thread.
pub trait DeviceRuntime: Send + Sync {
    /// How many devices of its type this process sees.
    fn device_count(&self) -> usize;

    /// Copies `memory` into host memory (`cuda_basic`'s sending side): a `Vec`, or the
    /// runtime's own memory ([`HostBytes::staged`]), which the CPU channel reads where it
    /// is and drops when the peer is done.
    ///
    /// # Errors
    /// Why the copy failed; the call fails with it.
    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<HostBytes, String>;

    /// Memory on `device` holding `bytes` (`cuda_basic`'s receiving side, for bytes that
    /// arrived whole: inline, over `mpt`, or from a runtime without
    /// [`receive_staged`](Self::receive_staged)).
    ///
    /// # Errors
    /// Why it cannot be allocated or filled (no such device, out of memory, ...).
    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, String>;

    /// Starts receiving a `len`-byte tensor onto `device` chunk by chunk
    /// ([`StagedReceive`]), or `None` when this runtime takes received bytes only whole
    /// ([`copy_from_host`](Self::copy_from_host)). Default: `None`.
    ///
    /// # Errors
    /// Why memory or buffers for it cannot be had (no such device, out of memory, ...).
    fn receive_staged(
        &self,
        device: Device,
        len: usize,
    ) -> Result<Option<Box<dyn StagedReceive>>, String> {
        let _ = (device, len);
        Ok(None)
    }

    /// The lending channels this runtime runs here (`cuda_xth`, `cuda_ipc`, `cuda_gdr`),
    /// each with its domain descriptor (two workers use a channel when their descriptors match),
    /// or why it cannot run here. Default: none.
    fn lending_channels(&self) -> Vec<(ChannelKind, Result<String, String>)> {
        Vec::new()
    }

    /// Lends `memory` to the peer over `channel`: the descriptor the frame carries, and
    /// what must live until the peer is done.
    ///
    /// # Errors
    /// Why it cannot be lent (memory this runtime did not make, a driver error, ...).
    fn lend(&self, channel: ChannelKind, memory: &DeviceBuffer) -> Result<DeviceLoan, String> {
        let _ = memory;
        Err(format!(
            "this device runtime does not lend memory over {channel}"
        ))
    }

    /// Fresh memory on `device` holding a copy of the `len` bytes a peer lent over
    /// `channel` with `descriptor` (untrusted bytes from the peer: check them).
    ///
    /// # Errors
    /// Why the copy failed (a malformed descriptor, memory of another process, ...).
    fn borrow(
        &self,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, String> {
        let _ = (device, len, descriptor);
        Err(format!(
            "this device runtime does not borrow memory over {channel}"
        ))
    }

    /// As [`borrow`](Self::borrow), for a loan that arrived on pipe `pipe` (the agent
    /// calls this one). A runtime that keeps what it opened for a peer (`cuda_ipc`'s
    /// opened IPC mappings) may keep it until [`pipe_ended`](Self::pipe_ended) for that
    /// pipe. Default: [`borrow`](Self::borrow).
    ///
    /// # Errors
    /// As [`borrow`](Self::borrow).
    fn borrow_on(
        &self,
        pipe: PipeId,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, String> {
        let _ = pipe;
        self.borrow(channel, device, len, descriptor)
    }

    /// Pipe `pipe` ended: nothing more is borrowed on it, and what the runtime kept for
    /// it can be released. Called once, after the last loan of that pipe was borrowed,
    /// for pipes that borrowed anything. Default: nothing.
    fn pipe_ended(&self, pipe: PipeId) {
        let _ = pipe;
    }
}

/// A pipe of this process, as the device runtimes see it: unique among the pipes of the
/// process's agents (never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PipeId(u64);

impl PipeId {
    /// A new id.
    pub(crate) fn next() -> PipeId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        PipeId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// The id as a number.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// Device memory lent to a peer: the descriptor that tells the peer's runtime where it
/// is, and what keeps it (and whatever lending it needed) alive until the peer is done.
pub struct DeviceLoan {
    /// What the frame carries for the tensor (at most 255 bytes).
    pub descriptor: Vec<u8>,
    /// Dropped when the loan ends: the peer read the memory, or the pipe ended.
    pub hold: Box<dyn Any + Send + Sync>,
}

impl fmt::Debug for DeviceLoan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceLoan")
            .field("descriptor_len", &self.descriptor.len())
            .finish_non_exhaustive()
    }
}

/// The domain descriptor of `cuda_basic`: staging runs wherever the CPU channels do.
pub(crate) const CUDA_BASIC_DESCRIPTOR: &str = "cuda_basic:staged";

/// The opened runtimes of one worker.
#[derive(Clone, Default)]
pub(crate) struct Devices {
    cuda: Option<Arc<dyn DeviceRuntime>>,
}

impl fmt::Debug for Devices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Devices")
            .field(
                "cuda",
                &self.cuda.as_ref().map(|runtime| runtime.device_count()),
            )
            .finish()
    }
}

impl Devices {
    /// Opens the plugins: the first viable CUDA one is used, the others' reasons are
    /// logged. A plugin for the CPU is refused.
    pub(crate) fn open(plugins: &[Arc<dyn DevicePlugin>]) -> Result<Devices, String> {
        let mut devices = Devices::default();
        for plugin in plugins {
            match plugin.device_type() {
                DeviceType::Cuda if devices.cuda.is_some() => {
                    tracing::info!("a second CUDA device plugin is ignored");
                }
                DeviceType::Cuda => match plugin.open() {
                    Ok(runtime) => {
                        tracing::info!(
                            devices = runtime.device_count(),
                            "CUDA tensors move over cuda_basic"
                        );
                        devices.cuda = Some(runtime);
                    }
                    Err(reason) => {
                        tracing::info!(%reason, "CUDA is not usable; cuda_basic serves CPU memory only");
                    }
                },
                DeviceType::Cpu => {
                    return Err("the CPU is built in and cannot be plugged in".into());
                }
                other => return Err(format!("device type {other} cannot be plugged in")),
            }
        }
        Ok(devices)
    }

    /// The runtime of `kind`'s devices (none for the CPU).
    pub(crate) fn runtime(&self, kind: DeviceType) -> Option<&Arc<dyn DeviceRuntime>> {
        match kind {
            DeviceType::Cuda => self.cuda.as_ref(),
            _ => None,
        }
    }

    /// Whether this worker has a CUDA runtime.
    pub(crate) fn has_cuda(&self) -> bool {
        self.cuda.is_some()
    }

    /// The domain descriptor of the lending channel `kind` (`cuda_xth`, `cuda_ipc`,
    /// `cuda_gdr`), or why this worker cannot offer it.
    pub(crate) fn lending_descriptor(&self, kind: ChannelKind) -> Result<String, String> {
        let runtime = self.cuda.as_ref().ok_or_else(|| {
            format!("{kind} needs a CUDA runtime (RpcOptions::device_plugins), and none opened")
        })?;
        runtime
            .lending_channels()
            .into_iter()
            .find(|(offered, _)| *offered == kind)
            .map_or_else(
                || Err(format!("the CUDA runtime does not run {kind}")),
                |(_, descriptor)| descriptor,
            )
    }

    /// Lends a `device` tensor's `memory` over `channel`.
    pub(crate) fn lend(
        &self,
        channel: ChannelKind,
        device: Device,
        memory: Option<&DeviceBuffer>,
    ) -> Result<DeviceLoan, String> {
        let memory = checked_memory(device, memory)?;
        let runtime = self.runtime(device.kind()).ok_or_else(|| {
            format!(
                "this worker has no {} runtime (RpcOptions::device_plugins)",
                device.kind()
            )
        })?;
        let loan = runtime.lend(channel, memory)?;
        if loan.descriptor.len() > usize::from(u8::MAX) {
            return Err(format!(
                "the {} runtime made a {}-byte {channel} descriptor; a frame carries at most 255",
                device.kind(),
                loan.descriptor.len()
            ));
        }
        Ok(loan)
    }

    /// The `len` bytes lent over `channel` with `descriptor` on `pipe`, copied onto
    /// `device`.
    pub(crate) fn borrow(
        &self,
        pipe: PipeId,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, String> {
        let kind = device.kind();
        let runtime = self
            .runtime(kind)
            .ok_or_else(|| format!("this worker has no {kind} runtime to receive on {device}"))?;
        let memory = runtime.borrow_on(pipe, channel, device, len, descriptor)?;
        if memory.device() != device || memory.len() as u64 != len {
            return Err(format!(
                "the {kind} runtime made {} bytes on {} for {len} bytes on {device}",
                memory.len(),
                memory.device()
            ));
        }
        Ok(memory)
    }

    /// Tells the runtimes that `pipe` ended.
    pub(crate) fn pipe_ended(&self, pipe: PipeId) {
        if let Some(runtime) = &self.cuda {
            runtime.pipe_ended(pipe);
        }
    }

    /// The host bytes of a tensor that leaves on `cuda_basic`: a CPU tensor's own, a
    /// device tensor's copied by its runtime.
    pub(crate) fn stage_out(
        &self,
        device: Device,
        data: Vec<u8>,
        memory: Option<&DeviceBuffer>,
    ) -> Result<HostBytes, String> {
        if device.is_cpu() {
            return match memory {
                None => Ok(data.into()),
                Some(_) => Err(format!(
                    "a {device} tensor holds device memory; give CPU tensors their bytes in `data`"
                )),
            };
        }
        let kind = device.kind();
        let memory = checked_memory(device, memory)?;
        let runtime = self.runtime(kind).ok_or_else(|| {
            format!("this worker has no {kind} runtime (RpcOptions::device_plugins)")
        })?;
        let bytes = runtime.copy_to_host(memory)?;
        if bytes.len() != memory.len() {
            return Err(format!(
                "the {kind} runtime copied {} bytes of a {}-byte tensor to the host",
                bytes.len(),
                memory.len()
            ));
        }
        Ok(bytes)
    }

    /// Where a received `len`-byte tensor for `device` (not the CPU) is pulled into:
    /// the runtime's chunks when it stages in chunks, else one host buffer handed to it
    /// whole at the end.
    pub(crate) fn receive_into(&self, device: Device, len: usize) -> Result<StagingIn, String> {
        let kind = device.kind();
        let runtime = self
            .runtime(kind)
            .ok_or_else(|| format!("this worker has no {kind} runtime to receive on {device}"))?;
        let target = match runtime.receive_staged(device, len)? {
            Some(chunked) if chunked.chunk_len() > 0 => Target::Chunked(chunked),
            Some(_) => return Err(format!("the {kind} runtime stages in chunks of 0 bytes")),
            None => Target::Whole {
                runtime: Arc::clone(runtime),
                bytes: Vec::new(),
            },
        };
        Ok(StagingIn {
            target,
            device,
            len,
        })
    }

    /// A received tensor's bytes put on `device`: kept as they are for the CPU, copied
    /// by the runtime otherwise. Returns the host bytes (empty for a device tensor) and
    /// the device memory.
    pub(crate) fn stage_in(
        &self,
        device: Device,
        bytes: Vec<u8>,
    ) -> Result<(Vec<u8>, Option<DeviceBuffer>), String> {
        let kind = device.kind();
        if kind == DeviceType::Cpu {
            return Ok((bytes, None));
        }
        let runtime = self
            .runtime(kind)
            .ok_or_else(|| format!("this worker has no {kind} runtime to receive on {device}"))?;
        let len = bytes.len();
        let memory = runtime.copy_from_host(device, bytes)?;
        if memory.device() != device || memory.len() != len {
            return Err(format!(
                "the {kind} runtime made {} bytes on {} for {len} bytes on {device}",
                memory.len(),
                memory.device()
            ));
        }
        Ok((Vec::new(), Some(memory)))
    }
}

/// A received tensor on its way into device memory ([`Devices::receive_into`]): the
/// pull fills its chunks in order ([`chunks`](Self::chunks),
/// [`chunk_buffer`](Self::chunk_buffer), [`chunk_filled`](Self::chunk_filled)) and
/// [`finish`](Self::finish) returns the memory, checked. Dropped unfinished, the runtime
/// takes back what it holds for it.
pub(crate) struct StagingIn {
    target: Target,
    device: Device,
    len: usize,
}

enum Target {
    /// The runtime's [`StagedReceive`].
    Chunked(Box<dyn StagedReceive>),
    /// One chunk, the whole tensor, handed to `copy_from_host` at the end.
    Whole {
        runtime: Arc<dyn DeviceRuntime>,
        bytes: Vec<u8>,
    },
}

impl fmt::Debug for StagingIn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingIn")
            .field("device", &self.device)
            .field("len", &self.len)
            .field("chunked", &matches!(self.target, Target::Chunked(_)))
            .finish()
    }
}

impl StagingIn {
    /// The chunks to fill, in order: `(k, offset, len)`.
    pub(crate) fn chunks(&self) -> Vec<(usize, usize, usize)> {
        let chunk = match &self.target {
            Target::Chunked(chunked) => chunked.chunk_len().max(1),
            Target::Whole { .. } => self.len.max(1),
        };
        (0..self.len.div_ceil(chunk))
            .map(|k| {
                let offset = k * chunk;
                (k, offset, chunk.min(self.len - offset))
            })
            .collect()
    }

    /// Chunk `k`'s buffer to fill (checked to be as long as the chunk).
    pub(crate) fn chunk_buffer(&mut self, k: usize) -> Result<&mut [u8], String> {
        let Some(&(_, _, expected)) = self.chunks().get(k) else {
            return Err(format!("no chunk {k} in a {}-byte tensor", self.len));
        };
        let kind = self.device.kind();
        let buffer = match &mut self.target {
            Target::Chunked(chunked) => chunked.chunk_buffer(k)?,
            Target::Whole { bytes, .. } => {
                *bytes = super::recycle::try_take(self.len).map_err(|e| e.to_string())?;
                crate::channel::buffer::prefer_huge_pages(bytes);
                bytes.as_mut_slice()
            }
        };
        if buffer.len() != expected {
            return Err(format!(
                "the {kind} runtime gave a {}-byte buffer for chunk {k} of {expected} bytes",
                buffer.len()
            ));
        }
        Ok(buffer)
    }

    /// Chunk `k` is filled.
    pub(crate) fn chunk_filled(&mut self, k: usize) -> Result<(), String> {
        match &mut self.target {
            Target::Chunked(chunked) => chunked.chunk_filled(k),
            Target::Whole { .. } => Ok(()),
        }
    }

    /// Every chunk is filled: the device memory, checked to be what was asked for.
    pub(crate) fn finish(self) -> Result<DeviceBuffer, String> {
        let StagingIn {
            target,
            device,
            len,
        } = self;
        let memory = match target {
            Target::Chunked(chunked) => chunked.finish()?,
            Target::Whole { runtime, bytes } => {
                let bytes = if len == 0 { Vec::new() } else { bytes };
                runtime.copy_from_host(device, bytes)?
            }
        };
        if memory.device() != device || memory.len() != len {
            return Err(format!(
                "the {} runtime made {} bytes on {} for {len} bytes on {device}",
                device.kind(),
                memory.len(),
                memory.device()
            ));
        }
        Ok(memory)
    }
}

/// A device tensor's memory, which it must hold, on the device it names.
fn checked_memory(device: Device, memory: Option<&DeviceBuffer>) -> Result<&DeviceBuffer, String> {
    let memory = memory.ok_or_else(|| {
        format!(
            "the {device} tensor holds no device memory (a {} tensor is made with \
             Tensor::on_device)",
            device.kind()
        )
    })?;
    if memory.device() != device {
        return Err(format!(
            "the tensor says {device}, but its memory is on {}",
            memory.device()
        ));
    }
    Ok(memory)
}

impl super::recycle::Recyclable for HostBytes {
    fn into_recyclable(self) -> Option<Vec<u8>> {
        self.into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct HostRuntime {
        short_copy: bool,
    }

    impl HostRuntime {
        fn bytes(memory: &DeviceBuffer) -> Result<Vec<u8>, String> {
            let memory = memory
                .downcast_ref::<HostMemory>()
                .ok_or("foreign memory")?;
            Ok(memory.bytes().to_vec())
        }
    }

    impl DeviceRuntime for HostRuntime {
        fn lending_channels(&self) -> Vec<(ChannelKind, Result<String, String>)> {
            vec![
                (ChannelKind::CudaIpc, Ok("cuda_ipc:here".into())),
                (ChannelKind::CudaXth, Err("not in this test".into())),
            ]
        }
        /// The descriptor is the bytes themselves (a short copy when `short_copy`).
        fn lend(&self, _: ChannelKind, memory: &DeviceBuffer) -> Result<DeviceLoan, String> {
            Ok(DeviceLoan {
                descriptor: Self::bytes(memory)?,
                hold: Box::new(memory.clone()),
            })
        }
        fn borrow(
            &self,
            _: ChannelKind,
            device: Device,
            _: u64,
            descriptor: &[u8],
        ) -> Result<DeviceBuffer, String> {
            let mut bytes = descriptor.to_vec();
            if self.short_copy {
                bytes.pop();
            }
            self.copy_from_host(device, bytes)
        }
        fn device_count(&self) -> usize {
            2
        }
        fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<HostBytes, String> {
            let memory = memory
                .downcast_ref::<HostMemory>()
                .ok_or("foreign memory")?;
            let mut bytes = memory.bytes().to_vec();
            if self.short_copy {
                bytes.pop();
            }
            Ok(bytes.into())
        }
        fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, String> {
            if device.index().unwrap_or(0) >= 2 {
                return Err(format!("no {device}"));
            }
            Ok(DeviceBuffer::new(HostMemory::new(device, bytes)))
        }
    }

    struct Plugin(DeviceType, Result<bool, &'static str>);

    impl DevicePlugin for Plugin {
        fn device_type(&self) -> DeviceType {
            self.0
        }
        fn open(&self) -> Result<Arc<dyn DeviceRuntime>, String> {
            match self.1 {
                Ok(short_copy) => Ok(Arc::new(HostRuntime { short_copy })),
                Err(reason) => Err(reason.to_string()),
            }
        }
    }

    fn cuda(index: u8) -> Device {
        Device::cuda(index)
    }

    fn devices(plugin: Plugin) -> Devices {
        Devices::open(&[Arc::new(plugin)]).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_cpu_plugin_is_refused_and_an_unusable_one_leaves_cuda_out() {
        let cpu: Arc<dyn DevicePlugin> = Arc::new(Plugin(DeviceType::Cpu, Ok(false)));
        let err = Devices::open(&[cpu]).expect_err("cpu is built in");
        assert!(err.contains("built in"), "{err}");
        assert!(!devices(Plugin(DeviceType::Cuda, Err("no driver"))).has_cuda());
        assert!(devices(Plugin(DeviceType::Cuda, Ok(false))).has_cuda());
    }

    #[test]
    fn lending_is_checked_on_both_sides() {
        let devices = devices(Plugin(DeviceType::Cuda, Ok(false)));
        assert_eq!(
            devices.lending_descriptor(ChannelKind::CudaIpc).as_deref(),
            Ok("cuda_ipc:here")
        );
        let err = devices
            .lending_descriptor(ChannelKind::CudaXth)
            .expect_err("refused");
        assert_eq!(err, "not in this test");
        let err = devices
            .lending_descriptor(ChannelKind::CudaGdr)
            .expect_err("not run");
        assert!(err.contains("does not run cuda_gdr"), "{err}");
        let err = Devices::default()
            .lending_descriptor(ChannelKind::CudaIpc)
            .expect_err("no runtime");
        assert!(err.contains("device_plugins"), "{err}");

        let memory = DeviceBuffer::new(HostMemory::new(cuda(0), vec![1, 2, 3]));
        let loan = devices
            .lend(ChannelKind::CudaIpc, cuda(0), Some(&memory))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(loan.descriptor, vec![1, 2, 3]);
        let copy = devices
            .borrow(
                PipeId::next(),
                ChannelKind::CudaIpc,
                cuda(1),
                3,
                &loan.descriptor,
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((copy.device(), copy.len()), (cuda(1), 3));
        // The tensor must hold memory on its own device.
        let err = devices
            .lend(ChannelKind::CudaIpc, cuda(1), Some(&memory))
            .expect_err("other device");
        assert!(err.contains("its memory is on cuda:0"), "{err}");
        let err = devices
            .lend(ChannelKind::CudaIpc, cuda(0), None)
            .expect_err("no memory");
        assert!(err.contains("Tensor::on_device"), "{err}");
        // A descriptor a frame cannot carry is refused.
        let big = DeviceBuffer::new(HostMemory::new(cuda(0), vec![0; 256]));
        let err = devices
            .lend(ChannelKind::CudaIpc, cuda(0), Some(&big))
            .expect_err("too long");
        assert!(err.contains("256-byte cuda_ipc descriptor"), "{err}");
        // The receiver checks what its runtime made.
        let short = self::devices(Plugin(DeviceType::Cuda, Ok(true)));
        let err = short
            .borrow(
                PipeId::next(),
                ChannelKind::CudaIpc,
                cuda(1),
                3,
                &loan.descriptor,
            )
            .expect_err("short");
        assert!(err.contains("made 2 bytes on cuda:1 for 3 bytes"), "{err}");
    }

    #[test]
    fn staging_round_trips_and_checks_what_the_runtime_returns() {
        let devices = devices(Plugin(DeviceType::Cuda, Ok(false)));
        let (host, memory) = devices
            .stage_in(cuda(1), vec![1, 2, 3])
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(host.is_empty());
        let memory = memory.expect("device memory");
        assert_eq!((memory.device(), memory.len()), (cuda(1), 3));
        assert_eq!(memory, memory.clone());
        let out = devices.stage_out(cuda(1), Vec::new(), Some(&memory));
        assert_eq!(out, Ok(vec![1, 2, 3].into()));
        // CPU tensors pass through.
        assert_eq!(
            devices.stage_in(Device::cpu(), vec![4]),
            Ok((vec![4], None))
        );
        assert_eq!(
            devices.stage_out(Device::cpu(), vec![5], None),
            Ok(vec![5].into())
        );
        // Wrong shapes are refused with what to do.
        let err = devices
            .stage_out(cuda(0), vec![1], None)
            .expect_err("no memory");
        assert!(err.contains("Tensor::on_device"), "{err}");
        let err = devices
            .stage_out(cuda(0), Vec::new(), Some(&memory))
            .expect_err("memory on another device");
        assert!(err.contains("its memory is on cuda:1"), "{err}");
        let err = devices
            .stage_out(Device::cpu(), Vec::new(), Some(&memory))
            .expect_err("cpu with memory");
        assert!(err.contains("holds device memory"), "{err}");
        let err = devices.stage_in(cuda(5), vec![1]).expect_err("no cuda:5");
        assert_eq!(err, "no cuda:5");

        let short = self::devices(Plugin(DeviceType::Cuda, Ok(true)));
        let err = short
            .stage_out(cuda(1), Vec::new(), Some(&memory))
            .expect_err("short copy");
        assert!(err.contains("copied 2 bytes of a 3-byte tensor"), "{err}");

        let none = Devices::default();
        let err = none.stage_in(cuda(0), vec![1]).expect_err("no runtime");
        assert!(err.contains("no cuda runtime"), "{err}");
        let err = none
            .stage_out(cuda(1), Vec::new(), Some(&memory))
            .expect_err("no runtime");
        assert!(err.contains("device_plugins"), "{err}");
    }
}
