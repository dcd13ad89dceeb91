//! A rendezvous storm: N ranks connect at once, join, and wait for the last one.
//!
//! Each rank does what a PyTorch rank does when a job starts: connect, `VALIDATE`,
//! `PING`, `ADD(counter, 1)`; the rank whose `ADD` returns N sets `done`; every rank then
//! `WAIT`s for `done`. The run ends when every rank has been released (or at the
//! timeout). All N sockets are opened at once from one thread with one `epoll` loop
//! (`mio`), so the client costs a few microseconds per rank and what is measured is the
//! server's accept path and its wake-up fan-out, not 4096 client threads.
//!
//! A connection that fails before its `ADD` was sent (refused, reset by a full listen
//! queue) is retried with exponential backoff, as PyTorch's client does, and counted.
//! One that fails after its `ADD` was sent is a failed rank: whether the server counted
//! it is unknown, so it is not retried. The `ADD` results must be exactly 1..=N, each once.
//!
//! It does not read the counter back (see [`read_counter`], run by the caller) or decide
//! how results are shown.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use mio::{Events, Interest, Poll, Token};
use rdzv_core::store::codec::{self, Decoded, Limits, PendingReply, ResponseView};
use rdzv_core::store::{KeyList, QueryType, Request, WaitResponse, VALIDATION_MAGIC};

use super::conn::{Fill, Reply, StoreConn};
use super::{new_histogram, BenchError};

/// What one storm does.
#[derive(Debug, Clone)]
pub(super) struct StormPlan {
    /// The store.
    pub addr: SocketAddr,
    /// Ranks (concurrent connections).
    pub ranks: usize,
    /// Give up on ranks not released by then.
    pub timeout: Duration,
    /// The counter is `{key_prefix}/counter`, the release key `{key_prefix}/done`.
    pub key_prefix: String,
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

/// What one storm measured.
#[derive(Debug)]
pub(super) struct StormOutcome {
    /// From the first connect to the last release (or to the timeout), seconds.
    pub seconds: f64,
    /// From the first connect until every rank had its `PING` answered, if they all did.
    pub all_connected_seconds: Option<f64>,
    /// Ranks that got `STOP_WAITING`.
    pub released: usize,
    /// Ranks that failed after sending `ADD`, or were still pending at the timeout.
    pub failed: usize,
    /// Connection attempts that failed before `ADD` and were retried.
    pub connect_retries: u64,
    /// Whether the `ADD` results were exactly 1..=N, each once.
    pub add_results_ok: bool,
    /// The first error a rank hit, if any, for the report.
    pub first_error: Option<String>,
    /// For each released rank, seconds from the start to its release, in nanoseconds.
    pub release_ns: Histogram<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the backoff to pass before (re)connecting.
    Backoff,
    Connecting,
    /// `VALIDATE` + `PING` sent.
    Validating,
    /// `ADD` sent: from here on a failure is not retried.
    Adding,
    /// `WAIT(done)` sent.
    Waiting,
    Released,
    Failed,
}

#[derive(Debug)]
struct Rank {
    conn: Option<StoreConn>,
    phase: Phase,
    attempts: u32,
}

/// Shared state of the storm loop.
struct Storm<'p> {
    plan: &'p StormPlan,
    counter_key: Vec<u8>,
    done_key: Vec<u8>,
    /// `done_key` as an encoded one-key list, for `WAIT`.
    done_list: Vec<u8>,
    ranks: Vec<Rank>,
    seen_add: Vec<bool>,
    add_results_ok: bool,
    connected: usize,
    released: usize,
    failed: usize,
    retries: u64,
    first_error: Option<String>,
    backoff: BinaryHeap<Reverse<(Instant, usize)>>,
    start: Instant,
    all_connected: Option<Instant>,
    last_release: Option<Instant>,
    release_ns: Histogram<u64>,
}

