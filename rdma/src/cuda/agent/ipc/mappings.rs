//! The borrower's cache of opened `cuda_ipc` mappings, the UCX way: a peer's allocation
//! is opened (`cuIpcOpenMemHandle`) once and kept for the pipe's life, instead of an
//! open and a close per loan.
//!
//! An entry is keyed by the pipe it was borrowed on, the lending process, the target
//! device and the lender's allocation base address (from the descriptor), and remembers
//! the IPC handle it was opened from. The same handle at a known base is a hit. Another
//! handle at a known base means the lender freed that allocation and the address was
//! reused: the old mapping is closed and the new handle opened, so nothing is ever
//! copied from a stale mapping. The cache is bounded, in mappings and in bytes mapped
//! (an open mapping keeps the lender's memory alive even after the lender freed it):
//! past either bound the least recently used mappings are closed. A pipe's mappings are closed when the pipe ends
//! ([`IpcMappings::close_pipe`]) and all of them when the runtime is dropped.
//!
//! A mapping is handed out as an `Arc`: one evicted while a copy still reads from it is
//! closed when that copy lets go of it. This module only keeps books; opening and closing
//! is the [`MappingOpener`]'s (the driver in the agent, a counting fake in the tests).

use std::collections::HashMap;
use std::sync::Arc;

use rdzv_core::channel::cuda::IPC_HANDLE_LEN;
use rdzv_core::channel::ProcessIdentity;

/// Opens IPC memory handles. Dropping a mapping closes it.
pub trait MappingOpener {
    /// An opened mapping.
    type Mapping: Send + Sync + 'static;
    /// Why a handle could not be opened.
    type Error;
    /// Opens `handle` for device `ordinal`.
    ///
    /// # Errors
    /// Why the driver refused it.
    fn open(
        &mut self,
        handle: &[u8; IPC_HANDLE_LEN],
        ordinal: usize,
    ) -> Result<Self::Mapping, Self::Error>;

    /// How many bytes `mapping` maps.
    fn mapped_len(mapping: &Self::Mapping) -> usize;
}

/// Where a mapping belongs: the pipe, the lending process, the device it is opened on
/// (the borrower's target) and the lender's allocation base.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MappingKey {
    /// The pipe the loans arrive on.
    pub pipe: u64,
    /// The lending process.
    pub peer: ProcessIdentity,
    /// The device the mapping is opened on.
    pub device: usize,
    /// The lender's allocation base address.
    pub base: u64,
}

/// What the cache did, for tests and debugging.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MappingStats {
    /// Handles opened.
    pub opens: u64,
    /// Loans served by an already opened mapping.
    pub hits: u64,
    /// Mappings dropped because the lender's address was reused by another allocation.
    pub recycled: u64,
    /// Mappings dropped to stay under the capacity.
    pub evicted: u64,
    /// Bytes mapped by the open mappings.
    pub mapped_bytes: usize,
}

struct Entry<M> {
    handle: [u8; IPC_HANDLE_LEN],
    mapping: Arc<M>,
    len: usize,
    last_used: u64,
}

/// The cache (see the module docs).
pub struct IpcMappings<O: MappingOpener> {
    opener: O,
    capacity: usize,
    max_bytes: usize,
    entries: HashMap<MappingKey, Entry<O::Mapping>>,
    clock: u64,
    stats: MappingStats,
}

impl<O: MappingOpener> std::fmt::Debug for IpcMappings<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMappings")
            .field("open", &self.entries.len())
            .field("capacity", &self.capacity)
            .field("max_bytes", &self.max_bytes)
            .field("stats", &self.stats)
            .finish()
    }
}

impl<O: MappingOpener> IpcMappings<O> {
    /// An empty cache keeping at most `capacity` (at least 1) mappings open, and
    /// mappings of at most `max_bytes` in all (beside the one in use).
    pub fn new(opener: O, capacity: usize, max_bytes: usize) -> Self {
        IpcMappings {
            opener,
            capacity: capacity.max(1),
            max_bytes,
            entries: HashMap::new(),
            clock: 0,
            stats: MappingStats::default(),
        }
    }

