//! PyTorch's `FileStoreTest` (the `StoreTestBase` cases and `test_refcount`),
//! `PrefixFileStoreTest`, `TestMultiThreadedWait`'s file-store cases, and what a store in
//! a shared file must survive: several handles and processes at once, a file that a
//! crashed writer left with half a record, a file replaced under a handle.
//!
//! Every test works in its own temporary directory on real files. Several handles in one
//! process each open the file afresh for every operation, so their `flock`s exclude each
//! other exactly as between processes; `two_processes_share_a_file_store` also runs a
//! real second process (this test binary, re-run in child mode).

mod store_base;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rdzv::core::store::file_log::{Record, Records};
use rdzv::uring::store::file::FileStore;
use rdzv::uring::store::PrefixStore;
use rdzv::uring::{Store, StoreError};

fn dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn open(path: &Path) -> FileStore {
    FileStore::new(path, None).expect("open file store")
}

/// The records of a store file, asserting it is well-formed (no torn tail).
fn records_of(path: &Path) -> Vec<(Vec<u8>, Vec<u8>)> {
    let bytes = std::fs::read(path).expect("read store file");
    let mut records = Records::new(&bytes);
    let out = records
        .by_ref()
        .map(|r| (r.key.to_vec(), r.value.to_vec()))
        .collect();
    assert_eq!(records.torn_tail(), None, "store file has a torn tail");
    assert_eq!(records.consumed(), bytes.len());
    out
}

fn append_raw(path: &Path, bytes: &[u8]) {
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .expect("open store file");
    file.write_all(bytes).expect("append");
}

#[test]
fn set_get_check() {
    let dir = dir();
    // refcount/ is a key too: PyTorch's FileStoreTest.num_keys_total is 6.
    store_base::set_get_check(&open(&dir.path().join("store")), 6);
}

#[test]
fn compare_set() {
    let dir = dir();
    store_base::compare_set(&open(&dir.path().join("store")));
}

#[test]
fn simple_wait() {
    let dir = dir();
    store_base::simple_wait(&open(&dir.path().join("store")));
}

#[test]
fn append_through_the_compare_set_fallback() {
    let dir = dir();
    store_base::append(&open(&dir.path().join("store")));
}

#[test]
fn multi_set_get() {
    let dir = dir();
    store_base::multi_set_get(&open(&dir.path().join("store")));
}

#[test]
fn clone_opens_another_handle() {
    let dir = dir();
    let path = dir.path().join("store");
    let store = open(&path);
    store_base::clone_shares(&store);
    // The clone counted itself and, dropped, counted itself out.
    let refcount = store.clone_store().unwrap();
    // refcount/, cleanup/ (the first clone was dropped), /clone_foo, /clone_back.
    assert_eq!(refcount.num_keys().unwrap(), 4);
    drop(refcount);
    let values: Vec<_> = records_of(&path)
        .into_iter()
        .filter(|(k, _)| k == b"refcount/")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(values.last().map(Vec::as_slice), Some(&b"1"[..]));
}

#[test]
fn queues_are_not_implemented() {
    let dir = dir();
    let store = open(&dir.path().join("store"));
    for err in [
        store.queue_push("q", b"1").unwrap_err(),
        store.queue_pop("q", false).unwrap_err(),
        store.queue_len("q").unwrap_err(),
    ] {
        assert_eq!(err.to_string(), "queue support is not implemented.");
    }
}

#[test]
fn get_timeout_has_pytorch_s_text() {
    let dir = dir();
    let store = open(&dir.path().join("store"));
    store.set_timeout(Duration::from_millis(50));
    let started = Instant::now();
    let err = store.get("missing").unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(50));
    assert_eq!(
        err.to_string(),
        "Timeout waiting for key: missing after 50 ms"
    );
    let err = store.wait(&["missing"], None).unwrap_err();
    assert_eq!(err.to_string(), "wait timeout after 50ms, keys: /missing");
}

#[test]
fn pytorch_key_layout_on_disk() {
    let dir = dir();
    let path = dir.path().join("store");
    let store = open(&path);
    store.set("k", b"v").unwrap();
    store.add("n", 41).unwrap();
    store.add("n", 1).unwrap();
    assert!(store.delete_key("k").unwrap());
    // Deleting a missing key still says true, as PyTorch's FileStore does.
    assert!(store.delete_key("never").unwrap());
    let expected: Vec<(Vec<u8>, Vec<u8>)> = [
        (&b"refcount/"[..], &b"1"[..]),
        (b"/k", b"v"),
        (b"/n", b"41"),
        (b"/n", b"42"),
        (b"-/k", b""),
        (b"-/never", b""),
    ]
    .iter()
    .map(|(k, v)| (k.to_vec(), v.to_vec()))
    .collect();
    assert_eq!(records_of(&path), expected);
    // The internal counter is counted but not listed.
    assert_eq!(store.num_keys().unwrap(), 2);
    assert_eq!(store.list_keys().unwrap(), vec!["n".to_string()]);
}

