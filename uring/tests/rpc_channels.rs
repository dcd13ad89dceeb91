//! The RPC agent's tensor channels with real processes: two workers on one host
//! negotiate `cma` (tensors of at least `min_channel_bytes` are read with
//! `process_vm_readv`, both ways), `channels = ["mpt", "basic"]` stripes them over extra
//! TCP connections, `channels = ["basic"]` forces everything inline, two agents in one
//! process negotiate `xth`, and a peer killed while it holds the caller's tensors (or
//! while they stream to it) fails the call quickly. The peer is this test binary re-run as a child
//! process with `RDZV_RPC_CHAN_CHILD` set; parent and child meet at a `file://` store.
//!
//! `cargo test --release -p rdzv-uring --test rpc_channels -- --ignored --nocapture`
//! runs `echo_bandwidth_by_channel`: the echo time per tensor size with everything inline
//! and with cma, which is how `DEFAULT_MIN_CHANNEL_BYTES` was chosen, and the 64 MiB
//! echo bandwidth.

use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use rdzv_core::negotiate::ChannelKind;
use rdzv_uring::rpc::{
    init_rpc, CallContext, CallError, Message, RpcAgent, RpcOptions, Tensor,
    DEFAULT_MIN_CHANNEL_BYTES,
};

mod common;

use common::{echo, echo_tensor, finish, pattern, serve_until_joined, Peer, PEER_EXIT_LIMIT};

const CHILD_ENV: &str = "RDZV_RPC_CHAN_CHILD";
const STORE_ENV: &str = "RDZV_RPC_CHAN_STORE";
const CHANNELS_ENV: &str = "RDZV_RPC_CHAN_CHANNELS";
const MIN_BYTES_ENV: &str = "RDZV_RPC_CHAN_MIN_BYTES";
const MPT_CONNECTIONS_ENV: &str = "RDZV_RPC_CHAN_MPT_CONNECTIONS";

/// Returns a fresh tensor of the requested size (8 little-endian bytes) and pattern
/// seed (the 9th byte): a response whose tensor the caller did not send.
fn make(_: &CallContext, m: Message) -> Result<Message, String> {
    let (len, seed) = rdzv_test_support::parse_make_request(&m.payload)?;
    Ok(Message::default().with_tensor(Tensor::cpu(pattern(len, seed))))
}

/// Checks that every request tensor is `pattern(len, seed)` for the seed in the
/// payload, and answers with their lengths.
fn check(_: &CallContext, m: Message) -> Result<Message, String> {
    let seed = m.payload.first().copied().unwrap_or(0);
    let mut lengths = Vec::new();
    for (i, tensor) in m.tensors.iter().enumerate() {
        if tensor.data != pattern(tensor.data.len(), seed) {
            return Err(format!("tensor {i} differs"));
        }
        lengths.extend_from_slice(&(tensor.data.len() as u64).to_le_bytes());
    }
    Ok(Message::from_payload(lengths))
}

fn options(url: &str, channels: Option<&str>, min_bytes: Option<u64>) -> RpcOptions {
    let mut options = RpcOptions::new(url)
        .with_handler("echo", echo)
        .with_handler("make", make)
        .with_handler("check", check)
        .with_handler(
            "die",
            |_: &CallContext, _: Message| -> Result<Message, String> { std::process::abort() },
        );
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.num_worker_threads = 2;
    options.transports = Some(vec!["tcp".into()]);
    options.channels = channels.map(|list| list.split(',').map(str::to_string).collect());
    if let Some(min_bytes) = min_bytes {
        options.min_channel_bytes = min_bytes;
    }
    options
}

/// The child: rank 1 ("peer"), serving until the parent's graceful shutdown (or its
/// own death by the `die` handler).
fn run_child() -> ! {
    let Ok(url) = std::env::var(STORE_ENV) else {
        std::process::exit(2)
    };
    let channels = std::env::var(CHANNELS_ENV).ok();
    let min_bytes = std::env::var(MIN_BYTES_ENV)
        .ok()
        .and_then(|v| v.parse().ok());
    let mut options = options(&url, channels.as_deref(), min_bytes);
    if let Some(connections) = std::env::var(MPT_CONNECTIONS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
    {
        options.mpt_connections = connections;
    }
    serve_until_joined(init_rpc("peer", 1, Some(2), options))
}

/// How a pair is configured: each side's `channels` and `min_channel_bytes`, and each
/// side's `mpt_connections`.
#[derive(Clone, Copy, Default)]
struct Setup<'a> {
    parent_channels: Option<&'a str>,
    child_channels: Option<&'a str>,
    min_bytes: Option<u64>,
    parent_connections: Option<u16>,
    child_connections: Option<u16>,
}

