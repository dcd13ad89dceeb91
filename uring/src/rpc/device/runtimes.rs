//! The opened runtimes of one worker ([`Devices`]): what the agent asks of them per
//! tensor, and staging a received tensor chunk by chunk ([`StagingIn`]).

use std::fmt;
use std::sync::Arc;

use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::ChannelKind;

use super::LentBytes;
use super::{
    ChannelUnavailable, DeviceBuffer, DeviceError, DeviceErrorSource, DeviceLoan, DeviceOp,
    DevicePlugin, DeviceRuntime, HostBytes, PipeId, StagedReceive, TensorMemoryError,
    UnavailableReason,
};
use crate::rpc::error::DevicesError;

/// The domain descriptor of `cuda_basic`: staging runs wherever the CPU channels do.
pub(crate) const CUDA_BASIC_DESCRIPTOR: &str = "cuda_basic:staged";

/// The opened runtimes of one worker.
#[derive(Clone, Default)]
pub(crate) struct Devices {
    cuda: Option<Arc<dyn DeviceRuntime>>,
    /// Why the CUDA plugin did not open, when one was given and failed.
    cuda_refused: Option<Arc<DeviceError>>,
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
    ///
    /// # Errors
    /// [`DevicesError`] for a plugin of a device type that cannot be plugged in.
    pub(crate) fn open(plugins: &[Arc<dyn DevicePlugin>]) -> Result<Devices, DevicesError> {
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
                    Err(e) => {
                        let reason = e.report();
                        tracing::info!(%reason, "CUDA is not usable; cuda_basic serves CPU memory only");
                        devices.cuda_refused = Some(Arc::new(e));
                    }
                },
                DeviceType::Cpu => return Err(DevicesError::BuiltIn),
                other => return Err(DevicesError::NotPluggable { kind: other }),
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
    pub(crate) fn lending_descriptor(
        &self,
        kind: ChannelKind,
    ) -> Result<String, ChannelUnavailable> {
        let Some(runtime) = self.cuda.as_ref() else {
            return Err(match &self.cuda_refused {
                Some(refused) => {
                    ChannelUnavailable::new(kind, UnavailableReason::NoRuntime, Arc::clone(refused))
                }
                None => ChannelUnavailable::bare(kind, UnavailableReason::NoRuntime),
            });
        };
        runtime
            .lending_channels()
            .into_iter()
            .find(|(offered, _)| *offered == kind)
            .map_or_else(
                || Err(ChannelUnavailable::bare(kind, UnavailableReason::NotRun)),
                |(_, descriptor)| descriptor,
            )
    }

