//! A rendezvous storm: N ranks connect at once, join, and wait for the last one.
//!
//! Each rank does what a PyTorch rank does when a job starts: connect, `VALIDATE`,
//! `PING`, `ADD(counter, 1)`; the rank whose `ADD` returns N sets `done`; every rank then
//! `WAIT`s for `done`. The run ends when every rank has been released (or at the
//! timeout). The ranks are dealt round-robin to a few client threads (default: one per
//! core the process may use), each opening its share of sockets at once and driving them
//! with one `epoll` loop (`mio`). So the client costs a few microseconds per rank, 16384
//! ranks cost 16384 sockets and not 16384 threads, and what is measured is the server's
//! accept path and its wake-up fan-out.
//!
//! A connection that fails before its `ADD` was sent (refused, reset by a full listen
//! queue) is retried with exponential backoff, as PyTorch's client does, and counted.
//! One that fails after its `ADD` was sent is a failed rank: whether the server counted
//! it is unknown, so it is not retried. The `ADD` results must be exactly 1..=N, each
//! once, whichever thread saw them (the threads share one table of atomics).
//!
//! Once every rank is released it reads the counter back ([`read_counter`]). It does not
//! decide how results are shown.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use rdzv_core::store::codec::{Limits, ResponseView};
use rdzv_core::store::{KeyList, Request, WaitResponse};

use super::conn::{one_key_list, Fill, Reactor, Reply, StoreConn};
use super::latency::BlockingConn;
use super::report::StormResult;
use super::{new_histogram, BenchError};

/// How long reading the counter back may take to connect, and each reply.
const READ_BACK_TIMEOUT: Duration = Duration::from_secs(10);

/// What one storm does.
#[derive(Debug, Clone)]
pub(super) struct StormPlan {
    /// The store.
    pub addr: SocketAddr,
    /// Ranks (concurrent connections).
    pub ranks: usize,
    /// Client threads the ranks are dealt to (at least 1, at most `ranks`).
    pub threads: usize,
    /// Give up on ranks not released by then.
    pub timeout: Duration,
    /// The counter is `{key_prefix}/counter`, the release key `{key_prefix}/done`.
    pub key_prefix: String,
    /// The store's name in the result.
    pub label: String,
}

impl StormPlan {
    /// The key every rank adds 1 to.
    pub(super) fn counter_key(&self) -> String {
        format!("{}/counter", self.key_prefix)
    }

    fn done_key(&self) -> String {
        format!("{}/done", self.key_prefix)
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the backoff to pass before (re)connecting.
    #[default]
    Backoff,
    /// Connecting, then `VALIDATE` + `PING` sent.
    Connecting,
    /// `ADD` sent: from here on a failure is not retried.
    Adding,
    /// `WAIT(done)` sent.
    Waiting,
    Released,
    Failed,
}

#[derive(Debug, Default)]
struct Rank {
    /// The rank's number in the whole storm (its `PING` nonce); its slot in its thread's
    /// table is its `mio` token.
    index: usize,
    conn: Option<StoreConn>,
    phase: Phase,
    attempts: u32,
}

/// What the client threads share: the `ADD` results seen, and counters for progress and
/// the outcome. Each is touched once or twice per rank, so contention is negligible.
#[derive(Default)]
struct Shared {
    /// `seen_add[v - 1]`: some rank's `ADD` returned `v`.
    seen_add: Vec<AtomicBool>,
    /// Some `ADD` result was out of range or seen twice.
    add_result_wrong: AtomicBool,
    connected: AtomicUsize,
    released: AtomicUsize,
    failed: AtomicUsize,
    retries: AtomicU64,
    first_error: Mutex<Option<String>>,
    /// The next local port a rank's socket binds (see [`Shared::local_port`]).
    next_port: AtomicU32,
}

/// The first local port a storm binds. A storm's sockets bind ports of their own,
/// counting up from here (skipping those taken), instead of leaving the choice to
/// `connect`: the kernel's search of the ephemeral range tries one parity of ports first
/// (Linux 4.2), and once those are all taken, every later connect walks them all. On
/// the development VM (range 32768-60999, 14,116 even ports) that made a 16,384-rank
/// storm's client spend 4.7 s in the kernel against 0.5 s for 8,192 ranks: the client's
/// cost, not the server's. A rank of a real job connects from a host of its own.
const FIRST_LOCAL_PORT: u32 = 10_000;

impl Shared {
    /// A local port for the next socket, or `None` once every port up to 65535 was
    /// handed out (then the kernel chooses).
    fn local_port(&self) -> Option<u16> {
        let port = FIRST_LOCAL_PORT + self.next_port.fetch_add(1, Ordering::Relaxed);
        u16::try_from(port).ok()
    }

