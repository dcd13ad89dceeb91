//! etcd's v3 JSON gateway over blocking HTTP/1.1: requests, replies, failover, retries.
//!
//! [`Gateway`] posts JSON to `/v3/kv/range`, `/v3/kv/txn`, `/v3/kv/deleterange` and
//! streams `/v3/watch` on one member at a time. A member that refuses the connection, or
//! answers that it cannot serve now (gRPC `Unavailable`, `ResourceExhausted`, a dropped
//! proposal), is left for the next endpoint; after a full turn over the endpoints it backs
//! off (25 ms doubling to 500 ms, jittered) until the caller's deadline. The member that
//! served last is tried first next time.
//!
//! **Tries** ([`Pace`]). When the leader dies, a member that forwarded a proposal to it
//! holds the request for etcd's own request timeout (5 s plus two election timeouts: 7 s
//! by default) before it answers "request timed out". So the first try of an idempotent
//! request lasts [`FIRST_TRY`]; if it runs out, the gateway connects to every member: if
//! one is gone, it leaves the try and goes on with short tries on the others until an
//! election must be over, and the member that knows the new leader answers
//! (`benches/etcd_failover.py` measures it); if all answer, the cluster is slow, not
//! broken, and the request is asked again of the same member and waits for etcd's answer,
//! as do the gateway's requests of the next [`PATIENCE`]. A compare-guarded transaction
//! ([`Retry::Conditional`]) always waits for etcd's answer: resent early on a cluster that
//! is slow but well, it would turn a success into an unknown outcome.
//!
//! **Resending.** A request that may have been applied (its answer was lost, or etcd timed
//! out) is resent too: callers send only idempotent requests or compare-guarded
//! transactions, and for the latter the gateway reports the lost copy so that a failed
//! compare is not taken as someone else's write. etcd's refusals of the request itself
//! (InvalidArgument and the like) fail at once.
//!
//! It knows etcd's wire format (base64 keys and values, 64-bit integers as JSON strings,
//! fields left out when zero) and nothing about the c10d store built on it.

use std::io::Read;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde::de::{DeserializeOwned, Deserializer};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::EtcdError;

/// The largest reply body read (a range of many large values).
const MAX_REPLY_BYTES: u64 = 512 << 20;
/// The first backoff after every endpoint failed once.
const BACKOFF_START: Duration = Duration::from_millis(25);
/// The longest backoff.
const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// The longest one connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the first try of an idempotent request on one member may take before the
/// gateway looks at whether a member is down.
const FIRST_TRY: Duration = Duration::from_millis(500);
/// How long etcd may take to elect a new leader: its default election timeout is 1 s,
/// randomized up to 2 s, and a member may need one more round of votes. Past it, each
/// try lasts twice as long as the one before.
const ELECTION_WINDOW: Duration = Duration::from_secs(3);
/// How long a gateway that found every member reachable behind a slow try lets later
/// requests wait for their answers without looking again.
const PATIENCE: Duration = Duration::from_secs(10);
/// How long a probe's connection to one member may take.
const PROBE_TIMEOUT: Duration = Duration::from_millis(200);

/// How a request paces its tries on the members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pace {
    /// A short first try; if it runs out, probe the members ([`Pace::after_timeout`]).
    Probe,
    /// A member is down (it refused a connection, or a probe found it gone): the leader
    /// may have died with proposals forwarded to it, so short tries until an election
    /// must be over, then each twice the one before.
    Failover,
    /// Every member is reachable and the cluster is slow: each try waits for etcd's own
    /// answer. So do compare-guarded transactions always (resent early on a cluster that
    /// is slow but well, one would turn a success into an unknown outcome).
    Whole,
}

impl Pace {
    /// How long the next try may last, `elapsed` into the request with `remaining` left,
    /// when the previous try was given `previous`.
    fn limit(self, elapsed: Duration, previous: Duration, remaining: Duration) -> Duration {
        let wanted = match self {
            Pace::Probe => FIRST_TRY,
            Pace::Failover if elapsed < ELECTION_WINDOW => FIRST_TRY,
            Pace::Failover => previous.saturating_mul(2).max(FIRST_TRY),
            Pace::Whole => remaining,
        };
        wanted.min(remaining).max(Duration::from_millis(1))
    }

    /// The pace after a try that failed at once (a refused connection, a member that
    /// cannot serve now): that member is down or lost its leader.
    fn after_refusal(self) -> Pace {
        Pace::Failover
    }

