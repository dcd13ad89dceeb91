//! The CUDA runtime of the RPC agent: [`CudaPlugin`], handed to
//! `rdzv_uring::rpc::RpcOptions::device_plugins`, and [`CudaMemory`], the device memory
//! of CUDA tensors (`rdzv_uring::rpc::Tensor::on_device(DeviceBuffer::new(memory))`).
//!
//! The agent asks the runtime for three things (`rdzv_uring::rpc::device`):
//!
//! - `cuda_xth` (same process): a tensor is lent by its device address, and the receiver
//!   copies it device to device (`cuMemcpyAsync` over unified addressing, so across GPUs
//!   too). Completion crosses the two agents through the process's loan table
//!   ([`xth::loans`], `xth`): the lender records a fence after the memory's ready
//!   event, the receiver's stream waits on it (no host wait for the producer), copies and
//!   records an event of its own, which the lender waits for before it lets go of the
//!   memory;
//! - `cuda_ipc` (another process of this host): a tensor is lent through the CUDA IPC
//!   memory handle of its allocation (`cuIpcGetMemHandle`, made once per allocation and
//!   cached with it) and the allocation's base address. The receiver keeps what it opened
//!   (`cuIpcOpenMemHandle`, with lazy peer access) per pipe, lending process, device and
//!   base, for the pipe's life, bounded ([`ipc::mappings`]): another handle at a
//!   known base means the address was reused, and the stale mapping is closed first.
//!   Completion crosses the two processes as a CUDA IPC event ([`super::loan_events`],
//!   `ipc`): the lender records a pooled interprocess event after the memory's ready
//!   event and sends its handle; the receiver's stream waits on it (no host wait for the
//!   producer), copies, and records it again; the lender holds the memory until the
//!   receiver answered (the agent's lending rule), then waits for that record before it
//!   lets go of the memory and reuses the event;
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
//!   chunk is pulled ([`basic::chunk_plan::ChunkedStageIn`]). Carried by `mpt`, whose
//!   lanes read their stripes at once, each piece of a stripe is read into a pinned slot
//!   and copied to its place on the device as soon as its lane read it, in any order
//!   (`DeviceRuntime::receive_parts`, `parts`); bytes that arrived whole (inline) are
//!   staged in chunks ([`basic::chunk_plan`]): the device copy of one chunk runs while
//!   the host copies the previous one.
//!
//! **When a received tensor is ready.** Every copy runs on the runtime's own streams
//! (a few per device) and is waited for with an event recorded after it, never with a
//! device-wide synchronisation; the runtime hands a tensor to the agent only after that
//! wait. So a received tensor's memory is complete when the agent hands it to a handler,
//! or when `rpc_sync` (or the future's wait) returns it; no stream of the caller's needs
//! to wait for anything. A sender hands the agent memory whose producing work is
//! complete, or says where it completes with [`CudaMemory::record_ready`] (the memory's
//! ready event, recorded on the producer's stream): `cuda_ipc` and `cuda_xth` then order
//! the peer's copy after it on the GPU, and the other channels wait for that one event.
//! With [`CudaOptions::pending_hand_over`], a tensor received over `cuda_ipc` or
//! `cuda_xth` is handed over at once, its copy still running, with the copy's event as
//! its ready event: async users ask `Tensor::is_ready` or block in `Tensor::wait_ready`
//! (`cuEventQuery` on that event, through `DeviceMemory`), or order a stream of theirs
//! after it without blocking ([`CudaMemory::wait_ready_on`]). Reading the bytes without
//! either races with the copy.
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
//! blocks) is released when the agent drops it at shutdown; a pipe's mappings and opened
//! events when the pipe ends (`DeviceRuntime::pipe_ended`).
//!
//! The files: this one (the runtime and its `DeviceRuntime` side), `options` (options
//! and plugins), `device` (what every channel shares per device, composing each
//! channel's own state), then one module per channel with all of it: `xth`, `ipc`
//! (with its mappings cache and `state`), `gdr` (node, registrations, `GdrState`),
//! `basic` (with its `chunk_plan` and `state`) and `parts` (`cuda_basic` over `mpt`);
//! `tensor_memory` ([`CudaMemory`]). Every `DeviceRuntime` call fails with the seam's
//! `DeviceError`, whose source is this crate's [`CudaChannelError`] (with the driver's
//! `DriverCode`) where the driver failed.
//!
//! Opening the runtime never panics when the driver is absent: [`CudaPlugin`] probes
//! first ([`super::probe`]) and reports why CUDA cannot be used, and the agent then
//! serves CUDA pairs with nothing (a CPU-only worker still offers `cuda_basic` for its
//! CPU side).

