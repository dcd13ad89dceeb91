//! The `cuda_basic` pipeline: how a device buffer is cut into chunks, staged through a
//! bounded pool of host slots and streamed over a [`ByteChannel`], and the one header that
//! precedes the bytes.
//!
//! The sender keeps up to `slots` device-to-host copies in flight: it starts a copy into
//! every free slot, waits for the oldest, sends its bytes, and reuses that slot for the next
//! chunk. The receiver reads a chunk into a free slot, starts the host-to-device copy and
//! only waits for a slot's copy when it needs that slot again, then waits for all of them at
//! the end. Both sides chunk independently (the channel carries a plain byte stream after
//! the header), so their slot sizes need not match.
//!
//! The pipeline is generic over [`StagingSide`], the device half: the real one
//! ([`basic`](super::basic)) issues `cuMemcpy*Async` on the caller's stream and waits on one
//! event per slot; tests drive the same code with host memory. This module issues no CUDA
//! call itself.

use super::byte_channel::ByteChannel;
use super::channel_error::CudaChannelError;

/// Magic bytes that open a `cuda_basic` transfer.
pub const BASIC_MAGIC: [u8; 4] = *b"RZCB";
/// Length of the transfer header: magic + total length (u64, little endian).
pub const BASIC_HEADER_LEN: usize = 12;

/// The device half of a staged transfer: a pool of host slots bound to one device buffer.
pub trait StagingSide {
    /// Number of slots in the pool (at least 1).
    fn slot_count(&self) -> usize;
    /// Bytes per slot (at least 1).
    fn slot_len(&self) -> usize;
    /// Starts copying `len` bytes at `offset` of the device buffer into `slot`.
    fn start_download(
        &mut self,
        slot: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError>;
    /// Starts copying the first `len` bytes of `slot` to `offset` of the device buffer.
    fn start_upload(
        &mut self,
        slot: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), CudaChannelError>;
    /// Waits until the last copy started on `slot` is complete.
    fn wait_slot(&mut self, slot: usize) -> Result<(), CudaChannelError>;
    /// The first `len` bytes of `slot`, for the CPU side. Only called when no copy on the
    /// slot is in flight.
    fn slot_bytes(&mut self, slot: usize, len: usize) -> Result<&mut [u8], CudaChannelError>;
}

/// `(offset, len)` of each chunk of a `total`-byte buffer cut into `chunk`-byte pieces (the
/// last one shorter); nothing for an empty buffer. A `chunk` of 0 is treated as 1.
pub fn chunks(total: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..total.div_ceil(chunk)).map(move |i| {
        let offset = i * chunk;
        (offset, chunk.min(total - offset))
    })
}

/// Encodes the transfer header.
pub fn encode_basic_header(total: u64) -> [u8; BASIC_HEADER_LEN] {
    let mut out = [0u8; BASIC_HEADER_LEN];
    out[..4].copy_from_slice(&BASIC_MAGIC);
    out[4..].copy_from_slice(&total.to_le_bytes());
    out
}

/// Decodes the transfer header into the total length.
pub fn decode_basic_header(bytes: &[u8; BASIC_HEADER_LEN]) -> Result<u64, CudaChannelError> {
    let (magic, len) = bytes.split_at(4);
    if magic != BASIC_MAGIC {
        return Err(CudaChannelError::protocol(
            "cuda_basic transfer header",
            format!("bad magic {magic:02x?}"),
        ));
    }
    let mut raw = [0u8; 8];
    raw.copy_from_slice(len);
    Ok(u64::from_le_bytes(raw))
}

fn check_pool<S: StagingSide + ?Sized>(side: &S) -> Result<(), CudaChannelError> {
    if side.slot_count() == 0 || side.slot_len() == 0 {
        return Err(CudaChannelError::InvalidPool {
            slots: side.slot_count(),
            slot_len: side.slot_len(),
        });
    }
    Ok(())
}

