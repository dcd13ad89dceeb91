//! Client → server frames: the server's push decoder and the client's encoder.
//!
//! This module decides the field layout of each of the 19 queries (and rdzv's `STATS`) (PyTorch 2.15
//! `TCPStore.cpp` on the client side, `TCPStoreLibUvBackend.cpp` on the server side) and
//! which [`Limits`] apply to which field. It does not check the `VALIDATE` magic or that
//! `VALIDATE` comes first: that is connection state, for which [`peek_query_type`]
//! reports the query type from the first byte alone.

#[cfg(feature = "alloc")]
use alloc::vec::Vec;

use super::error::{DecodeError, EncodeError, Field};
use super::wire::{self, Emit, ListProgress, Reader, Sink, Stop, LEN_WIDTH};
use super::{Decoded, Limits};
use crate::store::message::{KeyList, PairList, QueryType, Request};

/// The query type a request buffer starts with, as soon as its first byte is in:
/// `Ok(None)` for an empty buffer, an error if the byte is not a query type.
///
/// A server enforcing "the first frame must be `VALIDATE`" can close a connection whose
/// first byte is anything else without waiting for the rest of the frame.
pub fn peek_query_type(buf: &[u8]) -> Result<Option<QueryType>, DecodeError> {
    match buf.first() {
        None => Ok(None),
        Some(&byte) => QueryType::from_u8(byte)
            .map(Some)
            .ok_or(DecodeError::UnknownQuery { byte }),
    }
}

/// Decodes one request from the start of `buf`, which holds every byte of the
/// connection not yet consumed.
///
/// Returns [`Decoded::Partial`] until the whole frame is in, then
/// [`Decoded::Complete`] with the request (borrowing `buf`) and its length in bytes.
/// Claimed lengths and counts are checked against `limits` as soon as they arrive.
///
/// Each call parses from the start of the frame. That is O(1) for every query except
/// `CHECK`, `WAIT`, `MULTI_GET` and `MULTI_SET`, whose item lists are walked again on
/// every call; use a [`RequestDecoder`] to avoid that when frames arrive in many pieces.
///
/// ```
/// use rdzv_core::store::codec::{decode_request, Decoded, Limits};
/// use rdzv_core::store::Request;
///
/// let frame = b"\x00\xce\xf7\x85\x3c\x0d";
/// let decoded = decode_request(frame, &Limits::default()).unwrap();
/// assert_eq!(decoded, Decoded::Complete(Request::Validate { magic: 0x3C85_F7CE }, 5));
/// assert_eq!(decode_request(&frame[5..], &Limits::default()), Ok(Decoded::Partial(4)));
/// ```
pub fn decode_request<'b>(
    buf: &'b [u8],
    limits: &Limits,
) -> Result<Decoded<Request<'b>>, DecodeError> {
    let mut progress = ListProgress::NONE;
    wire::finish(parse(buf, limits, &mut progress))
}

/// A server-side push decoder that remembers how far it walked a key list, so that a
/// long `CHECK`/`WAIT`/`MULTI_GET`/`MULTI_SET` arriving in many pieces costs O(bytes)
/// in total rather than O(pieces × keys).
///
/// Contract: between one [`Decoded::Complete`] (or error) and the next, every call must
/// pass the same unconsumed bytes as before, possibly with more appended, which is what a
/// caller that appends to a buffer and drops consumed bytes naturally does. Call
/// [`RequestDecoder::reset`] when the buffer is replaced by something else. Breaking the
/// contract cannot panic, but may yield a list whose iteration disagrees with its
/// `len()`.
#[derive(Debug, Clone)]
pub struct RequestDecoder {
    limits: Limits,
    progress: ListProgress,
    items_walked: u64,
}

impl RequestDecoder {
    /// A decoder applying `limits`.
    pub const fn new(limits: Limits) -> RequestDecoder {
        RequestDecoder {
            limits,
            progress: ListProgress::NONE,
            items_walked: 0,
        }
    }

