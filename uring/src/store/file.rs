//! `FileStore`: PyTorch's c10d `FileStore`, a store kept in one append-only file that
//! every participant opens (on a local or shared filesystem).
//!
//! The file is byte-compatible with PyTorch's (`FileStore.cpp`): rdzv and PyTorch
//! processes can share one store file. Its record format, the `/` user-key prefix, the
//! `-` tombstones, the raw `refcount/` and `cleanup/` counters and the torn-tail policy
//! are decided in `rdzv_core::store::file_log`; what `add` and `compare_set` mean is
//! decided in `rdzv_core::store::semantics`. This module owns the file: it opens it,
//! locks it, reads what is new, appends, and polls.
//!
//! As in PyTorch, every operation takes the handle's process-local mutex, opens the
//! file afresh (readers `O_RDONLY`, writers `O_RDWR|O_CREAT` with mode 0644, `delete_key`
//! `O_RDWR`; an open that finds no file retries every 10 ms until the store timeout,
//! pytorch/pytorch#13750), takes `flock(LOCK_SH)` to read or `flock(LOCK_EX)` to write
//! (whole-file locks, held per open file description, so two handles in one process
//! exclude each other just as two processes do), reads the records appended since its
//! last visit into its cache, and, to write, appends one record at the end. `get` and
//! `wait` poll every 10 ms (PyTorch: "Not using inotify because it doesn't work on many
//! shared filesystems (such as NFS)"); a zero timeout waits forever.
//!
//! Where rdzv differs from PyTorch, on purpose:
//! * every write first reads to the end of the file and, holding the exclusive lock,
//!   cuts off a torn tail (a record a crashed writer left half written) before it
//!   appends; PyTorch spins forever on such a file (see `file_log`'s module docs). A
//!   record is appended with one `write` where PyTorch uses four.
//! * a bad record with whole records behind it is mid-file corruption, not a torn tail
//!   (`file_log::classify_tail`): every operation then fails with
//!   [`StoreError::CorruptFile`], naming the file and the offset, and nothing is cut or
//!   appended. PyTorch would spin on such a file, or append after it.
//! * [`Store::list_keys`] returns only user keys; PyTorch's `k.substr(1)` over every
//!   cache entry also lists the internal counters as `efcount/` and `leanup/`.
//!   [`Store::num_keys`] counts internal keys, as PyTorch does.
//! * a handle that finds another file at the path (another inode: the file was deleted
//!   and created anew) or a file shorter than what it already read forgets its cache and
//!   reads the file from the start; PyTorch keeps reading at its old position.
//! * dropping a handle whose directory vanished does not retry its opens for the whole
//!   timeout.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use rdzv_core::store::file_log::{self, LogCache, Record, CLEANUP_KEY, REFCOUNT_KEY};
use rdzv_core::store::semantics::{self, Decimal};
use rustix::fs::{flock, FlockOperation};

use super::{Store, StoreError, DEFAULT_TIMEOUT};

/// How long `get`, `wait` and a retried open sleep between two looks at the file.
pub const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// Read buffers larger than this are given back after use rather than kept.
const KEEP_BUFFER: usize = 1 << 20;

/// How an operation opens the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// `O_RDONLY`, shared lock.
    Read,
    /// `O_RDWR | O_CREAT` (0644), exclusive lock.
    Write,
    /// `O_RDWR` without creating the file (PyTorch's `deleteKey`), exclusive lock.
    WriteExisting,
}

/// What a write decides once it has seen the current state: the record to append, if
/// any, and the result to return.
type Decision<T> = (Option<Vec<u8>>, T);

/// The cache of the file and the buffer it is read through.
#[derive(Default)]
struct State {
    cache: LogCache,
    buf: Vec<u8>,
    /// The device and inode of the file the cache was read from.
    identity: Option<(u64, u64)>,
}

