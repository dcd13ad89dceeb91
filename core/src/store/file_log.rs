//! The on-disk log of PyTorch's `FileStore`: its record format, how a log is read back,
//! and what a reader does with a record that a crash cut short.
//!
//! A FileStore file is an append-only sequence of records
//! `[u32 LE key length][key][u32 LE value length][value]` (PyTorch writes host-endian
//! `uint32_t`, which is little-endian on every platform it runs on). Later records
//! override earlier ones. Key names carry the store's meaning:
//!
//! * a user key `k` is stored as `"/" + k` ([`USER_KEY_PREFIX`]);
//! * a record whose key starts with `-` ([`TOMBSTONE_PREFIX`]) is a tombstone: it erases
//!   `key[1..]` (its value is empty and ignored), so `delete_key("k")` appends
//!   `"-/k"`;
//! * the store's own counters are written raw, without the `/`: [`REFCOUNT_KEY`]
//!   (`"refcount/"`, handles open on the file) and [`CLEANUP_KEY`] (`"cleanup/"`, handles
//!   that finished).
//!
//! This module decides how records become bytes ([`Record::encode`]), how bytes become
//! records ([`scan_record`], [`Records`]) and, with `alloc`, what a replayed log holds
//! ([`LogCache`]). It does **not** open, lock, read or write a file; the runtime's
//! `FileStore` does that and hands the bytes it read here.
//!
//! # Torn tails
//!
//! A writer that dies in the middle of an append (PyTorch writes a record in four
//! `write` calls) leaves a *torn tail*: a header or a body cut short at the end of the
//! file. Every writer appends under an exclusive `flock` and every reader reads under a
//! shared one, so a reader never sees another live writer's half record: bytes at the
//! end of the file that do not make a whole record are a dead writer's remains and will
//! never be completed. [`scan_record`] reports them as [`Scanned::Incomplete`] with the
//! number of bytes present; nothing is ever read out of them and no claimed length is
//! trusted beyond the bytes actually given (no allocation follows a length field).
//!
//! PyTorch itself does not survive this: its `File::read` loops on `read(2)` until it
//! has the claimed number of bytes and `read` returns 0 at end of file forever, so any
//! PyTorch `get`/`check`/`add`/`compare_set` that meets a torn tail spins while holding
//! the lock; and its `set` (which does not read first) appends after the torn bytes, so
//! that the torn header's claimed lengths swallow the start of the new record and every
//! later reader misparses the log. rdzv's FileStore instead stops at the torn tail when
//! reading (its position stays at the end of the last whole record), and when it next
//! writes, holding the exclusive lock, it cuts the file back to that position
//! ([`LogCache::torn_tail`] gives it) before appending. That is safe because under the
//! exclusive lock nobody else is writing and the torn bytes can never become a record;
//! it is needed because appending after them would corrupt the log for every reader. The
//! log is then well-formed again, for rdzv and PyTorch readers alike.
//!
//! # Torn or corrupt: what may be cut
//!
//! Only the end of a file can be torn, and a torn tail is a prefix of **one** record. A
//! length field damaged in the middle of the file looks, to a reader, just like a torn
//! header: it claims more bytes than follow. What tells them apart is what follows it:
//! the bytes of a torn tail are one record's prefix and cannot hold a whole record of
//! their own, while behind a damaged field lie the records written after it.
//! [`classify_tail`] therefore looks, at every offset past the bad record's first byte,
//! for a whole record whose key is one a FileStore writes ([`is_store_key`]: `/k`, a
//! tombstone `-/k`, `refcount/`, `cleanup/`). If it finds one, the tail is
//! [`Tail::Corrupt`], and nothing may be cut: a writer must fail with an error naming the
//! offset. Only a tail with no such record is [`Tail::Torn`] and may be cut; cutting it
//! loses no record that any reader could recover. The rule errs on the side of keeping
//! bytes: a torn record whose own *value* embeds a FileStore record image is reported as
//! corrupt (an operator decides), never the other way round. A damaged length that
//! makes later records misparse as garbage records of plausible lengths cannot be
//! detected (the format has no checksum); such records are kept, as PyTorch keeps them.

use core::fmt;

#[cfg(feature = "alloc")]
use alloc::{collections::BTreeMap, vec::Vec};

/// The size of each length field: a `u32`.
pub const LENGTH_SIZE: usize = 4;

/// The smallest record: an empty key and an empty value (two length fields).
pub const MIN_RECORD_LEN: usize = 2 * LENGTH_SIZE;

/// The prefix PyTorch puts before every user key (`regularPrefix_`).
pub const USER_KEY_PREFIX: u8 = b'/';

/// The first byte of a tombstone's key (`deletePrefix_`): the record erases the key
/// that follows it.
pub const TOMBSTONE_PREFIX: u8 = b'-';

/// The internal counter of handles open on the file (`refCountKey_`), stored raw.
pub const REFCOUNT_KEY: &[u8] = b"refcount/";

/// The internal counter of handles that finished (`cleanupKey_`), stored raw.
pub const CLEANUP_KEY: &[u8] = b"cleanup/";

