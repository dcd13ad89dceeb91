//! Access control over real sockets (issue 24): `rdzv store serve --allow` and
//! `--token-file` run as a child process on each event loop (`--io io-uring` and
//! `--io epoll`), and real clients are admitted or refused:
//!
//! * an allowlist that excludes the client closes it at accept, counts it in STATS'
//!   `refused_peers` and logs it; one that includes it serves as usual;
//! * a prefix-bound token can SET, GET, ADD, WAIT and DELETE inside its prefix; each
//!   request outside it, and `GETNUMKEYS` / `LIST_KEYS` / `STATS` (which see every
//!   tenant), closes the connection;
//! * a bad token, no token, and a PyTorch client (`VALIDATE` first) are refused, the
//!   latter with a log line saying that the server requires a token;
//! * STATS' three refusal counters equal the refusals made, and so do `/metrics`'
//!   `rdzv_store_refused_{peers,tokens,requests}_total`.
//!
//! The client side of the handshake against a stand-in server is `tests/store_token.rs`.
//! The rules themselves are tested in core (`core/src/store/access/tests.rs`,
//! `core/src/store/session/tests/auth.rs`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdzv::core::store::codec::{decode_response, Decoded, Limits, PendingReply};
use rdzv::core::store::{QueryType, Request, Response, StoreStats, VALIDATION_MAGIC};
use rdzv::uring::store::tcp::{StoreToken, TcpStore, TcpStoreOptions};
use rdzv::uring::{IoMode, Store, StoreError};

#[macro_use]
mod store_io;

/// A token without a prefix: every key, STATS included.
const ADMIN: &str = "6tq2bX0n8Wc1pFv4LmZs7QyR";
/// A token bound to the keys a job names `job1/...` (on the wire `/job1/...`).
const JOB1: &str = "f0H3kd8Jq2LmZp5Vw9XyTb1C";
const WRONG: &str = "0000000000000000wrong";

const TIMEOUT: Duration = Duration::from_secs(5);
/// The timeout of a client that is refused by being closed (it retries until then).
const SHORT: Duration = Duration::from_millis(300);

/// A `rdzv store serve` child on 127.0.0.1, its stderr (the log) in a file.
struct Serve {
    peer: rdzv_test_support::Peer,
    port: u16,
    /// `--metrics`' address, when the flags ask for it.
    metrics: Option<SocketAddr>,
    log: PathBuf,
    dir: tempfile::TempDir,
}

impl Serve {
    /// Starts the server on `io` with `access` flags; `{tokens}` in them is replaced by
    /// the path of a token file holding [`ADMIN`] and [`JOB1`] bound to `/job1/`.
    fn start(io: IoMode, access: &[&str]) -> Serve {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let tokens = dir.path().join("tokens");
        std::fs::write(
            &tokens,
            format!("# operators\n{ADMIN}\n# job 1\n{JOB1} /job1/\n"),
        )
        .expect("writing the token file");
        let log = dir.path().join("server.log");
        let stderr = std::fs::File::create(&log).expect("the server's log file");
        let io = match io {
            IoMode::Epoll => "epoll",
            _ => "io-uring",
        };
        let mut command = Command::new(env!("CARGO_BIN_EXE_rdzv"));
        command
            .args(["store", "serve", "--host", "127.0.0.1", "--port", "0"])
            .args(["--threads", "1", "--io", io])
            .args(
                access
                    .iter()
                    .map(|a| a.replace("{tokens}", &tokens.display().to_string())),
            )
            .env("RUST_LOG", "warn")
            .env_remove("RDZV_TOKEN")
            .env_remove("RDZV_TOKEN_FILE")
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut peer = rdzv_test_support::Peer::spawn("rdzv store serve", command);
        let stdout = peer.child_mut().stdout.take().expect("stdout");
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        stdout.read_line(&mut line).expect("the listening line");
        let port = line
            .trim()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                panic!("unexpected first line {line:?}; the server's log:\n{log}")
            });
        let metrics = access.contains(&"--metrics").then(|| {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("the metrics line");
            line.trim()
                .strip_prefix("metrics on http://")
                .and_then(|rest| rest.strip_suffix("/metrics"))
                .and_then(|addr| addr.parse().ok())
                .unwrap_or_else(|| panic!("unexpected metrics line {line:?}"))
        });
        Serve {
            peer,
            port,
            metrics,
            log,
            dir,
        }
    }

    /// The refusal counters of a `/metrics` scrape: peers, tokens, requests; each
    /// with its `# HELP` and `# TYPE ... counter` lines.
    fn scraped_refusals(&self) -> (u64, u64, u64) {
        let addr = self.metrics.expect("the server was started with --metrics");
        let mut stream = TcpStream::connect(addr).expect("connecting to /metrics");
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).expect("the scrape");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        let counter = |kind: &str| -> u64 {
            let name = format!("rdzv_store_refused_{kind}_total");
            assert!(reply.contains(&format!("# HELP {name} ")), "{reply}");
            assert!(reply.contains(&format!("# TYPE {name} counter")), "{reply}");
            reply
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {name} in\n{reply}"))
        };
        (counter("peers"), counter("tokens"), counter("requests"))
    }

    /// An rdzv client sending `token` (none: PyTorch's handshake).
    fn client(&self, token: Option<&str>) -> Result<TcpStore, StoreError> {
        self.client_within(token, TIMEOUT)
    }

    /// [`Serve::client`] with its own timeout: a client the server closes during the
    /// handshake retries until then (only a refused token stops it at once).
    fn client_within(
        &self,
        token: Option<&str>,
        timeout: Duration,
    ) -> Result<TcpStore, StoreError> {
        let mut options = TcpStoreOptions::client("127.0.0.1", self.port);
        options.timeout = timeout;
        options.token = token.map(|t| StoreToken::new(t).expect("a well-formed token"));
        TcpStore::new(options)
    }

    fn admin(&self) -> TcpStore {
        self.client(Some(ADMIN))
            .expect("the admin token is accepted")
    }

    /// Waits until the server's log has a line containing every one of `needles`;
    /// returns that line.
    fn log_line(&self, needles: &[&str]) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            if let Some(line) = log
                .lines()
                .find(|line| needles.iter().all(|n| line.contains(n)))
            {
                return line.to_string();
            }
            assert!(
                Instant::now() < deadline,
                "no log line with {needles:?}; the server's log:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.peer.child_mut().kill();
        let _ = self.peer.child_mut().wait();
        let _ = &self.dir;
    }
}

