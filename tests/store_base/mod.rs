//! PyTorch's `StoreTestBase` and `TestMultiThreadedWait` cases
//! (`test/distributed/test_store.py`), written once against `&dyn Store` and run by
//! `store_tcp.rs`, `store_file.rs` and `store_hash.rs` over each store. Each test file
//! uses its subset.
#![allow(dead_code)]

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use rdzv::uring::{Store, StoreError};

/// `test_set_get_check`: counters, values, `check`, and a user key starting with `-`
/// (which must not read as a FileStore tombstone).
pub(crate) fn set_get_check(store: &dyn Store, num_keys_total: i64) {
    store.add("key", 1).unwrap();
    store.add("key", 2).unwrap();
    store.add("key", 3).unwrap();
    store.set("key0", b"value0").unwrap();
    store.add("key3", 1).unwrap();
    store.set("key1", b"value1").unwrap();
    store.add("key3", 2).unwrap();
    store.set("key2", b"value2").unwrap();
    store.add("key3", 3).unwrap();
    store.add("key3", 4).unwrap();
    store.add("key3", 5).unwrap();
    store.add("key3", 6).unwrap();
    assert_eq!(store.num_keys().unwrap(), num_keys_total);
    assert_eq!(store.get("key").unwrap(), b"6");
    assert_eq!(store.get("key0").unwrap(), b"value0");
    assert_eq!(store.get("key1").unwrap(), b"value1");
    assert_eq!(store.get("key2").unwrap(), b"value2");
    assert_eq!(store.get("key3").unwrap(), b"21");
    assert!(store.check(&["key3"]).unwrap());
    assert!(!store.check(&["Randomkey3"]).unwrap());
    store.set("-key3", b"7").unwrap();
    assert_eq!(store.get("-key3").unwrap(), b"7");
    assert!(store.delete_key("-key3").unwrap());
    assert_eq!(store.num_keys().unwrap(), num_keys_total);
    assert!(!store.check(&["-key3"]).unwrap());
    assert!(store.check(&["key3"]).unwrap());
}

/// `test_compare_set`: the four cases.
pub(crate) fn compare_set(store: &dyn Store) {
    store.set("cs_key0", b"value0").unwrap();
    assert_eq!(store.get("cs_key0").unwrap(), b"value0");
    assert_eq!(
        store
            .compare_set("cs_key0", b"wrong_old_value", b"new_value0")
            .unwrap(),
        b"value0"
    );
    assert_eq!(store.get("cs_key0").unwrap(), b"value0");
    assert_eq!(
        store
            .compare_set("cs_key0", b"value0", b"new_value0")
            .unwrap(),
        b"new_value0"
    );
    assert_eq!(store.get("cs_key0").unwrap(), b"new_value0");
    assert_eq!(
        store.compare_set("cs_key1", b"", b"new_value1").unwrap(),
        b"new_value1"
    );
    assert_eq!(store.get("cs_key1").unwrap(), b"new_value1");
    assert_eq!(
        store
            .compare_set("missing_key", b"wrong_old_value", b"x")
            .unwrap(),
        b"wrong_old_value"
    );
    assert!(!store.check(&["missing_key"]).unwrap());
}

/// `test_simple_wait`: a wait on a missing key times out with a message matching
/// `[t -i]imeout`; after an `add` the wait returns.
pub(crate) fn simple_wait(store: &dyn Store) {
    let err = store
        .wait(&["bad_key"], Some(Duration::from_millis(250)))
        .unwrap_err();
    assert!(matches!(err, StoreError::Timeout { .. }), "{err:?}");
    assert!(err.to_string().contains("imeout"), "{err}");
    store.add("good_key", 1).unwrap();
    store.wait(&["good_key"], None).unwrap();
}

/// `test_append`, including appends to a missing key.
pub(crate) fn append(store: &dyn Store) {
    store.set("foo", b"po").unwrap();
    store.append("foo", b"tato").unwrap();
    store.append("bar", b"po").unwrap();
    store.append("bar", b"tato").unwrap();
    assert_eq!(store.get("foo").unwrap(), b"potato");
    assert_eq!(store.get("bar").unwrap(), b"potato");
}

