//! What the RPC agent's integration tests share: the handlers every test group
//! registers, deterministic tensor contents, metric lookup, and re-running this test
//! binary as a peer process.
//!
//! Each test binary compiles its own copy and uses part of it.
#![allow(dead_code)]

use std::thread;
use std::time::Duration;

use rdzv_uring::rpc::{init_rpc, CallContext, InitError, Message, RpcAgent, RpcOptions, Tensor};

/// What a raw client offers in its hello: tcp and the basic channel, for tests that speak
/// the handshake themselves.
pub(crate) fn tcp_basic_offer() -> rdzv_core::negotiate::Offer<'static> {
    use rdzv_core::negotiate::{ChannelKind, DeviceDescriptors, Offer, TransportKind};
    let mut offer = Offer::new();
    offer
        .add_transport(TransportKind::Tcp, 0, "tcp:*")
        .unwrap_or_else(|e| panic!("{e}"));
    offer
        .add_channel(ChannelKind::Basic, 0, DeviceDescriptors::cpu("any"))
        .unwrap_or_else(|e| panic!("{e}"));
    offer
}

/// A test agent's options: loopback, tcp, the `echo` handler, two pool threads, the
/// store's counter from 0.
pub(crate) fn loopback_tcp(url: &str) -> RpcOptions {
    let mut options = RpcOptions::new(url).with_handler("echo", echo);
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.num_worker_threads = 2;
    options.transports = Some(vec!["tcp".into()]);
    options
}

/// Alice (rank 0, on this thread) and bob (rank 1, on another) in a group of two that
/// meets at a `file://` store in `dir`, each started with `options(url, rank)`.
pub(crate) fn pair_of(
    dir: &tempfile::TempDir,
    options: impl Fn(&str, u32) -> RpcOptions + Clone + Send + 'static,
) -> (RpcAgent, RpcAgent) {
    let url = format!("file://{}", dir.path().join("store").display());
    let bob = {
        let (url, options) = (url.clone(), options.clone());
        thread::spawn(move || init_rpc("bob", 1, Some(2), options(&url, 1)))
    };
    let alice = init_rpc("alice", 0, Some(2), options(&url, 0));
    let alice = alice.unwrap_or_else(|e| panic!("alice: {e}"));
    let bob = bob
        .join()
        .unwrap_or_else(|_| panic!("bob's init panicked"))
        .unwrap_or_else(|e| panic!("bob: {e}"));
    (alice, bob)
}

/// Answers with the request.
pub(crate) fn echo(_: &CallContext, m: Message) -> Result<Message, String> {
    Ok(m)
}

/// Sleeps for the milliseconds in the payload's first 8 bytes (little-endian), then
/// answers `slept`.
pub(crate) fn sleep_ms(_: &CallContext, m: Message) -> Result<Message, String> {
    let ms = m
        .payload
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_le_bytes);
    thread::sleep(Duration::from_millis(ms));
    Ok(Message::from_payload(b"slept".to_vec()))
}

/// The request of [`sleep_ms`].
pub(crate) fn sleep_message(ms: u64) -> Message {
    Message::from_payload(ms.to_le_bytes().to_vec())
}

/// `len` bytes that differ with `seed` and do not repeat with a short period, so that a
/// misplaced, dropped or duplicated chunk shows.
pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(seed ^ (i >> 8) as u8)
        })
        .collect()
}

/// Echoes one CPU tensor of `pattern(len, seed)` through `peer`'s `echo` handler and
/// checks that the same bytes came back; panics naming `what` otherwise.
pub(crate) fn echo_tensor(agent: &RpcAgent, peer: &str, len: usize, seed: u8, what: &str) {
    let data = pattern(len, seed);
    let reply = agent
        .rpc_sync(
            peer,
            "echo",
            Message::default().with_tensor(Tensor::cpu(data.clone())),
        )
        .unwrap_or_else(|e| panic!("{what}: echo of {len} bytes: {e}"));
    assert!(
        reply.tensors.first().is_some_and(|t| t.data == data),
        "{what}: the {len}-byte tensor came back different"
    );
}

/// The value of one of the agent's metrics.
pub(crate) fn metric(agent: &RpcAgent, key: &str) -> Option<String> {
    agent
        .get_metrics()
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
}

pub(crate) use rdzv_test_support::{exit_when_parent_gone, Peer};

/// How long a parent waits for its peer process to exit after both joined.
pub(crate) const PEER_EXIT_LIMIT: Duration = Duration::from_secs(60);

/// Starts this test binary again, running only `test`, with `env` set: the test sees
/// its child variable and plays the peer instead of the parent. The peer exits as soon
/// as the returned [`Peer`] is dropped (a panicking parent drops it while unwinding).
pub(crate) fn spawn_peer(test: &str, env: &[(&str, &str)]) -> Peer {
    Peer::spawn_test(test, &[], env)
}

/// The peer process's life: serve until the parent's graceful shutdown, then exit 0
/// (4 if `init_rpc` failed, 5 if `join` did). It exits at once if the parent goes away.
pub(crate) fn serve_until_joined(agent: Result<RpcAgent, InitError>) -> ! {
    exit_when_parent_gone();
    match agent {
        Ok(agent) => match agent.join() {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                eprintln!("child join failed: {e}");
                std::process::exit(5);
            }
        },
        Err(e) => {
            eprintln!("child init failed: {e}");
            std::process::exit(4);
        }
    }
}

/// The graceful end of a parent and its peer process: both sides' `join`, and the
/// child exits cleanly.
pub(crate) fn finish(agent: RpcAgent, child: Peer) {
    assert_eq!(agent.join().map_err(|e| e.to_string()), Ok(()));
    child.expect_success(PEER_EXIT_LIMIT);
}
