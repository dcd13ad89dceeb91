//! The CUDA runtime of the RPC agent: [`CudaPlugin`], handed to
//! `rdzv_uring::rpc::RpcOptions::device_plugins`, and [`CudaMemory`], the device memory
//! of CUDA tensors (`rdzv_uring::rpc::Tensor::on_device(DeviceBuffer::new(memory))`).
//!
//! The agent asks the runtime for three things (`rdzv_uring::rpc::device`):
//!
//! - `cuda_xth` (same process): a tensor is lent by its device address, and the receiver
//!   copies it device to device (`cuMemcpyAsync` over unified addressing, so across GPUs
//!   too);
//! - `cuda_ipc` (another process of this host): a tensor is lent through the CUDA IPC
//!   memory handle of its allocation (`cuIpcGetMemHandle`, made once per allocation and
//!   cached with it) and the allocation's base address. The receiver keeps what it opened
//!   (`cuIpcOpenMemHandle`, with lazy peer access) per pipe, lending process, device and
//!   base, for the pipe's life, bounded ([`super::ipc_mappings`]): another handle at a
//!   known base means the address was reused, and the stale mapping is closed first. The
//!   sender holds the memory until the receiver answered (the agent's lending rule), so
//!   no event handle is needed;
//! - `cuda_gdr` (another host, GPUDirect RDMA): a tensor's allocation is registered with
//!   the NIC in the verbs domain of this process's GDR endpoint (a TCP listener that
//!   bootstraps queue pairs, [`crate::ibv::lending`]); the descriptor names the endpoint,
//!   the device address and the rkey, and the receiver reads the range into fresh memory
//!   on its target device, registered in its own domain, with one RDMA READ. Offered only
//!   when the probe finds it viable (CUDA, an active InfiniBand/RoCE port, a registration
//!   path for every device); the node is started on first use. Each loan registers the
//!   allocation anew and deregisters it when the loan ends (no cache: a freed allocation
//!   must not leave a registration behind). Not run against a GPU and NIC here: the data
//!   path is the host-memory one tested on Soft-RoCE, the CUDA side only compiles;
//! - `cuda_basic`: copies to and from host memory through pinned buffers. Sending, the
//!   tensor is copied device to host once, into a pinned block from a per-device cache
//!   ([`CudaOptions::staged_out_cap_bytes`]), and the CPU channel reads that block where
//!   it is (`HostBytes::staged`; the block goes back to the cache when the channel drops
//!   it); a tensor that does not fit under the cap is staged in chunks into pageable
//!   memory instead. Receiving over `cma` or `xth`, the agent pulls the bytes chunk by
//!   chunk into the runtime's pinned staging buffers (`DeviceRuntime::receive_staged`),
//!   and each chunk's host-to-device copy starts as soon as it is filled, while the next
//!   chunk is pulled ([`super::chunk_plan::ChunkedStageIn`]); bytes that arrived whole
//!   (inline, `mpt`) are staged in chunks ([`super::chunk_plan`]): the device copy of one
//!   chunk runs while the host copies the previous one.
//!
//! **When a received tensor is ready.** Every copy runs on the runtime's own streams
//! (a few per device) and is waited for with an event recorded after it, never with a
//! device-wide synchronisation; the runtime hands a tensor to the agent only after that
//! wait. So a received tensor's memory is complete when the agent hands it to a handler,
//! or when `rpc_sync` (or the future's wait) returns it; no stream of the caller's needs
//! to wait for anything. A sender must hand the agent memory whose producing work is
//! complete (synchronise the stream that wrote it first).
//!
//! **Where received memory comes from.** A caching allocator per device
//! ([`super::caching_allocator`], `cuMemAlloc` blocks in size classes, under a cap:
//! [`CudaOptions::cache_cap_bytes`]). A received tensor's block goes back to the cache
//! when the last handle to its memory is dropped, and is handed out again for the next
//! tensor: work of the consumer's own that still reads or writes it must be complete by
//! then (as before `cuMemFree`). Memory made with [`CudaMemory::alloc`] or
//! [`CudaMemory::upload`] is the caller's own `cuMemAlloc` allocation, as before.
//!
//! Everything the runtime opened (mappings, events, streams, pinned buffers, cached
//! blocks) is released when the agent drops it at shutdown; a pipe's mappings when the
//! pipe ends (`DeviceRuntime::pipe_ended`).
//!
//! Opening the runtime never panics when the driver is absent: [`CudaPlugin`] probes
//! first ([`super::probe`]) and reports why CUDA cannot be used, and the agent then
//! serves CUDA pairs with nothing (a CPU-only worker still offers `cuda_basic` for its
//! CPU side).

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::safe::CudaStream;
use rdzv_core::channel::cuda::{CudaIpcDescriptor, CudaXthDescriptor, IPC_HANDLE_LEN};
use rdzv_core::channel::ProcessIdentity;
use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::ChannelKind;
use rdzv_uring::channel::current_identity;
use rdzv_uring::rpc::{
    DeviceBuffer, DeviceLoan, DeviceMemory, DevicePlugin, DeviceRuntime, HostBytes, PipeId,
    StagedBytes, StagedReceive,
};

use super::caching_allocator::{BackingAllocator, CachedBlock, CachingAllocator};
use super::channel_error::CudaChannelError;
use super::chunk_plan::{self, ChunkPlan, ChunkedStageIn, StagingCopies};
use super::descriptor::HostIdentity;
use super::gdr::{GdrPath, GdrRegistrar, GdrRegistration};
use super::gdr_lending::{self, GdrNode, GdrTarget};
use super::ipc_mappings::{IpcMappings, MappingKey, MappingOpener};
use super::memory::{
    copy_unified_async, DeviceAllocation, DeviceRange, DeviceSource, Gpu, IpcMapping, RawEvent,
    StagingBuffer,
};
use super::viability::{self, ChannelVerdict, CudaChannel};
use super::PeerMemory;
use crate::ibv::IbvViability;
use crate::report::ErrorChain;

/// The environment variable that sets [`CudaOptions::cache_cap_bytes`] for
/// [`CudaPlugin`] (a byte count).
pub const ENV_CACHE_CAP: &str = "RDZV_CUDA_CACHE_CAP";

