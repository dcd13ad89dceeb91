//! The CUDA runtime of the RPC agent: [`CudaPlugin`], handed to
//! `rdzv_uring::rpc::RpcOptions::device_plugins`, and [`CudaMemory`], the device memory
//! of CUDA tensors (`rdzv_uring::rpc::Tensor::on_device(DeviceBuffer::new(memory))`).
//!
//! The agent asks the runtime for three things (`rdzv_uring::rpc::device`):
//!
//! - `cuda_xth` (same process): a tensor is lent by its device address, and the receiver
//!   copies it device to device (`cuMemcpy` over unified addressing, so across GPUs
//!   too);
//! - `cuda_ipc` (another process of this host): a tensor is lent through a CUDA IPC
//!   memory handle of its allocation (`cuIpcGetMemHandle`); the receiver opens it
//!   (`cuIpcOpenMemHandle`, with lazy peer access), copies device to device into fresh
//!   memory on its target device and closes it again. The sender holds the memory until
//!   the receiver answered (the agent's lending rule), so no event handle is needed;
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
//! - `cuda_basic`: synchronous copies to and from host memory.
//!
//! Every copy is synchronous: the receiving side's memory is complete when the agent
//! hands the tensor to its handler or caller. A sender must hand the agent memory whose
//! producing work is complete (synchronise the stream that wrote it first), as with
//! any synchronous `cuMemcpy`. Device memory comes from `cuMemAlloc` (not the
//! stream-ordered pool), which CUDA IPC requires.
//!
//! Opening the runtime never panics when the driver is absent: [`CudaPlugin`] probes
//! first ([`super::probe`]) and reports why CUDA cannot be used, and the agent then
//! serves CUDA pairs with nothing (a CPU-only worker still offers `cuda_basic` for its
//! CPU side).

use std::any::Any;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys;
use rdzv_core::channel::cuda::{CudaIpcDescriptor, CudaXthDescriptor, IPC_HANDLE_LEN};
use rdzv_core::channel::ProcessIdentity;
use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::ChannelKind;
use rdzv_uring::channel::current_identity;
use rdzv_uring::rpc::{DeviceBuffer, DeviceLoan, DeviceMemory, DevicePlugin, DeviceRuntime};

use super::channel_error::CudaChannelError;
use super::descriptor::HostIdentity;
use super::gdr::{GdrPath, GdrRegistrar, GdrRegistration};
use super::gdr_lending::{self, GdrNode, GdrTarget};
use super::memory::{DeviceAllocation, Gpu};
use super::viability::{self, ChannelVerdict, CudaChannel};
use super::PeerMemory;
use crate::ibv::IbvViability;
use crate::report::ErrorChain;

/// The CUDA device plugin of the RPC agent.
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaPlugin;

impl DevicePlugin for CudaPlugin {
    fn device_type(&self) -> DeviceType {
        DeviceType::Cuda
    }

    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, String> {
        CudaRuntime::open().map(|runtime| Arc::new(runtime) as Arc<dyn DeviceRuntime>)
    }
}

