//! `cuda_basic` carried by `mpt`: a received tensor staged in parts that arrive in any
//! order, from one thread per lane ([`DriverPartsIn`], the runtime's `PartedReceive`).
//!
//! Each part lies within one staging chunk (the agent cuts stripes at multiples of
//! [`part_len`](PartedReceive::part_len)). A lane takes a pinned slot from the tensor's
//! small pool, waits for that slot's last copy (its event), reads the part into it, and
//! hands it back: the part's host-to-device copy is enqueued at once, to its offset in the
//! tensor, and the slot goes back to the pool with that copy in flight. So the copies of
//! the pieces already read run while the lanes read on, and at most as many parts as
//! the pool has slots are in flight. A slot taken and never filled (a lane that failed)
//! goes back too, so the other lanes never wait for it forever.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use rdzv_core::negotiate::ChannelKind;
use rdzv_uring::rpc::{DeviceBuffer, DeviceError, DeviceOp, PartBuffer, PartedReceive};

use super::device::DeviceState;
use super::tensor_memory::CudaMemory;
use super::Cause;
use crate::cuda::error::CudaChannelError;
use crate::cuda::memory::StagingBuffer;

/// The fewest slots a parted receive cycles through: one per lane of the default four,
/// so that no lane waits for another's copy before its own first piece.
const MIN_SLOTS: usize = 4;

/// A tensor's pinned slots: idle ones (their last copy may still be in flight), and how
/// many were made (at most `max`). Generic so that its waiting is tested without a GPU.
#[derive(Debug)]
struct SlotPool<T> {
    state: Mutex<Slots<T>>,
    returned: Condvar,
    max: usize,
}

#[derive(Debug)]
struct Slots<T> {
    idle: Vec<T>,
    made: usize,
}