/// How the CUDA runtime uses memory and streams. [`CudaPlugin`] takes the defaults
/// (with [`ENV_CACHE_CAP`]); [`ConfiguredCudaPlugin`] takes these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// The most bytes of received tensors' device memory one device's caching allocator
    /// holds (in use plus cached). A tensor that does not fit while the others are alive
    /// fails with an error naming the device, its size, the cap and the bytes in use.
    pub cache_cap_bytes: usize,
    /// `cuda_basic`'s staging chunk: the bytes one pinned buffer holds.
    pub staging_chunk_bytes: usize,
    /// Pinned buffers one staged copy cycles through (2 = double buffering).
    pub staging_buffers: usize,
    /// The most bytes of pinned host memory one device holds for tensors on their way
    /// out over `cuda_basic` (in use by the CPU channels plus cached). A tensor that
    /// does not fit is staged in chunks into pageable memory instead (one more host
    /// copy).
    pub staged_out_cap_bytes: usize,
    /// Streams per device the copies are spread over.
    pub streams_per_device: usize,
    /// The most `cuda_ipc` mappings a device keeps open (least recently used closed
    /// first).
    pub ipc_mappings_per_device: usize,
    /// The most bytes those mappings may map (an open mapping keeps the lender's memory
    /// alive even after the lender freed it).
    pub ipc_mapped_bytes_per_device: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            cache_cap_bytes: 8 << 30,
            staging_chunk_bytes: 4 << 20,
            staging_buffers: 3,
            staged_out_cap_bytes: 2 << 30,
            streams_per_device: 2,
            ipc_mappings_per_device: 256,
            ipc_mapped_bytes_per_device: 4 << 30,
        }
    }
}

impl CudaOptions {
    /// The defaults, with the cap from [`ENV_CACHE_CAP`] when it is set.
    ///
    /// # Errors
    /// [`ENV_CACHE_CAP`] is set but is not a byte count.
    pub fn from_env() -> Result<CudaOptions, String> {
        Self::with_cache_cap(std::env::var(ENV_CACHE_CAP).ok().as_deref())
    }

    /// The defaults, with the cap from `cap` (the value of [`ENV_CACHE_CAP`]) when given.
    fn with_cache_cap(cap: Option<&str>) -> Result<CudaOptions, String> {
        let mut options = CudaOptions::default();
        if let Some(text) = cap {
            options.cache_cap_bytes = text.trim().parse().map_err(|_| {
                format!("{ENV_CACHE_CAP}={text:?} is not a byte count (e.g. 8589934592)")
            })?;
        }
        Ok(options)
    }
}

/// The CUDA device plugin of the RPC agent, with [`CudaOptions::from_env`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaPlugin;

impl DevicePlugin for CudaPlugin {
    fn device_type(&self) -> DeviceType {
        DeviceType::Cuda
    }

    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, String> {
        let options = CudaOptions::from_env()?;
        CudaRuntime::open_with(options).map(|runtime| Arc::new(runtime) as Arc<dyn DeviceRuntime>)
    }
}

/// The CUDA device plugin of the RPC agent, with the given options.
#[derive(Debug, Clone, Copy, Default)]
pub struct ConfiguredCudaPlugin(pub CudaOptions);

impl DevicePlugin for ConfiguredCudaPlugin {
    fn device_type(&self) -> DeviceType {
        DeviceType::Cuda
    }

    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, String> {
        CudaRuntime::open_with(self.0).map(|runtime| Arc::new(runtime) as Arc<dyn DeviceRuntime>)
    }
}