    /// The mapping of `handle` at `key`: the cached one when it was opened from the same
    /// handle, else a fresh one (closing a stale one at the same base first).
    ///
    /// # Errors
    /// The opener's, when the handle cannot be opened (nothing is cached then).
    pub fn get(
        &mut self,
        key: MappingKey,
        handle: &[u8; IPC_HANDLE_LEN],
    ) -> Result<Arc<O::Mapping>, O::Error> {
        self.clock += 1;
        if let Some(entry) = self.entries.get_mut(&key) {
            if entry.handle == *handle {
                entry.last_used = self.clock;
                self.stats.hits += 1;
                return Ok(Arc::clone(&entry.mapping));
            }
            // The lender's address now belongs to another allocation.
            self.remove(&key);
            self.stats.recycled += 1;
        }
        let mapping = Arc::new(self.opener.open(handle, key.device)?);
        let len = O::mapped_len(&mapping);
        self.stats.opens += 1;
        // Make room: other mappings go, least recently used first.
        while !self.entries.is_empty()
            && (self.entries.len() >= self.capacity
                || self.stats.mapped_bytes.saturating_add(len) > self.max_bytes)
        {
            self.evict_least_recent();
        }
        self.stats.mapped_bytes += len;
        self.entries.insert(
            key,
            Entry {
                handle: *handle,
                mapping: Arc::clone(&mapping),
                len,
                last_used: self.clock,
            },
        );
        Ok(mapping)
    }

    fn remove(&mut self, key: &MappingKey) {
        if let Some(entry) = self.entries.remove(key) {
            self.stats.mapped_bytes -= entry.len;
        }
    }

    fn evict_least_recent(&mut self) {
        let oldest = self
            .entries
            .iter()
            .min_by_key(|(_, entry)| entry.last_used)
            .map(|(key, _)| *key);
        if let Some(key) = oldest {
            self.remove(&key);
            self.stats.evicted += 1;
        }
    }

    /// Closes every mapping borrowed on `pipe` (the pipe ended).
    pub fn close_pipe(&mut self, pipe: u64) {
        self.entries.retain(|key, _| key.pipe != pipe);
        self.stats.mapped_bytes = self.entries.values().map(|entry| entry.len).sum();
    }

    /// Closes every mapping.
    pub fn close_all(&mut self) {
        self.entries.clear();
        self.stats.mapped_bytes = 0;
    }