    /// Records `ADD`'s result `value`: it must be in 1..=N and seen by no other rank.
    fn check_add(&self, value: i64) {
        let slot = usize::try_from(value)
            .ok()
            .and_then(|v| v.checked_sub(1))
            .and_then(|i| self.seen_add.get(i));
        let fresh = slot.is_some_and(|seen| !seen.swap(true, Ordering::Relaxed));
        if !fresh {
            self.add_result_wrong.store(true, Ordering::Relaxed);
        }
    }

    fn note_error(&self, message: String) {
        if let Ok(mut first) = self.first_error.lock() {
            first.get_or_insert(message);
        }
    }
}

/// What one client thread measured.
struct ThreadOutcome {
    /// When its last rank was released, if any was.
    last_release: Option<Instant>,
    /// When the storm's last rank to connect did, if this thread saw it.
    all_connected: Option<Instant>,
    release_ns: Histogram<u64>,
}

/// One client thread's share of the storm and its `epoll` loop.
struct Storm<'p> {
    plan: &'p StormPlan,
    shared: &'p Shared,
    keys: &'p Keys,
    ranks: Vec<Rank>,
    /// Ranks of this thread released or failed.
    finished: usize,
    backoff: BinaryHeap<Reverse<(Instant, usize)>>,
    start: Instant,
    outcome: ThreadOutcome,
}

/// Runs the storm and returns what it measured. Errors only for local failures
/// (`epoll`, a panicked thread); a rank's failures are counted in the outcome. The
/// progress bar follows the released ranks, its message the connected ones.
pub(super) fn run(plan: &StormPlan, progress: &ProgressBar) -> Result<StormResult, BenchError> {
    let ranks = plan.ranks;
    let threads = plan.threads.clamp(1, ranks.max(1));
    let done = plan.done_key().into_bytes();
    let keys = Keys {
        counter: plan.counter_key().into_bytes(),
        done_list: one_key_list(&done),
        done,
    };
    let shared = Shared {
        seen_add: (0..ranks).map(|_| AtomicBool::new(false)).collect(),
        ..Shared::default()
    };
    progress.set_length(ranks as u64);

    let start = Instant::now();
    let results: Vec<Result<ThreadOutcome, BenchError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|thread| {
                let (shared, keys) = (&shared, &keys);
                let share: Vec<usize> = (thread..ranks).step_by(threads).collect();
                std::thread::Builder::new()
                    .name(format!("storm-{thread}"))
                    .spawn_scoped(scope, move || {
                        Storm::new(plan, shared, keys, share, start)?.drive()
                    })
            })
            .collect();
        follow(&handles, &shared, progress);
        handles
            .into_iter()
            .map(|handle| match handle {
                Ok(handle) => handle
                    .join()
                    .unwrap_or(Err(BenchError::ClientThreadPanicked)),
                Err(source) => Err(BenchError::io("start a storm client thread")(source)),
            })
            .collect()
    });
    outcome(plan, threads, start, shared, results)
}

/// The keys every rank uses.
struct Keys {
    counter: Vec<u8>,
    done: Vec<u8>,
    /// `done` as an encoded one-key list, for `WAIT`.
    done_list: Vec<u8>,
}

