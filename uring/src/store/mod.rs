//! The c10d `Store` API and its implementations.
//!
//! [`Store`] is PyTorch's `c10d::Store` as a Rust trait: blocking calls, one object
//! shared between threads, user keys as strings, values as bytes. The TCP client
//! ([`tcp::TcpStore`]), the file store ([`file::FileStore`]), the prefix wrapper
//! ([`prefix::PrefixStore`]) and the in-process store ([`hash::HashStore`]) implement it.
//! What each operation *means* (compare_set's four cases, counters stored as decimal text,
//! barrier keys) is decided in `rdzv_core::store`; this module only moves bytes.

pub mod error;
pub mod etcd;
pub mod file;
pub mod hash;
pub mod prefix;
pub mod tcp;

use std::time::Duration;

pub use error::StoreError;
pub use prefix::PrefixStore;

/// PyTorch's `Store::kDefaultTimeout`: 300 seconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// A c10d key-value store: the API of PyTorch's `torch.distributed.Store`.
///
/// All methods take `&self` and may be called from several threads; an implementation
/// serialises what must be serialised (as PyTorch's `activeOpLock_` does).
/// Timeouts: `None` means "the store's own timeout" ([`Store::timeout`]); a zero
/// duration means "do not wait at all" for the TCP store, as in PyTorch.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, waking anyone waiting for `key`.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Waits (up to the store timeout) until `key` exists, then returns its value.
    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError>;

    /// Adds `delta` to the counter at `key` (missing counts as 0) and returns the result.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;

    /// Sets `key` to `desired` if its value is `expected` (an empty `expected` means "the
    /// key is missing"), and returns the value the store holds afterwards (see
    /// `rdzv_core::store::semantics` for the four cases).
    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError>;

    /// Whether every key exists, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool, StoreError>;

    /// Waits until every key exists, or fails with [`StoreError::Timeout`].
    fn wait(&self, keys: &[&str], timeout: Option<Duration>) -> Result<(), StoreError>;

    /// Deletes `key`; returns whether it existed.
    fn delete_key(&self, key: &str) -> Result<bool, StoreError>;

    /// How many keys the store holds (including internal ones, as PyTorch counts).
    fn num_keys(&self) -> Result<i64, StoreError>;

    /// Appends `value` to the value at `key`, creating it if missing.
    ///
    /// The default is PyTorch's fallback: a `compare_set` loop.
    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let mut expected = if self.check(&[key])? {
            self.get(key)?
        } else {
            Vec::new()
        };
        loop {
            let mut desired = expected.clone();
            desired.extend_from_slice(value);
            let now = self.compare_set(key, &expected, &desired)?;
            if now == desired {
                return Ok(());
            }
            expected = now;
        }
    }

    /// Gets several keys at once (waiting for all of them).
    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        keys.iter().map(|k| self.get(k)).collect()
    }

    /// Sets several keys at once.
    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        pairs.iter().try_for_each(|(k, v)| self.set(k, v))
    }

    /// Pushes `value` onto the queue named `key`.
    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let _ = (key, value);
        Err(StoreError::NotImplemented(
            "queue support is not implemented.",
        ))
    }

    /// Pops the front of the queue `key`; with `block`, waits (up to the store timeout)
    /// for an element, else fails at once with [`StoreError::QueueEmpty`].
    fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>, StoreError> {
        let _ = (key, block);
        Err(StoreError::NotImplemented(
            "queue support is not implemented.",
        ))
    }

    /// The length of the queue `key` (0 if it does not exist).
    fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        let _ = key;
        Err(StoreError::NotImplemented(
            "queue support is not implemented.",
        ))
    }

    /// Every user key in the store.
    fn list_keys(&self) -> Result<Vec<String>, StoreError> {
        Err(StoreError::NotImplemented("list_keys is not implemented."))
    }

    /// Blocks until `world_size` callers have called `barrier` with `key`.
    ///
    /// The default is PyTorch's `Store::barrier` fallback: `add(key/num_members)`, the
    /// last arrival sets `key/last_member`, everyone waits for it.
    fn barrier(
        &self,
        key: &str,
        world_size: i64,
        timeout: Option<Duration>,
    ) -> Result<(), StoreError> {
        use rdzv_core::store::semantics;
        let keys = semantics::barrier_fallback_keys(key.as_bytes());
        // Both are `key` plus an ASCII suffix, so still UTF-8.
        let members = String::from_utf8_lossy(&keys.num_members).into_owned();
        let last = String::from_utf8_lossy(&keys.last_member).into_owned();
        let arrived = self.add(&members, 1)?;
        if semantics::barrier_fallback_is_last(arrived, world_size) {
            self.set(&last, b"1")?;
        }
        self.wait(&[&last], timeout)
    }

    /// The default timeout of blocking calls.
    fn timeout(&self) -> Duration;

    /// Changes the default timeout of blocking calls.
    fn set_timeout(&self, timeout: Duration);

    /// A new handle to the same store (for the TCP store: a new connection).
    fn clone_store(&self) -> Result<Box<dyn Store>, StoreError>;
}
