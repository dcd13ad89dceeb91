//! The TCPStore state machine: what every request does to the store, with libuv semantics.
//!
//! [`Engine`] owns the key/value map, the queues, the waiters and the per-connection state
//! of one TCPStore server. Input is `(connection, request)`; output is the reply to that
//! connection plus the `STOP_WAITING` wake-ups owed to waiting connections, as values.
//! It never sees bytes (the codec's job), sockets or clocks: TCPStore has no server-side
//! timeout, so nothing here depends on time. It does not enforce libuv's size limits
//! (keys, values and key counts per request): the decoder rejects those before a request
//! exists.
//!
//! # Driving it (polling order)
//!
//! 1. [`Engine::connect`] when a connection is accepted.
//! 2. For each request decoded from a connection, in arrival order,
//!    [`Engine::handle_request`]:
//!    - `Ok(outcome)`: write [`Outcome::own_wakeups`] `STOP_WAITING` bytes to that
//!      connection, then [`Outcome::reply`] if it is `Some`. (Own wake-ups answer the
//!      connection's *earlier* `WAIT`/`BARRIER` requests that this request completed; as
//!      in libuv they precede the reply on the wire.)
//!    - `Err(close)`: close that connection, and only it. The engine has already forgotten
//!      it and its waits; [`Engine::disconnect`] afterwards is a harmless no-op.
//! 3. After each request (also after an `Err`), drain [`Engine::poll_wakeup`] until it
//!    returns `None` and write each wake-up to its connection. The reply borrows the
//!    engine, so encode it before polling.
//! 4. [`Engine::disconnect`] when a connection closes. Its waits vanish with it.
//!
//! # Semantics (libuv backend of PyTorch 2.15), and where we deliberately differ
//!
//! * `GET`/`MULTI_GET` of a missing key reply with empty bytes.
//! * `ADD` and `BARRIER` store their counters as ASCII decimal and re-read them with
//!   `std::stoll` rules ([`semantics::parse_counter`]); a stored value that is not a number,
//!   or a sum that overflows `i64`, closes the asking connection ([`Close::BadCounter`]).
//! * `COMPARE_SET` follows [`semantics::compare_set`] and wakes the key's waiters in all
//!   four cases, even when nothing was written (libuv does this too).
//! * A key is *present* when it is in the key/value map or names a non-empty queue.
//!   `CHECK` and `WAIT` use that. A `WAIT` whose keys are all present (or that names no key)
//!   is answered at once; otherwise it registers on each distinct key that is not present
//!   and is answered once every one of them has *arrived* (been written after the `WAIT`).
//!   libuv registers on every key missing from the map, even one with a non-empty queue,
//!   which could leave such a waiter hanging while `CHECK` says ready; we do not.
//! * `SET`, `ADD`, `APPEND`, `MULTI_SET` (each key, in order) and `COMPARE_SET` are an
//!   arrival of their key for every registration on it. `DELETE_KEY` wakes nobody.
//! * `QUEUE_PUSH` wakes at most **one** waiter: it is an arrival of the key for the
//!   registrations on that key in registration (FIFO) order, up to and including the
//!   first whose `WAIT` it completes; registrations after that one are untouched. This is
//!   libuv's `wakeupOneWaitingClient` walk, except that libuv leaves every walked client
//!   in the key's list, where a later write counts it again (waking a multi-key `WAIT`
//!   early, or a finished one twice); we remove each registration the push satisfied.
//! * `BARRIER(key, world_size)` increments the decimal counter under `key` (an ordinary
//!   key/value entry). The arrival with `count >= world_size` wakes every waiter on the
//!   key and is answered `STOP_WAITING` at once; earlier arrivals wait (as a one-key wait
//!   on `key`) with no reply, and their counter writes wake nobody. A used key releases
//!   every later arrival at once.
//! * `CANCEL_WAIT` drops every pending wait of the connection and replies `WAIT_CANCELED`.
//! * Each `WAIT`/`BARRIER` is its own wait, answered by exactly one `STOP_WAITING` unless
//!   cancelled. libuv keeps one counter per client, which a second wait overwrites; PyTorch
//!   clients never have two in flight, so only pipelining clients see the difference.
//! * `QUEUE_POP` replies with the length before the pop and the front element; an emptied
//!   queue is removed (libuv keeps empty queues; nothing observable depends on it).
//!   `GETNUMKEYS` and `LIST_KEYS` count only the key/value map; `LIST_KEYS` is sorted
//!   bytewise (libuv's order is its hash map's).
//! * The first request of a connection must be `VALIDATE` with [`VALIDATION_MAGIC`]; a
//!   later `VALIDATE` is an invalid command. Both close the connection.
//!
//! # Cost
//!
//! `GET`, `SET`, `ADD`, `CHECK` and a ready `WAIT` are hash lookups; overwriting a value
//! reuses its buffer. Registering a wait is a `push_back` per key; a write wakes the
//! waiters on its key in O(w) for w of them (a list in registration order); a cancel or
//! disconnect costs O(k) amortized over the k keys its waits registered on (it leaves
//! stale entries that a later compaction drops). Nothing scans all waiters or all
//! connections. [`Engine::heap_bytes`] counts what the structures hold.

use alloc::boxed::Box;
use alloc::collections::VecDeque;
use alloc::vec::Vec;
use core::fmt;

use hashbrown::hash_map::EntryRef;
use hashbrown::HashMap;

use super::access::{AccessCounters, Refusal};
use super::budget::Budget;
use super::semantics::{self, CounterError, Decimal};
use super::{
    CheckResponse, ConnId, KeyList, QueryType, Request, Response, StoreStats, WaitResponse,
    VALIDATION_MAGIC,
};

