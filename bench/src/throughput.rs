//! Many connections doing `ADD` then `GET`, one request in flight each, for a fixed time.
//!
//! This is the load of a training job's ranks hammering the store: every connection
//! alternates `ADD(own key, 1)` and `GET(own key)` and sends its next request only when
//! the previous reply has arrived (PyTorch clients serialise their requests). The
//! connections are non-blocking sockets spread over a few client threads, each with one
//! `epoll` loop (`mio`), so that 512 connections cost the client one thread's worth of
//! CPU and not 512 threads' scheduling. Every reply that arrives in the measurement
//! window is counted and its latency (write to reply) goes into an HDR histogram.
//!
//! Each reply is checked: an `ADD` must return one more than the connection's previous
//! `ADD`, and a `GET` must return that number's decimal text, or the run fails. It
//! summarises what it measured as a `report` row, and does not decide how results are
//! shown.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use rdzv_core::store::codec::Limits;
use rdzv_core::store::Request;

use super::conn::{Fill, Reactor, Reply, StoreConn};
use super::cpu;
use super::report::{LatencySummary, ThroughputResult};
use super::{new_histogram, BenchError};

/// What one throughput run does.
#[derive(Debug, Clone)]
pub(super) struct ThroughputPlan {
    /// The store.
    pub addr: SocketAddr,
    /// Concurrent connections.
    pub conns: usize,
    /// Client threads the connections are spread over (at least 1).
    pub threads: usize,
    /// Time run but not measured, after every connection is ready.
    pub warmup: Duration,
    /// Time measured.
    pub measure: Duration,
    /// Keys are `{key_prefix}/{connection}`.
    pub key_prefix: String,
    /// How long connecting every connection may take.
    pub setup_timeout: Duration,
    /// Measure this process's CPU time over the window (meaningful when it holds no
    /// server).
    pub client_cpu: bool,
    /// Measure this server process's CPU time over the window.
    pub server_pid: Option<u32>,
    /// The store's name in the result.
    pub label: String,
}

/// Connects `plan.conns` connections, runs the load, and returns what was measured.
pub(super) fn run(
    plan: &ThroughputPlan,
    progress: &ProgressBar,
) -> Result<ThroughputResult, BenchError> {
    let conns = plan.conns.max(1);
    let threads = plan.threads.clamp(1, conns);
    let ready = connect_all(plan.addr, conns, plan.setup_timeout, progress)?;
    progress.set_message(format!("{conns} connections"));

    // Deal the connections out round-robin so each thread gets an even share.
    let mut shares: Vec<Vec<Slot>> = (0..threads).map(|_| Vec::new()).collect();
    for (index, conn) in ready.into_iter().enumerate() {
        let key = format!("{}/{index}", plan.key_prefix).into_bytes();
        if let Some(share) = shares.get_mut(index % threads) {
            share.push(Slot::new(conn, key));
        }
    }

    let start = Instant::now();
    let window_start = start + plan.warmup;
    let end = window_start + plan.measure;
    progress.set_length(duration_ms(plan.warmup + plan.measure));
    let sampled = std::sync::Mutex::new(None);
    let results: Vec<Result<(u64, Histogram<u64>), BenchError>> = std::thread::scope(|scope| {
        if plan.client_cpu || plan.server_pid.is_some() {
            let sampled = &sampled;
            scope.spawn(move || {
                let outcome = sample_cpu(plan.client_cpu, plan.server_pid, window_start, end);
                if let Ok(mut slot) = sampled.lock() {
                    *slot = Some(outcome);
                }
            });
        }
        let handles: Vec<_> = shares
            .into_iter()
            .enumerate()
            .map(|(thread, share)| {
                let progress = (thread == 0).then(|| progress.clone());
                scope.spawn(move || drive(share, start, window_start, end, progress))
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or(Err(BenchError::ClientThreadPanicked))
            })
            .collect()
    });
    let mut ops = 0;
    let mut latency_ns = new_histogram()?;
    for result in results {
        let (thread_ops, histogram) = result?;
        ops += thread_ops;
        latency_ns
            .add(&histogram)
            .map_err(|e| BenchError::Histogram(format!("{e:?}")))?;
    }
    let sampled = sampled.into_inner().ok().flatten().transpose()?;
    let (client_cpu, server_cpu) = sampled.unwrap_or_default();
    let seconds = plan.measure.as_secs_f64();
    Ok(ThroughputResult {
        target: plan.label.clone(),
        conns,
        client_threads: threads,
        seconds,
        ops,
        ops_per_s: super::per_second(ops, seconds),
        latency: LatencySummary::from_ns(&latency_ns),
        client_cpu_us_per_op: client_cpu.and_then(|cpu| cpu::us_per_op(cpu, ops)),
        server_cpu_us_per_op: server_cpu.and_then(|cpu| cpu::us_per_op(cpu, ops)),
    })
}