/// FileStoreTest.test_refcount.
#[test]
fn refcount_removes_the_file_after_the_last_handle() {
    let dir = dir();
    let path = dir.path().join("store");
    let a = FileStore::new(&path, Some(1)).unwrap();
    let b = FileStore::new(&path, Some(1)).unwrap();
    drop(a);
    assert!(path.exists());
    drop(b);
    assert!(!path.exists());
}

#[test]
fn a_store_without_fixed_world_size_keeps_its_file() {
    let dir = dir();
    let path = dir.path().join("store");
    let a = FileStore::new(&path, None).unwrap();
    a.set("k", b"v").unwrap();
    drop(a);
    assert!(path.exists());
    let b = open(&path);
    assert_eq!(b.get("k").unwrap(), b"v");
    assert_eq!(b.num_keys().unwrap(), 3, "refcount/, cleanup/ and /k");
}

#[test]
fn a_fixed_store_waits_for_every_participant_to_finish() {
    let dir = dir();
    let path = dir.path().join("store");
    // World size 2, but the two handles come and go one after the other: when the
    // first is dropped the refcount is 0 with one finished, so the file stays.
    drop(FileStore::new(&path, Some(2)).unwrap());
    assert!(path.exists());
    drop(FileStore::new(&path, Some(2)).unwrap());
    assert!(!path.exists());
}

#[test]
fn dropping_after_the_file_is_gone_does_nothing() {
    let dir = dir();
    let path = dir.path().join("store");
    let store = FileStore::new(&path, Some(1)).unwrap();
    std::fs::remove_file(&path).unwrap();
    drop(store);
    assert!(!path.exists());
}

/// PrefixFileStoreTest: the base tests over `PrefixStore("test_prefix", FileStore)`.
#[test]
fn prefix_file_store() {
    let dir = dir();
    let inner: Arc<dyn Store> = Arc::new(open(&dir.path().join("store")));
    let prefixed = PrefixStore::new("test_prefix", Arc::clone(&inner));
    store_base::set_get_check(&prefixed, 6);
    store_base::compare_set(&prefixed);
    store_base::simple_wait(&prefixed);
    store_base::append(&prefixed);
    store_base::multi_set_get(&prefixed);
    assert_eq!(inner.get("test_prefix/key").unwrap(), b"6");
    let listed = prefixed.list_keys().unwrap();
    assert!(listed.contains(&"key3".to_string()), "{listed:?}");
    assert!(!listed.iter().any(|k| k.contains("refcount")), "{listed:?}");
}

/// TestMultiThreadedWait.test_wait_file_store: one handle shared by both threads.
#[test]
fn multi_threaded_wait_one_handle() {
    let dir = dir();
    let store: Arc<dyn Store> = Arc::new(open(&dir.path().join("store")));
    store_base::multi_threaded_wait(Arc::clone(&store), store);
}

/// The same with a handle per thread, as two processes would have.
#[test]
fn multi_threaded_wait_two_handles() {
    let dir = dir();
    let path = dir.path().join("store");
    store_base::multi_threaded_wait(Arc::new(open(&path)), Arc::new(open(&path)));
}

/// TestMultiThreadedWait.test_wait_prefix_file_store.
#[test]
fn multi_threaded_wait_prefix_file_store() {
    let dir = dir();
    let path = dir.path().join("store");
    let rank =
        |store: FileStore| -> Arc<dyn Store> { Arc::new(PrefixStore::new("pre", Arc::new(store))) };
    store_base::multi_threaded_wait(rank(open(&path)), rank(open(&path)));
}

#[test]
fn barrier_fallback() {
    let dir = dir();
    store_base::barrier(&open(&dir.path().join("store")), 3);
}

