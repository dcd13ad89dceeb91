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
//!
//! [`ChunkedStageIn`] runs the host-to-device half when the bytes arrive chunk by chunk
//! (the agent's pull of a `cuda_basic` tensor over `cma` or `xth`): the caller fills
//! chunk k's buffer, the copy of chunk k starts at once, and the buffer is handed out
//! again (for chunk k + b) only after that copy was waited for.

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

/// Why a [`ChunkedStageIn`] step failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageInError<E> {
    /// The caller asked for chunks out of order (a bug of the caller's).
    OutOfOrder {
        /// The chunk asked for.
        asked: usize,
        /// The chunk expected.
        expected: usize,
    },
    /// Finished with chunks left unfilled.
    Incomplete {
        /// Chunks filled.
        filled: usize,
        /// Chunks in the plan.
        chunks: usize,
    },
    /// A copy failed to start or complete.
    Copy(E),
}

impl<E> From<E> for StageInError<E> {
    fn from(error: E) -> Self {
        StageInError::Copy(error)
    }
}

impl<E: std::fmt::Display> std::fmt::Display for StageInError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StageInError::OutOfOrder { asked, expected } => write!(
                f,
                "cuda_basic staging: chunk {asked} asked for, chunk {expected} expected next"
            ),
            StageInError::Incomplete { filled, chunks } => write!(
                f,
                "cuda_basic staging: finished after {filled} of {chunks} chunks"
            ),
            StageInError::Copy(error) => error.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for StageInError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StageInError::Copy(error) => error.source(),
            _ => None,
        }
    }
}

/// A host-to-device transfer whose bytes arrive chunk by chunk (see the module docs):
/// [`chunk_buffer`](Self::chunk_buffer), fill it,
/// [`chunk_filled`](Self::chunk_filled), for each chunk in order, then
/// [`finish`](Self::finish). After a failure, [`settle`](Self::settle) says which
/// buffers no copy uses any more.
#[derive(Debug)]
pub struct ChunkedStageIn<C> {
    plan: ChunkPlan,
    copies: C,
    /// Chunks filled (and their copies started).
    filled: usize,
    /// The chunk whose buffer is handed out.
    handed: Option<usize>,
    /// Per buffer: a copy was started and not waited for.
    busy: Vec<bool>,
}

impl<C: StagingCopies> ChunkedStageIn<C> {
    /// A transfer of `plan` through `copies`' buffers (at least `plan.buffers_used()`).
    pub fn new(plan: ChunkPlan, copies: C) -> Self {
        ChunkedStageIn {
            busy: vec![false; plan.buffers_used()],
            plan,
            copies,
            filled: 0,
            handed: None,
        }
    }

    /// The plan.
    pub fn plan(&self) -> &ChunkPlan {
        &self.plan
    }

    fn buffer_of(&self, k: usize) -> usize {
        k % self.busy.len().max(1)
    }

    /// Chunk `k`'s buffer (exactly the chunk's length), once the copy that used it last
    /// is done.
    ///
    /// # Errors
    /// `k` is not the next chunk, or waiting for the buffer failed.
    pub fn chunk_buffer(&mut self, k: usize) -> Result<&mut [u8], StageInError<C::Error>> {
        if k != self.filled || k >= self.plan.chunks() {
            return Err(StageInError::OutOfOrder {
                asked: k,
                expected: self.filled,
            });
        }
        let buffer = self.buffer_of(k);
        if self.busy[buffer] {
            self.copies.wait(buffer)?;
            self.busy[buffer] = false;
        }
        self.handed = Some(k);
        let (_, len) = self.plan.range(k);
        Ok(&mut self.copies.buffer(buffer)[..len])
    }

    /// Chunk `k`'s buffer is filled: starts its copy to the device.
    ///
    /// # Errors
    /// `k`'s buffer was not handed out last, or the copy could not be started.
    pub fn chunk_filled(&mut self, k: usize) -> Result<(), StageInError<C::Error>> {
        if self.handed != Some(k) {
            return Err(StageInError::OutOfOrder {
                asked: k,
                expected: self.filled,
            });
        }
        self.handed = None;
        let buffer = self.buffer_of(k);
        let (offset, len) = self.plan.range(k);
        // Busy from here: a copy that failed to start may still have been queued.
        self.busy[buffer] = true;
        self.copies.start_to_device(buffer, offset, len)?;
        self.filled += 1;
        Ok(())
    }

