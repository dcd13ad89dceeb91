//! The hostile-input cases that need no feature of a particular server loop, against any
//! server that speaks PyTorch's TCPStore protocol on 127.0.0.1 ([`Target`]): garbage,
//! wrong magic, a non-VALIDATE first message, requests split byte by byte, claimed 4 GB
//! lengths, a half-sent frame, a slowloris peer, clients (and a client process) gone
//! mid-wait, a client that never reads. After each one the server still answers other
//! clients, no key is lost and no waiter is left behind.
//!
//! Run by `store_hostile.rs` on both of rdzv's loops and by `tokio_store.rs` against the
//! tokio example driver. Frames are literal bytes (PyTorch 2.15 layout,
//! `store_serve`), so the cases do not depend on rdzv's own codec.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use rdzv::uring::store::tcp::TcpStore;
use rdzv::uring::{Store, StoreServer};

use crate::store_serve::{closed_by_server, get_frame, set_frame, string, VALIDATE};

/// A server under attack: where it listens, and what its engine holds.
pub(crate) trait Target {
    /// Its port on 127.0.0.1.
    fn port(&self) -> u16;
    /// Connections blocked in `WAIT`.
    fn waiters(&self) -> usize;
    /// Open client connections.
    fn connections(&self) -> usize;
}

impl Target for StoreServer {
    fn port(&self) -> u16 {
        StoreServer::port(self)
    }
    fn waiters(&self) -> usize {
        self.stats().waiters
    }
    fn connections(&self) -> usize {
        self.stats().connections
    }
}

/// A raw socket to `server`, with a 5 s read timeout.
pub(crate) fn raw(server: &impl Target) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// A well-behaved client still works and earlier keys are intact.
pub(crate) fn still_serves(server: &impl Target, key: &str, value: &[u8]) {
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    assert_eq!(store.get(key).unwrap(), value);
}

/// Stores the key every case checks is kept.
fn seed(server: &impl Target) {
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    store.set("precious", b"kept").unwrap();
}

pub(crate) fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Calls `$m!($args; case, case, ...)` with every case of this module, so that the list
/// is written once.
#[macro_export]
macro_rules! for_each_attack {
    ($m:ident!($($args:tt)*)) => {
        $m!(
            $($args)*;
            garbage_closes_only_that_connection,
            wrong_magic_is_closed,
            first_message_must_be_validate,
            requests_split_byte_by_byte_are_served,
            claimed_four_gigabytes_is_refused_at_once,
            truncated_frame_then_disconnect_loses_nothing,
            slowloris_costs_other_clients_nothing,
            disconnect_mid_wait_leaves_no_waiter,
            killed_client_process_mid_wait_leaves_no_waiter,
            a_client_that_never_reads_costs_others_nothing,
        );
    };
}

/// `fn case(arg: $ty)` for each case, running it against a fresh server `$make(arg)`.
#[macro_export]
macro_rules! attack_wrappers {
    ($make:ident($ty:ty); $($name:ident),* $(,)?) => {
        $(
            fn $name(arg: $ty) {
                $crate::store_attacks::$name(&$make(arg))
            }
        )*
    };
}

/// A `#[test] fn case()` for each case, running it against a fresh server `$make()`.
#[macro_export]
macro_rules! attack_tests {
    ($make:ident; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::store_attacks::$name(&$make())
            }
        )*
    };
}

pub(crate) fn garbage_closes_only_that_connection(server: &impl Target) {
    seed(server);
    let mut s = raw(server);
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert!(closed_by_server(&mut s));
    still_serves(server, "precious", b"kept");
}

pub(crate) fn wrong_magic_is_closed(server: &impl Target) {
    seed(server);
    let mut s = raw(server);
    s.write_all(&[0x00, 0xde, 0xad, 0xbe, 0xef]).unwrap();
    assert!(closed_by_server(&mut s));
    still_serves(server, "precious", b"kept");
}

pub(crate) fn first_message_must_be_validate(server: &impl Target) {
    seed(server);
    let mut s = raw(server);
    s.write_all(&get_frame(b"/precious")).unwrap();
    assert!(closed_by_server(&mut s));
    // A second VALIDATE later is also refused.
    let mut s = raw(server);
    s.write_all(&VALIDATE).unwrap();
    s.write_all(&VALIDATE).unwrap();
    assert!(closed_by_server(&mut s));
    still_serves(server, "precious", b"kept");
}

