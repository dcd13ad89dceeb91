//! The single-producer single-consumer byte ring inside a [`Segment`]: record format,
//! fragmentation of large messages, and validation of everything the peer controls.
//!
//! **Records.** The data region holds records at 8-byte-aligned ring positions; a record
//! is a 16-byte header (`u32` fragment length, `u32` flags, `u64` total message length,
//! little-endian) and the fragment's bytes, padded to a multiple of 8. Records wrap around
//! the end of the region. A message that fits the ring travels as one record
//! (`FIRST | LAST`); a larger one, or one that would otherwise wait long for room, is cut
//! into fragments that each fill the free space (at least an eighth of the ring), so the
//! consumer drains while the producer writes. The producer publishes `head` only after a
//! whole record is written, so a published record is always complete.
//!
//! **Indices.** `head` and `tail` count bytes ever written and consumed (they never wrap
//! in practice: 2^64 bytes). Each side keeps its own index privately and only *writes* it
//! to shared memory; it *reads* the other's, and treats that value as untrusted:
//! `head - tail` must not exceed the capacity, a record must lie within what is
//! published, lengths and flags must be consistent with the message being assembled and
//! with our `max_message_len`. Any violation is a [`ShmError::Corrupted`], never a panic
//! or an out-of-bounds access; the connection is then unusable.
//!
//! **Orderings.** Data copies are ordered by `head.store(Release)` / `head.load(Acquire)`
//! (producer to consumer) and `tail.store(Release)` / `tail.load(Acquire)` (the consumer
//! has finished reading bytes before the producer overwrites them). The sleep/wake flags
//! use a Dekker-style handshake, described in [`super::connection`]: each side stores its
//! flag or index, issues a `SeqCst` fence, then loads the other's.
//!
//! This module does not block, spin or make syscalls; [`super::connection`] does.

use std::sync::atomic::{fence, Ordering};

use super::segment::Segment;
use super::ShmError;

/// Bytes of a record header.
pub(crate) const RECORD_HEADER: usize = 16;
/// The record starts a message.
const FIRST: u32 = 1;
/// The record ends a message.
const LAST: u32 = 2;

/// Bytes a record with `payload` bytes occupies, or `None` on overflow.
fn record_len(payload: usize) -> Option<usize> {
    payload.checked_add(RECORD_HEADER + 7).map(|n| n & !7)
}

/// The smallest fragment worth cutting off a message that could wait for more room.
fn min_fragment(capacity: usize) -> usize {
    capacity / 8
}

/// How many of the `remaining` bytes of a message to write now, as one record, given
/// `free` bytes of room in a ring of `capacity`; `None` to wait for more room.
///
/// The rest of the message goes as one record when it fits now. Otherwise a message that
/// could fit whole and is small waits for room (small messages are never cut); a large
/// one is cut to fill the free space, if that is at least [`min_fragment`].
pub(crate) fn next_fragment(free: usize, remaining: usize, capacity: usize) -> Option<usize> {
    let whole = record_len(remaining)?;
    if whole <= free {
        return Some(remaining);
    }
    if whole <= capacity && remaining <= min_fragment(capacity) {
        return None;
    }
    let room = free.saturating_sub(RECORD_HEADER) & !7;
    (room > 0 && room >= min_fragment(capacity) && room < remaining).then_some(room)
}

/// The writing side of a ring (the peer's inbox, our outbox).
pub(crate) struct Producer {
    segment: Segment,
    /// Our private copy of `head`: the shared one is only written, never trusted.
    head: u64,
}

impl Producer {
    /// Takes the producer side of a freshly created segment.
    pub(crate) fn new(segment: Segment) -> Result<Producer, ShmError> {
        let header = segment.header();
        let head = header.head.0.load(Ordering::Acquire);
        let tail = header.tail.0.load(Ordering::Acquire);
        if head != 0 || tail != 0 {
            return Err(ShmError::Handshake {
                detail: format!("peer's new ring is not empty (head {head}, tail {tail})"),
            });
        }
        Ok(Producer { segment, head: 0 })
    }

    /// Bytes in the data region.
    pub(crate) fn capacity(&self) -> usize {
        self.segment.capacity()
    }