    /// The limits applied.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Decodes one request from the start of `buf`, as [`decode_request`] does, resuming
    /// a list walk where the previous call stopped.
    pub fn decode<'b>(&mut self, buf: &'b [u8]) -> Result<Decoded<Request<'b>>, DecodeError> {
        let mut walked = 0;
        let parsed = parse_counted(buf, &self.limits, &mut self.progress, &mut walked);
        self.items_walked = self.items_walked.saturating_add(walked as u64);
        if !matches!(parsed, Err(Stop::Partial(_))) {
            self.progress = ListProgress::NONE;
        }
        wire::finish(parsed)
    }

    /// How many list items (keys of a `CHECK`/`WAIT`/`MULTI_GET`, pairs of a
    /// `MULTI_SET`) this decoder has parsed in all, counting an item again each time it
    /// is walked. A measure of decoding work: for frames that arrive in pieces it stays
    /// equal to the items received, where a stateless decoder walks each list again on
    /// every call.
    pub fn items_walked(&self) -> u64 {
        self.items_walked
    }

    /// Forgets any partial progress (the caller's buffer no longer starts with the
    /// frame it was decoding).
    pub fn reset(&mut self) {
        self.progress = ListProgress::NONE;
    }
}

impl Default for RequestDecoder {
    fn default() -> RequestDecoder {
        RequestDecoder::new(Limits::default())
    }
}

/// Parses one request; `Ok` carries the request and the bytes it used.
fn parse<'b>(
    buf: &'b [u8],
    limits: &Limits,
    progress: &mut ListProgress,
) -> Result<(Request<'b>, usize), Stop> {
    parse_counted(buf, limits, progress, &mut 0)
}

/// [`parse`], adding the list items it walked to `walked`.
fn parse_counted<'b>(
    buf: &'b [u8],
    limits: &Limits,
    progress: &mut ListProgress,
    walked: &mut usize,
) -> Result<(Request<'b>, usize), Stop> {
    if let Some(common) = common_frame(buf, limits) {
        return Ok(common);
    }
    parse_general(buf, limits, progress, walked)
}

/// [`parse_counted`] through the general reader, for every frame.
fn parse_general<'b>(
    buf: &'b [u8],
    limits: &Limits,
    progress: &mut ListProgress,
    walked: &mut usize,
) -> Result<(Request<'b>, usize), Stop> {
    let Some(query) = peek_query_type(buf)? else {
        return Err(Stop::Partial(1));
    };
    let mut r = Reader::new(buf, 1, query);
    let parsed = fields(&mut r, query, limits, progress);
    *walked = walked.saturating_add(r.items_walked());
    parsed.map(|request| (request, r.pos()))
}

/// The frames a job sends most, `ADD`, `GET` and `SET`, cut in one pass when the whole
/// frame is in and its lengths are within `limits`. Everything else (a partial frame, a
/// length over a limit, any other query) is `None` and goes through [`fields`], which
/// decides exactly as it would have: this only skips the general reader where the answer
/// is the same (`common_frames_decode_as_the_general_parser_does` checks it).
#[inline]
fn common_frame<'b>(buf: &'b [u8], limits: &Limits) -> Option<(Request<'b>, usize)> {
    const ADD: u8 = QueryType::Add.as_u8();
    const GET: u8 = QueryType::Get.as_u8();
    const SET: u8 = QueryType::Set.as_u8();
    let (&query, rest) = buf.split_first()?;
    if !matches!(query, ADD | GET | SET) {
        return None;
    }
    let (key, rest) = prefixed(rest, limits.max_key_len)?;
    let key_end = 1 + LEN_WIDTH + key.len();
    match query {
        ADD => {
            let (delta, _) = rest.split_first_chunk::<8>()?;
            let delta = i64::from_le_bytes(*delta);
            Some((Request::Add { key, delta }, key_end + 8))
        }
        GET => Some((Request::Get { key }, key_end)),
        _ => {
            let (value, _) = prefixed(rest, limits.max_value_len)?;
            Some((
                Request::Set { key, value },
                key_end + LEN_WIDTH + value.len(),
            ))
        }
    }
}

