//! `cuda_basic`: CUDA tensors over any CPU channel, staged through pinned host memory.
//!
//! [`CudaBasicChannel`] owns a bounded pool of page-locked slots per direction (TensorPipe's
//! design: 16 slots of 1 MiB) and a [`ByteChannel`]. Sending issues `cuMemcpyDtoHAsync` of
//! each chunk into a slot on the caller's stream, records the slot's event, and ships the
//! slot once the event has fired; receiving reads each chunk into a slot and issues
//! `cuMemcpyHtoDAsync` on the caller's stream. The scheduling is [`staging`]'s;
//! this module is its CUDA half. Host buffers take the same wire format without staging,
//! so a CPU tensor on one side and a CUDA tensor on the other interoperate.
//!
//! It does not negotiate (its domain descriptor is the CPU channel's, see
//! [`descriptor`](super::descriptor)), frame anything beyond the transfer header, or
//! retry: an error leaves the byte channel in an unknown state and the pipe must be closed.

use cudarc::driver::safe::CudaStream;

use super::byte_channel::ByteChannel;
use super::channel_error::CudaChannelError;
use super::memory::{DeviceRange, Gpu, StagingBuffer};
use super::staging::{self, StagingSide};

/// Size and number of the staging slots of one direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Number of slots (copies in flight).
    pub slots: usize,
    /// Bytes per slot (the chunk size).
    pub slot_len: usize,
}

impl PoolConfig {
    /// TensorPipe's `cuda_basic` pool: 16 slots of 1 MiB.
    pub const BASIC_DEFAULT: PoolConfig = PoolConfig {
        slots: 16,
        slot_len: 1 << 20,
    };

    fn validate(self) -> Result<PoolConfig, CudaChannelError> {
        if self.slots == 0 || self.slot_len == 0 {
            return Err(CudaChannelError::InvalidPool {
                slots: self.slots,
                slot_len: self.slot_len,
            });
        }
        Ok(self)
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig::BASIC_DEFAULT
    }
}

/// A pool of pinned host slots, each with the event of its last copy.
#[derive(Debug)]
pub struct PinnedPool {
    gpu: Gpu,
    slots: Vec<StagingBuffer>,
    slot_len: usize,
}

impl PinnedPool {
    /// Allocates the pool on `gpu`.
    pub fn new(gpu: &Gpu, config: PoolConfig) -> Result<PinnedPool, CudaChannelError> {
        let config = config.validate()?;
        let slots = (0..config.slots)
            .map(|_| StagingBuffer::new(gpu, config.slot_len))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PinnedPool {
            gpu: gpu.clone(),
            slots,
            slot_len: config.slot_len,
        })
    }

    /// Number of slots.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Bytes per slot.
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }
}

/// The pool bound to one device buffer and stream for one transfer.
struct BoundPool<'p, 's, 'd> {
    pool: &'p mut PinnedPool,
    stream: &'s CudaStream,
    device: DeviceRange<'d>,
}

impl<'d> BoundPool<'_, '_, 'd> {
    fn device_range(&self, offset: usize, len: usize) -> Result<DeviceRange<'d>, CudaChannelError> {
        self.device.slice(offset, len).ok_or_else(|| {
            CudaChannelError::protocol(
                "cuda_basic chunk",
                format!(
                    "{len} bytes at {offset} exceed the {}-byte device buffer",
                    self.device.len()
                ),
            )
        })
    }

    fn slot(&mut self, slot: usize, len: usize) -> Result<&mut StagingBuffer, CudaChannelError> {
        let slot_len = self.pool.slot_len;
        match self.pool.slots.get_mut(slot) {
            Some(buffer) if len <= slot_len => Ok(buffer),
            _ => Err(CudaChannelError::protocol(
                "cuda_basic chunk",
                format!("slot {slot} cannot hold {len} bytes"),
            )),
        }
    }
}