/// `test_multi_set` and `test_multi_get`.
pub(crate) fn multi_set_get(store: &dyn Store) {
    store.multi_set(&[("m1", b"po"), ("m2", b"tato")]).unwrap();
    assert_eq!(store.get("m1").unwrap(), b"po");
    assert_eq!(store.get("m2").unwrap(), b"tato");
    assert_eq!(
        store.multi_get(&["m1", "m2"]).unwrap(),
        vec![b"po".to_vec(), b"tato".to_vec()]
    );
}

/// `test_clone`: a clone sees what the original wrote.
pub(crate) fn clone_shares(store: &dyn Store) {
    let other = store.clone_store().unwrap();
    store.set("clone_foo", b"bar").unwrap();
    assert_eq!(other.get("clone_foo").unwrap(), b"bar");
    other.set("clone_back", b"baz").unwrap();
    assert_eq!(store.get("clone_back").unwrap(), b"baz");
}

/// `test_queues`.
pub(crate) fn queues(store: &dyn Store) {
    assert!(!store.check(&["q"]).unwrap());
    assert_eq!(store.queue_len("q").unwrap(), 0);
    store.queue_push("q", b"1").unwrap();
    store.queue_push("q", b"2").unwrap();
    assert!(store.check(&["q"]).unwrap());
    assert_eq!(store.queue_len("q").unwrap(), 2);
    store.wait(&["q"], None).unwrap();
    assert_eq!(store.queue_pop("q", true).unwrap(), b"1");
    assert_eq!(store.queue_pop("q", true).unwrap(), b"2");
    assert!(!store.check(&["q"]).unwrap());
    assert_eq!(store.queue_len("q").unwrap(), 0);
}

/// `test_queues_nonblocking`.
pub(crate) fn queues_nonblocking(store: &dyn Store) {
    let err = store.queue_pop("foo", false).unwrap_err();
    assert!(matches!(err, StoreError::QueueEmpty), "{err:?}");
    assert!(err.to_string().contains("empty"), "{err}");
    store.queue_push("foo", b"a").unwrap();
    assert_eq!(store.queue_pop("foo", false).unwrap(), b"a");
}

/// `test_queues_bidirectional`: two threads on clones exchange through queues `a`, `b`.
pub(crate) fn queues_bidirectional(store: &dyn Store) {
    let a = store.clone_store().unwrap();
    let b = store.clone_store().unwrap();
    let worker_a = thread::spawn(move || {
        a.queue_push("a", b"a1").unwrap();
        a.queue_pop("b", true).unwrap()
    });
    let worker_b = thread::spawn(move || {
        let got = b.queue_pop("a", true).unwrap();
        b.queue_push("b", b"b1").unwrap();
        got
    });
    assert_eq!(worker_b.join().unwrap(), b"a1");
    assert_eq!(worker_a.join().unwrap(), b"b1");
}

/// `test_queues_timeout`: a blocking pop on an empty queue fails with a timeout.
pub(crate) fn queues_timeout(store: &dyn Store) {
    store.set_timeout(Duration::from_millis(10));
    let err = store.queue_pop("non_existant", true).unwrap_err();
    assert!(err.to_string().contains("timeout"), "{err}");
}

/// `TestMultiThreadedWait`: rank 0 waits for `key1` then reads it; rank 1 sets it.
/// `stores` are the two ranks' handles (the same store twice, or two handles on it).
pub(crate) fn multi_threaded_wait(rank0: Arc<dyn Store>, rank1: Arc<dyn Store>) {
    let waiter = thread::spawn(move || {
        rank0.wait(&["key1"], Some(Duration::from_secs(2))).unwrap();
        rank0.get("key1").unwrap()
    });
    let setter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(50));
        rank1.set("key1", b"value1").unwrap();
    });
    setter.join().unwrap();
    assert_eq!(waiter.join().unwrap(), b"value1");
}

/// `Store::barrier`'s add-and-wait fallback, with `n` threads on clones.
pub(crate) fn barrier(store: &dyn Store, n: usize) {
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let clone = store.clone_store().unwrap();
            thread::spawn(move || {
                clone
                    .barrier("bar", n as i64, Some(Duration::from_secs(10)))
                    .unwrap();
                clone.add("after_barrier", 1).unwrap()
            })
        })
        .collect();
    let mut arrivals: Vec<i64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    arrivals.sort_unstable();
    assert_eq!(arrivals, (1..=n as i64).collect::<Vec<_>>());
}
