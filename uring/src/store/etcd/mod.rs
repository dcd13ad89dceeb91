//! [`EtcdStore`]: the c10d [`Store`] over an etcd v3 cluster, for stores that must outlive
//! any one machine.
//!
//! It speaks etcd's JSON gateway (its `gateway` module) and maps each operation onto etcd's own
//! primitives, keeping PyTorch's meaning as `rdzv_core::store::semantics` states it
//! (compare_set's four cases, counters as decimal text, what counts as present):
//!
//! | operation | etcd |
//! |---|---|
//! | SET, DELETE | one put, one delete-range |
//! | GET, WAIT | a range; if keys are missing, a watch from the revision *after* that range, so no write in between is missed (no polling) |
//! | CHECK | one transaction of count-only ranges |
//! | ADD, APPEND, COMPARE_SET | a transaction comparing the key's `mod_revision` (or its absence), retried with the value etcd returns on conflict |
//! | MULTI_SET, MULTI_GET | one transaction (at most `max_txn_ops` keys) |
//! | NUM_KEYS, LIST_KEYS | key-only ranges over the store's prefix, paged at one revision |
//! | QUEUE_PUSH, QUEUE_POP, QUEUE_LEN | one key per element beside the queue's name; pop takes the oldest by `create_revision` and deletes it in a transaction; a blocking pop watches |
//!
//! **Key layout.** With prefix `P` (the `etcd://…/P` path), user key `K` is the etcd key
//! `/P/K`, and the elements of the queue `K` are `/P/K\0<32 hex digits>`. So the range
//! `[/P/K, /P/K\x01)` holds exactly the key and its queue, which is what CHECK and WAIT
//! count ("present" is "in the map or a non-empty queue"), and one watch covers both.
//! User keys may not contain NUL.
//!
//! **Where PyTorch's semantics are not kept, and why.**
//! - A QUEUE_PUSH wakes *every* blocked pop on that queue, not one; they race with
//!   transactions and exactly one wins each element, the others wait again. Each element is
//!   still popped exactly once, in push order; only which waiter gets it differs.
//! - A COMPARE_SET that writes nothing wakes no waiter (the TCP store wakes the waiters of
//!   its key even then); etcd has no event without a write.
//! - Values larger than etcd's request limit (`--max-request-bytes`, 1.5 MiB by default)
//!   and MULTI_SET/MULTI_GET over more than `--max-txn-ops` keys (128) are refused with an
//!   error naming the limit, where the TCP store would accept them.
//! - ADD, APPEND and QUEUE_POP are compare-guarded transactions, so when an answer is
//!   lost (a member died, "request timed out") the same transaction is sent again: at most
//!   one copy can apply. If the resent copy's compare fails, the lost one may be what
//!   changed the key, and the call fails with [`EtcdError::OutcomeUnknown`] rather than
//!   risk counting twice. Everything else is retried on another member until its deadline.
//!
//! Not here: leases (keys that end with their owner's lease: the `lease` module) and the
//! elastic rendezvous (`rdzv_uring::rendezvous::etcd`), which build on the same `gateway`.

pub mod error;
pub(crate) mod gateway;
mod lease;
mod spread;

use std::collections::HashMap;
use std::io;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rdzv_core::store::semantics;
use serde_json::{json, Value};

pub use error::EtcdError;
use gateway::{b64, prefix_end, Gateway, RangeReply, Retry, TxnReply};
pub use lease::Lease;

use super::{Store, StoreError, DEFAULT_TIMEOUT};

/// etcd's default `--max-request-bytes`: 1.5 MiB.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1536 * 1024;
/// etcd's default `--max-txn-ops`.
pub const DEFAULT_MAX_TXN_OPS: usize = 128;
/// Room left in a request for everything but keys and values (field tags, lengths).
const REQUEST_OVERHEAD: usize = 512;
/// Keys whose last value an [`EtcdStore`] handle remembers for its next update.
const LAST_SEEN_KEYS: usize = 256;
/// Keys read per page by NUM_KEYS and LIST_KEYS.
const PAGE: i64 = 1000;