/// Runs the storm and returns what it measured. Errors only for local failures
/// (`epoll`); a rank's failures are counted in the outcome.
pub(super) fn run(plan: &StormPlan, progress: &ProgressBar) -> Result<StormOutcome, BenchError> {
    let io = |what| move |source| BenchError::Io { what, source };
    let mut poll = Poll::new().map_err(io("create an epoll instance"))?;
    let done_key = plan.done_key().into_bytes();
    let mut done_list = Vec::with_capacity(8 + done_key.len());
    done_list.extend_from_slice(&(done_key.len() as u64).to_le_bytes());
    done_list.extend_from_slice(&done_key);
    let mut storm = Storm {
        plan,
        counter_key: plan.counter_key().into_bytes(),
        done_key,
        done_list,
        ranks: (0..plan.ranks)
            .map(|_| Rank {
                conn: None,
                phase: Phase::Backoff,
                attempts: 0,
            })
            .collect(),
        seen_add: vec![false; plan.ranks],
        add_results_ok: true,
        connected: 0,
        released: 0,
        failed: 0,
        retries: 0,
        first_error: None,
        backoff: BinaryHeap::new(),
        start: Instant::now(),
        all_connected: None,
        last_release: None,
        release_ns: new_histogram()?,
    };
    progress.set_length(plan.ranks as u64);

    storm.start = Instant::now();
    for index in 0..plan.ranks {
        storm.start_connect(&poll, index);
    }
    let deadline = storm.start + plan.timeout;
    let mut events = Events::with_capacity(4096);
    let mut last_progress = storm.start;
    while storm.released + storm.failed < plan.ranks {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let mut wait = (deadline - now).min(Duration::from_millis(50));
        if let Some(Reverse((due, _))) = storm.backoff.peek() {
            wait = wait.min(due.saturating_duration_since(now));
        }
        super::conn::poll_events(&mut poll, &mut events, Some(wait))
            .map_err(io("wait for socket events"))?;
        for event in events.iter() {
            storm.on_event(event.token().0);
        }
        let now = Instant::now();
        while let Some(Reverse((due, index))) = storm.backoff.peek().copied() {
            if due > now {
                break;
            }
            storm.backoff.pop();
            storm.start_connect(&poll, index);
        }
        if now.duration_since(last_progress) >= Duration::from_millis(100) {
            progress.set_position(storm.released as u64);
            progress.set_message(format!("connected {}", storm.connected));
            last_progress = now;
        }
    }
    progress.set_position(storm.released as u64);
    let end = storm.last_release.unwrap_or_else(Instant::now);
    let pending = plan.ranks - storm.released - storm.failed;
    if pending > 0 {
        storm.note_error(format!(
            "{pending} ranks were not released within {:.1} s",
            plan.timeout.as_secs_f64()
        ));
    }
    Ok(StormOutcome {
        seconds: if pending > 0 {
            plan.timeout.as_secs_f64()
        } else {
            end.duration_since(storm.start).as_secs_f64()
        },
        all_connected_seconds: storm
            .all_connected
            .map(|t| t.duration_since(storm.start).as_secs_f64()),
        released: storm.released,
        failed: storm.failed + pending,
        connect_retries: storm.retries,
        add_results_ok: storm.add_results_ok && storm.seen_add.iter().all(|&seen| seen),
        first_error: storm.first_error,
        release_ns: storm.release_ns,
    })
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
    fn note_error(&mut self, message: String) {
        if self.first_error.is_none() {
            self.first_error = Some(message);
        }
    }

    fn start_connect(&mut self, poll: &Poll, index: usize) {
        let addr = self.plan.addr;
        let result = StoreConn::connect(addr, Limits::default()).and_then(|mut conn| {
            poll.registry()
                .register(
                    conn.stream_mut(),
                    Token(index),
                    Interest::READABLE | Interest::WRITABLE,
                )
                .map(|()| conn)
        });
        match result {
            Ok(conn) => {
                if let Some(rank) = self.ranks.get_mut(index) {
                    rank.conn = Some(conn);
                    rank.phase = Phase::Connecting;
                }
            }
            Err(e) => self.retry(index, format!("connect to {addr}: {e}")),
        }
    }

    /// A failure before `ADD`: close and try again after a backoff.
    fn retry(&mut self, index: usize, why: String) {
        let Some(rank) = self.ranks.get_mut(index) else {
            return;
        };
        rank.conn = None;
        rank.phase = Phase::Backoff;
        rank.attempts = rank.attempts.saturating_add(1);
        let delay = backoff_delay(index, rank.attempts);
        self.retries += 1;
        tracing::debug!(rank = index, attempt = rank.attempts, %why, "storm: retrying connect");
        self.note_error(format!("rank {index} (retried): {why}"));
        self.backoff.push(Reverse((Instant::now() + delay, index)));
    }

    /// A failure after `ADD` was sent: the rank is lost.
    fn fail(&mut self, index: usize, why: String) {
        if let Some(rank) = self.ranks.get_mut(index) {
            rank.conn = None;
            rank.phase = Phase::Failed;
            self.failed += 1;
        }
        self.note_error(format!("rank {index}: {why}"));
    }

    /// A socket error: retried before `ADD`, fatal after.
    fn lose(&mut self, index: usize, why: String) {
        match self.ranks.get(index).map(|r| r.phase) {
            Some(Phase::Connecting | Phase::Validating) => self.retry(index, why),
            Some(Phase::Adding | Phase::Waiting) => self.fail(index, why),
            _ => {}
        }
    }

    fn on_event(&mut self, index: usize) {
        let Some(rank) = self.ranks.get_mut(index) else {
            return;
        };
        let Some(conn) = rank.conn.as_mut() else {
            return;
        };
        if rank.phase == Phase::Connecting {
            match conn.is_connected() {
                Ok(false) => return,
                Ok(true) => {
                    conn.queue(&Request::Validate {
                        magic: VALIDATION_MAGIC,
                    });
                    conn.queue(&Request::Ping {
                        nonce: index as u32,
                    });
                    rank.phase = Phase::Validating;
                }
                Err(e) => return self.lose(index, format!("connect: {e}")),
            }
        }
        if let Err(e) = conn.flush() {
            return self.lose(index, format!("send: {e}"));
        }
        let closed = match conn.fill() {
            Ok(fill) => fill == Fill::Closed,
            Err(e) => return self.lose(index, format!("read: {e}")),
        };
        // Replies that arrived before a close still count.
        loop {
            let Some(conn) = self.ranks.get_mut(index).and_then(|r| r.conn.as_mut()) else {
                return;
            };
            match conn.next_reply() {
                Ok(Some(reply)) => self.on_reply(index, reply),
                Ok(None) => break,
                Err(e) => return self.lose(index, e.to_string()),
            }
        }
        if closed {
            self.lose(index, "the server closed the connection".into());
        }
    }

    fn on_reply(&mut self, index: usize, reply: Reply) {
        let ranks = self.ranks.len();
        let Some(rank) = self.ranks.get_mut(index) else {
            return;
        };
        let Some(conn) = rank.conn.as_mut() else {
            return;
        };
        match (rank.phase, reply) {
            (Phase::Validating, Reply::Pong(nonce)) if nonce == index as u32 => {
                conn.queue(&Request::Add {
                    key: &self.counter_key,
                    delta: 1,
                });
                rank.phase = Phase::Adding;
                self.connected += 1;
                if self.connected == ranks {
                    self.all_connected = Some(Instant::now());
                }
            }
            (Phase::Adding, Reply::Int(value)) => {
                let slot = usize::try_from(value)
                    .ok()
                    .and_then(|v| v.checked_sub(1))
                    .and_then(|i| self.seen_add.get_mut(i));
                match slot {
                    Some(seen) if !*seen => *seen = true,
                    _ => self.add_results_ok = false,
                }
                if value == ranks as i64 {
                    conn.queue(&Request::Set {
                        key: &self.done_key,
                        value: b"1",
                    });
                }
                match KeyList::new(1, &self.done_list) {
                    Some(keys) => conn.queue(&Request::Wait { keys }),
                    None => return self.fail(index, "cannot encode the WAIT key".into()),
                }
                rank.phase = Phase::Waiting;
            }
            (Phase::Waiting, Reply::Wait(WaitResponse::StopWaiting)) => {
                rank.phase = Phase::Released;
                let now = Instant::now();
                self.released += 1;
                self.last_release = Some(now);
                let ns =
                    u64::try_from(now.duration_since(self.start).as_nanos()).unwrap_or(u64::MAX);
                self.release_ns.saturating_record(ns.max(1));
                return;
            }
            (phase, reply) => {
                return self.lose(
                    index,
                    format!("unexpected reply {reply:?} in phase {phase:?}"),
                );
            }
        }
        if let Err(e) = conn.flush() {
            self.lose(index, format!("send: {e}"));
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
    let io = |what| move |source| BenchError::Io { what, source };
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|source| BenchError::Connect { addr, source })?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(io("configure the verifying connection"))?;
    let mut out = Vec::new();
    Request::Validate {
        magic: VALIDATION_MAGIC,
    }
    .encode_into(&mut out);
    Request::Get {
        key: key.as_bytes(),
    }
    .encode_into(&mut out);
    stream.write_all(&out).map_err(io("send GET counter"))?;
    let pending = PendingReply::new(QueryType::Get, 0).ok_or(BenchError::UnexpectedReply {
        query: "GET",
        expected: "a reply",
    })?;
    let mut input = Vec::new();
    let mut chunk = [0u8; 256];
    loop {
        match codec::decode_response_view(pending, &input, &Limits::default()) {
            Ok(Decoded::Complete(ResponseView::Value(value), _)) => {
                return Ok(std::str::from_utf8(value)
                    .ok()
                    .and_then(|text| text.trim().parse().ok()));
            }
            Ok(Decoded::Complete(..)) => {
                return Err(BenchError::UnexpectedReply {
                    query: "GET",
                    expected: "a value",
                })
            }
            Ok(Decoded::Partial(_)) => {}
            Err(source) => {
                return Err(BenchError::Decode {
                    query: "GET",
                    source,
                })
            }
        }
        let n = stream.read(&mut chunk).map_err(io("read GET counter"))?;
        if n == 0 {
            return Err(BenchError::ServerClosed);
        }
        input.extend_from_slice(chunk.get(..n).unwrap_or_default());
    }
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
    fn a_small_storm_releases_every_rank_and_counts_exactly() {
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
            ranks: 64,
            timeout: Duration::from_secs(20),
            key_prefix: "/bench-test/storm".into(),
        };
        let outcome = run(&plan, &ProgressBar::hidden()).unwrap();
        assert_eq!(outcome.released, 64, "{:?}", outcome.first_error);
        assert_eq!(outcome.failed, 0);
        assert!(outcome.add_results_ok);
        assert!(outcome.all_connected_seconds.is_some());
        assert_eq!(outcome.release_ns.len(), 64);
        let counter = read_counter(
            server.local_addr(),
            &plan.counter_key(),
            Duration::from_secs(5),
        );
        assert_eq!(counter.unwrap(), Some(64));
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
            timeout: Duration::from_millis(150),
            key_prefix: "/x".into(),
        };
        let outcome = run(&plan, &ProgressBar::hidden()).unwrap();
        assert_eq!(outcome.released, 0);
        assert_eq!(outcome.failed, 3);
        assert!(outcome.connect_retries >= 3);
        assert!(!outcome.add_results_ok);
        assert!(outcome.first_error.is_some());
    }
}
