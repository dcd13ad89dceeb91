//! The RPC agent between two processes on one host: with `transports = ["shm", "tcp"]`
//! on both sides the pipes negotiate `shm` (bootstrapped over tcp), and `tcp` when either
//! side's `transports` asks for tcp alone. Round trips, tensors byte for byte, metrics, and a peer
//! killed mid-call. The peer is this test binary re-run as a child process with
//! `RDZV_RPC_SHM_CHILD` set; parent and child meet at a `file://` store.

use std::time::{Duration, Instant};

use rdzv_core::negotiate::TransportKind;
use rdzv_uring::rpc::{init_rpc, CallContext, CallError, Message, RpcAgent, RpcOptions, Tensor};

mod common;

use common::{
    echo, echo_tensor, finish, pattern, serve_until_joined, sleep_ms, spawn_peer, Peer,
    PEER_EXIT_LIMIT,
};

const CHILD_ENV: &str = "RDZV_RPC_SHM_CHILD";
const STORE_ENV: &str = "RDZV_RPC_SHM_STORE";
const TRANSPORTS_ENV: &str = "RDZV_RPC_SHM_TRANSPORTS";

/// `transports`: `None` for both `shm` and `tcp` (the agent's default offers tcp only).
fn options(url: &str, transports: Option<&str>) -> RpcOptions {
    let mut options = RpcOptions::new(url)
        .with_handler("echo", echo)
        .with_handler("sleep", sleep_ms)
        .with_handler(
            "die",
            |_: &CallContext, _: Message| -> Result<Message, String> { std::process::abort() },
        );
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.num_worker_threads = 2;
    let list = transports.unwrap_or("shm,tcp");
    options.transports = Some(list.split(',').map(str::to_string).collect());
    options
}

/// The child: rank 1 ("peer"), serving until the parent's graceful shutdown (or its
/// own death by the `die` handler).
fn run_child() {
    let Ok(url) = std::env::var(STORE_ENV) else {
        std::process::exit(2)
    };
    let transports = std::env::var(TRANSPORTS_ENV).ok();
    serve_until_joined(init_rpc(
        "peer",
        1,
        Some(2),
        options(&url, transports.as_deref()),
    ))
}

/// Starts the child for `test` (this binary, running only that test) and the parent's
/// agent ("main", rank 0).
fn start(
    test: &str,
    dir: &tempfile::TempDir,
    parent_transports: Option<&str>,
    child_transports: Option<&str>,
) -> (RpcAgent, Peer) {
    let url = format!("file://{}", dir.path().join("store").display());
    let mut env = vec![(CHILD_ENV, "1"), (STORE_ENV, url.as_str())];
    if let Some(list) = child_transports {
        env.push((TRANSPORTS_ENV, list));
    }
    let child = spawn_peer(test, &env);
    let agent = init_rpc("main", 0, Some(2), options(&url, parent_transports))
        .unwrap_or_else(|e| panic!("parent init: {e}"));
    (agent, child)
}

#[test]
fn shm_is_negotiated_and_carries_round_trips_and_tensors() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return run_child();
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (agent, child) = start(
        "shm_is_negotiated_and_carries_round_trips_and_tensors",
        &dir,
        None,
        None,
    );
    assert!(
        agent.address().starts_with("shm://@"),
        "{}",
        agent.address()
    );
    assert!(agent.address().contains(";tcp://127.0.0.1:"));
    assert_eq!(agent.pipe_transport("peer"), None);

    let reply = agent.rpc_sync("peer", "echo", Message::from_payload(b"hi".to_vec()));
    assert_eq!(
        reply.map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"hi".to_vec())
    );
    assert_eq!(agent.pipe_transport("peer"), Some(TransportKind::Shm));
    let before = agent
        .network_data()
        .get("peer")
        .copied()
        .unwrap_or_default();
    assert_eq!(before.num_calls, 1);
    // Request: 40-byte header + "echo" + 2 payload bytes; response: header + payload.
    assert_eq!(before.total_sent_bytes, 40 + 4 + 2);
    assert_eq!(before.total_recv_bytes, 40 + 2);

    let mut sent = before.total_sent_bytes;
    for (len, seed) in [(0usize, 1u8), (1, 2), (1 << 20, 3), (64 << 20, 4)] {
        let data = pattern(len, seed);
        let request = Message::from_payload(vec![seed]).with_tensor(Tensor::cpu(data.clone()));
        let reply = agent
            .rpc_sync("peer", "echo", request)
            .unwrap_or_else(|e| panic!("{len} bytes: {e}"));
        let tensor = reply
            .tensors
            .first()
            .cloned()
            .unwrap_or_else(|| panic!("{len} bytes: no tensor came back"));
        assert_eq!(tensor.data.len(), len);
        assert!(tensor.data == data, "{len} bytes differ");
        let now = agent
            .network_data()
            .get("peer")
            .copied()
            .unwrap_or_default();
        assert!(now.total_sent_bytes >= sent + len as u64, "{len} bytes");
        assert!(now.total_recv_bytes >= len as u64, "{len} bytes");
        sent = now.total_sent_bytes;
    }
    // Calls in flight together on the one shm pipe.
    let futures: Vec<_> = (0..32usize)
        .map(|i| {
            let len = if i % 2 == 0 { 3 << 20 } else { i };
            let m = Message::default().with_tensor(Tensor::cpu(pattern(len, i as u8)));
            (len, i, agent.rpc_async("peer", "echo", m))
        })
        .collect();
    for (len, i, future) in futures {
        let reply = future.wait().unwrap_or_else(|e| panic!("call {i}: {e}"));
        let data = reply
            .tensors
            .first()
            .map(|t| t.data.clone())
            .unwrap_or_default();
        assert!(data == pattern(len, i as u8), "call {i} differs");
    }
    // Threads waiting in rpc_sync read replies off the ring themselves, each other's
    // included, while the pipe's reader thread sleeps.
    let agent = std::sync::Arc::new(agent);
    let threads: Vec<_> = (0..6u8)
        .map(|t| {
            let agent = std::sync::Arc::clone(&agent);
            std::thread::spawn(move || {
                for i in 0..100u32 {
                    let len = if i % 25 == 0 { 300 * 1024 } else { 8 };
                    let mut payload = vec![t];
                    payload.extend_from_slice(&i.to_le_bytes());
                    let request = Message::from_payload(payload)
                        .with_tensor(Tensor::cpu(pattern(len, t ^ i as u8)));
                    let reply = agent.rpc_sync("peer", "echo", request.clone());
                    assert_eq!(reply.map_err(|e| e.to_string()), Ok(request), "{t}/{i}");
                }
            })
        })
        .collect();
    for thread in threads {
        assert!(thread.join().is_ok());
    }
    let agent = std::sync::Arc::try_unwrap(agent).unwrap_or_else(|_| panic!("still shared"));
    let after = agent
        .network_data()
        .get("peer")
        .copied()
        .unwrap_or_default();
    assert_eq!(after.num_calls, 1 + 4 + 32 + 600);
    assert_eq!(after.total_errors, 0);
    assert_eq!(agent.pipe_transport("peer"), Some(TransportKind::Shm));
    finish(agent, child);
}