/// One record of the log, borrowed from the bytes it was read from (or to be written).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Record<'a> {
    /// The stored key, prefix included (`"/k"`, `"-/k"`, `"refcount/"`).
    pub key: &'a [u8],
    /// The value (empty for a tombstone).
    pub value: &'a [u8],
}

/// What a record does to the store when it is replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect<'a> {
    /// Sets the stored key to the value.
    Put {
        /// The stored key.
        key: &'a [u8],
        /// The new value.
        value: &'a [u8],
    },
    /// Erases the stored key (the record's key without its leading `-`).
    Erase {
        /// The stored key that disappears.
        key: &'a [u8],
    },
}

/// Why a record could not be encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EncodeError {
    /// The output buffer is too small; nothing was written.
    InsufficientSize {
        /// How many bytes the record needs in all.
        needed: usize,
    },
    /// A key or value is longer than a `u32` length field can say.
    TooLong {
        /// The offending length.
        len: usize,
    },
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            EncodeError::InsufficientSize { needed } => {
                write!(f, "insufficient size, need {needed} bytes")
            }
            EncodeError::TooLong { len } => write!(
                f,
                "a FileStore key or value holds at most {} bytes, got {len}",
                u32::MAX
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for EncodeError {}

fn length_field(len: usize) -> Result<[u8; LENGTH_SIZE], EncodeError> {
    u32::try_from(len)
        .map(u32::to_le_bytes)
        .map_err(|_| EncodeError::TooLong { len })
}

impl<'a> Record<'a> {
    /// A record storing `value` under the stored key `key`.
    pub fn new(key: &'a [u8], value: &'a [u8]) -> Self {
        Record { key, value }
    }

    /// How many bytes the record takes on disk, or `None` if that does not fit in `usize`.
    pub fn encoded_len(&self) -> Option<usize> {
        MIN_RECORD_LEN
            .checked_add(self.key.len())?
            .checked_add(self.value.len())
    }

    /// Writes the record at the start of `out` and returns its length.
    ///
    /// Fails, writing nothing, with [`EncodeError::TooLong`] if the key or value has more
    /// than `u32::MAX` bytes, or [`EncodeError::InsufficientSize`] if `out` is too short.
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, EncodeError> {
        let key_len = length_field(self.key.len())?;
        let value_len = length_field(self.value.len())?;
        let needed = self.encoded_len().ok_or(EncodeError::TooLong {
            len: self.value.len(),
        })?;
        let out = out
            .get_mut(..needed)
            .ok_or(EncodeError::InsufficientSize { needed })?;
        let (head, rest) = out.split_at_mut(LENGTH_SIZE);
        head.copy_from_slice(&key_len);
        let (key, rest) = rest.split_at_mut(self.key.len());
        key.copy_from_slice(self.key);
        let (head, value) = rest.split_at_mut(LENGTH_SIZE);
        head.copy_from_slice(&value_len);
        value.copy_from_slice(self.value);
        Ok(needed)
    }

    /// Appends the record to `out` and returns its length.
    ///
    /// Fails, appending nothing, with [`EncodeError::TooLong`] if the key or value has
    /// more than `u32::MAX` bytes.
    #[cfg(feature = "alloc")]
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<usize, EncodeError> {
        let key_len = length_field(self.key.len())?;
        let value_len = length_field(self.value.len())?;
        let needed = self.encoded_len().ok_or(EncodeError::TooLong {
            len: self.value.len(),
        })?;
        out.reserve(needed);
        out.extend_from_slice(&key_len);
        out.extend_from_slice(self.key);
        out.extend_from_slice(&value_len);
        out.extend_from_slice(self.value);
        Ok(needed)
    }

    /// What replaying this record does (the tombstone rule).
    pub fn effect(&self) -> Effect<'a> {
        match self.key.split_first() {
            Some((&TOMBSTONE_PREFIX, erased)) => Effect::Erase { key: erased },
            _ => Effect::Put {
                key: self.key,
                value: self.value,
            },
        }
    }
}

/// A record cut short at the end of the bytes given: a torn tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Torn {
    /// How many bytes of it are present (at least 1).
    pub len: usize,
    /// A lower bound on its full length, from the length fields read so far
    /// ([`MIN_RECORD_LEN`] while the key length itself is cut). It is what the header
    /// *claims*; nothing is allocated or awaited on its account.
    pub claimed: u64,
}

/// What [`scan_record`] found at the start of some bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scanned<'a> {
    /// A whole record and how many bytes it used.
    Complete(Record<'a>, usize),
    /// The bytes start a record but end before it does.
    Incomplete(Torn),
    /// There are no bytes.
    Empty,
}

fn read_length(bytes: &[u8], at: usize) -> Option<u32> {
    let field = bytes.get(at..at.checked_add(LENGTH_SIZE)?)?;
    let mut raw = [0u8; LENGTH_SIZE];
    raw.copy_from_slice(field);
    Some(u32::from_le_bytes(raw))
}

