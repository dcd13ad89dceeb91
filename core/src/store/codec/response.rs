//! Server → client frames: the server's encoder and the client's push decoder.
//!
//! Replies carry neither a type byte nor a length, so this module decides, for each
//! query, what its reply looks like ([`PendingReply`]): `MULTI_GET`'s reply is n values
//! with no count (n is the request's), `QUEUE_POP`'s is an `i64` followed by a value only
//! when that `i64` is positive, `LIST_KEYS`'s is an `i64` count and then the keys. It does
//! not run the client's `WAIT`/`CANCEL_WAIT` exchange (PyTorch `TCPStore::doWait`): it
//! decodes each one-byte reply as it comes and leaves the sequence to the caller.

#[cfg(feature = "alloc")]
use alloc::vec::Vec;

use super::error::{DecodeError, EncodeError, Field};
use super::wire::{self, Emit, ListProgress, Reader, Sink, Stop};
use super::{Decoded, Limits};
use crate::store::message::{
    CheckResponse, KeyList, QueryType, Request, Response, StoreStats, WaitResponse,
};

/// The values of a `MULTI_GET` reply: n length-prefixed byte strings, the same wire
/// shape as a [`KeyList`], validated and borrowed from the frame.
pub type ValueList<'a> = KeyList<'a>;

/// What a reply looks like on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Shape {
    /// `u32` nonce.
    Pong,
    /// One length-prefixed value.
    Value,
    /// One `i64`.
    Int,
    /// One byte, [`CheckResponse`].
    Check,
    /// One byte, [`WaitResponse`].
    Wait,
    /// This many length-prefixed values, no count.
    Values(usize),
    /// `i64`, then a value if it is positive.
    QueuePop,
    /// `i64` count, then that many length-prefixed keys.
    Keys,
    /// `u64` count, then that many `u64` counters (rdzv's `STATS`).
    Stats,
}

/// Most counters a `STATS` reply may claim. This version sends
/// [`StoreStats::COUNTERS`]; the margin leaves newer servers room to add counters while a
/// hostile count is refused before anything is waited for.
pub const MAX_STATS_COUNTERS: u64 = 4096;

/// The reply a client is waiting for: which query it answers and, for `MULTI_GET`, how
/// many values it carries. Queries that get no reply (`VALIDATE`, `SET`, `APPEND`,
/// `MULTI_SET`, `QUEUE_PUSH`) have no `PendingReply`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PendingReply {
    query: QueryType,
    shape: Shape,
}

impl PendingReply {
    /// The reply to a `query`; `multi_get_keys` is the number of keys a `MULTI_GET`
    /// asked for and is ignored for other queries. `None` if the query has no reply.
    pub const fn new(query: QueryType, multi_get_keys: usize) -> Option<PendingReply> {
        let shape = match query {
            QueryType::Validate
            | QueryType::Set
            | QueryType::Append
            | QueryType::MultiSet
            | QueryType::QueuePush => return None,
            QueryType::Ping => Shape::Pong,
            QueryType::CompareSet | QueryType::Get => Shape::Value,
            QueryType::Add | QueryType::GetNumKeys | QueryType::DeleteKey | QueryType::QueueLen => {
                Shape::Int
            }
            QueryType::Check => Shape::Check,
            QueryType::Wait | QueryType::CancelWait | QueryType::Barrier => Shape::Wait,
            QueryType::MultiGet => Shape::Values(multi_get_keys),
            QueryType::QueuePop => Shape::QueuePop,
            QueryType::ListKeys => Shape::Keys,
            QueryType::Stats => Shape::Stats,
        };
        Some(PendingReply { query, shape })
    }

    /// The reply `request` will get, or `None` if it gets none.
    pub fn for_request(request: &Request<'_>) -> Option<PendingReply> {
        let keys = match request {
            Request::MultiGet { keys } => keys.len(),
            _ => 0,
        };
        PendingReply::new(request.query_type(), keys)
    }

    /// The query this reply answers.
    pub const fn query(&self) -> QueryType {
        self.query
    }
}