/// A whole `u64`-length-prefixed string of at most `limit` bytes at the start of `bytes`,
/// and what follows it; `None` when it is not all there or is over the limit.
#[inline]
fn prefixed(bytes: &[u8], limit: u64) -> Option<(&[u8], &[u8])> {
    let (len, rest) = bytes.split_first_chunk::<LEN_WIDTH>()?;
    let len = u64::from_le_bytes(*len);
    if len > limit {
        return None;
    }
    let len = usize::try_from(len).ok()?;
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// The fields of a `query` frame, after its type byte.
fn fields<'b>(
    r: &mut Reader<'b>,
    query: QueryType,
    limits: &Limits,
    progress: &mut ListProgress,
) -> Result<Request<'b>, Stop> {
    let request = match query {
        QueryType::Validate => Request::Validate { magic: r.u32(0)? },
        QueryType::Set => {
            let key = key(r, limits, LEN_WIDTH)?;
            let value = value(r, limits, Field::Value, 0)?;
            Request::Set { key, value }
        }
        QueryType::CompareSet => {
            let key = key(r, limits, 2 * LEN_WIDTH)?;
            let expected = value(r, limits, Field::ExpectedValue, LEN_WIDTH)?;
            let desired = value(r, limits, Field::DesiredValue, 0)?;
            Request::CompareSet {
                key,
                expected,
                desired,
            }
        }
        QueryType::Get => Request::Get {
            key: key(r, limits, 0)?,
        },
        QueryType::Add => {
            let key = key(r, limits, 8)?;
            Request::Add {
                key,
                delta: r.i64(0)?,
            }
        }
        QueryType::Check => Request::Check {
            keys: key_list(r, limits, progress)?,
        },
        QueryType::Wait => Request::Wait {
            keys: key_list(r, limits, progress)?,
        },
        QueryType::GetNumKeys => Request::GetNumKeys,
        QueryType::DeleteKey => Request::DeleteKey {
            key: key(r, limits, 0)?,
        },
        QueryType::Append => {
            let key = key(r, limits, LEN_WIDTH)?;
            let value = value(r, limits, Field::Value, 0)?;
            Request::Append { key, value }
        }
        QueryType::MultiGet => Request::MultiGet {
            keys: key_list(r, limits, progress)?,
        },
        QueryType::MultiSet => Request::MultiSet {
            pairs: pair_list(r, limits, progress)?,
        },
        QueryType::CancelWait => Request::CancelWait,
        QueryType::Ping => Request::Ping { nonce: r.u32(0)? },
        QueryType::QueuePush => {
            let key = key(r, limits, LEN_WIDTH)?;
            let value = value(r, limits, Field::Value, 0)?;
            Request::QueuePush { key, value }
        }
        QueryType::QueuePop => Request::QueuePop {
            key: key(r, limits, 0)?,
        },
        QueryType::QueueLen => Request::QueueLen {
            key: key(r, limits, 0)?,
        },
        QueryType::ListKeys => Request::ListKeys,
        QueryType::Barrier => {
            let key = key(r, limits, 8)?;
            Request::Barrier {
                key,
                world_size: r.i64(0)?,
            }
        }
        QueryType::Stats => Request::Stats,
    };
    Ok(request)
}

fn key<'b>(r: &mut Reader<'b>, limits: &Limits, after: usize) -> Result<&'b [u8], Stop> {
    r.prefixed(Field::Key, limits.max_key_len, after)
}

fn value<'b>(
    r: &mut Reader<'b>,
    limits: &Limits,
    field: Field,
    after: usize,
) -> Result<&'b [u8], Stop> {
    r.prefixed(field, limits.max_value_len, after)
}