/// The file and the handle's view of it: everything but the handle's lifetime rules.
struct Log {
    path: PathBuf,
    /// PyTorch's `activeFileOpLock_` together with `cache_` and `pos_`.
    state: Mutex<State>,
}

/// A c10d store in a file shared by all participants (PyTorch's `FileStore`).
///
/// Each handle counts itself in the file's `refcount/` when created. Dropping it does
/// PyTorch's destructor cleanup: it adds 1 to `cleanup/` and -1 to `refcount/`, and
/// the last handle of a store with a fixed world size removes the file once
/// `cleanup/` reaches that size.
pub struct FileStore {
    log: Log,
    world_size: Option<u32>,
    timeout: Mutex<Duration>,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("path", &self.log.path)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

/// When a wait of `timeout` that starts now ends; `None` (never) for a zero timeout,
/// PyTorch's `kNoTimeout`.
fn deadline_after(timeout: Duration) -> Option<Instant> {
    if timeout.is_zero() {
        None
    } else {
        Instant::now().checked_add(timeout)
    }
}

fn expired(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

impl Log {
    fn error(&self, op: &'static str, source: io::Error) -> StoreError {
        StoreError::File {
            op,
            path: self.path.clone(),
            source,
        }
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens the file, retrying every [`POLL_INTERVAL`] while it does not exist until
    /// `deadline`.
    fn open(&self, access: Access, deadline: Option<Instant>) -> Result<File, StoreError> {
        let mut options = OpenOptions::new();
        options.read(true);
        if access != Access::Read {
            options.write(true);
        }
        if access == Access::Write {
            options.create(true).mode(0o644);
        }
        loop {
            match options.open(&self.path) {
                Ok(file) => return Ok(file),
                Err(e) if e.kind() == io::ErrorKind::NotFound && !expired(deadline) => {
                    thread::sleep(POLL_INTERVAL)
                }
                Err(e) => return Err(self.error("open", e)),
            }
        }
    }

    /// Takes the whole-file lock; it is released when `file` is closed.
    fn lock_file(&self, file: &File, access: Access) -> Result<(), StoreError> {
        let operation = match access {
            Access::Read => FlockOperation::LockShared,
            Access::Write | Access::WriteExisting => FlockOperation::LockExclusive,
        };
        loop {
            match flock(file, operation) {
                Ok(()) => return Ok(()),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(self.error("flock", e.into())),
            }
        }
    }

    /// Reads what was appended since the last visit into the cache (PyTorch's
    /// `refresh`). The caller holds a file lock, so the file does not grow meanwhile.
    fn refresh(&self, state: &mut State, file: &mut File) -> Result<(), StoreError> {
        let meta = file.metadata().map_err(|e| self.error("stat", e))?;
        let identity = (meta.dev(), meta.ino());
        if state.identity != Some(identity) {
            // Another file now lives at the path (deleted and created anew): what the
            // cache read came from the old one.
            if state.identity.is_some() {
                state.cache.reset();
            }
            state.identity = Some(identity);
        }
        let len = meta.len();
        let Some(from) = state.cache.read_from(len) else {
            return Ok(());
        };
        file.seek(SeekFrom::Start(from))
            .map_err(|e| self.error("seek", e))?;
        state.buf.clear();
        // Bounded by the length seen: the allocation follows the bytes on disk, never a
        // length field.
        file.take(len - from)
            .read_to_end(&mut state.buf)
            .map_err(|e| self.error("read", e))?;
        state.cache.replay(&state.buf);
        if state.buf.capacity() > KEEP_BUFFER {
            state.buf = Vec::new();
        }
        match state.cache.corruption() {
            None => Ok(()),
            Some(corrupt) => {
                let offset = state.cache.offset();
                Err(StoreError::CorruptFile {
                    path: self.path.clone(),
                    offset,
                    claimed: corrupt.bad.claimed,
                    present: corrupt.bad.len as u64,
                    record_at: offset.saturating_add(corrupt.record_at as u64),
                })
            }
        }
    }

    /// A read-only operation: opens, takes the shared lock, refreshes, then asks `f`.
    fn read<T>(
        &self,
        deadline: Option<Instant>,
        f: impl FnOnce(&LogCache) -> T,
    ) -> Result<T, StoreError> {
        let mut state = self.lock_state();
        let mut file = self.open(Access::Read, deadline)?;
        self.lock_file(&file, Access::Read)?;
        self.refresh(&mut state, &mut file)?;
        Ok(f(&state.cache))
    }

    /// A writing operation: opens, takes the exclusive lock, refreshes, lets `decide`
    /// choose the record to append, cuts off a torn tail and appends it.
    fn write<T>(
        &self,
        access: Access,
        deadline: Option<Instant>,
        decide: impl FnOnce(&LogCache) -> Result<Decision<T>, StoreError>,
    ) -> Result<T, StoreError> {
        let mut state = self.lock_state();
        let mut file = self.open(access, deadline)?;
        self.lock_file(&file, access)?;
        self.refresh(&mut state, &mut file)?;
        let (record, result) = decide(&state.cache)?;
        let Some(record) = record else {
            return Ok(result);
        };
        if let Some(torn) = state.cache.torn_tail() {
            let at = state.cache.offset();
            file.set_len(at).map_err(|e| self.error("truncate", e))?;
            tracing::warn!(
                path = %self.path.display(),
                offset = at,
                torn_bytes = torn.len,
                "FileStore: removed a record a crashed writer left incomplete"
            );
        }
        let at = file
            .seek(SeekFrom::End(0))
            .map_err(|e| self.error("seek", e))?;
        file.write_all(&record)
            .map_err(|e| self.error("write", e))?;
        // The cache has read up to the end of the file, so the record lands at its
        // offset; apply it without reading it back.
        if at == state.cache.offset() {
            state.cache.replay(&record);
        }
        Ok(result)
    }

    /// `add` on a stored key (PyTorch's `addHelper`): an empty or missing value counts
    /// as 0; the new value is written as decimal text.
    fn add(&self, stored: &[u8], delta: i64, deadline: Option<Instant>) -> Result<i64, StoreError> {
        self.write(Access::Write, deadline, |cache| {
            let current = cache.get(stored).filter(|value| !value.is_empty());
            let total =
                semantics::add_counter(current, delta).map_err(|e| StoreError::NotACounter {
                    key: lossy(file_log::user_key_of(stored).unwrap_or(stored)),
                    detail: e.to_string(),
                })?;
            let record = encode(stored, Decimal::new(total).as_bytes())?;
            Ok((Some(record), total))
        })
    }
}

fn encode(key: &[u8], value: &[u8]) -> Result<Vec<u8>, StoreError> {
    let mut out = Vec::new();
    Record::new(key, value)
        .encode_into(&mut out)
        .map_err(|e| StoreError::InvalidArgument(e.to_string()))?;
    Ok(out)
}

impl FileStore {
    /// Opens (creating it if needed) the store at `path` and counts this handle in its
    /// `refcount/`. `world_size` is the number of participants if fixed (PyTorch's
    /// `world_size=-1` is `None`); only a fixed-size store's file is removed when the
    /// last handle is dropped. The timeout is PyTorch's default, 300 s.
    pub fn new(path: impl AsRef<Path>, world_size: Option<u32>) -> Result<FileStore, StoreError> {
        FileStore::with_timeout(path, world_size, DEFAULT_TIMEOUT)
    }

    /// [`FileStore::new`] with another timeout, which also bounds how long the first open
    /// waits for the file's directory to appear.
    pub fn with_timeout(
        path: impl AsRef<Path>,
        world_size: Option<u32>,
        timeout: Duration,
    ) -> Result<FileStore, StoreError> {
        let log = Log {
            path: path.as_ref().to_path_buf(),
            state: Mutex::new(State::default()),
        };
        // Counted before the handle exists, so that a failure here owes no cleanup.
        log.add(REFCOUNT_KEY, 1, deadline_after(timeout))?;
        Ok(FileStore {
            log,
            world_size,
            timeout: Mutex::new(timeout),
        })
    }

    /// The store file.
    pub fn path(&self) -> &Path {
        &self.log.path
    }

    /// The fixed number of participants, if any.
    pub fn world_size(&self) -> Option<u32> {
        self.world_size
    }

    fn op_deadline(&self) -> Option<Instant> {
        deadline_after(self.timeout())
    }
}

impl Drop for FileStore {
    /// PyTorch's destructor: if the file still exists, `cleanup/ += 1`,
    /// `refcount/ -= 1`, and the last handle of a fixed-size store whose every
    /// participant finished removes the file. Best effort: errors are logged, never
    /// raised.
    fn drop(&mut self) {
        if !matches!(self.log.path.try_exists(), Ok(true)) {
            return;
        }
        // The file was just there: do not wait for it to come back.
        let now = Some(Instant::now());
        let finished = self.log.add(CLEANUP_KEY, 1, now);
        let references = self.log.add(REFCOUNT_KEY, -1, now);
        match (finished, references) {
            (Ok(finished), Ok(0))
                if self
                    .world_size
                    .is_some_and(|size| finished >= i64::from(size)) =>
            {
                if let Err(e) = std::fs::remove_file(&self.log.path) {
                    tracing::debug!(path = %self.log.path.display(), error = %e,
                        "FileStore: could not remove the store file");
                }
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::debug!(path = %self.log.path.display(), error = %e,
                    "FileStore: cleanup on drop failed");
            }
            _ => {}
        }
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let record = encode(&file_log::user_key(key.as_bytes()), value)?;
        self.log.write(Access::Write, self.op_deadline(), |_| {
            Ok((Some(record), ()))
        })
    }

    /// Polls every 10 ms until `key` exists; after the store timeout fails with PyTorch's
    /// `Timeout waiting for key: {key} after {ms} ms` ([`StoreError::GetTimeout`]).
    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let timeout = self.timeout();
        let deadline = deadline_after(timeout);
        let stored = file_log::user_key(key.as_bytes());
        loop {
            let found = self
                .log
                .read(deadline, |cache| cache.get(&stored).map(<[u8]>::to_vec))?;
            if let Some(value) = found {
                return Ok(value);
            }
            if expired(deadline) {
                return Err(StoreError::GetTimeout {
                    key: key.to_string(),
                    ms: timeout.as_millis(),
                });
            }
            thread::sleep(POLL_INTERVAL);
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.log.add(
            &file_log::user_key(key.as_bytes()),
            delta,
            self.op_deadline(),
        )
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let stored = file_log::user_key(key.as_bytes());
        self.log.write(Access::Write, self.op_deadline(), |cache| {
            let outcome = semantics::compare_set(cache.get(&stored), expected, desired);
            let record = if outcome.writes() {
                Some(encode(&stored, desired)?)
            } else {
                None
            };
            Ok((record, outcome.reply().to_vec()))
        })
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let stored: Vec<Vec<u8>> = keys
            .iter()
            .map(|k| file_log::user_key(k.as_bytes()))
            .collect();
        self.log.read(self.op_deadline(), |cache| {
            stored.iter().all(|k| cache.contains(k))
        })
    }

    /// Polls [`Store::check`] every 10 ms. PyTorch's FileStore says only "Wait timeout";
    /// this fails with [`StoreError::Timeout`] ("wait timeout after {ms}ms, keys: /k"),
    /// the TCP store's text, so that a timeout reads the same whichever store ran out.
    fn wait(&self, keys: &[&str], timeout: Option<Duration>) -> Result<(), StoreError> {
        let timeout = timeout.unwrap_or_else(|| self.timeout());
        let deadline = deadline_after(timeout);
        let stored: Vec<Vec<u8>> = keys
            .iter()
            .map(|k| file_log::user_key(k.as_bytes()))
            .collect();
        loop {
            let present = self
                .log
                .read(deadline, |cache| stored.iter().all(|k| cache.contains(k)))?;
            if present {
                return Ok(());
            }
            if expired(deadline) {
                return Err(StoreError::Timeout {
                    ms: timeout.as_millis(),
                    keys: stored.iter().map(|k| lossy(k)).collect(),
                });
            }
            thread::sleep(POLL_INTERVAL);
        }
    }

    /// Appends a tombstone and returns `true` whether or not the key existed, as
    /// PyTorch's FileStore does. The file must exist (it is not created).
    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        let tombstone = file_log::tombstone_key(&file_log::user_key(key.as_bytes()));
        let record = encode(&tombstone, b"")?;
        self.log
            .write(Access::WriteExisting, self.op_deadline(), |_| {
                Ok((Some(record), true))
            })
    }

    /// Every key present, internal ones (`refcount/`, `cleanup/`) included, as PyTorch
    /// counts.
    fn num_keys(&self) -> Result<i64, StoreError> {
        self.log.read(self.op_deadline(), |cache| {
            i64::try_from(cache.len()).unwrap_or(i64::MAX)
        })
    }

    /// The user keys, in byte order; the internal counters are left out (PyTorch lists
    /// them mangled, see the module docs).
    fn list_keys(&self) -> Result<Vec<String>, StoreError> {
        self.log.read(self.op_deadline(), |cache| {
            cache.user_keys().map(lossy).collect()
        })
    }

    fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_timeout(&self, timeout: Duration) {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner()) = timeout;
    }

    /// A new handle on the same file, counted in `refcount/` like any other (PyTorch's
    /// clone constructs a new FileStore); it starts with this handle's timeout.
    fn clone_store(&self) -> Result<Box<dyn Store>, StoreError> {
        Ok(Box::new(FileStore::with_timeout(
            &self.log.path,
            self.world_size,
            self.timeout(),
        )?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp() -> tempfile::TempDir {
        tempfile::tempdir().expect("tempdir")
    }

    #[test]
    fn constructor_counts_the_handle_and_writes_pytorch_bytes() {
        let dir = temp();
        let path = dir.path().join("store");
        let store = FileStore::new(&path, None).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes, b"\x09\x00\x00\x00refcount/\x01\x00\x00\x001");
        store.set("k", b"v").unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.ends_with(b"\x02\x00\x00\x00/k\x01\x00\x00\x00v"));
        assert_eq!(store.num_keys().unwrap(), 2);
        assert_eq!(store.list_keys().unwrap(), vec!["k".to_string()]);
    }

    #[test]
    fn add_treats_an_empty_value_as_zero_and_rejects_text() {
        let dir = temp();
        let store = FileStore::new(dir.path().join("store"), None).unwrap();
        store.set("empty", b"").unwrap();
        assert_eq!(store.add("empty", 3).unwrap(), 3);
        store.set("text", b"abc").unwrap();
        let err = store.add("text", 1).unwrap_err();
        assert!(
            matches!(&err, StoreError::NotACounter { key, .. } if key == "text"),
            "{err}"
        );
        assert_eq!(store.get("text").unwrap(), b"abc");
    }

    #[test]
    fn a_failed_constructor_owes_no_cleanup() {
        let dir = temp();
        let path = dir.path().join("missing-dir").join("store");
        let err = FileStore::with_timeout(&path, Some(1), Duration::from_millis(30)).unwrap_err();
        assert!(matches!(err, StoreError::File { op: "open", .. }), "{err}");
        assert!(!path.exists());
    }

    #[test]
    fn deadlines() {
        assert_eq!(deadline_after(Duration::ZERO), None);
        assert!(!expired(None));
        assert!(expired(Some(Instant::now())));
        // Too far to represent: treated as no deadline.
        assert_eq!(deadline_after(Duration::MAX), None);
    }
}