/// Reads the record at the start of `bytes`.
///
/// Lengths are checked against the bytes given before anything is sliced: a header that
/// claims more than is there makes the record [`Scanned::Incomplete`].
pub fn scan_record(bytes: &[u8]) -> Scanned<'_> {
    if bytes.is_empty() {
        return Scanned::Empty;
    }
    let have = bytes.len();
    // usize -> u64 never truncates on the targets Rust supports.
    let have_u64 = have as u64;
    let torn = |claimed: u64| {
        Scanned::Incomplete(Torn {
            len: have,
            claimed: claimed.max(have_u64 + 1),
        })
    };
    let Some(key_len) = read_length(bytes, 0) else {
        return torn(MIN_RECORD_LEN as u64);
    };
    let key_end = LENGTH_SIZE as u64 + u64::from(key_len);
    let header_end = key_end + LENGTH_SIZE as u64;
    if header_end > have_u64 {
        return torn(header_end);
    }
    // header_end <= have, so these fit in usize.
    let key_end = key_end as usize;
    let Some(value_len) = read_length(bytes, key_end) else {
        return torn(header_end);
    };
    let total = header_end + u64::from(value_len);
    if total > have_u64 {
        return torn(total);
    }
    let used = total as usize;
    match (
        bytes.get(LENGTH_SIZE..key_end),
        bytes.get(key_end + LENGTH_SIZE..used),
    ) {
        (Some(key), Some(value)) => Scanned::Complete(Record { key, value }, used),
        // Unreachable given the checks above; reported as torn rather than trusted.
        _ => torn(total),
    }
}

/// The records of a log segment, in order: an iterator that stops at the end of the
/// bytes or at a torn tail.
///
/// ```
/// use rdzv_core::store::file_log::{Record, Records};
/// let mut log = [0u8; 64];
/// let n = Record::new(b"/k", b"v").encode(&mut log).unwrap();
/// let mut records = Records::new(&log[..n + 3]);
/// assert_eq!(records.next(), Some(Record::new(b"/k", b"v")));
/// assert_eq!(records.next(), None);
/// assert_eq!(records.consumed(), n);
/// assert_eq!(records.torn_tail().map(|t| t.len), Some(3));
/// ```
#[derive(Debug, Clone)]
pub struct Records<'a> {
    rest: &'a [u8],
    consumed: usize,
}

impl<'a> Records<'a> {
    /// The records of `bytes`, which must start at a record boundary.
    pub fn new(bytes: &'a [u8]) -> Self {
        Records {
            rest: bytes,
            consumed: 0,
        }
    }

    /// How many bytes the records returned so far take.
    pub fn consumed(&self) -> usize {
        self.consumed
    }

    /// The bytes not yet returned as records.
    pub fn remainder(&self) -> &'a [u8] {
        self.rest
    }

    /// The torn tail the iterator stops at, if the remaining bytes are one (that is,
    /// they start a record but do not hold all of it).
    pub fn torn_tail(&self) -> Option<Torn> {
        match scan_record(self.rest) {
            Scanned::Incomplete(torn) => Some(torn),
            Scanned::Complete(..) | Scanned::Empty => None,
        }
    }

    /// The remaining bytes classified as torn or corrupt ([`classify_tail`]); `None`
    /// where [`Records::torn_tail`] is `None`.
    pub fn tail(&self) -> Option<Tail> {
        classify_tail(self.rest)
    }
}

impl<'a> Iterator for Records<'a> {
    type Item = Record<'a>;

    fn next(&mut self) -> Option<Record<'a>> {
        match scan_record(self.rest) {
            Scanned::Complete(record, used) => {
                self.rest = self.rest.get(used..).unwrap_or_default();
                self.consumed += used;
                Some(record)
            }
            Scanned::Incomplete(_) | Scanned::Empty => None,
        }
    }
}

/// Whether a stored key has a shape that a FileStore writer produces: a user key
/// (`/k`), a tombstone of one (`-/k`), or one of the two internal counters.
pub fn is_store_key(key: &[u8]) -> bool {
    matches!(
        key,
        [USER_KEY_PREFIX, ..] | [TOMBSTONE_PREFIX, USER_KEY_PREFIX, ..]
    ) || key == REFCOUNT_KEY
        || key == CLEANUP_KEY
}

/// A bad record followed by a whole record: the file is damaged in the middle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Corrupt {
    /// The bad record, as [`scan_record`] saw it: the bytes from it to the end of the
    /// file and what its header claims.
    pub bad: Torn,
    /// Where, counted from the bad record's first byte, the first whole FileStore record
    /// found behind it starts.
    pub record_at: usize,
}

/// What the bytes after the last whole record of a log are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tail {
    /// A record a dead writer left incomplete: it holds no record and may be cut.
    Torn(Torn),
    /// Mid-file corruption: whole records follow the bad one; nothing may be cut.
    Corrupt(Corrupt),
}

impl Tail {
    /// How many bytes the tail spans, from the bad record to the end of the bytes.
    pub fn len(&self) -> usize {
        match self {
            Tail::Torn(torn) => torn.len,
            Tail::Corrupt(corrupt) => corrupt.bad.len,
        }
    }