    /// Every chunk is filled: waits for the copies still running.
    ///
    /// # Errors
    /// Chunks left unfilled, or a copy failed.
    pub fn finish(&mut self) -> Result<(), StageInError<C::Error>> {
        if self.filled != self.plan.chunks() {
            return Err(StageInError::Incomplete {
                filled: self.filled,
                chunks: self.plan.chunks(),
            });
        }
        for buffer in 0..self.busy.len() {
            if self.busy[buffer] {
                self.copies.wait(buffer)?;
                self.busy[buffer] = false;
            }
        }
        Ok(())
    }

    /// Waits for every copy still running (after a failure, or to abandon the
    /// transfer) and says, per buffer, whether it is idle now (`false`: its wait failed
    /// and a copy may still use it).
    pub fn settle(&mut self) -> Vec<bool> {
        for buffer in 0..self.busy.len() {
            if self.busy[buffer] && self.copies.wait(buffer).is_ok() {
                self.busy[buffer] = false;
            }
        }
        self.busy.iter().map(|busy| !busy).collect()
    }

    /// The copies, for their buffers.
    #[cfg(test)]
    pub fn copies_mut(&mut self) -> &mut C {
        &mut self.copies
    }

    /// The copies back (call [`finish`](Self::finish) or [`settle`](Self::settle)
    /// first: a copy may still use a buffer).
    pub fn into_copies(self) -> C {
        self.copies
    }
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

    /// Fills every chunk of `source` through `staging`, in order, as the agent's pull
    /// does.
    fn fill_all(
        staging: &mut ChunkedStageIn<FakeCopies>,
        source: &[u8],
    ) -> Result<(), StageInError<String>> {
        for k in 0..staging.plan().chunks() {
            let (offset, len) = staging.plan().range(k);
            let buffer = staging.chunk_buffer(k)?;
            assert_eq!(buffer.len(), len);
            buffer.copy_from_slice(&source[offset..offset + len]);
            staging.chunk_filled(k)?;
        }
        staging.finish()
    }

    #[test]
    fn chunks_out_of_order_or_missing_are_refused() {
        let plan = ChunkPlan::new(10, 4, 2);
        let mut staging = ChunkedStageIn::new(plan, FakeCopies::new(vec![0; 10], 2, 4));
        assert_eq!(
            staging.chunk_buffer(1).map(|b| b.len()),
            Err(StageInError::OutOfOrder {
                asked: 1,
                expected: 0
            })
        );
        assert_eq!(
            staging.chunk_filled(0),
            Err(StageInError::OutOfOrder {
                asked: 0,
                expected: 0
            })
        );
        assert!(staging.chunk_buffer(0).is_ok());
        assert_eq!(staging.chunk_filled(0), Ok(()));
        assert_eq!(
            staging.finish(),
            Err(StageInError::Incomplete {
                filled: 1,
                chunks: 3
            })
        );
        assert_eq!(staging.settle(), [true, true]);
        let text = StageInError::<String>::Incomplete {
            filled: 1,
            chunks: 3,
        }
        .to_string();
        assert!(text.contains("after 1 of 3 chunks"), "{text}");
    }

    #[test]
    fn a_failed_chunk_copy_fails_the_transfer_and_settles_every_buffer() {
        let source = bytes(100);
        for fail_at in 0..10 {
            let plan = ChunkPlan::new(100, 10, 3);
            let mut copies = FakeCopies::new(vec![0; 100], 3, 10);
            copies.fail_at = Some(fail_at);
            let mut staging = ChunkedStageIn::new(plan, copies);
            assert_eq!(
                fill_all(&mut staging, &source),
                Err(StageInError::Copy(format!("copy {fail_at} failed")))
            );
            assert_eq!(staging.settle(), [true, true, true]);
            assert!(staging.copies_mut().pending.iter().all(Option::is_none));
        }
    }

    proptest! {
        /// Chunk by chunk, every byte lands on the device, no buffer is handed out
        /// while its copy may still read it (the fake panics), and nothing is left
        /// running after `finish`.
        #[test]
        fn chunked_stage_in_moves_every_byte(
            len in 0usize..3000, chunk in 1usize..400, buffers in 1usize..4,
        ) {
            let plan = ChunkPlan::new(len, chunk, buffers);
            let source = bytes(len);
            let copies = FakeCopies::new(vec![0; len], buffers, chunk);
            let mut staging = ChunkedStageIn::new(plan, copies);
            prop_assert_eq!(fill_all(&mut staging, &source), Ok(()));
            let copies = staging.copies_mut();
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