    /// Free bytes now, from a fresh read of the consumer's `tail`.
    pub(crate) fn free(&self) -> Result<usize, ShmError> {
        let tail = self.segment.header().tail.0.load(Ordering::Acquire);
        let used = self.head.wrapping_sub(tail);
        let capacity = self.capacity() as u64;
        if used > capacity {
            return Err(ShmError::Corrupted {
                detail: format!(
                    "consumer tail {tail} is inconsistent with head {} (capacity {capacity})",
                    self.head
                ),
            });
        }
        // used <= capacity, which fits a usize.
        Ok((capacity - used) as usize)
    }

    /// Writes one record holding `fragment`, part of a message of `total` bytes, and
    /// publishes it. The caller checked that the record fits the free space.
    pub(crate) fn push_record(&mut self, fragment: &[u8], first: bool, last: bool, total: u64) {
        let flags = if first { FIRST } else { 0 } | if last { LAST } else { 0 };
        // A fragment fits the ring, whose capacity is at most 1 GiB.
        let len = fragment.len() as u32;
        let mut header = [0u8; RECORD_HEADER];
        header[..4].copy_from_slice(&len.to_le_bytes());
        header[4..8].copy_from_slice(&flags.to_le_bytes());
        header[8..].copy_from_slice(&total.to_le_bytes());
        self.segment.write_wrapping(self.head, &header);
        self.segment
            .write_wrapping(self.head.wrapping_add(RECORD_HEADER as u64), fragment);
        let step = record_len(fragment.len()).unwrap_or(RECORD_HEADER) as u64;
        self.head = self.head.wrapping_add(step);
        self.segment
            .header()
            .head
            .0
            .store(self.head, Ordering::Release);
    }

    /// After publishing: whether the consumer announced it sleeps, in which case the
    /// caller must signal its data eventfd. Clears the announcement so that one signal
    /// is sent per sleep. The `SeqCst` fence pairs with the one in
    /// [`Consumer::announce_sleep`].
    pub(crate) fn consumer_needs_wake(&self) -> bool {
        fence(Ordering::SeqCst);
        let sleeping = &self.segment.header().consumer_sleeping.0;
        sleeping.load(Ordering::Relaxed) != 0 && sleeping.swap(0, Ordering::AcqRel) != 0
    }

    /// Announces that we are about to block for free space; the consumer then signals us
    /// after it frees some. The caller must re-check [`Producer::free`] after this.
    pub(crate) fn announce_wait(&self) {
        self.segment
            .header()
            .producer_waiting
            .0
            .store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Withdraws [`Producer::announce_wait`].
    pub(crate) fn withdraw_wait(&self) {
        self.segment
            .header()
            .producer_waiting
            .0
            .store(0, Ordering::Relaxed);
    }

    /// Whether the consumer dropped its receiving half.
    pub(crate) fn consumer_closed(&self) -> bool {
        self.segment
            .header()
            .consumer_closed
            .0
            .load(Ordering::Acquire)
            != 0
    }

    /// Tells the consumer no more records will come (after the last one published).
    pub(crate) fn close(&self) {
        self.segment
            .header()
            .producer_closed
            .0
            .store(1, Ordering::SeqCst);
    }
}

/// A message being reassembled from fragments.
struct Partial {
    total: usize,
    bytes: Vec<u8>,
}

/// What the next record holds, from a validated header.
struct Record {
    len: usize,
    first: bool,
    last: bool,
    total: usize,
}

/// What [`Consumer::take_message_into`] did with a complete message.
#[derive(Debug)]
pub(crate) enum TakenInto {
    /// Copied into the buffer; this many bytes.
    Copied(usize),
    /// The message needs `needed` bytes, more than the buffer has. A single-record
    /// message is left in the ring (`kept` is `None`); a reassembled one is handed back
    /// for the caller to keep.
    TooSmall {
        needed: usize,
        kept: Option<Vec<u8>>,
    },
}

/// The reading side of a ring (our inbox).
pub(crate) struct Consumer {
    segment: Segment,
    /// Our private copy of `tail`.
    tail: u64,
    /// The largest message we accept.
    max_message_len: usize,
    partial: Option<Partial>,
    /// Set when we freed space while the producer announced it waits.
    producer_wake: bool,
}

impl Consumer {
    /// Takes the consumer side of a segment we created.
    pub(crate) fn new(segment: Segment, max_message_len: usize) -> Consumer {
        Consumer {
            segment,
            tail: 0,
            max_message_len,
            partial: None,
            producer_wake: false,
        }
    }

    /// Whether any record is published past our tail (one atomic load: the spin check).
    pub(crate) fn has_data(&self) -> bool {
        self.segment.header().head.0.load(Ordering::Relaxed) != self.tail
    }

