//! What travels between a TCPStore client and server, as typed values.
//!
//! These types mirror PyTorch 2.15's `TCPStoreBackend.hpp` exactly: [`QueryType`] carries
//! the wire numbers (VALIDATE = 0 … BARRIER = 18). Requests and responses borrow their
//! keys and values from the buffer they were decoded from (zero-copy), so the same types
//! serve the server, the client and `no_std` users. This module holds no encoding logic
//! (see [`super::codec`]) and no semantics (see [`super::engine`]).

/// The magic number a client sends in its first frame, `VALIDATE`.
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// A connection, as the embedding runtime names it. The core never interprets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub u64);

/// The one-byte command that starts every client → server frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum QueryType {
    /// `u32` magic; no response. Must be the first frame of a connection.
    Validate = 0,
    /// `key`, `value`; no response.
    Set = 1,
    /// `key`, `expected`, `desired`; responds with bytes.
    CompareSet = 2,
    /// `key`; responds with bytes.
    Get = 3,
    /// `key`, `i64` delta; responds with the new `i64`.
    Add = 4,
    /// `u64` n, n keys; responds with a [`CheckResponse`].
    Check = 5,
    /// `u64` n, n keys; responds with [`WaitResponse::StopWaiting`], maybe later.
    Wait = 6,
    /// No payload; responds with an `i64`.
    GetNumKeys = 7,
    /// `key`; responds with an `i64` count erased.
    DeleteKey = 8,
    /// `key`, `value`; no response.
    Append = 9,
    /// `u64` n, n keys; responds with n values.
    MultiGet = 10,
    /// `i64` n, n (key, value) pairs; no response.
    MultiSet = 11,
    /// No payload; responds with [`WaitResponse::WaitCanceled`].
    CancelWait = 12,
    /// `u32` nonce; responds with the same nonce.
    Ping = 13,
    /// `key`, `value`; no response.
    QueuePush = 14,
    /// `key`; responds with `i64` length before the pop, then the value if it was > 0.
    QueuePop = 15,
    /// `key`; responds with an `i64`.
    QueueLen = 16,
    /// No payload; responds with `i64` count, then that many keys.
    ListKeys = 17,
    /// `key`, `i64` world size; responds with [`WaitResponse::StopWaiting`], maybe later.
    Barrier = 18,
    /// rdzv's extension, not PyTorch's: no payload; responds with the server's counters
    /// ([`StoreStats`]). Its byte, `0x52` (`'R'`), is far above PyTorch's 0..=18 so that
    /// PyTorch adding queries of its own does not collide with it; a PyTorch server
    /// refuses it by closing the connection.
    Stats = 0x52,
}

impl QueryType {
    /// Every query type, in wire order: PyTorch's 19, then rdzv's `STATS`.
    pub const ALL: [QueryType; 20] = [
        QueryType::Validate,
        QueryType::Set,
        QueryType::CompareSet,
        QueryType::Get,
        QueryType::Add,
        QueryType::Check,
        QueryType::Wait,
        QueryType::GetNumKeys,
        QueryType::DeleteKey,
        QueryType::Append,
        QueryType::MultiGet,
        QueryType::MultiSet,
        QueryType::CancelWait,
        QueryType::Ping,
        QueryType::QueuePush,
        QueryType::QueuePop,
        QueryType::QueueLen,
        QueryType::ListKeys,
        QueryType::Barrier,
        QueryType::Stats,
    ];

    /// The query type for a wire byte, or `None` if neither PyTorch 2.15 nor rdzv has
    /// such a query.
    pub const fn from_u8(byte: u8) -> Option<QueryType> {
        match byte {
            0..=18 => Some(Self::ALL[byte as usize]),
            0x52 => Some(QueryType::Stats),
            _ => None,
        }
    }

    /// A dense index (`0..ALL.len()`), for per-query tables such as
    /// [`StoreStats::requests`].
    pub const fn index(self) -> usize {
        match self {
            QueryType::Stats => 19,
            other => other as usize,
        }
    }

