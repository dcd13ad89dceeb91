//! `GET /status.json` and `GET /status`: what the server holds, for a person.
//!
//! `/status.json` is the server (version, uptime, `--io` mode and loops, connections,
//! requests per second, refusals by reason, each limit with its current use), every
//! elastic run its keys hold (`rdzv_core::rendezvous::elastic::view`: round, state,
//! members with their node, rank, host and heartbeat age, waiting and struck nodes, how
//! the round formed) and the keys by prefix (the 20 prefixes holding the most bytes).
//! It shows run ids, node names, hosts, key prefixes and the reasons nodes wrote when a
//! round ended; never a value. `/status` is one HTML page, with no external asset, that
//! fetches `/status.json` every second and draws it; it holds no data itself.
//!
//! With `--token-file`, `/status.json` needs `Authorization: Bearer TOKEN` with a token
//! of the `@status` grant (or one of every key); the page asks for one and keeps it for
//! the tab (`sessionStorage`). Reading the keys takes the engine's lock for one pass
//! over them; a result is reused for [`REUSE`], so that many open pages cost one pass.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdzv_core::rendezvous::elastic::view::{ElasticView, PrefixTally};
use rdzv_core::rendezvous::elastic::Instant as CoreInstant;
use rdzv_core::store::access::AccessPolicy;
use rdzv_core::store::engine::Engine;
use serde_json::{json, Value};

use super::super::StatsCells;
use super::process;

/// How long one reading of the keys is served again.
pub(crate) const REUSE: Duration = Duration::from_millis(500);

/// How many key prefixes `/status.json` lists.
pub(crate) const TOP_PREFIXES: usize = 20;

/// The page: HTML, CSS and script in one file, no external asset.
pub(crate) const PAGE: &str = include_str!("status.html");

/// What the status page reads: the server's facts and, once its loops started, the
/// engine.
pub(crate) struct StatusSource {
    /// The `--io` mode the loops run on (`io_uring`, `epoll`).
    pub(crate) io: &'static str,
    /// How many loops.
    pub(crate) loops: usize,
    /// Who may read it.
    pub(crate) access: AccessPolicy,
    /// The loops' counters (and the last published engine figures).
    pub(crate) stats: Arc<StatsCells>,
    /// When the server started.
    pub(crate) started: Instant,
    /// What earlier readings left.
    last: Mutex<Reading>,
}

/// What one reading remembers for the next.
#[derive(Default)]
struct Reading {
    view: ElasticView,
    /// When, the requests served by then, and the answer.
    at: Option<(Instant, u64, Arc<String>)>,
    /// Requests per second between the two last readings.
    rate: Option<f64>,
}

/// The engine's side of a reading, taken under its lock.
struct EngineFacts {
    elastic: Vec<(Vec<u8>, Vec<u8>)>,
    tally: PrefixTally,
    largest_value: usize,
    held_bytes: usize,
    budget: rdzv_core::store::budget::Budget,
}

fn engine_facts(engine: &Engine) -> EngineFacts {
    let mut tally = PrefixTally::default();
    let mut elastic = Vec::new();
    let mut largest_value = 0;
    for (key, value) in engine.entries() {
        tally.add(key, value.len());
        largest_value = largest_value.max(value.len());
        let bare = key.strip_prefix(b"/").unwrap_or(key);
        if bare.starts_with(b"rdzv.elastic.") {
            elastic.push((key.to_vec(), value.to_vec()));
        }
    }
    EngineFacts {
        elastic,
        tally,
        largest_value,
        held_bytes: engine.held_bytes(),
        budget: *engine.budget(),
    }
}

impl StatusSource {
    /// The status of a server started at `started` on `loops` loops of `io`.
    pub(crate) fn new(
        io: &'static str,
        loops: usize,
        access: AccessPolicy,
        stats: Arc<StatsCells>,
        started: Instant,
    ) -> StatusSource {
        StatusSource {
            io,
            loops,
            access,
            stats,
            started,
            last: Mutex::new(Reading::default()),
        }
    }

