//! The primitive encodings shared by requests and replies (PyTorch `tcputil` /
//! `SendBuffer` / libuv `ChunkedStream`): little-endian scalars, `u64`-length-prefixed
//! byte strings, and counted lists of them.
//!
//! The reader here decides only whether enough bytes are present, whether a claimed
//! length fits its limit, and how many more bytes are needed at least; it knows nothing
//! of which query has which fields (that is [`super::request`] and [`super::response`]).

use super::error::{DecodeError, EncodeError, Field};
use super::Decoded;
use crate::store::message::QueryType;

/// Width of a length prefix or count on the wire.
pub(super) const LEN_WIDTH: usize = 8;

/// Why a parse stopped before producing a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// At least this many more bytes are needed (always ≥ 1).
    Partial(usize),
    /// The bytes are invalid.
    Invalid(DecodeError),
}

impl From<DecodeError> for Stop {
    fn from(error: DecodeError) -> Stop {
        Stop::Invalid(error)
    }
}

/// Turns the internal parse result into the public push-decoder result.
pub(super) fn finish<T>(parsed: Result<(T, usize), Stop>) -> Result<Decoded<T>, DecodeError> {
    match parsed {
        Ok((value, consumed)) => Ok(Decoded::Complete(value, consumed)),
        Err(Stop::Partial(needed)) => Ok(Decoded::Partial(needed.max(1))),
        Err(Stop::Invalid(error)) => Err(error),
    }
}

/// A cursor over the bytes received so far. `pos <= buf.len()` always holds.
#[derive(Debug)]
pub(super) struct Reader<'b> {
    buf: &'b [u8],
    pos: usize,
    query: QueryType,
    /// List items parsed by this reader (resumed items not counted).
    items_walked: usize,
}

impl<'b> Reader<'b> {
    /// A reader at `pos` (clamped to the buffer) reporting errors against `query`.
    pub(super) fn new(buf: &'b [u8], pos: usize, query: QueryType) -> Reader<'b> {
        Reader {
            buf,
            pos: pos.min(buf.len()),
            query,
            items_walked: 0,
        }
    }

    /// Bytes consumed so far (the position in the buffer).
    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    /// How many list items this reader parsed (items resumed past are not counted).
    pub(super) fn items_walked(&self) -> usize {
        self.items_walked
    }

    /// The query errors are reported against.
    pub(super) fn query(&self) -> QueryType {
        self.query
    }

    fn available(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    /// Takes the next `n` bytes. `after` is the least number of bytes the frame still
    /// needs once these are read; it only sharpens the `Partial` hint.
    pub(super) fn take(&mut self, n: usize, after: usize) -> Result<&'b [u8], Stop> {
        let available = self.available();
        if available < n {
            return Err(Stop::Partial((n - available).saturating_add(after)));
        }
        let end = self.pos + n;
        match self.buf.get(self.pos..end) {
            Some(bytes) => {
                self.pos = end;
                Ok(bytes)
            }
            None => Err(Stop::Partial(n.saturating_add(after))),
        }
    }

    fn array<const N: usize>(&mut self, after: usize) -> Result<[u8; N], Stop> {
        let bytes = self.take(N, after)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    /// A `u8`.
    pub(super) fn u8(&mut self, after: usize) -> Result<u8, Stop> {
        Ok(u8::from_le_bytes(self.array(after)?))
    }

    /// A little-endian `u32`.
    pub(super) fn u32(&mut self, after: usize) -> Result<u32, Stop> {
        Ok(u32::from_le_bytes(self.array(after)?))
    }

    /// A little-endian `u64`.
    pub(super) fn u64(&mut self, after: usize) -> Result<u64, Stop> {
        Ok(u64::from_le_bytes(self.array(after)?))
    }

    /// A little-endian `i64`.
    pub(super) fn i64(&mut self, after: usize) -> Result<i64, Stop> {
        Ok(i64::from_le_bytes(self.array(after)?))
    }

    /// A `u64` length-prefixed byte string of at most `limit` bytes. The length is
    /// checked as soon as its eight bytes are in, before waiting for the body.
    pub(super) fn prefixed(
        &mut self,
        field: Field,
        limit: u64,
        after: usize,
    ) -> Result<&'b [u8], Stop> {
        let claimed = self.u64(after)?;
        let len = self.check_len(field, claimed, limit)?;
        self.take(len, after)
    }

    /// Checks a claimed length against `limit` and against what this machine can index.
    fn check_len(&self, field: Field, claimed: u64, limit: u64) -> Result<usize, Stop> {
        let over = |limit| DecodeError::LengthOverLimit {
            query: self.query,
            field,
            claimed,
            limit,
        };
        if claimed > limit {
            return Err(over(limit).into());
        }
        usize::try_from(claimed).map_err(|_| over(usize::MAX as u64).into())
    }

    /// Checks a claimed count against `limit` and against what this machine can index.
    pub(super) fn check_count(
        &self,
        field: Field,
        claimed: u64,
        limit: u64,
    ) -> Result<usize, Stop> {
        let over = |limit| DecodeError::CountOverLimit {
            query: self.query,
            field,
            claimed,
            limit,
        };
        if claimed > limit {
            return Err(over(limit).into());
        }
        usize::try_from(claimed).map_err(|_| over(usize::MAX as u64).into())
    }

    /// Walks `count` items of length-prefixed fields (one `(field, limit)` per field of
    /// an item), resuming from `progress` when it describes this same list, and returns
    /// the encoded items. On `Partial`, `progress` records the last whole item so that
    /// the next call need not walk the list again.
    pub(super) fn list(
        &mut self,
        count: usize,
        fields: &[(Field, u64)],
        progress: &mut ListProgress,
    ) -> Result<&'b [u8], Stop> {
        let start = self.pos;
        let item_min = fields.len().saturating_mul(LEN_WIDTH);
        let (mut done, resume_at) = progress.resume(self.query, start, count, self.buf.len());
        self.pos = resume_at;
        while done < count {
            let item_start = self.pos;
            let items_after = count - done - 1;
            for (index, &(field, limit)) in fields.iter().enumerate() {
                let fields_after = fields.len() - index - 1;
                let after = items_after
                    .saturating_mul(item_min)
                    .saturating_add(fields_after * LEN_WIDTH);
                if let Err(stop) = self.prefixed(field, limit, after) {
                    if let Stop::Partial(_) = stop {
                        *progress = ListProgress {
                            query: Some(self.query),
                            start,
                            count,
                            done,
                            offset: item_start,
                        };
                    }
                    return Err(stop);
                }
            }
            done += 1;
            self.items_walked += 1;
        }
        *progress = ListProgress::NONE;
        self.buf.get(start..self.pos).ok_or(Stop::Partial(1))
    }
}