/// `u64` n, then n keys (`CHECK`, `WAIT`, `MULTI_GET`).
fn key_list<'b>(
    r: &mut Reader<'b>,
    limits: &Limits,
    progress: &mut ListProgress,
) -> Result<KeyList<'b>, Stop> {
    let claimed = r.u64(0)?;
    let count = r.check_count(Field::KeyCount, claimed, limits.max_key_count)?;
    let encoded = r.list(count, &[(Field::Key, limits.max_key_len)], progress)?;
    Ok(KeyList::from_validated(count, encoded))
}

/// `i64` n, then n (key, value) pairs (`MULTI_SET`). A negative n is an error.
fn pair_list<'b>(
    r: &mut Reader<'b>,
    limits: &Limits,
    progress: &mut ListProgress,
) -> Result<PairList<'b>, Stop> {
    let claimed = r.i64(0)?;
    let Ok(unsigned) = u64::try_from(claimed) else {
        return Err(DecodeError::NegativeCount {
            query: r.query(),
            field: Field::PairCount,
            claimed,
        }
        .into());
    };
    let count = r.check_count(Field::PairCount, unsigned, limits.max_key_count)?;
    let fields = [
        (Field::Key, limits.max_key_len),
        (Field::Value, limits.max_value_len),
    ];
    let encoded = r.list(count, &fields, progress)?;
    Ok(PairList::from_validated(count, encoded))
}

impl Emit for Request<'_> {
    fn emit<S: Sink>(&self, s: &mut S) {
        s.put(&[self.query_type().as_u8()]);
        match *self {
            Request::Validate { magic } => s.put(&magic.to_le_bytes()),
            Request::Ping { nonce } => s.put(&nonce.to_le_bytes()),
            Request::Set { key, value }
            | Request::Append { key, value }
            | Request::QueuePush { key, value } => {
                s.put_prefixed(key);
                s.put_prefixed(value);
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                s.put_prefixed(key);
                s.put_prefixed(expected);
                s.put_prefixed(desired);
            }
            Request::Get { key }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key } => s.put_prefixed(key),
            Request::Add { key, delta: number }
            | Request::Barrier {
                key,
                world_size: number,
            } => {
                s.put_prefixed(key);
                s.put(&number.to_le_bytes());
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                s.put(&(keys.len() as u64).to_le_bytes());
                s.put(keys.encoded());
            }
            Request::MultiSet { pairs } => {
                // A slice of at least 16 bytes per pair cannot hold more than i64::MAX.
                s.put(&(pairs.len() as i64).to_le_bytes());
                s.put(pairs.encoded());
            }
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys | Request::Stats => {}
        }
    }
}