/// Where an [`EtcdStore`] keeps its keys and how it reaches them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdConfig {
    /// The members' client endpoints, `host:port` each, tried in this order first.
    pub endpoints: Vec<String>,
    /// The store's prefix: keys live under `/PREFIX/` (no leading or trailing `/`).
    pub prefix: String,
    /// The default timeout of blocking calls (GET, WAIT, blocking QUEUE_POP).
    pub timeout: Duration,
    /// How long one operation keeps retrying etcd (over every endpoint, with backoff)
    /// before it fails with an error naming etcd.
    pub request_timeout: Duration,
    /// etcd's `--max-request-bytes`: bigger writes are refused before they are sent.
    pub max_request_bytes: usize,
    /// etcd's `--max-txn-ops`: the most keys one MULTI_SET or MULTI_GET may name.
    pub max_txn_ops: usize,
}

impl EtcdConfig {
    /// A configuration with PyTorch's 300 s timeout, 30 s to reach etcd, and etcd's
    /// default limits.
    pub fn new(endpoints: Vec<String>, prefix: &str) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            prefix: prefix.trim_matches('/').to_string(),
            timeout: DEFAULT_TIMEOUT,
            request_timeout: Duration::from_secs(30),
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_txn_ops: DEFAULT_MAX_TXN_OPS,
        }
    }

    /// Reads `etcd://HOST:PORT[,HOST:PORT…]/PREFIX` (a `?query` is left to the caller).
    pub fn parse(addr: &str) -> Result<EtcdConfig, EtcdError> {
        let bad = |detail| EtcdError::BadAddress {
            addr: addr.to_string(),
            detail,
        };
        let rest = addr
            .strip_prefix("etcd://")
            .ok_or_else(|| bad("it does not start with etcd://"))?;
        let rest = rest.split_once('?').map_or(rest, |(path, _)| path);
        let (hosts, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        if prefix.is_empty() {
            return Err(bad("the prefix (the path after the endpoints) is missing"));
        }
        if prefix.contains('\0') {
            return Err(bad("the prefix contains a NUL byte"));
        }
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let Some((name, port)) = host.rsplit_once(':') else {
                return Err(bad("an endpoint has no :PORT"));
            };
            if name.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad("an endpoint is not HOST:PORT with a port up to 65535"));
            }
            endpoints.push(host.to_string());
        }
        Ok(EtcdConfig::new(endpoints, prefix))
    }
}

/// A c10d store kept in etcd under one prefix. See the module docs for the mapping and
/// the key layout.
#[derive(Debug)]
pub struct EtcdStore {
    gateway: Gateway,
    config: EtcdConfig,
    /// `/PREFIX/`.
    prefix: Vec<u8>,
    timeout: Mutex<Duration>,
    /// The value and `mod_revision` this handle last wrote or saw for keys it updated
    /// (ADD, APPEND), the first guess of the next update: a counter this handle alone
    /// advances costs one transaction. A stale guess only fails its compare.
    last_seen: Mutex<LastSeen>,
}

/// A key's current value and revision, as a range found it (`None`: missing).
type Current = Option<(Vec<u8>, i64)>;

/// What an [`EtcdStore`] handle last saw of keys it updated: value and `mod_revision`.
type LastSeen = HashMap<Vec<u8>, (Vec<u8>, i64)>;

/// Where an update starts.
enum First {
    /// Guess that the key is missing (one transaction for a new key).
    GuessMissing,
    /// From the value a transaction just returned.
    Known(Current),
}

fn put_op(key: &[u8], value: &[u8]) -> Value {
    json!({"request_put": {"key": b64(key), "value": b64(value)}})
}

fn range_op(key: &[u8], end: Option<&[u8]>, count_only: bool) -> Value {
    let mut range = json!({"key": b64(key), "count_only": count_only});
    if let Some(end) = end {
        range["range_end"] = Value::String(b64(end));
    }
    json!({ "request_range": range })
}