#[cfg(test)]
mod tests;

/// Why the engine wants a connection closed. The engine has already forgotten the
/// connection (and its waits) when it returns one of these.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Close {
    /// The first request was `VALIDATE` with the wrong magic number.
    IncorrectValidate {
        /// The magic the client sent.
        magic: u32,
    },
    /// The first request was not `VALIDATE`.
    MissingValidate {
        /// What the client sent instead.
        query: QueryType,
    },
    /// `VALIDATE` arrived after the first request (libuv: "Client sent invalid command").
    RepeatedValidate,
    /// A request for a connection that was never connected, or was closed or disconnected.
    UnknownConnection {
        /// The connection named.
        conn: ConnId,
    },
    /// `ADD` or `BARRIER` found a stored value it cannot count with (`std::stoll` throws in
    /// PyTorch), or the new count overflows.
    BadCounter {
        /// `ADD` or `BARRIER`.
        query: QueryType,
        /// The key, as on the wire.
        key: Vec<u8>,
        /// What went wrong.
        error: CounterError,
    },
    /// The value a write would leave under `key` is over the per-value limit
    /// (`--max-value-bytes`); `APPEND` counts what it builds.
    ValueTooLarge {
        /// The query that wrote.
        query: QueryType,
        /// The key, as on the wire (at most the first 64 bytes).
        key: Vec<u8>,
        /// Bytes the value would hold.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The store would hold more than its total limit (`--max-store-bytes`).
    StoreFull {
        /// The query that wrote.
        query: QueryType,
        /// Bytes the store would hold after it.
        needed: usize,
        /// The limit.
        limit: usize,
    },
    /// The allocator refused the memory a write needs.
    OutOfMemory {
        /// The query that wrote.
        query: QueryType,
        /// Bytes asked for.
        bytes: usize,
    },
}

impl fmt::Display for Close {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Close::IncorrectValidate { magic } => write!(
                f,
                "Miscellaneous client with incorrect VALIDATE query is detected \
                 (magic {magic:#010x}, expected {VALIDATION_MAGIC:#010x})"
            ),
            Close::MissingValidate { query } => write!(
                f,
                "Miscellaneous client without VALIDATE query is detected (first query: {})",
                query.name()
            ),
            Close::RepeatedValidate => f.write_str(
                "Client sent invalid command: VALIDATE is only accepted as the first query",
            ),
            Close::UnknownConnection { conn } => {
                write!(f, "request on unknown connection {}", conn.0)
            }
            Close::BadCounter { query, key, error } => write!(
                f,
                "{} on key \"{}\": {error}",
                query.name(),
                key.escape_ascii()
            ),
            Close::ValueTooLarge {
                query,
                key,
                len,
                limit,
            } => write!(
                f,
                "{} on key \"{}\" would make a value of {len} bytes, over the server's \
                 limit of {limit} bytes per value (--max-value-bytes)",
                query.name(),
                key.escape_ascii()
            ),
            Close::StoreFull {
                query,
                needed,
                limit,
            } => write!(
                f,
                "{} would make the store hold {needed} bytes, over the server's limit of \
                 {limit} bytes (--max-store-bytes)",
                query.name()
            ),
            Close::OutOfMemory { query, bytes } => write!(
                f,
                "{} needs {bytes} bytes of memory that the allocator refused",
                query.name()
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for Close {}

#[cfg(feature = "std")]
impl std::error::Error for CounterError {}

/// What [`Engine::handle_request`] owes the requesting connection, in wire order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome<'a> {
    /// How many `STOP_WAITING` bytes to write first: this connection's own earlier
    /// `WAIT`/`BARRIER` requests that this request completed. Zero for any client with one
    /// request in flight (every PyTorch client).
    pub own_wakeups: usize,
    /// The reply to this request, or `None` when it has none (`VALIDATE`, `SET`, `APPEND`,
    /// `MULTI_SET`, `QUEUE_PUSH`) or none yet (a `WAIT` or `BARRIER` that must wait).
    pub reply: Option<Response<'a>>,
}

impl Outcome<'_> {
    fn silent() -> Self {
        Outcome {
            own_wakeups: 0,
            reply: None,
        }
    }
}