impl Request<'_> {
    /// Checks the request against the limits a server decodes with, before it is sent:
    /// the error is the one the server would hit (it would then close the connection,
    /// PyTorch's protocol having no error reply), so a client can name the limit.
    pub fn check_limits(&self, limits: &Limits) -> Result<(), DecodeError> {
        let query = self.query_type();
        let length = |field: Field, bytes: &[u8], limit: u64| {
            let claimed = bytes.len() as u64;
            if claimed > limit {
                Err(DecodeError::LengthOverLimit {
                    query,
                    field,
                    claimed,
                    limit,
                })
            } else {
                Ok(())
            }
        };
        let key = |bytes: &[u8]| length(Field::Key, bytes, limits.max_key_len);
        let count = |field: Field, n: usize| {
            let claimed = n as u64;
            if claimed > limits.max_key_count {
                Err(DecodeError::CountOverLimit {
                    query,
                    field,
                    claimed,
                    limit: limits.max_key_count,
                })
            } else {
                Ok(())
            }
        };
        match *self {
            Request::Set { key: k, value }
            | Request::Append { key: k, value }
            | Request::QueuePush { key: k, value } => {
                key(k)?;
                length(Field::Value, value, limits.max_value_len)
            }
            Request::CompareSet {
                key: k,
                expected,
                desired,
            } => {
                key(k)?;
                length(Field::ExpectedValue, expected, limits.max_value_len)?;
                length(Field::DesiredValue, desired, limits.max_value_len)
            }
            Request::Get { key: k }
            | Request::DeleteKey { key: k }
            | Request::QueuePop { key: k }
            | Request::QueueLen { key: k }
            | Request::Add { key: k, .. }
            | Request::Barrier { key: k, .. } => key(k),
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
                count(Field::KeyCount, keys.len())?;
                keys.iter().try_for_each(key)
            }
            Request::MultiSet { pairs } => {
                count(Field::PairCount, pairs.len())?;
                pairs.iter().try_for_each(|(k, value)| {
                    key(k)?;
                    length(Field::Value, value, limits.max_value_len)
                })
            }
            Request::Validate { .. }
            | Request::Ping { .. }
            | Request::GetNumKeys
            | Request::CancelWait
            | Request::ListKeys
            | Request::Stats => Ok(()),
        }
    }

    /// How many bytes [`Request::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        wire::encoded_len(self)
    }

    /// Writes the wire frame (type byte and fields) at the start of `out`; returns the
    /// bytes written, or [`EncodeError::InsufficientSize`] if `out` is shorter than
    /// [`Request::encoded_len`].
    ///
    /// ```
    /// use rdzv_core::store::{Request, VALIDATION_MAGIC};
    ///
    /// let mut buf = [0u8; 16];
    /// let n = Request::Validate { magic: VALIDATION_MAGIC }.encode(&mut buf).unwrap();
    /// assert_eq!(&buf[..n], b"\x00\xce\xf7\x85\x3c");
    /// ```
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, EncodeError> {
        wire::encode_to_slice(self, out)
    }

    /// Appends the wire frame to `out`.
    #[cfg(feature = "alloc")]
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.reserve(self.encoded_len());
        self.emit(out);
    }
}

#[cfg(test)]
mod tests {
    use alloc::vec;
    use alloc::vec::Vec;

    use proptest::prelude::*;

    use super::*;

    /// An `ADD`, `GET` or `SET` frame (or another query's first byte) with claimed
    /// lengths that may lie, cut anywhere.
    fn frame() -> impl Strategy<Value = Vec<u8>> {
        (
            prop_oneof![
                Just(QueryType::Add),
                Just(QueryType::Get),
                Just(QueryType::Set),
                Just(QueryType::Barrier)
            ],
            proptest::collection::vec(any::<u8>(), 0..20),
            proptest::collection::vec(any::<u8>(), 0..20),
            prop_oneof![Just(None), (0u64..40).prop_map(Some), Just(Some(u64::MAX))],
            any::<i64>(),
            0usize..64,
        )
            .prop_map(|(query, key, value, lie, delta, cut)| {
                let mut buf = vec![query.as_u8()];
                buf.extend_from_slice(&lie.unwrap_or(key.len() as u64).to_le_bytes());
                buf.extend_from_slice(&key);
                match query {
                    QueryType::Set => {
                        buf.extend_from_slice(&(value.len() as u64).to_le_bytes());
                        buf.extend_from_slice(&value);
                    }
                    QueryType::Get => {}
                    _ => buf.extend_from_slice(&delta.to_le_bytes()),
                }
                let keep = buf.len().saturating_sub(cut % 8);
                buf.truncate(if cut >= 48 { keep.min(cut - 40) } else { keep });
                buf
            })
    }

    proptest! {
        #[test]
        fn common_frames_decode_as_the_general_parser_does(
            buf in frame(),
            max_key_len in prop_oneof![Just(8u64), Just(8 * 1024)],
            max_value_len in prop_oneof![Just(4u64), Just(1 << 20)],
        ) {
            let limits = Limits { max_key_len, max_value_len, ..Limits::PYTORCH };
            let (mut first, mut second) = (ListProgress::NONE, ListProgress::NONE);
            let general = parse_general(&buf, &limits, &mut first, &mut 0);
            let both = parse_counted(&buf, &limits, &mut second, &mut 0);
            prop_assert_eq!(&both, &general);
            if let Some(common) = common_frame(&buf, &limits) {
                prop_assert_eq!(Ok(common), general);
            }
        }
    }
}