/// A decoded reply whose lists are borrowed views, so that it needs no `alloc`. It
/// mirrors [`Response`]; with `alloc`, `ResponseView::to_response` converts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[allow(clippy::large_enum_variant)] // STATS' counters, a rare reply, held inline
pub enum ResponseView<'a> {
    /// `PING`: the nonce, echoed.
    Pong(u32),
    /// `GET` and `COMPARE_SET`: one value.
    Value(&'a [u8]),
    /// `ADD`, `GETNUMKEYS`, `DELETE_KEY`, `QUEUE_LEN`: one `i64`.
    Int(i64),
    /// `CHECK`.
    Check(CheckResponse),
    /// `WAIT`, `BARRIER` and `CANCEL_WAIT`.
    Wait(WaitResponse),
    /// `MULTI_GET`: one value per requested key, in order.
    Values(ValueList<'a>),
    /// `QUEUE_POP`.
    QueuePop {
        /// The queue's length before this pop.
        len_before: i64,
        /// The popped element; `Some` exactly when `len_before > 0`.
        value: Option<&'a [u8]>,
    },
    /// `LIST_KEYS`: the server's raw keys.
    Keys(KeyList<'a>),
    /// `STATS` (rdzv's extension): the server's counters.
    Stats(StoreStats),
}

#[cfg(feature = "alloc")]
impl<'a> ResponseView<'a> {
    /// The same reply as a [`Response`], collecting list views into `Vec`s of borrowed
    /// slices (the bytes themselves are not copied).
    pub fn to_response(&self) -> Response<'a> {
        match *self {
            ResponseView::Pong(nonce) => Response::Pong(nonce),
            ResponseView::Value(value) => Response::Value(value),
            ResponseView::Int(number) => Response::Int(number),
            ResponseView::Check(check) => Response::Check(check),
            ResponseView::Wait(wait) => Response::Wait(wait),
            ResponseView::Values(values) => Response::Values(collect(values)),
            ResponseView::QueuePop { len_before, value } => {
                Response::QueuePop { len_before, value }
            }
            ResponseView::Keys(keys) => Response::Keys(collect(keys)),
            ResponseView::Stats(stats) => Response::Stats(alloc::boxed::Box::new(stats)),
        }
    }
}

#[cfg(feature = "alloc")]
fn collect(list: KeyList<'_>) -> Vec<&[u8]> {
    // The list was validated against the bytes present, so `len()` is not a claim.
    let mut out = Vec::with_capacity(list.len());
    out.extend(list.iter());
    out
}

#[cfg(feature = "alloc")]
impl<'a> From<ResponseView<'a>> for Response<'a> {
    fn from(view: ResponseView<'a>) -> Response<'a> {
        view.to_response()
    }
}

/// Decodes the reply `pending` describes from the start of `buf` (every byte of the
/// connection not yet consumed), checking claimed lengths and counts against `limits`.
///
/// Each call parses from the start of the reply; only a `MULTI_GET` or `LIST_KEYS` list
/// is walked again on every call (see [`ResponseDecoder`]).
///
/// ```
/// use rdzv_core::store::codec::{decode_response_view, Decoded, Limits, PendingReply, ResponseView};
/// use rdzv_core::store::QueryType;
///
/// let pending = PendingReply::new(QueryType::QueuePop, 0).unwrap();
/// let empty_queue = 0i64.to_le_bytes();
/// assert_eq!(
///     decode_response_view(pending, &empty_queue, &Limits::default()),
///     Ok(Decoded::Complete(ResponseView::QueuePop { len_before: 0, value: None }, 8)),
/// );
/// ```
pub fn decode_response_view<'b>(
    pending: PendingReply,
    buf: &'b [u8],
    limits: &Limits,
) -> Result<Decoded<ResponseView<'b>>, DecodeError> {
    let mut progress = ListProgress::NONE;
    wire::finish(parse(pending, buf, limits, &mut progress))
}

/// Decodes the reply `pending` describes, as [`decode_response_view`] does, collecting
/// `MULTI_GET` and `LIST_KEYS` lists into a [`Response`].
#[cfg(feature = "alloc")]
pub fn decode_response<'b>(
    pending: PendingReply,
    buf: &'b [u8],
    limits: &Limits,
) -> Result<Decoded<Response<'b>>, DecodeError> {
    decode_response_view(pending, buf, limits).map(|decoded| decoded.map(Response::from))
}

/// A client-side push decoder for one expected reply, remembering how far it walked a
/// `MULTI_GET` or `LIST_KEYS` list between calls. Same contract as
/// [`super::RequestDecoder`]: pass the same unconsumed bytes each time, possibly with
/// more appended. Make a new one (it is cheap) for each reply.
#[derive(Debug, Clone)]
pub struct ResponseDecoder {
    pending: PendingReply,
    limits: Limits,
    progress: ListProgress,
}

