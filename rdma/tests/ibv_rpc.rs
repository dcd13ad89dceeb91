//! An RPC exchange between two processes that negotiates the `ibv` transport: both run
//! `init_rpc` with `transports = ["ibv", "tcp"]` and the [`IbvPlugin`], the pipe moves from
//! the tcp bootstrap to ibv, and echo round trips carry tensors of 0 B, 1 B, 1 MiB and
//! 8 MiB (the last two zero-copy) verified byte for byte, in both directions, before a
//! graceful `join`; and a peer process killed in the middle of a call fails the ibv pipe's
//! pending calls within seconds (its bootstrap connection ends without the end-of-stream
//! byte), not after the RDMA retry timers. The second process is this test binary, re-run
//! with `RDZV_IBV_RPC_CHILD` set. Skipped (with the reason) on hosts without verbs;
//! `rdma/softroce/run` runs it in a Soft-RoCE VM, where a missing device fails it.

mod verbs_env;

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rdzv_core::negotiate::TransportKind;
use rdzv_rdma::ibv::transport::IbvPlugin;
use rdzv_test_support::Peer;
use rdzv_uring::rpc::{init_rpc, CallContext, CallError, Message, RpcAgent, RpcOptions, Tensor};

const CHILD_ENV: &str = "RDZV_IBV_RPC_CHILD";
const STORE_ENV: &str = "RDZV_IBV_RPC_STORE";
const TEST: &str = "two_processes_negotiate_ibv_and_echo_tensors";
const KILL_TEST: &str = "a_killed_peer_fails_the_ibv_pipe_quickly";
const SIZES: [usize; 4] = [0, 1, 1 << 20, 8 << 20];

/// Set in the parent when the child says its round trips are done (`child_done`), so the
/// parent's `reset_pipes` never ends a pipe under one of the child's calls (a reset
/// fails the calls in flight on the pipes it drops).
static CHILD_DONE: Mutex<bool> = Mutex::new(false);
static CHILD_DONE_CHANGED: Condvar = Condvar::new();

fn child_done(_: &CallContext, message: Message) -> Result<Message, String> {
    *CHILD_DONE.lock().unwrap_or_else(|p| p.into_inner()) = true;
    CHILD_DONE_CHANGED.notify_all();
    Ok(message)
}

/// Waits until the child's round trips are done.
fn await_child_done(timeout: Duration) {
    let done = CHILD_DONE.lock().unwrap_or_else(|p| p.into_inner());
    let (done, _) = CHILD_DONE_CHANGED
        .wait_timeout_while(done, timeout, |done| !*done)
        .unwrap_or_else(|p| p.into_inner());
    assert!(
        *done,
        "the child did not finish its round trips within {timeout:?}"
    );
}

fn echo(_: &CallContext, m: Message) -> Result<Message, String> {
    Ok(m)
}

fn options(url: &str) -> RpcOptions {
    let mut options = RpcOptions::new(url).with_handler("echo", echo);
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.num_worker_threads = 2;
    options.rpc_timeout = Duration::from_secs(120);
    options.transports = Some(vec!["ibv".into(), "tcp".into()]);
    options.transport_plugins = vec![IbvPlugin::default().into()];
    options
}

/// Deterministic content that differs per size and direction.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 11) as u8)
        .collect()
}

/// Echo round trips to `peer` with every size in [`SIZES`]; returns the tensor bytes sent.
fn round_trips(agent: &RpcAgent, peer: &str, seed: u8) -> u64 {
    let mut sent = 0;
    for (n, &len) in SIZES.iter().enumerate() {
        let data = pattern(len, seed.wrapping_add(n as u8));
        let payload = format!("{peer} {len}").into_bytes();
        let request = Message::from_payload(payload.clone()).with_tensor(Tensor::cpu(data.clone()));
        let reply = agent
            .rpc_sync(peer, "echo", request)
            .unwrap_or_else(|e| panic!("echo of {len} bytes to {peer}: {e}"));
        assert_eq!(reply.payload, payload);
        assert_eq!(reply.tensors.len(), 1, "{len} bytes");
        let got = reply
            .tensors
            .into_iter()
            .next()
            .map(|t| t.data)
            .unwrap_or_default();
        assert_eq!(got.len(), len);
        assert!(
            got == data,
            "the {len}-byte tensor differs after the round trip"
        );
        sent += len as u64;
        // The pipe exists after the first call: it must have moved to ibv.
        assert_eq!(
            agent.pipe_transport(peer),
            Some(TransportKind::Ibv),
            "pipe to {peer}"
        );
    }
    sent
}

fn check_metrics(agent: &RpcAgent, peer: &str, tensor_bytes: u64) {
    let data = agent.network_data().get(peer).copied().unwrap_or_default();
    assert_eq!(data.num_calls, SIZES.len() as u64, "{data:?}");
    assert_eq!(data.total_errors, 0, "{data:?}");
    assert!(data.total_sent_bytes >= tensor_bytes, "{data:?}");
    assert!(data.total_recv_bytes >= tensor_bytes, "{data:?}");
    let metric = |key: &str| {
        agent
            .get_metrics()
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    };
    assert_eq!(metric("agent.client_active_calls").as_deref(), Some("0"));
}