    /// Takes the next complete message, if all its records are published; fragments of a
    /// message still being written are consumed and kept.
    pub(crate) fn take_message(&mut self) -> Result<Option<Vec<u8>>, ShmError> {
        loop {
            let Some(record) = self.next_record()? else {
                return Ok(None);
            };
            if record.first && record.last {
                let mut bytes = vec![0; record.len];
                self.read_payload(&mut bytes);
                self.consume(record.len);
                return Ok(Some(bytes));
            }
            if let Some(message) = self.take_fragment(&record)? {
                return Ok(Some(message));
            }
        }
    }

    /// Like [`Consumer::take_message`], but copies a single-record message straight into
    /// `buf`.
    pub(crate) fn take_message_into(
        &mut self,
        buf: &mut [u8],
    ) -> Result<Option<TakenInto>, ShmError> {
        loop {
            let Some(record) = self.next_record()? else {
                return Ok(None);
            };
            if record.first && record.last {
                let Some(out) = buf.get_mut(..record.len) else {
                    return Ok(Some(TakenInto::TooSmall {
                        needed: record.len,
                        kept: None,
                    }));
                };
                self.read_payload(out);
                self.consume(record.len);
                return Ok(Some(TakenInto::Copied(record.len)));
            }
            if let Some(message) = self.take_fragment(&record)? {
                return Ok(Some(match buf.get_mut(..message.len()) {
                    Some(out) => {
                        out.copy_from_slice(&message);
                        TakenInto::Copied(message.len())
                    }
                    None => TakenInto::TooSmall {
                        needed: message.len(),
                        kept: Some(message),
                    },
                }));
            }
        }
    }

    /// Returns and clears whether the producer waits for the space we freed: the caller
    /// then signals the producer's space eventfd.
    pub(crate) fn take_producer_wake(&mut self) -> bool {
        std::mem::take(&mut self.producer_wake)
    }