/// A raw TCP connection from `source` (a loopback address) to the server.
fn raw_from(source: &str, port: u16) -> TcpStream {
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("a socket");
    let source: SocketAddr = format!("{source}:0").parse().unwrap();
    socket
        .bind(&source.into())
        .expect("binding a loopback source");
    let server: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    socket.connect(&server.into()).expect("connecting");
    let stream = TcpStream::from(socket);
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    stream
}

fn frame(requests: &[Request<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    for request in requests {
        request.encode_into(&mut out);
    }
    out
}

/// Whether the server closes `stream` (EOF or reset) before answering anything.
fn closed_unanswered(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    match stream.read(&mut buf) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

/// PyTorch's handshake on a raw connection (no token); no reply is due.
fn raw_validate(stream: &mut TcpStream) {
    let request = frame(&[Request::Validate {
        magic: VALIDATION_MAGIC,
    }]);
    stream.write_all(&request).expect("sending VALIDATE");
}

/// STATS over a raw connection, validated.
fn raw_stats(stream: &mut TcpStream) -> StoreStats {
    stream
        .write_all(&frame(&[Request::Stats]))
        .expect("sending STATS");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        let pending = PendingReply::new(QueryType::Stats, 0).expect("STATS has a reply");
        match decode_response(pending, &buf, &Limits::default()) {
            Ok(Decoded::Complete(Response::Stats(stats), _)) => return *stats,
            Ok(Decoded::Complete(other, _)) => panic!("a STATS reply, got {other:?}"),
            Ok(Decoded::Partial(_)) => {}
            Err(e) => panic!("a STATS reply: {e}"),
        }
        let n = stream.read(&mut chunk).expect("reading STATS");
        assert!(n > 0, "the server closed before answering STATS");
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn refusals(stats: &StoreStats) -> (u64, u64, u64) {
    (
        stats.refused_peers,
        stats.refused_tokens,
        stats.refused_requests,
    )
}

/// `--allow` without the client's address: closed at accept, before any byte is
/// answered, counted and logged; an allowed peer (another loopback source) is served
/// and reads the count.
fn an_allowlist_without_the_client_closes_it_at_accept(io: IoMode) {
    let serve = Serve::start(
        io,
        &[
            "--allow",
            "10.0.0.0/8,127.0.0.2/32",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    const REFUSED: u64 = 3;
    for _ in 0..REFUSED {
        let mut stream = raw_from("127.0.0.1", serve.port);
        // The handshake may or may not get out before the close; nothing comes back.
        let _ = stream.write_all(&frame(&[Request::Validate {
            magic: VALIDATION_MAGIC,
        }]));
        assert!(
            closed_unanswered(&mut stream),
            "a refused peer was answered"
        );
    }
    let line = serve.log_line(&["refusing store connection", "127.0.0.1"]);
    assert!(line.contains("--allow"), "{line}");
    // Scraped before any request is served: the refusals at accept are published
    // by themselves.
    assert_eq!(
        serve.scraped_refusals(),
        (REFUSED, 0, 0),
        "/metrics counts them"
    );
    let mut admin = raw_from("127.0.0.2", serve.port);
    raw_validate(&mut admin);
    let stats = raw_stats(&mut admin);
    assert_eq!(refusals(&stats), (REFUSED, 0, 0));
    // rdzv's client from the refused address fails within its timeout, each of its
    // tries refused at accept.
    let error = serve
        .client_within(None, SHORT)
        .expect_err("a refused client");
    // A close at accept may read as a reset; the message names the server either way.
    assert!(error.to_string().contains("127.0.0.1"), "{error}");
    assert!(error.to_string().contains("see its log"), "{error}");
    let (peers, tokens, requests) = refusals(&raw_stats(&mut admin));
    assert!(peers > REFUSED, "{peers} refused peers");
    assert_eq!((tokens, requests), (0, 0));
}

/// Each try of a client refused by `--allow` reads the close at accept as an end of
/// stream or as a reset (our handshake bytes were unread when the server closed),
/// depending on who runs first: either way its error says the server closed it and to
/// see the server's log. Looped to meet both orders; a token client is told to look
/// at the log too.
fn a_client_refused_at_accept_is_told_to_see_the_log(io: IoMode) {
    let serve = Serve::start(io, &["--allow", "10.0.0.0/8"]);
    const TRIES: usize = 25;
    for _ in 0..TRIES {
        let error = serve
            .client_within(None, Duration::from_millis(40))
            .expect_err("a refused client");
        let text = error.to_string();
        assert!(
            text.contains("closed the connection during the handshake")
                && text.contains("see its log"),
            "{text}"
        );
    }
    let error = serve
        .client_within(Some(JOB1), Duration::from_millis(40))
        .expect_err("a refused token client");
    assert!(error.to_string().contains("log"), "{error}");
}

/// `--allow` with the client's network: PyTorch's protocol as usual, nothing refused.
fn an_allowlist_with_the_client_serves_it(io: IoMode) {
    let serve = Serve::start(io, &["--allow", "10.0.0.0/8,127.0.0.0/8"]);
    let store = serve.client(None).expect("an allowed client connects");
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");
    assert_eq!(refusals(&store.stats().unwrap()), (0, 0, 0));
}

/// A prefix-bound token inside its prefix: every key operation, WAIT released by
/// another client of the same job.
fn a_prefix_token_works_inside_its_prefix(io: IoMode) {
    let serve = Serve::start(io, &["--token-file", "{tokens}"]);
    let job = serve
        .client(Some(JOB1))
        .expect("the job's token is accepted");
    job.set("job1/a", b"1").unwrap();
    assert_eq!(job.get("job1/a").unwrap(), b"1");
    assert_eq!(job.add("job1/n", 5).unwrap(), 5);
    assert_eq!(job.add("job1/n", -2).unwrap(), 3);
    let port = serve.port;
    let waiter = std::thread::spawn(move || {
        let mut options = TcpStoreOptions::client("127.0.0.1", port);
        options.timeout = TIMEOUT;
        options.token = Some(StoreToken::new(JOB1).unwrap());
        let store = TcpStore::new(options)?;
        store.wait(&["job1/late"], Some(TIMEOUT))
    });
    job.set("job1/late", b"here").unwrap();
    waiter
        .join()
        .unwrap()
        .expect("the WAIT inside the prefix is released");
    assert!(job.delete_key("job1/a").unwrap());
    assert!(!job.check(&["job1/a"]).unwrap());
    let stats = serve.admin().stats().unwrap();
    assert_eq!(refusals(&stats), (0, 0, 0));
    assert_eq!(stats.keys, 2, "job1/n and job1/late");
}

/// Each request outside the prefix, and the queries that see every tenant, closes
/// the connection; nothing outside the prefix is read or changed; each is counted.
fn a_prefix_token_is_refused_outside_its_prefix(io: IoMode) {
    let serve = Serve::start(
        io,
        &["--token-file", "{tokens}", "--metrics", "127.0.0.1:0"],
    );
    let admin = serve.admin();
    admin.set("job2/secret", b"theirs").unwrap();
    type Op = fn(&TcpStore) -> Result<(), StoreError>;
    // SET has no reply in PyTorch's protocol, so the client cannot see its refusal;
    // the next request on the connection does, and the value is unchanged.
    let outside: &[(&str, Op)] = &[
        ("GET", |s| s.get("job2/secret").map(drop)),
        ("SET", |s| s.set("job2/secret", b"mine")),
        ("ADD", |s| s.add("job2/n", 1).map(drop)),
        ("WAIT", |s| s.wait(&["job2/secret"], Some(TIMEOUT))),
        ("DELETE_KEY", |s| s.delete_key("job2/secret").map(drop)),
        ("SET on /job10", |s| s.set("job10", b"x")),
        ("MULTI_GET", |s| {
            s.multi_get(&["job1/a", "job2/secret"]).map(drop)
        }),
        ("GETNUMKEYS", |s| s.num_keys().map(drop)),
        ("LIST_KEYS", |s| s.list_keys().map(drop)),
        ("STATS", |s| s.stats().map(drop)),
    ];
    for (what, op) in outside {
        let job = serve
            .client(Some(JOB1))
            .expect("the job's token is accepted");
        let started = Instant::now();
        let result = op(&job);
        assert!(
            result.is_err() || what.starts_with("SET"),
            "{what} outside /job1/ was served"
        );
        assert!(
            started.elapsed() < TIMEOUT,
            "{what}: the refusal was waited out, not seen"
        );
        // The connection is gone: the next request inside the prefix fails too.
        assert!(
            job.get("job1/a").is_err(),
            "{what}: the connection lived on"
        );
    }
    assert_eq!(admin.get("job2/secret").unwrap(), b"theirs");
    assert!(!admin.check(&["job2/n", "job10"]).unwrap());
    let stats = admin.stats().unwrap();
    assert_eq!(refusals(&stats), (0, 0, outside.len() as u64));
    assert_eq!(
        serve.scraped_refusals(),
        refusals(&stats),
        "/metrics agrees"
    );
    let line = serve.log_line(&[
        "closing store connection",
        "outside the client's token prefix",
    ]);
    assert!(!line.contains(JOB1), "the log holds a token: {line}");
}

/// A bad token and no token are refused and counted; the errors say what to do.
fn a_bad_or_missing_token_is_refused(io: IoMode) {
    let serve = Serve::start(io, &["--token-file", "{tokens}"]);
    let admin = serve.admin();
    let started = Instant::now();
    let error = serve.client(Some(WRONG)).expect_err("a wrong token");
    assert!(matches!(error, StoreError::TokenRefused { .. }), "{error}");
    assert!(started.elapsed() < TIMEOUT, "a refused token was retried");
    assert_eq!(refusals(&admin.stats().unwrap()), (0, 1, 0));
    let line = serve.log_line(&["closing store connection", "not in the token file"]);
    assert!(!line.contains(WRONG), "the log holds a token: {line}");
    // Without a token the client retries its handshake until its timeout (the server
    // only closes); each try is one more refusal.
    let error = serve
        .client_within(None, SHORT)
        .expect_err("a client without a token");
    assert!(error.to_string().contains("see its log"), "{error}");
    let (peers, tokens, requests) = refusals(&admin.stats().unwrap());
    assert_eq!((peers, requests), (0, 0));
    assert!(tokens >= 2, "{tokens} token refusals counted");
}

/// A PyTorch client (`VALIDATE` first) is closed unanswered in token mode, counted,
/// and the log says the server requires a token.
fn a_pytorch_client_is_refused_in_token_mode(io: IoMode) {
    let serve = Serve::start(
        io,
        &["--token-file", "{tokens}", "--metrics", "127.0.0.1:0"],
    );
    let mut stream = raw_from("127.0.0.1", serve.port);
    stream
        .write_all(&frame(&[
            Request::Validate {
                magic: VALIDATION_MAGIC,
            },
            Request::Ping { nonce: 7 },
        ]))
        .unwrap();
    assert!(
        closed_unanswered(&mut stream),
        "a PyTorch client was answered"
    );
    let line = serve.log_line(&["closing store connection", "requires a token"]);
    assert!(line.contains("127.0.0.1"), "the peer is named: {line}");
    assert!(line.contains("PyTorch client"), "{line}");
    assert_eq!(refusals(&serve.admin().stats().unwrap()), (0, 1, 0));
    assert_eq!(serve.scraped_refusals(), (0, 1, 0), "/metrics agrees");
}

on_every_io!(
    an_allowlist_without_the_client_closes_it_at_accept,
    an_allowlist_with_the_client_serves_it,
    a_client_refused_at_accept_is_told_to_see_the_log,
    a_prefix_token_works_inside_its_prefix,
    a_prefix_token_is_refused_outside_its_prefix,
    a_bad_or_missing_token_is_refused,
    a_pytorch_client_is_refused_in_token_mode,
);
