//! The TCPStore wire codec: PyTorch 2.15's c10d framing, byte for byte.
//!
//! This module decides how [`Request`]s and [`Response`]s become bytes and back. Every
//! frame is little-endian: a `u8` query type, then the fields of that query (strings and
//! byte vectors as a `u64` length and the raw bytes, counts as 8 bytes, integers as
//! `i64`, the `VALIDATE` magic and the `PING` nonce as `u32`). Responses carry no type
//! byte and no frame length, so a client decodes one knowing the request it answers
//! ([`PendingReply`]).
//!
//! It does **not** read sockets, keep connection state or give meaning to a request: the
//! "first frame must be `VALIDATE` with [`VALIDATION_MAGIC`]" rule belongs to the
//! connection (the decoder only reports the query type as early as possible, see
//! [`peek_query_type`]), and what a request does to the store belongs to the store
//! engine (`store::engine`).
//!
//! # rdzv's `STATS` query
//!
//! One query is rdzv's own: `STATS`, type byte `0x52` (`'R'`) and no payload. Its byte
//! sits far above PyTorch's 0..=18 so that PyTorch growing new queries does not collide
//! with it. The reply is a `u64` count n, then n `u64` counters (all little-endian) in
//! the order [`StoreStats::counter`] documents: connections, keys, waiters, queues,
//! bytes in, bytes out, uptime (ms), then requests per query type in `QueryType::ALL`
//! order. The decoder refuses n above [`MAX_STATS_COUNTERS`], reads the counters it
//! knows and skips the rest, so newer servers may append counters. A PyTorch server
//! does not know the byte and closes the connection, which a client should report as
//! "not an rdzv server" rather than as a network failure.
//!
//! # Decoding bytes that arrive in pieces
//!
//! Decoders are push decoders in the style of `httparse`: the caller keeps its own
//! buffer, appends what the socket delivered and hands *all unconsumed bytes* to the
//! decoder, which answers [`Decoded::Partial`] (with a lower bound on the bytes still
//! missing) or [`Decoded::Complete`] with a value borrowed from that buffer and the number
//! of bytes it used. Bytes after the frame are left alone: they start the next frame.
//! Nothing is allocated while decoding (except `decode_response`, which gathers list
//! replies into a `Vec` once they are complete) and keys and values are never copied;
//! multi-key requests come back as zero-copy [`KeyList`] / [`PairList`] views.
//!
//! [`decode_request`] and [`decode_response_view`] are stateless: each call parses from
//! the start of the frame. Fixed fields and length prefixes cost O(1) to re-parse however
//! large the value behind them is, so only the per-item walk of a long key list is
//! repeated; a `CHECK` of n keys that arrives one byte at a time costs O(n²) in total.
//! [`RequestDecoder`] and [`ResponseDecoder`] remember how far they got through such a
//! list and resume there, which makes every call O(new bytes).
//!
//! # Limits
//!
//! Every claimed length and count is checked against [`Limits`] as soon as its field is
//! complete, before anything is allocated or waited for: a `GET` claiming a 4 GiB key is
//! rejected from its first nine bytes. The defaults are PyTorch's libuv server limits
//! (`MAX_STRING_LEN`, `MAX_PAYLOAD_LEN`, `MAX_KEY_COUNT`). The client-side decoders take
//! limits too, so that a wrong or hostile server cannot make a client wait for or
//! allocate a terabyte (pytorch/pytorch#129367).
//!
//! # Encoding
//!
//! [`Request::encode`], [`Response::encode`] and [`ResponseView::encode`] write into a
//! caller buffer and fail with [`EncodeError::InsufficientSize`], naming the size needed,
//! when it is too small; `encoded_len()` says that size up front. With `alloc`,
//! `encode_into` appends to a `Vec<u8>`. Encoders do not apply [`Limits`]: the peer's
//! decoder does. Encoding a decoded frame gives back exactly the bytes it was decoded
//! from (the encoding is canonical).
//!
//! # Without `alloc`
//!
//! `Response::Values` (`MULTI_GET`) and `Response::Keys` (`LIST_KEYS`) hold a `Vec`
//! and exist only with `alloc`. [`decode_response_view`] works everywhere: it returns a
//! [`ResponseView`] whose lists are validated, borrowed [`KeyList`]s, and those views
//! encode without `alloc` as well.
//!
//! [`VALIDATION_MAGIC`]: super::message::VALIDATION_MAGIC
//! [`Request`]: super::message::Request
//! [`Response`]: super::message::Response
//! [`Request::encode`]: super::message::Request::encode
//! [`Response::encode`]: super::message::Response::encode
//! [`KeyList`]: super::message::KeyList
//! [`PairList`]: super::message::PairList
//! [`StoreStats::counter`]: super::message::StoreStats::counter

