//! How `cuda_basic` stages a tensor through a few pinned host buffers: the tensor is cut
//! into chunks, and each chunk takes the next buffer in turn, so that the device copy of
//! chunk k+1 runs while the host copies chunk k.
//!
//! [`ChunkPlan`] is the pure part: the chunk boundaries and the order of the steps.
//! For `n` chunks over `b` buffers the steps are, per chunk k: *issue* k's device copy
//! into (or out of) buffer `k % b`, then *finish* chunk k − (b − 1) (wait for its copy,
//! then copy its bytes between the buffer and the caller's host memory). A buffer is
//! issued again only after its previous chunk finished, and chunks finish in order.
//!
//! [`stage_out`] and [`stage_in`] run a plan over [`StagingCopies`]: the agent's runtime
//! implements it with pinned buffers, asynchronous copies on its streams and one event
//! per buffer; the tests with a fake whose copies land only when waited for, so that
//! reading a buffer too early or reusing a busy one shows up as wrong bytes.

/// One step of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Start chunk `chunk`'s device copy through buffer `buffer`.
    Issue {
        /// Chunk index.
        chunk: usize,
        /// Buffer index.
        buffer: usize,
    },
    /// Wait for chunk `chunk` (in buffer `buffer`) and do its host-side copy.
    Finish {
        /// Chunk index.
        chunk: usize,
        /// Buffer index.
        buffer: usize,
    },
}

/// The plan for one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlan {
    len: usize,
    chunk: usize,
    buffers: usize,
}

impl ChunkPlan {
    /// A plan for `len` bytes in chunks of at most `chunk` bytes over `buffers` buffers
    /// (both at least 1).
    pub fn new(len: usize, chunk: usize, buffers: usize) -> ChunkPlan {
        ChunkPlan {
            len,
            chunk: chunk.max(1),
            buffers: buffers.max(1),
        }
    }

    /// How many chunks.
    pub fn chunks(&self) -> usize {
        self.len.div_ceil(self.chunk)
    }

    /// How many buffers the plan uses (at most the chunks).
    pub fn buffers_used(&self) -> usize {
        self.buffers.min(self.chunks())
    }

    /// Chunk `k`'s byte range `(offset, len)`.
    pub fn range(&self, k: usize) -> (usize, usize) {
        let offset = k.saturating_mul(self.chunk).min(self.len);
        (offset, self.chunk.min(self.len - offset))
    }

    /// The steps, in order.
    pub fn steps(&self) -> impl Iterator<Item = Step> + '_ {
        let n = self.chunks();
        let lag = self.buffers - 1;
        let buffers = self.buffers;
        (0..n + lag).flat_map(move |k| {
            let issue = (k < n).then_some(Step::Issue {
                chunk: k,
                buffer: k % buffers,
            });
            let finish = k.checked_sub(lag).filter(|&f| f < n).map(|f| Step::Finish {
                chunk: f,
                buffer: f % buffers,
            });
            issue.into_iter().chain(finish)
        })
    }
}

/// The copies a staged transfer needs, between a device range and a few host buffers.
pub trait StagingCopies {
    /// Why a copy failed.
    type Error;
    /// Starts copying `len` bytes at `offset` of the device range into buffer `buffer`.
    ///
    /// # Errors
    /// The copy could not be started.
    fn start_to_host(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), Self::Error>;
    /// Starts copying the first `len` bytes of buffer `buffer` to `offset` of the device
    /// range.
    ///
    /// # Errors
    /// The copy could not be started.
    fn start_to_device(
        &mut self,
        buffer: usize,
        offset: usize,
        len: usize,
    ) -> Result<(), Self::Error>;
    /// Waits for buffer `buffer`'s last copy.
    ///
    /// # Errors
    /// The copy failed.
    fn wait(&mut self, buffer: usize) -> Result<(), Self::Error>;
    /// Buffer `buffer`'s bytes; only called when no copy uses it.
    fn buffer(&mut self, buffer: usize) -> &mut [u8];
}

