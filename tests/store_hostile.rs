//! Hostile input against the store server over raw sockets: garbage, wrong magic, a
//! non-VALIDATE first message, requests split byte by byte, claimed 4 GB lengths, a
//! slowloris peer and clients killed mid-wait. After each one the server still answers
//! other clients, no key is lost and no waiter is left behind.
//!
//! Frames are written as literal bytes (PyTorch 2.15 layout) so these tests do not depend
//! on rdzv's own codec.
//!
//! Two memory-budget tests (issue 24) run `rdzv store serve` as a child with small
//! limits (`store_serve`): the descriptor limit, and SIGTERM with pipelined requests.
//! The attack classes that measure a good client's latency, with their RSS and liveness
//! checks, are `store_latency.rs`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use rdzv::uring::store::tcp::TcpStore;
use rdzv::uring::{IoMode, ServerOptions, Store, StoreServer};

#[macro_use]
mod store_io;
mod store_serve;

use store_serve::{
    closed_by_server, get_frame, set_and_confirm, set_frame, string, Serve, MAX_CONN, VALIDATE,
};

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
// The descriptor limit and SIGTERM (issue 24), against a `store serve` process with the
// budget of `store_serve`. The attack classes that measure a good client's latency are
// in `store_latency.rs`, a test binary of their own, so that nothing runs beside them.

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
    at_the_fd_limit_new_clients_are_refused_promptly,
    sigterm_closes_after_a_whole_reply,
);
