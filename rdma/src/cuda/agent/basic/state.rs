//! What `cuda_basic` keeps per opened device ([`BasicState`]): its idle staging slots, its
//! cache of pinned host blocks for staged sends, and the chunking it stages with.
//! `DeviceState` owns one beside the other channels' state; this module only makes it,
//! and copies nothing (the staging is in [`super`]).

use std::sync::Mutex;

use crate::cuda::agent::driver::PinnedBacking;
use crate::cuda::caching_allocator::CachingAllocator;
use crate::cuda::memory::{Gpu, StagingBuffer};

/// `cuda_basic`'s pools on one device.
pub(in crate::cuda::agent) struct BasicState {
    /// Idle staging slots of `chunk` bytes each.
    pub(in crate::cuda::agent) staging: Mutex<Vec<StagingBuffer>>,
    /// Pinned host blocks a staged send is copied into.
    pub(in crate::cuda::agent) pinned: CachingAllocator<PinnedBacking>,
    /// Bytes per staged chunk (at least 1).
    pub(in crate::cuda::agent) chunk: usize,
    /// Chunks in flight at once (at least 1).
    pub(in crate::cuda::agent) buffers: usize,
}

impl BasicState {
    /// Empty pools on `gpu` (named `device` in the cache's messages), keeping at most
    /// `pinned_cap_bytes` of pinned memory, staging `chunk` bytes at a time through
    /// `buffers` slots (each raised to 1).
    pub(in crate::cuda::agent) fn new(
        gpu: &Gpu,
        device: impl std::fmt::Display,
        pinned_cap_bytes: usize,
        chunk: usize,
        buffers: usize,
    ) -> BasicState {
        BasicState {
            staging: Mutex::new(Vec::new()),
            pinned: CachingAllocator::new(
                format!("{device} (pinned host memory for cuda_basic)"),
                PinnedBacking { gpu: gpu.clone() },
                pinned_cap_bytes,
            ),
            chunk: chunk.max(1),
            buffers: buffers.max(1),
        }
    }
}