    /// Always `false`: a tail holds at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Classifies `rest`, the bytes that follow the last whole record of a log (see the
/// module docs): `None` when they are empty or start a whole record, otherwise whether
/// they are a torn tail or a bad record with whole records behind it.
///
/// The search is linear in `rest` and allocates nothing; no claimed length is trusted
/// beyond the bytes given.
pub fn classify_tail(rest: &[u8]) -> Option<Tail> {
    let Scanned::Incomplete(bad) = scan_record(rest) else {
        return None;
    };
    let found = (1..rest.len()).find(|&at| {
        matches!(
            scan_record(rest.get(at..).unwrap_or_default()),
            Scanned::Complete(record, _) if is_store_key(record.key)
        )
    });
    Some(match found {
        Some(record_at) => Tail::Corrupt(Corrupt { bad, record_at }),
        None => Tail::Torn(bad),
    })
}

/// The stored form of the user key `key`: `"/" + key`.
#[cfg(feature = "alloc")]
pub fn user_key(key: &[u8]) -> Vec<u8> {
    let mut stored = Vec::with_capacity(key.len() + 1);
    stored.push(USER_KEY_PREFIX);
    stored.extend_from_slice(key);
    stored
}

/// The key of the tombstone that erases the stored key `stored`: `"-" + stored`.
#[cfg(feature = "alloc")]
pub fn tombstone_key(stored: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(stored.len() + 1);
    key.push(TOMBSTONE_PREFIX);
    key.extend_from_slice(stored);
    key
}

/// The user key a stored key names, or `None` for the internal keys (`refcount/`,
/// `cleanup/`, anything without the `/` prefix).
pub fn user_key_of(stored: &[u8]) -> Option<&[u8]> {
    match stored.split_first() {
        Some((&USER_KEY_PREFIX, key)) => Some(key),
        _ => None,
    }
}

/// What one [`LogCache::replay`] read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replayed {
    /// Whole records applied.
    pub records: usize,
    /// Bytes those records took (the cache's offset moved by this much).
    pub consumed: usize,
    /// The bytes after them that are not a whole record, classified, if any.
    pub tail: Option<Tail>,
}

/// The in-memory state of a replayed log (PyTorch's `cache_` and `pos_`): stored key →
/// value, and how far into the file it has read.
///
/// The caller reads the file from [`LogCache::read_from`] to its end and hands those
/// bytes to [`LogCache::replay`]. Keys iterate in byte order.
#[cfg(feature = "alloc")]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogCache {
    entries: BTreeMap<Vec<u8>, Vec<u8>>,
    offset: u64,
    tail: Option<Tail>,
}

#[cfg(feature = "alloc")]
impl LogCache {
    /// An empty cache at offset 0.
    pub fn new() -> Self {
        LogCache::default()
    }

    /// The file offset where the next unread record starts: the end of the last whole
    /// record replayed.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Where to start reading a file that is now `file_len` bytes long, or `None` when
    /// there is nothing new.
    ///
    /// A file shorter than what was already replayed has been replaced or truncated by
    /// someone else: the cache forgets everything and the file is read from 0 (PyTorch
    /// keeps its stale cache and, on its next write, its position is wrong).
    pub fn read_from(&mut self, file_len: u64) -> Option<u64> {
        if file_len < self.offset {
            self.reset();
        }
        (file_len > self.offset).then_some(self.offset)
    }

    /// Replays `bytes`, the file's contents from [`LogCache::offset`] to its end: every
    /// whole record is applied in order and the offset moves past it; what follows is
    /// classified and remembered ([`LogCache::torn_tail`], [`LogCache::corruption`]) and
    /// left unread.
    pub fn replay(&mut self, bytes: &[u8]) -> Replayed {
        let mut records = Records::new(bytes);
        let mut count = 0;
        for record in records.by_ref() {
            self.apply(record);
            count += 1;
        }
        let consumed = records.consumed();
        self.offset = self.offset.saturating_add(consumed as u64);
        self.tail = records.tail();
        Replayed {
            records: count,
            consumed,
            tail: self.tail,
        }
    }

    /// Applies one record (the tombstone rule included) without moving the offset.
    pub fn apply(&mut self, record: Record<'_>) {
        match record.effect() {
            Effect::Put { key, value } => {
                if let Some(slot) = self.entries.get_mut(key) {
                    slot.clear();
                    slot.extend_from_slice(value);
                } else {
                    self.entries.insert(key.to_vec(), value.to_vec());
                }
            }
            Effect::Erase { key } => {
                self.entries.remove(key);
            }
        }
    }

    /// The torn tail the last replay stopped at, if it is one ([`Tail::Torn`]). A writer
    /// holding the exclusive lock truncates the file to [`LogCache::offset`] before
    /// appending when this is `Some` (see the module docs).
    pub fn torn_tail(&self) -> Option<Torn> {
        match self.tail {
            Some(Tail::Torn(torn)) => Some(torn),
            Some(Tail::Corrupt(_)) | None => None,
        }
    }

    /// The mid-file corruption the last replay stopped at, if any: the bad record starts
    /// at [`LogCache::offset`], a whole record at `offset + record_at`. Nothing may be cut
    /// or appended; the runtime reports it (see the module docs).
    pub fn corruption(&self) -> Option<Corrupt> {
        match self.tail {
            Some(Tail::Corrupt(corrupt)) => Some(corrupt),
            Some(Tail::Torn(_)) | None => None,
        }
    }