pub(crate) fn requests_split_byte_by_byte_are_served(server: &impl Target) {
    seed(server);
    let mut s = raw(server);
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
    still_serves(server, "split", b"across segments");
}

pub(crate) fn claimed_four_gigabytes_is_refused_at_once(server: &impl Target) {
    seed(server);
    let mut s = raw(server);
    s.write_all(&VALIDATE).unwrap();
    let mut f = vec![1u8];
    f.extend_from_slice(&(4u64 << 30).to_le_bytes());
    s.write_all(&f).unwrap();
    let started = Instant::now();
    assert!(closed_by_server(&mut s));
    assert!(started.elapsed() < Duration::from_secs(2));
    // The same for a value length, and for a key count.
    let mut s = raw(server);
    s.write_all(&VALIDATE).unwrap();
    let mut f = vec![1u8];
    string(&mut f, b"/k");
    f.extend_from_slice(&u64::MAX.to_le_bytes());
    s.write_all(&f).unwrap();
    assert!(closed_by_server(&mut s));
    let mut s = raw(server);
    s.write_all(&VALIDATE).unwrap();
    let mut f = vec![6u8];
    f.extend_from_slice(&(1u64 << 40).to_le_bytes());
    s.write_all(&f).unwrap();
    assert!(closed_by_server(&mut s));
    still_serves(server, "precious", b"kept");
}

pub(crate) fn truncated_frame_then_disconnect_loses_nothing(server: &impl Target) {
    seed(server);
    let mut s = raw(server);
    s.write_all(&VALIDATE).unwrap();
    let frame = set_frame(b"/half", b"never completed");
    s.write_all(&frame[..frame.len() / 2]).unwrap();
    drop(s);
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    assert!(!store.check(&["half"]).unwrap());
    assert_eq!(store.get("precious").unwrap(), b"kept");
}

pub(crate) fn slowloris_costs_other_clients_nothing(server: &impl Target) {
    seed(server);
    let mut slow = raw(server);
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

pub(crate) fn disconnect_mid_wait_leaves_no_waiter(server: &impl Target) {
    seed(server);
    let mut sockets = Vec::new();
    for _ in 0..20 {
        let mut s = raw(server);
        s.write_all(&VALIDATE).unwrap();
        let mut f = vec![6u8];
        f.extend_from_slice(&1u64.to_le_bytes());
        string(&mut f, b"/never");
        s.write_all(&f).unwrap();
        sockets.push(s);
    }
    wait_until("the 20 waits are registered", || server.waiters() == 20);
    drop(sockets);
    wait_until("the waiters are gone", || server.waiters() == 0);
    wait_until("the connections are gone", || server.connections() == 0);
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    store.set("never", b"finally").unwrap();
    assert_eq!(store.get("precious").unwrap(), b"kept");
}

pub(crate) fn killed_client_process_mid_wait_leaves_no_waiter(server: &impl Target) {
    seed(server);
    let exe = env!("CARGO_BIN_EXE_rdzv");
    let mut command = std::process::Command::new(exe);
    command
        .args(["store", "--addr", &format!("127.0.0.1:{}", server.port())])
        .args(["wait", "never-set", "--timeout", "60"])
        .stderr(std::process::Stdio::null());
    let mut child = rdzv_test_support::Peer::spawn("rdzv store wait", command);
    wait_until("the child waits", || server.waiters() == 1);
    child.child_mut().kill().unwrap();
    child.wait(Duration::from_secs(30));
    wait_until("its waiter is gone", || server.waiters() == 0);
    still_serves(server, "precious", b"kept");
}

/// A client that pipelines requests and does not read the replies: the server stops
/// reading it once its unsent replies pile up (bounded memory), keeps serving others,
/// and delivers every reply in order once the client reads.
pub(crate) fn a_client_that_never_reads_costs_others_nothing(server: &impl Target) {
    seed(server);
    let value = vec![0x5a; 64 << 10];
    let store = TcpStore::connect("127.0.0.1", server.port(), Duration::from_secs(5)).unwrap();
    store.set("big", &value).unwrap();
    // SET has no reply: a GET on the same connection makes sure it has been applied.
    assert_eq!(store.get("big").unwrap().len(), value.len());
    let mut greedy = raw(server);
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