pub(crate) mod basic;
mod device;
mod driver;
pub mod gdr;
pub(crate) mod ipc;
mod options;
mod parts;
mod tensor_memory;
pub(crate) mod xth;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rdzv_core::channel::cuda::{CudaIpcDescriptor, CudaXthDescriptor};
use rdzv_core::channel::ProcessIdentity;
use rdzv_core::device::Device;
use rdzv_core::negotiate::ChannelKind;
use rdzv_uring::channel::current_identity;
use rdzv_uring::rpc::{
    ChannelUnavailable, DeviceBuffer, DeviceError, DeviceErrorSource, DeviceLoan, DeviceMemory,
    DeviceOp, DeviceRuntime, HostBytes, PartedReceive, PipeId, StagedReceive, UnavailableReason,
};

use super::descriptor::HostIdentity;
use super::error::CudaChannelError;
use super::viability::{self, ChannelVerdict, CudaChannel, LendingRefused};

use crate::error_chain::ErrorChain;

use device::DeviceState;
use gdr::GdrState;
pub use options::{
    ConfiguredCudaPlugin, CudaOpenError, CudaOptions, CudaOptionsError, CudaPlugin, ENV_CACHE_CAP,
    ENV_PENDING_HAND_OVER,
};
pub use tensor_memory::CudaMemory;

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
    xth: Result<String, LendingRefused>,
    ipc: Result<String, LendingRefused>,
    /// `cuda_gdr`'s offer, node and registrars.
    gdr: GdrState,
}