mod auth;
mod error;
mod request;
mod response;
mod wire;

pub use auth::{
    decode_auth, AuthDecodeError, AuthRequest, AUTH_ACCEPTED, AUTH_QUERY, MAX_AUTH_TOKEN_LEN,
};
pub use error::{DecodeError, EncodeError, Field};
pub use request::{decode_request, peek_query_type, RequestDecoder};
#[cfg(feature = "alloc")]
pub use response::decode_response;
pub use response::{
    decode_response_view, PendingReply, ResponseDecoder, ResponseView, ValueList,
    MAX_STATS_COUNTERS,
};

/// What a push decoder made of the bytes it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded<T> {
    /// The frame is not complete yet. The number is a lower bound (at least 1) on how
    /// many more bytes must arrive before it can be: the frame is at least this much
    /// longer than the bytes given.
    Partial(usize),
    /// A whole frame: the value, borrowed from the buffer, and how many bytes of the
    /// buffer it used. Bytes after those belong to the next frame.
    Complete(T, usize),
}

impl<T> Decoded<T> {
    /// The decoded value, if the frame was complete.
    pub fn complete(self) -> Option<T> {
        match self {
            Decoded::Complete(value, _) => Some(value),
            Decoded::Partial(_) => None,
        }
    }

    /// Whether the frame was complete.
    pub fn is_complete(&self) -> bool {
        matches!(self, Decoded::Complete(..))
    }

    /// Applies `f` to the decoded value, keeping the consumed count or the hint.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Decoded<U> {
        match self {
            Decoded::Complete(value, consumed) => Decoded::Complete(f(value), consumed),
            Decoded::Partial(needed) => Decoded::Partial(needed),
        }
    }
}

/// How large a frame a decoder accepts. A claimed length or count above a limit is a
/// [`DecodeError`] as soon as its field is complete.
///
/// The defaults ([`Limits::PYTORCH`]) are the limits of PyTorch's libuv TCPStore server.
/// A length equal to the limit is accepted, as in PyTorch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Limits {
    /// Longest key, in bytes (PyTorch `MAX_STRING_LEN` = 8 KiB). Also applies to the
    /// keys of a `LIST_KEYS` reply.
    pub max_key_len: u64,
    /// Longest value, in bytes (PyTorch `MAX_PAYLOAD_LEN` = 8 MiB): `SET`, `APPEND`,
    /// `QUEUE_PUSH` and `MULTI_SET` values, both `COMPARE_SET` values, and every value in
    /// a reply.
    pub max_value_len: u64,
    /// Most keys in one `CHECK`, `WAIT` or `MULTI_GET`, and most pairs in one `MULTI_SET`
    /// (PyTorch `MAX_KEY_COUNT` = 128 Ki).
    pub max_key_count: u64,
    /// Most keys in one `LIST_KEYS` reply. PyTorch's client has no such limit (a store
    /// may hold more keys than one request may name); rdzv's default is 16 Mi.
    pub max_listed_keys: u64,
}

impl Limits {
    /// PyTorch's libuv server limits: 8 KiB keys, 8 MiB values, 128 Ki keys per request,
    /// and rdzv's 16 Mi keys per `LIST_KEYS` reply.
    pub const PYTORCH: Limits = Limits {
        max_key_len: 8 * 1024,
        max_value_len: 8 * 1024 * 1024,
        max_key_count: 128 * 1024,
        max_listed_keys: 16 * 1024 * 1024,
    };

    /// No limits at all, like PyTorch's legacy (non-libuv) server. Only for peers you
    /// trust: a single bad length field then makes the decoder wait for that many bytes.
    pub const UNLIMITED: Limits = Limits {
        max_key_len: u64::MAX,
        max_value_len: u64::MAX,
        max_key_count: u64::MAX,
        max_listed_keys: u64::MAX,
    };

    /// These limits with a different key length limit.
    pub const fn with_max_key_len(mut self, bytes: u64) -> Limits {
        self.max_key_len = bytes;
        self
    }

    /// These limits with a different value length limit.
    pub const fn with_max_value_len(mut self, bytes: u64) -> Limits {
        self.max_value_len = bytes;
        self
    }

    /// These limits with a different per-request key count limit.
    pub const fn with_max_key_count(mut self, keys: u64) -> Limits {
        self.max_key_count = keys;
        self
    }

    /// These limits with a different `LIST_KEYS` reply count limit.
    pub const fn with_max_listed_keys(mut self, keys: u64) -> Limits {
        self.max_listed_keys = keys;
        self
    }
}

impl Default for Limits {
    fn default() -> Limits {
        Limits::PYTORCH
    }
}

#[cfg(all(test, feature = "alloc"))]
mod tests;
