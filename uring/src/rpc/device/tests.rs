//! The runtimes' seam with a fake runtime that keeps "device" memory on the host.

use std::sync::Arc;

use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::ChannelKind;

use super::*;

struct HostRuntime {
    short_copy: bool,
}

impl HostRuntime {
    fn bytes(memory: &DeviceBuffer, op: DeviceOp) -> Result<Vec<u8>, DeviceError> {
        let memory = memory
            .downcast_ref::<HostMemory>()
            .ok_or_else(|| DeviceError::new(op, "foreign memory"))?;
        Ok(memory.bytes().to_vec())
    }
}

impl DeviceRuntime for HostRuntime {
    fn lending_channels(&self) -> Vec<(ChannelKind, Result<String, ChannelUnavailable>)> {
        vec![
            (ChannelKind::CudaIpc, Ok("cuda_ipc:here".into())),
            (
                ChannelKind::CudaXth,
                Err(ChannelUnavailable::new(
                    ChannelKind::CudaXth,
                    UnavailableReason::NotViable,
                    "not in this test",
                )),
            ),
        ]
    }
    /// The descriptor is the bytes themselves (a short copy when `short_copy`).
    fn lend(&self, _: ChannelKind, memory: &DeviceBuffer) -> Result<DeviceLoan, DeviceError> {
        Ok(DeviceLoan {
            descriptor: Self::bytes(memory, DeviceOp::Lend)?,
            hold: Box::new(memory.clone()),
        })
    }
    fn borrow(
        &self,
        _: ChannelKind,
        device: Device,
        _: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, DeviceError> {
        let mut bytes = descriptor.to_vec();
        if self.short_copy {
            bytes.pop();
        }
        self.copy_from_host(device, bytes)
    }
    fn device_count(&self) -> usize {
        2
    }
    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<HostBytes, DeviceError> {
        let mut bytes = Self::bytes(memory, DeviceOp::CopyToHost)?;
        if self.short_copy {
            bytes.pop();
        }
        Ok(bytes.into())
    }
    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, DeviceError> {
        if device.index().unwrap_or(0) >= 2 {
            return Err(DeviceError::new(
                DeviceOp::CopyFromHost,
                format!("no {device}"),
            ));
        }
        Ok(DeviceBuffer::new(HostMemory::new(device, bytes)))
    }
}

struct Plugin(DeviceType, Result<bool, &'static str>);

impl DevicePlugin for Plugin {
    fn device_type(&self) -> DeviceType {
        self.0
    }
    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, DeviceError> {
        match self.1 {
            Ok(short_copy) => Ok(Arc::new(HostRuntime { short_copy })),
            Err(reason) => Err(DeviceError::new(DeviceOp::Open, reason)),
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
    assert_eq!(err, crate::rpc::error::DevicesError::BuiltIn);
    // init_rpc's error names the option and keeps the refusal as its source.
    let init = crate::rpc::InitError::DevicePlugins(err);
    assert!(init.is_configuration() && !init.is_retryable());
    assert_eq!(
        init.to_string(),
        "invalid RPC option device_plugins: the CPU is built in and cannot be plugged in"
    );
    assert!(std::error::Error::source(&init).is_some());
    assert!(!devices(Plugin(DeviceType::Cuda, Err("no driver"))).has_cuda());
    assert!(devices(Plugin(DeviceType::Cuda, Ok(false))).has_cuda());
}

#[test]
fn lending_is_checked_on_both_sides() {
    let devices = devices(Plugin(DeviceType::Cuda, Ok(false)));
    assert_eq!(
        devices
            .lending_descriptor(ChannelKind::CudaIpc)
            .ok()
            .as_deref(),
        Some("cuda_ipc:here")
    );
    let err = devices
        .lending_descriptor(ChannelKind::CudaXth)
        .expect_err("refused");
    assert_eq!(err.reason(), UnavailableReason::NotViable);
    assert_eq!(err.to_string(), "not in this test");
    let err = devices
        .lending_descriptor(ChannelKind::CudaGdr)
        .expect_err("not run");
    assert_eq!(err.reason(), UnavailableReason::NotRun);
    assert!(err.to_string().contains("does not run cuda_gdr"), "{err}");
    let err = Devices::default()
        .lending_descriptor(ChannelKind::CudaIpc)
        .expect_err("no runtime");
    assert_eq!(err.reason(), UnavailableReason::NoRuntime);
    assert!(err.to_string().contains("device_plugins"), "{err}");
    // A plugin that failed to open is the cause of the channels it leaves out.
    let unusable: Arc<dyn DevicePlugin> = Arc::new(Plugin(DeviceType::Cuda, Err("no driver")));
    let err = Devices::open(&[unusable])
        .unwrap_or_else(|e| panic!("{e}"))
        .lending_descriptor(ChannelKind::CudaIpc)
        .expect_err("no runtime");
    assert_eq!(err.reason(), UnavailableReason::NoRuntime);
    assert!(
        err.to_string()
            .ends_with("and none opened: cannot open the device runtime: no driver"),
        "{err}"
    );
    assert!(std::error::Error::source(&err).is_some());

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
        .expect_err("other device")
        .report();
    assert!(err.contains("its memory is on cuda:0"), "{err}");
    let err = devices
        .lend(ChannelKind::CudaIpc, cuda(0), None)
        .expect_err("no memory");
    // The check is a typed source a caller can match on.
    let why = std::error::Error::source(&err).and_then(|e| e.downcast_ref::<TensorMemoryError>());
    assert_eq!(why, Some(&TensorMemoryError::Missing { device: cuda(0) }));
    let err = err.report();
    assert!(err.contains("Tensor::on_device"), "{err}");
    // A descriptor a frame cannot carry is refused.
    let big = DeviceBuffer::new(HostMemory::new(cuda(0), vec![0; 256]));
    let err = devices
        .lend(ChannelKind::CudaIpc, cuda(0), Some(&big))
        .expect_err("too long")
        .report();
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
        .expect_err("short")
        .report();
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
    assert_eq!(out.ok(), Some(vec![1, 2, 3].into()));
    // CPU tensors pass through.
    assert_eq!(
        devices.stage_in(Device::cpu(), vec![4]).ok(),
        Some((vec![4], None))
    );
    assert_eq!(
        devices.stage_out(Device::cpu(), vec![5], None).ok(),
        Some(vec![5].into())
    );
    // Wrong shapes are refused with what to do.
    let err = devices
        .stage_out(cuda(0), vec![1], None)
        .expect_err("no memory")
        .report();
    assert!(err.contains("Tensor::on_device"), "{err}");
    let err = devices
        .stage_out(cuda(0), Vec::new(), Some(&memory))
        .expect_err("memory on another device")
        .report();
    assert!(err.contains("its memory is on cuda:1"), "{err}");
    let err = devices
        .stage_out(Device::cpu(), Vec::new(), Some(&memory))
        .expect_err("cpu with memory")
        .report();
    assert!(err.contains("holds device memory"), "{err}");
    let err = devices
        .stage_in(cuda(5), vec![1])
        .expect_err("no cuda:5")
        .report();
    // The runtime's reason, after what failed and where (the agent filled both in).
    assert_eq!(
        err,
        "cannot put a received tensor on the device on cuda:5 over cuda_basic: no cuda:5"
    );

    let short = self::devices(Plugin(DeviceType::Cuda, Ok(true)));
    let err = short
        .stage_out(cuda(1), Vec::new(), Some(&memory))
        .expect_err("short copy")
        .report();
    assert!(err.contains("copied 2 bytes of a 3-byte tensor"), "{err}");

    let none = Devices::default();
    let err = none
        .stage_in(cuda(0), vec![1])
        .expect_err("no runtime")
        .report();
    assert!(err.contains("no cuda runtime"), "{err}");
    let err = none
        .stage_out(cuda(1), Vec::new(), Some(&memory))
        .expect_err("no runtime")
        .report();
    assert!(err.contains("device_plugins"), "{err}");
}
