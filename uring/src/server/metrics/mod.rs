//! `store serve --metrics HOST:PORT`: the server's figures in Prometheus' text exposition
//! format (version 0.0.4), served over HTTP/1.1 `GET /metrics`.
//!
//! What it reports is what rdzv's `STATS` query reports (connections, keys, waiters,
//! queues, requests by query type, bytes in and out, uptime, and the access-control
//! refusals by kind: peers, tokens, requests), as published by the event
//! loops after every batch of requests, plus a request-duration histogram per query type.
//! A request's duration is the server's time to handle it: from its last byte being
//! decoded to its reply being encoded (for `WAIT`/`BARRIER`, the registration, not the
//! time spent blocked). Loops record into fixed buckets of atomic counters, so recording
//! takes no lock and the buckets are Prometheus' own model (cumulative `le` bounds);
//! none of this runs unless `--metrics` is given.
//!
//! The same port serves `GET /status.json` and `GET /status`, the server and the elastic
//! runs its keys hold, for a person ([`status`]: read-only, never a value; in token mode
//! only a token of the `@status` grant may read it).
//!
//! Each scrape also carries the process figures Prometheus' client libraries export
//! (`process_cpu_seconds_total`, `process_resident_memory_bytes`, `process_open_fds`, ...:
//! [`process`]).
//!
//! HTTP is `hyper`'s (HTTP/1.1 only), on a current-thread tokio runtime in one thread:
//! every connection is a task of its own, so scrapes run concurrently and an idle or slow
//! client holds up nobody. One request per connection (no keep-alive), heads of at most
//! 8 KiB (431 beyond), at most 64 connections at once (more are closed at accept) and 10 s
//! per connection. It decides nothing about requests.

mod process;
mod status;

pub(crate) use status::StatusSource;

use std::convert::Infallible;
use std::fmt::Write as _;
use std::io;
use std::net::{SocketAddr, TcpListener as StdTcpListener};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, WWW_AUTHENTICATE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use rdzv_core::store::engine::Engine;
use rdzv_core::store::{QueryType, StoreStats};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Notify;

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
    /// The engine, for `/status.json`: set once the loops have one.
    engine: EngineSlot,
}

/// How `/status.json` reads the engine: runs the function with the engine locked, or
/// answers `false` once the loops are gone. The server passes it in (the engine's lock
/// is the loops' business).
pub(crate) type EngineRead = Box<dyn Fn(&mut dyn FnMut(&Engine)) -> bool + Send + Sync>;

/// Where `/status.json` finds the engine, once the loops have one.
#[derive(Default)]
struct EngineSlot(OnceLock<EngineRead>);

impl std::fmt::Debug for EngineSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "EngineSlot(attached)"
        } else {
            "EngineSlot(none)"
        })
    }
}

impl Metrics {
    /// Records how long one request of type `query` took to handle.
    pub(crate) fn record(&self, query: QueryType, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.durations[query.index()].record(ns);
    }

    /// Gives `/status.json` the engine to read (once; later calls are ignored).
    pub(crate) fn attach(&self, read: EngineRead) {
        let _ = self.engine.0.set(read);
    }

    /// Runs `f` with the engine locked; `false` if there is none (yet, or any more).
    fn read_engine(&self, f: &mut dyn FnMut(&Engine)) -> bool {
        self.engine.0.get().is_some_and(|read| read(f))
    }

