//! `store serve --metrics HOST:PORT`: the server's figures in Prometheus' text exposition
//! format (version 0.0.4), served by one small std thread over HTTP/1.1 `GET /metrics`.
//!
//! What it reports is what rdzv's `STATS` query reports (connections, keys, waiters,
//! queues, requests by query type, bytes in and out, uptime), as published by the event
//! loops after every batch of requests, plus a request-duration histogram per query type.
//! A request's duration is the server's time to handle it: from its last byte being
//! decoded to its reply being encoded (for `WAIT`/`BARRIER`, the registration, not the
//! time spent blocked). Loops record into fixed buckets of atomic counters, so recording
//! takes no lock and the buckets are Prometheus' own model (cumulative `le` bounds);
//! none of this runs unless `--metrics` is given.
//!
//! It does not decide anything about requests, and it is no general HTTP server: one
//! request per connection, `Connection: close`, heads of at most 8 KiB. Reading a head
//! ([`head_complete`]) and choosing the answer ([`route`]) are pure functions of the
//! bytes received, fuzzed by `fuzz/fuzz_targets/metrics_http.rs`.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rdzv_core::store::{QueryType, StoreStats};

/// Upper bounds of the duration buckets, in nanoseconds: 1-2-5 steps from 1 µs to 1 s.
const BOUNDS_NS: [u64; 19] = [
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    20_000_000,
    50_000_000,
    100_000_000,
    200_000_000,
    500_000_000,
    1_000_000_000,
];

/// One query type's durations: a count per bucket (the last one is `+Inf`), their sum
/// and how many.
#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; BOUNDS_NS.len() + 1],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn record(&self, ns: u64) {
        let bucket = BOUNDS_NS.partition_point(|&bound| bound < ns);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the event loops publish for the metrics thread.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    /// The engine's figures after the last batch any loop served.
    snapshot: Mutex<StoreStats>,
    /// Durations by [`QueryType::index`].
    durations: [Histogram; QueryType::ALL.len()],
}

impl Metrics {
    /// Records how long one request of type `query` took to handle.
    pub(crate) fn record(&self, query: QueryType, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.durations[query.index()].record(ns);
    }

    /// Publishes the engine's figures (after a batch of requests).
    pub(crate) fn publish(&self, stats: StoreStats) {
        *self.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = stats;
    }

    /// The figures in Prometheus' text format. `uptime_ms` is the server's uptime and
    /// `live` its connections, keys and waiters as the loops keep them (fresher than the
    /// last batch's snapshot: a disconnect serves no request).
    pub(crate) fn render(&self, uptime_ms: u64, live: [usize; 3]) -> String {
        let mut stats = *self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        stats.connections = live[0] as u64;
        stats.keys = live[1] as u64;
        stats.waiters = live[2] as u64;
        let mut out = String::with_capacity(4096);
        let gauges = [
            ("connections", "Open client connections.", stats.connections),
            (
                "keys",
                "Keys in the key-value map (queues not counted).",
                stats.keys,
            ),
            (
                "waiters",
                "Pending WAIT and BARRIER requests.",
                stats.waiters,
            ),
            ("queues", "Non-empty queues.", stats.queues),
        ];
        for (name, help, value) in gauges {
            metric(&mut out, name, "gauge", help);
            let _ = writeln!(out, "rdzv_store_{name} {value}");
        }
        let counters = [
            (
                "received_bytes_total",
                "Request bytes decoded.",
                stats.bytes_in,
            ),
            (
                "sent_bytes_total",
                "Reply and wake-up bytes encoded.",
                stats.bytes_out,
            ),
        ];
        for (name, help, value) in counters {
            metric(&mut out, name, "counter", help);
            let _ = writeln!(out, "rdzv_store_{name} {value}");
        }
        metric(
            &mut out,
            "uptime_seconds",
            "gauge",
            "Seconds since the server started.",
        );
        let _ = writeln!(
            out,
            "rdzv_store_uptime_seconds {}.{:03}",
            uptime_ms / 1000,
            uptime_ms % 1000
        );
        metric(
            &mut out,
            "requests_total",
            "counter",
            "Requests served, by query type.",
        );
        for query in QueryType::ALL {
            let _ = writeln!(
                out,
                "rdzv_store_requests_total{{query=\"{}\"}} {}",
                query.name(),
                stats.requests_of(query)
            );
        }
        metric(
            &mut out,
            "request_duration_seconds",
            "histogram",
            "Time to handle a request, from its last byte decoded to its reply encoded.",
        );
        for query in QueryType::ALL {
            let histogram = &self.durations[query.index()];
            let count = histogram.count.load(Ordering::Relaxed);
            if count == 0 {
                continue;
            }
            let name = query.name();
            let mut cumulative = 0u64;
            for (i, bucket) in histogram.buckets.iter().enumerate() {
                cumulative += bucket.load(Ordering::Relaxed);
                let le = match BOUNDS_NS.get(i) {
                    Some(&ns) => seconds(ns),
                    None => "+Inf".to_string(),
                };
                let _ = writeln!(
                    out,
                    "rdzv_store_request_duration_seconds_bucket{{query=\"{name}\",le=\"{le}\"}} {cumulative}"
                );
            }
            let sum = histogram.sum_ns.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "rdzv_store_request_duration_seconds_sum{{query=\"{name}\"}} {}",
                seconds(sum)
            );
            // The count is the +Inf bucket, read in the same pass.
            let _ = writeln!(
                out,
                "rdzv_store_request_duration_seconds_count{{query=\"{name}\"}} {cumulative}"
            );
        }
        out
    }
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP rdzv_store_{name} {help}");
    let _ = writeln!(out, "# TYPE rdzv_store_{name} {kind}");
}