    /// How many mappings are open.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is open.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The counters now.
    pub fn stats(&self) -> MappingStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Default)]
    struct Counts {
        opens: AtomicU64,
        closes: AtomicU64,
    }

    struct FakeOpener(Arc<Counts>);

    struct FakeMapping {
        handle: [u8; IPC_HANDLE_LEN],
        counts: Arc<Counts>,
    }

    impl Drop for FakeMapping {
        fn drop(&mut self) {
            self.counts.closes.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl MappingOpener for FakeOpener {
        type Mapping = FakeMapping;
        type Error = String;
        fn open(&mut self, handle: &[u8; IPC_HANDLE_LEN], _: usize) -> Result<FakeMapping, String> {
            if handle[0] == 0xff {
                return Err("cuIpcOpenMemHandle refused it".into());
            }
            self.0.opens.fetch_add(1, Ordering::SeqCst);
            Ok(FakeMapping {
                handle: *handle,
                counts: Arc::clone(&self.0),
            })
        }
        /// A handle's second byte says how many MiB it maps.
        fn mapped_len(mapping: &FakeMapping) -> usize {
            usize::from(mapping.handle[1]) << 20
        }
    }

    fn cache(capacity: usize) -> (IpcMappings<FakeOpener>, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        (
            IpcMappings::new(FakeOpener(Arc::clone(&counts)), capacity, usize::MAX),
            counts,
        )
    }

    fn peer(pid: u32) -> ProcessIdentity {
        ProcessIdentity {
            boot_id: [7; 16],
            pid_namespace: 1,
            user_namespace: 2,
            pid,
            start_time: 99,
        }
    }

    fn key(pipe: u64, pid: u32, base: u64) -> MappingKey {
        MappingKey {
            pipe,
            peer: peer(pid),
            device: 0,
            base,
        }
    }

    fn handle(id: u8) -> [u8; IPC_HANDLE_LEN] {
        [id; IPC_HANDLE_LEN]
    }

    fn counts(counts: &Counts) -> (u64, u64) {
        (
            counts.opens.load(Ordering::SeqCst),
            counts.closes.load(Ordering::SeqCst),
        )
    }

    #[test]
    fn a_handle_is_opened_once_per_pipe_and_reused() {
        let (mut cache, opened) = cache(8);
        for _ in 0..5 {
            let mapping = cache.get(key(1, 10, 0x1000), &handle(1)).unwrap();
            assert_eq!(mapping.handle, handle(1));
        }
        assert_eq!(counts(&opened), (1, 0));
        assert_eq!(cache.stats().hits, 4);
        // Another device, another peer or another pipe: its own mapping.
        let mut other_device = key(1, 10, 0x1000);
        other_device.device = 1;
        cache.get(other_device, &handle(1)).unwrap();
        cache.get(key(1, 11, 0x1000), &handle(1)).unwrap();
        cache.get(key(2, 10, 0x1000), &handle(1)).unwrap();
        assert_eq!(counts(&opened), (4, 0));
    }

    #[test]
    fn a_new_handle_at_a_known_base_closes_the_stale_mapping_first() {
        let (mut cache, opened) = cache(8);
        let stale = cache.get(key(1, 10, 0x1000), &handle(1)).unwrap();
        drop(stale);
        let fresh = cache.get(key(1, 10, 0x1000), &handle(2)).unwrap();
        assert_eq!(fresh.handle, handle(2), "never the stale mapping");
        assert_eq!(counts(&opened), (2, 1));
        assert_eq!(cache.stats().recycled, 1);
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn a_mapping_in_use_is_closed_when_its_copy_lets_go() {
        let (mut cache, opened) = cache(8);
        let in_use = cache.get(key(1, 10, 0x1000), &handle(1)).unwrap();
        cache.get(key(1, 10, 0x1000), &handle(2)).unwrap();
        assert_eq!(counts(&opened), (2, 0), "still read by a copy");
        drop(in_use);
        assert_eq!(counts(&opened), (2, 1));
    }

    #[test]
    fn past_capacity_the_least_recently_used_is_closed() {
        let (mut cache, opened) = cache(2);
        cache.get(key(1, 10, 0xa), &handle(1)).unwrap();
        cache.get(key(1, 10, 0xb), &handle(2)).unwrap();
        cache.get(key(1, 10, 0xa), &handle(1)).unwrap(); // 0xb is now the oldest
        cache.get(key(1, 10, 0xc), &handle(3)).unwrap();
        assert_eq!(counts(&opened), (3, 1));
        assert_eq!(cache.stats().evicted, 1);
        cache.get(key(1, 10, 0xa), &handle(1)).unwrap();
        assert_eq!(counts(&opened), (3, 1), "0xa stayed");
        cache.get(key(1, 10, 0xb), &handle(2)).unwrap();
        assert_eq!(counts(&opened), (4, 2), "0xb was the one closed");
    }

    /// A handle of `id` mapping `mib` MiB.
    fn sized(id: u8, mib: u8) -> [u8; IPC_HANDLE_LEN] {
        let mut handle = handle(id);
        handle[1] = mib;
        handle
    }

    #[test]
    fn past_the_byte_bound_the_least_recently_used_are_closed() {
        let opened = Arc::new(Counts::default());
        let mut cache = IpcMappings::new(FakeOpener(Arc::clone(&opened)), 100, 100 << 20);
        cache.get(key(1, 10, 0xa), &sized(1, 40)).unwrap();
        cache.get(key(1, 10, 0xb), &sized(2, 40)).unwrap();
        cache.get(key(1, 10, 0xa), &sized(1, 40)).unwrap(); // 0xb is now the oldest
        assert_eq!(cache.stats().mapped_bytes, 80 << 20);
        cache.get(key(1, 10, 0xc), &sized(3, 40)).unwrap();
        assert_eq!(counts(&opened), (3, 1), "0xb closed");
        assert_eq!(cache.stats().mapped_bytes, 80 << 20);
        // One mapping over the bound alone is still served (and kept, alone).
        let big = cache.get(key(1, 10, 0xd), &sized(4, 200)).unwrap();
        assert_eq!(big.handle, sized(4, 200));
        assert_eq!((cache.len(), cache.stats().mapped_bytes), (1, 200 << 20));
        cache.close_pipe(1);
        assert_eq!(cache.stats().mapped_bytes, 0);
    }

    #[test]
    fn a_pipe_end_closes_its_mappings_and_the_end_closes_all() {
        let (mut cache, opened) = cache(8);
        cache.get(key(1, 10, 0xa), &handle(1)).unwrap();
        cache.get(key(1, 10, 0xb), &handle(2)).unwrap();
        cache.get(key(2, 11, 0xa), &handle(3)).unwrap();
        cache.close_pipe(1);
        assert_eq!(counts(&opened), (3, 2));
        assert_eq!(cache.len(), 1);
        cache.get(key(2, 11, 0xb), &handle(4)).unwrap();
        drop(cache);
        assert_eq!(counts(&opened), (4, 4), "every mapping closed");
    }

    #[test]
    fn a_refused_handle_caches_nothing() {
        let (mut cache, opened) = cache(8);
        cache.get(key(1, 10, 0xa), &handle(1)).unwrap();
        assert!(cache.get(key(1, 10, 0xa), &handle(0xff)).is_err());
        assert!(cache.is_empty(), "the stale mapping is gone too");
        assert_eq!(counts(&opened), (1, 1));
    }
}