    /// The wire byte.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// PyTorch's name for it, as in `QueryType::VALIDATE`.
    pub const fn name(self) -> &'static str {
        match self {
            QueryType::Validate => "VALIDATE",
            QueryType::Set => "SET",
            QueryType::CompareSet => "COMPARE_SET",
            QueryType::Get => "GET",
            QueryType::Add => "ADD",
            QueryType::Check => "CHECK",
            QueryType::Wait => "WAIT",
            QueryType::GetNumKeys => "GETNUMKEYS",
            QueryType::DeleteKey => "DELETE_KEY",
            QueryType::Append => "APPEND",
            QueryType::MultiGet => "MULTI_GET",
            QueryType::MultiSet => "MULTI_SET",
            QueryType::CancelWait => "CANCEL_WAIT",
            QueryType::Ping => "PING",
            QueryType::QueuePush => "QUEUE_PUSH",
            QueryType::QueuePop => "QUEUE_POP",
            QueryType::QueueLen => "QUEUE_LEN",
            QueryType::ListKeys => "LIST_KEYS",
            QueryType::Barrier => "BARRIER",
            QueryType::Stats => "STATS",
        }
    }
}

/// The reply to `CHECK`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CheckResponse {
    /// Every key exists.
    Ready = 0,
    /// At least one key is missing.
    NotReady = 1,
}

/// The one-byte replies to `WAIT`, `BARRIER` and `CANCEL_WAIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum WaitResponse {
    /// The awaited keys exist (or the barrier is complete).
    StopWaiting = 0,
    /// The connection's waits were cancelled.
    WaitCanceled = 1,
}

/// A list of `n` length-prefixed keys, already validated by the decoder, borrowed from
/// the frame. Iterating yields each key without copying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyList<'a> {
    count: usize,
    /// The encoded keys: `count` × (`u64` LE length, bytes).
    encoded: &'a [u8],
}

impl<'a> KeyList<'a> {
    /// Wraps `encoded`, which must hold exactly `count` well-formed length-prefixed
    /// strings. Returns `None` if it does not.
    pub fn new(count: usize, encoded: &'a [u8]) -> Option<Self> {
        let list = KeyList { count, encoded };
        let mut seen = 0usize;
        let mut rest = encoded;
        while !rest.is_empty() {
            let (_, tail) = split_prefixed(rest)?;
            rest = tail;
            seen += 1;
        }
        (seen == count).then_some(list)
    }

    /// Wraps `encoded` that the codec has already walked and found to hold exactly
    /// `count` length-prefixed strings, without walking it a second time. Not public: a
    /// wrong `count` would not be unsafe, but iteration would disagree with [`Self::len`].
    pub(crate) const fn from_validated(count: usize, encoded: &'a [u8]) -> Self {
        KeyList { count, encoded }
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The encoded bytes (`count` × length-prefixed key), as on the wire.
    pub fn encoded(&self) -> &'a [u8] {
        self.encoded
    }

    /// The keys, in order.
    pub fn iter(&self) -> KeyIter<'a> {
        KeyIter { rest: self.encoded }
    }
}

impl<'a> IntoIterator for KeyList<'a> {
    type Item = &'a [u8];
    type IntoIter = KeyIter<'a>;
    fn into_iter(self) -> KeyIter<'a> {
        self.iter()
    }
}

/// Iterator over a [`KeyList`].
#[derive(Debug, Clone)]
pub struct KeyIter<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for KeyIter<'a> {
    type Item = &'a [u8];
    fn next(&mut self) -> Option<&'a [u8]> {
        let (item, tail) = split_prefixed(self.rest)?;
        self.rest = tail;
        Some(item)
    }
}

/// A list of `n` (key, value) pairs for `MULTI_SET`, validated and borrowed like
/// [`KeyList`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairList<'a> {
    count: usize,
    /// The encoded pairs: `count` × (key, value), each `u64` LE length-prefixed.
    encoded: &'a [u8],
}

impl<'a> PairList<'a> {
    /// Wraps `encoded`, which must hold exactly `count` well-formed (key, value) pairs.
    pub fn new(count: usize, encoded: &'a [u8]) -> Option<Self> {
        let mut seen = 0usize;
        let mut rest = encoded;
        while !rest.is_empty() {
            let (_, tail) = split_prefixed(rest)?;
            let (_, tail) = split_prefixed(tail)?;
            rest = tail;
            seen += 1;
        }
        (seen == count).then_some(PairList { count, encoded })
    }