/// Runs this test binary's `test` as the second worker.
fn spawn_child(test: &str, url: &str) -> Peer {
    Peer::spawn_test(
        test,
        &["--test-threads=1"],
        &[(CHILD_ENV, "1"), (STORE_ENV, url)],
    )
}

/// The second worker: calls the first over ibv, then leaves with it.
fn run_child() {
    rdzv_test_support::exit_when_parent_gone();
    let url = std::env::var(STORE_ENV).unwrap_or_else(|_| panic!("{STORE_ENV} is not set"));
    let agent = init_rpc("child", 1, Some(2), options(&url))
        .unwrap_or_else(|e| panic!("child init_rpc: {e}"));
    let sent = round_trips(&agent, "parent", 100);
    check_metrics(&agent, "parent", sent);
    agent
        .rpc_sync("parent", "child_done", Message::default())
        .unwrap_or_else(|e| panic!("telling the parent the round trips are done: {e}"));
    agent.join().unwrap_or_else(|e| panic!("child join: {e}"));
}

#[test]
fn two_processes_negotiate_ibv_and_echo_tensors() {
    if std::env::var_os(CHILD_ENV).is_some() {
        run_child();
        return;
    }
    if verbs_env::selection_or_skip(TEST).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    let mut child = spawn_child(TEST, &url);
    let agent = init_rpc(
        "parent",
        0,
        Some(2),
        options(&url).with_handler("child_done", child_done),
    );
    let agent = match agent {
        Ok(agent) => agent,
        Err(e) => {
            drop(child);
            panic!("parent init_rpc: {e}");
        }
    };
    let sent = round_trips(&agent, "child", 0);
    check_metrics(&agent, "child", sent);
    // Reconnect covers ibv: after the pipes are dropped, the next call opens a new
    // one, which negotiates ibv again (a fresh queue pair) and moves the same bytes.
    await_child_done(Duration::from_secs(120));
    agent.reset_pipes();
    std::thread::sleep(Duration::from_millis(100));
    let data = pattern(1 << 20, 99);
    let reply = agent
        .rpc_sync(
            "child",
            "echo",
            Message::default().with_tensor(Tensor::cpu(data.clone())),
        )
        .unwrap_or_else(|e| panic!("echo after reset_pipes: {e}"));
    assert!(reply.tensors.first().is_some_and(|t| t.data == data));
    assert_eq!(agent.pipe_transport("child"), Some(TransportKind::Ibv));
    agent.join().unwrap_or_else(|e| panic!("parent join: {e}"));
    let status = child.wait(Duration::from_secs(60));
    assert!(status.success(), "the child failed: {status}");
}

/// The victim of [`a_killed_peer_fails_the_ibv_pipe_quickly`]: serves until its `die`
/// handler kills it.
fn run_victim() {
    rdzv_test_support::exit_when_parent_gone();
    let url = std::env::var(STORE_ENV).unwrap_or_else(|_| panic!("{STORE_ENV} is not set"));
    let options = options(&url)
        .with_handler(
            "die",
            |_: &CallContext, _: Message| -> Result<Message, String> { std::process::abort() },
        )
        .with_handler(
            "sleep",
            |_: &CallContext, m: Message| -> Result<Message, String> {
                std::thread::sleep(Duration::from_secs(60));
                Ok(m)
            },
        );
    let _agent =
        init_rpc("victim", 1, Some(2), options).unwrap_or_else(|e| panic!("victim init_rpc: {e}"));
    std::thread::sleep(Duration::from_secs(120));
    std::process::exit(3);
}

#[test]
fn a_killed_peer_fails_the_ibv_pipe_quickly() {
    if std::env::var_os(CHILD_ENV).is_some() {
        run_victim();
        return;
    }
    if verbs_env::selection_or_skip(KILL_TEST).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    let mut child = spawn_child(KILL_TEST, &url);
    let agent = match init_rpc("survivor", 0, Some(2), options(&url)) {
        Ok(agent) => agent,
        Err(e) => {
            drop(child);
            panic!("survivor init_rpc: {e}");
        }
    };
    let warm = Message::default().with_tensor(Tensor::cpu(pattern(1 << 20, 7)));
    assert!(agent.rpc_sync("victim", "echo", warm).is_ok());
    assert_eq!(agent.pipe_transport("victim"), Some(TransportKind::Ibv));
    let pending = agent.rpc_async("victim", "sleep", Message::default());
    let started = Instant::now();
    let died = agent.rpc_async("victim", "die", Message::default()).wait();
    let slept = pending.wait();
    let elapsed = started.elapsed();
    println!("pending calls failed {elapsed:?} after the kill");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    for result in [died, slept] {
        match result {
            Err(CallError::PipeBroken { peer, reason }) => {
                println!("broken pipe: {reason}");
                assert_eq!(peer, "victim");
            }
            other => panic!("expected a broken pipe, got {other:?}"),
        }
    }
    let status = child.wait(Duration::from_secs(60));
    assert!(!status.success());
    assert!(agent.shutdown(false).is_ok());
}