/// An opened CUDA runtime: the devices, opened on first use, and what the lending
/// channels need to know about this process.
#[derive(Debug)]
pub struct CudaRuntime {
    options: CudaOptions,
    count: usize,
    devices: Mutex<Vec<Option<Arc<DeviceState>>>>,
    /// This process, for the lending descriptors; `Err` when `/proc` could not say.
    process: Result<ProcessIdentity, String>,
    /// `cuda_xth`'s and `cuda_ipc`'s domain descriptors, or why they cannot run.
    xth: Result<String, String>,
    ipc: Result<String, String>,
    /// `cuda_gdr`'s domain descriptor, or why it cannot run.
    gdr: Result<String, String>,
    /// Each device's registration path (from the probe), by ordinal.
    gdr_paths: Vec<GdrPath>,
    peer_memory: PeerMemory,
    /// The GDR node, started on first use, and one registrar per device.
    gdr_node: Mutex<Option<Arc<GdrNode>>>,
    registrars: Mutex<Vec<Option<GdrRegistrar>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CudaRuntime {
    /// Probes CUDA and the channels' prerequisites, with the default options.
    ///
    /// # Errors
    /// Why CUDA cannot be used here (no driver library, `cuInit` failed, no device).
    pub fn open() -> Result<CudaRuntime, String> {
        Self::open_with(CudaOptions::default())
    }

    /// As [`open`](Self::open), with `options`.
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub fn open_with(options: CudaOptions) -> Result<CudaRuntime, String> {
        let report = viability::probe();
        let cuda = report.facts.cuda.report().ok_or_else(|| {
            report.facts.cuda.reason().map_or_else(
                || "CUDA is not viable".to_string(),
                |reason| format!("CUDA is not viable: {}", ErrorChain(reason)),
            )
        })?;
        let count = cuda.devices.len();
        let process = current_identity().map_err(|e| ErrorChain(&e).to_string());
        let host = HostIdentity::current().map_err(|e| format!("cannot identify this host: {e}"));
        let channel = |channel: CudaChannel, descriptor: fn(&HostIdentity) -> String| match report
            .verdict(channel)
        {
            Some(verdict) if !verdict.is_viable() => Err(format!("{channel}: {verdict}")),
            _ => match (&host, &process) {
                (Ok(host), Ok(_)) => Ok(descriptor(host)),
                (Err(e), _) | (_, Err(e)) => Err(format!("{channel} not viable: {e}")),
            },
        };
        let gdr_verdict = report.verdict(CudaChannel::Gdr);
        let gdr = gdr_lending::gdr_offer(
            gdr_verdict,
            process.as_ref().map(|_| ()).map_err(String::as_str),
        );
        let gdr_paths = match gdr_verdict {
            Some(ChannelVerdict::Viable(paths)) => paths.clone(),
            _ => Vec::new(),
        };
        Ok(CudaRuntime {
            options,
            count,
            devices: Mutex::new((0..count).map(|_| None).collect()),
            xth: channel(CudaChannel::Xth, HostIdentity::xth_descriptor),
            ipc: channel(CudaChannel::Ipc, HostIdentity::ipc_descriptor),
            gdr,
            gdr_paths,
            peer_memory: cuda.peer_memory,
            gdr_node: Mutex::new(None),
            registrars: Mutex::new((0..count).map(|_| None).collect()),
            process,
        })
    }

    /// The opened device `device` (opened now if it is the first use).
    fn device(&self, device: Device) -> Result<Arc<DeviceState>, String> {
        let ordinal = ordinal(device)?;
        let mut devices = lock(&self.devices);
        let slot = devices.get_mut(ordinal).ok_or_else(|| {
            format!(
                "this process has no {device}: it sees {} CUDA device(s)",
                self.count
            )
        })?;
        if let Some(state) = slot {
            return Ok(Arc::clone(state));
        }
        let state = Arc::new(
            DeviceState::open(device, ordinal, &self.options)
                .map_err(|e| ErrorChain(&e).to_string())?,
        );
        *slot = Some(Arc::clone(&state));
        Ok(state)
    }

    fn process(&self) -> Result<ProcessIdentity, String> {
        self.process.clone()
    }

    /// The GDR node, started now if this is the first use; only when `cuda_gdr` is
    /// offered.
    fn gdr_node(&self) -> Result<Arc<GdrNode>, String> {
        self.gdr.as_ref().map_err(Clone::clone)?;
        let mut node = lock(&self.gdr_node);
        if let Some(node) = node.as_ref() {
            return Ok(Arc::clone(node));
        }
        let selection = match crate::ibv::probe_env() {
            IbvViability::Viable(selection) => selection,
            IbvViability::NotViable(reason) => {
                return Err(format!(
                    "cuda_gdr: no usable RDMA device: {}",
                    ErrorChain(&reason)
                ))
            }
        };
        let configured = std::env::var(gdr_lending::ENV_GDR_ADDR).ok();
        let advertised = gdr_lending::advertised_ip(configured.as_deref(), selection.gid)?;
        let started = Arc::new(GdrNode::open(&selection, advertised)?);
        tracing::info!(
            endpoint = %started.advertised(),
            device = %selection.device,
            "cuda_gdr endpoint started"
        );
        *node = Some(Arc::clone(&started));
        Ok(started)
    }

    /// A registration of the whole allocation `allocation` of device `ordinal` in the GDR
    /// node's domain, held only by the caller (dropping it deregisters).
    fn gdr_register(
        &self,
        node: &GdrNode,
        ordinal: usize,
        allocation: &DeviceAllocation,
    ) -> Result<Arc<GdrRegistration>, String> {
        let gpu = allocation.gpu().clone();
        let path = *self.gdr_paths.get(ordinal).ok_or_else(|| {
            format!("cuda_gdr: the probe found no registration path for CUDA device {ordinal}")
        })?;
        let mut registrars = lock(&self.registrars);
        let slot = registrars
            .get_mut(ordinal)
            .ok_or_else(|| format!("cuda_gdr: no CUDA device {ordinal}"))?;
        let registrar = slot.get_or_insert_with(|| {
            GdrRegistrar::new(
                Arc::clone(node.domain().pd()),
                &gpu,
                path,
                &self.peer_memory,
                gdr_lending::gdr_access(),
                1,
            )
        });
        let registration = registrar
            .register(allocation.range())
            .map_err(|e| ErrorChain(&e).to_string());
        // Nothing stays cached: the caller's handle is the only one, so the registration
        // ends with the loan (or the read), before the allocation can be freed.
        registrar.forget_all();
        registration
    }

    /// Lent memory copied into memory from `device`'s cache (`pipe`: where the loan
    /// came from, `None` when the caller did not say).
    fn borrow_from(
        &self,
        pipe: Option<PipeId>,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, String> {
        let me = self.process()?;
        let target = ordinal(device)?;
        let to_usize =
            |len: u64| usize::try_from(len).map_err(|_| format!("{len} bytes do not fit here"));
        match channel {
            ChannelKind::CudaXth => {
                let lent = CudaXthDescriptor::decode(descriptor).map_err(|e| e.to_string())?;
                check_lent_length(channel, lent.length, len)?;
                if lent.process != me {
                    return Err(format!(
                        "the memory was lent by pid {}, not by this process (pid {}): \
                         cuda_xth works within one process",
                        lent.process.pid, me.pid
                    ));
                }
                let state = self.device(device)?;
                let memory = state.alloc(to_usize(len)?)?;
                // Only read: the lender holds the memory until this side answered.
                let src = DeviceSource::named_by_peer(lent.address, memory.len());
                state
                    .copy_device(memory.range(), src)
                    .map_err(|e| ErrorChain(&e).to_string())?;
                Ok(DeviceBuffer::new(memory))
            }
            ChannelKind::CudaIpc => {
                let lent = CudaIpcDescriptor::decode(descriptor).map_err(|e| e.to_string())?;
                check_lent_length(channel, lent.length, len)?;
                if let Some(what) = me.mismatch(&lent.process) {
                    return Err(format!(
                        "the memory was lent by pid {} under another {what}: cuda_ipc works \
                         between processes of one host",
                        lent.process.pid
                    ));
                }
                let offset = to_usize(lent.offset)?;
                let state = self.device(device)?;
                let memory = state.alloc(to_usize(len)?)?;
                if memory.is_empty() {
                    return Ok(DeviceBuffer::new(memory));
                }
                let copy = |mapping: &OpenedHandle| -> Result<(), CudaChannelError> {
                    let src = mapping.holding(offset, memory.len())?;
                    state.copy_device(memory.range(), src)
                };
                let copied = match pipe {
                    Some(pipe) => {
                        let key = MappingKey {
                            pipe: pipe.get(),
                            peer: lent.process,
                            device: target,
                            base: lent.base,
                        };
                        state.gpu.bind().map_err(|e| ErrorChain(&e).to_string())?;
                        let mapping = lock(&state.mappings)
                            .get(key, &lent.handle)
                            .map_err(|e| ErrorChain(&e).to_string())?;
                        copy(&mapping)
                    }
                    None => {
                        state.gpu.bind().map_err(|e| ErrorChain(&e).to_string())?;
                        let mapping = OpenedHandle::open(&state.gpu, &lent.handle)
                            .map_err(|e| ErrorChain(&e).to_string())?;
                        copy(&mapping)
                    }
                };
                copied.map_err(|e| ErrorChain(&e).to_string())?;
                Ok(DeviceBuffer::new(memory))
            }
            ChannelKind::CudaGdr => {
                let lent = gdr_lending::check_descriptor(descriptor, len)?;
                let state = self.device(device)?;
                let memory = state.alloc(to_usize(len)?)?;
                if memory.is_empty() {
                    return Ok(DeviceBuffer::new(memory));
                }
                let node = self.gdr_node()?;
                let registration = self.gdr_register(&node, target, memory.allocation())?;
                let target = GdrTarget::new(registration, memory)
                    .map_err(|e| format!("cuda_gdr: {}", ErrorChain(&e)))?;
                let filled = node.read(&lent, target)?;
                Ok(DeviceBuffer::new(filled.into_memory()))
            }
            other => Err(format!("the CUDA runtime does not borrow over {other}")),
        }
    }
}

/// What the runtime keeps per opened device. Field order is drop order: mappings first,
/// then the staging buffers and events, the streams, the cached blocks, the device.
struct DeviceState {
    device: Device,
    mappings: Mutex<IpcMappings<DriverOpener>>,
    staging: Mutex<Vec<StagingBuffer>>,
    pinned: CachingAllocator<PinnedBacking>,
    events: Mutex<Vec<RawEvent>>,
    streams: Vec<Arc<CudaStream>>,
    next_stream: AtomicUsize,
    allocator: CachingAllocator<DeviceBacking>,
    chunk: usize,
    buffers: usize,
    gpu: Gpu,
}

impl std::fmt::Debug for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceState")
            .field("device", &self.device)
            .field("allocator", &self.allocator)
            .field("mappings", &*lock(&self.mappings))
            .field("streams", &self.streams.len())
            .finish_non_exhaustive()
    }
}