    /// Announces that we are about to block on our data eventfd. The caller must re-check
    /// the ring after this: the `SeqCst` fence pairs with the producer's in
    /// [`Producer::consumer_needs_wake`], so either we see its record or it sees our flag.
    pub(crate) fn announce_sleep(&self) {
        self.segment
            .header()
            .consumer_sleeping
            .0
            .store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Withdraws [`Consumer::announce_sleep`].
    pub(crate) fn withdraw_sleep(&self) {
        self.segment
            .header()
            .consumer_sleeping
            .0
            .store(0, Ordering::Relaxed);
    }

    /// Whether the producer dropped its sending half. Records it published before stay
    /// readable; check the ring again after seeing this.
    pub(crate) fn producer_closed(&self) -> bool {
        self.segment
            .header()
            .producer_closed
            .0
            .load(Ordering::Acquire)
            != 0
    }

    /// Tells the producer we will read no more.
    pub(crate) fn close(&self) {
        self.segment
            .header()
            .consumer_closed
            .0
            .store(1, Ordering::SeqCst);
    }

    /// Appends a fragment record to the message being assembled; returns the message once
    /// its last fragment arrived.
    fn take_fragment(&mut self, record: &Record) -> Result<Option<Vec<u8>>, ShmError> {
        let mut partial = match (self.partial.take(), record.first) {
            (None, true) => {
                let mut bytes = Vec::new();
                bytes.try_reserve_exact(record.total).map_err(|_| {
                    corrupted(format!(
                        "cannot allocate {} bytes for an incoming message",
                        record.total
                    ))
                })?;
                Partial {
                    total: record.total,
                    bytes,
                }
            }
            (Some(partial), false) if partial.total == record.total => partial,
            (Some(partial), true) => {
                return Err(corrupted(format!(
                    "a new message starts while {} of {} bytes of the previous one arrived",
                    partial.bytes.len(),
                    partial.total
                )));
            }
            (Some(partial), false) => {
                return Err(corrupted(format!(
                    "fragment announces a {}-byte message inside a {}-byte one",
                    record.total, partial.total
                )));
            }
            (None, false) => {
                return Err(corrupted(
                    "continuation fragment without a first one".into(),
                ));
            }
        };
        let have = partial.bytes.len();
        let after = have + record.len;
        if after > partial.total || (record.last != (after == partial.total)) {
            return Err(corrupted(format!(
                "fragment of {} bytes after {have} of a {}-byte message (last: {})",
                record.len, partial.total, record.last
            )));
        }
        partial.bytes.resize(after, 0);
        if let Some(out) = partial.bytes.get_mut(have..) {
            self.read_payload(out);
        }
        self.consume(record.len);
        if record.last {
            Ok(Some(partial.bytes))
        } else {
            self.partial = Some(partial);
            Ok(None)
        }
    }

    /// Reads and validates the header of the next published record, without consuming it.
    fn next_record(&mut self) -> Result<Option<Record>, ShmError> {
        let head = self.segment.header().head.0.load(Ordering::Acquire);
        let available = head.wrapping_sub(self.tail);
        let capacity = self.segment.capacity() as u64;
        if available == 0 {
            return Ok(None);
        }
        if available > capacity {
            return Err(corrupted(format!(
                "producer head {head} is inconsistent with tail {} (capacity {capacity})",
                self.tail
            )));
        }
        if available < RECORD_HEADER as u64 {
            return Err(corrupted(format!(
                "{available} bytes published, less than a record header"
            )));
        }
        let mut raw = [0u8; RECORD_HEADER];
        self.segment.read_wrapping(self.tail, &mut raw);
        let [l0, l1, l2, l3, f0, f1, f2, f3, t0, t1, t2, t3, t4, t5, t6, t7] = raw;
        let len = u32::from_le_bytes([l0, l1, l2, l3]) as usize;
        let flags = u32::from_le_bytes([f0, f1, f2, f3]);
        let total = u64::from_le_bytes([t0, t1, t2, t3, t4, t5, t6, t7]);
        if flags & !(FIRST | LAST) != 0 {
            return Err(corrupted(format!("unknown record flags {flags:#x}")));
        }
        let needed = record_len(len).map_or(u64::MAX, |n| n as u64);
        if needed > available {
            return Err(corrupted(format!(
                "record of {len} bytes overruns the {available} bytes published"
            )));
        }
        let total = usize::try_from(total)
            .ok()
            .filter(|&t| t <= self.max_message_len)
            .ok_or_else(|| {
                corrupted(format!(
                    "message of {total} bytes exceeds our limit of {} bytes",
                    self.max_message_len
                ))
            })?;
        let (first, last) = (flags & FIRST != 0, flags & LAST != 0);
        if first && last && total != len {
            return Err(corrupted(format!(
                "single-record message of {len} bytes announces {total} bytes"
            )));
        }
        Ok(Some(Record {
            len,
            first,
            last,
            total,
        }))
    }

    fn read_payload(&self, out: &mut [u8]) {
        self.segment
            .read_wrapping(self.tail.wrapping_add(RECORD_HEADER as u64), out);
    }

    /// Releases the record of `len` payload bytes at our tail to the producer, and notes
    /// whether it waits for that room (the `SeqCst` fence pairs with the one in
    /// [`Producer::announce_wait`]).
    fn consume(&mut self, len: usize) {
        let step = record_len(len).unwrap_or(RECORD_HEADER) as u64;
        self.tail = self.tail.wrapping_add(step);
        let header = self.segment.header();
        header.tail.0.store(self.tail, Ordering::Release);
        fence(Ordering::SeqCst);
        let waiting = &header.producer_waiting.0;
        if waiting.load(Ordering::Relaxed) != 0 && waiting.swap(0, Ordering::AcqRel) != 0 {
            self.producer_wake = true;
        }
    }
}

fn corrupted(detail: String) -> ShmError {
    ShmError::Corrupted { detail }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::segment::MIN_CAPACITY;

    /// A producer and a consumer over two mappings of one segment, as two processes
    /// would have them.
    fn pair(capacity: usize) -> (Producer, Consumer) {
        let (mine, fd) = Segment::create(capacity).expect("create segment");
        let theirs = Segment::open(&fd, capacity as u64).expect("map segment");
        (
            Producer::new(theirs).expect("fresh ring"),
            Consumer::new(mine, 1 << 30),
        )
    }

    /// Sends `msg` the way the connection does, without blocking: every fragment must fit.
    fn push(p: &mut Producer, msg: &[u8]) -> bool {
        let mut sent = 0;
        while sent < msg.len() || (sent == 0 && msg.is_empty()) {
            let free = p.free().expect("free");
            let Some(n) = next_fragment(free, msg.len() - sent, p.capacity()) else {
                return false;
            };
            let last = sent + n == msg.len();
            p.push_record(&msg[sent..sent + n], sent == 0, last, msg.len() as u64);
            sent += n;
            if last {
                break;
            }
        }
        true
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn empty_and_one_byte_messages_round_trip() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        assert_eq!(c.take_message().unwrap(), None);
        assert!(push(&mut p, b""));
        assert!(push(&mut p, b"x"));
        assert_eq!(c.take_message().unwrap(), Some(vec![]));
        assert_eq!(c.take_message().unwrap(), Some(b"x".to_vec()));
        assert_eq!(c.take_message().unwrap(), None);
    }

    #[test]
    fn records_wrap_around_the_end_many_times() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        // 100-byte payloads make 120-byte records, which do not divide 4096, so headers
        // and payloads straddle the end of the region at varying offsets.
        for i in 0..2000u32 {
            let msg = pattern(100 + (i as usize % 13), i as u8);
            assert!(push(&mut p, &msg), "message {i} should fit an empty ring");
            assert_eq!(c.take_message().unwrap(), Some(msg), "message {i}");
        }
    }

