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
//!   ([`DeviceRuntime::copy_to_host`]), the bytes travel like a CPU tensor's over the CPU
//!   channel the pipe negotiated (inline, `cma`, `xth` or `mpt`), and the receiver's
//!   runtime copies them into fresh memory on the target device
//!   ([`DeviceRuntime::copy_from_host`]). So `cuda_basic` runs over every transport and
//!   gains from every CPU channel. Every worker offers it for CPU memory (the CPU side of
//!   a CPU ↔ CUDA pair needs no GPU), and a worker with a CUDA runtime also for CUDA
//!   memory.
//!
//! `rdzv_rdma::cuda::agent::CudaPlugin` is the CUDA runtime (cudarc, loaded at run time).
//! A test can plug in a runtime that keeps "device" memory on the host: the agent cannot
//! tell, which is how its part is tested on machines without a GPU.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::ChannelKind;

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

    /// Copies `memory` into host memory (`cuda_basic`'s sending side).
    ///
    /// # Errors
    /// Why the copy failed; the call fails with it.
    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<Vec<u8>, String>;

    /// Memory on `device` holding `bytes` (`cuda_basic`'s receiving side).
    ///
    /// # Errors
    /// Why it cannot be allocated or filled (no such device, out of memory, ...).
    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, String>;

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
    pub fn open(plugins: &[Arc<dyn DevicePlugin>]) -> Result<Devices, String> {
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
    pub fn runtime(&self, kind: DeviceType) -> Option<&Arc<dyn DeviceRuntime>> {
        match kind {
            DeviceType::Cuda => self.cuda.as_ref(),
            _ => None,
        }
    }

    /// Whether this worker has a CUDA runtime.
    pub fn has_cuda(&self) -> bool {
        self.cuda.is_some()
    }

    /// The domain descriptor of the lending channel `kind` (`cuda_xth`, `cuda_ipc`,
    /// `cuda_gdr`), or why this worker cannot offer it.
    pub fn lending_descriptor(&self, kind: ChannelKind) -> Result<String, String> {
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
    pub fn lend(
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
    pub fn borrow(
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
    pub fn pipe_ended(&self, pipe: PipeId) {
        if let Some(runtime) = &self.cuda {
            runtime.pipe_ended(pipe);
        }
    }

    /// The host bytes of a tensor that leaves on `cuda_basic`: a CPU tensor's own, a
    /// device tensor's copied by its runtime.
    pub fn stage_out(
        &self,
        device: Device,
        data: Vec<u8>,
        memory: Option<&DeviceBuffer>,
    ) -> Result<Vec<u8>, String> {
        if device.is_cpu() {
            return match memory {
                None => Ok(data),
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

    /// A received tensor's bytes put on `device`: kept as they are for the CPU, copied
    /// by the runtime otherwise. Returns the host bytes (empty for a device tensor) and
    /// the device memory.
    pub fn stage_in(
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
        fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<Vec<u8>, String> {
            let memory = memory
                .downcast_ref::<HostMemory>()
                .ok_or("foreign memory")?;
            let mut bytes = memory.bytes().to_vec();
            if self.short_copy {
                bytes.pop();
            }
            Ok(bytes)
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
        assert!(crate::rpc::channels::lends_device_memory(
            ChannelKind::CudaGdr
        ));
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
        assert_eq!(out, Ok(vec![1, 2, 3]));
        // CPU tensors pass through.
        assert_eq!(
            devices.stage_in(Device::cpu(), vec![4]),
            Ok((vec![4], None))
        );
        assert_eq!(devices.stage_out(Device::cpu(), vec![5], None), Ok(vec![5]));
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
