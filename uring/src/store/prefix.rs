//! `PrefixStore`: every key becomes `prefix + "/" + key` on an underlying store.
//!
//! Mirrors PyTorch's `c10d::PrefixStore`: `num_keys` is not filtered (it is the
//! underlying store's total), `list_keys` keeps only keys under the prefix and strips
//! it, and the timeout is the underlying store's (shared). Prefixes nest.

use std::sync::Arc;
use std::time::Duration;

use super::{Store, StoreError};

/// A view of `store` where every key lives under `prefix/`.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    store: Arc<dyn Store>,
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl PrefixStore {
    /// Wraps `store` so that every key is `prefix + "/" + key`.
    pub fn new(prefix: impl Into<String>, store: Arc<dyn Store>) -> Self {
        PrefixStore {
            prefix: prefix.into(),
            store,
        }
    }

    /// The prefix (without the trailing `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store this one wraps (`underlying_store` in PyTorch).
    pub fn underlying_store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    fn join(&self, key: &str) -> String {
        let mut joined = String::with_capacity(self.prefix.len() + 1 + key.len());
        joined.push_str(&self.prefix);
        joined.push('/');
        joined.push_str(key);
        joined
    }

    fn join_all(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.join(k)).collect()
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.store.set(&self.join(key), value)
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.store.get(&self.join(key))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.store.add(&self.join(key), delta)
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.store.compare_set(&self.join(key), expected, desired)
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let joined = self.join_all(keys);
        let refs: Vec<&str> = joined.iter().map(String::as_str).collect();
        self.store.check(&refs)
    }

    fn wait(&self, keys: &[&str], timeout: Option<Duration>) -> Result<(), StoreError> {
        let joined = self.join_all(keys);
        let refs: Vec<&str> = joined.iter().map(String::as_str).collect();
        self.store.wait(&refs, timeout)
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.store.delete_key(&self.join(key))
    }

    fn num_keys(&self) -> Result<i64, StoreError> {
        self.store.num_keys()
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.store.append(&self.join(key), value)
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        let joined = self.join_all(keys);
        let refs: Vec<&str> = joined.iter().map(String::as_str).collect();
        self.store.multi_get(&refs)
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let joined: Vec<(String, &[u8])> = pairs.iter().map(|(k, v)| (self.join(k), *v)).collect();
        let refs: Vec<(&str, &[u8])> = joined.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        self.store.multi_set(&refs)
    }

    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.store.queue_push(&self.join(key), value)
    }

    fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>, StoreError> {
        self.store.queue_pop(&self.join(key), block)
    }

    fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        self.store.queue_len(&self.join(key))
    }

    fn list_keys(&self) -> Result<Vec<String>, StoreError> {
        let strip = self.prefix.len() + 1;
        Ok(self
            .store
            .list_keys()?
            .into_iter()
            .filter(|k| k.starts_with(&self.prefix))
            .map(|k| k.get(strip..).unwrap_or_default().to_string())
            .collect())
    }

    fn timeout(&self) -> Duration {
        self.store.timeout()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.store.set_timeout(timeout)
    }

    fn clone_store(&self) -> Result<Box<dyn Store>, StoreError> {
        Ok(Box::new(PrefixStore {
            prefix: self.prefix.clone(),
            store: Arc::from(self.store.clone_store()?),
        }))
    }
}
