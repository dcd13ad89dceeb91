//! PyTorch's `HashStoreTest` (the `StoreTestBase` cases), `TestMultiThreadedWait`'s
//! `test_wait_hash_store` and `PrefixStore` over a HashStore, against rdzv's in-process
//! store.

mod store_base;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv::uring::store::hash::HashStore;
use rdzv::uring::store::PrefixStore;
use rdzv::uring::{Store, StoreError};

#[test]
fn set_get_check() {
    // No internal keys: PyTorch's base `num_keys_total` of 5.
    store_base::set_get_check(&HashStore::new(), 5);
}

#[test]
fn compare_set() {
    store_base::compare_set(&HashStore::new());
}

#[test]
fn simple_wait() {
    store_base::simple_wait(&HashStore::new());
}

#[test]
fn append() {
    store_base::append(&HashStore::new());
}

#[test]
fn multi_set_get() {
    store_base::multi_set_get(&HashStore::new());
}

#[test]
fn clone_shares_the_data() {
    store_base::clone_shares(&HashStore::new());
}

#[test]
fn queues() {
    store_base::queues(&HashStore::new());
}

#[test]
fn queues_nonblocking() {
    store_base::queues_nonblocking(&HashStore::new());
}

#[test]
fn queues_bidirectional() {
    store_base::queues_bidirectional(&HashStore::new());
}

#[test]
fn queues_timeout() {
    let store = HashStore::new();
    let started = Instant::now();
    store_base::queues_timeout(&store);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn multi_threaded_wait() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    store_base::multi_threaded_wait(Arc::clone(&store), store);
}

#[test]
fn barrier_fallback() {
    store_base::barrier(&HashStore::new(), 4);
}

#[test]
fn get_times_out_on_a_missing_key() {
    let store = HashStore::new();
    store.set_timeout(Duration::from_millis(50));
    let err = store.get("nothing").unwrap_err();
    assert!(matches!(err, StoreError::Timeout { ms: 50, .. }), "{err:?}");
}

#[test]
fn wait_with_zero_timeout_waits_until_set() {
    let store = HashStore::new();
    let setter = store.clone();
    let handle = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        setter.set("late", b"1").unwrap();
    });
    // Zero is "no timeout" for the HashStore, as in PyTorch.
    store.wait(&["late"], Some(Duration::ZERO)).unwrap();
    handle.join().unwrap();
}

#[test]
fn delete_and_list_keys() {
    let store = HashStore::new();
    store.set("a", b"1").unwrap();
    store.set("b", b"2").unwrap();
    assert!(store.delete_key("a").unwrap());
    assert!(!store.delete_key("a").unwrap());
    assert_eq!(store.num_keys().unwrap(), 1);
    assert_eq!(store.list_keys().unwrap(), vec!["b".to_string()]);
}

#[test]
fn add_on_text_is_an_error_and_the_store_stays_usable() {
    let store = HashStore::new();
    store.set("text", b"abc").unwrap();
    let err = store.add("text", 1).unwrap_err();
    assert!(matches!(err, StoreError::NotACounter { .. }), "{err:?}");
    assert_eq!(store.add("n", 2).unwrap(), 2);
    assert_eq!(store.get("text").unwrap(), b"abc");
}

#[test]
fn prefix_hash_store() {
    let inner: Arc<dyn Store> = Arc::new(HashStore::new());
    let prefixed = PrefixStore::new("test_prefix", Arc::clone(&inner));
    store_base::set_get_check(&prefixed, 5);
    store_base::compare_set(&prefixed);
    store_base::append(&prefixed);
    store_base::queues(&prefixed);
    assert_eq!(inner.get("test_prefix/key").unwrap(), b"6");
    let listed = prefixed.list_keys().unwrap();
    assert!(listed.contains(&"key3".to_string()), "{listed:?}");
    assert!(Arc::ptr_eq(prefixed.underlying_store(), &inner));
}