/// In the child process, serves as "peer" and never returns. In the parent, starts the
/// child for `test` (this binary, running only that test) and the parent's agent
/// ("main", rank 0) on a store in a fresh directory (returned: keep it alive).
fn start(test: &str, setup: Setup<'_>) -> (RpcAgent, Peer, tempfile::TempDir) {
    if std::env::var_os(CHILD_ENV).is_some() {
        run_child();
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
    let mut command = Command::new(exe);
    command
        .args([test, "--exact", "--nocapture", "--include-ignored"])
        .env(CHILD_ENV, "1")
        .env(STORE_ENV, &url);
    match setup.child_channels {
        Some(list) => command.env(CHANNELS_ENV, list),
        None => command.env_remove(CHANNELS_ENV),
    };
    match setup.min_bytes {
        Some(bytes) => command.env(MIN_BYTES_ENV, bytes.to_string()),
        None => command.env_remove(MIN_BYTES_ENV),
    };
    match setup.child_connections {
        Some(connections) => command.env(MPT_CONNECTIONS_ENV, connections.to_string()),
        None => command.env_remove(MPT_CONNECTIONS_ENV),
    };
    let child = Peer::spawn(format!("peer process for test {test}"), command);
    let mut options = options(&url, setup.parent_channels, setup.min_bytes);
    if let Some(connections) = setup.parent_connections {
        options.mpt_connections = connections;
    }
    let agent =
        init_rpc("main", 0, Some(2), options).unwrap_or_else(|e| panic!("parent init: {e}"));
    (agent, child, dir)
}

/// Why cma cannot run here, if it cannot (the test then says so and checks nothing).
fn cma_unavailable() -> Option<String> {
    rdzv_uring::channel::cma::viability()
        .err()
        .map(|e| e.to_string())
}

fn bytes_on(agent: &RpcAgent, channel: ChannelKind) -> u64 {
    agent
        .tensor_bytes_by_channel()
        .into_iter()
        .find(|&(kind, _)| kind == channel)
        .map_or(0, |(_, bytes)| bytes)
}

const SIZES: [usize; 4] = [0, 1, 1 << 20, 64 << 20];

/// Echoes each size alone, then all of them in one message, and has the peer check
/// request tensors and make response tensors: every byte is compared.
fn exercise(agent: &RpcAgent, peer: &str) {
    for (len, seed) in SIZES.into_iter().zip(1u8..) {
        let data = pattern(len, seed);
        let request = Message::from_payload(vec![seed]).with_tensor(Tensor::cpu(data.clone()));
        let reply = agent
            .rpc_sync(peer, "echo", request)
            .unwrap_or_else(|e| panic!("{len} bytes: {e}"));
        let tensor = reply
            .tensors
            .first()
            .unwrap_or_else(|| panic!("{len} bytes: no tensor came back"));
        assert_eq!(tensor.data.len(), len);
        assert!(tensor.data == data, "{len} bytes differ");
    }
    // All sizes in one message, both ways.
    let mut request = Message::from_payload(vec![9]);
    for len in SIZES {
        request = request.with_tensor(Tensor::cpu(pattern(len, 9)));
    }
    let reply = agent
        .rpc_sync(peer, "echo", request)
        .unwrap_or_else(|e| panic!("mixed: {e}"));
    let lengths: Vec<usize> = reply.tensors.iter().map(|t| t.data.len()).collect();
    assert_eq!(lengths, SIZES.to_vec());
    for tensor in &reply.tensors {
        assert!(
            tensor.data == pattern(tensor.data.len(), 9),
            "mixed differs"
        );
    }
    // Request tensors checked by the peer; response tensors made by the peer.
    let mut request = Message::from_payload(vec![5]);
    for len in SIZES {
        request = request.with_tensor(Tensor::cpu(pattern(len, 5)));
    }
    let reply = agent
        .rpc_sync(peer, "check", request)
        .unwrap_or_else(|e| panic!("check: {e}"));
    let expected: Vec<u8> = SIZES
        .iter()
        .flat_map(|&len| (len as u64).to_le_bytes())
        .collect();
    assert_eq!(reply.payload, expected);
    for (len, seed) in SIZES.into_iter().zip(20u8..) {
        let payload = rdzv_test_support::make_request(len as u64, seed);
        let reply = agent
            .rpc_sync(peer, "make", Message::from_payload(payload))
            .unwrap_or_else(|e| panic!("make {len}: {e}"));
        let data = reply.tensors.first().map(|t| t.data.clone());
        assert!(data == Some(pattern(len, seed)), "made {len} bytes differ");
    }
}

/// Every request tensor the parent sent in [`exercise`] of at least `min` bytes.
fn big_request_bytes(min: u64) -> u64 {
    let big: u64 = SIZES
        .iter()
        .map(|&len| len as u64)
        .filter(|&len| len > 0 && len >= min)
        .sum();
    // Alone, in the mixed echo and in the check.
    3 * big
}

#[test]
fn cma_is_negotiated_and_carries_tensors_both_ways() {
    if let Some(reason) = cma_unavailable() {
        eprintln!("skipped: cma is not viable on this host: {reason}");
        return;
    }
    let (agent, child, _dir) = start(
        "cma_is_negotiated_and_carries_tensors_both_ways",
        Setup::default(),
    );
    assert_eq!(agent.pipe_channel("peer"), None);
    exercise(&agent, "peer");
    assert_eq!(agent.pipe_channel("peer"), Some(ChannelKind::Cma));
    // The large request tensors went over cma, the small ones inline.
    assert_eq!(
        bytes_on(&agent, ChannelKind::Cma),
        big_request_bytes(DEFAULT_MIN_CHANNEL_BYTES)
    );
    assert_eq!(bytes_on(&agent, ChannelKind::Basic), 3);
    assert_eq!(bytes_on(&agent, ChannelKind::Xth), 0);
    // Calls in flight together, each lending its own buffer.
    let futures: Vec<_> = (0..16usize)
        .map(|i| {
            let len = if i % 2 == 0 { 3 << 20 } else { i };
            let m = Message::default().with_tensor(Tensor::cpu(pattern(len, i as u8)));
            (len, i, agent.rpc_async("peer", "echo", m))
        })
        .collect();
    for (len, i, future) in futures {
        let reply = future.wait().unwrap_or_else(|e| panic!("call {i}: {e}"));
        let data = reply.tensors.first().map(|t| t.data.clone());
        assert!(data == Some(pattern(len, i as u8)), "call {i} differs");
    }
    // Fire-and-forget calls whose responses carry lent tensors: nobody reads them, the
    // caller just acks, and the pipe stays healthy.
    for i in 0..4u8 {
        let m = Message::default().with_tensor(Tensor::cpu(pattern(2 << 20, i)));
        assert!(agent.remote("peer", "echo", m).is_ok());
    }
    assert!(agent
        .wait_until_pending_futures_flushed(Duration::from_secs(30))
        .is_ok());
    echo_tensor(&agent, "peer", 2 << 20, 77, "after remote");
    let network = agent
        .network_data()
        .get("peer")
        .copied()
        .unwrap_or_default();
    assert_eq!(network.total_errors, 0);
    // Out-of-band bytes count as sent and received.
    assert!(network.total_sent_bytes >= big_request_bytes(DEFAULT_MIN_CHANNEL_BYTES));
    assert!(network.total_recv_bytes >= 3 * (65 << 20));
    finish(agent, child);
}

#[test]
fn every_tensor_goes_over_cma_with_no_threshold() {
    if let Some(reason) = cma_unavailable() {
        eprintln!("skipped: cma is not viable on this host: {reason}");
        return;
    }
    let (agent, child, _dir) = start(
        "every_tensor_goes_over_cma_with_no_threshold",
        Setup {
            min_bytes: Some(0),
            ..Setup::default()
        },
    );
    exercise(&agent, "peer");
    assert_eq!(agent.pipe_channel("peer"), Some(ChannelKind::Cma));
    // Even the 1-byte tensor; a 0-byte one has nothing to read and stays inline.
    assert_eq!(bytes_on(&agent, ChannelKind::Cma), big_request_bytes(0));
    assert_eq!(bytes_on(&agent, ChannelKind::Basic), 0);
    finish(agent, child);
}

#[test]
fn channels_basic_forces_inline_tensors() {
    let (agent, child, _dir) = start(
        "channels_basic_forces_inline_tensors",
        Setup {
            parent_channels: Some("basic"),
            ..Setup::default()
        },
    );
    exercise(&agent, "peer");
    assert_eq!(agent.pipe_channel("peer"), Some(ChannelKind::Basic));
    assert_eq!(bytes_on(&agent, ChannelKind::Cma), 0);
    assert_eq!(bytes_on(&agent, ChannelKind::Basic), big_request_bytes(0));
    finish(agent, child);
}

#[test]
fn channel_priorities_must_agree() {
    if let Some(reason) = cma_unavailable() {
        eprintln!("skipped: cma is not viable on this host: {reason}");
        return;
    }
    // The parent prefers basic to cma, the child (defaults) cma to basic: as in
    // TensorPipe, the pipe is refused rather than used with two different choices.
    let (agent, child, _dir) = start(
        "channel_priorities_must_agree",
        Setup {
            parent_channels: Some("basic,cma"),
            ..Setup::default()
        },
    );
    match agent.rpc_sync("peer", "echo", Message::default()) {
        Err(CallError::Handshake { peer, reason }) => {
            assert_eq!(peer, "peer");
            let reason = reason.to_string();
            assert!(
                reason.contains("Inconsistent channel selection"),
                "{reason}"
            );
        }
        other => panic!("expected a handshake error, got {other:?}"),
    }
    assert_eq!(agent.pipe_channel("peer"), None);
    finish(agent, child);
}

#[test]
fn unknown_and_unrun_channels_are_errors() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    // A CUDA channel without a CUDA runtime is left out; alone, nothing is left.
    for (list, expected) in [
        ("basic,pigeon", "pigeon"),
        ("cuda_ipc", "cuda_ipc needs a CUDA runtime"),
    ] {
        let err = init_rpc("main", 0, Some(1), options(&url, Some(list), None))
            .map(|_| ())
            .expect_err("bad channels option");
        assert!(err.to_string().contains(expected), "{err}");
        let checked = options(&url, Some(list), None).check().map(|_| ());
        assert_eq!(
            checked.map_err(|e| e.to_string()),
            Err(err.to_string()),
            "check() and init_rpc refuse {list} alike"
        );
    }
    // mpt needs lane threads; a faulty worker runs lanes too (fault injection wraps
    // their senders), so it offers mpt.
    let faulty_dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let faulty_url = format!("file://{}", faulty_dir.path().join("store").display());
    let mut faulty = options(&faulty_url, Some("mpt"), None);
    faulty.fault_injection.fail_handlers = vec!["echo".into()];
    let agent = init_rpc("main", 0, Some(1), faulty)
        .unwrap_or_else(|e| panic!("mpt alone under fault injection: {e}"));
    assert!(agent.address().contains("mpt://"), "{}", agent.address());
    assert!(agent.shutdown(false).is_ok());
    for connections in [0, 65] {
        let mut bad = options(&url, None, None);
        bad.mpt_connections = connections;
        let err = init_rpc("main", 0, Some(1), bad)
            .map(|_| ())
            .expect_err("bad connection count");
        assert!(err.to_string().contains("mpt_connections"), "{err}");
    }
}