    /// The pace after a try that ran out of its time, given whether every member
    /// accepts a connection (asked only when it matters, by `all_reachable`).
    fn after_timeout(self, all_reachable: impl FnOnce() -> bool) -> Pace {
        match self {
            Pace::Probe if all_reachable() => Pace::Whole,
            Pace::Probe => Pace::Failover,
            other => other,
        }
    }
}

/// Whether a request may be sent again when its first try may have been applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Reads, puts of a fixed value, deletes: always resent.
    Idempotent,
    /// A transaction whose compare lets at most one of its copies apply (the key's
    /// `mod_revision` or `create_revision` is unchanged): resent too, but when a resent
    /// copy's compare fails, the caller cannot tell whether the lost first copy applied,
    /// so [`Gateway::call`] reports that it resent after an ambiguous failure.
    Conditional,
}

/// The endpoints of one etcd cluster and the HTTP agent (keep-alive pool) to reach them.
#[derive(Debug)]
pub(crate) struct Gateway {
    endpoints: Vec<String>,
    /// The member tried first.
    current: AtomicUsize,
    agent: ureq::Agent,
    /// HTTP requests posted (watches included), shared with [`Gateway::duplicate`]s.
    requests: Arc<AtomicU64>,
    /// Until when requests wait for etcd's own answers ([`Pace::Whole`]): set when a
    /// slow try found every member reachable.
    patient_until: Mutex<Option<Instant>>,
}

/// A base64 string of bytes.
pub(crate) fn b64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

/// The key just after every key starting with `prefix` (etcd's `range_end` for a prefix).
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: the range has no end ("\0" means "to the end" for etcd).
    vec![0]
}

pub(crate) fn int<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    // The gateway writes int64 as strings; accept numbers too.
    match Value::deserialize(d)? {
        Value::String(s) => s.parse().map_err(serde::de::Error::custom),
        Value::Number(n) => n
            .as_i64()
            .ok_or_else(|| serde::de::Error::custom("integer out of range")),
        Value::Null => Ok(0),
        other => Err(serde::de::Error::custom(format!(
            "expected an integer, got {other}"
        ))),
    }
}

fn bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let text = Option::<String>::deserialize(d)?.unwrap_or_default();
    STANDARD
        .decode(text.as_bytes())
        .map_err(serde::de::Error::custom)
}

/// A reply's header: the store's revision when it was served.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Header {
    #[serde(default, deserialize_with = "int")]
    pub(crate) revision: i64,
}

/// One key-value pair.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Kv {
    #[serde(default, deserialize_with = "bytes")]
    pub(crate) key: Vec<u8>,
    #[serde(default, deserialize_with = "bytes")]
    pub(crate) value: Vec<u8>,
    #[serde(default, deserialize_with = "int")]
    pub(crate) create_revision: i64,
    #[serde(default, deserialize_with = "int")]
    pub(crate) mod_revision: i64,
}

/// The reply to a range.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RangeReply {
    #[serde(default)]
    pub(crate) header: Header,
    #[serde(default)]
    pub(crate) kvs: Vec<Kv>,
    #[serde(default)]
    pub(crate) more: bool,
    #[serde(default, deserialize_with = "int")]
    pub(crate) count: i64,
}

/// The reply to a delete.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct DeleteReply {
    #[serde(default, deserialize_with = "int")]
    pub(crate) deleted: i64,
}

/// One operation's reply inside a transaction.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct OpReply {
    pub(crate) response_range: Option<RangeReply>,
}

/// The reply to a transaction.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct TxnReply {
    #[serde(default)]
    pub(crate) header: Header,
    #[serde(default)]
    pub(crate) succeeded: bool,
    #[serde(default)]
    pub(crate) responses: Vec<OpReply>,
}

/// One event of a watch.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Event {
    /// `PUT` is left out (it is the zero value); `DELETE` is written.
    #[serde(default, rename = "type")]
    pub(crate) kind: Option<String>,
    #[serde(default)]
    pub(crate) kv: Kv,
}

impl Event {
    pub(crate) fn is_put(&self) -> bool {
        matches!(self.kind.as_deref(), None | Some("PUT"))
    }
}

/// One message of a watch stream.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct WatchReply {
    #[serde(default)]
    pub(crate) canceled: bool,
    #[serde(default, deserialize_with = "int")]
    pub(crate) compact_revision: i64,
    #[serde(default)]
    pub(crate) events: Vec<Event>,
}

