//! The mpt channel between two real processes: this test binary re-runs itself as the
//! sending child (`RDZV_MPT_CHILD=<addr>:<connections>`, only the `child_role` test), which
//! connects its connections to the parent's listener and sends a list of transfers; the parent
//! checks every byte.

use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use rdzv_test_support::Peer;
use rdzv_uring::channel::mpt::{MptChannel, MptOptions};

const CHILD_ENV: &str = "RDZV_MPT_CHILD";
const SIZES: [usize; 5] = [0, 1, 1 << 20, 64 << 20, 64 << 20];

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
        .collect()
}

/// The child's side. Does nothing unless spawned by a test below.
#[test]
fn child_role() {
    let Some(role) = rdzv_test_support::peer_env(CHILD_ENV) else {
        return;
    };
    let (addr, connections) = role.rsplit_once('/').expect("addr/connections");
    let connections: usize = connections.parse().expect("connections");
    let streams: Vec<TcpStream> = (0..connections)
        .map(|_| TcpStream::connect(addr).expect("connect a connection"))
        .collect();
    let mut channel = MptChannel::new(streams, MptOptions::default()).expect("channel");
    for (id, len) in SIZES.into_iter().enumerate() {
        channel
            .send(id as u64, &pattern(len, id as u64))
            .expect("send");
    }
}

/// Runs the child with `connections` connections and receives every transfer; returns the seconds
/// the last 64 MiB transfer took.
fn exchange(connections: usize) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    let addr = listener.local_addr().expect("addr");
    let child = Peer::spawn_test(
        "child_role",
        &["--test-threads=1"],
        &[(CHILD_ENV, format!("{addr}/{connections}"))],
    );
    let streams: Vec<TcpStream> = (0..connections)
        .map(|_| listener.accept().expect("accept a connection").0)
        .collect();
    let mut channel = MptChannel::new(streams, MptOptions::default()).expect("channel");
    let mut last = 0.0;
    for (id, len) in SIZES.into_iter().enumerate() {
        let mut buf = vec![0u8; len];
        let started = Instant::now();
        channel.recv(id as u64, &mut buf).expect("recv");
        last = started.elapsed().as_secs_f64();
        assert!(
            buf == pattern(len, id as u64),
            "transfer {id} of {len} bytes differs"
        );
    }
    child.expect_success(Duration::from_secs(60));
    last
}

#[test]
fn four_connections_between_processes_byte_for_byte() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let seconds = exchange(4);
    println!(
        "mpt 64 MiB over 4 connections: {:.2} GB/s",
        (64u64 << 20) as f64 / seconds / 1e9
    );
}

#[test]
fn one_connection_between_processes_byte_for_byte() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let seconds = exchange(1);
    println!(
        "mpt 64 MiB over 1 connection: {:.2} GB/s",
        (64u64 << 20) as f64 / seconds / 1e9
    );
}