/// `RpcOptions::check` says what the started agent offers: its transports are the
/// address's, in order, and mpt is offered exactly when the address lists mpt connections.
#[test]
fn check_offers_what_init_rpc_starts() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    for (transports, channels) in [
        (None, None),
        (Some("tcp"), Some("mpt,basic")),
        (Some("tcp"), Some("basic")),
        (Some("shm,tcp"), None),
    ] {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let url = format!("file://{}", dir.path().join("store").display());
        let mut opts = options(&url, channels, None);
        opts.transports = transports.map(|list| list.split(',').map(str::to_string).collect());
        let offer = opts
            .check()
            .unwrap_or_else(|e| panic!("{transports:?}/{channels:?}: {e}"));
        let agent = init_rpc("main", 0, Some(1), opts)
            .unwrap_or_else(|e| panic!("{transports:?}/{channels:?}: {e}"));
        let schemes: Vec<&str> = agent
            .address()
            .split(';')
            .filter_map(|a| a.split("://").next())
            .filter(|s| *s != "mpt")
            .collect();
        let offered: Vec<&str> = offer.transports.iter().map(|(k, _)| k.name()).collect();
        assert_eq!(schemes, offered, "{}", agent.address());
        let mpt = offer
            .channels
            .iter()
            .any(|(k, _, _)| *k == ChannelKind::Mpt);
        assert_eq!(
            agent.address().contains("mpt://"),
            mpt,
            "{}",
            agent.address()
        );
        assert!(agent.shutdown(false).is_ok());
    }
}