/// Follows the shared counters on `progress` until every thread is done.
fn follow<T>(
    handles: &[std::io::Result<std::thread::ScopedJoinHandle<'_, T>>],
    shared: &Shared,
    progress: &ProgressBar,
) {
    loop {
        let done = handles
            .iter()
            .all(|h| h.as_ref().map_or(true, |h| h.is_finished()));
        progress.set_position(shared.released.load(Ordering::Relaxed) as u64);
        progress.set_message(format!(
            "connected {}",
            shared.connected.load(Ordering::Relaxed)
        ));
        if done {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The storm's result from the threads' and the shared counters, with the counter read
/// back.
fn outcome(
    plan: &StormPlan,
    threads: usize,
    start: Instant,
    shared: Shared,
    results: Vec<Result<ThreadOutcome, BenchError>>,
) -> Result<StormResult, BenchError> {
    let mut release_ns = new_histogram()?;
    let mut last_release = None;
    let mut all_connected = None;
    for result in results {
        let outcome = result?;
        release_ns
            .add(&outcome.release_ns)
            .map_err(|e| BenchError::Histogram(format!("{e:?}")))?;
        last_release = last_release.max(outcome.last_release);
        all_connected = all_connected.or(outcome.all_connected);
    }
    let released = shared.released.load(Ordering::Relaxed);
    let failed = shared.failed.load(Ordering::Relaxed);
    let pending = plan.ranks.saturating_sub(released + failed);
    if pending > 0 {
        shared.note_error(format!(
            "{pending} ranks were not released within {:.1} s",
            plan.timeout.as_secs_f64()
        ));
    }
    let end = last_release.unwrap_or_else(Instant::now);
    let counter =
        read_counter(plan.addr, &plan.counter_key(), READ_BACK_TIMEOUT).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot read the storm counter back");
            None
        });
    let adds_ok = !shared.add_result_wrong.load(Ordering::Relaxed)
        && shared
            .seen_add
            .iter()
            .all(|seen| seen.load(Ordering::Relaxed));
    Ok(StormResult {
        target: plan.label.clone(),
        ranks: plan.ranks,
        client_threads: threads,
        seconds: if pending > 0 {
            plan.timeout.as_secs_f64()
        } else {
            end.duration_since(start).as_secs_f64()
        },
        all_connected_seconds: all_connected.map(|t| t.duration_since(start).as_secs_f64()),
        released,
        failed: failed + pending,
        connect_retries: shared.retries.load(Ordering::Relaxed),
        counter,
        counter_ok: adds_ok && counter == i64::try_from(plan.ranks).ok(),
        release_p50_seconds: release_ns.value_at_quantile(0.5) as f64 / 1e9,
        release_p99_seconds: release_ns.value_at_quantile(0.99) as f64 / 1e9,
        first_error: shared.first_error.into_inner().ok().flatten(),
    })
}

impl<'p> Storm<'p> {
    /// One thread's share: the ranks `share`, all waiting to connect.
    fn new(
        plan: &'p StormPlan,
        shared: &'p Shared,
        keys: &'p Keys,
        share: Vec<usize>,
        start: Instant,
    ) -> Result<Storm<'p>, BenchError> {
        Ok(Storm {
            plan,
            shared,
            keys,
            ranks: share
                .into_iter()
                .map(|index| Rank {
                    index,
                    ..Rank::default()
                })
                .collect(),
            finished: 0,
            backoff: BinaryHeap::new(),
            start,
            outcome: ThreadOutcome {
                last_release: None,
                all_connected: None,
                release_ns: new_histogram()?,
            },
        })
    }
}

/// Backoff before reconnect attempt `attempt` (1-based) of rank `index`: 10 ms doubling
/// to 1 s, with a jitter of up to a quarter, spread by rank so retries do not re-storm.
fn backoff_delay(index: usize, attempt: u32) -> Duration {
    let base_ms = 10u64
        .saturating_mul(1 << attempt.saturating_sub(1).min(7))
        .min(1000);
    // A cheap deterministic spread (Knuth's multiplicative hash of the rank).
    let spread = (index as u64).wrapping_mul(2_654_435_761) % 1000;
    let jitter_us = base_ms * 250 * spread / 1000;
    Duration::from_millis(base_ms) + Duration::from_micros(jitter_us)
}

impl Storm<'_> {
    /// Opens every connection of this share at once and runs the `epoll` loop until each
    /// rank is released or failed, or the timeout passes.
    fn drive(mut self) -> Result<ThreadOutcome, BenchError> {
        let mut reactor = Reactor::new(4096)?;
        for slot in 0..self.ranks.len() {
            self.start_connect(&reactor, slot);
        }
        let deadline = self.start + self.plan.timeout;
        while self.finished < self.ranks.len() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let mut wait = (deadline - now).min(Duration::from_millis(50));
            if let Some(Reverse((due, _))) = self.backoff.peek() {
                wait = wait.min(due.saturating_duration_since(now));
            }
            for event in reactor.wait(wait)? {
                self.on_event(event.token().0);
            }
            let now = Instant::now();
            while let Some(Reverse((due, slot))) = self.backoff.peek().copied() {
                if due > now {
                    break;
                }
                self.backoff.pop();
                self.start_connect(&reactor, slot);
            }
        }
        Ok(self.outcome)
    }

    fn start_connect(&mut self, reactor: &Reactor, slot: usize) {
        let addr = self.plan.addr;
        let nonce = self.ranks.get(slot).map(|rank| rank.index as u32);
        match self.connect(reactor, slot, nonce) {
            Ok(conn) => {
                if let Some(rank) = self.ranks.get_mut(slot) {
                    rank.conn = Some(conn);
                    rank.phase = Phase::Connecting;
                }
            }
            Err(e) => self.retry(slot, format!("connect to {addr}: {e}")),
        }
    }

    /// A connection for rank `slot`, from a port of its own ([`Shared::local_port`];
    /// taken ones are skipped), or from one the kernel chooses once the ports run out.
    fn connect(
        &self,
        reactor: &Reactor,
        slot: usize,
        nonce: Option<u32>,
    ) -> std::io::Result<StoreConn> {
        let addr = self.plan.addr;
        while let Some(port) = self.shared.local_port() {
            match StoreConn::connect_from(addr, port, Limits::default(), nonce) {
                Ok(mut conn) => {
                    reactor.register(&mut conn, slot)?;
                    return Ok(conn);
                }
                // Taken (bound, or the same four-tuple still open elsewhere).
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::AddrInUse | std::io::ErrorKind::AddrNotAvailable
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(e),
            }
        }
        reactor.connect(addr, Limits::default(), nonce, slot)
    }

    /// A failure before `ADD`: close and try again after a backoff.
    fn retry(&mut self, slot: usize, why: String) {
        let Some(rank) = self.ranks.get_mut(slot) else {
            return;
        };
        rank.conn = None;
        rank.phase = Phase::Backoff;
        rank.attempts = rank.attempts.saturating_add(1);
        let (index, attempts) = (rank.index, rank.attempts);
        let delay = backoff_delay(index, attempts);
        self.shared.retries.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(rank = index, attempt = attempts, %why, "storm: retrying connect");
        self.shared
            .note_error(format!("rank {index} (retried): {why}"));
        self.backoff.push(Reverse((Instant::now() + delay, slot)));
    }

    /// A failure after `ADD` was sent: the rank is lost.
    fn fail(&mut self, slot: usize, why: String) {
        let Some(rank) = self.ranks.get_mut(slot) else {
            return;
        };
        rank.conn = None;
        rank.phase = Phase::Failed;
        let index = rank.index;
        self.finished += 1;
        self.shared.failed.fetch_add(1, Ordering::Relaxed);
        self.shared.note_error(format!("rank {index}: {why}"));
    }

    /// A socket error: retried before `ADD`, fatal after.
    fn lose(&mut self, slot: usize, why: String) {
        match self.ranks.get(slot).map(|r| r.phase) {
            Some(Phase::Connecting) => self.retry(slot, why),
            Some(Phase::Adding | Phase::Waiting) => self.fail(slot, why),
            _ => {}
        }
    }

    fn on_event(&mut self, slot: usize) {
        let Some(conn) = self.ranks.get_mut(slot).and_then(|r| r.conn.as_mut()) else {
            return;
        };
        let closed = match conn.pump() {
            Ok(None) => return,
            Ok(Some(fill)) => fill == Fill::Closed,
            Err(e) => return self.lose(slot, e.to_string()),
        };
        // Replies that arrived before a close still count.
        loop {
            let Some(conn) = self.ranks.get_mut(slot).and_then(|r| r.conn.as_mut()) else {
                return;
            };
            match conn.next_reply() {
                Ok(Some(reply)) => self.on_reply(slot, reply),
                Ok(None) => break,
                Err(e) => return self.lose(slot, e.to_string()),
            }
        }
        if closed {
            self.lose(slot, "the server closed the connection".into());
        }
    }

    fn on_reply(&mut self, slot: usize, reply: Reply) {
        let total = self.plan.ranks;
        let Some(rank) = self.ranks.get_mut(slot) else {
            return;
        };
        let (phase, index) = (rank.phase, rank.index);
        let Some(conn) = rank.conn.as_mut() else {
            return;
        };
        match (phase, reply) {
            (Phase::Connecting, Reply::Pong(nonce)) if nonce == index as u32 => {
                conn.queue(&Request::Add {
                    key: &self.keys.counter,
                    delta: 1,
                });
                rank.phase = Phase::Adding;
                if self.shared.connected.fetch_add(1, Ordering::Relaxed) + 1 == total {
                    self.outcome.all_connected = Some(Instant::now());
                }
            }
            (Phase::Adding, Reply::Int(value)) => {
                self.shared.check_add(value);
                if value == total as i64 {
                    conn.queue(&Request::Set {
                        key: &self.keys.done,
                        value: b"1",
                    });
                }
                match KeyList::new(1, &self.keys.done_list) {
                    Some(keys) => conn.queue(&Request::Wait { keys }),
                    None => return self.fail(slot, "cannot encode the WAIT key".into()),
                }
                rank.phase = Phase::Waiting;
            }
            (Phase::Waiting, Reply::Wait(WaitResponse::StopWaiting)) => {
                // The connection stays open, as a real rank's store connection does,
                // until the storm is over.
                rank.phase = Phase::Released;
                let now = Instant::now();
                self.finished += 1;
                self.shared.released.fetch_add(1, Ordering::Relaxed);
                self.outcome.last_release = Some(now);
                let ns =
                    u64::try_from(now.duration_since(self.start).as_nanos()).unwrap_or(u64::MAX);
                self.outcome.release_ns.saturating_record(ns.max(1));
                return;
            }
            (phase, reply) => {
                return self.lose(
                    slot,
                    format!("unexpected reply {reply:?} in phase {phase:?}"),
                );
            }
        }
        if let Err(e) = conn.flush() {
            self.lose(slot, format!("send: {e}"));
        }
    }
}

