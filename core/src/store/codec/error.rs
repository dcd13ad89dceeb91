//! What can go wrong turning TCPStore frames into values and back.
//!
//! Decode errors name the query, the field, the claimed value and the limit, so that a
//! log line alone says which peer sent what. PyTorch's libuv server reports the same
//! failures as "Invalid string size", "Invalid payload size", "Too many keys being
//! waited" and "Client sent invalid command", and closes the connection; so should the
//! caller. This module only describes failures; it does not decide what to do about them.

use core::fmt;

use crate::store::message::QueryType;

/// Which field of a frame a [`DecodeError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Field {
    /// A request key.
    Key,
    /// A request value (`SET`, `APPEND`, `QUEUE_PUSH`, `MULTI_SET`).
    Value,
    /// `COMPARE_SET`'s expected value.
    ExpectedValue,
    /// `COMPARE_SET`'s desired value.
    DesiredValue,
    /// The key count of `CHECK`, `WAIT` or `MULTI_GET`.
    KeyCount,
    /// The pair count of `MULTI_SET`.
    PairCount,
    /// A value in a reply (`GET`, `COMPARE_SET`, `MULTI_GET`, `QUEUE_POP`).
    ReplyValue,
    /// A key in a `LIST_KEYS` reply.
    ReplyKey,
    /// The key count of a `LIST_KEYS` reply.
    ReplyKeyCount,
    /// The counter count of a `STATS` reply (rdzv's extension).
    StatsCount,
}

impl Field {
    /// How the field is named in error messages, e.g. `"expected value"`.
    pub const fn name(self) -> &'static str {
        match self {
            Field::Key => "key",
            Field::Value => "value",
            Field::ExpectedValue => "expected value",
            Field::DesiredValue => "desired value",
            Field::KeyCount => "key count",
            Field::PairCount => "pair count",
            Field::ReplyValue => "reply value",
            Field::ReplyKey => "reply key",
            Field::ReplyKeyCount => "reply key count",
            Field::StatsCount => "stats counter count",
        }
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why bytes are not a valid TCPStore frame. Every variant means the peer is broken or
/// hostile (or the limits are too small); the connection cannot be resynchronised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DecodeError {
    /// The first byte of a request is not a PyTorch 2.15 query type (0 to 18) nor rdzv's
    /// `STATS` (0x52).
    UnknownQuery {
        /// The byte received.
        byte: u8,
    },
    /// A length prefix claims more bytes than the limit allows.
    LengthOverLimit {
        /// The query being decoded (or answered, for replies).
        query: QueryType,
        /// The field whose length it is.
        field: Field,
        /// The length the peer claimed.
        claimed: u64,
        /// The limit it exceeds.
        limit: u64,
    },
    /// A count claims more items than the limit allows.
    CountOverLimit {
        /// The query being decoded (or answered, for replies).
        query: QueryType,
        /// The count field.
        field: Field,
        /// The count the peer claimed.
        claimed: u64,
        /// The limit it exceeds.
        limit: u64,
    },
    /// A signed count (`MULTI_SET` pairs, `LIST_KEYS` reply keys) is negative.
    NegativeCount {
        /// The query being decoded (or answered, for replies).
        query: QueryType,
        /// The count field.
        field: Field,
        /// The count the peer claimed.
        claimed: i64,
    },
    /// A one-byte reply (`CHECK`, `WAIT`, `BARRIER`, `CANCEL_WAIT`) is not one of the two
    /// values PyTorch defines.
    InvalidReplyByte {
        /// The query answered.
        query: QueryType,
        /// The byte received.
        byte: u8,
    },
}

impl DecodeError {
    /// The query the error is about, when the frame got far enough to name one.
    pub const fn query(&self) -> Option<QueryType> {
        match *self {
            DecodeError::UnknownQuery { .. } => None,
            DecodeError::LengthOverLimit { query, .. }
            | DecodeError::CountOverLimit { query, .. }
            | DecodeError::NegativeCount { query, .. }
            | DecodeError::InvalidReplyByte { query, .. } => Some(query),
        }
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            DecodeError::UnknownQuery { byte } => write!(
                f,
                "invalid command: query type byte {byte} (0x{byte:02x}) is not a TCPStore query"
            ),
            DecodeError::LengthOverLimit {
                query,
                field,
                claimed,
                limit,
            } => write!(
                f,
                "{} {field} length {claimed} exceeds the limit of {limit} bytes",
                query.name()
            ),
            DecodeError::CountOverLimit {
                query,
                field,
                claimed,
                limit,
            } => write!(
                f,
                "{} {field} {claimed} exceeds the limit of {limit}",
                query.name()
            ),
            DecodeError::NegativeCount {
                query,
                field,
                claimed,
            } => write!(f, "{} {field} {claimed} is negative", query.name()),
            DecodeError::InvalidReplyByte { query, byte } => {
                let (zero, one) = match query {
                    QueryType::Check => ("READY", "NOT_READY"),
                    _ => ("STOP_WAITING", "WAIT_CANCELED"),
                };
                write!(
                    f,
                    "{} reply byte {byte} is neither {zero} (0) nor {one} (1)",
                    query.name()
                )
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for DecodeError {}

/// Why a value could not be encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EncodeError {
    /// The output buffer is too small; nothing useful was written.
    InsufficientSize {
        /// How many bytes the encoding needs in all.
        needed: usize,
    },
    /// A `QUEUE_POP` reply whose value does not match its length: PyTorch sends a value
    /// exactly when the length before the pop is positive.
    QueuePopMismatch {
        /// The length before the pop.
        len_before: i64,
        /// Whether a value was given.
        has_value: bool,
    },
    /// The output buffer could not grow by `needed` bytes (the allocator refused):
    /// nothing was written.
    OutOfMemory {
        /// How many bytes the encoding needs.
        needed: usize,
    },
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            EncodeError::InsufficientSize { needed } => {
                write!(f, "insufficient size, need {needed} bytes")
            }
            EncodeError::QueuePopMismatch {
                len_before,
                has_value: true,
            } => write!(
                f,
                "QUEUE_POP reply with length {len_before} cannot carry a value"
            ),
            EncodeError::QueuePopMismatch {
                len_before,
                has_value: false,
            } => write!(
                f,
                "QUEUE_POP reply with length {len_before} must carry a value"
            ),
            EncodeError::OutOfMemory { needed } => {
                write!(f, "cannot allocate {needed} bytes for a reply")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for EncodeError {}