/// Runs `plan` device to host: the tensor's bytes are appended to `out` in order.
///
/// # Errors
/// The first failed copy (copies already started may still be running: wait for every
/// buffer before reusing them).
pub fn stage_out<C: StagingCopies>(
    plan: &ChunkPlan,
    copies: &mut C,
    out: &mut Vec<u8>,
) -> Result<(), C::Error> {
    for step in plan.steps() {
        match step {
            Step::Issue { chunk, buffer } => {
                let (offset, len) = plan.range(chunk);
                copies.start_to_host(buffer, offset, len)?;
            }
            Step::Finish { chunk, buffer } => {
                let (_, len) = plan.range(chunk);
                copies.wait(buffer)?;
                out.extend_from_slice(&copies.buffer(buffer)[..len]);
            }
        }
    }
    Ok(())
}

/// Runs `plan` host to device: `bytes` (the plan's length) land in the device range.
///
/// # Errors
/// As [`stage_out`].
pub fn stage_in<C: StagingCopies>(
    plan: &ChunkPlan,
    copies: &mut C,
    bytes: &[u8],
) -> Result<(), C::Error> {
    for step in plan.steps() {
        match step {
            Step::Issue { chunk, buffer } => {
                let (offset, len) = plan.range(chunk);
                copies.buffer(buffer)[..len].copy_from_slice(&bytes[offset..offset + len]);
                copies.start_to_device(buffer, offset, len)?;
            }
            Step::Finish { buffer, .. } => copies.wait(buffer)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn chunks_cover_the_tensor_in_order() {
        let plan = ChunkPlan::new(10, 4, 2);
        assert_eq!(plan.chunks(), 3);
        assert_eq!(
            (0..3).map(|k| plan.range(k)).collect::<Vec<_>>(),
            [(0, 4), (4, 4), (8, 2)]
        );
        assert_eq!(ChunkPlan::new(0, 4, 2).chunks(), 0);
        assert_eq!(ChunkPlan::new(0, 4, 2).steps().count(), 0);
    }

    #[test]
    fn double_buffering_overlaps_one_chunk() {
        let steps: Vec<Step> = ChunkPlan::new(3, 1, 2).steps().collect();
        use Step::*;
        assert_eq!(
            steps,
            [
                Issue {
                    chunk: 0,
                    buffer: 0
                },
                Issue {
                    chunk: 1,
                    buffer: 1
                },
                Finish {
                    chunk: 0,
                    buffer: 0
                },
                Issue {
                    chunk: 2,
                    buffer: 0
                },
                Finish {
                    chunk: 1,
                    buffer: 1
                },
                Finish {
                    chunk: 2,
                    buffer: 0
                },
            ]
        );
    }

    /// Fake asynchronous copies: a copy is only recorded when started and lands when its
    /// buffer is waited for, so a buffer read before its wait holds stale bytes and a
    /// buffer overwritten before its wait sends the wrong ones. Touching a busy buffer or
    /// starting a second copy on it panics.
    struct FakeCopies {
        device: Vec<u8>,
        buffers: Vec<Vec<u8>>,
        pending: Vec<Option<(bool, usize, usize)>>,
        fail_at: Option<usize>,
        started: usize,
    }

    impl FakeCopies {
        fn new(device: Vec<u8>, buffers: usize, chunk: usize) -> FakeCopies {
            FakeCopies {
                device,
                buffers: vec![vec![0xee; chunk]; buffers],
                pending: vec![None; buffers],
                fail_at: None,
                started: 0,
            }
        }

        fn start(
            &mut self,
            buffer: usize,
            to_host: bool,
            offset: usize,
            len: usize,
        ) -> Result<(), String> {
            assert!(
                self.pending[buffer].is_none(),
                "buffer {buffer} reused while busy"
            );
            if self.fail_at == Some(self.started) {
                return Err(format!("copy {} failed", self.started));
            }
            self.started += 1;
            self.pending[buffer] = Some((to_host, offset, len));
            Ok(())
        }
    }

    impl StagingCopies for FakeCopies {
        type Error = String;
        fn start_to_host(
            &mut self,
            buffer: usize,
            offset: usize,
            len: usize,
        ) -> Result<(), String> {
            self.start(buffer, true, offset, len)
        }
        fn start_to_device(
            &mut self,
            buffer: usize,
            offset: usize,
            len: usize,
        ) -> Result<(), String> {
            self.start(buffer, false, offset, len)
        }
        fn wait(&mut self, buffer: usize) -> Result<(), String> {
            if let Some((to_host, offset, len)) = self.pending[buffer].take() {
                if to_host {
                    self.buffers[buffer][..len].copy_from_slice(&self.device[offset..offset + len]);
                } else {
                    self.device[offset..offset + len].copy_from_slice(&self.buffers[buffer][..len]);
                }
            }
            Ok(())
        }
        fn buffer(&mut self, buffer: usize) -> &mut [u8] {
            assert!(
                self.pending[buffer].is_none(),
                "buffer {buffer} touched while busy"
            );
            &mut self.buffers[buffer]
        }
    }

    fn bytes(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn a_failed_copy_stops_the_transfer() {
        let plan = ChunkPlan::new(100, 10, 2);
        let mut copies = FakeCopies::new(bytes(100), 2, 10);
        copies.fail_at = Some(4);
        let mut out = Vec::new();
        assert_eq!(
            stage_out(&plan, &mut copies, &mut out),
            Err("copy 4 failed".into())
        );
        assert!(out.len() < 100);
    }

    proptest! {
        /// Staged out and staged in through the fake, every byte arrives in order, with
        /// no buffer read early, overwritten early or reused while busy.
        #[test]
        fn staged_copies_move_every_byte_in_order(
            len in 0usize..3000, chunk in 1usize..400, buffers in 1usize..4,
        ) {
            let plan = ChunkPlan::new(len, chunk, buffers);
            let source = bytes(len);
            let mut copies = FakeCopies::new(source.clone(), buffers, chunk);
            let mut out = Vec::new();
            prop_assert_eq!(stage_out(&plan, &mut copies, &mut out), Ok(()));
            prop_assert!(out == source);

            let mut copies = FakeCopies::new(vec![0; len], buffers, chunk);
            prop_assert_eq!(stage_in(&plan, &mut copies, &source), Ok(()));
            prop_assert!(copies.pending.iter().all(Option::is_none), "every copy waited for");
            prop_assert!(copies.device == source);
        }
    }

    proptest! {
        /// Every chunk is issued once and finished once after it was issued; chunks
        /// finish in order; a buffer is never issued while it holds an unfinished chunk;
        /// at most `buffers` chunks are in flight; the ranges tile `[0, len)`.
        #[test]
        fn plans_are_ordered_and_never_reuse_a_busy_buffer(
            len in 0usize..5000, chunk in 1usize..700, buffers in 1usize..5,
        ) {
            let plan = ChunkPlan::new(len, chunk, buffers);
            let n = plan.chunks();
            let mut busy: Vec<Option<usize>> = vec![None; buffers];
            let mut issued = vec![false; n];
            let mut finished = 0usize;
            for step in plan.steps() {
                match step {
                    Step::Issue { chunk, buffer } => {
                        prop_assert!(!issued[chunk]);
                        prop_assert!(busy[buffer].is_none(), "buffer {} busy", buffer);
                        issued[chunk] = true;
                        busy[buffer] = Some(chunk);
                    }
                    Step::Finish { chunk, buffer } => {
                        prop_assert_eq!(chunk, finished, "in order");
                        prop_assert_eq!(busy[buffer], Some(chunk));
                        busy[buffer] = None;
                        finished += 1;
                    }
                }
                prop_assert!(busy.iter().flatten().count() <= buffers);
            }
            prop_assert_eq!(finished, n);
            let mut next = 0;
            for k in 0..n {
                let (offset, len_k) = plan.range(k);
                prop_assert_eq!(offset, next);
                prop_assert!(len_k > 0 && len_k <= chunk);
                next += len_k;
            }
            prop_assert_eq!(next, len);
        }
    }
}