/// Reads the counter `key` back over a fresh blocking connection: `VALIDATE`, `GET`.
/// `None` if the key holds something that is not a decimal number.
pub(super) fn read_counter(
    addr: SocketAddr,
    key: &str,
    timeout: Duration,
) -> Result<Option<i64>, BenchError> {
    let mut conn = BlockingConn::connect(addr, timeout, "configure the verifying connection")?;
    let get = Request::Get {
        key: key.as_bytes(),
    };
    let counter = conn.request(&get, |view| match view {
        ResponseView::Value(value) => Some(
            std::str::from_utf8(value)
                .ok()
                .and_then(|text| text.trim().parse().ok()),
        ),
        _ => None,
    })?;
    counter.ok_or(BenchError::UnexpectedReply {
        query: "GET",
        expected: "a value",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_a_second_with_bounded_jitter() {
        assert!(backoff_delay(0, 1) >= Duration::from_millis(10));
        assert!(backoff_delay(0, 1) < Duration::from_millis(13));
        for index in 0..100 {
            for attempt in 1..40 {
                let d = backoff_delay(index, attempt);
                assert!(d >= Duration::from_millis(10), "{d:?}");
                assert!(d <= Duration::from_millis(1250), "{d:?}");
            }
        }
        assert!(backoff_delay(3, 5) > backoff_delay(3, 2));
    }

    #[test]
    fn a_storm_over_two_client_threads_releases_every_rank_and_counts_exactly() {
        // 256 ranks and the embedded server's 256 sockets: more than a default soft
        // limit of 1024 leaves once the other tests' sockets are counted.
        let _ = rlimit::increase_nofile_limit(4096);
        let server = match rdzv_uring::StoreServer::start(rdzv_uring::ServerOptions {
            host: Some("127.0.0.1".into()),
            port: 0,
            ..rdzv_uring::ServerOptions::default()
        }) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("SKIP: cannot start the io_uring store server here: {e}");
                return;
            }
        };
        let plan = StormPlan {
            addr: server.local_addr(),
            ranks: 256,
            threads: 2,
            timeout: Duration::from_secs(30),
            key_prefix: "/bench-test/storm".into(),
            label: "rdzv".into(),
        };
        let outcome = run(&plan, &ProgressBar::hidden()).unwrap();
        assert_eq!(outcome.client_threads, 2);
        assert_eq!(outcome.released, 256, "{:?}", outcome.first_error);
        assert_eq!(outcome.failed, 0);
        assert!(outcome.counter_ok && outcome.succeeded());
        assert!(outcome.all_connected_seconds.is_some());
        assert_eq!(outcome.counter, Some(256));
        assert!(outcome.release_p99_seconds > 0.0);
        let counter = read_counter(
            server.local_addr(),
            &plan.counter_key(),
            Duration::from_secs(5),
        );
        assert_eq!(counter.unwrap(), Some(256));
        server.shutdown();
    }

    #[test]
    fn more_threads_than_ranks_run_one_rank_each() {
        let server = match rdzv_uring::StoreServer::start(rdzv_uring::ServerOptions {
            host: Some("127.0.0.1".into()),
            port: 0,
            ..rdzv_uring::ServerOptions::default()
        }) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("SKIP: cannot start the io_uring store server here: {e}");
                return;
            }
        };
        let plan = StormPlan {
            addr: server.local_addr(),
            ranks: 3,
            threads: 8,
            timeout: Duration::from_secs(20),
            key_prefix: "/bench-test/storm3".into(),
            label: "rdzv".into(),
        };
        let outcome = run(&plan, &ProgressBar::hidden()).unwrap();
        assert_eq!(outcome.client_threads, 3);
        assert_eq!(outcome.released, 3, "{:?}", outcome.first_error);
        assert!(outcome.counter_ok);
        server.shutdown();
    }

    #[test]
    fn a_storm_against_nothing_times_out_and_says_why() {
        // Bind then drop a listener: its port refuses connections.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let plan = StormPlan {
            addr,
            ranks: 3,
            threads: 2,
            timeout: Duration::from_millis(150),
            key_prefix: "/x".into(),
            label: "nothing".into(),
        };
        let outcome = run(&plan, &ProgressBar::hidden()).unwrap();
        assert_eq!(outcome.released, 0);
        assert_eq!(outcome.failed, 3);
        assert!(outcome.connect_retries >= 3);
        assert!(!outcome.counter_ok);
        assert!(outcome.first_error.is_some());
    }
}
