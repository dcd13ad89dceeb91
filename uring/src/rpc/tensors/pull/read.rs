//! One tensor's bytes read from the peer ([`Pull`]): into host memory in parallel
//! slices when large ([`read_in_slices`]), or chunk by chunk into a device runtime's
//! staging ([`pull_staged`]); a lender's release during the read fails the call with
//! its pipe.

use rdzv_core::device::Device;
use rdzv_core::negotiate::ChannelKind;

use crate::channel::buffer::prefer_huge_pages;
use crate::rpc::device::{DeviceError, Devices, StagingIn};
use crate::rpc::error::{CallError, ChannelCause, ChannelFailure, PipeFailure};
use crate::rpc::message::Tensor;
use crate::rpc::recycle;

/// Out-of-band tensors of at least this size are read by several threads at once, each
/// a slice of at least [`PARALLEL_SLICE_MIN`] bytes: a fresh destination buffer is
/// faulted in and filled in parallel (a fresh, huge-page-hinted 64 MiB buffer read over
/// cma on this project's 2-vCPU VM, best of 5: 17.6 ms with one thread, 10.3 ms with
/// two).
pub(in crate::rpc::tensors) const PARALLEL_PULL_MIN: usize = 8 << 20;
/// The smallest slice one pulling thread reads.
const PARALLEL_SLICE_MIN: usize = 4 << 20;
/// The most threads one tensor's pull uses.
const PARALLEL_PULL_THREADS: usize = 4;

/// Fills `dst` with `read(offset, slice)` calls: for large buffers several slices at
/// once, the last on the calling thread and the others on scoped threads. The first
/// error wins.
pub(in crate::rpc::tensors) fn read_in_slices(
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

/// One tensor read from the peer over `channel` (cma or xth), into host memory or, for a
/// device, chunk by chunk into its runtime's staging.
pub(super) struct Pull<'a> {
    pub(super) devices: &'a Devices,
    pub(super) channel: ChannelKind,
    pub(super) index: usize,
    pub(super) peer: &'a str,
}

impl Pull<'_> {
    /// Reads `length` bytes for `device` with `read(offset, part)`, whose error says
    /// whether the lender no longer holds the buffer (cma: its pages are unmapped,
    /// `EFAULT`; xth: the transfer is gone). A lender releases what it lent only after
    /// the ack, or when its pipe ends, so such a read overlapped the end of the pipe on
    /// the lender's side (a reset, a shutdown): the call fails with the pipe
    /// ([`CallError::PipeBroken`], retryable), not the channel.
    pub(super) fn read(
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
                reason: PipeFailure::protocol(ReleasedWhileRead {
                    peer: self.peer.to_string(),
                    read: error,
                }),
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

/// The peer released a tensor it lent while this side read it: its end of the pipe
/// ended or was reset, so the read's own failure is a consequence.
#[derive(Debug, thiserror::Error)]
#[error(
    "{peer} released a tensor it lent while it was read, which it does only when its end \
     of the pipe ends or is reset ({read})"
)]
struct ReleasedWhileRead {
    peer: String,
    #[source]
    read: CallError,
}