    /// Lends a `device` tensor's `memory` over `channel`.
    pub(crate) fn lend(
        &self,
        channel: ChannelKind,
        device: Device,
        memory: Option<&DeviceBuffer>,
    ) -> Result<DeviceLoan, DeviceError> {
        let failed = |why: String| {
            DeviceError::new(DeviceOp::Lend, why)
                .on(device)
                .over(channel)
        };
        let memory = checked_memory(device, memory)
            .map_err(|e| DeviceError::new(DeviceOp::Lend, e).on(device).over(channel))?;
        let runtime = self.runtime(device.kind()).ok_or_else(|| {
            failed(format!(
                "this worker has no {} runtime (RpcOptions::device_plugins)",
                device.kind()
            ))
        })?;
        let loan = runtime
            .lend(channel, memory)
            .map_err(|e| e.located(device, Some(channel)))?;
        if loan.descriptor.len() > usize::from(u8::MAX) {
            return Err(failed(format!(
                "the {} runtime made a {}-byte {channel} descriptor; a frame carries at most 255",
                device.kind(),
                loan.descriptor.len()
            )));
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
    ) -> Result<DeviceBuffer, DeviceError> {
        let failed = |why: String| {
            DeviceError::new(DeviceOp::Borrow, why)
                .on(device)
                .over(channel)
        };
        let runtime = self
            .runtime(device.kind())
            .ok_or_else(|| failed(no_runtime(device)))?;
        let memory = runtime
            .borrow_on(pipe, channel, device, len, descriptor)
            .map_err(|e| e.located(device, Some(channel)))?;
        check_made(device, len, &memory).map_err(|e| {
            DeviceError::new(DeviceOp::Borrow, e)
                .on(device)
                .over(channel)
        })?;
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
    ) -> Result<HostBytes, DeviceError> {
        let failed = |why: String| {
            DeviceError::new(DeviceOp::CopyToHost, why)
                .on(device)
                .over(ChannelKind::CudaBasic)
        };
        if device.is_cpu() {
            return match memory {
                None => Ok(data.into()),
                // Bytes lent by their owner (`Tensor::lent`): read where they are.
                Some(memory) => match memory.downcast_ref::<LentBytes>() {
                    Some(lent) => Ok(lent.host_bytes()),
                    None => Err(failed(format!(
                        "a {device} tensor holds device memory; give CPU tensors their \
                         bytes in `data` (or lend them: `Tensor::lent`)"
                    ))),
                },
            };
        }
        let kind = device.kind();
        let memory = checked_memory(device, memory).map_err(|e| {
            DeviceError::new(DeviceOp::CopyToHost, e)
                .on(device)
                .over(ChannelKind::CudaBasic)
        })?;
        let runtime = self.runtime(kind).ok_or_else(|| {
            failed(format!(
                "this worker has no {kind} runtime (RpcOptions::device_plugins)"
            ))
        })?;
        let bytes = runtime
            .copy_to_host(memory)
            .map_err(|e| e.located(device, Some(ChannelKind::CudaBasic)))?;
        if bytes.len() != memory.len() {
            return Err(failed(format!(
                "the {kind} runtime copied {} bytes of a {}-byte tensor to the host",
                bytes.len(),
                memory.len()
            )));
        }
        Ok(bytes)
    }

    /// Where a received `len`-byte tensor for `device` (not the CPU) is pulled into:
    /// the runtime's chunks when it stages in chunks, else one host buffer handed to it
    /// whole at the end.
    pub(crate) fn receive_into(
        &self,
        device: Device,
        len: usize,
    ) -> Result<StagingIn, DeviceError> {
        let kind = device.kind();
        let runtime = self
            .runtime(kind)
            .ok_or_else(|| staging_failed(device, no_runtime(device)))?;
        let chunked = runtime
            .receive_staged(device, len)
            .map_err(|e| e.located(device, Some(ChannelKind::CudaBasic)))?;
        let target = match chunked {
            Some(chunked) if chunked.chunk_len() > 0 => Target::Chunked(chunked),
            Some(_) => {
                return Err(staging_failed(
                    device,
                    format!("the {kind} runtime stages in chunks of 0 bytes"),
                ))
            }
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
    ) -> Result<(Vec<u8>, Option<DeviceBuffer>), DeviceError> {
        let kind = device.kind();
        if kind == DeviceType::Cpu {
            return Ok((bytes, None));
        }
        let failed = |why: String| {
            DeviceError::new(DeviceOp::CopyFromHost, why)
                .on(device)
                .over(ChannelKind::CudaBasic)
        };
        let runtime = self
            .runtime(kind)
            .ok_or_else(|| failed(no_runtime(device)))?;
        let len = bytes.len() as u64;
        let memory = runtime
            .copy_from_host(device, bytes)
            .map_err(|e| e.located(device, Some(ChannelKind::CudaBasic)))?;
        check_made(device, len, &memory).map_err(|e| {
            DeviceError::new(DeviceOp::CopyFromHost, e)
                .on(device)
                .over(ChannelKind::CudaBasic)
        })?;
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
    pub(crate) fn chunk_buffer(&mut self, k: usize) -> Result<&mut [u8], DeviceError> {
        let device = self.device;
        let Some(&(_, _, expected)) = self.chunks().get(k) else {
            return Err(staging_failed(
                device,
                format!("no chunk {k} in a {}-byte tensor", self.len),
            ));
        };
        let buffer = match &mut self.target {
            Target::Chunked(chunked) => chunked
                .chunk_buffer(k)
                .map_err(|e| e.located(device, Some(ChannelKind::CudaBasic)))?,
            Target::Whole { bytes, .. } => {
                *bytes = crate::rpc::recycle::try_take(self.len)
                    .map_err(|e| DeviceError::new(DeviceOp::ReceiveStaged, e).on(device))?;
                crate::channel::buffer::prefer_huge_pages(bytes);
                bytes.as_mut_slice()
            }
        };
        if buffer.len() != expected {
            return Err(staging_failed(
                device,
                format!(
                    "the {} runtime gave a {}-byte buffer for chunk {k} of {expected} bytes",
                    device.kind(),
                    buffer.len()
                ),
            ));
        }
        Ok(buffer)
    }

    /// Chunk `k` is filled.
    pub(crate) fn chunk_filled(&mut self, k: usize) -> Result<(), DeviceError> {
        let device = self.device;
        match &mut self.target {
            Target::Chunked(chunked) => chunked
                .chunk_filled(k)
                .map_err(|e| e.located(device, Some(ChannelKind::CudaBasic))),
            Target::Whole { .. } => Ok(()),
        }
    }

    /// Every chunk is filled: the device memory, checked to be what was asked for.
    pub(crate) fn finish(self) -> Result<DeviceBuffer, DeviceError> {
        let StagingIn {
            target,
            device,
            len,
        } = self;
        let memory = match target {
            Target::Chunked(chunked) => chunked.finish(),
            Target::Whole { runtime, bytes } => {
                let bytes = if len == 0 { Vec::new() } else { bytes };
                runtime.copy_from_host(device, bytes)
            }
        }
        .map_err(|e| e.located(device, Some(ChannelKind::CudaBasic)))?;
        check_made(device, len as u64, &memory).map_err(|why| staging_failed(device, why))?;
        Ok(memory)
    }
}

/// Why there is nothing to receive on `device` with.
fn no_runtime(device: Device) -> String {
    format!(
        "this worker has no {} runtime to receive on {device} (RpcOptions::device_plugins)",
        device.kind()
    )
}

/// A chunk-by-chunk receive onto `device` failed, for `why`.
fn staging_failed(device: Device, why: impl Into<DeviceErrorSource>) -> DeviceError {
    DeviceError::new(DeviceOp::ReceiveStaged, why)
        .on(device)
        .over(ChannelKind::CudaBasic)
}

/// Checks that a runtime made `len` bytes on `device`: a runtime's bug otherwise.
pub(super) fn check_made(
    device: Device,
    len: u64,
    memory: &DeviceBuffer,
) -> Result<(), TensorMemoryError> {
    if memory.device() == device && memory.len() as u64 == len {
        return Ok(());
    }
    Err(TensorMemoryError::Made {
        device,
        len,
        made: memory.len(),
        made_on: memory.device(),
    })
}

/// A device tensor's memory, which it must hold, on the device it names.
fn checked_memory(
    device: Device,
    memory: Option<&DeviceBuffer>,
) -> Result<&DeviceBuffer, TensorMemoryError> {
    let memory = memory.ok_or(TensorMemoryError::Missing { device })?;
    if memory.device() != device {
        return Err(TensorMemoryError::OtherDevice {
            device,
            memory: memory.device(),
        });
    }
    Ok(memory)
}