    /// What the last replay stopped at, if anything: a torn tail or corruption.
    pub fn tail(&self) -> Option<Tail> {
        self.tail
    }

    /// Forgets every entry and goes back to offset 0.
    pub fn reset(&mut self) {
        self.entries.clear();
        self.offset = 0;
        self.tail = None;
    }

    /// The value of a stored key (prefix included).
    pub fn get(&self, stored: &[u8]) -> Option<&[u8]> {
        self.entries.get(stored).map(Vec::as_slice)
    }

    /// Whether a stored key (prefix included) is present.
    pub fn contains(&self, stored: &[u8]) -> bool {
        self.entries.contains_key(stored)
    }

    /// The value of the user key `key` (stored as `"/" + key`).
    pub fn get_user(&self, key: &[u8]) -> Option<&[u8]> {
        self.get(&user_key(key))
    }

    /// How many stored keys are present, internal ones included (PyTorch's
    /// `getNumKeys`).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no key is present.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every stored key with its value, in byte order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.entries
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
    }

    /// The user keys present, without their `/`, in byte order; internal keys are left
    /// out.
    pub fn user_keys(&self) -> impl Iterator<Item = &[u8]> {
        self.entries.keys().filter_map(|k| user_key_of(k))
    }
}

#[cfg(all(test, feature = "alloc"))]
mod tests {
    use super::*;
    use alloc::vec;
    use proptest::prelude::*;
    use std::collections::BTreeMap as Model;

