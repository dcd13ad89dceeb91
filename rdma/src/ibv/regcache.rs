//! A cache of memory registrations keyed by address range, with least-recently-used
//! eviction.
//!
//! Registering memory (`ibv_reg_mr`) pins pages and costs tens of microseconds or more, so
//! a buffer sent repeatedly should be registered once. The cache maps disjoint address
//! intervals `[start, end)` to a caller's value (the registration); a lookup hits when one
//! cached interval contains the whole requested range. Inserting a range removes every
//! entry it overlaps (the new registration supersedes them), and beyond `capacity` entries
//! the least recently used one goes. Removed values are handed back so that the caller
//! decides when they are dropped.
//!
//! The cache knows nothing about verbs or memory: keeping a cached range's memory alive
//! (so that its addresses cannot be reused by another allocation while the registration
//! maps the old pages) is the value's job; the connection stores the buffer's owner in it.

use std::collections::BTreeMap;

#[derive(Debug)]
struct Entry<T> {
    end: u64,
    last_used: u64,
    value: T,
}

/// Registrations keyed by disjoint address ranges.
#[derive(Debug)]
pub struct RegistrationCache<T> {
    entries: BTreeMap<u64, Entry<T>>,
    capacity: usize,
    clock: u64,
}

impl<T> RegistrationCache<T> {
    /// An empty cache holding at most `capacity` registrations (at least one).
    pub fn new(capacity: usize) -> Self {
        RegistrationCache {
            entries: BTreeMap::new(),
            capacity: capacity.max(1),
            clock: 0,
        }
    }

    /// Number of cached registrations.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The registration whose range contains `[start, start + len)`, marked as recently
    /// used. An empty or overflowing range never hits.
    pub fn lookup(&mut self, start: u64, len: u64) -> Option<&T> {
        let end = start.checked_add(len).filter(|_| len > 0)?;
        self.clock += 1;
        let clock = self.clock;
        // Intervals are disjoint, so only the last one starting at or before `start` can
        // contain it.
        let (_, entry) = self.entries.range_mut(..=start).next_back()?;
        if entry.end >= end {
            entry.last_used = clock;
            Some(&entry.value)
        } else {
            None
        }
    }

    /// Caches `value` for `[start, start + len)`; returns the values it displaced (entries
    /// overlapping the range, then the least recently used beyond capacity). An empty or
    /// overflowing range is not cached and `value` comes straight back.
    pub fn insert(&mut self, start: u64, len: u64, value: T) -> Vec<T> {
        let Some(end) = start.checked_add(len).filter(|_| len > 0) else {
            return vec![value];
        };
        let mut displaced = Vec::new();
        let overlapping: Vec<u64> = self
            .entries
            .range(..end)
            .rev()
            .take_while(|(_, entry)| entry.end > start)
            .map(|(&key, _)| key)
            .collect();
        for key in overlapping {
            if let Some(entry) = self.entries.remove(&key) {
                displaced.push(entry.value);
            }
        }
        self.clock += 1;
        self.entries.insert(
            start,
            Entry {
                end,
                last_used: self.clock,
                value,
            },
        );
        while self.entries.len() > self.capacity {
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(_, entry)| entry.last_used)
                .map(|(&key, _)| key);
            match oldest.and_then(|key| self.entries.remove(&key)) {
                Some(entry) => displaced.push(entry.value),
                None => break,
            }
        }
        displaced
    }

    /// Removes every entry and returns the values.
    pub fn clear(&mut self) -> Vec<T> {
        std::mem::take(&mut self.entries)
            .into_values()
            .map(|entry| entry.value)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn containing_range_hits() {
        let mut cache = RegistrationCache::new(4);
        assert!(cache.insert(100, 50, "a").is_empty());
        assert_eq!(cache.lookup(100, 50), Some(&"a"));
        assert_eq!(cache.lookup(120, 30), Some(&"a"));
        assert_eq!(cache.lookup(120, 31), None, "runs past the end");
        assert_eq!(cache.lookup(99, 2), None, "starts before");
        assert_eq!(cache.lookup(100, 0), None, "empty range");
        assert_eq!(cache.lookup(u64::MAX, 2), None, "overflow");
    }

    #[test]
    fn overlapping_insert_displaces() {
        let mut cache = RegistrationCache::new(8);
        cache.insert(0, 10, 1);
        cache.insert(10, 10, 2);
        cache.insert(30, 10, 3);
        let mut displaced = cache.insert(5, 10, 4);
        displaced.sort();
        assert_eq!(displaced, vec![1, 2]);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.lookup(6, 9), Some(&4));
        assert_eq!(cache.insert(0, 0, 9), vec![9]);
    }

    #[test]
    fn least_recently_used_is_evicted() {
        let mut cache = RegistrationCache::new(2);
        cache.insert(0, 10, 'a');
        cache.insert(100, 10, 'b');
        assert!(cache.lookup(0, 1).is_some());
        assert_eq!(cache.insert(200, 10, 'c'), vec!['b']);
        assert_eq!(cache.clear().len(), 2);
        assert!(cache.is_empty());
    }

    proptest! {
        /// Against a model: a list of (start, end, id) intervals with the same rules.
        #[test]
        fn matches_a_model(
            ops in proptest::collection::vec((any::<bool>(), 0u64..200, 0u64..60), 1..200),
        ) {
            let mut cache = RegistrationCache::new(5);
            let mut model: Vec<(u64, u64, usize, u64)> = Vec::new(); // start, end, id, used
            let mut clock = 0u64;
            for (id, (is_insert, start, len)) in ops.into_iter().enumerate() {
                clock += 1;
                if is_insert {
                    let mut displaced = cache.insert(start, len, id);
                    let mut expected = Vec::new();
                    if len == 0 {
                        expected.push(id);
                    } else {
                        let end = start + len;
                        model.retain(|&(s, e, i, _)| {
                            let overlap = s < end && e > start;
                            if overlap { expected.push(i); }
                            !overlap
                        });
                        model.push((start, end, id, clock));
                        while model.len() > 5 {
                            let (pos, _) = model.iter().enumerate()
                                .min_by_key(|(_, m)| m.3).unwrap();
                            expected.push(model.remove(pos).2);
                        }
                    }
                    displaced.sort();
                    expected.sort();
                    prop_assert_eq!(displaced, expected);
                } else {
                    let hit = cache.lookup(start, len).copied();
                    let want = model.iter_mut()
                        .find(|m| len > 0 && m.0 <= start && start + len <= m.1);
                    let want = want.map(|m| { m.3 = clock; m.2 });
                    prop_assert_eq!(hit, want);
                }
                prop_assert_eq!(cache.len(), model.len());
            }
        }
    }
}