    #[test]
    fn full_ring_refuses_until_consumed_and_exact_fit_is_accepted() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        // One record filling the ring exactly: 16 header bytes plus 4080 payload bytes.
        let exact = pattern(MIN_CAPACITY - RECORD_HEADER, 7);
        assert!(push(&mut p, &exact));
        assert_eq!(p.free().unwrap(), 0);
        assert!(
            !push(&mut p, b""),
            "a full ring takes not even an empty record"
        );
        assert_eq!(c.take_message().unwrap(), Some(exact));
        assert_eq!(p.free().unwrap(), MIN_CAPACITY);
        // Small messages wait instead of being cut.
        let small = pattern(300, 1);
        let mut queued = 0;
        while push(&mut p, &small) {
            queued += 1;
        }
        assert_eq!(queued, MIN_CAPACITY / 320);
        for _ in 0..queued {
            assert_eq!(c.take_message().unwrap(), Some(small.clone()));
        }
        assert_eq!(c.take_message().unwrap(), None);
    }

    #[test]
    fn messages_larger_than_the_ring_are_fragmented_and_reassembled() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        let big = pattern(MIN_CAPACITY * 5 + 3, 9);
        let mut sent = 0;
        let mut received = None;
        let mut rounds = 0;
        while received.is_none() {
            rounds += 1;
            assert!(rounds < 100, "no progress");
            let free = p.free().unwrap();
            if sent < big.len() {
                if let Some(n) = next_fragment(free, big.len() - sent, p.capacity()) {
                    let last = sent + n == big.len();
                    p.push_record(&big[sent..sent + n], sent == 0, last, big.len() as u64);
                    sent += n;
                }
            }
            received = c.take_message().unwrap();
        }
        assert_eq!(received, Some(big));
    }

    #[test]
    fn take_into_leaves_a_message_that_does_not_fit() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        assert!(push(&mut p, b"hello world"));
        let mut small = [0u8; 4];
        assert!(matches!(
            c.take_message_into(&mut small).unwrap(),
            Some(TakenInto::TooSmall {
                needed: 11,
                kept: None
            })
        ));
        let mut buf = [0u8; 64];
        assert!(matches!(
            c.take_message_into(&mut buf).unwrap(),
            Some(TakenInto::Copied(11))
        ));
        assert_eq!(&buf[..11], b"hello world");
    }

    #[test]
    fn fragment_policy() {
        let cap = 1 << 20;
        // Fits: whole.
        assert_eq!(next_fragment(cap, 100, cap), Some(100));
        // Small message, not enough room: wait rather than cut.
        assert_eq!(next_fragment(50, 100, cap), None);
        // Large message, a quarter of the ring free: fill it.
        assert_eq!(
            next_fragment(cap / 4, cap / 2, cap),
            Some(cap / 4 - RECORD_HEADER)
        );
        // Large message, too little room for a worthwhile fragment: wait.
        assert_eq!(next_fragment(cap / 16, cap / 2, cap), None);
        // Larger than the ring: fragments of the free space.
        assert_eq!(next_fragment(cap, 3 * cap, cap), Some(cap - RECORD_HEADER));
        // Exact fit of the largest single record.
        assert_eq!(
            next_fragment(cap, cap - RECORD_HEADER, cap),
            Some(cap - RECORD_HEADER)
        );
    }

    #[test]
    fn corrupted_head_is_an_error_not_a_read() {
        let (p, mut c) = pair(MIN_CAPACITY);
        p.segment
            .header()
            .head
            .0
            .store(MIN_CAPACITY as u64 + 8, Ordering::Release);
        assert!(matches!(c.take_message(), Err(ShmError::Corrupted { .. })));
        p.segment.header().head.0.store(u64::MAX, Ordering::Release);
        assert!(matches!(c.take_message(), Err(ShmError::Corrupted { .. })));
        p.segment.header().head.0.store(8, Ordering::Release);
        assert!(matches!(c.take_message(), Err(ShmError::Corrupted { .. })));
    }

    #[test]
    fn corrupted_tail_is_an_error_for_the_producer() {
        let (p, c) = pair(MIN_CAPACITY);
        c.segment.header().tail.0.store(12345, Ordering::Release);
        assert!(matches!(p.free(), Err(ShmError::Corrupted { .. })));
    }

    /// Writes a raw record header and publishes `published` bytes.
    fn forge(p: &Producer, len: u32, flags: u32, total: u64, published: u64) {
        let mut raw = [0u8; RECORD_HEADER];
        raw[..4].copy_from_slice(&len.to_le_bytes());
        raw[4..8].copy_from_slice(&flags.to_le_bytes());
        raw[8..].copy_from_slice(&total.to_le_bytes());
        p.segment.write_wrapping(0, &raw);
        p.segment
            .header()
            .head
            .0
            .store(published, Ordering::Release);
    }

    #[test]
    fn corrupted_record_headers_are_errors() {
        let cases: [(u32, u32, u64, u64); 7] = [
            // Length beyond what is published.
            (4096, FIRST | LAST, 4096, 64),
            // Length near u32::MAX.
            (u32::MAX, FIRST | LAST, u32::MAX as u64, 4096),
            // Unknown flags.
            (8, 0x80 | FIRST | LAST, 8, 24),
            // Single record whose total disagrees.
            (8, FIRST | LAST, 9, 24),
            // Continuation without a first fragment.
            (8, LAST, 8, 24),
            // Total beyond our limit.
            (8, FIRST, u64::MAX, 24),
            // First fragment longer than its message.
            (16, FIRST, 8, 32),
        ];
        for (i, &(len, flags, total, published)) in cases.iter().enumerate() {
            let (p, mut c) = pair(MIN_CAPACITY);
            forge(&p, len, flags, total, published);
            let result = c.take_message();
            assert!(
                matches!(result, Err(ShmError::Corrupted { .. })),
                "case {i}: {result:?}"
            );
        }
    }

    #[test]
    fn message_over_the_limit_is_refused() {
        let (mine, fd) = Segment::create(MIN_CAPACITY).unwrap();
        let mut p = Producer::new(Segment::open(&fd, MIN_CAPACITY as u64).unwrap()).unwrap();
        let mut c = Consumer::new(mine, 10);
        assert!(push(&mut p, &[1; 11]));
        assert!(matches!(c.take_message(), Err(ShmError::Corrupted { .. })));
    }

    #[test]
    fn open_checks_size_seals_and_header() {
        let (_mine, fd) = Segment::create(MIN_CAPACITY).unwrap();
        assert!(matches!(
            Segment::open(&fd, 2 * MIN_CAPACITY as u64),
            Err(ShmError::Handshake { .. })
        ));
        assert!(matches!(
            Segment::open(&fd, 3000),
            Err(ShmError::Handshake { .. })
        ));
        // An unsealed memfd of the right size is refused too.
        let unsealed = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&unsealed, (4096 + MIN_CAPACITY) as u64).unwrap();
        assert!(matches!(
            Segment::open(&unsealed, MIN_CAPACITY as u64),
            Err(ShmError::Handshake { .. })
        ));
    }

    #[test]
    fn wake_flags_are_one_shot() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        p.push_record(b"a", true, true, 1);
        assert!(!p.consumer_needs_wake());
        c.announce_sleep();
        p.push_record(b"b", true, true, 1);
        assert!(p.consumer_needs_wake());
        assert!(!p.consumer_needs_wake(), "one signal per announced sleep");
        p.announce_wait();
        assert!(c.take_message().unwrap().is_some());
        assert!(c.take_producer_wake());
        assert!(!c.take_producer_wake());
        assert!(c.take_message().unwrap().is_some());
        assert!(!c.take_producer_wake(), "one signal per announced wait");
    }
}