    /// The engine's figures as of the last batch.
    fn snapshot(&self) -> StoreStats {
        *self.snapshot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes the engine's figures (after a batch of requests).
    pub(crate) fn publish(&self, stats: StoreStats) {
        *self.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = stats;
    }

    /// The figures in Prometheus' text format. `uptime_ms` is the server's uptime and
    /// `live` its connections, keys and waiters as the loops keep them (fresher than the
    /// last batch's snapshot: a disconnect serves no request).
    pub(crate) fn render(&self, uptime_ms: u64, live: [usize; 3]) -> String {
        let mut stats = self.snapshot();
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
            (
                "refused_peers_total",
                "Peers closed at accept: their address is in no --allow network.",
                stats.refused_peers,
            ),
            (
                "refused_tokens_total",
                "Connections closed for a missing, unknown or repeated AUTH token \
                 (--token-file; a PyTorch client counts here).",
                stats.refused_tokens,
            ),
            (
                "refused_requests_total",
                "Connections closed for a request outside their token's key prefix, or a \
                 query a prefix-bound token may not make (GETNUMKEYS, LIST_KEYS, STATS).",
                stats.refused_requests,
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

/// Most connections served at once; one more is closed at accept (and logged).
const MAX_CONNECTIONS: usize = 64;

/// How long one connection may take, from accept to the end of its reply: a client that
/// sends nothing (or dribbles its head) is closed after this.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest request head read (hyper's smallest read buffer); a longer one gets 431.
pub(crate) const MAX_HEAD: usize = 8 * 1024;

/// The thread serving `GET /metrics`, stopped by [`MetricsServer::stop`].
#[derive(Debug)]
pub(crate) struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<Notify>,
    thread: Option<JoinHandle<()>>,
}

/// What the connections answer from: the store's figures (the server's closure) and,
/// when the server gave one, its status.
#[derive(Clone)]
struct Routes {
    render: Arc<Mutex<dyn Fn() -> String + Send>>,
    status: Option<Arc<StatusSource>>,
}

impl MetricsServer {
    /// Binds `addr` and starts serving `render()`'s output, followed by the process
    /// figures, at `/metrics`, and `status` at `/status` and `/status.json`, on a thread
    /// of its own.
    pub(crate) fn start(
        addr: SocketAddr,
        render: impl Fn() -> String + Send + 'static,
        status: Option<StatusSource>,
    ) -> io::Result<MetricsServer> {
        let listener = StdTcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        let stop = Arc::new(Notify::new());
        let stopping = Arc::clone(&stop);
        let routes = Routes {
            render: Arc::new(Mutex::new(render)),
            status: status.map(Arc::new),
        };
        let thread = std::thread::Builder::new()
            .name("rdzv-metrics".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(error) => {
                            tracing::warn!(%error, "metrics listener could not be registered");
                            return;
                        }
                    };
                    let stopped = async {
                        stopping.notified().await;
                        None
                    };
                    let accepting = accept_loop(&listener, routes);
                    futures_lite::future::or(accepting, stopped).await;
                });
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

    /// Stops the thread (open connections are dropped) and waits for it.
    pub(crate) fn stop(&mut self) {
        self.stop.notify_one();
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

/// Accepts until stopped; each connection is a task of its own, so an idle or slow
/// client holds up nobody. Never returns `Some`; the type lets it race the stop signal.
async fn accept_loop(listener: &TcpListener, routes: Routes) -> Option<()> {
    let active = Arc::new(AtomicUsize::new(0));
    let mut refused = RateLimited::default();
    let mut failed = RateLimited::default();
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                if active.load(Ordering::Acquire) >= MAX_CONNECTIONS {
                    drop(stream);
                    refused.warn(|n| {
                        tracing::warn!(
                            %peer,
                            refused = n,
                            limit = MAX_CONNECTIONS,
                            "metrics: too many connections at once; closed new ones"
                        )
                    });
                    continue;
                }
                active.fetch_add(1, Ordering::AcqRel);
                let active = Arc::clone(&active);
                let routes = routes.clone();
                tokio::spawn(async move {
                    let served = tokio::time::timeout(CONNECTION_TIMEOUT, serve(stream, routes));
                    match served.await {
                        Ok(Ok(())) => {}
                        Ok(Err(error)) => tracing::debug!(%peer, %error, "metrics request failed"),
                        Err(_) => tracing::debug!(%peer, "metrics connection timed out"),
                    }
                    active.fetch_sub(1, Ordering::AcqRel);
                });
            }
            Err(error) => {
                // Out of descriptors, most likely: say so now and then, and let the
                // store's own connections have them back.
                failed.warn(|n| tracing::warn!(%error, failures = n, "metrics: accept failed"));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Counts events and lets one warning through a second.
#[derive(Default)]
struct RateLimited {
    last: Option<std::time::Instant>,
    count: u64,
}

impl RateLimited {
    fn warn(&mut self, log: impl FnOnce(u64)) {
        self.count += 1;
        let now = std::time::Instant::now();
        if self
            .last
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            log(self.count);
            self.count = 0;
            self.last = Some(now);
        }
    }
}

/// One connection: one request (no keep-alive), answered by [`answer`].
async fn serve(stream: tokio::net::TcpStream, routes: Routes) -> Result<(), hyper::Error> {
    let service = service_fn(move |request: Request<Incoming>| {
        let routes = routes.clone();
        async move { Ok::<_, Infallible>(answer(&request, &routes)) }
    });
    http1::Builder::new()
        .keep_alive(false)
        .max_buf_size(MAX_HEAD)
        .serve_connection(Io(stream), service)
        .await
}

/// Prometheus' text format.
const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What a request is answered with: `GET /metrics` (any query string) the figures,
/// `GET /status.json` the status (401 without a token that may read it, where tokens are
/// required), `GET /status` the page that shows it; a `GET` of another path 404, any
/// other method 405.
fn answer<B>(request: &Request<B>, routes: &Routes) -> Response<Full<Bytes>> {
    let status = routes.status.as_deref();
    let (code, kind, body) = match (request.method(), request.uri().path(), status) {
        (&Method::GET, "/metrics", _) => {
            let mut body = (routes.render.lock().unwrap_or_else(|p| p.into_inner()))();
            process::render(&mut body);
            (StatusCode::OK, TEXT, Bytes::from(body))
        }
        (&Method::GET, "/status.json", Some(status)) => {
            let header = request
                .headers()
                .get(AUTHORIZATION)
                .map(HeaderValue::as_bytes);
            if status.allows(header) {
                let body = status.json(std::time::Instant::now());
                (
                    StatusCode::OK,
                    "application/json",
                    Bytes::from(body.as_bytes().to_vec()),
                )
            } else {
                let mut response = reply(
                    StatusCode::UNAUTHORIZED,
                    TEXT,
                    Bytes::from_static(
                        b"the status needs Authorization: Bearer TOKEN, a token of the                           @status grant in the server's --token-file\n",
                    ),
                );
                response.headers_mut().insert(
                    WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"rdzv status\""),
                );
                return response;
            }
        }
        (&Method::GET, "/status", Some(_)) => {
            let mut response = reply(
                StatusCode::OK,
                "text/html; charset=utf-8",
                Bytes::from_static(status::PAGE.as_bytes()),
            );
            // Nothing but this page's own script and style, and fetches of this server.
            response.headers_mut().insert(
                "content-security-policy",
                HeaderValue::from_static(
                    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                     connect-src 'self'; img-src data:; form-action 'none'; frame-ancestors 'none'",
                ),
            );
            return response;
        }
        (&Method::GET, _, _) => (
            StatusCode::NOT_FOUND,
            TEXT,
            Bytes::from_static(b"rdzv serves its metrics at /metrics and its status at /status\n"),
        ),
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            Bytes::from_static(b"only GET is served\n"),
        ),
    };
    reply(code, kind, body)
}

fn reply(code: StatusCode, kind: &'static str, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = code;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(kind));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// A tokio socket as hyper's I/O (what `hyper-util`'s `TokioIo` does, without the crate).
struct Io(tokio::net::TcpStream);

impl hyper::rt::Read for Io {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let mut chunk = [0u8; 4096];
        let want = buf.remaining().min(chunk.len());
        let mut read = tokio::io::ReadBuf::new(chunk.get_mut(..want).unwrap_or_default());
        match Pin::new(&mut self.0).poll_read(cx, &mut read) {
            Poll::Ready(Ok(())) => {
                buf.put_slice(read.filled());
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl hyper::rt::Write for Io {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
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
        stats.refused_peers = 3;
        stats.refused_tokens = 2;
        stats.refused_requests = 1;
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
        for (kind, value) in [("peers", "3"), ("tokens", "2"), ("requests", "1")] {
            let name = format!("rdzv_store_refused_{kind}_total");
            assert_eq!(line(&format!("{name} ")), value);
            assert!(text.contains(&format!("# TYPE {name} counter\n")), "{text}");
            assert!(text.contains(&format!("# HELP {name} ")), "{text}");
        }
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

    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Instant;

    fn ask(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        stream.write_all(request).unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).unwrap();
        reply
    }

    fn figures() -> MetricsServer {
        MetricsServer::start(
            "127.0.0.1:0".parse().unwrap(),
            || "figures 1\n".into(),
            None,
        )
        .unwrap()
    }

    #[test]
    fn the_server_answers_each_route() {
        let mut server = figures();
        let addr = server.local_addr();
        let ok = ask(addr, b"GET /metrics?name[]=x HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("text/plain; version=0.0.4"), "{ok}");
        let body = ok.split("\r\n\r\n").nth(1).unwrap();
        assert!(body.starts_with("figures 1\n"), "{body}");
        assert!(body.contains("\nprocess_resident_memory_bytes "), "{body}");
        assert!(body.contains("\nprocess_open_fds "), "{body}");
        assert!(body.contains("\nprocess_cpu_seconds_total "), "{body}");
        assert!(ask(addr, b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.1 404 "));
        assert!(ask(addr, b"PUT /metrics HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.1 405 "));
        let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        huge.resize(MAX_HEAD + 100, b'a');
        huge.extend_from_slice(b"\r\n\r\n");
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let _ = stream.write_all(&huge);
        let mut reply = Vec::new();
        let _ = stream.read_to_end(&mut reply);
        let reply = String::from_utf8_lossy(&reply);
        assert!(
            reply.is_empty() || reply.starts_with("HTTP/1.1 431 "),
            "{reply}"
        );
        server.stop();
    }

    /// The probe's case: one idle TCP connection held a scrape up for 4.9 s.
    #[test]
    fn an_idle_connection_does_not_hold_up_a_scrape() {
        let server = figures();
        let addr = server.local_addr();
        let _idle = TcpStream::connect(addr).unwrap();
        let mut half = TcpStream::connect(addr).unwrap();
        half.write_all(b"GET /metr").unwrap();
        let started = Instant::now();
        let reply = ask(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.1 200 "), "{reply}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "a scrape behind an idle connection took {:?}",
            started.elapsed()
        );
        // The half-sent request still gets its answer once it is whole.
        half.write_all(b"ics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut reply = String::new();
        half.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        half.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.1 200 "), "{reply}");
    }

    #[test]
    fn two_scrapes_run_at_once() {
        let server = figures();
        let addr = server.local_addr();
        // Both requests are in before either is read: neither waits for the other.
        let mut a = TcpStream::connect(addr).unwrap();
        let mut b = TcpStream::connect(addr).unwrap();
        for s in [&mut a, &mut b] {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
        }
        for mut s in [b, a] {
            let mut reply = String::new();
            s.read_to_string(&mut reply).unwrap();
            assert!(reply.starts_with("HTTP/1.1 200 "), "{reply}");
        }
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || ask(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))
            })
            .collect();
        for t in threads {
            assert!(t.join().unwrap().starts_with("HTTP/1.1 200 "));
        }
    }

    #[test]
    fn seconds_are_exact_decimals() {
        assert_eq!(seconds(0), "0");
        assert_eq!(seconds(1_000), "0.000001");
        assert_eq!(seconds(1_500_000_000), "1.5");
        assert_eq!(seconds(2_000_000_000), "2");
    }
}