#[test]
fn tcp_is_negotiated_when_the_child_asks_for_it() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return run_child();
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (agent, child) = start(
        "tcp_is_negotiated_when_the_child_asks_for_it",
        &dir,
        None,
        Some("tcp"),
    );
    echo_tensor(&agent, "peer", 1 << 20, 7, "echo");
    assert_eq!(agent.pipe_transport("peer"), Some(TransportKind::Tcp));
    finish(agent, child);
}

#[test]
fn tcp_is_negotiated_when_the_caller_asks_for_it() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return run_child();
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (agent, child) = start(
        "tcp_is_negotiated_when_the_caller_asks_for_it",
        &dir,
        Some("tcp"),
        None,
    );
    assert!(agent.address().starts_with("tcp://"), "{}", agent.address());
    assert!(!agent.address().contains("shm://"));
    let reply = agent.rpc_sync("peer", "echo", Message::from_payload(vec![1, 2, 3]));
    assert_eq!(reply.map(|m| m.payload).ok(), Some(vec![1, 2, 3]));
    assert_eq!(agent.pipe_transport("peer"), Some(TransportKind::Tcp));
    finish(agent, child);
}

#[test]
fn shm_only_bootstraps_over_shm() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return run_child();
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (agent, child) = start("shm_only_bootstraps_over_shm", &dir, Some("shm"), None);
    assert!(!agent.address().contains("tcp://"), "{}", agent.address());
    let reply = agent.rpc_sync("peer", "echo", Message::from_payload(vec![4]));
    assert_eq!(reply.map(|m| m.payload).ok(), Some(vec![4]));
    assert_eq!(agent.pipe_transport("peer"), Some(TransportKind::Shm));
    finish(agent, child);
}

#[test]
fn a_peer_killed_mid_call_over_shm_fails_pending_calls_quickly() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return run_child();
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (agent, mut child) = start(
        "a_peer_killed_mid_call_over_shm_fails_pending_calls_quickly",
        &dir,
        None,
        None,
    );
    assert!(agent.rpc_sync("peer", "echo", Message::default()).is_ok());
    assert_eq!(agent.pipe_transport("peer"), Some(TransportKind::Shm));
    let pending = agent.rpc_async(
        "peer",
        "sleep",
        Message::from_payload(30_000u64.to_le_bytes().to_vec()),
    );
    let started = Instant::now();
    let died = agent.rpc_async("peer", "die", Message::default()).wait();
    let first = pending.wait();
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
    for result in [died, first] {
        match result {
            Err(CallError::PipeBroken { peer, .. }) => assert_eq!(peer, "peer"),
            other => panic!("expected a broken pipe, got {other:?}"),
        }
    }
    let status = child.wait(PEER_EXIT_LIMIT);
    assert!(!status.success());
    let errors = agent
        .network_data()
        .get("peer")
        .map(|d| d.total_errors)
        .unwrap_or_default();
    assert_eq!(errors, 2);
    assert!(agent.shutdown(false).is_ok());
}