/// Handles in several threads, each with its own open file descriptions, racing on one
/// counter and one compare-and-set append: the exclusive `flock` makes every
/// read-modify-write atomic.
#[test]
fn concurrent_handles_lose_no_update() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 50;
    let dir = dir();
    let path = dir.path().join("store");
    let workers: Vec<_> = (0..THREADS)
        .map(|i| {
            let path = path.clone();
            thread::spawn(move || {
                let store = open(&path);
                for _ in 0..ROUNDS {
                    store.add("counter", 1).unwrap();
                }
                store.append("log", &[b'a' + i as u8]).unwrap();
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    let store = open(&path);
    assert_eq!(
        store.get("counter").unwrap(),
        (THREADS * ROUNDS).to_string().as_bytes()
    );
    let mut log = store.get("log").unwrap();
    log.sort_unstable();
    assert_eq!(log, b"abcd");
    records_of(&path);
}

const CHILD_ENV: &str = "RDZV_FILE_STORE_CHILD";
const ROUNDS_PER_PROCESS: i64 = 100;

/// Two processes (this test binary, re-run in child mode) add to one counter through
/// one file, then the last handle of the world-size-2 store removes the file.
#[test]
fn two_processes_share_a_file_store() {
    if let Some(path) = rdzv_test_support::peer_env(CHILD_ENV) {
        // Child: the second participant (it exits if the parent goes away).
        let store = FileStore::new(PathBuf::from(path), Some(2)).unwrap();
        store.wait(&["go"], Some(Duration::from_secs(30))).unwrap();
        for _ in 0..ROUNDS_PER_PROCESS {
            store.add("counter", 1).unwrap();
        }
        store.set("child_done", b"1").unwrap();
        return;
    }
    let dir = dir();
    let path = dir.path().join("store");
    let store = FileStore::new(&path, Some(2)).unwrap();
    let mut child = rdzv_test_support::Peer::spawn_test(
        "two_processes_share_a_file_store",
        &[],
        &[(CHILD_ENV, &path)],
    );
    store.set("go", b"1").unwrap();
    for _ in 0..ROUNDS_PER_PROCESS {
        store.add("counter", 1).unwrap();
    }
    let done = store.wait(&["child_done"], Some(Duration::from_secs(30)));
    if done.is_err() {
        child.release();
    }
    let status = child.wait(Duration::from_secs(60));
    assert!(
        done.is_ok() && status.success(),
        "child failed ({done:?}): {status} (its output is above)"
    );
    assert_eq!(
        store.get("counter").unwrap(),
        (2 * ROUNDS_PER_PROCESS).to_string().as_bytes()
    );
    // The child's handle is gone: one finished, one reference left.
    records_of(&path);
    drop(store);
    assert!(!path.exists(), "both participants finished: file removed");
}

/// A writer crashed after writing part of a record. The earlier keys stay readable, the
/// torn record never appears, the next write cuts it off, and the log is well-formed
/// again for a fresh handle.
#[test]
fn torn_record_recovery() {
    let dir = dir();
    let path = dir.path().join("store");
    {
        let store = open(&path);
        store.set("a", b"1").unwrap();
        store.set("b", b"2").unwrap();
    }
    let clean_len = std::fs::metadata(&path).unwrap().len();
    // A record for "/torn" cut in the middle of its value.
    let mut half = Vec::new();
    Record::new(b"/torn", b"never-finished")
        .encode_into(&mut half)
        .unwrap();
    half.truncate(half.len() - 5);
    append_raw(&path, &half);

    // Opening writes refcount/ and therefore cuts the torn tail first.
    let store = open(&path);
    assert_eq!(store.get("a").unwrap(), b"1");
    assert_eq!(store.get("b").unwrap(), b"2");
    assert!(!store.check(&["torn"]).unwrap());
    store.set("c", b"3").unwrap();
    let records = records_of(&path);
    assert!(!records.iter().any(|(k, _)| k == b"/torn"));

    let fresh = open(&path);
    assert_eq!(fresh.get("c").unwrap(), b"3");
    assert_eq!(fresh.get("a").unwrap(), b"1");
    assert_eq!(
        fresh.list_keys().unwrap(),
        vec!["a".to_string(), "b".to_string(), "c".to_string()]
    );
    assert!(std::fs::metadata(&path).unwrap().len() > clean_len);
}

/// A torn header (two bytes of a length field) seen by a handle that only reads: reads
/// ignore it, and the handle's next write repairs the file.
#[test]
fn torn_header_seen_by_a_reader_then_repaired() {
    let dir = dir();
    let path = dir.path().join("store");
    let store = open(&path);
    store.set("a", b"1").unwrap();
    append_raw(&path, &[7, 0]);
    assert_eq!(store.get("a").unwrap(), b"1");
    assert!(!store.check(&["b"]).unwrap());
    assert_eq!(store.num_keys().unwrap(), 2);
    store.set_timeout(Duration::from_millis(30));
    assert!(matches!(
        store.get("b").unwrap_err(),
        StoreError::GetTimeout { .. }
    ));
    store.set("b", b"2").unwrap();
    records_of(&path);
    let fresh = open(&path);
    assert_eq!(fresh.get("b").unwrap(), b"2");
}

/// A reader opens a path whose file does not exist yet: it retries until a writer
/// creates it (pytorch/pytorch#13750). A handle whose file was deleted and created anew
/// reads the new file from its start.
#[test]
fn a_reader_waits_for_the_file_and_follows_a_new_one() {
    let dir = dir();
    let path = dir.path().join("store");
    let reader = open(&path);
    reader.set("old", b"stale").unwrap();
    reader.set("padding", &[b'x'; 256]).unwrap();
    std::fs::remove_file(&path).unwrap();
    let writer_path = path.clone();
    let writer = thread::spawn(move || {
        thread::sleep(Duration::from_millis(50));
        let store = open(&writer_path);
        store.set("new", b"fresh").unwrap();
        store
    });
    assert_eq!(reader.get("new").unwrap(), b"fresh");
    assert!(!reader.check(&["old"]).unwrap());
    let writer = writer.join().unwrap();
    reader.set("from_reader", b"ok").unwrap();
    assert_eq!(writer.get("from_reader").unwrap(), b"ok");
    records_of(&path);
}

#[test]
fn delete_key_does_not_create_the_file() {
    let dir = dir();
    let path = dir.path().join("store");
    let store = FileStore::with_timeout(&path, None, Duration::from_millis(30)).unwrap();
    std::fs::remove_file(&path).unwrap();
    let err = store.delete_key("k").unwrap_err();
    assert!(
        matches!(err, StoreError::File { op: "open", .. }),
        "{err:?}"
    );
    assert!(!path.exists());
}

/// The bytes PyTorch 2.15's `FileStore` wrote for: `FileStore(path, -1)`, `set("from_py",
/// "hello")`, `add("py_counter", 5)`, `add("py_counter", 2)`, `set("doomed", "x")`,
/// `delete_key("doomed")`, `compare_set("py_cas", "", "first")`,
/// `set("bin", bytes([0, 1, 2, 255]))`, then `del store` (captured once, by hand, from
/// `torch.distributed.FileStore`). rdzv must read such a file and append to it in kind.
const PYTORCH_2_15_FILE: &[u8] =
    b"\x09\x00\x00\x00refcount/\x01\x00\x00\x001\x08\x00\x00\x00/from_py\x05\x00\x00\
      \x00hello\x0b\x00\x00\x00/py_counter\x01\x00\x00\x005\x0b\x00\x00\x00/py_counter\
      \x01\x00\x00\x007\x07\x00\x00\x00/doomed\x01\x00\x00\x00x\x08\x00\x00\x00-/doome\
      d\x00\x00\x00\x00\x07\x00\x00\x00/py_cas\x05\x00\x00\x00first\x04\x00\x00\x00/bi\
      n\x04\x00\x00\x00\x00\x01\x02\xff\x08\x00\x00\x00cleanup/\x01\x00\x00\x001\x09\
      \x00\x00\x00refcount/\x01\x00\x00\x000";

#[test]
fn reads_and_extends_a_file_pytorch_wrote() {
    let dir = dir();
    let path = dir.path().join("store");
    std::fs::write(&path, PYTORCH_2_15_FILE).unwrap();
    let store = open(&path);
    assert_eq!(store.get("from_py").unwrap(), b"hello");
    assert_eq!(store.get("py_counter").unwrap(), b"7");
    assert_eq!(store.add("py_counter", 1).unwrap(), 8);
    assert!(!store.check(&["doomed"]).unwrap());
    assert_eq!(
        store.compare_set("py_cas", b"first", b"second").unwrap(),
        b"second"
    );
    assert_eq!(store.get("bin").unwrap(), [0, 1, 2, 255]);
    // refcount/, cleanup/ and four user keys.
    assert_eq!(store.num_keys().unwrap(), 6);
    assert_eq!(
        store.list_keys().unwrap(),
        vec!["bin", "from_py", "py_cas", "py_counter"]
    );
    drop(store);
    let records = records_of(&path);
    assert_eq!(
        &records[records.len() - 2..],
        &[
            (b"cleanup/".to_vec(), b"2".to_vec()),
            (b"refcount/".to_vec(), b"0".to_vec())
        ]
    );
}

/// Writes `count` keys `k00..` with values `v00..` through one handle and returns the file's
/// bytes and where each record starts.
fn file_of_keys(path: &Path, count: usize) -> (Vec<u8>, Vec<usize>) {
    {
        let store = open(path);
        for i in 0..count {
            store
                .set(&format!("k{i:02}"), format!("v{i:02}").as_bytes())
                .unwrap();
        }
    }
    let bytes = std::fs::read(path).unwrap();
    let mut starts = Vec::new();
    let mut records = Records::new(&bytes);
    loop {
        let at = records.consumed();
        if records.next().is_none() {
            break;
        }
        starts.push(at);
    }
    (bytes, starts)
}

/// A crash can cut the last record at any byte: for every cut, the next handle keeps every
/// whole record, cuts only the torn bytes and leaves a well-formed PyTorch file.
#[test]
fn truncation_at_every_byte_of_a_record_loses_nothing_whole() {
    let dir = dir();
    let clean = dir.path().join("clean");
    let (base, _) = file_of_keys(&clean, 4);
    let mut last = Vec::new();
    Record::new(b"/last", b"the last value, cut by a crash")
        .encode_into(&mut last)
        .unwrap();
    for cut in 1..last.len() {
        let path = dir.path().join(format!("cut{cut}"));
        let mut bytes = base.clone();
        bytes.extend_from_slice(&last[..cut]);
        std::fs::write(&path, &bytes).unwrap();
        let store = open(&path);
        for i in 0..4 {
            assert_eq!(
                store.get(&format!("k{i:02}")).unwrap(),
                format!("v{i:02}").as_bytes(),
                "cut {cut}"
            );
        }
        assert!(!store.check(&["last"]).unwrap(), "cut {cut}");
        drop(store);
        let records = records_of(&path);
        assert!(records.len() > 4, "cut {cut}");
        let after = std::fs::read(&path).unwrap();
        assert_eq!(
            &after[..base.len()],
            &base[..],
            "cut {cut}: whole records changed"
        );
    }
}

/// A length field damaged in the middle (the probe's case: 64 keys, one bad length) is
/// corruption: every operation fails naming the file and the offset, and the file is not
/// changed by a single byte, so the 33 keys behind it can still be recovered.
#[test]
fn a_corrupt_length_mid_file_is_an_error_and_nothing_is_cut() {
    let dir = dir();
    let path = dir.path().join("store");
    let (mut bytes, starts) = file_of_keys(&path, 64);
    // starts[0] is refcount/, so starts[32] is k31's record.
    let bad_at = starts[32];
    bytes[bad_at..bad_at + 4].copy_from_slice(&0x0100_0000u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();

    let err = FileStore::new(&path, None).unwrap_err();
    match &err {
        StoreError::CorruptFile {
            path: p,
            offset,
            record_at,
            ..
        } => {
            assert_eq!(p, &path);
            assert_eq!(*offset, bad_at as u64);
            assert_eq!(*record_at, starts[33] as u64);
        }
        other => panic!("expected CorruptFile, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(text.contains(&format!("offset {bad_at}")), "{text}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "the file was changed");

    // A damaged value length: the same, for a handle that reads and one that writes.
    let other = dir.path().join("other");
    let (mut bytes, starts) = file_of_keys(&other, 8);
    let bad_at = starts[4];
    // [key length][/k03][value length][v03]: the value length is at +8.
    bytes[bad_at + 8..bad_at + 12].copy_from_slice(&u32::MAX.to_le_bytes());
    std::fs::write(&other, &bytes).unwrap();
    let err = FileStore::new(&other, None).unwrap_err();
    assert!(
        matches!(err, StoreError::CorruptFile { offset, .. } if offset == bad_at as u64),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&other).unwrap(),
        bytes,
        "the file was changed"
    );
}

/// Garbage after the last record (no whole record in it) is a torn tail: it is cut and
/// every whole record kept.
#[test]
fn a_garbage_tail_is_cut_and_nothing_whole_is_lost() {
    let dir = dir();
    let path = dir.path().join("store");
    let (base, _) = file_of_keys(&path, 8);
    append_raw(
        &path,
        b"\xde\xad\xbe\xef garbage that a crash left, holding no record",
    );
    let store = open(&path);
    store.set("after", b"ok").unwrap();
    for i in 0..8 {
        assert_eq!(
            store.get(&format!("k{i:02}")).unwrap(),
            format!("v{i:02}").as_bytes()
        );
    }
    drop(store);
    let records = records_of(&path);
    assert!(records.iter().any(|(k, v)| k == b"/after" && v == b"ok"));
    assert_eq!(&std::fs::read(&path).unwrap()[..base.len()], &base[..]);
}