#[derive(Debug, Deserialize)]
struct WatchLine {
    result: Option<WatchReply>,
    error: Option<GatewayErrorBody>,
}

/// The gateway's error body: `{"error": ..., "message": ..., "code": N}`.
#[derive(Debug, Default, Deserialize)]
struct GatewayErrorBody {
    #[serde(default)]
    message: String,
    #[serde(default)]
    error: String,
    #[serde(default, deserialize_with = "int")]
    code: i64,
}

impl GatewayErrorBody {
    fn text(self) -> String {
        if self.message.is_empty() {
            self.error
        } else {
            self.message
        }
    }
}

/// An open watch stream: the messages one member sends.
pub(crate) struct WatchStream {
    endpoint: String,
    lines: serde_json::StreamDeserializer<
        'static,
        serde_json::de::IoRead<Box<dyn Read + Send>>,
        WatchLine,
    >,
}

impl WatchStream {
    /// The next message; `None` when the member closed the stream.
    pub(crate) fn next_reply(&mut self) -> Option<Result<WatchReply, EtcdError>> {
        let line = match self.lines.next()? {
            Ok(line) => line,
            Err(err) => {
                return Some(Err(EtcdError::BadReply {
                    endpoint: self.endpoint.clone(),
                    op: "watch",
                    detail: err.to_string(),
                }))
            }
        };
        Some(match (line.result, line.error) {
            (_, Some(err)) => Err(EtcdError::Server {
                endpoint: self.endpoint.clone(),
                op: "watch",
                code: err.code,
                status: 200,
                message: err.text(),
            }),
            (Some(reply), None) => Ok(reply),
            (None, None) => Ok(WatchReply::default()),
        })
    }
}

/// Whether `err` shows that the request never reached etcd (so any request may be retried).
fn unsent(err: &ureq::Error) -> bool {
    match err {
        ureq::Error::HostNotFound | ureq::Error::ConnectionFailed => true,
        ureq::Error::Timeout(t) => {
            matches!(t, ureq::Timeout::Connect | ureq::Timeout::Resolve)
        }
        ureq::Error::Io(io) => matches!(
            io.kind(),
            std::io::ErrorKind::ConnectionRefused
                | std::io::ErrorKind::AddrNotAvailable
                | std::io::ErrorKind::NetworkUnreachable
                | std::io::ErrorKind::HostUnreachable
        ),
        _ => false,
    }
}

/// Whether etcd refused a request before proposing it to raft, so that sending it again
/// cannot apply it twice: ResourceExhausted ("too many requests"), or Unavailable for a
/// member without a leader, not yet capable, unhealthy, or a learner.
fn refused_before_proposal(code: i64, message: &str) -> bool {
    code == 8
        // A candidate (or a follower that lost its leader) drops proposals outright; etcd
        // 3.4 passes raft's error on with code Unknown.
        || message.contains("raft proposal dropped")
        || (code == 14
            && [
                "no leader",
                "not capable",
                "unhealthy cluster",
                "not supported for learner",
            ]
            .iter()
            .any(|m| message.contains(m)))
}

/// What one try on one member came to.
enum Attempt<T> {
    Done(T),
    /// Try the next member (the error is kept as the last one).
    Next(EtcdError),
    /// Give up now.
    Fail(EtcdError),
}

impl Gateway {
    /// A gateway over `endpoints` (`host:port` each), tried in that order first.
    pub(crate) fn new(endpoints: Vec<String>) -> Gateway {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .max_idle_connections_per_host(8)
            .build()
            .into();
        Gateway {
            endpoints,
            current: AtomicUsize::new(0),
            agent,
            requests: Arc::new(AtomicU64::new(0)),
            patient_until: Mutex::new(None),
        }
    }

    /// A second handle: the same endpoints, its own connections.
    pub(crate) fn duplicate(&self) -> Gateway {
        let mut clone = Gateway::new(self.endpoints.clone());
        clone.requests = Arc::clone(&self.requests);
        clone
            .current
            .store(self.current.load(Ordering::Relaxed), Ordering::Relaxed);
        clone
    }

    /// How many HTTP requests this gateway and its duplicates have posted (each attempt
    /// counts, a watch counts once).
    pub(crate) fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// The endpoints, comma-separated.
    pub(crate) fn endpoints(&self) -> String {
        self.endpoints.join(",")
    }