    /// Whether the `Authorization` header's value `header` may read the status.
    pub(crate) fn allows(&self, header: Option<&[u8]>) -> bool {
        // The scheme is case-insensitive (RFC 9110, 11.1).
        let token = header
            .filter(|h| {
                h.get(..7)
                    .is_some_and(|s| s.eq_ignore_ascii_case(b"bearer "))
            })
            .and_then(|h| h.get(7..))
            .map(<[u8]>::trim_ascii);
        self.access.grants_status(token)
    }

    /// `/status.json`'s body at `now`.
    pub(crate) fn json(&self, now: Instant) -> Arc<String> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, _, body)) = &last.at {
            if now.saturating_duration_since(*at) < REUSE {
                return Arc::clone(body);
            }
        }
        let metrics = self.stats.metrics.as_ref();
        let mut facts = None;
        if let Some(metrics) = metrics {
            metrics.read_engine(&mut |engine| facts = Some(engine_facts(engine)));
        }
        let stats = metrics.map(super::Metrics::snapshot).unwrap_or_default();
        let requests: u64 = stats.requests.iter().sum();
        if let Some((at, before, _)) = &last.at {
            let secs = now.saturating_duration_since(*at).as_secs_f64();
            if secs > 0.0 {
                last.rate = Some(requests.saturating_sub(*before) as f64 / secs);
            }
        }
        let since_start = now.saturating_duration_since(self.started);
        let core_now = CoreInstant::from_duration(since_start);
        let (runs, prefixes, totals) = match &facts {
            Some(facts) => {
                let pairs: Vec<(&[u8], &[u8])> = facts
                    .elastic
                    .iter()
                    .map(|(k, v)| (k.as_slice(), v.as_slice()))
                    .collect();
                let runs = last.view.observe(&pairs, core_now);
                (runs, facts.tally.top(TOP_PREFIXES), facts.tally.totals())
            }
            None => (Vec::new(), Vec::new(), (0, 0)),
        };
        let cells = &self.stats;
        let load =
            |cell: &std::sync::atomic::AtomicUsize| cell.load(std::sync::atomic::Ordering::Relaxed);
        let (open_fds, max_fds) = process::descriptors();
        let limits = match &facts {
            Some(f) => json!([
                limit(
                    "--max-store-bytes",
                    f.budget.max_store_bytes,
                    Some(f.held_bytes),
                    "bytes the store holds"
                ),
                limit(
                    "--max-value-bytes",
                    f.budget.max_value_bytes,
                    Some(f.largest_value),
                    "the largest value held"
                ),
                limit(
                    "--max-conn-bytes",
                    f.budget.max_conn_bytes,
                    None,
                    "per connection; not tracked server-wide"
                ),
                limit_opt(
                    "descriptors",
                    max_fds,
                    open_fds,
                    "open file descriptors (RLIMIT_NOFILE)"
                ),
            ]),
            None => json!([limit_opt(
                "descriptors",
                max_fds,
                open_fds,
                "open file descriptors (RLIMIT_NOFILE)"
            )]),
        };
        let body = json!({
            "schema": 1,
            "server": {
                "version": env!("CARGO_PKG_VERSION"),
                "uptime_s": since_start.as_secs_f64(),
                "io": self.io,
                "loops": self.loops,
                "connections": load(&cells.connections),
                "keys": load(&cells.keys),
                "waiters": load(&cells.waiters),
                "requests_total": requests,
                "requests_per_second": last.rate,
                "bytes_in": stats.bytes_in,
                "bytes_out": stats.bytes_out,
                "refusals": {
                    "peers": stats.refused_peers,
                    "tokens": stats.refused_tokens,
                    "requests": stats.refused_requests,
                },
                "tokens_required": self.access.requires_tokens(),
                "limits": limits,
            },
            "runs": runs,
            "keys": {
                "total": totals.0,
                "bytes": totals.1,
                "top_prefixes": prefixes,
            },
        });
        let body = Arc::new(body.to_string());
        last.at = Some((now, requests, Arc::clone(&body)));
        body
    }
}

fn limit(name: &str, limit: usize, in_use: Option<usize>, what: &str) -> Value {
    json!({ "name": name, "limit": limit, "in_use": in_use, "what": what })
}

fn limit_opt(name: &str, limit: Option<u64>, in_use: Option<usize>, what: &str) -> Value {
    json!({ "name": name, "limit": limit, "in_use": in_use, "what": what })
}