/// An opened CUDA runtime: the devices, opened on first use, and what the lending
/// channels need to know about this process.
#[derive(Debug)]
pub struct CudaRuntime {
    count: usize,
    gpus: Mutex<Vec<Option<Gpu>>>,
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

impl CudaRuntime {
    /// Probes CUDA and the channels' prerequisites.
    ///
    /// # Errors
    /// Why CUDA cannot be used here (no driver library, `cuInit` failed, no device).
    pub fn open() -> Result<CudaRuntime, String> {
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
            count,
            gpus: Mutex::new(vec![None; count]),
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
    fn gpu(&self, device: Device) -> Result<Gpu, String> {
        let ordinal = ordinal(device)?;
        let mut gpus = self.gpus.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = gpus.get_mut(ordinal).ok_or_else(|| {
            format!(
                "this process has no {device}: it sees {} CUDA device(s)",
                self.count
            )
        })?;
        if let Some(gpu) = slot {
            return Ok(gpu.clone());
        }
        let gpu = Gpu::open(ordinal).map_err(|e| ErrorChain(&e).to_string())?;
        *slot = Some(gpu.clone());
        Ok(gpu)
    }

    fn process(&self) -> Result<ProcessIdentity, String> {
        self.process.clone()
    }

    /// The GDR node, started now if this is the first use; only when `cuda_gdr` is
    /// offered.
    fn gdr_node(&self) -> Result<Arc<GdrNode>, String> {
        self.gdr.as_ref().map_err(Clone::clone)?;
        let mut node = self.gdr_node.lock().unwrap_or_else(PoisonError::into_inner);
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
        let mut registrars = self
            .registrars
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
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

    /// Fresh memory on `device`, filled by `fill(destination address)` (a synchronous
    /// device copy), with the device's context current.
    fn copy_into_new(
        &self,
        device: Device,
        len: u64,
        fill: impl FnOnce(sys::CUdeviceptr, usize) -> Result<(), CudaChannelError>,
    ) -> Result<DeviceBuffer, String> {
        let len = usize::try_from(len).map_err(|_| format!("{len} bytes do not fit here"))?;
        let gpu = self.gpu(device)?;
        let allocation = gpu.alloc(len).map_err(|e| ErrorChain(&e).to_string())?;
        if len > 0 {
            gpu.bind().map_err(|e| ErrorChain(&e).to_string())?;
            fill(allocation.range().ptr(), len).map_err(|e| ErrorChain(&e).to_string())?;
        }
        Ok(DeviceBuffer::new(CudaMemory { device, allocation }))
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

/// Synchronous device-to-device copy of `len` bytes, then a wait for the copy: the
/// current context must be the destination's.
fn copy_and_wait(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
    ordinal: usize,
) -> Result<(), CudaChannelError> {
    // SAFETY: `dst` is a live allocation of at least `len` bytes in the current
    // context; `src` is mapped for `len` bytes (an opened IPC handle, or a lent
    // allocation of this process kept alive by its loan). Unified addressing lets the
    // driver find both devices.
    unsafe { sys::cuMemcpy(dst, src, len) }
        .result()
        .map_err(CudaChannelError::driver("cuMemcpy", ordinal))?;
    // SAFETY: no arguments; waits for the current context's work, the copy included.
    unsafe { sys::cuCtxSynchronize() }
        .result()
        .map_err(CudaChannelError::driver("cuCtxSynchronize", ordinal))
}

impl DeviceRuntime for CudaRuntime {
    fn device_count(&self) -> usize {
        self.count
    }

    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<Vec<u8>, String> {
        own(memory)?
            .to_host()
            .map_err(|e| ErrorChain(&e).to_string())
    }

    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, String> {
        let gpu = self.gpu(device)?;
        let memory =
            CudaMemory::upload_on(&gpu, device, &bytes).map_err(|e| ErrorChain(&e).to_string())?;
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
        let length = own.allocation.len() as u64;
        let descriptor = match channel {
            ChannelKind::CudaXth => CudaXthDescriptor {
                process: self.process()?,
                address: own.allocation.range().ptr(),
                length,
                device,
            }
            .encode()
            .to_vec(),
            ChannelKind::CudaIpc => CudaIpcDescriptor {
                process: self.process()?,
                handle: own.ipc_handle().map_err(|e| ErrorChain(&e).to_string())?,
                offset: 0,
                length,
                device,
                base: own.allocation.range().ptr(),
            }
            .encode()
            .to_vec(),
            ChannelKind::CudaGdr => {
                let node = self.gdr_node()?;
                let address = own.allocation.range().ptr();
                let registration = if length == 0 {
                    None
                } else {
                    let ordinal = ordinal(own.device)?;
                    Some(self.gdr_register(&node, ordinal, &own.allocation)?)
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
        let me = self.process()?;
        let target = ordinal(device)?;
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
                self.copy_into_new(device, len, |dst, len| {
                    copy_and_wait(dst, lent.address, len, target)
                })
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
                let offset = usize::try_from(lent.offset)
                    .map_err(|_| format!("offset {} does not fit here", lent.offset))?;
                self.copy_into_new(device, len, |dst, len| {
                    let opened = OpenedHandle::open(&lent.handle, target)?;
                    opened.check_holds(offset, len)?;
                    copy_and_wait(dst, opened.base + offset as u64, len, target)
                })
            }
            ChannelKind::CudaGdr => {
                let lent = gdr_lending::check_descriptor(descriptor, len)?;
                let len =
                    usize::try_from(len).map_err(|_| format!("{len} bytes do not fit here"))?;
                let gpu = self.gpu(device)?;
                let allocation = gpu.alloc(len).map_err(|e| ErrorChain(&e).to_string())?;
                let memory = CudaMemory { device, allocation };
                if len == 0 {
                    return Ok(DeviceBuffer::new(memory));
                }
                let node = self.gdr_node()?;
                let registration = self.gdr_register(&node, target, &memory.allocation)?;
                let filled = node.read(&lent, GdrTarget::new(registration, memory))?;
                Ok(DeviceBuffer::new(filled.into_memory()))
            }
            other => Err(format!("the CUDA runtime does not borrow over {other}")),
        }
    }
}

/// A peer's allocation mapped into this process by `cuIpcOpenMemHandle`, closed on drop.
struct OpenedHandle {
    base: sys::CUdeviceptr,
    ordinal: usize,
}

impl OpenedHandle {
    /// Opens `handle` in the current context (the target device's).
    fn open(handle: &[u8; IPC_HANDLE_LEN], ordinal: usize) -> Result<Self, CudaChannelError> {
        let base = super::ipc::open_mem_handle(handle, ordinal)?;
        Ok(OpenedHandle { base, ordinal })
    }

    /// Checks that the mapping holds `[offset, offset + len)`: never trust the peer's
    /// geometry.
    fn check_holds(&self, offset: usize, len: usize) -> Result<(), CudaChannelError> {
        let mut mapped_base: sys::CUdeviceptr = 0;
        let mut mapped_len: usize = 0;
        // SAFETY: `base` is a live mapping; the driver writes into two live locals.
        unsafe { sys::cuMemGetAddressRange_v2(&mut mapped_base, &mut mapped_len, self.base) }
            .result()
            .map_err(CudaChannelError::driver(
                "cuMemGetAddressRange",
                self.ordinal,
            ))?;
        let fits = offset
            .checked_add(len)
            .is_some_and(|end| self.base == mapped_base && end <= mapped_len);
        if fits {
            Ok(())
        } else {
            Err(CudaChannelError::Protocol {
                what: "cuda_ipc descriptor",
                detail: format!(
                    "it lends {len} bytes at offset {offset} of an allocation of {mapped_len}"
                ),
            })
        }
    }
}

impl Drop for OpenedHandle {
    fn drop(&mut self) {
        // SAFETY: `base` came from `cuIpcOpenMemHandle` and is closed once; every copy
        // out of it was waited for.
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
    }
}

/// A CUDA tensor's memory: one `cuMemAlloc` allocation on one device. Wrap it in a
/// `DeviceBuffer` to make a tensor of it.
#[derive(Debug)]
pub struct CudaMemory {
    device: Device,
    allocation: DeviceAllocation,
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
            allocation: gpu.alloc(len)?,
        })
    }

    /// Memory on `device` holding a copy of `bytes`.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), or the copy failed.
    pub fn upload(device: Device, bytes: &[u8]) -> Result<CudaMemory, CudaChannelError> {
        let gpu = Gpu::open(cuda_ordinal(device)?)?;
        Self::upload_on(&gpu, device, bytes)
    }

    fn upload_on(gpu: &Gpu, device: Device, bytes: &[u8]) -> Result<CudaMemory, CudaChannelError> {
        let mut allocation = gpu.alloc(bytes.len())?;
        allocation.copy_from_host(bytes)?;
        Ok(CudaMemory { device, allocation })
    }

    /// A host copy of the memory.
    ///
    /// # Errors
    /// The copy failed.
    pub fn to_host(&self) -> Result<Vec<u8>, CudaChannelError> {
        let mut bytes = vec![0u8; self.allocation.len()];
        self.allocation.copy_to_host(&mut bytes)?;
        Ok(bytes)
    }

    /// The allocation (its device address range, for kernels and copies).
    pub fn allocation(&self) -> &DeviceAllocation {
        &self.allocation
    }

    /// The allocation's CUDA IPC memory handle.
    fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_LEN], CudaChannelError> {
        let gpu = self.allocation.gpu();
        gpu.bind()?;
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_LEN],
        };
        // SAFETY: the allocation is a live `cuMemAlloc` pointer of the current context;
        // the driver writes one handle into a live local.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, self.allocation.range().ptr()) }
            .result()
            .map_err(CudaChannelError::driver("cuIpcGetMemHandle", gpu.ordinal()))?;
        Ok(handle.reserved.map(|c| c as u8))
    }
}

impl DeviceMemory for CudaMemory {
    fn device(&self) -> Device {
        self.device
    }

    fn len(&self) -> usize {
        self.allocation.len()
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