    fn encode_all(records: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, v) in records {
            Record::new(k, v).encode_into(&mut out).unwrap();
        }
        out
    }

    #[test]
    fn layout_is_pytorch_s() {
        let mut buf = [0u8; 32];
        let n = Record::new(b"/key", b"value").encode(&mut buf).unwrap();
        assert_eq!(n, 17);
        assert_eq!(&buf[..n], b"\x04\x00\x00\x00/key\x05\x00\x00\x00value");
        let mut v = Vec::new();
        assert_eq!(Record::new(b"/key", b"value").encode_into(&mut v), Ok(17));
        assert_eq!(v, &buf[..n]);
        // An empty record is two zero lengths.
        assert_eq!(Record::new(b"", b"").encode(&mut buf), Ok(MIN_RECORD_LEN));
        assert_eq!(&buf[..8], &[0u8; 8]);
    }

    #[test]
    fn encode_reports_needed_size_and_writes_nothing() {
        let mut buf = [0xAAu8; 16];
        assert_eq!(
            Record::new(b"/key", b"value").encode(&mut buf),
            Err(EncodeError::InsufficientSize { needed: 17 })
        );
        assert_eq!(buf, [0xAA; 16]);
        assert_eq!(Record::new(b"/key", b"value").encoded_len(), Some(17));
        assert_eq!(
            std::format!("{}", EncodeError::InsufficientSize { needed: 17 }),
            "insufficient size, need 17 bytes"
        );
        assert!(std::format!("{}", EncodeError::TooLong { len: 5 }).contains("at most"));
    }

    #[test]
    fn tombstones_and_prefixes() {
        assert_eq!(
            Record::new(b"-/k", b"").effect(),
            Effect::Erase { key: b"/k" }
        );
        assert_eq!(
            Record::new(b"/k", b"v").effect(),
            Effect::Put {
                key: b"/k",
                value: b"v"
            }
        );
        // A user key that itself starts with '-' is stored behind '/', so it is no
        // tombstone; deleting it writes "-/-k".
        assert_eq!(
            Record::new(b"/-k", b"7").effect(),
            Effect::Put {
                key: b"/-k",
                value: b"7"
            }
        );
        assert_eq!(user_key(b"-k"), b"/-k");
        assert_eq!(tombstone_key(&user_key(b"-k")), b"-/-k");
        assert_eq!(user_key_of(b"/a/b"), Some(&b"a/b"[..]));
        assert_eq!(user_key_of(REFCOUNT_KEY), None);
        assert_eq!(user_key_of(CLEANUP_KEY), None);
        assert_eq!(user_key_of(b""), None);
    }

    #[test]
    fn scan_stops_at_torn_header_and_body() {
        let log = encode_all(&[(b"/a".to_vec(), b"1".to_vec())]);
        assert_eq!(scan_record(&[]), Scanned::Empty);
        for cut in 1..log.len() {
            match scan_record(&log[..cut]) {
                Scanned::Incomplete(torn) => {
                    assert_eq!(torn.len, cut);
                    assert!(torn.claimed > cut as u64);
                    if cut >= 10 {
                        assert_eq!(torn.claimed, log.len() as u64);
                    }
                }
                other => panic!("cut {cut}: {other:?}"),
            }
        }
        assert_eq!(
            scan_record(&log),
            Scanned::Complete(Record::new(b"/a", b"1"), log.len())
        );
    }

    #[test]
    fn huge_claimed_lengths_are_torn_not_trusted() {
        // A key length of u32::MAX with 3 bytes behind it.
        let bytes = [0xFF, 0xFF, 0xFF, 0xFF, 1, 2, 3];
        assert_eq!(
            scan_record(&bytes),
            Scanned::Incomplete(Torn {
                len: 7,
                claimed: 4 + u64::from(u32::MAX) + 4,
            })
        );
        // A value length of u32::MAX.
        let bytes = [1, 0, 0, 0, b'k', 0xFF, 0xFF, 0xFF, 0xFF, b'v'];
        assert_eq!(
            scan_record(&bytes),
            Scanned::Incomplete(Torn {
                len: 10,
                claimed: 9 + u64::from(u32::MAX),
            })
        );
    }

    #[test]
    fn records_iterates_and_reports_the_tail() {
        let mut log = encode_all(&[
            (b"/a".to_vec(), b"1".to_vec()),
            (b"refcount/".to_vec(), b"1".to_vec()),
        ]);
        let whole = log.len();
        log.extend_from_slice(&[3, 0, 0]);
        let mut records = Records::new(&log);
        assert_eq!(records.next(), Some(Record::new(b"/a", b"1")));
        assert!(records.torn_tail().is_none());
        assert_eq!(records.next(), Some(Record::new(b"refcount/", b"1")));
        assert_eq!(records.next(), None);
        assert_eq!(records.consumed(), whole);
        assert_eq!(records.remainder(), &[3, 0, 0]);
        assert_eq!(
            records.torn_tail(),
            Some(Torn {
                len: 3,
                claimed: MIN_RECORD_LEN as u64
            })
        );
    }

    #[test]
    fn cache_replays_in_order_with_tombstones() {
        let log = encode_all(&[
            (b"refcount/".to_vec(), b"1".to_vec()),
            (b"/k".to_vec(), b"1".to_vec()),
            (b"/k".to_vec(), b"2".to_vec()),
            (b"/gone".to_vec(), b"x".to_vec()),
            (b"-/gone".to_vec(), b"".to_vec()),
            (b"-/never".to_vec(), b"".to_vec()),
        ]);
        let mut cache = LogCache::new();
        assert_eq!(cache.read_from(log.len() as u64), Some(0));
        let replayed = cache.replay(&log);
        assert_eq!(
            replayed,
            Replayed {
                records: 6,
                consumed: log.len(),
                tail: None
            }
        );
        assert_eq!(cache.offset(), log.len() as u64);
        assert_eq!(cache.read_from(log.len() as u64), None);
        assert_eq!(cache.len(), 2);
        assert!(!cache.is_empty());
        assert_eq!(cache.get_user(b"k"), Some(&b"2"[..]));
        assert_eq!(cache.get(REFCOUNT_KEY), Some(&b"1"[..]));
        assert!(!cache.contains(b"/gone"));
        assert_eq!(cache.user_keys().collect::<Vec<_>>(), vec![&b"k"[..]]);
        assert_eq!(cache.iter().count(), 2);
    }

    #[test]
    fn cache_keeps_its_offset_at_a_torn_tail_and_resumes() {
        let first = encode_all(&[(b"/a".to_vec(), b"1".to_vec())]);
        let second = encode_all(&[(b"/b".to_vec(), b"2".to_vec())]);
        let mut file = first.clone();
        file.extend_from_slice(&second[..5]);
        let mut cache = LogCache::new();
        let replayed = cache.replay(&file);
        assert_eq!(replayed.records, 1);
        assert_eq!(replayed.tail.map(|t| t.len()), Some(5));
        assert_eq!(cache.corruption(), None);
        assert_eq!(cache.offset(), first.len() as u64);
        assert_eq!(cache.torn_tail().map(|t| t.len), Some(5));
        // The writer truncates to the offset and appends a whole record.
        file.truncate(cache.offset() as usize);
        file.extend_from_slice(&second);
        let from = cache.read_from(file.len() as u64).unwrap() as usize;
        let replayed = cache.replay(&file[from..]);
        assert_eq!(replayed.records, 1);
        assert_eq!(replayed.tail, None);
        assert_eq!(cache.torn_tail(), None);
        assert_eq!(cache.get_user(b"b"), Some(&b"2"[..]));
        assert_eq!(cache.offset(), file.len() as u64);
    }

    #[test]
    fn a_shrunk_file_resets_the_cache() {
        let log = encode_all(&[(b"/a".to_vec(), b"1".to_vec())]);
        let mut cache = LogCache::new();
        cache.replay(&log);
        assert_eq!(cache.read_from(3), Some(0));
        assert!(cache.is_empty());
        assert_eq!(cache.offset(), 0);
        let mut cache2 = LogCache::new();
        cache2.replay(&log);
        assert_eq!(cache2.read_from(0), None);
        assert!(cache2.is_empty());
    }

    #[test]
    fn store_key_shapes() {
        assert!(is_store_key(b"/"));
        assert!(is_store_key(b"/k"));
        assert!(is_store_key(b"-/k"));
        assert!(is_store_key(REFCOUNT_KEY));
        assert!(is_store_key(CLEANUP_KEY));
        assert!(!is_store_key(b""));
        assert!(!is_store_key(b"-"));
        assert!(!is_store_key(b"-k"));
        assert!(!is_store_key(b"refcount"));
        assert!(!is_store_key(b"k"));
    }

    /// Every cut of a record after whole ones is a torn tail, never corruption, and the
    /// cache keeps every whole record.
    #[test]
    fn every_cut_of_the_last_record_is_torn() {
        let whole = encode_all(&[
            (b"refcount/".to_vec(), b"1".to_vec()),
            (b"/a".to_vec(), b"1".to_vec()),
        ]);
        let last = encode_all(&[(b"/key".to_vec(), b"a value of some length".to_vec())]);
        for cut in 1..last.len() {
            let mut file = whole.clone();
            file.extend_from_slice(&last[..cut]);
            let mut cache = LogCache::new();
            let replayed = cache.replay(&file);
            assert_eq!(replayed.records, 2, "cut {cut}");
            assert_eq!(cache.offset(), whole.len() as u64);
            assert_eq!(cache.torn_tail().map(|t| t.len), Some(cut), "cut {cut}");
            assert_eq!(cache.corruption(), None, "cut {cut}");
        }
    }

    /// A length field damaged in the middle claims more than follows, like a torn
    /// header; the whole records behind it make it corruption.
    #[test]
    fn a_corrupt_length_mid_file_is_corruption() {
        let records: Vec<(Vec<u8>, Vec<u8>)> = (0..8u8)
            .map(|i| (vec![b'/', b'a' + i], vec![b'0' + i]))
            .collect();
        let mut file = encode_all(&records);
        let record_len = 4 + 2 + 4 + 1;
        let bad_at = 3 * record_len;
        file[bad_at..bad_at + 4].copy_from_slice(&0x7FFF_0000u32.to_le_bytes());
        let mut cache = LogCache::new();
        let replayed = cache.replay(&file);
        assert_eq!(replayed.records, 3);
        assert_eq!(cache.offset(), bad_at as u64);
        assert_eq!(cache.torn_tail(), None);
        let corrupt = cache.corruption().expect("corruption");
        assert_eq!(corrupt.bad.len, file.len() - bad_at);
        assert_eq!(corrupt.record_at, record_len);
        // A damaged value length too.
        let mut file = encode_all(&records);
        file[bad_at + 6..bad_at + 10].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Records::new(&file[bad_at..]).tail(),
            Some(Tail::Corrupt(Corrupt { record_at, .. })) if record_at == record_len
        ));
    }

    #[test]
    fn a_garbage_or_zero_tail_is_torn() {
        let whole = encode_all(&[(b"/a".to_vec(), b"1".to_vec())]);
        for junk in [
            &b"some garbage a crash left behind, no record in it"[..],
            &[0u8; 7][..],
            &[0xFF; 100][..],
        ] {
            let mut file = whole.clone();
            file.extend_from_slice(junk);
            let tail = Records::new(&file[whole.len()..]).tail();
            assert_eq!(
                tail.map(|t| matches!(t, Tail::Torn(_))),
                Some(true),
                "{junk:?}"
            );
            assert_eq!(tail.map(|t| t.len()), Some(junk.len()));
            assert!(tail.is_some_and(|t| !t.is_empty()));
        }
        // Zeros that parse are whole (empty) records, kept as PyTorch keeps them.
        assert_eq!(classify_tail(&[0u8; 8]), None);
        assert_eq!(classify_tail(&[]), None);
    }

    /// One operation of the model test, as a FileStore would log it.
    #[derive(Debug, Clone)]
    enum Op {
        Set(u8, Vec<u8>),
        Delete(u8),
        Internal(bool, Vec<u8>),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..6, proptest::collection::vec(any::<u8>(), 0..6)).prop_map(|(k, v)| Op::Set(k, v)),
            (0u8..6).prop_map(Op::Delete),
            (any::<bool>(), proptest::collection::vec(b'0'..=b'9', 1..3))
                .prop_map(|(r, v)| Op::Internal(r, v)),
        ]
    }

    fn key_name(k: u8) -> Vec<u8> {
        // Includes names starting with '-' and '/', which the prefix keeps apart.
        [&b"a"[..], b"-a", b"/a", b"", b"refcount/", b"b/c"][usize::from(k % 6)].to_vec()
    }

    /// A log, where each record ends, and what the store holds after it.
    type Logged = (Vec<u8>, Vec<usize>, Model<Vec<u8>, Vec<u8>>);

    fn log_of(ops: &[Op]) -> Logged {
        let mut log = Vec::new();
        let mut ends = Vec::new();
        let mut model = Model::new();
        for op in ops {
            match op {
                Op::Set(k, v) => {
                    let stored = user_key(&key_name(*k));
                    Record::new(&stored, v).encode_into(&mut log).unwrap();
                    model.insert(stored, v.clone());
                }
                Op::Delete(k) => {
                    let stored = user_key(&key_name(*k));
                    Record::new(&tombstone_key(&stored), b"")
                        .encode_into(&mut log)
                        .unwrap();
                    model.remove(&stored);
                }
                Op::Internal(refcount, v) => {
                    let key = if *refcount { REFCOUNT_KEY } else { CLEANUP_KEY };
                    Record::new(key, v).encode_into(&mut log).unwrap();
                    model.insert(key.to_vec(), v.clone());
                }
            }
            ends.push(log.len());
        }
        (log, ends, model)
    }

    proptest! {
        #[test]
        fn replay_equals_the_model(
            ops in proptest::collection::vec(op(), 0..40),
            chunks in proptest::collection::vec(1usize..64, 0..8),
        ) {
            let (log, _, model) = log_of(&ops);
            let mut cache = LogCache::new();
            cache.replay(&log);
            let replayed: Model<Vec<u8>, Vec<u8>> =
                cache.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
            prop_assert_eq!(&replayed, &model);
            prop_assert_eq!(cache.len(), model.len());
            prop_assert_eq!(cache.offset(), log.len() as u64);

            // The same file, growing in arbitrary pieces (including cuts mid-record),
            // read incrementally from the cache's offset each time.
            let mut grown = LogCache::new();
            let mut len = 0usize;
            for step in chunks.iter().chain(core::iter::once(&usize::MAX)) {
                len = len.saturating_add(*step).min(log.len());
                if let Some(from) = grown.read_from(len as u64) {
                    grown.replay(&log[from as usize..len]);
                }
            }
            prop_assert_eq!(grown, cache);
        }

        #[test]
        fn every_truncation_is_a_prefix_and_a_torn_tail(
            ops in proptest::collection::vec(op(), 0..12),
        ) {
            let (log, ends, _) = log_of(&ops);
            let all: Vec<Record<'_>> = Records::new(&log).collect();
            prop_assert_eq!(all.len(), ops.len());
            for cut in 0..=log.len() {
                let mut records = Records::new(&log[..cut]);
                let got: Vec<Record<'_>> = records.by_ref().collect();
                let whole = ends.iter().take_while(|&&end| end <= cut).count();
                prop_assert_eq!(&got[..], &all[..whole]);
                let boundary = if whole == 0 { 0 } else { ends[whole - 1] };
                prop_assert_eq!(records.consumed(), boundary);
                match records.torn_tail() {
                    None => prop_assert_eq!(boundary, cut),
                    Some(torn) => {
                        prop_assert_eq!(torn.len, cut - boundary);
                        prop_assert!(torn.claimed > torn.len as u64);
                        prop_assert!(torn.claimed <= (ends[whole] - boundary) as u64);
                    }
                }
            }
        }

        /// Cutting the last record anywhere leaves a torn tail (never corruption); damaging
        /// any earlier record's key length leaves corruption at that record, and the cache
        /// holds exactly the records before it.
        #[test]
        fn torn_only_at_the_end_corrupt_in_the_middle(
            ops in proptest::collection::vec(op(), 1..16),
            pick in any::<proptest::sample::Index>(),
            cut in any::<proptest::sample::Index>(),
        ) {
            let (log, ends, _) = log_of(&ops);
            let last_start = if ends.len() > 1 { ends[ends.len() - 2] } else { 0 };
            let cut_at = last_start + 1 + cut.index(log.len() - last_start - 1);
            let mut cache = LogCache::new();
            cache.replay(&log[..cut_at]);
            prop_assert_eq!(cache.offset(), last_start as u64);
            prop_assert_eq!(cache.corruption(), None);
            prop_assert_eq!(cache.torn_tail().map(|t| t.len), Some(cut_at - last_start));

            if ends.len() >= 2 {
                let bad = pick.index(ends.len() - 1);
                let bad_at = if bad == 0 { 0 } else { ends[bad - 1] };
                let mut damaged = log.clone();
                damaged[bad_at..bad_at + 4].copy_from_slice(&0xFFFF_FF00u32.to_le_bytes());
                let mut cache = LogCache::new();
                let replayed = cache.replay(&damaged);
                prop_assert_eq!(replayed.records, bad);
                prop_assert_eq!(cache.offset(), bad_at as u64);
                prop_assert_eq!(cache.torn_tail(), None);
                let corrupt = cache.corruption();
                prop_assert!(corrupt.is_some());
                let record_at = corrupt.map_or(0, |c| c.record_at);
                prop_assert!(record_at >= 1 && bad_at + record_at < damaged.len());
            }
        }

        #[test]
        fn parse_of_encode_is_identity(
            records in proptest::collection::vec(
                (proptest::collection::vec(any::<u8>(), 0..12),
                 proptest::collection::vec(any::<u8>(), 0..12)),
                0..16,
            ),
        ) {
            let log = encode_all(&records);
            let parsed: Vec<(Vec<u8>, Vec<u8>)> = Records::new(&log)
                .map(|r| (r.key.to_vec(), r.value.to_vec()))
                .collect();
            prop_assert_eq!(parsed, records);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut records = Records::new(&bytes);
            let n = records.by_ref().count();
            let torn = records.torn_tail().map_or(0, |t| t.len);
            prop_assert_eq!(records.consumed() + torn, bytes.len());
            let mut cache = LogCache::new();
            let replayed = cache.replay(&bytes);
            prop_assert_eq!(replayed.records, n);
        }
    }
}
