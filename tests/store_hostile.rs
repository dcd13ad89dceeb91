//! Hostile input against the store server over raw sockets, on both event loops: the
//! cases any server must pass (`store_attacks`: garbage, wrong magic, a non-VALIDATE
//! first message, requests split byte by byte, claimed 4 GB lengths, a slowloris peer,
//! clients killed mid-wait, a client that never reads), and the same attacks spread over
//! two loops. After each one the server still answers other clients, no key is lost and
//! no waiter is left behind.
//!
//! Frames are written as literal bytes (PyTorch 2.15 layout) so these tests do not depend
//! on rdzv's own codec.
//!
//! Two memory-budget tests (issue 24) run `rdzv store serve` as a child with small
//! limits (`store_serve`): the descriptor limit, and SIGTERM with pipelined requests.
//! The attack classes that measure a good client's latency, with their RSS and liveness
//! checks, are `store_latency.rs`.

use std::io::{Read, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use rdzv::uring::store::tcp::TcpStore;
use rdzv::uring::{IoMode, ServerOptions, Store, StoreServer};

#[macro_use]
mod store_io;
#[macro_use]
mod store_attacks;
mod store_serve;

use store_attacks::{raw, still_serves, wait_until};
use store_serve::{
    closed_by_server, get_frame, set_and_confirm, string, Serve, MAX_CONN, VALIDATE,
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

// The cases any server must pass (`store_attacks`), each against a fresh server on `io`.
for_each_attack!(attack_wrappers!(server(IoMode)));

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

/// `on_every_io!` over this file's own cases and every `store_attacks` case.
macro_rules! on_every_io_with_the_attacks {
    ($($own:ident),*; $($attack:ident),* $(,)?) => {
        on_every_io!($($own,)* $($attack),*);
    };
}

for_each_attack!(on_every_io_with_the_attacks!(
    hostile_inputs_with_two_executors,
    at_the_fd_limit_new_clients_are_refused_promptly,
    sigterm_closes_after_a_whole_reply
));