impl<T> SlotPool<T> {
    fn new(max: usize) -> SlotPool<T> {
        SlotPool {
            state: Mutex::new(Slots {
                idle: Vec::new(),
                made: 0,
            }),
            returned: Condvar::new(),
            max: max.max(1),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An idle slot: one of the pool's, one from `make` while fewer than `max` were
    /// made, or the next one given back (waiting for it).
    fn take<E>(&self, make: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let mut slots = self.slots();
        loop {
            if let Some(slot) = slots.idle.pop() {
                return Ok(slot);
            }
            if slots.made < self.max {
                slots.made += 1;
                drop(slots);
                let made = make();
                if made.is_err() {
                    self.slots().made -= 1;
                    // A waiter may make one now (and fail with the reason itself).
                    self.returned.notify_one();
                }
                return made;
            }
            slots = self
                .returned
                .wait(slots)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn put_back(&self, slot: T) {
        self.slots().idle.push(slot);
        self.returned.notify_one();
    }

    /// Whether every slot made is back.
    fn all_back(&self) -> bool {
        let slots = self.slots();
        slots.made == slots.idle.len()
    }

    /// The idle slots, taken out.
    fn drain(&self) -> Vec<T> {
        std::mem::take(&mut self.slots().idle)
    }
}

/// A part's slot, on its way from [`DriverPartsIn::part`] to
/// [`DriverPartsIn::part_filled`]; back to the pool if dropped unfilled.
struct DriverPart {
    slot: Option<StagingBuffer>,
    offset: usize,
    len: usize,
    pool: Arc<SlotPool<StagingBuffer>>,
}

impl PartBuffer for DriverPart {
    fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        self.slot
            .as_mut()
            .and_then(StagingBuffer::bytes_mut)
            .and_then(|bytes| bytes.get_mut(..len))
            .unwrap_or_default()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

impl Drop for DriverPart {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.pool.put_back(slot);
        }
    }
}

/// A tensor received onto one device in parts (see the module docs).
pub(super) struct DriverPartsIn {
    state: Arc<DeviceState>,
    /// Taken by `finish`.
    memory: Option<CudaMemory>,
    pool: Arc<SlotPool<StagingBuffer>>,
    /// Bytes whose copy was enqueued.
    filled: AtomicUsize,
}

impl DeviceState {
    /// `cuda_basic`'s receiving side over mpt: fresh memory for `len` bytes, filled in
    /// parts of at most a staging chunk.
    pub(super) fn receive_parts(
        self: Arc<Self>,
        len: usize,
    ) -> Result<Box<dyn PartedReceive>, Cause> {
        let memory = self.alloc(len)?;
        let max = self.basic.buffers.max(MIN_SLOTS);
        Ok(Box::new(DriverPartsIn {
            state: self,
            memory: Some(memory),
            pool: Arc::new(SlotPool::new(max)),
            filled: AtomicUsize::new(0),
        }))
    }
}

impl DriverPartsIn {
    fn failed(&self, why: impl Into<Cause>) -> DeviceError {
        DeviceError::new(DeviceOp::ReceiveStaged, why)
            .on(self.state.device)
            .over(ChannelKind::CudaBasic)
    }

    /// Waits for every slot's copy and gives the slots to the device's pool; whether
    /// every wait succeeded (a slot whose wait failed is leaked: a copy may still use it).
    fn settle(&self) -> bool {
        let idle = self.pool.drain();
        let mut back = Vec::with_capacity(idle.len());
        let mut all = true;
        for mut slot in idle {
            match slot.wait() {
                Ok(()) => back.push(slot),
                Err(_) => {
                    all = false;
                    std::mem::forget(slot);
                }
            }
        }
        self.state.give_back(back);
        all
    }
}

impl PartedReceive for DriverPartsIn {
    fn part_len(&self) -> usize {
        self.state.basic.chunk
    }

    fn part(&self, offset: usize, len: usize) -> Result<Box<dyn PartBuffer>, DeviceError> {
        let total = self.memory.as_ref().map_or(0, |m| m.len);
        let chunk = self.state.basic.chunk;
        let end = offset.checked_add(len).filter(|&end| end <= total);
        if len == 0 || end.is_none() || offset / chunk != (offset + len - 1) / chunk {
            return Err(self.failed(format!(
                "part {offset}+{len} of a {total}-byte tensor is empty, out of bounds or \
                 crosses a {chunk}-byte chunk (a bug of the caller's)"
            )));
        }
        // An idle slot of the pool (made from the device's staging slots when needed).
        let mut slot = self
            .pool
            .take(|| self.state.take_slot())
            .map_err(|e| self.failed(e))?;
        if let Err(e) = self
            .state
            .gpu
            .bind()
            .and_then(|()| slot.wait())
            .map_err(CudaChannelError::from)
        {
            // Its copy may still run: never reuse it.
            std::mem::forget(slot);
            return Err(self.failed(e));
        }
        Ok(Box::new(DriverPart {
            slot: Some(slot),
            offset,
            len,
            pool: Arc::clone(&self.pool),
        }))
    }

    fn part_filled(&self, part: Box<dyn PartBuffer>) -> Result<(), DeviceError> {
        let mut part = part
            .into_any()
            .downcast::<DriverPart>()
            .map_err(|_| self.failed("a part this receive did not hand out"))?;
        let (offset, len) = (part.offset, part.len);
        let memory = self
            .memory
            .as_ref()
            .ok_or_else(|| self.failed("this receive already finished"))?;
        let dst = memory
            .range()
            .slice(offset, len)
            .ok_or_else(|| self.failed(format!("part {offset}+{len} out of bounds")))?;
        let Some(slot) = part.slot.as_mut() else {
            return Err(self.failed("a part without its slot"));
        };
        // The slot goes back to the pool (on drop) with its copy in flight.
        let copied = self
            .state
            .gpu
            .bind()
            .and_then(|()| slot.upload(dst, self.state.stream()));
        copied.map_err(|e| self.failed(CudaChannelError::from(e)))?;
        self.filled.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> Result<DeviceBuffer, DeviceError> {
        let total = self.memory.as_ref().map_or(0, |m| m.len);
        let filled = self.filled.load(Ordering::Relaxed);
        if filled != total {
            return Err(self.failed(format!(
                "finished after {filled} of {total} bytes were filled"
            )));
        }
        if !self.pool.all_back() {
            return Err(self.failed("finished while a part was still out"));
        }
        if !self.settle() {
            return Err(
                self.failed("a staging copy cannot be waited for; the tensor's memory is leaked")
            );
        }
        let memory = self
            .memory
            .take()
            .ok_or_else(|| self.failed("this receive already finished"))?;
        Ok(DeviceBuffer::new(memory))
    }
}

/// Dropped unfinished (or after a failed `finish`): waits for the copies it started and
/// gives the slots and the memory back; if a wait fails the memory is leaked, never
/// reused under a running copy.
impl Drop for DriverPartsIn {
    fn drop(&mut self) {
        let Some(memory) = self.memory.take() else {
            return;
        };
        if self.settle() {
            drop(memory);
        } else {
            tracing::warn!(
                device = %self.state.device,
                "a cuda_basic staging copy cannot be waited for: the tensor's memory is leaked"
            );
            std::mem::forget(memory);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_pool_makes_up_to_its_max_then_hands_back_what_returns() {
        let pool = SlotPool::new(2);
        let made = AtomicUsize::new(0);
        let make = || -> Result<usize, String> { Ok(made.fetch_add(1, Ordering::Relaxed)) };
        let (a, b) = (pool.take(make), pool.take(make));
        assert_eq!((a.clone(), b.clone()), (Ok(0), Ok(1)));
        assert!(!pool.all_back());
        // A third lane waits until a slot comes back, and gets that one.
        std::thread::scope(|s| {
            let third = s.spawn(|| pool.take(make));
            std::thread::sleep(Duration::from_millis(20));
            pool.put_back(b.unwrap_or_default());
            assert_eq!(third.join().ok(), Some(Ok(1)));
        });
        assert_eq!(made.load(Ordering::Relaxed), 2, "made past the max");
        pool.put_back(a.unwrap_or_default());
        pool.put_back(1);
        assert!(pool.all_back());
        assert_eq!(pool.drain().len(), 2);
    }

    #[test]
    fn a_slot_that_cannot_be_made_frees_its_place_and_wakes_a_waiter() {
        let pool: SlotPool<u8> = SlotPool::new(1);
        let first = pool.take(|| Err::<u8, _>("no pinned memory"));
        assert_eq!(first, Err("no pinned memory"));
        // Its place is free again: the next take makes one.
        assert_eq!(pool.take(|| Ok::<_, &str>(5)), Ok(5));
        // A waiter blocked on a full pool wakes when a make fails, and tries itself.
        let pool: SlotPool<u8> = SlotPool::new(1);
        let (started, go) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        std::thread::scope(|s| {
            let maker = s.spawn(|| {
                pool.take(|| {
                    started.wait();
                    go.wait();
                    Err::<u8, _>("cuMemHostAlloc failed")
                })
            });
            started.wait();
            let waiter = s.spawn(|| pool.take(|| Ok::<_, &str>(7)));
            std::thread::sleep(Duration::from_millis(20));
            go.wait();
            assert_eq!(maker.join().ok(), Some(Err("cuMemHostAlloc failed")));
            assert_eq!(waiter.join().ok(), Some(Ok(7)));
        });
    }
}