impl DeviceState {
    fn open(
        device: Device,
        ordinal: usize,
        options: &CudaOptions,
    ) -> Result<DeviceState, CudaChannelError> {
        let gpu = Gpu::open(ordinal)?;
        let streams = (0..options.streams_per_device.max(1))
            .map(|_| gpu.new_stream())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceState {
            device,
            mappings: Mutex::new(IpcMappings::new(
                DriverOpener { gpu: gpu.clone() },
                options.ipc_mappings_per_device,
                options.ipc_mapped_bytes_per_device,
            )),
            staging: Mutex::new(Vec::new()),
            pinned: CachingAllocator::new(
                format!("{device} (pinned host memory for cuda_basic)"),
                PinnedBacking { gpu: gpu.clone() },
                options.staged_out_cap_bytes,
            ),
            events: Mutex::new(Vec::new()),
            streams,
            next_stream: AtomicUsize::new(0),
            allocator: CachingAllocator::new(
                device.to_string(),
                DeviceBacking { gpu: gpu.clone() },
                options.cache_cap_bytes,
            ),
            chunk: options.staging_chunk_bytes.max(1),
            buffers: options.staging_buffers.max(1),
            gpu,
        })
    }

    /// The next of the device's streams.
    fn stream(&self) -> &Arc<CudaStream> {
        let index = self.next_stream.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        &self.streams[index]
    }

    /// `len` bytes from the device's cache (nothing for 0 bytes).
    fn alloc(&self, len: usize) -> Result<CudaMemory, String> {
        let storage = if len == 0 {
            Storage::Own(self.gpu.alloc(0).map_err(|e| ErrorChain(&e).to_string())?)
        } else {
            Storage::Cached(
                self.allocator
                    .allocate(len)
                    .map_err(|e| ErrorChain(&e).to_string())?,
            )
        };
        Ok(CudaMemory {
            device: self.device,
            len,
            storage,
        })
    }

    /// Runs `enqueue` on one of the device's streams, then waits for it with an event:
    /// only that stream's work up to here is waited for, never the whole device.
    fn on_stream_and_wait(
        &self,
        enqueue: impl FnOnce(&CudaStream) -> Result<(), CudaChannelError>,
    ) -> Result<(), CudaChannelError> {
        self.gpu.bind()?;
        let stream = self.stream();
        enqueue(stream)?;
        let event = match lock(&self.events).pop() {
            Some(event) => event,
            None => RawEvent::new(&self.gpu, false)?,
        };
        event.record(stream)?;
        let waited = event.synchronize();
        lock(&self.events).push(event);
        waited
    }

    /// Copies `src` (any device memory the driver can address: this device's, another
    /// device's, an opened IPC mapping, held by the caller until this returns) into `dst`
    /// (this device's, as long), and waits for the copy.
    fn copy_device(
        &self,
        dst: DeviceRange<'_>,
        src: DeviceSource<'_>,
    ) -> Result<(), CudaChannelError> {
        if src.is_empty() {
            return Ok(());
        }
        self.on_stream_and_wait(|stream| copy_unified_async(dst, src, stream))
    }

    /// `count` staging slots (made now if the pool has fewer idle).
    fn take_slots(&self, count: usize) -> Result<Vec<StagingBuffer>, CudaChannelError> {
        let mut slots: Vec<StagingBuffer> = {
            let mut idle = lock(&self.staging);
            let keep = idle.len().saturating_sub(count);
            idle.split_off(keep)
        };
        while slots.len() < count {
            slots.push(StagingBuffer::new(&self.gpu, self.chunk)?);
        }
        Ok(slots)
    }

    /// Puts slots back (their copies were waited for).
    fn give_back(&self, slots: Vec<StagingBuffer>) {
        lock(&self.staging).extend(slots);
    }

    /// Copies `src` (this device's) into host memory through the pinned slots: the
    /// device-to-host copy of chunk k+1 runs while the host copies chunk k out.
    fn stage_out(&self, src: DeviceRange<'_>) -> Result<Vec<u8>, CudaChannelError> {
        let plan = ChunkPlan::new(src.len(), self.chunk, self.buffers);
        let mut out = Vec::with_capacity(src.len());
        if plan.chunks() == 0 {
            return Ok(out);
        }
        let mut slots = self.take_slots(plan.buffers_used())?;
        let result = self.gpu.bind().and_then(|()| {
            let mut copies = DriverStaging {
                state: self,
                slots: &mut slots,
                device: src,
            };
            chunk_plan::stage_out(&plan, &mut copies, &mut out)
        });
        self.finish_slots(slots, &result);
        result.map(|()| out)
    }

    /// Copies `src` (this device's) into a pinned block of its own from the device's
    /// cache, for the CPU channel to read where it is; `None` when the block cannot be
    /// had (the cap, or no pinned memory left) or `src` is empty.
    fn stage_out_pinned(
        &self,
        src: DeviceRange<'_>,
    ) -> Result<Option<PinnedBytes>, CudaChannelError> {
        if src.is_empty() {
            return Ok(None);
        }
        let mut block = match self.pinned.allocate(src.len()) {
            Ok(block) => block,
            Err(e) => {
                tracing::debug!(
                    error = %ErrorChain(&e),
                    "cuda_basic stages this tensor through pageable memory"
                );
                return Ok(None);
            }
        };
        // The block's own event orders the wait: only this stream's work up to here.
        let copied = self.gpu.bind().and_then(|()| {
            let stream = self.stream();
            let staged = block.block_mut();
            staged.download(src.source(), stream)?;
            staged.wait()
        });
        match copied {
            Ok(()) => Ok(Some(PinnedBytes {
                block,
                len: src.len(),
            })),
            Err(e) => {
                // The copy may still be writing the block: never hand it out again.
                std::mem::forget(block);
                Err(e)
            }
        }
    }

    /// Copies `bytes` into `dst` (this device's, as long as `bytes`) through the pinned
    /// slots: the host copy of chunk k+1 runs while chunk k goes host to device.
    fn stage_in(&self, dst: DeviceRange<'_>, bytes: &[u8]) -> Result<(), CudaChannelError> {
        if dst.len() != bytes.len() {
            return Err(CudaChannelError::LengthMismatch {
                sent: bytes.len() as u64,
                expected: dst.len() as u64,
            });
        }
        let plan = ChunkPlan::new(bytes.len(), self.chunk, self.buffers);
        if plan.chunks() == 0 {
            return Ok(());
        }
        let mut slots = self.take_slots(plan.buffers_used())?;
        let result = self.gpu.bind().and_then(|()| {
            let mut copies = DriverStaging {
                state: self,
                slots: &mut slots,
                device: dst,
            };
            chunk_plan::stage_in(&plan, &mut copies, bytes)
        });
        self.finish_slots(slots, &result);
        result
    }

    /// After a staged copy: on success the slots are idle and go back to the pool; after
    /// an error a copy may still use one, so each is waited for first (and dropped if
    /// that fails too).
    fn finish_slots(&self, slots: Vec<StagingBuffer>, result: &Result<(), CudaChannelError>) {
        if result.is_ok() {
            self.give_back(slots);
            return;
        }
        let idle: Vec<StagingBuffer> = slots
            .into_iter()
            .filter_map(|mut slot| slot.wait().is_ok().then_some(slot))
            .collect();
        self.give_back(idle);
    }
}