#[test]
fn mpt_is_negotiated_and_stripes_tensors_both_ways() {
    // Three mpt connections on the parent's pipe (an odd split); the child would open two.
    let (agent, child, _dir) = start(
        "mpt_is_negotiated_and_stripes_tensors_both_ways",
        Setup {
            parent_channels: Some("mpt,basic"),
            child_channels: Some("mpt,basic"),
            parent_connections: Some(3),
            child_connections: Some(2),
            ..Setup::default()
        },
    );
    assert!(
        agent.address().contains("mpt://127.0.0.1:"),
        "{}",
        agent.address()
    );
    exercise(&agent, "peer");
    assert_eq!(agent.pipe_channel("peer"), Some(ChannelKind::Mpt));
    assert_eq!(
        bytes_on(&agent, ChannelKind::Mpt),
        big_request_bytes(DEFAULT_MIN_CHANNEL_BYTES)
    );
    assert_eq!(bytes_on(&agent, ChannelKind::Basic), 3);
    // Threads calling at once, large and small tensors interleaved: each frame's
    // stripes must follow it in order on the shared mpt connections, both ways.
    let results: Vec<Result<(), String>> = thread::scope(|scope| {
        let workers: Vec<_> = (0..6u8)
            .map(|t| {
                let agent = &agent;
                scope.spawn(move || {
                    for i in 0..6u8 {
                        let seed = t.wrapping_mul(16).wrapping_add(i);
                        let len = match (t + i) % 3 {
                            0 => (3 << 20) + usize::from(seed),
                            1 => 300 * 1024 + usize::from(seed),
                            _ => usize::from(seed),
                        };
                        let data = pattern(len, seed);
                        let m = Message::default().with_tensor(Tensor::cpu(data.clone()));
                        let reply = agent
                            .rpc_sync("peer", "echo", m)
                            .map_err(|e| format!("thread {t} call {i}: {e}"))?;
                        if reply.tensors.first().map(|t| &t.data) != Some(&data) {
                            return Err(format!("thread {t} call {i}: {len} bytes differ"));
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|_| Err("a caller panicked".into())))
            .collect()
    });
    for result in results {
        result.unwrap_or_else(|e| panic!("{e}"));
    }
    // Async calls in flight together, and fire-and-forget ones.
    let futures: Vec<_> = (0..12usize)
        .map(|i| {
            let len = if i % 2 == 0 { 2 << 20 } else { i };
            let m = Message::default().with_tensor(Tensor::cpu(pattern(len, i as u8)));
            (len, i, agent.rpc_async("peer", "echo", m))
        })
        .collect();
    for i in 0..3u8 {
        let m = Message::default().with_tensor(Tensor::cpu(pattern(1 << 20, i)));
        assert!(agent.remote("peer", "echo", m).is_ok());
    }
    for (len, i, future) in futures {
        let reply = future.wait().unwrap_or_else(|e| panic!("call {i}: {e}"));
        let data = reply.tensors.first().map(|t| t.data.clone());
        assert!(data == Some(pattern(len, i as u8)), "call {i} differs");
    }
    let network = agent
        .network_data()
        .get("peer")
        .copied()
        .unwrap_or_default();
    assert_eq!(network.total_errors, 0);
    assert!(network.total_recv_bytes >= 3 * (65 << 20));
    // A pipe that is dropped is re-created with mpt connections of its own.
    agent.reset_pipes();
    thread::sleep(Duration::from_millis(100));
    echo_tensor(&agent, "peer", 3 << 20, 42, "after reset_pipes");
    assert_eq!(agent.pipe_channel("peer"), Some(ChannelKind::Mpt));
    finish(agent, child);
}

#[test]
fn mpt_offered_by_one_side_only_falls_back_to_basic() {
    // The child offers only basic: mpt is not negotiated, everything goes inline and
    // no mpt connection is opened.
    let (agent, child, _dir) = start(
        "mpt_offered_by_one_side_only_falls_back_to_basic",
        Setup {
            parent_channels: Some("mpt,basic"),
            child_channels: Some("basic"),
            ..Setup::default()
        },
    );
    echo_tensor(&agent, "peer", 1 << 20, 4, "echo");
    assert_eq!(agent.pipe_channel("peer"), Some(ChannelKind::Basic));
    assert_eq!(bytes_on(&agent, ChannelKind::Mpt), 0);
    finish(agent, child);
}

#[test]
fn a_peer_killed_while_mpt_streams_fails_the_call_quickly() {
    let (agent, mut child, _dir) = start(
        "a_peer_killed_while_mpt_streams_fails_the_call_quickly",
        Setup {
            parent_channels: Some("mpt,basic"),
            child_channels: Some("mpt,basic"),
            ..Setup::default()
        },
    );
    assert!(agent.rpc_sync("peer", "echo", Message::default()).is_ok());
    // The peer dies in a handler while other calls' 64 MiB tensors stream to it.
    let streaming: Vec<_> = (0..2u8)
        .map(|i| {
            agent.rpc_async(
                "peer",
                "check",
                Message::from_payload(vec![i]).with_tensor(Tensor::cpu(pattern(64 << 20, i))),
            )
        })
        .collect();
    let started = Instant::now();
    let died = agent
        .rpc_async(
            "peer",
            "die",
            Message::default().with_tensor(Tensor::cpu(pattern(1 << 20, 9))),
        )
        .wait();
    let others: Vec<_> = streaming.into_iter().map(|f| f.wait()).collect();
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    match died {
        Err(CallError::PipeBroken { peer, .. }) => assert_eq!(peer, "peer"),
        other => panic!("expected a broken pipe, got {other:?}"),
    }
    for other in others {
        match other {
            Ok(reply) => assert_eq!(reply.payload, (64u64 << 20).to_le_bytes().to_vec()),
            Err(CallError::PipeBroken { peer, .. }) => assert_eq!(peer, "peer"),
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    let status = child.wait(PEER_EXIT_LIMIT);
    assert!(!status.success());
    assert!(agent.shutdown(false).is_ok());
}

#[test]
fn xth_between_two_agents_in_one_process() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    let other = {
        let url = url.clone();
        thread::spawn(move || init_rpc("bob", 1, Some(2), options(&url, None, None)))
    };
    let alice = init_rpc("alice", 0, Some(2), options(&url, None, None))
        .unwrap_or_else(|e| panic!("alice: {e}"));
    let bob = other
        .join()
        .unwrap_or_else(|_| panic!("bob's thread panicked"))
        .unwrap_or_else(|e| panic!("bob: {e}"));
    exercise(&alice, "bob");
    assert_eq!(alice.pipe_channel("bob"), Some(ChannelKind::Xth));
    assert_eq!(
        bytes_on(&alice, ChannelKind::Xth),
        big_request_bytes(DEFAULT_MIN_CHANNEL_BYTES)
    );
    assert_eq!(bytes_on(&alice, ChannelKind::Cma), 0);
    // The responses went back over xth too.
    assert!(bytes_on(&bob, ChannelKind::Xth) >= 3 * (65 << 20));
    // And the other way round.
    echo_tensor(&bob, "alice", 2 << 20, 3, "echo");
    assert_eq!(bob.pipe_channel("alice"), Some(ChannelKind::Xth));
    let t = thread::spawn(move || bob.join().map_err(|e| e.to_string()));
    assert_eq!(alice.join().map_err(|e| e.to_string()), Ok(()));
    assert_eq!(t.join().ok(), Some(Ok(())));
}

#[test]
fn a_peer_killed_holding_lent_tensors_fails_the_call_quickly() {
    if let Some(reason) = cma_unavailable() {
        eprintln!("skipped: cma is not viable on this host: {reason}");
        return;
    }
    let (agent, mut child, _dir) = start(
        "a_peer_killed_holding_lent_tensors_fails_the_call_quickly",
        Setup::default(),
    );
    assert!(agent.rpc_sync("peer", "echo", Message::default()).is_ok());
    // The peer pulls 64 MiB over cma, then dies in the handler, while another call's
    // 64 MiB is lent to it.
    let lent = agent.rpc_async(
        "peer",
        "check",
        Message::from_payload(vec![1]).with_tensor(Tensor::cpu(pattern(64 << 20, 1))),
    );
    let started = Instant::now();
    let died = agent
        .rpc_async(
            "peer",
            "die",
            Message::default().with_tensor(Tensor::cpu(pattern(64 << 20, 2))),
        )
        .wait();
    let other = lent.wait();
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    match died {
        Err(CallError::PipeBroken { peer, .. }) => assert_eq!(peer, "peer"),
        other => panic!("expected a broken pipe, got {other:?}"),
    }
    // The other call either finished before the peer died or failed with it.
    match other {
        Ok(reply) => assert_eq!(reply.payload, (64u64 << 20).to_le_bytes().to_vec()),
        Err(CallError::PipeBroken { peer, .. }) => assert_eq!(peer, "peer"),
        Err(e) => panic!("unexpected error: {e}"),
    }
    let status = child.wait(PEER_EXIT_LIMIT);
    assert!(!status.success());
    assert!(agent.shutdown(false).is_ok());
}

/// One echo of `data` to "peer", timed.
fn echo_once(agent: &RpcAgent, data: &[u8]) -> Duration {
    let message = Message::default().with_tensor(Tensor::cpu(data.to_vec()));
    let started = Instant::now();
    let reply = agent
        .rpc_sync("peer", "echo", message)
        .unwrap_or_else(|e| panic!("{} bytes: {e}", data.len()));
    let elapsed = started.elapsed();
    assert_eq!(
        reply.tensors.first().map(|t| t.data.len()),
        Some(data.len())
    );
    elapsed
}

const BENCH_SIZES: [usize; 7] = [
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    64 << 20,
];

#[test]
#[ignore = "a measurement: run in release with --ignored --nocapture"]
fn echo_bandwidth_by_channel() {
    if let Some(reason) = cma_unavailable() {
        eprintln!("skipped: cma is not viable on this host: {reason}");
        return;
    }
    // Two pairs at once, everything inline and everything over cma, their echoes
    // interleaved so that both see the same load.
    let pairs: Vec<(&str, tempfile::TempDir, RpcAgent, Peer)> = [("basic", u64::MAX), ("cma", 1)]
        .into_iter()
        .map(|(label, min_bytes)| {
            let (agent, child, dir) = start(
                "echo_bandwidth_by_channel",
                Setup {
                    min_bytes: Some(min_bytes),
                    ..Setup::default()
                },
            );
            (label, dir, agent, child)
        })
        .collect();
    println!("bytes      basic_p50_us  cma_p50_us  basic_GB/s  cma_GB/s (echo, both directions)");
    for len in BENCH_SIZES {
        let data = pattern(len, 1);
        let rounds = if len >= 64 << 20 { 11 } else { 51 };
        let mut times: Vec<Vec<Duration>> = vec![Vec::new(); pairs.len()];
        for (_, _, agent, _) in &pairs {
            let _ = echo_once(agent, &data);
        }
        for _ in 0..rounds {
            for ((_, _, agent, _), samples) in pairs.iter().zip(&mut times) {
                samples.push(echo_once(agent, &data));
            }
        }
        let p50: Vec<f64> = times
            .iter_mut()
            .map(|samples| {
                samples.sort();
                samples
                    .get(rounds / 2)
                    .copied()
                    .unwrap_or_default()
                    .as_secs_f64()
            })
            .collect();
        let gbps = |t: f64| 2.0 * len as f64 / t / 1e9;
        if let [basic, cma] = p50[..] {
            println!(
                "{len:<10} {:>12.1} {:>11.1} {:>11.2} {:>9.2}",
                basic * 1e6,
                cma * 1e6,
                gbps(basic),
                gbps(cma)
            );
        }
    }
    for (_, _dir, agent, child) in pairs {
        finish(agent, child);
    }
}