impl ResponseDecoder {
    /// A decoder for the reply `pending`, applying `limits`.
    pub const fn new(pending: PendingReply, limits: Limits) -> ResponseDecoder {
        ResponseDecoder {
            pending,
            limits,
            progress: ListProgress::NONE,
        }
    }

    /// The reply this decoder expects.
    pub fn pending(&self) -> PendingReply {
        self.pending
    }

    /// Decodes the reply from the start of `buf`, resuming a list walk.
    pub fn decode<'b>(&mut self, buf: &'b [u8]) -> Result<Decoded<ResponseView<'b>>, DecodeError> {
        let parsed = parse(self.pending, buf, &self.limits, &mut self.progress);
        if !matches!(parsed, Err(Stop::Partial(_))) {
            self.progress = ListProgress::NONE;
        }
        wire::finish(parsed)
    }

    /// [`ResponseDecoder::decode`], collecting lists into a [`Response`].
    #[cfg(feature = "alloc")]
    pub fn decode_response<'b>(
        &mut self,
        buf: &'b [u8],
    ) -> Result<Decoded<Response<'b>>, DecodeError> {
        self.decode(buf).map(|decoded| decoded.map(Response::from))
    }

    /// Forgets any partial progress.
    pub fn reset(&mut self) {
        self.progress = ListProgress::NONE;
    }
}

fn parse<'b>(
    pending: PendingReply,
    buf: &'b [u8],
    limits: &Limits,
    progress: &mut ListProgress,
) -> Result<(ResponseView<'b>, usize), Stop> {
    let query = pending.query;
    let mut r = Reader::new(buf, 0, query);
    let invalid_byte = |byte| Stop::Invalid(DecodeError::InvalidReplyByte { query, byte });
    let view = match pending.shape {
        Shape::Pong => ResponseView::Pong(r.u32(0)?),
        Shape::Value => {
            ResponseView::Value(r.prefixed(Field::ReplyValue, limits.max_value_len, 0)?)
        }
        Shape::Int => ResponseView::Int(r.i64(0)?),
        Shape::Check => ResponseView::Check(match r.u8(0)? {
            0 => CheckResponse::Ready,
            1 => CheckResponse::NotReady,
            byte => return Err(invalid_byte(byte)),
        }),
        Shape::Wait => ResponseView::Wait(match r.u8(0)? {
            0 => WaitResponse::StopWaiting,
            1 => WaitResponse::WaitCanceled,
            byte => return Err(invalid_byte(byte)),
        }),
        Shape::Values(count) => {
            let fields = [(Field::ReplyValue, limits.max_value_len)];
            let encoded = r.list(count, &fields, progress)?;
            ResponseView::Values(KeyList::from_validated(count, encoded))
        }
        Shape::QueuePop => {
            let len_before = r.i64(0)?;
            let value = if len_before > 0 {
                Some(r.prefixed(Field::ReplyValue, limits.max_value_len, 0)?)
            } else {
                None
            };
            ResponseView::QueuePop { len_before, value }
        }
        Shape::Keys => {
            let claimed = r.i64(0)?;
            let Ok(unsigned) = u64::try_from(claimed) else {
                return Err(DecodeError::NegativeCount {
                    query,
                    field: Field::ReplyKeyCount,
                    claimed,
                }
                .into());
            };
            let count = r.check_count(Field::ReplyKeyCount, unsigned, limits.max_listed_keys)?;
            let encoded = r.list(count, &[(Field::ReplyKey, limits.max_key_len)], progress)?;
            ResponseView::Keys(KeyList::from_validated(count, encoded))
        }
        Shape::Stats => {
            let claimed = r.u64(0)?;
            let count = r.check_count(Field::StatsCount, claimed, MAX_STATS_COUNTERS)?;
            let mut stats = StoreStats::default();
            for index in 0..count {
                stats.set_counter(index, r.u64(8 * (count - index - 1))?);
            }
            ResponseView::Stats(stats)
        }
    };
    Ok((view, r.pos()))
}

/// `QUEUE_POP` carries a value exactly when the length before the pop is positive.
fn check_queue_pop(len_before: i64, has_value: bool) -> Result<(), EncodeError> {
    if has_value == (len_before > 0) {
        Ok(())
    } else {
        Err(EncodeError::QueuePopMismatch {
            len_before,
            has_value,
        })
    }
}