/// A staged copy's driver side: pinned slots, the device range, asynchronous copies on
/// the device's streams, one event per slot (the slot's own).
struct DriverStaging<'a, 'r> {
    state: &'a DeviceState,
    slots: &'a mut [StagingBuffer],
    device: DeviceRange<'r>,
}

impl<'r> DriverStaging<'_, 'r> {
    /// The slot and the device range `[offset, offset + len)`, checked.
    fn place(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(&mut StagingBuffer, DeviceRange<'r>), CudaChannelError> {
        let range = self.device.slice(offset, len);
        let slot = self.slots.get_mut(buffer).filter(|slot| len <= slot.len());
        match (slot, range) {
            (Some(slot), Some(range)) => Ok((slot, range)),
            _ => Err(CudaChannelError::protocol(
                "cuda_basic staging plan",
                format!("{len} bytes at {offset} do not fit buffer {buffer} or the tensor"),
            )),
        }
    }
}

impl StagingCopies for DriverStaging<'_, '_> {
    type Error = CudaChannelError;

    fn start_to_host(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError> {
        let stream = self.state.stream();
        let (slot, src) = self.place(buffer, offset, len)?;
        // The tensor stays alive for the whole staged copy; the slot's bytes are fenced
        // by its event until the plan waited for it.
        slot.download(src.source(), stream)
    }

    fn start_to_device(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError> {
        let stream = self.state.stream();
        let (slot, dst) = self.place(buffer, offset, len)?;
        slot.upload(dst, stream)
    }

    fn wait(&mut self, buffer: usize) -> Result<(), CudaChannelError> {
        match self.slots.get_mut(buffer) {
            Some(slot) => slot.wait(),
            None => Err(CudaChannelError::protocol(
                "cuda_basic staging plan",
                format!("no buffer {buffer}"),
            )),
        }
    }

    fn buffer(&mut self, buffer: usize) -> &mut [u8] {
        self.slots
            .get_mut(buffer)
            .and_then(StagingBuffer::bytes_mut)
            .unwrap_or_default()
    }
}

/// A tensor staged out into a pinned block: the bytes the CPU channel reads. Dropping
/// it gives the block back to its device's cache.
struct PinnedBytes {
    block: CachedBlock<PinnedBacking>,
    len: usize,
}

impl StagedBytes for PinnedBytes {
    fn bytes(&self) -> &[u8] {
        // The block is at least `len` long (its size class); its copy was waited for.
        self.block
            .block()
            .bytes()
            .and_then(|bytes| bytes.get(..self.len))
            .unwrap_or_default()
    }
}

/// `cuMemHostAlloc` blocks for a device's cache of staged-out tensors.
struct PinnedBacking {
    gpu: Gpu,
}

impl BackingAllocator for PinnedBacking {
    type Block = StagingBuffer;
    type Error = CudaChannelError;

    fn allocate(&mut self, len: usize) -> Result<StagingBuffer, CudaChannelError> {
        StagingBuffer::new(&self.gpu, len)
    }
}

/// The copies of a chunked receive ([`DriverStageIn`]): the device's pinned slots, and
/// the fresh memory the tensor lands in.
struct OwnedStaging {
    state: Arc<DeviceState>,
    slots: Vec<StagingBuffer>,
    memory: CudaMemory,
}

impl OwnedStaging {
    fn driver(&mut self) -> DriverStaging<'_, '_> {
        DriverStaging {
            state: &self.state,
            slots: &mut self.slots,
            device: self.memory.range(),
        }
    }
}

impl StagingCopies for OwnedStaging {
    type Error = CudaChannelError;

    fn start_to_host(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError> {
        self.state.gpu.bind()?;
        self.driver().start_to_host(buffer, offset, len)
    }

    fn start_to_device(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError> {
        // The agent's pull runs on any thread: make the device's context current.
        self.state.gpu.bind()?;
        self.driver().start_to_device(buffer, offset, len)
    }

    fn wait(&mut self, buffer: usize) -> Result<(), CudaChannelError> {
        self.driver().wait(buffer)
    }

    fn buffer(&mut self, buffer: usize) -> &mut [u8] {
        self.slots
            .get_mut(buffer)
            .and_then(StagingBuffer::bytes_mut)
            .unwrap_or_default()
    }
}

/// A tensor received over `cuda_basic` chunk by chunk (`DeviceRuntime::receive_staged`):
/// each chunk's host-to-device copy starts as soon as the agent filled its pinned slot.
/// Dropped unfinished, it waits for the copies it started, gives the slots back and the
/// memory to the cache; a slot (or the memory) whose copy cannot be waited for is never
/// reused (leaked).
struct DriverStageIn {
    staging: Option<ChunkedStageIn<OwnedStaging>>,
    chunk: usize,
}

impl DriverStageIn {
    fn staging(&mut self) -> Result<&mut ChunkedStageIn<OwnedStaging>, String> {
        self.staging
            .as_mut()
            .ok_or_else(|| "this cuda_basic receive already finished".to_string())
    }
}

impl StagedReceive for DriverStageIn {
    fn chunk_len(&self) -> usize {
        self.chunk
    }

    fn chunk_buffer(&mut self, k: usize) -> Result<&mut [u8], String> {
        self.staging()?
            .chunk_buffer(k)
            .map_err(|e| ErrorChain(&e).to_string())
    }

    fn chunk_filled(&mut self, k: usize) -> Result<(), String> {
        self.staging()?
            .chunk_filled(k)
            .map_err(|e| ErrorChain(&e).to_string())
    }

    fn finish(mut self: Box<Self>) -> Result<DeviceBuffer, String> {
        // On an error, dropping `self` settles the copies.
        self.staging()?
            .finish()
            .map_err(|e| ErrorChain(&e).to_string())?;
        let Some(staging) = self.staging.take() else {
            return Err("this cuda_basic receive already finished".into());
        };
        let OwnedStaging {
            state,
            slots,
            memory,
        } = staging.into_copies();
        state.give_back(slots);
        Ok(DeviceBuffer::new(memory))
    }
}

impl Drop for DriverStageIn {
    fn drop(&mut self) {
        let Some(mut staging) = self.staging.take() else {
            return;
        };
        let idle = staging.settle();
        let OwnedStaging {
            state,
            slots,
            memory,
        } = staging.into_copies();
        let mut all_idle = true;
        let mut back = Vec::with_capacity(slots.len());
        for (slot, idle) in slots
            .into_iter()
            .zip(idle.into_iter().chain(std::iter::repeat(true)))
        {
            if idle {
                back.push(slot);
            } else {
                // A copy may still read it: never free or reuse it.
                all_idle = false;
                std::mem::forget(slot);
            }
        }
        state.give_back(back);
        if all_idle {
            drop(memory);
        } else {
            std::mem::forget(memory);
        }
    }
}

/// `cuMemAlloc` blocks for a device's caching allocator.
struct DeviceBacking {
    gpu: Gpu,
}

impl BackingAllocator for DeviceBacking {
    type Block = DeviceAllocation;
    type Error = CudaChannelError;

    fn allocate(&mut self, len: usize) -> Result<DeviceAllocation, CudaChannelError> {
        self.gpu.alloc(len)
    }
}

/// Opens `cuda_ipc` handles on one device.
struct DriverOpener {
    gpu: Gpu,
}

impl MappingOpener for DriverOpener {
    type Mapping = OpenedHandle;
    type Error = CudaChannelError;

    fn open(
        &mut self,
        handle: &[u8; IPC_HANDLE_LEN],
        _ordinal: usize,
    ) -> Result<OpenedHandle, CudaChannelError> {
        OpenedHandle::open(&self.gpu, handle)
    }

    fn mapped_len(mapping: &OpenedHandle) -> usize {
        mapping.len
    }
}

/// The ordinal of a CUDA device (`cuda` alone is device 0).
fn cuda_ordinal(device: Device) -> Result<usize, CudaChannelError> {
    if !device.is_cuda() {
        return Err(CudaChannelError::NotCuda {
            device: device.to_string(),
        });
    }
    Ok(usize::from(device.index().unwrap_or(0)))
}

/// As [`cuda_ordinal`], for the agent's string errors.
fn ordinal(device: Device) -> Result<usize, String> {
    cuda_ordinal(device).map_err(|e| e.to_string())
}

/// Checks that a `channel` descriptor lends as many bytes (`lent`) as the frame says
/// (`len`).
pub(crate) fn check_lent_length(channel: ChannelKind, lent: u64, len: u64) -> Result<(), String> {
    if lent == len {
        Ok(())
    } else {
        Err(format!(
            "the {channel} descriptor lends {lent} bytes, the frame says {len}"
        ))
    }
}

/// Memory a tensor lent: the runtime's own.
fn own(memory: &DeviceBuffer) -> Result<&CudaMemory, String> {
    memory.downcast_ref::<CudaMemory>().ok_or_else(|| {
        format!(
            "the {} tensor's memory was not made by rdzv_rdma's CUDA runtime (CudaMemory)",
            memory.device()
        )
    })
}

impl DeviceRuntime for CudaRuntime {
    fn device_count(&self) -> usize {
        self.count
    }

    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<HostBytes, String> {
        let memory = own(memory)?;
        let state = self.device(memory.device)?;
        let staged = match state.stage_out_pinned(memory.range()) {
            Ok(Some(pinned)) => Ok(HostBytes::staged(pinned)),
            Ok(None) => state.stage_out(memory.range()).map(HostBytes::from),
            Err(e) => Err(e),
        };
        staged.map_err(|e| ErrorChain(&e).to_string())
    }

    fn receive_staged(
        &self,
        device: Device,
        len: usize,
    ) -> Result<Option<Box<dyn StagedReceive>>, String> {
        let state = self.device(device)?;
        let memory = state.alloc(len)?;
        let plan = ChunkPlan::new(len, state.chunk, state.buffers);
        let slots = state
            .take_slots(plan.buffers_used())
            .map_err(|e| ErrorChain(&e).to_string())?;
        let chunk = state.chunk;
        Ok(Some(Box::new(DriverStageIn {
            staging: Some(ChunkedStageIn::new(
                plan,
                OwnedStaging {
                    state,
                    slots,
                    memory,
                },
            )),
            chunk,
        })))
    }

    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, String> {
        let state = self.device(device)?;
        let memory = state.alloc(bytes.len())?;
        state
            .stage_in(memory.range(), &bytes)
            .map_err(|e| ErrorChain(&e).to_string())?;
        Ok(DeviceBuffer::new(memory))
    }

    fn lending_channels(&self) -> Vec<(ChannelKind, Result<String, String>)> {
        vec![
            (ChannelKind::CudaXth, self.xth.clone()),
            (ChannelKind::CudaIpc, self.ipc.clone()),
            (ChannelKind::CudaGdr, self.gdr.clone()),
        ]
    }

    fn lend(&self, channel: ChannelKind, memory: &DeviceBuffer) -> Result<DeviceLoan, String> {
        let own = own(memory)?;
        let device = u32::from(own.device.index().unwrap_or(0));
        let length = own.len as u64;
        let descriptor = match channel {
            ChannelKind::CudaXth => CudaXthDescriptor {
                process: self.process()?,
                address: own.range().ptr(),
                length,
                device,
            }
            .encode()
            .to_vec(),
            ChannelKind::CudaIpc => CudaIpcDescriptor {
                process: self.process()?,
                handle: own
                    .allocation()
                    .ipc_handle()
                    .map_err(|e| ErrorChain(&e).to_string())?,
                offset: 0,
                length,
                device,
                base: own.allocation().range().ptr(),
            }
            .encode()
            .to_vec(),
            ChannelKind::CudaGdr => {
                let node = self.gdr_node()?;
                let address = own.range().ptr();
                let registration = if length == 0 {
                    None
                } else {
                    let ordinal = ordinal(own.device)?;
                    Some(self.gdr_register(&node, ordinal, own.allocation())?)
                };
                let rkey = registration.as_ref().map_or(0, |r| r.rkey());
                let descriptor = node.descriptor(self.process()?, address, rkey, length, device);
                // The registration goes before the memory (tuple fields drop in order);
                // both live until the peer answered.
                return Ok(DeviceLoan {
                    descriptor,
                    hold: Box::new((registration, memory.clone())),
                });
            }
            other => return Err(format!("the CUDA runtime does not lend over {other}")),
        };
        // The loan keeps the allocation: the peer reads it until it answers.
        Ok(DeviceLoan {
            descriptor,
            hold: Box::new(memory.clone()),
        })
    }

    fn borrow(
        &self,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, String> {
        self.borrow_from(None, channel, device, len, descriptor)
    }

    fn borrow_on(
        &self,
        pipe: PipeId,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, String> {
        self.borrow_from(Some(pipe), channel, device, len, descriptor)
    }

    fn pipe_ended(&self, pipe: PipeId) {
        let opened: Vec<Arc<DeviceState>> = lock(&self.devices).iter().flatten().cloned().collect();
        for state in opened {
            if state.gpu.bind().is_ok() {
                lock(&state.mappings).close_pipe(pipe.get());
            }
        }
    }
}

/// A peer's allocation mapped into this process by `cuIpcOpenMemHandle`, closed on drop.
struct OpenedHandle {
    mapping: IpcMapping,
    /// The mapped allocation's length.
    len: usize,
}

impl OpenedHandle {
    /// Opens `handle` on `gpu` and reads how much it maps.
    fn open(gpu: &Gpu, handle: &[u8; IPC_HANDLE_LEN]) -> Result<Self, CudaChannelError> {
        let mapping = IpcMapping::open(gpu, handle)?;
        if !mapping.starts_its_allocation() {
            return Err(CudaChannelError::protocol(
                "cuda_ipc descriptor",
                "its handle maps to the middle of an allocation",
            ));
        }
        let len = mapping.len();
        Ok(OpenedHandle { mapping, len })
    }

    /// `[offset, offset + len)` of the mapping, checked against what it maps: never
    /// trust the peer's geometry.
    fn holding(&self, offset: usize, len: usize) -> Result<DeviceSource<'_>, CudaChannelError> {
        self.mapping.source().slice(offset, len).ok_or_else(|| {
            CudaChannelError::protocol(
                "cuda_ipc descriptor",
                format!(
                    "it lends {len} bytes at offset {offset} of an allocation of {}",
                    self.len
                ),
            )
        })
    }
}

/// Where a [`CudaMemory`]'s bytes live.
#[derive(Debug)]
enum Storage {
    /// An allocation of its own.
    Own(DeviceAllocation),
    /// A block of the runtime's caching allocator, back to it on drop.
    Cached(CachedBlock<DeviceBacking>),
}

/// A CUDA tensor's memory: on one device, the start of a `cuMemAlloc` allocation (its
/// own, or a block of the runtime's cache). Wrap it in a `DeviceBuffer` to make a
/// tensor of it.
#[derive(Debug)]
pub struct CudaMemory {
    device: Device,
    len: usize,
    storage: Storage,
}

impl CudaMemory {
    /// `len` bytes of uninitialised memory on `device` (a CUDA device).
    ///
    /// # Errors
    /// No such device, no driver, or out of memory.
    pub fn alloc(device: Device, len: usize) -> Result<CudaMemory, CudaChannelError> {
        let gpu = Gpu::open(cuda_ordinal(device)?)?;
        Ok(CudaMemory {
            device,
            len,
            storage: Storage::Own(gpu.alloc(len)?),
        })
    }

    /// Memory on `device` holding a copy of `bytes`.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), or the copy failed.
    pub fn upload(device: Device, bytes: &[u8]) -> Result<CudaMemory, CudaChannelError> {
        let gpu = Gpu::open(cuda_ordinal(device)?)?;
        let mut allocation = gpu.alloc(bytes.len())?;
        allocation.copy_from_host(bytes)?;
        Ok(CudaMemory {
            device,
            len: bytes.len(),
            storage: Storage::Own(allocation),
        })
    }

    /// A host copy of the memory (a synchronous copy).
    ///
    /// # Errors
    /// The copy failed.
    pub fn to_host(&self) -> Result<Vec<u8>, CudaChannelError> {
        let mut bytes = vec![0u8; self.len];
        if self.len == 0 {
            return Ok(bytes);
        }
        self.allocation().copy_prefix_to_host(&mut bytes)?;
        Ok(bytes)
    }

    /// The allocation the memory starts (it may be longer than the tensor: a cached
    /// block is a whole size class).
    pub fn allocation(&self) -> &DeviceAllocation {
        match &self.storage {
            Storage::Own(allocation) => allocation,
            Storage::Cached(block) => block.block(),
        }
    }

    /// The tensor's bytes: the first `len` of the allocation.
    pub fn range(&self) -> DeviceRange<'_> {
        let whole = self.allocation().range();
        whole.slice(0, self.len).unwrap_or(whole)
    }
}

impl DeviceMemory for CudaMemory {
    fn device(&self) -> Device {
        self.device
    }

    fn len(&self) -> usize {
        self.len
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinals_are_cuda_only() {
        assert_eq!(ordinal(Device::cuda(3)), Ok(3));
        assert!(ordinal(Device::cpu()).is_err());
    }

    #[test]
    fn the_cache_cap_is_a_byte_count() {
        assert_eq!(
            CudaOptions::with_cache_cap(Some(" 1048576\n")).map(|o| o.cache_cap_bytes),
            Ok(1 << 20)
        );
        let err = CudaOptions::with_cache_cap(Some("lots")).expect_err("not a number");
        assert!(err.contains(ENV_CACHE_CAP) && err.contains("lots"), "{err}");
        assert_eq!(
            CudaOptions::with_cache_cap(None),
            Ok(CudaOptions::default())
        );
    }

    /// The runtime with small staging chunks on `cuda:0`, or `None` (with the reason
    /// printed) without CUDA; panics then when `RDZV_REQUIRE_CUDA=1`.
    fn gpu_runtime(test: &str) -> Option<CudaRuntime> {
        gpu_runtime_with(
            test,
            CudaOptions {
                staging_chunk_bytes: 64 << 10,
                staging_buffers: 2,
                ..CudaOptions::default()
            },
        )
    }

    fn gpu_runtime_with(test: &str, options: CudaOptions) -> Option<CudaRuntime> {
        match CudaRuntime::open_with(options) {
            Ok(runtime) => Some(runtime),
            Err(reason) => {
                assert!(
                    std::env::var("RDZV_REQUIRE_CUDA").as_deref() != Ok("1"),
                    "{test}: RDZV_REQUIRE_CUDA=1 but {reason}"
                );
                println!("SKIPPED {test}: {reason}");
                None
            }
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 11) as u8)
            .collect()
    }

    /// On a GPU: staged copies of more chunks than buffers come back byte for byte, and a
    /// dropped tensor's block serves the next one of its class.
    #[test]
    fn staged_copies_and_cached_blocks_on_a_gpu() {
        let Some(runtime) = gpu_runtime("staged_copies_and_cached_blocks_on_a_gpu") else {
            return;
        };
        let cuda0 = Device::cuda(0);
        for (seed, len) in [0usize, 1, 64 << 10, (64 << 10) + 1, (3 << 20) + 5]
            .into_iter()
            .enumerate()
        {
            let bytes = pattern(len, seed as u8);
            let memory = runtime
                .copy_from_host(cuda0, bytes.clone())
                .unwrap_or_else(|e| panic!("{len} bytes to the device: {e}"));
            assert_eq!(memory.len(), len);
            let back = runtime
                .copy_to_host(&memory)
                .unwrap_or_else(|e| panic!("{len} bytes back: {e}"));
            assert!(back == bytes, "{len} bytes came back different");
            let own = memory.downcast_ref::<CudaMemory>().expect("CudaMemory");
            assert!(own.to_host().is_ok_and(|b| b == bytes));
        }
        let state = runtime.device(cuda0).unwrap_or_else(|e| panic!("{e}"));
        drop(runtime.copy_from_host(cuda0, vec![1; 5 << 20]));
        let before = state.allocator.stats();
        for _ in 0..10 {
            drop(runtime.copy_from_host(cuda0, vec![2; 5 << 20]));
        }
        let after = state.allocator.stats();
        assert_eq!(
            after.backing_allocations, before.backing_allocations,
            "{after:?}"
        );
        assert_eq!(after.reuses, before.reuses + 10);
    }

    /// On a GPU: a chunked receive lands every byte; a staged-out tensor is a pinned
    /// block the channel reads in place, back in its cache when dropped (and reused);
    /// one over the cap is staged into a `Vec`; a receive abandoned midway gives its
    /// slots and memory back.
    #[test]
    fn pinned_staging_out_and_chunked_receives_on_a_gpu() {
        let test = "pinned_staging_out_and_chunked_receives_on_a_gpu";
        let Some(runtime) = gpu_runtime(test) else {
            return;
        };
        let cuda0 = Device::cuda(0);
        let state = runtime.device(cuda0).unwrap_or_else(|e| panic!("{e}"));
        for round in 0..2u8 {
            for (seed, len) in [1usize, 64 << 10, (64 << 10) + 1, (3 << 20) + 5]
                .into_iter()
                .enumerate()
            {
                let bytes = pattern(len, seed as u8 + round);
                let mut staging = runtime
                    .receive_staged(cuda0, len)
                    .unwrap_or_else(|e| panic!("{e}"))
                    .expect("the CUDA runtime receives in chunks");
                let chunk = staging.chunk_len();
                for k in 0..len.div_ceil(chunk) {
                    let buffer = staging
                        .chunk_buffer(k)
                        .unwrap_or_else(|e| panic!("{len} bytes, chunk {k}: {e}"));
                    let offset = k * chunk;
                    buffer.copy_from_slice(&bytes[offset..offset + buffer.len()]);
                    staging
                        .chunk_filled(k)
                        .unwrap_or_else(|e| panic!("{len} bytes, chunk {k}: {e}"));
                }
                let memory = staging.finish().unwrap_or_else(|e| panic!("{len}: {e}"));
                let own = memory.downcast_ref::<CudaMemory>().expect("CudaMemory");
                assert!(own.to_host().is_ok_and(|b| b == bytes), "{len} bytes in");
                let out = runtime
                    .copy_to_host(&memory)
                    .unwrap_or_else(|e| panic!("{len} bytes out: {e}"));
                assert!(out.is_staged(), "{len} bytes staged in pinned memory");
                assert!(out == bytes, "{len} bytes out");
                drop(out);
                assert_eq!(state.pinned.stats().in_use, 0);
            }
        }
        assert!(
            state.pinned.stats().reuses >= 4,
            "{:?}",
            state.pinned.stats()
        );

        // Abandoned after two chunks: the slots and the memory go back.
        let slots_before = lock(&state.staging).len();
        let in_use_before = state.allocator.stats().in_use;
        let mut staging = runtime
            .receive_staged(cuda0, 1 << 20)
            .unwrap_or_else(|e| panic!("{e}"))
            .expect("chunked");
        for k in 0..2 {
            let buffer = staging.chunk_buffer(k).unwrap_or_else(|e| panic!("{e}"));
            buffer.fill(k as u8);
            staging.chunk_filled(k).unwrap_or_else(|e| panic!("{e}"));
        }
        assert!(staging.chunk_buffer(5).is_err(), "out of order");
        drop(staging);
        assert!(lock(&state.staging).len() >= slots_before);
        assert_eq!(state.allocator.stats().in_use, in_use_before);

        // Over the pinned cap: staged through the slots into a Vec.
        let Some(capped) = gpu_runtime_with(
            test,
            CudaOptions {
                staged_out_cap_bytes: 1024,
                ..CudaOptions::default()
            },
        ) else {
            return;
        };
        let bytes = pattern(64 << 10, 9);
        let memory = capped
            .copy_from_host(cuda0, bytes.clone())
            .unwrap_or_else(|e| panic!("{e}"));
        let out = capped
            .copy_to_host(&memory)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!out.is_staged() && out == bytes);
    }

    /// On a GPU: a tensor lent over cuda_xth is copied device to device on the
    /// runtime's stream, and the copy is complete when `borrow` returns.
    #[test]
    fn xth_loans_are_copied_on_the_runtimes_stream() {
        let Some(runtime) = gpu_runtime("xth_loans_are_copied_on_the_runtimes_stream") else {
            return;
        };
        let cuda0 = Device::cuda(0);
        let bytes = pattern((8 << 20) + 3, 9);
        let lent =
            DeviceBuffer::new(CudaMemory::upload(cuda0, &bytes).unwrap_or_else(|e| panic!("{e}")));
        let loan = runtime
            .lend(ChannelKind::CudaXth, &lent)
            .unwrap_or_else(|e| panic!("{e}"));
        let copy = runtime
            .borrow(
                ChannelKind::CudaXth,
                cuda0,
                bytes.len() as u64,
                &loan.descriptor,
            )
            .unwrap_or_else(|e| panic!("{e}"));
        let own = copy.downcast_ref::<CudaMemory>().expect("CudaMemory");
        assert!(own.to_host().is_ok_and(|b| b == bytes));
        // A descriptor that lends another length is refused before any copy.
        let err = runtime
            .borrow(ChannelKind::CudaXth, cuda0, 5, &loan.descriptor)
            .expect_err("wrong length");
        assert!(err.contains("lends"), "{err}");
    }

    /// Without a driver (this crate's CI hosts) opening says why and never panics;
    /// with one, the runtime counts devices and offers the lending channels.
    #[test]
    fn opening_says_why_cuda_cannot_be_used() {
        match CudaPlugin.open() {
            Ok(runtime) => {
                assert!(runtime.device_count() > 0);
                let kinds: Vec<ChannelKind> = runtime
                    .lending_channels()
                    .into_iter()
                    .map(|(kind, _)| kind)
                    .collect();
                assert_eq!(
                    kinds,
                    [
                        ChannelKind::CudaXth,
                        ChannelKind::CudaIpc,
                        ChannelKind::CudaGdr
                    ]
                );
            }
            Err(reason) => {
                eprintln!("CUDA is not usable here: {reason}");
                assert!(reason.contains("CUDA is not viable"), "{reason}");
            }
        }
    }
}