    /// Wraps `encoded` that the codec has already walked and found to hold exactly
    /// `count` (key, value) pairs, without walking it a second time (see
    /// [`KeyList::from_validated`]).
    pub(crate) const fn from_validated(count: usize, encoded: &'a [u8]) -> Self {
        PairList { count, encoded }
    }

    /// How many pairs there are.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether there are no pairs.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The encoded bytes, as on the wire.
    pub fn encoded(&self) -> &'a [u8] {
        self.encoded
    }

    /// The pairs, in order.
    pub fn iter(&self) -> PairIter<'a> {
        PairIter { rest: self.encoded }
    }
}

impl<'a> IntoIterator for PairList<'a> {
    type Item = (&'a [u8], &'a [u8]);
    type IntoIter = PairIter<'a>;
    fn into_iter(self) -> PairIter<'a> {
        self.iter()
    }
}

/// Iterator over a [`PairList`].
#[derive(Debug, Clone)]
pub struct PairIter<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for PairIter<'a> {
    type Item = (&'a [u8], &'a [u8]);
    fn next(&mut self) -> Option<(&'a [u8], &'a [u8])> {
        let (key, tail) = split_prefixed(self.rest)?;
        let (value, tail) = split_prefixed(tail)?;
        self.rest = tail;
        Some((key, value))
    }
}

/// Splits one `u64` LE length-prefixed string off the front of `bytes`.
fn split_prefixed(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = bytes.split_first_chunk::<8>()?;
    let len = usize::try_from(u64::from_le_bytes(*len)).ok()?;
    if rest.len() < len {
        return None;
    }
    Some(rest.split_at(len))
}

/// A client → server request, borrowing its keys and values from the frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Request<'a> {
    /// `VALIDATE(magic)`.
    Validate {
        /// The magic the client sent; [`VALIDATION_MAGIC`] if it is one of ours.
        magic: u32,
    },
    /// `SET(key, value)`.
    Set {
        /// The key, exactly as on the wire (PyTorch clients prefix user keys with `/`).
        key: &'a [u8],
        /// The value.
        value: &'a [u8],
    },
    /// `COMPARE_SET(key, expected, desired)`.
    CompareSet {
        /// The key.
        key: &'a [u8],
        /// The value the client expects to find (empty: "the key must be missing").
        expected: &'a [u8],
        /// The value to store if the expectation holds.
        desired: &'a [u8],
    },
    /// `GET(key)`.
    Get {
        /// The key.
        key: &'a [u8],
    },
    /// `ADD(key, delta)`.
    Add {
        /// The key.
        key: &'a [u8],
        /// What to add to the stored counter (missing counts as 0).
        delta: i64,
    },
    /// `CHECK(keys)`.
    Check {
        /// The keys that must all exist.
        keys: KeyList<'a>,
    },
    /// `WAIT(keys)`.
    Wait {
        /// The keys to wait for.
        keys: KeyList<'a>,
    },
    /// `GETNUMKEYS`.
    GetNumKeys,
    /// `DELETE_KEY(key)`.
    DeleteKey {
        /// The key.
        key: &'a [u8],
    },
    /// `APPEND(key, value)`.
    Append {
        /// The key.
        key: &'a [u8],
        /// The bytes to append.
        value: &'a [u8],
    },
    /// `MULTI_GET(keys)`.
    MultiGet {
        /// The keys.
        keys: KeyList<'a>,
    },
    /// `MULTI_SET(pairs)`.
    MultiSet {
        /// The pairs, set in order.
        pairs: PairList<'a>,
    },
    /// `CANCEL_WAIT`.
    CancelWait,
    /// `PING(nonce)`.
    Ping {
        /// Echoed back unchanged (PyTorch's client sends its pid).
        nonce: u32,
    },
    /// `QUEUE_PUSH(key, value)`.
    QueuePush {
        /// The queue's name.
        key: &'a [u8],
        /// The element.
        value: &'a [u8],
    },
    /// `QUEUE_POP(key)`.
    QueuePop {
        /// The queue's name.
        key: &'a [u8],
    },
    /// `QUEUE_LEN(key)`.
    QueueLen {
        /// The queue's name.
        key: &'a [u8],
    },
    /// `LIST_KEYS`.
    ListKeys,
    /// `BARRIER(key, world_size)`.
    Barrier {
        /// The barrier's counter key.
        key: &'a [u8],
        /// How many arrivals release it.
        world_size: i64,
    },
    /// `STATS` (rdzv's extension, byte `0x52`): the server's counters.
    Stats,
}