/// Sends the `total` bytes of the device buffer behind `side` over `channel`.
pub fn send_staged<S, C>(
    side: &mut S,
    total: usize,
    channel: &mut C,
) -> Result<(), CudaChannelError>
where
    S: StagingSide + ?Sized,
    C: ByteChannel + ?Sized,
{
    check_pool(side)?;
    let slots = side.slot_count();
    let plan: Vec<(usize, usize)> = chunks(total, side.slot_len()).collect();
    for (i, &(offset, len)) in plan.iter().enumerate().take(slots) {
        side.start_download(i, offset, len)?;
    }
    channel
        .send_bytes(&encode_basic_header(total as u64))
        .map_err(CudaChannelError::cpu("sending the cuda_basic header"))?;
    for (i, &(_, len)) in plan.iter().enumerate() {
        let slot = i % slots;
        side.wait_slot(slot)?;
        channel
            .send_bytes(side.slot_bytes(slot, len)?)
            .map_err(CudaChannelError::cpu("sending a staged chunk"))?;
        if let Some(&(next_offset, next_len)) = plan.get(i + slots) {
            side.start_download(slot, next_offset, next_len)?;
        }
    }
    Ok(())
}

/// Receives a transfer from `channel` into the `total`-byte device buffer behind `side`,
/// and returns once every byte has been copied to the device.
pub fn recv_staged<S, C>(
    side: &mut S,
    total: usize,
    channel: &mut C,
) -> Result<(), CudaChannelError>
where
    S: StagingSide + ?Sized,
    C: ByteChannel + ?Sized,
{
    check_pool(side)?;
    let mut header = [0u8; BASIC_HEADER_LEN];
    channel
        .recv_bytes(&mut header)
        .map_err(CudaChannelError::cpu("receiving the cuda_basic header"))?;
    let sent = decode_basic_header(&header)?;
    if sent != total as u64 {
        return Err(CudaChannelError::LengthMismatch {
            sent,
            expected: total as u64,
        });
    }
    let slots = side.slot_count();
    let mut in_flight = vec![false; slots];
    for (i, (offset, len)) in chunks(total, side.slot_len()).enumerate() {
        let slot = i % slots;
        if in_flight.get(slot).copied().unwrap_or(false) {
            side.wait_slot(slot)?;
        }
        channel
            .recv_bytes(side.slot_bytes(slot, len)?)
            .map_err(CudaChannelError::cpu("receiving a staged chunk"))?;
        side.start_upload(slot, offset, len)?;
        if let Some(flag) = in_flight.get_mut(slot) {
            *flag = true;
        }
    }
    for (slot, busy) in in_flight.into_iter().enumerate() {
        if busy {
            side.wait_slot(slot)?;
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cuda::byte_channel::StreamChannel;
    use proptest::prelude::*;
    use std::os::unix::net::UnixStream;

    /// Host-memory stand-in for the device: copies happen at `wait_slot` time, so a
    /// pipeline that reads a slot before waiting sees stale bytes and fails the test.
    pub(crate) struct FakeSide {
        pub device: Vec<u8>,
        slots: Vec<Vec<u8>>,
        pending: Vec<Option<(bool, usize, usize)>>,
        pub waits: usize,
    }

    impl FakeSide {
        pub(crate) fn new(device: Vec<u8>, slots: usize, slot_len: usize) -> Self {
            FakeSide {
                device,
                slots: vec![vec![0xEE; slot_len]; slots],
                pending: vec![None; slots],
                waits: 0,
            }
        }
    }

    impl StagingSide for FakeSide {
        fn slot_count(&self) -> usize {
            self.slots.len()
        }
        fn slot_len(&self) -> usize {
            self.slots.first().map_or(0, Vec::len)
        }
        fn start_download(
            &mut self,
            slot: usize,
            offset: usize,
            len: usize,
        ) -> Result<(), CudaChannelError> {
            assert!(
                self.pending[slot].is_none(),
                "slot {slot} reused while busy"
            );
            assert!(len <= self.slot_len() && offset + len <= self.device.len());
            self.pending[slot] = Some((true, offset, len));
            Ok(())
        }
        fn start_upload(
            &mut self,
            slot: usize,
            offset: usize,
            len: usize,
        ) -> Result<(), CudaChannelError> {
            assert!(
                self.pending[slot].is_none(),
                "slot {slot} reused while busy"
            );
            assert!(len <= self.slot_len() && offset + len <= self.device.len());
            self.pending[slot] = Some((false, offset, len));
            Ok(())
        }
        fn wait_slot(&mut self, slot: usize) -> Result<(), CudaChannelError> {
            self.waits += 1;
            if let Some((download, offset, len)) = self.pending[slot].take() {
                if download {
                    self.slots[slot][..len].copy_from_slice(&self.device[offset..offset + len]);
                } else {
                    self.device[offset..offset + len].copy_from_slice(&self.slots[slot][..len]);
                }
            }
            Ok(())
        }
        fn slot_bytes(&mut self, slot: usize, len: usize) -> Result<&mut [u8], CudaChannelError> {
            assert!(
                self.pending[slot].is_none(),
                "CPU touched slot {slot} during a copy"
            );
            Ok(&mut self.slots[slot][..len])
        }
    }

    fn transfer(data: Vec<u8>, send_pool: (usize, usize), recv_pool: (usize, usize)) -> Vec<u8> {
        let total = data.len();
        let (a, b) = UnixStream::pair().expect("socketpair");
        let sender = std::thread::spawn(move || {
            let mut side = FakeSide::new(data, send_pool.0, send_pool.1);
            send_staged(&mut side, total, &mut StreamChannel::new(a)).expect("send");
        });
        let mut side = FakeSide::new(vec![0; total], recv_pool.0, recv_pool.1);
        recv_staged(&mut side, total, &mut StreamChannel::new(b)).expect("recv");
        sender.join().expect("sender thread");
        assert!(
            side.pending.iter().all(Option::is_none),
            "receiver left copies in flight"
        );
        side.device
    }

    #[test]
    fn chunk_plan() {
        assert_eq!(chunks(0, 4).count(), 0);
        assert_eq!(
            chunks(10, 4).collect::<Vec<_>>(),
            vec![(0, 4), (4, 4), (8, 2)]
        );
        assert_eq!(chunks(8, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4)]);
        assert_eq!(chunks(3, 0).count(), 3);
    }

    #[test]
    fn header_round_trip_and_errors() {
        let header = encode_basic_header(1 << 40);
        assert_eq!(decode_basic_header(&header).expect("valid"), 1 << 40);
        let mut bad = header;
        bad[0] = b'X';
        assert!(matches!(
            decode_basic_header(&bad),
            Err(CudaChannelError::Protocol { .. })
        ));
    }

    #[test]
    fn sizes_that_matter() {
        for total in [0usize, 1, 4095, 4096, 4097, 100_000] {
            let data: Vec<u8> = (0..total).map(|i| (i * 31 % 251) as u8).collect();
            assert_eq!(
                transfer(data.clone(), (4, 4096), (3, 1000)),
                data,
                "total {total}"
            );
        }
    }

    #[test]
    fn length_mismatch_is_reported() {
        let (a, b) = UnixStream::pair().expect("socketpair");
        let sender = std::thread::spawn(move || {
            let mut side = FakeSide::new(vec![7; 10], 2, 4);
            // The receiver hangs up after the header; the send error is expected.
            let _ = send_staged(&mut side, 10, &mut StreamChannel::new(a));
        });
        let mut side = FakeSide::new(vec![0; 12], 2, 4);
        let err = recv_staged(&mut side, 12, &mut StreamChannel::new(b)).expect_err("mismatch");
        assert!(matches!(
            err,
            CudaChannelError::LengthMismatch {
                sent: 10,
                expected: 12
            }
        ));
        sender.join().expect("sender thread");
    }

    #[test]
    fn empty_pool_is_refused() {
        let (a, _b) = UnixStream::pair().expect("socketpair");
        let mut side = FakeSide::new(vec![1; 3], 0, 4);
        let err = send_staged(&mut side, 3, &mut StreamChannel::new(a)).expect_err("no slots");
        assert!(matches!(
            err,
            CudaChannelError::InvalidPool { slots: 0, .. }
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn any_pools_move_any_bytes(
            data in proptest::collection::vec(any::<u8>(), 0..5000),
            send_slots in 1usize..5, send_len in 1usize..700,
            recv_slots in 1usize..5, recv_len in 1usize..700,
        ) {
            let got = transfer(data.clone(), (send_slots, send_len), (recv_slots, recv_len));
            prop_assert_eq!(got, data);
        }
    }
}
