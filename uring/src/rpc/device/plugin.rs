//! The seam for device runtimes: [`DevicePlugin`] opens a [`DeviceRuntime`], which lends,
//! borrows and stages device memory. Every call fails with a [`DeviceError`].

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use rdzv_core::device::{Device, DeviceType};
use rdzv_core::negotiate::ChannelKind;

#[cfg(doc)]
use super::DeviceMemory;
use super::{ChannelUnavailable, DeviceBuffer, DeviceError, DeviceOp, HostBytes};

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
    fn chunk_buffer(&mut self, k: usize) -> Result<&mut [u8], DeviceError>;

    /// Chunk `k`'s buffer is filled: its copy to the device may start.
    ///
    /// # Errors
    /// A chunk out of order, or why the copy could not be started.
    fn chunk_filled(&mut self, k: usize) -> Result<(), DeviceError>;

    /// Every chunk was filled: waits for the last copies and returns the memory.
    ///
    /// # Errors
    /// Chunks left unfilled, or why a copy failed.
    fn finish(self: Box<Self>) -> Result<DeviceBuffer, DeviceError>;
}

/// A tensor received into device memory in parts that arrive in any order and from
/// several threads at once (`cuda_basic` carried by `mpt`, whose stripes are read by one
/// thread per lane), made by [`DeviceRuntime::receive_parts`].
///
/// A reading thread asks for a buffer for the part it is about to read
/// ([`part`](Self::part): `len` bytes at `offset`, never crossing a multiple of
/// [`part_len`](Self::part_len), so a part lies within one chunk), reads into it and
/// hands it back ([`part_filled`](Self::part_filled)): the runtime starts that part's
/// copy to the device at once, to its place in the tensor, and hands the buffer out again
/// only once that copy is done (so `part` may wait). Parts never overlap, and together
/// cover the tensor once. Dropping it before [`finish`](Self::finish) abandons the
/// tensor: the runtime waits for the copies it started and takes its buffers back.
pub trait PartedReceive: Send + Sync {
    /// The longest part (at least 1): a staging buffer's length.
    fn part_len(&self) -> usize;

    /// A buffer for the `len` bytes at `offset` of the tensor, exactly `len` long, for
    /// the caller to fill; waits until one is free.
    ///
    /// # Errors
    /// A part out of bounds or crossing a chunk, or why no buffer can be had.
    fn part(&self, offset: usize, len: usize) -> Result<Box<dyn PartBuffer>, DeviceError>;

    /// `part` is filled: its copy to the device may start.
    ///
    /// # Errors
    /// Why the copy could not be started.
    fn part_filled(&self, part: Box<dyn PartBuffer>) -> Result<(), DeviceError>;

    /// Every part was filled: waits for the last copies and returns the memory.
    ///
    /// # Errors
    /// Bytes left unfilled, or why a copy failed.
    fn finish(self: Box<Self>) -> Result<DeviceBuffer, DeviceError>;
}

/// A device runtime's host buffer that one part of a tensor is read into
/// ([`PartedReceive::part`]).
pub trait PartBuffer: Send {
    /// The part's bytes, to fill.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Itself, for the runtime that made it to take back
    /// ([`PartedReceive::part_filled`]).
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

/// A device runtime built outside this crate, handed to the agent in
/// `RpcOptions::device_plugins`.
pub trait DevicePlugin: Send + Sync {
    /// The device type it serves (only [`DeviceType::Cuda`] is accepted).
    fn device_type(&self) -> DeviceType;

    /// Opens the runtime: once per `init_rpc`.
    ///
    /// # Errors
    /// Why the devices cannot be used in this process (no driver, no device, ...;
    /// [`DeviceOp::Open`]): the agent logs it and offers `cuda_basic` for CPU memory only.
    fn open(&self) -> Result<Arc<dyn DeviceRuntime>, DeviceError>;
}

/// What the agent asks of an opened device runtime. Every call blocks until its work is
/// started, may run on any thread, and fails with a [`DeviceError`] (the operation, the
/// device, the channel, and the runtime's own error as the source). Memory it returns is
/// complete, unless it says otherwise through [`DeviceMemory::is_ready`]
/// (a pending hand-over: its copy still running).
pub trait DeviceRuntime: Send + Sync {
    /// How many devices of its type this process sees.
    fn device_count(&self) -> usize;

    /// Copies `memory` into host memory (`cuda_basic`'s sending side): a `Vec`, or the
    /// runtime's own memory ([`HostBytes::staged`]), which the CPU channel reads where it
    /// is and drops when the peer is done.
    ///
    /// # Errors
    /// Why the copy failed; the call fails with it.
    fn copy_to_host(&self, memory: &DeviceBuffer) -> Result<HostBytes, DeviceError>;

    /// Memory on `device` holding `bytes` (`cuda_basic`'s receiving side, for bytes that
    /// arrived whole: inline, or over `cma`, `xth` or `mpt` to a runtime without
    /// [`receive_staged`](Self::receive_staged) or [`receive_parts`](Self::receive_parts)).
    ///
    /// # Errors
    /// Why it cannot be allocated or filled (no such device, out of memory, ...).
    fn copy_from_host(&self, device: Device, bytes: Vec<u8>) -> Result<DeviceBuffer, DeviceError>;

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
    ) -> Result<Option<Box<dyn StagedReceive>>, DeviceError> {
        let _ = (device, len);
        Ok(None)
    }

    /// Starts receiving a `len`-byte tensor onto `device` in parts that arrive in any
    /// order ([`PartedReceive`]: `cuda_basic` over `mpt`), or `None` when this runtime
    /// takes such bytes only whole ([`copy_from_host`](Self::copy_from_host)). Default:
    /// `None`.
    ///
    /// # Errors
    /// Why memory or buffers for it cannot be had; the agent then reads the bytes whole
    /// and hands them to [`copy_from_host`](Self::copy_from_host).
    fn receive_parts(
        &self,
        device: Device,
        len: usize,
    ) -> Result<Option<Box<dyn PartedReceive>>, DeviceError> {
        let _ = (device, len);
        Ok(None)
    }

    /// The lending channels this runtime runs here (`cuda_xth`, `cuda_ipc`, `cuda_gdr`),
    /// each with its domain descriptor (two workers use a channel when their descriptors match),
    /// or why it cannot run here ([`ChannelUnavailable`], usually
    /// [`UnavailableReason::NotViable`](super::UnavailableReason::NotViable) with the
    /// runtime's own error as the source). Default: none.
    fn lending_channels(&self) -> Vec<(ChannelKind, Result<String, ChannelUnavailable>)> {
        Vec::new()
    }

    /// Lends `memory` to the peer over `channel`: the descriptor the frame carries, and
    /// what must live until the peer is done.
    ///
    /// # Errors
    /// Why it cannot be lent (memory this runtime did not make, a driver error, ...).
    fn lend(&self, channel: ChannelKind, memory: &DeviceBuffer) -> Result<DeviceLoan, DeviceError> {
        Err(DeviceError::new(
            DeviceOp::Lend,
            format!("this device runtime does not lend memory over {channel}"),
        )
        .on(memory.device())
        .over(channel))
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
    ) -> Result<DeviceBuffer, DeviceError> {
        let _ = (len, descriptor);
        Err(DeviceError::new(
            DeviceOp::Borrow,
            format!("this device runtime does not borrow memory over {channel}"),
        )
        .on(device)
        .over(channel))
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
    ) -> Result<DeviceBuffer, DeviceError> {
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