impl Request<'_> {
    /// The query type of this request.
    pub fn query_type(&self) -> QueryType {
        match self {
            Request::Validate { .. } => QueryType::Validate,
            Request::Set { .. } => QueryType::Set,
            Request::CompareSet { .. } => QueryType::CompareSet,
            Request::Get { .. } => QueryType::Get,
            Request::Add { .. } => QueryType::Add,
            Request::Check { .. } => QueryType::Check,
            Request::Wait { .. } => QueryType::Wait,
            Request::GetNumKeys => QueryType::GetNumKeys,
            Request::DeleteKey { .. } => QueryType::DeleteKey,
            Request::Append { .. } => QueryType::Append,
            Request::MultiGet { .. } => QueryType::MultiGet,
            Request::MultiSet { .. } => QueryType::MultiSet,
            Request::CancelWait => QueryType::CancelWait,
            Request::Ping { .. } => QueryType::Ping,
            Request::QueuePush { .. } => QueryType::QueuePush,
            Request::QueuePop { .. } => QueryType::QueuePop,
            Request::QueueLen { .. } => QueryType::QueueLen,
            Request::ListKeys => QueryType::ListKeys,
            Request::Barrier { .. } => QueryType::Barrier,
            Request::Stats => QueryType::Stats,
        }
    }
}

