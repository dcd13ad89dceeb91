//! Tensors in device memory (CUDA), and the seam through which a device runtime built
//! outside this crate plugs into the agent: [`DevicePlugin`].
//!
//! This crate knows no GPU. A tensor on a device other than the CPU holds a
//! [`DeviceBuffer`], a shared handle to memory the runtime owns ([`DeviceMemory`]), and
//! the agent moves it with the `cuda_basic` channel: the sender's runtime copies it to
//! host memory ([`DeviceRuntime::copy_to_host`]), the bytes travel like a CPU tensor's over
//! the CPU channel the pipe negotiated (inline, `cma`, `xth` or `mpt`), and the
//! receiver's runtime copies them into fresh memory on the target device
//! ([`DeviceRuntime::copy_from_host`]), which the device map chose. So `cuda_basic` runs over
//! every transport and gains from every CPU channel.
//!
//! `rdzv_rdma::cuda::agent::CudaPlugin` is the CUDA runtime (cudarc, loaded at run time).
//! A test can plug in a runtime that keeps "device" memory on the host: the agent cannot
//! tell, which is how its part is tested on machines without a GPU.
//!
//! Negotiation: every worker offers `cuda_basic` for CPU memory (the CPU side of a CPU ↔
//! CUDA pair needs no GPU), and a worker with a CUDA runtime also for CUDA memory. The
//! other CUDA channels (`cuda_ipc`, `cuda_xth`, `cuda_gdr`) are not run by the agent.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use rdzv_core::device::{Device, DeviceType};

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

/// What the agent asks of an opened device runtime. Both calls block (they are
/// synchronous copies) and may run on any thread.
pub trait DeviceRuntime: Send + Sync {
    /// How many devices of its type this process sees.
    fn device_count(&self) -> usize;

    /// Copies `memory` into host memory.
    ///
    /// # Errors
    /// Why the copy failed; the call fails with it.
    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<Vec<u8>, String>;

    /// Memory on `device` holding `bytes` (a received tensor).
    ///
    /// # Errors
    /// Why it cannot be allocated or filled (no such device, out of memory, ...).
    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, String>;
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

    /// The host bytes of a tensor that leaves on `cuda_basic`: a CPU tensor's own, a
    /// device tensor's copied by its runtime.
    pub fn stage_out(
        &self,
        device: Device,
        data: Vec<u8>,
        memory: Option<&DeviceBuffer>,
    ) -> Result<Vec<u8>, String> {
        match (device.kind(), memory) {
            (DeviceType::Cpu, None) => Ok(data),
            (DeviceType::Cpu, Some(_)) => Err(format!(
                "a {device} tensor holds device memory; give CPU tensors their bytes in `data`"
            )),
            (kind, None) => Err(format!(
                "the {device} tensor holds no device memory (a {kind} tensor is made with \
                 Tensor::on_device)"
            )),
            (kind, Some(memory)) => {
                if memory.device() != device {
                    return Err(format!(
                        "the tensor says {device}, but its memory is on {}",
                        memory.device()
                    ));
                }
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
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Debug)]
    struct HostMemory {
        device: Device,
        bytes: Mutex<Vec<u8>>,
    }

    impl DeviceMemory for HostMemory {
        fn device(&self) -> Device {
            self.device
        }
        fn len(&self) -> usize {
            self.bytes.lock().map_or(0, |b| b.len())
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    struct HostRuntime {
        short_copy: bool,
    }

    impl DeviceRuntime for HostRuntime {
        fn device_count(&self) -> usize {
            2
        }
        fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<Vec<u8>, String> {
            let memory = memory
                .downcast_ref::<HostMemory>()
                .ok_or("foreign memory")?;
            let mut bytes = memory.bytes.lock().map_err(|e| e.to_string())?.clone();
            if self.short_copy {
                bytes.pop();
            }
            Ok(bytes)
        }
        fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, String> {
            if device.index().unwrap_or(0) >= 2 {
                return Err(format!("no {device}"));
            }
            Ok(DeviceBuffer::new(HostMemory {
                device,
                bytes: Mutex::new(bytes),
            }))
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