/// How far a list walk got in an earlier call: the list of `count` items answering
/// `query` started at `start`, and `done` whole items end at `offset`. `query == None`
/// means nothing is remembered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ListProgress {
    query: Option<QueryType>,
    start: usize,
    count: usize,
    done: usize,
    offset: usize,
}

impl ListProgress {
    /// Nothing remembered.
    pub(super) const NONE: ListProgress = ListProgress {
        query: None,
        start: 0,
        count: 0,
        done: 0,
        offset: 0,
    };

    /// Where to resume a walk of `count` items of `query` starting at `start` in a
    /// buffer of `buf_len` bytes: `(items done, offset)`, or `(0, start)` if the saved
    /// progress is about another list or no longer fits the buffer.
    fn resume(
        &self,
        query: QueryType,
        start: usize,
        count: usize,
        buf_len: usize,
    ) -> (usize, usize) {
        let same_list = self.query == Some(query) && self.start == start && self.count == count;
        if same_list && self.done < count && self.offset >= start && self.offset <= buf_len {
            (self.done, self.offset)
        } else {
            (0, start)
        }
    }
}

/// Where encoders put bytes: a caller slice, a `Vec`, or just a byte count.
pub(super) trait Sink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]);

    /// Appends a `u64` length prefix and `bytes`.
    fn put_prefixed(&mut self, bytes: &[u8]) {
        self.put(&(bytes.len() as u64).to_le_bytes());
        self.put(bytes);
    }
}

/// Counts bytes instead of writing them; saturates rather than overflowing.
#[derive(Debug, Default)]
pub(super) struct Counter(pub(super) usize);

impl Sink for Counter {
    fn put(&mut self, bytes: &[u8]) {
        self.0 = self.0.saturating_add(bytes.len());
    }
}

/// Writes into a caller slice that the caller has checked is large enough.
#[derive(Debug)]
pub(super) struct SliceSink<'o> {
    rest: &'o mut [u8],
    written: usize,
}

impl<'o> SliceSink<'o> {
    pub(super) fn new(out: &'o mut [u8]) -> SliceSink<'o> {
        SliceSink {
            rest: out,
            written: 0,
        }
    }

    /// Bytes written so far.
    pub(super) fn written(&self) -> usize {
        self.written
    }
}

impl Sink for SliceSink<'_> {
    fn put(&mut self, bytes: &[u8]) {
        let rest = core::mem::take(&mut self.rest);
        if rest.len() < bytes.len() {
            // Unreachable when the caller checked `encoded_len()` first; writing nothing
            // keeps `written()` short so the mismatch is visible instead of a panic.
            self.rest = rest;
            return;
        }
        let (head, tail) = rest.split_at_mut(bytes.len());
        head.copy_from_slice(bytes);
        self.rest = tail;
        self.written += bytes.len();
    }
}

#[cfg(feature = "alloc")]
impl Sink for alloc::vec::Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// A value with a wire encoding. `emit` must only be called after `check` passed.
pub(super) trait Emit {
    /// Whether the value can be encoded at all.
    fn check(&self) -> Result<(), EncodeError> {
        Ok(())
    }

    /// Writes the encoding into `sink`.
    fn emit<S: Sink>(&self, sink: &mut S);
}

/// Length of the encoding of `value`.
pub(super) fn encoded_len<E: Emit + ?Sized>(value: &E) -> usize {
    let mut counter = Counter::default();
    value.emit(&mut counter);
    counter.0
}

/// Encodes `value` into `out` after checking it is large enough; returns bytes written.
pub(super) fn encode_to_slice<E: Emit + ?Sized>(
    value: &E,
    out: &mut [u8],
) -> Result<usize, EncodeError> {
    value.check()?;
    let needed = encoded_len(value);
    if out.len() < needed {
        return Err(EncodeError::InsufficientSize { needed });
    }
    let mut sink = SliceSink::new(out);
    value.emit(&mut sink);
    if sink.written() == needed {
        Ok(needed)
    } else {
        Err(EncodeError::InsufficientSize { needed })
    }
}

/// Appends the encoding of `value` to `out`. The room is reserved fallibly: a reply too
/// large for the allocator is [`EncodeError::OutOfMemory`], never an abort (a caller that
/// bounds memory checks `encoded_len` against its budget first).
#[cfg(feature = "alloc")]
pub(super) fn encode_to_vec<E: Emit + ?Sized>(
    value: &E,
    out: &mut alloc::vec::Vec<u8>,
) -> Result<(), EncodeError> {
    value.check()?;
    let needed = encoded_len(value);
    out.try_reserve(needed)
        .map_err(|_| EncodeError::OutOfMemory { needed })?;
    value.emit(out);
    Ok(())
}