/// Nanoseconds as decimal seconds, exactly (`1500` → `0.0000015`).
fn seconds(ns: u64) -> String {
    let whole = ns / 1_000_000_000;
    let frac = ns % 1_000_000_000;
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:09}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// The thread serving `GET /metrics`, stopped by [`MetricsServer::stop`].
#[derive(Debug)]
pub(crate) struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` and starts serving `render()`'s output.
    pub(crate) fn start(
        addr: SocketAddr,
        render: impl Fn() -> String + Send + 'static,
    ) -> io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("rdzv-metrics".into())
            .spawn(move || {
                while !stopping.load(Ordering::Acquire) {
                    match listener.accept() {
                        Ok((stream, peer)) => {
                            if let Err(error) = answer(stream, &render) {
                                tracing::debug!(%peer, %error, "metrics request failed");
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        Err(error) => {
                            tracing::warn!(%error, "metrics listener accept failed");
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                }
            })?;
        Ok(MetricsServer {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it serves on.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops the thread and waits for it.
    pub(crate) fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Longest request head read.
pub(crate) const MAX_HEAD: usize = 8 * 1024;

/// What a request head is answered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// `GET /metrics` (any query string): the figures.
    Metrics,
    /// `GET` of another path: 404.
    NotFound,
    /// Any other method, or no request line: 405.
    MethodNotAllowed,
    /// A head of [`MAX_HEAD`] bytes or more with no end: 431.
    TooLarge,
}

impl Route {
    /// The HTTP status line's code and reason, and the body (`None`: the metrics).
    fn answer(self) -> (&'static str, Option<&'static str>) {
        match self {
            Route::Metrics => ("200 OK", None),
            Route::NotFound => (
                "404 Not Found",
                Some("rdzv serves its metrics at /metrics\n"),
            ),
            Route::MethodNotAllowed => (
                "405 Method Not Allowed",
                Some("only GET /metrics is served\n"),
            ),
            Route::TooLarge => ("431 Request Header Fields Too Large", Some("")),
        }
    }
}

/// Whether `head` holds a whole request head: an empty line ends it (`\r\n\r\n`, or
/// `\n\n` from lenient clients).
pub(crate) fn head_complete(head: &[u8]) -> bool {
    head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n")
}

/// The answer to the request head `head` (what was read of it: a client that closes
/// early is answered from what it sent). Only the request line counts: `GET`, then a
/// target whose path (before any `?`) is `/metrics`.
pub(crate) fn route(head: &[u8]) -> Route {
    if head.len() >= MAX_HEAD && !head_complete(head) {
        return Route::TooLarge;
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => Route::Metrics,
        ("GET", _) => Route::NotFound,
        _ => Route::MethodNotAllowed,
    }
}

/// Reads one request head and answers it.
fn answer(mut stream: TcpStream, render: &dyn Fn() -> String) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while head.len() < MAX_HEAD && !head_complete(&head) {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(chunk.get(..n).unwrap_or_default());
    }
    match route(&head).answer() {
        (status, Some(body)) => respond(&mut stream, status, body),
        (status, None) => respond(&mut stream, status, &render()),
    }
}

fn respond(stream: &mut TcpStream, status: &str, body: &str) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_fall_in_cumulative_buckets() {
        let metrics = Metrics::default();
        metrics.record(QueryType::Set, Duration::from_nanos(800));
        metrics.record(QueryType::Set, Duration::from_micros(1));
        metrics.record(QueryType::Set, Duration::from_micros(3));
        metrics.record(QueryType::Set, Duration::from_secs(2));
        let mut stats = StoreStats::default();
        stats.requests[QueryType::Set.index()] = 4;
        metrics.publish(stats);
        let text = metrics.render(1500, [2, 0, 0]);
        let line = |prefix: &str| {
            text.lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
                .rsplit(' ')
                .next()
                .unwrap()
                .to_string()
        };
        assert_eq!(line("rdzv_store_connections "), "2");
        assert_eq!(line("rdzv_store_uptime_seconds "), "1.500");
        assert_eq!(line("rdzv_store_requests_total{query=\"SET\"}"), "4");
        let bucket = |le: &str| {
            line(&format!(
                "rdzv_store_request_duration_seconds_bucket{{query=\"SET\",le=\"{le}\"}}"
            ))
        };
        assert_eq!(bucket("0.000001"), "2", "800 ns and 1 µs are <= 1 µs");
        assert_eq!(bucket("0.000005"), "3");
        assert_eq!(bucket("1"), "3");
        assert_eq!(bucket("+Inf"), "4");
        assert_eq!(
            line("rdzv_store_request_duration_seconds_count{query=\"SET\"}"),
            "4"
        );
        assert_eq!(
            line("rdzv_store_request_duration_seconds_sum{query=\"SET\"}"),
            "2.0000048"
        );
        assert!(
            !text.contains("duration_seconds_count{query=\"GET\"}"),
            "unseen query types have no histogram"
        );
    }

    #[test]
    fn requests_are_routed_by_their_request_line() {
        let cases: [(&[u8], Route); 9] = [
            (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", Route::Metrics),
            (b"GET /metrics?name[]=x HTTP/1.0\n\n", Route::Metrics),
            (b"GET /metrics", Route::Metrics),
            (b"GET / HTTP/1.1\r\n\r\n", Route::NotFound),
            (b"GET /metricsx HTTP/1.1\r\n\r\n", Route::NotFound),
            (b"POST /metrics HTTP/1.1\r\n\r\n", Route::MethodNotAllowed),
            (b"get /metrics HTTP/1.1\r\n\r\n", Route::MethodNotAllowed),
            (b"", Route::MethodNotAllowed),
            (
                b"\r\nGET /metrics HTTP/1.1\r\n\r\n",
                Route::MethodNotAllowed,
            ),
        ];
        for (head, want) in cases {
            assert_eq!(route(head), want, "{:?}", String::from_utf8_lossy(head));
        }
        let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        huge.resize(MAX_HEAD, b'a');
        assert_eq!(route(&huge), Route::TooLarge);
        huge.truncate(MAX_HEAD - 4);
        huge.extend_from_slice(b"\r\n\r\n");
        assert_eq!(
            route(&huge),
            Route::Metrics,
            "a whole head of 8 KiB is served"
        );
    }

    #[test]
    fn heads_end_at_an_empty_line() {
        assert!(head_complete(b"GET / HTTP/1.1\r\n\r\n"));
        assert!(head_complete(b"GET / HTTP/1.1\n\n"));
        assert!(!head_complete(b"GET / HTTP/1.1\r\nHost: x\r\n"));
        assert!(!head_complete(b""));
    }

    #[test]
    fn the_server_answers_each_route() {
        let mut server =
            MetricsServer::start("127.0.0.1:0".parse().unwrap(), || "figures\n".into()).unwrap();
        let ask = |request: &[u8]| {
            let mut stream = TcpStream::connect(server.local_addr()).unwrap();
            stream.write_all(request).unwrap();
            let mut reply = String::new();
            stream.read_to_string(&mut reply).unwrap();
            reply
        };
        let ok = ask(b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(
            ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("\r\n\r\nfigures\n"),
            "{ok}"
        );
        assert!(ask(b"GET /x HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
        assert!(ask(b"PUT /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
        // Exactly the limit, so that nothing is left unread (which would reset the
        // connection before the reply is read).
        let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        huge.resize(MAX_HEAD, b'a');
        assert!(ask(&huge).starts_with("HTTP/1.1 431 "));
        server.stop();
    }

    #[test]
    fn seconds_are_exact_decimals() {
        assert_eq!(seconds(0), "0");
        assert_eq!(seconds(1_000), "0.000001");
        assert_eq!(seconds(1_500_000_000), "1.5");
        assert_eq!(seconds(2_000_000_000), "2");
    }
}