fn emit_stats<S: Sink>(s: &mut S, stats: &StoreStats) {
    s.put(&(StoreStats::COUNTERS as u64).to_le_bytes());
    for index in 0..StoreStats::COUNTERS {
        s.put(&stats.counter(index).to_le_bytes());
    }
}

fn emit_queue_pop<S: Sink>(s: &mut S, len_before: i64, value: Option<&[u8]>) {
    s.put(&len_before.to_le_bytes());
    if let Some(value) = value {
        s.put_prefixed(value);
    }
}

impl Emit for ResponseView<'_> {
    fn check(&self) -> Result<(), EncodeError> {
        match *self {
            ResponseView::QueuePop { len_before, value } => {
                check_queue_pop(len_before, value.is_some())
            }
            _ => Ok(()),
        }
    }

    fn emit<S: Sink>(&self, s: &mut S) {
        match *self {
            ResponseView::Pong(nonce) => s.put(&nonce.to_le_bytes()),
            ResponseView::Value(value) => s.put_prefixed(value),
            ResponseView::Int(number) => s.put(&number.to_le_bytes()),
            ResponseView::Check(check) => s.put(&[check as u8]),
            ResponseView::Wait(wait) => s.put(&[wait as u8]),
            ResponseView::Values(values) => s.put(values.encoded()),
            ResponseView::QueuePop { len_before, value } => emit_queue_pop(s, len_before, value),
            ResponseView::Keys(keys) => {
                // A slice of at least 8 bytes per key cannot hold more than i64::MAX.
                s.put(&(keys.len() as i64).to_le_bytes());
                s.put(keys.encoded());
            }
            ResponseView::Stats(stats) => emit_stats(s, &stats),
        }
    }
}

impl Emit for Response<'_> {
    fn check(&self) -> Result<(), EncodeError> {
        match *self {
            Response::QueuePop { len_before, value } => {
                check_queue_pop(len_before, value.is_some())
            }
            _ => Ok(()),
        }
    }

    fn emit<S: Sink>(&self, s: &mut S) {
        match self {
            Response::Pong(nonce) => s.put(&nonce.to_le_bytes()),
            Response::Value(value) => s.put_prefixed(value),
            Response::Int(number) => s.put(&number.to_le_bytes()),
            Response::Check(check) => s.put(&[*check as u8]),
            Response::Wait(wait) => s.put(&[*wait as u8]),
            #[cfg(feature = "alloc")]
            Response::Values(values) => {
                for value in values {
                    s.put_prefixed(value);
                }
            }
            Response::QueuePop { len_before, value } => emit_queue_pop(s, *len_before, *value),
            #[cfg(feature = "alloc")]
            Response::Keys(keys) => {
                s.put(&(keys.len() as i64).to_le_bytes());
                for key in keys {
                    s.put_prefixed(key);
                }
            }
            Response::Stats(stats) => emit_stats(s, stats),
        }
    }
}

impl ResponseView<'_> {
    /// How many bytes [`ResponseView::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        wire::encoded_len(self)
    }

    /// Writes the reply at the start of `out`; returns the bytes written.
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, EncodeError> {
        wire::encode_to_slice(self, out)
    }

    /// Appends the reply to `out`.
    #[cfg(feature = "alloc")]
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        wire::encode_to_vec(self, out)
    }
}

impl Response<'_> {
    /// How many bytes [`Response::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        wire::encoded_len(self)
    }

    /// Writes the reply at the start of `out`; returns the bytes written, or
    /// [`EncodeError::InsufficientSize`] if `out` is shorter than
    /// [`Response::encoded_len`], or [`EncodeError::QueuePopMismatch`] for a `QUEUE_POP`
    /// reply PyTorch could not have sent.
    ///
    /// ```
    /// use rdzv_core::store::Response;
    ///
    /// let mut buf = [0u8; 4];
    /// assert_eq!(Response::Pong(0x0102_0304).encode(&mut buf), Ok(4));
    /// assert_eq!(buf, [4, 3, 2, 1]);
    /// ```
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, EncodeError> {
        wire::encode_to_slice(self, out)
    }

    /// Appends the reply to `out`.
    #[cfg(feature = "alloc")]
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        wire::encode_to_vec(self, out)
    }

    /// Appends the reply to `out`, which already has room for [`Response::encoded_len`]
    /// more bytes: the serve step reserves a reply and the wake-ups before it at once, so
    /// this neither measures the reply again nor reserves.
    #[cfg(feature = "alloc")]
    pub(crate) fn encode_reserved(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        self.check()?;
        self.emit(out);
        Ok(())
    }
}