    /// Whether requests now wait for etcd's own answers (see [`Pace::Whole`]).
    fn patient(&self) -> bool {
        let until = self
            .patient_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        until.is_some_and(|until| Instant::now() < until)
    }

    fn be_patient(&self) {
        *self
            .patient_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now() + PATIENCE);
    }

    /// Whether every member accepts a TCP connection within [`PROBE_TIMEOUT`].
    fn all_reachable(&self) -> bool {
        self.endpoints.iter().all(|endpoint| {
            endpoint.to_socket_addrs().is_ok_and(|mut addrs| {
                addrs.any(|addr| TcpStream::connect_timeout(&addr, PROBE_TIMEOUT).is_ok())
            })
        })
    }

    /// Runs `attempt` on one member after another, with backoff after each full turn,
    /// until it succeeds, fails for good, or `deadline` passes.
    fn with_failover<T>(
        &self,
        op: &'static str,
        retry: Retry,
        deadline: Instant,
        mut attempt: impl FnMut(&str, Duration) -> Attempt<T>,
    ) -> Result<T, EtcdError> {
        let started = Instant::now();
        let count = self.endpoints.len().max(1);
        let mut backoff = BACKOFF_START;
        let mut attempts = 0u32;
        let mut previous = Duration::ZERO;
        let mut pace = match retry {
            Retry::Conditional => Pace::Whole,
            Retry::Idempotent if self.patient() => Pace::Whole,
            Retry::Idempotent => Pace::Probe,
        };
        let mut index = self.current.load(Ordering::Relaxed) % count;
        let mut last: Option<EtcdError> = None;
        loop {
            let now = Instant::now();
            let remaining = deadline.saturating_duration_since(now);
            if remaining.is_zero() && attempts > 0 {
                break;
            }
            let Some(endpoint) = self.endpoints.get(index) else {
                break;
            };
            attempts += 1;
            let limit = pace.limit(started.elapsed(), previous, remaining);
            previous = limit;
            let tried = Instant::now();
            match attempt(endpoint, limit) {
                Attempt::Done(value) => {
                    self.current.store(index, Ordering::Relaxed);
                    return Ok(value);
                }
                Attempt::Fail(err) => return Err(err),
                Attempt::Next(err) => last = Some(err),
            }
            if tried.elapsed() + Duration::from_millis(5) < limit {
                pace = pace.after_refusal();
            } else {
                let was = pace;
                pace = pace.after_timeout(|| self.all_reachable());
                if (was, pace) == (Pace::Probe, Pace::Whole) {
                    // Slow, not gone: ask the same member again and wait for its answer.
                    self.be_patient();
                    continue;
                }
            }
            index = (index + 1) % count;
            if (attempts as usize).is_multiple_of(count) {
                let left = deadline.saturating_duration_since(Instant::now());
                let jitter = backoff.mul_f64(0.5 + fastrand::f64() * 0.5);
                std::thread::sleep(jitter.min(left));
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
        Err(EtcdError::Unavailable {
            op,
            endpoints: self.endpoints(),
            ms: started.elapsed().as_millis(),
            attempts,
            last: Box::new(last.unwrap_or(EtcdError::BadReply {
                endpoint: self.endpoints(),
                op,
                detail: "no endpoint was tried".into(),
            })),
        })
    }

    fn post(
        &self,
        endpoint: &str,
        path: &str,
        body: &[u8],
        timeout: Duration,
    ) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.agent
            .post(&format!("http://{endpoint}{path}"))
            .header("content-type", "application/json")
            .config()
            .timeout_global(Some(timeout))
            .timeout_connect(Some(timeout.min(CONNECT_TIMEOUT)))
            .build()
            .send(body)
    }

    /// Posts `body` to `path` (e.g. `/v3/kv/range`) and decodes the reply.
    pub(crate) fn call<T: DeserializeOwned>(
        &self,
        op: &'static str,
        path: &str,
        body: &Value,
        deadline: Instant,
    ) -> Result<T, EtcdError> {
        self.call_with(op, path, body, Retry::Idempotent, deadline)
            .map(|(reply, _)| reply)
    }

    /// [`Gateway::call`], also returning the failure after which the request was resent
    /// when an earlier copy may have been applied (only [`Retry::Conditional`] ones are).
    pub(crate) fn call_with<T: DeserializeOwned>(
        &self,
        op: &'static str,
        path: &str,
        body: &Value,
        retry: Retry,
        deadline: Instant,
    ) -> Result<(T, Option<EtcdError>), EtcdError> {
        let mut ambiguous: Option<EtcdError> = None;
        let body = body.to_string();
        self.with_failover(op, retry, deadline, |endpoint, timeout| {
            let transport = |source| EtcdError::Transport {
                endpoint: endpoint.to_string(),
                op,
                source,
            };
            // A failure after the request left: resend it, remembering (for a
            // conditional transaction) that the first copy may have applied.
            let mut after_send = |err: EtcdError| {
                if retry == Retry::Conditional {
                    ambiguous = Some(err.clone_for_report());
                }
                Attempt::Next(err)
            };
            let mut reply = match self.post(endpoint, path, body.as_bytes(), timeout) {
                Ok(reply) => reply,
                Err(err) if unsent(&err) => return Attempt::Next(transport(err)),
                Err(err) => return after_send(transport(err)),
            };
            let status = reply.status().as_u16();
            let text = match reply
                .body_mut()
                .with_config()
                .limit(MAX_REPLY_BYTES)
                .read_to_vec()
            {
                Ok(text) => text,
                Err(err) => return after_send(transport(err)),
            };
            let bad = |detail: String| EtcdError::BadReply {
                endpoint: endpoint.to_string(),
                op,
                detail,
            };
            if status != 200 {
                let Ok(err) = serde_json::from_slice::<GatewayErrorBody>(&text) else {
                    let shown = String::from_utf8_lossy(text.get(..200).unwrap_or(&text));
                    return after_send(bad(format!("HTTP {status}: {shown}")));
                };
                let (code, message) = (err.code, err.text());
                let refused = refused_before_proposal(code, &message);
                let err = EtcdError::Server {
                    endpoint: endpoint.to_string(),
                    op,
                    code,
                    status,
                    message,
                };
                return match code {
                    _ if refused => Attempt::Next(err),
                    // Unavailable ("request timed out", "server stopped", "leader
                    // changed") and DeadlineExceeded: the request may have been applied.
                    14 | 4 => after_send(err),
                    _ => Attempt::Fail(err),
                };
            }
            match serde_json::from_slice(&text) {
                Ok(value) => Attempt::Done(value),
                Err(err) => Attempt::Fail(bad(err.to_string())),
            }
        })
        .map(|reply| (reply, ambiguous))
    }

    /// Opens a watch stream with one `create_request` per `(key, range_end)`, all from
    /// `start_revision`, on the first member that accepts it. The stream's reads end at
    /// `deadline`.
    pub(crate) fn watch(
        &self,
        ranges: &[(Vec<u8>, Vec<u8>)],
        start_revision: i64,
        connect_deadline: Instant,
        deadline: Instant,
    ) -> Result<WatchStream, EtcdError> {
        let mut body = String::new();
        for (key, end) in ranges {
            let create = json!({"create_request": {
                "key": b64(key),
                "range_end": b64(end),
                "start_revision": start_revision.to_string(),
            }});
            body.push_str(&create.to_string());
        }
        // A watch's stream lasts until `deadline`: `connect_deadline` bounds only the
        // failover while it opens.
        self.with_failover(
            "watch",
            Retry::Idempotent,
            connect_deadline,
            |endpoint, _| {
                let timeout = deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                let transport = |source| EtcdError::Transport {
                    endpoint: endpoint.to_string(),
                    op: "watch",
                    source,
                };
                match self.post(endpoint, "/v3/watch", body.as_bytes(), timeout) {
                    Ok(reply) if reply.status().as_u16() == 200 => {
                        let reader: Box<dyn Read + Send> =
                            Box::new(reply.into_body().into_reader());
                        Attempt::Done(WatchStream {
                            endpoint: endpoint.to_string(),
                            lines: serde_json::Deserializer::from_reader(reader).into_iter(),
                        })
                    }
                    Ok(reply) => Attempt::Next(EtcdError::Server {
                        endpoint: endpoint.to_string(),
                        op: "watch",
                        code: 0,
                        status: reply.status().as_u16(),
                        message: "the watch was refused".into(),
                    }),
                    Err(err) => Attempt::Next(transport(err)),
                }
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte() {
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
    }

    #[test]
    fn a_first_try_is_short_and_a_slow_one_waits_once_every_member_answers() {
        let plenty = Duration::from_secs(600);
        let half = FIRST_TRY;
        let zero = Duration::ZERO;
        assert_eq!(Pace::Probe.limit(zero, zero, plenty), half);
        // Slow, every member reachable: the next try waits for etcd's answer.
        assert_eq!(Pace::Probe.after_timeout(|| true), Pace::Whole);
        assert_eq!(Pace::Whole.limit(zero, half, plenty), plenty);
        // Slow, a member gone: the leader may have died; short tries on the others.
        assert_eq!(Pace::Probe.after_timeout(|| false), Pace::Failover);
        // The probe is asked only where it decides something.
        let asked = |pace: Pace| pace.after_timeout(|| panic!("probed in {pace:?}"));
        assert_eq!(asked(Pace::Failover), Pace::Failover);
        assert_eq!(asked(Pace::Whole), Pace::Whole);
        assert_eq!(Pace::Probe.after_refusal(), Pace::Failover);
        assert_eq!(Pace::Whole.after_refusal(), Pace::Failover);
    }

    #[test]
    fn in_failover_tries_stay_short_through_an_election_then_double() {
        let plenty = Duration::from_secs(600);
        let half = FIRST_TRY;
        let during = ELECTION_WINDOW - Duration::from_millis(100);
        let f = Pace::Failover;
        assert_eq!(f.limit(during, half, plenty), half);
        assert_eq!(
            f.limit(ELECTION_WINDOW, half, plenty),
            Duration::from_secs(1)
        );
        assert_eq!(
            f.limit(ELECTION_WINDOW, Duration::from_secs(4), plenty),
            Duration::from_secs(8)
        );
        assert_eq!(f.limit(ELECTION_WINDOW, plenty, plenty), plenty);
        let short = Duration::from_millis(300);
        assert_eq!(
            Pace::Probe.limit(Duration::ZERO, Duration::ZERO, short),
            short
        );
        assert_eq!(
            f.limit(ELECTION_WINDOW, half, Duration::ZERO),
            Duration::from_millis(1)
        );
    }

    #[test]
    fn a_probe_finds_a_closed_port_unreachable() {
        let open = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (open_addr, closed_addr) = (open.local_addr().unwrap(), closed.local_addr().unwrap());
        drop(closed);
        let both = Gateway::new(vec![open_addr.to_string()]);
        assert!(both.all_reachable());
        let one_gone = Gateway::new(vec![open_addr.to_string(), closed_addr.to_string()]);
        assert!(!one_gone.all_reachable());
        assert!(!one_gone.patient());
        one_gone.be_patient();
        assert!(one_gone.patient());
    }

    #[test]
    fn only_refusals_before_raft_are_safe_to_resend() {
        assert!(refused_before_proposal(2, "raft proposal dropped"));
        assert!(refused_before_proposal(14, "etcdserver: no leader"));
        assert!(refused_before_proposal(8, "etcdserver: too many requests"));
        assert!(!refused_before_proposal(
            14,
            "etcdserver: request timed out"
        ));
        assert!(!refused_before_proposal(
            14,
            "etcdserver: request timed out, possibly due to previous leader failure"
        ));
        assert!(!refused_before_proposal(
            3,
            "etcdserver: request is too large"
        ));
    }

    #[test]
    fn replies_decode_with_fields_left_out() {
        let text = br#"{"header":{"revision":"7"},"responses":[{"response_range":{"header":{"revision":"7"},"kvs":[{"key":"YQ==","create_revision":"2","mod_revision":"5","version":"1","value":"MQ=="}],"count":"1"}}]}"#;
        let txn: TxnReply = serde_json::from_slice(text).unwrap();
        assert!(!txn.succeeded);
        assert_eq!(txn.header.revision, 7);
        let range = txn.responses[0].response_range.as_ref().unwrap();
        assert_eq!(range.kvs[0].key, b"a");
        assert_eq!(range.kvs[0].value, b"1");
        assert_eq!(range.kvs[0].mod_revision, 5);
        let empty: RangeReply = serde_json::from_slice(br#"{"header":{}}"#).unwrap();
        assert_eq!((empty.count, empty.kvs.len()), (0, 0));
    }

    #[test]
    fn watch_events_decode_put_and_delete() {
        let text = br#"{"result":{"events":[{"kv":{"key":"eQ=="}},{"type":"DELETE","kv":{"key":"eQ=="}}]}}"#;
        let line: WatchLine = serde_json::from_slice(text).unwrap();
        let events = line.result.unwrap().events;
        assert!(events[0].is_put());
        assert!(!events[1].is_put());
    }
}