impl StagingSide for BoundPool<'_, '_, '_> {
    fn slot_count(&self) -> usize {
        self.pool.slots.len()
    }

    fn slot_len(&self) -> usize {
        self.pool.slot_len
    }

    fn start_download(
        &mut self,
        slot: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError> {
        // The slot is not touched until the pipeline waited for it (`wait_slot`), and
        // the pool outlives the copy (a slot's drop waits for it).
        let src = self.device_range(offset, len)?.source();
        let stream = self.stream;
        self.slot(slot, len)?.download(src, stream)
    }

    fn start_upload(
        &mut self,
        slot: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError> {
        let dst = self.device_range(offset, len)?;
        let stream = self.stream;
        self.slot(slot, len)?.upload(dst, stream)
    }

    fn wait_slot(&mut self, slot: usize) -> Result<(), CudaChannelError> {
        match self.pool.slots.get_mut(slot) {
            Some(buffer) => buffer.wait(),
            None => Ok(()),
        }
    }

    fn slot_bytes(&mut self, slot: usize, len: usize) -> Result<&mut [u8], CudaChannelError> {
        let buffer = self.slot(slot, len)?;
        buffer.wait()?;
        buffer
            .bytes_mut()
            .and_then(|bytes| bytes.get_mut(..len))
            .ok_or_else(|| {
                CudaChannelError::protocol("cuda_basic chunk", format!("slot {slot} is busy"))
            })
    }
}

/// A `cuda_basic` endpoint: staging pools for both directions over a CPU byte channel.
#[derive(Debug)]
pub struct CudaBasicChannel<C> {
    channel: C,
    send_pool: PinnedPool,
    recv_pool: PinnedPool,
}

impl<C: ByteChannel> CudaBasicChannel<C> {
    /// A channel on `gpu` over `channel`, with `pool` slots in each direction.
    pub fn new(gpu: &Gpu, channel: C, pool: PoolConfig) -> Result<Self, CudaChannelError> {
        Ok(CudaBasicChannel {
            channel,
            send_pool: PinnedPool::new(gpu, pool)?,
            recv_pool: PinnedPool::new(gpu, pool)?,
        })
    }

    /// Sends the device bytes of `src`, read in order on `stream`, a stream of this
    /// channel's device (so work queued on it before, such as the kernel that produced
    /// them, completes first). Returns once every byte has been handed to the CPU channel.
    pub fn send(
        &mut self,
        src: DeviceRange<'_>,
        stream: &CudaStream,
    ) -> Result<(), CudaChannelError> {
        self.send_pool.gpu.check_stream(stream)?;
        let total = src.len();
        let mut side = BoundPool {
            pool: &mut self.send_pool,
            stream,
            device: src,
        };
        staging::send_staged(&mut side, total, &mut self.channel)
    }

    /// Receives a transfer into `dst`, whose length must equal the sender's. The copies to
    /// the device are issued on `stream`, a stream of this channel's device; the call returns
    /// once they have completed.
    pub fn recv(
        &mut self,
        dst: DeviceRange<'_>,
        stream: &CudaStream,
    ) -> Result<(), CudaChannelError> {
        self.recv_pool.gpu.check_stream(stream)?;
        let total = dst.len();
        let mut side = BoundPool {
            pool: &mut self.recv_pool,
            stream,
            device: dst,
        };
        staging::recv_staged(&mut side, total, &mut self.channel)
    }

    /// Sends host bytes (a CPU tensor) in the same wire format, without staging.
    pub fn send_host(&mut self, src: &[u8]) -> Result<(), CudaChannelError> {
        self.channel
            .send_bytes(&staging::encode_basic_header(src.len() as u64))
            .map_err(CudaChannelError::cpu("sending the cuda_basic header"))?;
        self.channel
            .send_bytes(src)
            .map_err(CudaChannelError::cpu("sending host bytes"))
    }

    /// Receives a transfer into host memory (a CPU tensor), without staging.
    pub fn recv_host(&mut self, dst: &mut [u8]) -> Result<(), CudaChannelError> {
        let mut header = [0u8; staging::BASIC_HEADER_LEN];
        self.channel
            .recv_bytes(&mut header)
            .map_err(CudaChannelError::cpu("receiving the cuda_basic header"))?;
        let sent = staging::decode_basic_header(&header)?;
        if sent != dst.len() as u64 {
            return Err(CudaChannelError::LengthMismatch {
                sent,
                expected: dst.len() as u64,
            });
        }
        self.channel
            .recv_bytes(dst)
            .map_err(CudaChannelError::cpu("receiving host bytes"))
    }

    /// The CPU channel.
    pub fn channel_mut(&mut self) -> &mut C {
        &mut self.channel
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_config_is_validated() {
        assert_eq!(PoolConfig::default(), PoolConfig::BASIC_DEFAULT);
        assert!(PoolConfig {
            slots: 0,
            slot_len: 1
        }
        .validate()
        .is_err());
        assert!(PoolConfig {
            slots: 1,
            slot_len: 0
        }
        .validate()
        .is_err());
        assert!(PoolConfig {
            slots: 1,
            slot_len: 1
        }
        .validate()
        .is_ok());
    }
}