/// A server → client response. Responses are not self-describing on the wire: a client
/// decodes one knowing the request it answers.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Response<'a> {
    /// `PING`: the nonce, echoed.
    Pong(u32),
    /// `GET` and `COMPARE_SET`: one length-prefixed value.
    Value(&'a [u8]),
    /// `ADD`, `GETNUMKEYS`, `DELETE_KEY`, `QUEUE_LEN`: one `i64`.
    Int(i64),
    /// `CHECK`.
    Check(CheckResponse),
    /// `WAIT`, `BARRIER` and `CANCEL_WAIT`: one byte.
    Wait(WaitResponse),
    /// `MULTI_GET`: n length-prefixed values (no count on the wire).
    #[cfg(feature = "alloc")]
    Values(alloc::vec::Vec<&'a [u8]>),
    /// `QUEUE_POP`: `i64` length before the pop, then the popped value if it was > 0.
    QueuePop {
        /// The queue's length before this pop.
        len_before: i64,
        /// The popped element; `Some` exactly when `len_before > 0`.
        value: Option<&'a [u8]>,
    },
    /// `LIST_KEYS`: `i64` count, then the keys.
    #[cfg(feature = "alloc")]
    Keys(alloc::vec::Vec<&'a [u8]>),
    /// `STATS` (rdzv's extension): `u64` n, then n `u64` counters. Boxed: the counters
    /// are 30 times the size of any other reply, and every reply is moved a few times
    /// on its way out (an inline one cost each request about 50 instructions).
    #[cfg(feature = "alloc")]
    Stats(alloc::boxed::Box<StoreStats>),
    /// `STATS` (rdzv's extension): `u64` n, then n `u64` counters.
    #[cfg(not(feature = "alloc"))]
    Stats(StoreStats),
}

/// What a store server reports to rdzv's `STATS` query.
///
/// On the wire the reply is a `u64` count n followed by n little-endian `u64` counters, in
/// the order of [`StoreStats::COUNTERS`]: connections, keys, waiters, queues, bytes in,
/// bytes out, uptime in milliseconds, requests served per query type in
/// [`QueryType::ALL`] order, then the access-control refusals (peers, tokens,
/// requests; see `store::access`). A decoder reads the counters it knows and skips any
/// others, so a newer server can append counters without breaking older clients; a
/// counter missing from a shorter reply reads as 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct StoreStats {
    /// Open client connections.
    pub connections: u64,
    /// Keys in the key-value map (queues not counted).
    pub keys: u64,
    /// Pending `WAIT`/`BARRIER` requests.
    pub waiters: u64,
    /// Non-empty queues.
    pub queues: u64,
    /// Request bytes the server decoded.
    pub bytes_in: u64,
    /// Reply and wake-up bytes the server encoded.
    pub bytes_out: u64,
    /// Milliseconds since the server started.
    pub uptime_ms: u64,
    /// Requests served, indexed by [`QueryType::index`].
    pub requests: [u64; QueryType::ALL.len()],
    /// Peers closed at accept by the `--allow` list.
    pub refused_peers: u64,
    /// Connections closed for a missing or unknown token (`--token-file`).
    pub refused_tokens: u64,
    /// Connections closed for a request outside their token's scope.
    pub refused_requests: u64,
}

impl StoreStats {
    /// How many counters this version sends: 7 figures, one per query type, then the
    /// 3 refusal counters.
    pub const COUNTERS: usize = 7 + QueryType::ALL.len() + 3;

    /// Where the refusal counters start in wire order.
    const REFUSALS: usize = 7 + QueryType::ALL.len();

    /// Requests served of one query type.
    pub const fn requests_of(&self, query: QueryType) -> u64 {
        self.requests[query.index()]
    }

    /// Counter number `index` in wire order (0 past the known counters).
    pub const fn counter(&self, index: usize) -> u64 {
        match index {
            0 => self.connections,
            1 => self.keys,
            2 => self.waiters,
            3 => self.queues,
            4 => self.bytes_in,
            5 => self.bytes_out,
            6 => self.uptime_ms,
            i if i < Self::REFUSALS => self.requests[i - 7],
            i if i == Self::REFUSALS => self.refused_peers,
            i if i == Self::REFUSALS + 1 => self.refused_tokens,
            i if i == Self::REFUSALS + 2 => self.refused_requests,
            _ => 0,
        }
    }

    /// Sets counter number `index` in wire order; counters this version does not know
    /// are ignored.
    pub fn set_counter(&mut self, index: usize, value: u64) {
        match index {
            0 => self.connections = value,
            1 => self.keys = value,
            2 => self.waiters = value,
            3 => self.queues = value,
            4 => self.bytes_in = value,
            5 => self.bytes_out = value,
            6 => self.uptime_ms = value,
            i if i < Self::REFUSALS => self.requests[i - 7] = value,
            i if i == Self::REFUSALS => self.refused_peers = value,
            i if i == Self::REFUSALS + 1 => self.refused_tokens = value,
            i if i == Self::REFUSALS + 2 => self.refused_requests = value,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(out: &mut std::vec::Vec<u8>, s: &[u8]) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s);
    }

    #[test]
    fn query_type_round_trips_every_wire_byte() {
        for byte in 0..=255u8 {
            match QueryType::from_u8(byte) {
                Some(q) => assert_eq!(q.as_u8(), byte),
                None => assert!(byte > 18 && byte != 0x52),
            }
        }
        for (index, query) in QueryType::ALL.into_iter().enumerate() {
            assert_eq!(query.index(), index);
        }
        assert_eq!(QueryType::from_u8(0x52), Some(QueryType::Stats));
        assert_eq!(QueryType::Barrier.as_u8(), 18);
        assert_eq!(QueryType::Ping.name(), "PING");
    }

    #[test]
    fn key_list_iterates_and_rejects_bad_counts() {
        let mut buf = std::vec::Vec::new();
        enc(&mut buf, b"/a");
        enc(&mut buf, b"");
        enc(&mut buf, b"/ccc");
        let list = KeyList::new(3, &buf).unwrap();
        let keys: std::vec::Vec<_> = list.iter().collect();
        assert_eq!(keys, [&b"/a"[..], b"", b"/ccc"]);
        assert!(KeyList::new(2, &buf).is_none());
        assert!(KeyList::new(3, &buf[..buf.len() - 1]).is_none());
    }

    #[test]
    fn pair_list_iterates() {
        let mut buf = std::vec::Vec::new();
        enc(&mut buf, b"k1");
        enc(&mut buf, b"v1");
        enc(&mut buf, b"k2");
        enc(&mut buf, b"");
        let list = PairList::new(2, &buf).unwrap();
        let pairs: std::vec::Vec<_> = list.iter().collect();
        assert_eq!(pairs, [(&b"k1"[..], &b"v1"[..]), (&b"k2"[..], &b""[..])]);
        assert!(PairList::new(2, &buf[..buf.len() - 3]).is_none());
    }
}
