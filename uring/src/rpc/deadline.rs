//! [`DeadlineStore`]: a store whose waits end by one deadline, for a graceful shutdown
//! with a timeout (`shutdown(graceful, timeout)`): the join's barriers wait on the
//! store, and each wait gets what is left of the time. It decides nothing else: every
//! other operation goes to the wrapped store unchanged.

use std::time::{Duration, Instant};

use crate::store::{Store, StoreError};

/// A wait is never given less than this (a zero wait means "do not wait at all" for
/// the TCP store, which would fail a barrier that is about to complete).
const MIN_WAIT: Duration = Duration::from_millis(1);

/// `inner`, with every `wait` ending by `deadline`.
pub(crate) struct DeadlineStore<'a> {
    inner: &'a dyn Store,
    deadline: Instant,
}

impl<'a> DeadlineStore<'a> {
    /// `inner`, whose waits end by `deadline`.
    pub(crate) fn new(inner: &'a dyn Store, deadline: Instant) -> DeadlineStore<'a> {
        DeadlineStore { inner, deadline }
    }

    /// Whether the deadline has passed.
    pub(crate) fn expired(&self) -> bool {
        Instant::now() >= self.deadline
    }

    fn left(&self, asked: Option<Duration>) -> Duration {
        let left = self
            .deadline
            .saturating_duration_since(Instant::now())
            .max(MIN_WAIT);
        left.min(asked.unwrap_or_else(|| self.inner.timeout()))
    }
}

impl Store for DeadlineStore<'_> {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.set(key, value)
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.inner.get(key)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.inner.add(key, delta)
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.inner.compare_set(key, expected, desired)
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.inner.check(keys)
    }

    fn wait(&self, keys: &[&str], timeout: Option<Duration>) -> Result<(), StoreError> {
        self.inner.wait(keys, Some(self.left(timeout)))
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete_key(key)
    }

    fn num_keys(&self) -> Result<i64, StoreError> {
        self.inner.num_keys()
    }

    fn timeout(&self) -> Duration {
        self.left(None)
    }

    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout);
    }

    fn clone_store(&self) -> Result<Box<dyn Store>, StoreError> {
        self.inner.clone_store()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::hash::HashStore;

    #[test]
    fn waits_end_by_the_deadline_and_the_rest_passes_through() {
        let inner = HashStore::new();
        let store = DeadlineStore::new(&inner, Instant::now() + Duration::from_millis(50));
        assert_eq!(store.add("n", 2).ok(), Some(2));
        assert!(store.check(&["n"]).unwrap_or(false));
        let started = Instant::now();
        let waited = store.wait(&["never"], None);
        assert!(
            matches!(waited, Err(StoreError::Timeout { .. })),
            "{waited:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(store.expired());
        assert!(
            store.wait(&["n"], None).is_ok(),
            "a present key needs no time"
        );
    }
}