/// The compare of an optimistic write: the key still has `current`'s revision (or is
/// still missing).
fn unchanged(key: &[u8], current: &Current) -> Value {
    match current {
        None => {
            json!({"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
        }
        Some((_, revision)) => {
            json!({"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": revision.to_string()})
        }
    }
}

fn first(range: Option<&RangeReply>) -> Current {
    range
        .and_then(|r| r.kvs.first())
        .map(|kv| (kv.value.clone(), kv.mod_revision))
}

impl EtcdStore {
    /// A store over `config` (no request is sent until the first operation).
    pub fn new(config: EtcdConfig) -> EtcdStore {
        let mut prefix = Vec::with_capacity(config.prefix.len() + 2);
        prefix.push(b'/');
        prefix.extend_from_slice(config.prefix.as_bytes());
        prefix.push(b'/');
        EtcdStore {
            gateway: Gateway::new(config.endpoints.clone()),
            timeout: Mutex::new(config.timeout),
            last_seen: Mutex::new(HashMap::new()),
            prefix,
            config,
        }
    }

    /// A store from `etcd://HOST:PORT[,HOST:PORT…]/PREFIX`.
    pub fn from_addr(addr: &str) -> Result<EtcdStore, StoreError> {
        EtcdConfig::parse(addr)
            .map(EtcdStore::new)
            .map_err(|e| StoreError::InvalidArgument(e.to_string()))
    }

    /// A handle of its own (its own connections) on the same cluster and prefix, counting
    /// its requests with this one's ([`Store::clone_store`], typed).
    pub fn duplicate(&self) -> EtcdStore {
        EtcdStore {
            gateway: self.gateway.duplicate(),
            config: self.config.clone(),
            prefix: self.prefix.clone(),
            timeout: Mutex::new(self.timeout()),
            last_seen: Mutex::new(HashMap::new()),
        }
    }

    /// The configuration this store was made with.
    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// How many requests this store and the handles cloned from it
    /// ([`Store::clone_store`]) have sent to etcd: every HTTP request to the gateway,
    /// retries on other members included, a watch counted once. Benchmarks divide it by
    /// the work done (requests per join, per keep-alive).
    pub fn requests(&self) -> u64 {
        self.gateway.requests()
    }

    fn error(&self, err: EtcdError) -> StoreError {
        match err {
            EtcdError::TooLarge { .. }
            | EtcdError::TooManyOps { .. }
            | EtcdError::NulInKey { .. }
            | EtcdError::BadAddress { .. } => StoreError::InvalidArgument(err.to_string()),
            other => StoreError::Io {
                op: "etcd store at",
                peer: self.gateway.endpoints(),
                source: io::Error::other(other),
            },
        }
    }

    fn key(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        if key.as_bytes().contains(&0) {
            return Err(self.error(EtcdError::NulInKey {
                key: key.to_string(),
            }));
        }
        let mut full = Vec::with_capacity(self.prefix.len() + key.len() + 33);
        full.extend_from_slice(&self.prefix);
        full.extend_from_slice(key.as_bytes());
        Ok(full)
    }

    /// `[key, key\x01)`: the key and its queue's elements.
    fn presence_end(full: &[u8]) -> Vec<u8> {
        let mut end = full.to_vec();
        end.push(1);
        end
    }

    /// `[key\0, key\x01)`: the queue's elements.
    fn queue_range(full: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let mut start = full.to_vec();
        start.push(0);
        (start, Self::presence_end(full))
    }

    fn request_deadline(&self) -> Instant {
        Instant::now() + self.config.request_timeout
    }

    fn check_size(&self, op: &'static str, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let bytes = pairs.iter().fold(REQUEST_OVERHEAD, |sum, (k, v)| {
            sum.saturating_add(self.prefix.len() + k.len() + v.len() + 32)
        });
        if bytes > self.config.max_request_bytes {
            return Err(self.error(EtcdError::TooLarge {
                op,
                key: pairs
                    .first()
                    .map(|(k, _)| k.to_string())
                    .unwrap_or_default(),
                bytes,
                limit: self.config.max_request_bytes,
            }));
        }
        Ok(())
    }

    fn check_ops(&self, op: &'static str, count: usize) -> Result<(), StoreError> {
        if count > self.config.max_txn_ops {
            return Err(self.error(EtcdError::TooManyOps {
                op,
                count,
                limit: self.config.max_txn_ops,
            }));
        }
        Ok(())
    }

    fn range(&self, body: Value, deadline: Instant) -> Result<RangeReply, StoreError> {
        self.gateway
            .call("range", "/v3/kv/range", &body, deadline)
            .map_err(|e| self.error(e))
    }

    fn txn(
        &self,
        compare: Vec<Value>,
        success: Vec<Value>,
        failure: Vec<Value>,
        deadline: Instant,
    ) -> Result<TxnReply, StoreError> {
        self.conditional_txn(compare, success, failure, Retry::Idempotent, deadline)
            .map(|(reply, _)| reply)
    }

    /// A transaction, and whether it had to be resent after a copy that may have applied
    /// (see [`Retry::Conditional`]): if so and its compare failed, the lost copy may be
    /// what changed the key, and the caller reports [`EtcdError::OutcomeUnknown`].
    fn conditional_txn(
        &self,
        compare: Vec<Value>,
        success: Vec<Value>,
        failure: Vec<Value>,
        retry: Retry,
        deadline: Instant,
    ) -> Result<(TxnReply, Option<EtcdError>), StoreError> {
        let body = json!({"compare": compare, "success": success, "failure": failure});
        self.gateway
            .call_with("txn", "/v3/kv/txn", &body, retry, deadline)
            .map_err(|e| self.error(e))
    }

    fn unknown(&self, op: &'static str, cause: EtcdError) -> StoreError {
        self.error(EtcdError::OutcomeUnknown {
            op,
            source: Box::new(cause),
        })
    }

    fn read(&self, full: &[u8], deadline: Instant) -> Result<(Current, i64), StoreError> {
        let reply = self.range(json!({"key": b64(full)}), deadline)?;
        Ok((first(Some(&reply)), reply.header.revision))
    }

    /// An optimistic read-modify-write of one key: `decide` maps the current value to
    /// `Ok(Some(new value))` to write, or `Ok(None)` to stop; a conflict re-reads (from
    /// the failed transaction) and decides again. Returns the value last decided on.
    /// Conditional updates (ADD, APPEND) guess from what this handle last saw.
    fn update<T>(
        &self,
        op: &'static str,
        key: &str,
        first_step: First,
        retry: Retry,
        mut decide: impl FnMut(&Current) -> Result<(Option<Vec<u8>>, T), StoreError>,
    ) -> Result<T, StoreError> {
        let full = self.key(key)?;
        let deadline = self.request_deadline();
        // A guess (remembered, or "missing") is only ever confirmed by a write's compare:
        // a decision not to write, or an error, is taken again on a fresh read.
        let (mut current, mut guessed) = match first_step {
            First::GuessMissing => (Some(None), true),
            First::Known(known) => (Some(known), false),
        };
        if retry == Retry::Conditional {
            if let Some(seen) = self.last_seen().get(&full) {
                current = Some(Some(seen.clone()));
                guessed = true;
            }
        }
        let mut conflicts = 0u32;
        loop {
            let known = match current.take() {
                Some(known) => known,
                None => self.read(&full, deadline)?.0,
            };
            let decided = decide(&known);
            let (write, result) = match decided {
                Err(_) | Ok((None, _)) if guessed => {
                    guessed = false;
                    continue;
                }
                other => other?,
            };
            let Some(value) = write else {
                return Ok(result);
            };
            self.check_size("write", &[(key, &value)])?;
            let (reply, resent) = self.conditional_txn(
                vec![unchanged(&full, &known)],
                vec![put_op(&full, &value)],
                vec![range_op(&full, None, false)],
                retry,
                deadline,
            )?;
            if reply.succeeded {
                // The transaction's revision is the key's new `mod_revision`.
                self.remember(full, Some((value, reply.header.revision)));
                return Ok(result);
            }
            if let (Retry::Conditional, Some(cause)) = (retry, resent) {
                self.remember(full, None);
                return Err(self.unknown(op, cause));
            }
            if !guessed {
                // Lost a race with another writer of this key: back off a random while
                // (1 ms doubling to 64 ms) so that a burst of writers, such as N nodes
                // counting their arrivals, spreads out instead of every loser retrying
                // at once.
                conflicts = conflicts.saturating_add(1);
                let ceiling = Duration::from_millis(1 << conflicts.min(6));
                std::thread::sleep(ceiling.mul_f64(fastrand::f64()));
            }
            guessed = false;
            current = Some(first(
                reply
                    .responses
                    .first()
                    .and_then(|r| r.response_range.as_ref()),
            ));
        }
    }

    /// `ADD`, resent after a lost answer even though the lost copy may have applied: the
    /// delta may count twice, never fails with [`EtcdError::OutcomeUnknown`]. For counters
    /// where that is harmless, such as a heartbeat whose watcher looks only for change.
    pub fn add_at_least_once(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.add_with(key, delta, Retry::Idempotent)
    }

    /// `ADD` as an update: one transaction for a new key or a right guess.
    fn add_with(&self, key: &str, delta: i64, retry: Retry) -> Result<i64, StoreError> {
        self.update("add", key, First::GuessMissing, retry, |current| {
            let value = current.as_ref().map(|(v, _)| v.as_slice());
            let new =
                semantics::add_counter(value, delta).map_err(|e| StoreError::NotACounter {
                    key: key.to_string(),
                    detail: e.to_string(),
                })?;
            if delta == 0 && current.is_some() {
                // Nothing to write; nobody waits on a key that exists.
                return Ok((None, new));
            }
            Ok((Some(semantics::Decimal::new(new).as_bytes().to_vec()), new))
        })
    }

    fn last_seen(&self) -> MutexGuard<'_, LastSeen> {
        self.last_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Remembers (or, with `None`, forgets) what `full` holds, keeping the map bounded.
    fn remember(&self, full: Vec<u8>, seen: Option<(Vec<u8>, i64)>) {
        let mut last_seen = self.last_seen();
        match seen {
            Some(seen) => {
                if last_seen.len() >= LAST_SEEN_KEYS && !last_seen.contains_key(&full) {
                    last_seen.clear();
                }
                last_seen.insert(full, seen);
            }
            None => {
                last_seen.remove(&full);
            }
        }
    }

    /// Which of `keys` are present (kv only, or kv or queue), and the revision read at
    /// (the oldest of the transactions', when there are several).
    fn presence(&self, fulls: &[Vec<u8>], kv_only: bool) -> Result<(Vec<bool>, i64), StoreError> {
        let deadline = self.request_deadline();
        let mut present = Vec::with_capacity(fulls.len());
        let mut revision = i64::MAX;
        for chunk in fulls.chunks(self.config.max_txn_ops.max(1)) {
            let ops = chunk
                .iter()
                .map(|full| {
                    let end = (!kv_only).then(|| Self::presence_end(full));
                    range_op(full, end.as_deref(), true)
                })
                .collect();
            let reply = self.txn(vec![], ops, vec![], deadline)?;
            revision = revision.min(reply.header.revision);
            present.extend(reply.responses.iter().map(|r| {
                r.response_range
                    .as_ref()
                    .is_some_and(|range| range.count > 0 || !range.kvs.is_empty())
            }));
        }
        if present.len() != fulls.len() {
            return Err(self.error(EtcdError::BadReply {
                endpoint: self.gateway.endpoints(),
                op: "txn",
                detail: format!("{} replies to {} ranges", present.len(), fulls.len()),
            }));
        }
        Ok((present, revision))
    }

    /// Waits until every key is present, watching from the revision of the check that
    /// found some missing. `names` are the keys as the caller gave them (for errors).
    fn wait_present(
        &self,
        names: &[&str],
        fulls: &[Vec<u8>],
        kv_only: bool,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let wait_deadline = started + timeout;
        let timed_out = || StoreError::Timeout {
            ms: timeout.as_millis(),
            keys: names.iter().map(|k| k.to_string()).collect(),
        };
        loop {
            let (present, revision) = self.presence(fulls, kv_only)?;
            let mut missing: Vec<(Vec<u8>, Vec<u8>)> = fulls
                .iter()
                .zip(&present)
                .filter(|(_, &here)| !here)
                .map(|(full, _)| {
                    let mut end = full.clone();
                    end.push(if kv_only { 0 } else { 1 });
                    (full.clone(), end)
                })
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= wait_deadline {
                return Err(timed_out());
            }
            // Opening the watch keeps failing over no longer than the wait may last: a
            // member slow to answer (etcd sends the reply's headers when it has made the
            // watch) is a wait that timed out, not a failure of etcd.
            let opened = self.gateway.watch(
                &missing,
                revision.saturating_add(1),
                self.request_deadline().min(wait_deadline),
                wait_deadline,
            );
            let mut stream = match opened {
                Ok(stream) => stream,
                Err(_) if Instant::now() >= wait_deadline => return Err(timed_out()),
                Err(e) => return Err(self.error(e)),
            };
            loop {
                match stream.next_reply() {
                    Some(Ok(reply)) if !reply.canceled && reply.compact_revision == 0 => {
                        for event in reply.events.iter().filter(|e| e.is_put()) {
                            let key = &event.kv.key;
                            missing.retain(|(start, end)| !(key >= start && key < end));
                        }
                        if missing.is_empty() {
                            return Ok(());
                        }
                    }
                    // Cancelled, compacted, broken or closed: check again (on another
                    // member if this one is gone), unless the time is up.
                    _ => {
                        if Instant::now() >= wait_deadline {
                            return Err(timed_out());
                        }
                        std::thread::sleep(Duration::from_millis(20));
                        break;
                    }
                }
            }
        }
    }

    fn wait_for(&self, keys: &[&str], kv_only: bool, timeout: Duration) -> Result<(), StoreError> {
        let fulls = keys
            .iter()
            .map(|k| self.key(k))
            .collect::<Result<Vec<_>, _>>()?;
        self.wait_present(keys, &fulls, kv_only, timeout)
    }

    /// Every user key under the prefix (queue elements left out), read page by page at
    /// the first page's revision.
    fn user_keys(&self) -> Result<Vec<Vec<u8>>, StoreError> {
        let deadline = self.request_deadline();
        let end = prefix_end(&self.prefix);
        let mut from = self.prefix.clone();
        let mut revision = 0i64;
        let mut keys = Vec::new();
        loop {
            let mut body = json!({"key": b64(&from), "range_end": b64(&end),
                "keys_only": true, "limit": PAGE.to_string()});
            if revision > 0 {
                body["revision"] = Value::String(revision.to_string());
            }
            let reply = self.range(body, deadline)?;
            if revision == 0 {
                revision = reply.header.revision;
            }
            let Some(last) = reply.kvs.last() else {
                break;
            };
            from = last.key.clone();
            from.push(0);
            keys.extend(
                reply
                    .kvs
                    .into_iter()
                    .filter_map(|kv| kv.key.get(self.prefix.len()..).map(<[u8]>::to_vec))
                    .filter(|user| !user.contains(&0)),
            );
            if !reply.more {
                break;
            }
        }
        Ok(keys)
    }
}