/// The reply to a request, described without borrowing the store (see `Engine::render`).
enum Answer<'r> {
    /// No reply (now).
    Silent,
    /// A reply that borrows at most the request.
    Now(Response<'r>),
    /// `Value` of the stored `key`, or `missing` if there is none.
    Stored { key: &'r [u8], missing: &'r [u8] },
    /// `Values` of the stored keys, empty for missing ones.
    StoredMany(KeyList<'r>),
    /// `Keys` of the key/value map.
    ListKeys,
    /// `QueuePop` of the element just moved to `Engine::popped`.
    Popped { len_before: i64 },
}

/// Numbers waits in registration order.
type WaitId = u64;

#[derive(Debug, Default)]
struct Connection {
    validated: bool,
    /// Pending `WAIT`/`BARRIER` requests.
    waits: Vec<WaitId>,
}

/// Most key bytes a [`Close`] quotes.
const QUOTED_KEY: usize = 64;

#[derive(Debug)]
struct PendingWait {
    conn: ConnId,
    /// Registrations still in `Engine::waiters`; the wait completes when this reaches 0.
    remaining: usize,
    /// Every key it registered on, `None` once that registration was satisfied: the
    /// keys whose [`Registrations`] still hold it, for cancellation.
    keys: WaitKeys,
    /// What it is charged against the store budget.
    cost: usize,
}

/// The keys a wait registered on, in order, each `None` once its registration was
/// satisfied. One key (every `BARRIER`, PyTorch's `wait([key])`) is held inline, so that
/// such a wait costs one allocation: its key's copy.
#[derive(Debug)]
enum WaitKeys {
    One(Option<Box<[u8]>>),
    Many(Vec<Option<Box<[u8]>>>),
}

impl Default for WaitKeys {
    fn default() -> Self {
        WaitKeys::Many(Vec::new())
    }
}

impl WaitKeys {
    fn as_slice(&self) -> &[Option<Box<[u8]>>] {
        match self {
            WaitKeys::One(key) => core::slice::from_ref(key),
            WaitKeys::Many(keys) => keys,
        }
    }

    /// Adds a key; returns its index.
    fn push(&mut self, key: Box<[u8]>) -> usize {
        match self {
            WaitKeys::Many(keys) if keys.is_empty() => {
                *self = WaitKeys::One(Some(key));
                0
            }
            WaitKeys::One(first) => {
                let first = first.take();
                *self = WaitKeys::Many(alloc::vec![first, Some(key)]);
                1
            }
            WaitKeys::Many(keys) => {
                keys.push(Some(key));
                keys.len() - 1
            }
        }
    }

    /// Marks the `index`-th key's registration satisfied.
    fn satisfy(&mut self, index: usize) {
        let slot = match self {
            WaitKeys::One(key) => (index == 0).then_some(key),
            WaitKeys::Many(keys) => keys.get_mut(index),
        };
        if let Some(key) = slot {
            *key = None;
        }
    }

    /// The keys whose registrations are not satisfied yet.
    fn unsatisfied(&self) -> impl Iterator<Item = &Box<[u8]>> {
        self.as_slice().iter().flatten()
    }

    /// Bytes on the heap: the list (when not inline) and the keys still held.
    fn heap_bytes(&self) -> usize {
        let list = match self {
            WaitKeys::One(_) => 0,
            WaitKeys::Many(keys) => keys.capacity() * core::mem::size_of::<Option<Box<[u8]>>>(),
        };
        list + self.unsatisfied().map(|key| key.len()).sum::<usize>()
    }
}

/// The waits registered on one key, oldest first, each with the index of the key among
/// its wait's `keys`. A dropped wait (cancelled, or its connection gone) leaves its
/// entries here stale, skipped by the wake-ups since the wait is no longer in
/// `Engine::waits` (ids are never reused); `stale` counts them, and the list is compacted
/// once they are more than half of it. So registering costs a `push_back`, dropping
/// O(1) amortized, a wake-up O(1) per registration, and the list holds at most about
/// twice the live registrations, however often a peer cancels.
#[derive(Debug, Default)]
struct Registrations {
    ids: VecDeque<(WaitId, usize)>,
    stale: usize,
}

/// The state machine of one TCPStore server. See the [module docs](self) for the
/// polling order and the exact semantics.
#[derive(Debug)]
pub struct Engine {
    /// The per-value and total limits (the per-connection ones are `session`'s).
    budget: Budget,
    /// Bytes charged against `budget.max_store_bytes` (see `budget`'s policy).
    held: usize,
    /// The clock the runtime last reported ([`Engine::tick`]), and the first one.
    now_ms: u64,
    started_ms: Option<u64>,
    kv: HashMap<Box<[u8]>, Vec<u8>>,
    /// Never holds an empty queue.
    queues: HashMap<Box<[u8]>, VecDeque<Vec<u8>>>,
    /// Key → waits registered on it, in registration order. Never holds an entry
    /// without a live registration. Invariant: a wait's `remaining` equals the number of
    /// entries here that hold its id.
    waiters: HashMap<Box<[u8]>, Registrations>,
    waits: HashMap<WaitId, PendingWait>,
    conns: HashMap<ConnId, Connection>,
    /// `STOP_WAITING` wake-ups owed to connections other than the requester.
    wakeups: VecDeque<ConnId>,
    next_wait: WaitId,
    /// The connection whose request is being handled (its wake-ups go to `own_wakeups`).
    requester: Option<ConnId>,
    own_wakeups: usize,
    /// The element the last `QUEUE_POP` removed; its reply borrows it.
    popped: Vec<u8>,
    /// Requests handled, by [`QueryType::index`].
    requests: [u64; QueryType::ALL.len()],
    /// Bytes the runtime reported through [`Engine::count_traffic`].
    bytes_in: u64,
    bytes_out: u64,
    /// Access-control refusals the runtime reported through [`Engine::count_refusal`].
    refusals: AccessCounters,
}

impl Default for Engine {
    fn default() -> Self {
        Engine::with_budget(Budget::UNLIMITED)
    }
}

impl Engine {
    /// An empty store with no connections and no memory limits (an in-process store).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that refuses writes over `budget`'s per-value and total limits.
    pub fn with_budget(budget: Budget) -> Self {
        Engine {
            budget,
            held: 0,
            now_ms: 0,
            started_ms: None,
            kv: HashMap::new(),
            queues: HashMap::new(),
            waiters: HashMap::new(),
            waits: HashMap::new(),
            conns: HashMap::new(),
            wakeups: VecDeque::new(),
            next_wait: 0,
            requester: None,
            own_wakeups: 0,
            popped: Vec::new(),
            requests: [0; QueryType::ALL.len()],
            bytes_in: 0,
            bytes_out: 0,
            refusals: AccessCounters::default(),
        }
    }

    /// The limits this store enforces.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Bytes charged against the total limit now.
    pub fn held_bytes(&self) -> usize {
        self.held
    }

    /// The runtime's clock, in milliseconds from any fixed origin: the first call marks
    /// the start that `STATS` reports uptime from. Never going back is not required (a
    /// smaller `now_ms` is ignored).
    pub fn tick(&mut self, now_ms: u64) {
        self.started_ms.get_or_insert(now_ms);
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// Milliseconds from the first [`Engine::tick`] to the last (0 without one).
    pub fn uptime_ms(&self) -> u64 {
        self.started_ms
            .map_or(0, |started| self.now_ms.saturating_sub(started))
    }

    /// Registers a newly accepted connection, which must send `VALIDATE` first. Returns
    /// `false` (and changes nothing) if `conn` is already connected.
    pub fn connect(&mut self, conn: ConnId) -> bool {
        match self.conns.entry(conn) {
            hashbrown::hash_map::Entry::Occupied(_) => false,
            hashbrown::hash_map::Entry::Vacant(slot) => {
                slot.insert(Connection::default());
                true
            }
        }
    }

    /// Forgets a closed connection: its pending waits are dropped, and so are wake-ups
    /// queued for it and not yet polled. Returns whether it was connected.
    pub fn disconnect(&mut self, conn: ConnId) -> bool {
        self.forget(conn)
    }

    /// Applies one request from `conn` and returns what `conn` is owed now; wake-ups for
    /// other connections wait in [`Engine::poll_wakeup`]. See the [module docs](self).
    ///
    /// The reply may borrow the store (a value) or the request (`COMPARE_SET` on a missing
    /// key echoes `expected`), hence the shared lifetime.
    pub fn handle_request<'a>(
        &'a mut self,
        conn: ConnId,
        request: Request<'a>,
    ) -> Result<Outcome<'a>, Close> {
        self.count_request(&request);
        let Some(state) = self.conns.get_mut(&conn) else {
            return Err(Close::UnknownConnection { conn });
        };
        if !state.validated {
            let close = match request {
                Request::Validate { magic } if magic == VALIDATION_MAGIC => {
                    state.validated = true;
                    return Ok(Outcome::silent());
                }
                Request::Validate { magic } => Close::IncorrectValidate { magic },
                other => Close::MissingValidate {
                    query: other.query_type(),
                },
            };
            self.forget(conn);
            return Err(close);
        }
        self.apply_validated(conn, request)
    }

    /// [`Engine::handle_request`] for a connection that is connected and has passed
    /// `VALIDATE` here, as the caller knows (a [`Session`](super::session::Session)
    /// remembers the engine's answer to its `VALIDATE`): the same, without looking the
    /// connection up to check. After a [`Close`] the engine has forgotten the connection,
    /// and the caller closes it rather than calling again.
    pub fn handle_validated_request<'a>(
        &'a mut self,
        conn: ConnId,
        request: Request<'a>,
    ) -> Result<Outcome<'a>, Close> {
        debug_assert!(
            self.conns.get(&conn).is_some_and(|state| state.validated),
            "{conn:?} is not a validated connection of this engine"
        );
        self.count_request(&request);
        self.apply_validated(conn, request)
    }

    /// Counts `request` for `STATS`, and lets go of the value the last `QUEUE_POP`
    /// reply borrowed.
    #[inline]
    fn count_request(&mut self, request: &Request<'_>) {
        if !self.popped.is_empty() {
            // The previous reply that borrowed it is gone; do not hold a large value.
            self.popped = Vec::new();
        }
        let served = &mut self.requests[request.query_type().index()];
        *served = served.saturating_add(1);
    }

    /// A validated connection's request, applied and answered.
    #[inline]
    fn apply_validated<'a>(
        &'a mut self,
        conn: ConnId,
        request: Request<'a>,
    ) -> Result<Outcome<'a>, Close> {
        self.requester = Some(conn);
        self.own_wakeups = 0;
        let answer = self.apply(conn, request);
        self.requester = None;
        let own_wakeups = core::mem::take(&mut self.own_wakeups);
        match answer {
            Ok(answer) => Ok(Outcome {
                own_wakeups,
                reply: self.render(answer),
            }),
            Err(close) => {
                self.forget(conn);
                Err(close)
            }
        }
    }

    /// The next wake-up owed to a waiting connection (always
    /// [`WaitResponse::StopWaiting`]), in the order the waits completed. Drain it after
    /// every [`Engine::handle_request`].
    pub fn poll_wakeup(&mut self) -> Option<(ConnId, WaitResponse)> {
        self.wakeups
            .pop_front()
            .map(|conn| (conn, WaitResponse::StopWaiting))
    }

    /// How many keys the key/value map holds (what `GETNUMKEYS` replies).
    pub fn num_keys(&self) -> usize {
        self.kv.len()
    }

    /// Every key and its value, in no order (queues not included): for a read-only
    /// status view (`--metrics`' `/status`), which shows keys, never values.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.kv
            .iter()
            .map(|(key, value)| (&key[..], value.as_slice()))
    }

    /// The value stored under `key`, if any.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.kv.get(key).map(Vec::as_slice)
    }

    /// How many elements the queue `key` holds.
    pub fn queue_len(&self, key: &[u8]) -> usize {
        self.queues.get(key).map_or(0, VecDeque::len)
    }

    /// How many non-empty queues exist.
    pub fn num_queues(&self) -> usize {
        self.queues.len()
    }

    /// How many `WAIT`/`BARRIER` requests are pending, over all connections.
    pub fn waiter_count(&self) -> usize {
        self.waits.len()
    }

    /// How many distinct keys have at least one pending wait registered on them.
    pub fn waited_key_count(&self) -> usize {
        self.waiters.len()
    }

    /// How many connections are connected (validated or not).
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Whether `conn` is connected.
    pub fn is_connected(&self, conn: ConnId) -> bool {
        self.conns.contains_key(&conn)
    }

    /// The bytes the engine's structures hold on the heap now: its hash tables
    /// (`allocation_size`), every key, value and queue element by capacity, the waits'
    /// registrations and key copies, the connections' wait lists and the wake-up queue.
    /// Exact up to the allocator's own rounding and headers. It walks the whole store
    /// (O(keys + waits + connections)): for measuring, not for a serve path.
    pub fn heap_bytes(&self) -> usize {
        use core::mem::size_of;
        let kv: usize = self.kv.iter().map(|(k, v)| k.len() + v.capacity()).sum();
        let queues: usize = self
            .queues
            .iter()
            .map(|(k, q)| {
                k.len()
                    + q.capacity() * size_of::<Vec<u8>>()
                    + q.iter().map(Vec::capacity).sum::<usize>()
            })
            .sum();
        let waiters: usize = self
            .waiters
            .iter()
            .map(|(k, r)| k.len() + r.ids.capacity() * size_of::<(WaitId, usize)>())
            .sum();
        let waits: usize = self.waits.values().map(|w| w.keys.heap_bytes()).sum();
        let conns: usize = self
            .conns
            .values()
            .map(|c| c.waits.capacity() * size_of::<WaitId>())
            .sum();
        self.kv.allocation_size()
            + self.queues.allocation_size()
            + self.waiters.allocation_size()
            + self.waits.allocation_size()
            + self.conns.allocation_size()
            + kv
            + queues
            + waiters
            + waits
            + conns
            + self.wakeups.capacity() * size_of::<ConnId>()
            + self.popped.capacity()
    }

    /// How many wake-ups wait to be polled.
    pub fn pending_wakeups(&self) -> usize {
        self.wakeups.len()
    }

    /// Adds to the traffic counters reported by `STATS`: request bytes decoded and reply
    /// bytes encoded. The engine never sees bytes, so the runtime reports them.
    pub fn count_traffic(&mut self, bytes_in: u64, bytes_out: u64) {
        self.bytes_in = self.bytes_in.saturating_add(bytes_in);
        self.bytes_out = self.bytes_out.saturating_add(bytes_out);
    }

    /// Counts an access-control refusal (a peer closed at accept, a bad or missing
    /// token, a request outside a token's scope) for `STATS`.
    pub fn count_refusal(&mut self, refusal: &Refusal) {
        self.refusals.record(refusal);
    }

    /// What `STATS` reports now; `uptime_ms` is [`Engine::uptime_ms`], as of the last
    /// [`Engine::tick`].
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            connections: self.conns.len() as u64,
            keys: self.kv.len() as u64,
            waiters: self.waits.len() as u64,
            queues: self.queues.len() as u64,
            bytes_in: self.bytes_in,
            bytes_out: self.bytes_out,
            uptime_ms: self.uptime_ms(),
            requests: self.requests,
            refused_peers: self.refusals.refused_peers,
            refused_tokens: self.refusals.refused_tokens,
            refused_requests: self.refusals.refused_requests,
        }
    }

    /// Applies a validated connection's request to the store; the reply is described,
    /// not built, so that the store is free to borrow again.
    fn apply<'r>(&mut self, conn: ConnId, request: Request<'r>) -> Result<Answer<'r>, Close> {
        let answer = match request {
            Request::Validate { .. } => return Err(Close::RepeatedValidate),
            Request::Set { key, value } => {
                self.store(QueryType::Set, key, value)?;
                self.wake_all(key);
                Answer::Silent
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                let current = self.kv.get(key).map(Vec::as_slice);
                let writes = semantics::compare_set(current, expected, desired).writes();
                if writes {
                    self.store(QueryType::CompareSet, key, desired)?;
                }
                self.wake_all(key);
                if writes {
                    Answer::Now(Response::Value(desired))
                } else {
                    // The current value, or `expected` when the key is missing.
                    Answer::Stored {
                        key,
                        missing: expected,
                    }
                }
            }
            Request::Get { key } => Answer::Stored { key, missing: &[] },
            Request::Add { key, delta } => {
                let total = self.add(key, delta)?;
                self.wake_all(key);
                Answer::Now(Response::Int(total))
            }
            Request::Check { keys } => Answer::Now(Response::Check(if self.all_present(keys) {
                CheckResponse::Ready
            } else {
                CheckResponse::NotReady
            })),
            Request::Wait { keys } => {
                if self.wait(conn, keys)? {
                    Answer::Now(Response::Wait(WaitResponse::StopWaiting))
                } else {
                    Answer::Silent
                }
            }
            Request::GetNumKeys => Answer::Now(Response::Int(count(self.kv.len()))),
            Request::DeleteKey { key } => {
                let removed = self.kv.remove(key);
                if let Some(value) = &removed {
                    self.release(Budget::entry_cost(key.len(), value.len()));
                }
                Answer::Now(Response::Int(i64::from(removed.is_some())))
            }
            Request::Append { key, value } => {
                self.append(key, value)?;
                self.wake_all(key);
                Answer::Silent
            }
            Request::MultiGet { keys } => Answer::StoredMany(keys),
            Request::MultiSet { pairs } => {
                self.check_multi_set(pairs)?;
                for (key, value) in pairs.iter() {
                    self.store(QueryType::MultiSet, key, value)?;
                    self.wake_all(key);
                }
                Answer::Silent
            }
            Request::CancelWait => {
                self.cancel_waits(conn);
                Answer::Now(Response::Wait(WaitResponse::WaitCanceled))
            }
            Request::Ping { nonce } => Answer::Now(Response::Pong(nonce)),
            Request::QueuePush { key, value } => {
                self.queue_push(key, value)?;
                self.wake_one(key);
                Answer::Silent
            }
            Request::QueuePop { key } => self.queue_pop(key),
            Request::QueueLen { key } => Answer::Now(Response::Int(count(self.queue_len(key)))),
            Request::ListKeys => Answer::ListKeys,
            Request::Stats => Answer::Now(Response::Stats(Box::new(self.stats()))),
            Request::Barrier { key, world_size } => {
                let current = self.kv.get(key).map(Vec::as_slice);
                let arrival = semantics::barrier_count(current)
                    .map_err(|error| bad_counter(QueryType::Barrier, key, error))?;
                self.store(QueryType::Barrier, key, Decimal::new(arrival).as_bytes())?;
                if semantics::barrier_released(arrival, world_size) {
                    self.wake_all(key);
                    Answer::Now(Response::Wait(WaitResponse::StopWaiting))
                } else {
                    let cost = Budget::entry_cost(key.len(), key.len());
                    self.charge(QueryType::Barrier, cost)?;
                    let id = self.new_wait_id();
                    self.waiters
                        .entry_ref(key)
                        .or_default()
                        .ids
                        .push_back((id, 0));
                    self.add_wait(conn, id, WaitKeys::One(Some(Box::from(key))), cost);
                    Answer::Silent
                }
            }
        };
        Ok(answer)
    }

    /// Builds the reply an [`Answer`] describes, borrowing the store where it must.
    fn render<'a>(&'a self, answer: Answer<'a>) -> Option<Response<'a>> {
        Some(match answer {
            Answer::Silent => return None,
            Answer::Now(response) => response,
            Answer::Stored { key, missing } => {
                Response::Value(self.kv.get(key).map_or(missing, Vec::as_slice))
            }
            Answer::StoredMany(keys) => {
                let mut values = Vec::with_capacity(keys.len());
                values.extend(keys.iter().map(|key| self.value_or_empty(key)));
                Response::Values(values)
            }
            Answer::ListKeys => {
                let mut keys: Vec<&[u8]> = self.kv.keys().map(|key| &**key).collect();
                keys.sort_unstable();
                Response::Keys(keys)
            }
            Answer::Popped { len_before } => Response::QueuePop {
                len_before,
                value: Some(&self.popped),
            },
        })
    }

    fn value_or_empty(&self, key: &[u8]) -> &[u8] {
        self.kv.get(key).map_or(&[], Vec::as_slice)
    }

    /// `store[key] = value`, reusing the old buffer unless it is far too large; refused
    /// (nothing changed) over the per-value or total limit, or when the allocator
    /// refuses.
    fn store(&mut self, query: QueryType, key: &[u8], value: &[u8]) -> Result<(), Close> {
        if value.len() > self.budget.max_value_bytes {
            return Err(self.too_large(query, key, value.len()));
        }
        let oom = |_| Close::OutOfMemory {
            query,
            bytes: value.len(),
        };
        // One lookup: the account is settled on the entry found (fields apart from
        // `kv`, so that the entry stays borrowed).
        let (held, limit) = (&mut self.held, self.budget.max_store_bytes);
        let new = Budget::entry_cost(key.len(), value.len());
        let mut settle = |old: usize| {
            let needed = held.saturating_sub(old).saturating_add(new);
            if new > old && needed > limit {
                return Err(Close::StoreFull {
                    query,
                    needed,
                    limit,
                });
            }
            *held = needed;
            Ok(())
        };
        match self.kv.entry_ref(key) {
            EntryRef::Occupied(mut slot) => {
                settle(Budget::entry_cost(key.len(), slot.get().len()))?;
                let buf = slot.get_mut();
                if buf.capacity() / 2 > value.len().max(64) {
                    *buf = try_copy(value).map_err(oom)?;
                } else {
                    buf.clear();
                    buf.try_reserve(value.len()).map_err(oom)?;
                    buf.extend_from_slice(value);
                }
            }
            EntryRef::Vacant(slot) => {
                settle(0)?;
                slot.insert(try_copy(value).map_err(oom)?);
            }
        }
        Ok(())
    }

    /// `ADD`: the counter at `key` plus `delta`, stored as its decimal. A counter that
    /// exists is rewritten in place with one lookup when its room fits the new digits
    /// (the common case); anything else goes through [`Engine::store`], with the same
    /// limits.
    fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, Close> {
        let existing = match self.kv.get_mut(key) {
            Some(buf) => {
                let total = semantics::add_counter(Some(buf), delta)
                    .map_err(|error| bad_counter(QueryType::Add, key, error))?;
                let digits = Decimal::new(total);
                let value = digits.as_bytes();
                let old = Budget::entry_cost(key.len(), buf.len());
                let new = Budget::entry_cost(key.len(), value.len());
                let needed = self.held.saturating_sub(old).saturating_add(new);
                // What `store` would do in place: no refusal, no reallocation.
                let in_place = value.len() <= self.budget.max_value_bytes
                    && (new <= old || needed <= self.budget.max_store_bytes)
                    && buf.capacity() >= value.len()
                    && buf.capacity() / 2 <= value.len().max(64);
                if in_place {
                    if buf.len() == value.len() {
                        // As many digits as before (most ADDs): one copy, no resize.
                        buf.copy_from_slice(value);
                    } else {
                        buf.clear();
                        buf.extend_from_slice(value);
                    }
                    self.held = needed;
                    return Ok(total);
                }
                Some(total)
            }
            None => None,
        };
        let total = match existing {
            Some(total) => total,
            None => semantics::add_counter(None, delta)
                .map_err(|error| bad_counter(QueryType::Add, key, error))?,
        };
        self.store(QueryType::Add, key, Decimal::new(total).as_bytes())?;
        Ok(total)
    }

    /// `APPEND`: the value it builds is held to the per-value limit.
    fn append(&mut self, key: &[u8], value: &[u8]) -> Result<(), Close> {
        let query = QueryType::Append;
        let old = self.kv.get(key).map(Vec::len);
        let len = old.unwrap_or(0).saturating_add(value.len());
        if len > self.budget.max_value_bytes {
            return Err(self.too_large(query, key, len));
        }
        let cost = match old {
            Some(_) => value.len(),
            None => Budget::entry_cost(key.len(), value.len()),
        };
        self.charge(query, cost)?;
        let oom = |_| Close::OutOfMemory {
            query,
            bytes: value.len(),
        };
        match self.kv.entry_ref(key) {
            EntryRef::Occupied(mut slot) => {
                let buf = slot.get_mut();
                buf.try_reserve(value.len()).map_err(oom)?;
                buf.extend_from_slice(value);
            }
            EntryRef::Vacant(slot) => {
                slot.insert(try_copy(value).map_err(oom)?);
            }
        }
        Ok(())
    }

    /// `QUEUE_PUSH`: each element is held to the per-value limit and charged.
    fn queue_push(&mut self, key: &[u8], value: &[u8]) -> Result<(), Close> {
        let query = QueryType::QueuePush;
        if value.len() > self.budget.max_value_bytes {
            return Err(self.too_large(query, key, value.len()));
        }
        let mut cost = Budget::entry_cost(0, value.len());
        if !self.queues.contains_key(key) {
            cost = cost.saturating_add(Budget::entry_cost(key.len(), 0));
        }
        self.charge(query, cost)?;
        let element = try_copy(value).map_err(|_| Close::OutOfMemory {
            query,
            bytes: value.len(),
        })?;
        self.queues.entry_ref(key).or_default().push_back(element);
        Ok(())
    }

    /// Refuses a `MULTI_SET` that cannot fit before any of it is written, so that a
    /// refusal changes nothing. The check counts every pair as new and frees each
    /// existing key's old value once (a key named twice is charged twice: erring on the
    /// side of refusal).
    fn check_multi_set(&self, pairs: super::PairList<'_>) -> Result<(), Close> {
        let query = QueryType::MultiSet;
        let mut added = 0usize;
        for (key, value) in pairs.iter() {
            if value.len() > self.budget.max_value_bytes {
                return Err(self.too_large(query, key, value.len()));
            }
            added = added.saturating_add(Budget::entry_cost(key.len(), value.len()));
        }
        let limit = self.budget.max_store_bytes;
        if self.held.saturating_add(added) <= limit {
            return Ok(());
        }
        let mut seen = hashbrown::HashSet::new();
        let mut freed = 0usize;
        for (key, _) in pairs.iter() {
            if let Some(old) = self.kv.get(key) {
                if seen.insert(key) {
                    freed = freed.saturating_add(Budget::entry_cost(key.len(), old.len()));
                }
            }
        }
        let needed = self.held.saturating_add(added).saturating_sub(freed);
        if needed > limit {
            return Err(Close::StoreFull {
                query,
                needed,
                limit,
            });
        }
        Ok(())
    }

    /// Charges `bytes` against the total limit, or refuses (charging nothing).
    fn charge(&mut self, query: QueryType, bytes: usize) -> Result<(), Close> {
        let needed = self.held.saturating_add(bytes);
        let limit = self.budget.max_store_bytes;
        if needed > limit {
            return Err(Close::StoreFull {
                query,
                needed,
                limit,
            });
        }
        self.held = needed;
        Ok(())
    }

    fn release(&mut self, bytes: usize) {
        self.held = self.held.saturating_sub(bytes);
    }

    fn too_large(&self, query: QueryType, key: &[u8], len: usize) -> Close {
        Close::ValueTooLarge {
            query,
            key: key[..key.len().min(QUOTED_KEY)].to_vec(),
            len,
            limit: self.budget.max_value_bytes,
        }
    }

    fn present(&self, key: &[u8]) -> bool {
        semantics::key_present(self.kv.contains_key(key), self.queue_len(key))
    }

    fn all_present(&self, keys: KeyList<'_>) -> bool {
        keys.iter().all(|key| self.present(key))
    }

    fn queue_pop<'r>(&mut self, key: &[u8]) -> Answer<'r> {
        let empty = Answer::Now(Response::QueuePop {
            len_before: 0,
            value: None,
        });
        let Some(queue) = self.queues.get_mut(key) else {
            return empty;
        };
        let len_before = count(queue.len());
        let front = queue.pop_front();
        let mut freed = front
            .as_ref()
            .map_or(0, |value| Budget::entry_cost(0, value.len()));
        if queue.is_empty() {
            self.queues.remove(key);
            freed = freed.saturating_add(Budget::entry_cost(key.len(), 0));
        }
        self.release(freed);
        match front {
            Some(value) => {
                self.popped = value;
                Answer::Popped { len_before }
            }
            // Unreachable while the map holds no empty queue; answer as for a missing one.
            None => empty,
        }
    }

    /// Handles `WAIT`: returns `true` to reply now, else registers a wait (charged for
    /// every key it names, twice: the registration and the wait's own copy).
    fn wait(&mut self, conn: ConnId, keys: KeyList<'_>) -> Result<bool, Close> {
        if self.all_present(keys) {
            return Ok(true);
        }
        let cost = keys.iter().fold(0usize, |cost, key| {
            cost.saturating_add(Budget::entry_cost(key.len(), key.len()))
        });
        self.charge(QueryType::Wait, cost)?;
        let id = self.new_wait_id();
        let mut registered = WaitKeys::default();
        for key in keys.iter() {
            if self.present(key) {
                continue;
            }
            let ids = &mut self.waiters.entry_ref(key).or_default().ids;
            // `id` is the newest wait, so if it is registered here already (the key
            // repeats in this WAIT) it is the last element.
            if ids.back().is_some_and(|&(last, _)| last == id) {
                continue;
            }
            let index = registered.push(Box::from(key));
            ids.push_back((id, index));
        }
        self.add_wait(conn, id, registered, cost);
        Ok(false)
    }

    fn new_wait_id(&mut self) -> WaitId {
        let id = self.next_wait;
        // 2^64 waits do not happen; wrapping keeps this panic-free regardless.
        self.next_wait = self.next_wait.wrapping_add(1);
        id
    }

    fn add_wait(&mut self, conn: ConnId, id: WaitId, keys: WaitKeys, cost: usize) {
        let remaining = keys.as_slice().len();
        self.waits.insert(
            id,
            PendingWait {
                conn,
                remaining,
                keys,
                cost,
            },
        );
        if let Some(state) = self.conns.get_mut(&conn) {
            state.waits.push(id);
        }
    }

    /// An arrival of `key` for every wait registered on it.
    fn wake_all(&mut self, key: &[u8]) {
        // Most writes find no waiter at all: no need to hash the key a second time.
        if self.waiters.is_empty() {
            return;
        }
        let Some(registrations) = self.waiters.remove(key) else {
            return;
        };
        // Stale ids find no wait and are skipped.
        for (id, index) in registrations.ids {
            let done = match self.waits.get_mut(&id) {
                Some(wait) => satisfy(wait, index),
                None => false,
            };
            if done {
                self.complete(id);
            }
        }
    }

    /// An arrival of `key` for the waits registered on it, in order, up to and including
    /// the first one it completes.
    fn wake_one(&mut self, key: &[u8]) {
        let Some(registrations) = self.waiters.get_mut(key) else {
            return;
        };
        let mut completed = None;
        while let Some((id, index)) = registrations.ids.pop_front() {
            match self.waits.get_mut(&id) {
                Some(wait) => {
                    if satisfy(wait, index) {
                        completed = Some(id);
                        break;
                    }
                }
                None => registrations.stale = registrations.stale.saturating_sub(1),
            }
        }
        if registrations.ids.len() <= registrations.stale {
            self.waiters.remove(key);
        } else if registrations.stale * 2 > registrations.ids.len() {
            // Popping live entries can leave stale ones the majority: compact, as
            // `drop_wait` does, so that stale entries never outnumber live ones.
            let waits = &self.waits;
            registrations.ids.retain(|(id, _)| waits.contains_key(id));
            registrations.stale = 0;
        }
        if let Some(id) = completed {
            self.complete(id);
        }
    }

    /// Retires a wait with no registrations left and owes its connection `STOP_WAITING`.
    fn complete(&mut self, id: WaitId) {
        let Some(wait) = self.waits.remove(&id) else {
            return;
        };
        self.release(wait.cost);
        if let Some(state) = self.conns.get_mut(&wait.conn) {
            if let Some(pos) = state.waits.iter().position(|&w| w == id) {
                state.waits.swap_remove(pos);
            }
        }
        if self.requester == Some(wait.conn) {
            self.own_wakeups += 1;
        } else {
            self.wakeups.push_back(wait.conn);
        }
    }

    /// Drops a wait and all its remaining registrations, owing nothing.
    fn drop_wait(&mut self, id: WaitId) {
        let Some(wait) = self.waits.remove(&id) else {
            return;
        };
        self.release(wait.cost);
        for key in wait.keys.unsatisfied() {
            let Some(registrations) = self.waiters.get_mut(&**key) else {
                continue;
            };
            registrations.stale += 1;
            if registrations.ids.len() <= registrations.stale {
                self.waiters.remove(&**key);
            } else if registrations.stale * 2 > registrations.ids.len() {
                let waits = &self.waits;
                registrations.ids.retain(|(id, _)| waits.contains_key(id));
                registrations.stale = 0;
            }
        }
    }

    fn cancel_waits(&mut self, conn: ConnId) {
        let Some(state) = self.conns.get_mut(&conn) else {
            return;
        };
        let mut ids = core::mem::take(&mut state.waits);
        for &id in &ids {
            self.drop_wait(id);
        }
        ids.clear();
        if let Some(state) = self.conns.get_mut(&conn) {
            // Keep the buffer for the connection's next wait.
            state.waits = ids;
        }
    }

    fn forget(&mut self, conn: ConnId) -> bool {
        let Some(state) = self.conns.remove(&conn) else {
            return false;
        };
        for id in state.waits {
            self.drop_wait(id);
        }
        if !self.wakeups.is_empty() {
            self.wakeups.retain(|&owed| owed != conn);
        }
        true
    }
}

/// Satisfies `wait`'s registration on its `index`-th key; returns whether that was its
/// last one (the wait is complete).
fn satisfy(wait: &mut PendingWait, index: usize) -> bool {
    wait.keys.satisfy(index);
    wait.remaining = wait.remaining.saturating_sub(1);
    wait.remaining == 0
}

fn bad_counter(query: QueryType, key: &[u8], error: CounterError) -> Close {
    Close::BadCounter {
        query,
        key: key.to_vec(),
        error,
    }
}

/// A copy of `bytes` in a fallibly allocated vector.
fn try_copy(bytes: &[u8]) -> Result<Vec<u8>, alloc::collections::TryReserveError> {
    let mut copy = Vec::new();
    copy.try_reserve_exact(bytes.len())?;
    copy.extend_from_slice(bytes);
    Ok(copy)
}

/// A length as the wire's `int64` (saturating; no map holds 2^63 entries).
fn count(len: usize) -> i64 {
    i64::try_from(len).unwrap_or(i64::MAX)
}
