//! How `cuda_basic` stages a tensor through a few pinned host buffers: the tensor is cut
//! into chunks, and each chunk takes the next buffer in turn, so that the device copy of
//! chunk k+1 runs while the host copies chunk k.
//!
//! [`ChunkPlan`] is the pure part: the chunk boundaries and the order of the steps.
//! For `n` chunks over `b` buffers the steps are, per chunk k: *issue* k's device copy
//! into (or out of) buffer `k % b`, then *finish* chunk k − (b − 1) (wait for its copy,
//! then copy its bytes between the buffer and the caller's host memory). A buffer is
//! issued again only after its previous chunk finished, and chunks finish in order.
//! The agent's runtime runs the plan with CUDA events; this module moves no bytes.

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