impl Store for EtcdStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.multi_set(&[(key, value)])
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let full = self.key(key)?;
        let timeout = self.timeout();
        let started = Instant::now();
        loop {
            if let (Some((value, _)), _) = self.read(&full, self.request_deadline())? {
                return Ok(value);
            }
            let left = timeout.saturating_sub(started.elapsed());
            self.wait_present(&[key], std::slice::from_ref(&full), true, left)
                .map_err(|err| match err {
                    StoreError::Timeout { keys, .. } => StoreError::Timeout {
                        ms: timeout.as_millis(),
                        keys,
                    },
                    other => other,
                })?;
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        // First try assumes the key is missing: a new counter costs one transaction.
        // `ADD 0` (a read that creates a missing counter) writes only a missing key and
        // may be applied twice without harm, so a lost answer is simply resent: one
        // transaction, never an unknown outcome.
        let retry = if delta == 0 {
            Retry::Idempotent
        } else {
            Retry::Conditional
        };
        self.add_with(key, delta, retry)
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        // One transaction in the common cases: an empty `expected` first assumes the key
        // is missing; otherwise etcd compares the value itself. A failed compare brings
        // back the current value, and the semantics decide from it.
        let first_step = if expected.is_empty() {
            First::GuessMissing
        } else {
            self.check_size("compare_set", &[(key, desired)])?;
            let full = self.key(key)?;
            let compare = json!({"key": b64(&full), "target": "VALUE", "result": "EQUAL",
                "value": b64(expected)});
            let reply = self.txn(
                vec![compare],
                vec![put_op(&full, desired)],
                vec![range_op(&full, None, false)],
                self.request_deadline(),
            )?;
            if reply.succeeded {
                return Ok(desired.to_vec());
            }
            First::Known(first(
                reply
                    .responses
                    .first()
                    .and_then(|r| r.response_range.as_ref()),
            ))
        };
        self.update(
            "compare_set",
            key,
            first_step,
            Retry::Idempotent,
            |current| {
                let value = current.as_ref().map(|(v, _)| v.as_slice());
                let outcome = semantics::compare_set(value, expected, desired);
                let write = outcome.writes().then(|| desired.to_vec());
                Ok((write, outcome.reply().to_vec()))
            },
        )
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let fulls = keys
            .iter()
            .map(|k| self.key(k))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(self.presence(&fulls, false)?.0.iter().all(|&here| here))
    }

    fn wait(&self, keys: &[&str], timeout: Option<Duration>) -> Result<(), StoreError> {
        self.wait_for(keys, false, timeout.unwrap_or_else(|| self.timeout()))
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        let full = self.key(key)?;
        let reply: gateway::DeleteReply = self
            .gateway
            .call(
                "deleterange",
                "/v3/kv/deleterange",
                &json!({"key": b64(&full)}),
                self.request_deadline(),
            )
            .map_err(|e| self.error(e))?;
        Ok(reply.deleted > 0)
    }

    fn num_keys(&self) -> Result<i64, StoreError> {
        Ok(i64::try_from(self.user_keys()?.len()).unwrap_or(i64::MAX))
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.update(
            "append",
            key,
            First::GuessMissing,
            Retry::Conditional,
            |current| {
                let mut new = current.as_ref().map(|(v, _)| v.clone()).unwrap_or_default();
                new.extend_from_slice(value);
                Ok((Some(new), ()))
            },
        )
    }

    fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.check_ops("multi_get", keys.len())?;
        let fulls = keys
            .iter()
            .map(|k| self.key(k))
            .collect::<Result<Vec<_>, _>>()?;
        let timeout = self.timeout();
        let started = Instant::now();
        loop {
            let left = timeout.saturating_sub(started.elapsed());
            self.wait_present(keys, &fulls, true, left)?;
            let ops = fulls.iter().map(|f| range_op(f, None, false)).collect();
            let reply = self.txn(vec![], ops, vec![], self.request_deadline())?;
            let values: Option<Vec<Vec<u8>>> = reply
                .responses
                .iter()
                .map(|r| first(r.response_range.as_ref()).map(|(v, _)| v))
                .collect();
            match values {
                Some(values) if values.len() == keys.len() => return Ok(values),
                // A key was deleted between the wait and the read: wait again.
                _ => continue,
            }
        }
    }

    fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        self.check_ops("multi_set", pairs.len())?;
        self.check_size("set", pairs)?;
        let ops = pairs
            .iter()
            .map(|(k, v)| Ok(put_op(&self.key(k)?, v)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        self.txn(vec![], ops, vec![], self.request_deadline())
            .map(drop)
    }

    fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.check_size("queue_push", &[(key, value)])?;
        let mut element = self.key(key)?;
        element.push(0);
        element.extend_from_slice(format!("{:032x}", fastrand::u128(..)).as_bytes());
        // Created only if absent, so a retry after a lost answer cannot push twice.
        self.txn(
            vec![unchanged(&element, &None)],
            vec![put_op(&element, value)],
            vec![],
            self.request_deadline(),
        )
        .map(drop)
    }

    fn queue_pop(&self, key: &str, block: bool) -> Result<Vec<u8>, StoreError> {
        let full = self.key(key)?;
        let (start, end) = Self::queue_range(&full);
        let timeout = self.timeout();
        let started = Instant::now();
        loop {
            let reply = self.range(
                json!({"key": b64(&start), "range_end": b64(&end), "limit": "1",
                    "sort_order": "ASCEND", "sort_target": "CREATE"}),
                self.request_deadline(),
            )?;
            if let Some(front) = reply.kvs.first() {
                let compare = json!({"key": b64(&front.key), "target": "CREATE",
                    "result": "EQUAL", "create_revision": front.create_revision.to_string()});
                let delete = json!({"request_delete_range": {"key": b64(&front.key)}});
                let (popped, resent) = self.conditional_txn(
                    vec![compare],
                    vec![delete],
                    vec![],
                    Retry::Conditional,
                    self.request_deadline(),
                )?;
                if popped.succeeded {
                    return Ok(front.value.clone());
                }
                if let Some(cause) = resent {
                    // The element is gone: our lost first copy may have taken it.
                    return Err(self.unknown("queue_pop", cause));
                }
                // Another pop took it: try the next element.
                continue;
            }
            if !block {
                return Err(StoreError::QueueEmpty);
            }
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(StoreError::Timeout {
                    ms: timeout.as_millis(),
                    keys: vec![key.to_string()],
                });
            }
            // Wait for a push after the range that found the queue empty.
            let mut stream = self
                .gateway
                .watch(
                    &[(start.clone(), end.clone())],
                    reply.header.revision.saturating_add(1),
                    self.request_deadline(),
                    started + timeout,
                )
                .map_err(|e| self.error(e))?;
            loop {
                match stream.next_reply() {
                    Some(Ok(r)) if !r.canceled && r.compact_revision == 0 => {
                        if r.events.iter().any(|e| e.is_put()) {
                            break;
                        }
                    }
                    _ => {
                        std::thread::sleep(Duration::from_millis(20));
                        break;
                    }
                }
            }
        }
    }

    fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        let (start, end) = Self::queue_range(&self.key(key)?);
        let reply = self.range(
            json!({"key": b64(&start), "range_end": b64(&end), "count_only": true}),
            self.request_deadline(),
        )?;
        Ok(reply.count)
    }

    fn list_keys(&self) -> Result<Vec<String>, StoreError> {
        Ok(self
            .user_keys()?
            .into_iter()
            .map(|k| String::from_utf8_lossy(&k).into_owned())
            .collect())
    }

    fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_timeout(&self, timeout: Duration) {
        *self.timeout.lock().unwrap_or_else(PoisonError::into_inner) = timeout;
    }

    fn clone_store(&self) -> Result<Box<dyn Store>, StoreError> {
        Ok(Box::new(self.duplicate()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        let config = EtcdConfig::parse("etcd://a:1,b:2/job/7?nodes=1:2").unwrap();
        assert_eq!(config.endpoints, vec!["a:1", "b:2"]);
        assert_eq!(config.prefix, "job/7");
        for bad in [
            "tcp://a:1/p",
            "etcd://a:1",
            "etcd://a:1/",
            "etcd://a/p",
            "etcd://a:x/p",
            "etcd://:1/p",
        ] {
            let err = EtcdConfig::parse(bad).unwrap_err();
            assert!(err.to_string().contains("etcd://HOST:PORT"), "{bad}: {err}");
        }
    }

    #[test]
    fn oversized_values_and_nul_keys_are_refused_without_a_request() {
        // Port 1 on loopback: nothing listens, and nothing is sent.
        let store = EtcdStore::new(EtcdConfig::new(vec!["127.0.0.1:1".into()], "t"));
        let big = vec![0u8; DEFAULT_MAX_REQUEST_BYTES];
        let err = store.set("k", &big).unwrap_err();
        assert!(err.to_string().contains("1572864"), "{err}");
        let err = store.set("a\0b", b"1").unwrap_err();
        assert!(err.to_string().contains("NUL"), "{err}");
        let many: Vec<String> = (0..129).map(|i| i.to_string()).collect();
        let keys: Vec<&str> = many.iter().map(String::as_str).collect();
        let err = store.multi_get(&keys).unwrap_err();
        assert!(err.to_string().contains("--max-txn-ops"), "{err}");
    }

    #[test]
    fn an_unreachable_cluster_fails_within_the_request_timeout_naming_etcd() {
        let mut config = EtcdConfig::new(vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()], "t");
        config.request_timeout = Duration::from_millis(300);
        let store = EtcdStore::new(config);
        let started = Instant::now();
        let err = store.set("k", b"v").unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(3));
        let text = err.to_string();
        assert!(
            text.contains("etcd") && text.contains("127.0.0.1:2"),
            "{text}"
        );
    }
}