/// Why a step of the runtime failed: a typed error of this crate (a
/// [`CudaChannelError`], whose chain names the driver call, its `CUresult` and what to
/// do), or a text; it becomes the source of the seam's `DeviceError`.
type Cause = DeviceErrorSource;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CudaRuntime {
    /// Probes CUDA and the channels' prerequisites, with the default options.
    ///
    /// # Errors
    /// Why CUDA cannot be used here (no driver library, `cuInit` failed, no device).
    pub fn open() -> Result<CudaRuntime, CudaOpenError> {
        Self::open_with(CudaOptions::default())
    }

    /// As [`open`](Self::open), with `options`.
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub fn open_with(options: CudaOptions) -> Result<CudaRuntime, CudaOpenError> {
        let report = viability::probe();
        let cuda = match report.facts.cuda {
            super::CudaViability::Viable(ref cuda) => cuda,
            super::CudaViability::NotViable(reason) => {
                return Err(CudaOpenError::NotViable(reason))
            }
        };
        let count = cuda.devices.len();
        let process = current_identity().map_err(|e| ErrorChain(&e).to_string());
        let host = HostIdentity::current().map_err(|e| format!("cannot identify this host: {e}"));
        let channel = |channel: CudaChannel, descriptor: fn(&HostIdentity) -> String| match report
            .verdict(channel)
        {
            Some(ChannelVerdict::NotViable(reason)) => Err(LendingRefused::NotViable {
                channel,
                reason: reason.clone(),
            }),
            _ => match (&host, &process) {
                (Ok(host), Ok(_)) => Ok(descriptor(host)),
                (Err(e), _) | (_, Err(e)) => Err(LendingRefused::Unidentified {
                    channel,
                    reason: e.clone(),
                }),
            },
        };
        let gdr = GdrState::new(
            report.verdict(CudaChannel::Gdr),
            process.as_ref().map(|_| ()).map_err(String::as_str),
            cuda.peer_memory,
            count,
        );
        Ok(CudaRuntime {
            options,
            count,
            devices: Mutex::new((0..count).map(|_| None).collect()),
            xth: channel(CudaChannel::Xth, HostIdentity::xth_descriptor),
            ipc: channel(CudaChannel::Ipc, HostIdentity::ipc_descriptor),
            gdr,
            process,
        })
    }

    /// The opened device `device` (opened now if it is the first use).
    fn device(&self, device: Device) -> Result<Arc<DeviceState>, Cause> {
        let ordinal = cuda_ordinal(device)?;
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
        let state = Arc::new(DeviceState::open(device, ordinal, &self.options)?);
        *slot = Some(Arc::clone(&state));
        Ok(state)
    }

    fn process(&self) -> Result<ProcessIdentity, Cause> {
        self.process.clone().map_err(Cause::from)
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
    ) -> Result<DeviceBuffer, Cause> {
        let me = self.process()?;
        let target = cuda_ordinal(device)?;
        let to_usize =
            |len: u64| usize::try_from(len).map_err(|_| format!("{len} bytes do not fit here"));
        match channel {
            ChannelKind::CudaXth => {
                let lent = CudaXthDescriptor::decode(descriptor)?;
                check_lent_length("cuda_xth descriptor", lent.length, len)?;
                if lent.process != me {
                    return Err(format!(
                        "the memory was lent by pid {}, not by this process (pid {}): \
                         cuda_xth works within one process",
                        lent.process.pid, me.pid
                    )
                    .into());
                }
                let state = self.device(device)?;
                let memory = state.alloc(to_usize(len)?)?;
                if !memory.is_empty() {
                    xth::borrow(&state, &lent, &memory)?;
                }
                Ok(DeviceBuffer::new(memory))
            }
            ChannelKind::CudaIpc => {
                let lent = CudaIpcDescriptor::decode(descriptor)?;
                check_lent_length("cuda_ipc descriptor", lent.length, len)?;
                if let Some(what) = me.mismatch(&lent.process) {
                    return Err(format!(
                        "the memory was lent by pid {} under another {what}: cuda_ipc works \
                         between processes of one host",
                        lent.process.pid
                    )
                    .into());
                }
                let state = self.device(device)?;
                let memory = state.alloc(to_usize(len)?)?;
                if memory.is_empty() {
                    return Ok(DeviceBuffer::new(memory));
                }
                let how = ipc::Borrowing {
                    pipe,
                    lent: &lent,
                    offset: to_usize(lent.offset)?,
                    target,
                };
                ipc::borrow(&state, how, &memory)?;
                Ok(DeviceBuffer::new(memory))
            }
            ChannelKind::CudaGdr => {
                gdr::borrow(&self.gdr, &*self.device(device)?, target, len, descriptor)
            }
            other => Err(format!("the CUDA runtime does not borrow over {other}").into()),
        }
    }

    /// Lends `memory` over `channel` (the seam's `lend`).
    fn lend_memory(
        &self,
        channel: ChannelKind,
        memory: &DeviceBuffer,
    ) -> Result<DeviceLoan, Cause> {
        let own = own(memory)?;
        // Ordered after the producer on the GPU, through the loan's event (cuda_ipc) or
        // fence (cuda_xth).
        match channel {
            ChannelKind::CudaIpc => {
                let state = self.device(own.device)?;
                return Ok(ipc::lend(&state, self.process()?, memory, own)?);
            }
            ChannelKind::CudaXth => {
                let state = self.device(own.device)?;
                return Ok(xth::lend(&state, self.process()?, memory, own)?);
            }
            _ => {}
        }
        // The peer's NIC (cuda_gdr) reads it once this returns.
        own.wait_ready()?;
        match channel {
            ChannelKind::CudaGdr => gdr::lend(&self.gdr, self.process()?, memory, own),
            other => Err(format!("the CUDA runtime does not lend over {other}").into()),
        }
    }

    /// The seam's error for `operation` on `device` (over `channel`), because of `cause`.
    fn failed(
        operation: DeviceOp,
        device: Device,
        channel: Option<ChannelKind>,
    ) -> impl FnOnce(Cause) -> DeviceError {
        move |cause| {
            let error = DeviceError::new(operation, cause).on(device);
            match channel {
                Some(channel) => error.over(channel),
                None => error,
            }
        }
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

/// Checks that a descriptor (`what`: `cuda_xth descriptor`, ...) lends as many bytes
/// (`lent`) as the frame says (`len`).
fn check_lent_length(what: &'static str, lent: u64, len: u64) -> Result<(), CudaChannelError> {
    if lent == len {
        Ok(())
    } else {
        Err(CudaChannelError::protocol(
            what,
            format!("it lends {lent} bytes, the frame says {len}"),
        ))
    }
}

/// Memory a tensor lent: the runtime's own.
fn own(memory: &DeviceBuffer) -> Result<&CudaMemory, Cause> {
    memory.downcast_ref::<CudaMemory>().ok_or_else(|| {
        format!(
            "the {} tensor's memory was not made by rdzv_rdma's CUDA runtime (CudaMemory)",
            memory.device()
        )
        .into()
    })
}

impl DeviceRuntime for CudaRuntime {
    fn device_count(&self) -> usize {
        self.count
    }

    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<HostBytes, DeviceError> {
        let failed = || Self::failed(DeviceOp::CopyToHost, memory.device(), None);
        let own = own(memory).map_err(failed())?;
        let state = self.device(own.device).map_err(failed())?;
        state.copy_to_host(own).map_err(|e| failed()(e.into()))
    }

    fn receive_staged(
        &self,
        device: Device,
        len: usize,
    ) -> Result<Option<Box<dyn StagedReceive>>, DeviceError> {
        self.device(device)
            .and_then(|state| state.receive_staged(len))
            .map(Some)
            .map_err(Self::failed(DeviceOp::ReceiveStaged, device, None))
    }

    fn receive_parts(
        &self,
        device: Device,
        len: usize,
    ) -> Result<Option<Box<dyn PartedReceive>>, DeviceError> {
        self.device(device)
            .and_then(|state| state.receive_parts(len))
            .map(Some)
            .map_err(Self::failed(DeviceOp::ReceiveStaged, device, None))
    }

    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, DeviceError> {
        self.device(device)
            .and_then(|state| state.copy_from_host(&bytes))
            .map_err(Self::failed(DeviceOp::CopyFromHost, device, None))
    }

    fn lending_channels(&self) -> Vec<(ChannelKind, Result<String, ChannelUnavailable>)> {
        let offer = |kind: ChannelKind, descriptor: &Result<String, LendingRefused>| {
            let descriptor = descriptor.clone().map_err(|refused| {
                ChannelUnavailable::new(kind, UnavailableReason::NotViable, refused)
            });
            (kind, descriptor)
        };
        vec![
            offer(ChannelKind::CudaXth, &self.xth),
            offer(ChannelKind::CudaIpc, &self.ipc),
            offer(ChannelKind::CudaGdr, &self.gdr.offer),
        ]
    }

    fn lend(&self, channel: ChannelKind, memory: &DeviceBuffer) -> Result<DeviceLoan, DeviceError> {
        self.lend_memory(channel, memory).map_err(Self::failed(
            DeviceOp::Lend,
            memory.device(),
            Some(channel),
        ))
    }

    fn borrow(
        &self,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, DeviceError> {
        self.borrow_from(None, channel, device, len, descriptor)
            .map_err(Self::failed(DeviceOp::Borrow, device, Some(channel)))
    }

    fn borrow_on(
        &self,
        pipe: PipeId,
        channel: ChannelKind,
        device: Device,
        len: u64,
        descriptor: &[u8],
    ) -> Result<DeviceBuffer, DeviceError> {
        self.borrow_from(Some(pipe), channel, device, len, descriptor)
            .map_err(Self::failed(DeviceOp::Borrow, device, Some(channel)))
    }

    fn pipe_ended(&self, pipe: PipeId) {
        let opened: Vec<Arc<DeviceState>> = lock(&self.devices).iter().flatten().cloned().collect();
        for state in opened {
            if state.gpu.bind().is_ok() {
                lock(&state.ipc.opened_events).close_pipe(pipe.get());
                lock(&state.ipc.mappings).close_pipe(pipe.get());
            }
        }
    }
}

#[cfg(test)]
mod tests;