/// CPU time of this process and of the server over `[window_start, end)`, read at the
/// window's edges (the load threads take their own timestamps from the same instants).
fn sample_cpu(
    client: bool,
    server_pid: Option<u32>,
    window_start: Instant,
    end: Instant,
) -> Result<(Option<Duration>, Option<Duration>), BenchError> {
    let read = |process| cpu::cpu_time(process).map_err(BenchError::CpuTime);
    let sample = || -> Result<(Option<Duration>, Option<Duration>), BenchError> {
        let own = client.then(|| read(cpu::Process::Current)).transpose()?;
        let server = server_pid
            .map(|pid| read(cpu::Process::Pid(pid)))
            .transpose()?;
        Ok((own, server))
    };
    std::thread::sleep(window_start.saturating_duration_since(Instant::now()));
    let (own_before, server_before) = sample()?;
    std::thread::sleep(end.saturating_duration_since(Instant::now()));
    let (own_after, server_after) = sample()?;
    let delta = |before: Option<Duration>, after: Option<Duration>| {
        before.zip(after).map(|(b, a)| a.saturating_sub(b))
    };
    Ok((
        delta(own_before, own_after),
        delta(server_before, server_after),
    ))
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Opens `n` connections at once and waits until each has sent `VALIDATE` and had a
/// `PING` answered. A server that accepts slowly (PyTorch's libuv server takes about
/// 10 connections per second once hundreds are queued) only makes this take longer, up
/// to `timeout`; the progress bar's message counts the ready connections.
pub(super) fn connect_all(
    addr: SocketAddr,
    n: usize,
    timeout: Duration,
    progress: &ProgressBar,
) -> Result<Vec<StoreConn>, BenchError> {
    let mut reactor = Reactor::new(1024)?;
    let nonce = std::process::id();
    let conns: Result<Vec<StoreConn>, _> = (0..n)
        .map(|token| reactor.connect(addr, Limits::default(), Some(nonce), token))
        .collect();
    let mut conns = conns.map_err(|source| BenchError::Connect { addr, source })?;
    let deadline = Instant::now() + timeout;
    let mut ready = 0;
    let mut last_progress = Instant::now();
    while ready < n {
        let now = Instant::now();
        if now.duration_since(last_progress) >= Duration::from_millis(200) {
            progress.set_message(format!("connected {ready}/{n}"));
            last_progress = now;
        }
        if now >= deadline {
            return Err(BenchError::SetupTimeout {
                ready,
                wanted: n,
                seconds: timeout.as_secs_f64(),
            });
        }
        for event in reactor.wait((deadline - now).min(Duration::from_millis(200)))? {
            if let Some(conn) = conns.get_mut(event.token().0) {
                ready += setup_step(conn, addr, nonce)?;
            }
        }
    }
    for conn in &mut conns {
        reactor.deregister(conn)?;
    }
    Ok(conns)
}

/// One readiness event of a connection being set up (`VALIDATE` and `PING` go out once
/// it is connected): returns how many `PING`s were answered.
fn setup_step(conn: &mut StoreConn, addr: SocketAddr, nonce: u32) -> Result<usize, BenchError> {
    match conn.pump() {
        Ok(None) => return Ok(0),
        Ok(Some(Fill::Open)) => {}
        Ok(Some(Fill::Closed)) => return Err(BenchError::ServerClosed),
        Err(e) if e.during == "connect" => {
            return Err(BenchError::Connect {
                addr,
                source: e.source,
            })
        }
        Err(e) if e.during == "send" => {
            return Err(BenchError::io("send VALIDATE and PING")(e.source))
        }
        Err(e) => return Err(BenchError::io("read a PING reply")(e.source)),
    }
    let mut answered = 0;
    while let Some(reply) = conn.next_reply()? {
        if reply != Reply::Pong(nonce) {
            return Err(BenchError::UnexpectedReply {
                query: "PING",
                expected: "the nonce echoed",
            });
        }
        answered += 1;
    }
    Ok(answered)
}

/// One connection of the load and what it has seen.
#[derive(Debug)]
struct Slot {
    conn: StoreConn,
    key: Vec<u8>,
    /// The next request is a `GET` (else an `ADD`).
    next_is_get: bool,
    sent_at: Instant,
    /// The value of the last `ADD`; 0 before the first.
    counter: i64,
}

impl Slot {
    fn new(conn: StoreConn, key: Vec<u8>) -> Slot {
        Slot {
            conn,
            key,
            next_is_get: false,
            sent_at: Instant::now(),
            counter: 0,
        }
    }

    fn send_next(&mut self) -> Result<(), BenchError> {
        if self.next_is_get {
            self.conn.queue(&Request::Get { key: &self.key });
        } else {
            self.conn.queue(&Request::Add {
                key: &self.key,
                delta: 1,
            });
        }
        self.sent_at = Instant::now();
        self.conn.flush().map_err(BenchError::io("send a request"))
    }

    /// Checks `reply` against what this connection sent and expects.
    fn check(&mut self, reply: Reply) -> Result<(), BenchError> {
        let expected = match (self.next_is_get, reply) {
            (true, Reply::Value { len }) if len == decimal_len(self.counter) => None,
            (true, _) => Some(("GET", "the decimal text of the last ADD's result")),
            // One more, or (a key left by an earlier run against the same server) its
            // count adopted.
            (false, Reply::Int(value))
                if self.counter.checked_add(1) == Some(value)
                    || (self.counter == 0 && value > 0) =>
            {
                self.counter = value;
                None
            }
            (false, _) => Some(("ADD", "one more than this connection's previous ADD")),
        };
        if let Some((query, expected)) = expected {
            return Err(BenchError::UnexpectedReply { query, expected });
        }
        self.next_is_get = !self.next_is_get;
        Ok(())
    }
}

/// Bytes in the decimal text of `n` (as `ADD` stores it).
fn decimal_len(n: i64) -> usize {
    let mut len = usize::from(n < 0) + 1;
    let mut rest = n.unsigned_abs() / 10;
    while rest > 0 {
        len += 1;
        rest /= 10;
    }
    len
}

/// Runs one thread's share of connections until `end`.
fn drive(
    mut slots: Vec<Slot>,
    start: Instant,
    window_start: Instant,
    end: Instant,
    progress: Option<ProgressBar>,
) -> Result<(u64, Histogram<u64>), BenchError> {
    let mut reactor = Reactor::new(1024)?;
    for (token, slot) in slots.iter_mut().enumerate() {
        reactor
            .register(&mut slot.conn, token)
            .map_err(BenchError::io("register a socket"))?;
    }
    let mut histogram = new_histogram()?;
    let mut ops = 0u64;
    for slot in &mut slots {
        slot.send_next()?;
    }
    let mut last_progress = start;
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        if let Some(bar) = &progress {
            if now.duration_since(last_progress) >= Duration::from_millis(100) {
                bar.set_position(duration_ms(now.duration_since(start)));
                last_progress = now;
            }
        }
        let wait = (end - now).min(Duration::from_millis(50));
        for event in reactor.wait(wait)? {
            let Some(slot) = slots.get_mut(event.token().0) else {
                continue;
            };
            if event.is_writable() && slot.conn.has_unsent() {
                slot.conn
                    .flush()
                    .map_err(BenchError::io("send a request"))?;
            }
            if !event.is_readable() && !event.is_read_closed() && !event.is_error() {
                continue;
            }
            if slot.conn.fill().map_err(BenchError::io("read a reply"))? == Fill::Closed {
                return Err(BenchError::ServerClosed);
            }
            while let Some(reply) = slot.conn.next_reply()? {
                let now = Instant::now();
                slot.check(reply)?;
                if now >= window_start && now < end {
                    let ns = u64::try_from(now.duration_since(slot.sent_at).as_nanos())
                        .unwrap_or(u64::MAX);
                    histogram.saturating_record(ns.max(1));
                    ops += 1;
                }
                if now < end {
                    slot.send_next()?;
                }
            }
        }
    }
    if let Some(bar) = &progress {
        bar.set_position(duration_ms(end.duration_since(start)));
    }
    Ok((ops, histogram))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_len_matches_formatting() {
        for n in [0i64, 1, 9, 10, 99, 100, 12345, -1, -10, i64::MAX, i64::MIN] {
            assert_eq!(decimal_len(n), n.to_string().len(), "{n}");
        }
    }

    #[test]
    fn runs_against_a_real_server_and_counts_every_reply() {
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
        let plan = ThroughputPlan {
            addr: server.local_addr(),
            conns: 8,
            threads: 2,
            warmup: Duration::from_millis(20),
            measure: Duration::from_millis(200),
            key_prefix: "/bench-test/throughput".into(),
            setup_timeout: Duration::from_secs(10),
            client_cpu: true,
            // The server runs in this process: its CPU is this process's.
            server_pid: Some(std::process::id()),
            label: "rdzv".into(),
        };
        let outcome = run(&plan, &ProgressBar::hidden()).unwrap();
        let own = outcome.client_cpu_us_per_op.unwrap();
        let server_cpu = outcome.server_cpu_us_per_op.unwrap();
        // The same process, read at the same instants (a tick apart at most).
        assert!(
            (own - server_cpu).abs() * outcome.ops as f64 <= 20_000.0,
            "{own} vs {server_cpu} µs per op"
        );
        assert_eq!(outcome.conns, 8);
        assert_eq!(outcome.client_threads, 2);
        assert!(outcome.ops > 0, "no operation completed in 200 ms");
        assert!(outcome.latency.p50_us > 0.0);
        server.shutdown();
    }
}
