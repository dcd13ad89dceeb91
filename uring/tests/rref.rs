//! Remote references across real processes: three workers (`w0`, this test, and `w1`,
//! `w2`, this binary re-run with `RDZV_RREF_CHILD` set) on a `file://` store. The parent
//! drives the arrangements through handlers of the children (`hold` turns a fork into
//! an RRef and keeps it, `fetch` calls `to_here` on it, `drop` drops it, ...) and checks
//! the owner's counts with `wait_until_owners_and_forks_on_rank` after each.
//!
//! - every owner / user / fork arrangement: a user's `to_here` of a 4 MiB tensor, a
//!   user forking to a third worker, the owner forking to a user, a fork back to its
//!   owner, `remote()` to oneself, a user dropped before its value exists, a failing
//!   handler;
//! - the owner killed: `to_here` fails at once, naming the owner, and a `remote()` call
//!   to it fails without leaving a pending user;
//! - a failed `remote()` call (its send refused by fault injection, or timed out) leaves
//!   no pending user, `to_here` and `fork_to` say why, naming the owner, and `join`
//!   reports no leak; a missing or failing handler is the owner's error, not a failure;
//! - fault injection failing every control message twice: the retries converge;
//! - `to_here` of a 64 MiB tensor over tcp and over shm (ibv: `rdma/tests/ibv_rref.rs`,
//!   in the Soft-RoCE VM);
//! - `join`'s leak report by owner, and a soak of RRefs created, forked and dropped.

use std::collections::HashMap;
use std::process::Command;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use rdzv_core::rpc::name::WorkerId;
use rdzv_uring::rpc::{
    init_rpc, CallContext, CallError, CallErrorKind, FaultInjection, Message, RRef,
    RRefRetryOptions, RpcAgent, RpcOptions, Tensor, UsageError,
};

mod common;

use common::{pattern, serve_until_joined, Peer, PEER_EXIT_LIMIT};

const CHILD_ENV: &str = "RDZV_RREF_CHILD";
const STORE_ENV: &str = "RDZV_RREF_STORE";
const WORLD_ENV: &str = "RDZV_RREF_WORLD";
const FAULTS_ENV: &str = "RDZV_RREF_FAULTS";
const TRANSPORT_ENV: &str = "RDZV_RREF_TRANSPORT";

/// How long a count or a value may take to arrive.
const PATIENCE: Duration = Duration::from_secs(20);

/// The RRefs a worker keeps for the parent, by key.
static HELD: LazyLock<Mutex<HashMap<String, RRef>>> = LazyLock::new(Mutex::default);

fn held() -> std::sync::MutexGuard<'static, HashMap<String, RRef>> {
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

fn rank(r: i16) -> WorkerId {
    WorkerId::from(r)
}

/// The request of `make`: a tensor of `len` bytes of `pattern(len, seed)`.
fn make_message(len: u64, seed: u8) -> Message {
    Message::from_payload(rdzv_test_support::make_request(len, seed))
}

fn make(_: &CallContext, m: Message) -> Result<Message, String> {
    let (len, seed) = rdzv_test_support::parse_make_request(&m.payload)?;
    Ok(Message::from_payload(b"made".to_vec()).with_tensor(Tensor::cpu(pattern(len, seed))))
}

/// A key (one length byte) and the rest.
fn keyed(key: &str, rest: &[u8]) -> Message {
    let mut payload = vec![u8::try_from(key.len()).unwrap_or(u8::MAX)];
    payload.extend_from_slice(key.as_bytes());
    payload.extend_from_slice(rest);
    Message::from_payload(payload)
}

fn split_key(payload: &[u8]) -> Result<(String, &[u8]), String> {
    let len = usize::from(*payload.first().ok_or("no key")?);
    let key = payload.get(1..1 + len).ok_or("short key")?;
    let rest = payload.get(1 + len..).ok_or("short payload")?;
    Ok((String::from_utf8_lossy(key).into_owned(), rest))
}

fn options(url: &str, faults: bool, transport: Option<&str>) -> RpcOptions {
    let mut options = RpcOptions::new(url)
        .with_handler("make", make)
        .with_handler(
            "slow",
            |_: &CallContext, _: Message| -> Result<Message, String> {
                std::thread::sleep(Duration::from_millis(300));
                Ok(Message::from_payload(b"slow".to_vec()))
            },
        )
        .with_handler(
            "fail",
            |_: &CallContext, _: Message| -> Result<Message, String> {
                Err("the handler said no".into())
            },
        )
        // Turns a fork into an RRef and keeps it; answers whether this is its owner.
        .with_handler(
            "hold",
            |ctx: &CallContext, m: Message| -> Result<Message, String> {
                let (key, fork) = split_key(&m.payload)?;
                let rref = ctx.client.rref_from_fork(fork).map_err(|e| e.to_string())?;
                let owner = rref.is_owner();
                held().insert(key, rref);
                Ok(Message::from_payload(vec![u8::from(owner)]))
            },
        )
        .with_handler(
            "fetch",
            |_: &CallContext, m: Message| -> Result<Message, String> {
                let (key, _) = split_key(&m.payload)?;
                let rref = held().get(&key).cloned().ok_or("no such RRef held")?;
                rref.to_here(PATIENCE).map_err(|e| e.to_string())
            },
        )
        .with_handler(
            "drop",
            |_: &CallContext, m: Message| -> Result<Message, String> {
                let (key, _) = split_key(&m.payload)?;
                held().remove(&key).ok_or("no such RRef held")?;
                Ok(Message::default())
            },
        )
        // Turns every fork in the payload (each with a 2-byte length) into an RRef and
        // drops it at once.
        .with_handler(
            "take_and_drop",
            |ctx: &CallContext, m: Message| -> Result<Message, String> {
                let mut rest = m.payload.as_slice();
                while let [a, b, tail @ ..] = rest {
                    let len = usize::from(u16::from_le_bytes([*a, *b]));
                    let fork = tail.get(..len).ok_or("short fork")?;
                    drop(ctx.client.rref_from_fork(fork).map_err(|e| e.to_string())?);
                    rest = tail.get(len..).unwrap_or_default();
                }
                Ok(Message::default())
            },
        )
        // Forks the RRef held under the key to the worker named after it, which holds it
        // under "chain".
        .with_handler(
            "forward",
            |ctx: &CallContext, m: Message| -> Result<Message, String> {
                let (key, to) = split_key(&m.payload)?;
                let to = String::from_utf8_lossy(to).into_owned();
                let rref = held().get(&key).cloned().ok_or("no such RRef held")?;
                let fork = rref.fork_to(&to).map_err(|e| e.to_string())?;
                ctx.client
                    .rpc_sync(&to, "hold", keyed("chain", &fork))
                    .map_err(|e| e.to_string())
            },
        )
        .with_handler(
            "rss",
            |_: &CallContext, _: Message| -> Result<Message, String> {
                Ok(Message::from_payload(rss_kib().to_le_bytes().to_vec()))
            },
        )
        // The owner's own RRef, forked to the worker named in the payload (key "own"),
        // then dropped here.
        .with_handler(
            "own_and_send",
            |ctx: &CallContext, m: Message| -> Result<Message, String> {
                let to = String::from_utf8_lossy(&m.payload).into_owned();
                let me = ctx.client.worker_info().name().to_string();
                let own = ctx
                    .client
                    .remote(&me, "make", make_message(4096, 3))
                    .map_err(|e| e.to_string())?;
                own.to_here(PATIENCE).map_err(|e| e.to_string())?;
                let fork = own.fork_to(&to).map_err(|e| e.to_string())?;
                ctx.client
                    .rpc_sync(&to, "hold", keyed("own", &fork))
                    .map_err(|e| e.to_string())?;
                Ok(Message::default())
            },
        );
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.num_worker_threads = 4;
    options.transports = transport.map(|t| vec![t.to_string()]);
    if faults {
        options.fault_injection = FaultInjection {
            fail_handlers: vec![
                "RREF_FORK_REQUEST".into(),
                "RREF_CHILD_ACCEPT".into(),
                "RREF_USER_DELETE".into(),
            ],
            num_fail_sends: 2,
            delays: Vec::new(),
        };
        options.rref_retry = RRefRetryOptions {
            max_retries: 8,
            rpc_retry_duration: Duration::from_millis(20),
            retry_backoff: 1.5,
        };
    } else {
        options.rref_retry = RRefRetryOptions {
            max_retries: 5,
            rpc_retry_duration: Duration::from_millis(200),
            retry_backoff: 1.5,
        };
    }
    options
}

/// This process's resident set, in KiB (0 where /proc is unreadable).
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// In a child: serves as `w{rank}` until the parent's join, and exits.
fn run_child() -> ! {
    let rank: u32 = std::env::var(CHILD_ENV)
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1);
    let url = std::env::var(STORE_ENV).unwrap_or_default();
    let world: u32 = std::env::var(WORLD_ENV)
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(3);
    let faults = std::env::var_os(FAULTS_ENV).is_some();
    serve_until_joined(init_rpc(
        &format!("w{rank}"),
        rank,
        Some(world),
        options(&url, faults, std::env::var(TRANSPORT_ENV).ok().as_deref()),
    ))
}

/// Starts `world - 1` children for `test` and the parent `w0`.
fn start(test: &str, world: u32, faults: bool) -> (RpcAgent, Vec<Peer>, tempfile::TempDir) {
    start_over(test, world, faults, None)
}

/// [`start`] with every worker offering only `transport`, if given.
fn start_over(
    test: &str,
    world: u32,
    faults: bool,
    transport: Option<&str>,
) -> (RpcAgent, Vec<Peer>, tempfile::TempDir) {
    start_with(test, world, faults, transport, |options| options)
}

/// [`start_over`] with the parent's options changed by `parent`.
fn start_with(
    test: &str,
    world: u32,
    faults: bool,
    transport: Option<&str>,
    parent: impl FnOnce(RpcOptions) -> RpcOptions,
) -> (RpcAgent, Vec<Peer>, tempfile::TempDir) {
    if std::env::var_os(CHILD_ENV).is_some() {
        run_child();
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
    let peers = (1..world)
        .map(|rank| {
            let mut command = Command::new(&exe);
            command
                .args([test, "--exact", "--nocapture"])
                .env(CHILD_ENV, rank.to_string())
                .env(STORE_ENV, &url)
                .env(WORLD_ENV, world.to_string());
            if faults {
                command.env(FAULTS_ENV, "1");
            } else {
                command.env_remove(FAULTS_ENV);
            }
            match transport {
                Some(t) => command.env(TRANSPORT_ENV, t),
                None => command.env_remove(TRANSPORT_ENV),
            };
            Peer::spawn(format!("w{rank} for test {test}"), command)
        })
        .collect();
    let agent = init_rpc(
        "w0",
        0,
        Some(world),
        parent(options(&url, faults, transport)),
    )
    .unwrap_or_else(|e| panic!("w0 init: {e}"));
    (agent, peers, dir)
}

fn call(agent: &RpcAgent, to: &str, handler: &str, m: Message) -> Message {
    agent
        .rpc_sync(to, handler, m)
        .unwrap_or_else(|e| panic!("{handler} on {to}: {e}"))
}

fn expect_counts(agent: &RpcAgent, owners: usize, forks: usize, on: i16, what: &str) {
    if let Err(e) = agent.wait_until_owners_and_forks_on_rank(owners, forks, rank(on), PATIENCE) {
        let all: Vec<_> = (0..3)
            .map(|r| agent.rref_debug_info_of(rank(r)).map_err(|e| e.to_string()))
            .collect();
        panic!("{what}: {e}; every worker's counts: {all:?}");
    }
}

fn check_tensor(m: &Message, len: usize, seed: u8, what: &str) {
    let data = m.tensors.first().map(|t| t.data.as_slice());
    assert!(
        data == Some(pattern(len, seed).as_slice()),
        "{what}: the {len}-byte value came back different"
    );
}

fn wait_confirmed(rref: &RRef) {
    let deadline = Instant::now() + PATIENCE;
    while !rref.confirmed_by_owner() {
        assert!(Instant::now() < deadline, "{rref:?} never confirmed");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Flushes every worker, checks every table is empty, and joins all.
fn finish(agent: RpcAgent, peers: Vec<Peer>, world: i16) {
    for r in 0..world {
        expect_counts(&agent, 0, 0, r, "at the end");
    }
    if let Err(e) = agent.wait_until_pending_futures_and_users_flushed(PATIENCE) {
        panic!("flush: {e}");
    }
    assert_eq!(agent.join().map_err(|e| e.to_string()), Ok(()));
    let report = agent
        .rref_shutdown_report()
        .unwrap_or_else(|| panic!("no shutdown report after join"));
    assert!(report.is_clean(), "leaks at shutdown: {report:?}");
    for peer in peers {
        peer.expect_success(PEER_EXIT_LIMIT);
    }
}

/// Forks w0's user of an RRef owned by w1 to w2, which fetches it; then both drop it.
fn user_forks_to_a_third_worker(agent: &RpcAgent, seed: u8) {
    let rref = agent
        .remote("w1", "make", make_message(1000, seed))
        .unwrap_or_else(|e| panic!("remote: {e}"));
    let fork = rref.fork_to("w2").unwrap_or_else(|e| panic!("fork: {e}"));
    let owner = call(agent, "w2", "hold", keyed("b", &fork));
    assert_eq!(owner.payload, [0], "w2 is not the owner");
    let value = call(agent, "w2", "fetch", keyed("b", &[]));
    check_tensor(&value, 1000, seed, "w2's to_here of a forked RRef");
    drop(rref);
    // Only w2's fork is left once w2 accepted and w0's user is deleted.
    expect_counts(agent, 1, 1, 1, "after w0 dropped its user");
    call(agent, "w2", "drop", keyed("b", &[]));
    expect_counts(agent, 0, 0, 1, "after w2 dropped its fork");
}

#[test]
fn owner_user_and_fork_arrangements() {
    let (agent, peers, _dir) = start("owner_user_and_fork_arrangements", 3, false);

    // A user on w0, the value on w1: a 4 MiB tensor comes back.
    let len = 4 << 20;
    let rref = agent
        .remote("w1", "make", make_message(len as u64, 7))
        .unwrap_or_else(|e| panic!("remote: {e}"));
    assert!(!rref.is_owner());
    assert_eq!(rref.owner(), "w1");
    assert!(rref.local_value().is_none(), "a user has no local value");
    let value = rref
        .to_here(PATIENCE)
        .unwrap_or_else(|e| panic!("to_here: {e}"));
    check_tensor(&value, len, 7, "to_here of 4 MiB");
    assert_eq!(value.payload, b"made");
    wait_confirmed(&rref);
    expect_counts(&agent, 1, 1, 1, "one user of one value");
    let copy = rref.clone();
    drop(rref);
    expect_counts(&agent, 1, 1, 1, "a local copy keeps the user");
    drop(copy);
    expect_counts(&agent, 0, 0, 1, "the user dropped");

    // A user forks to a third worker.
    user_forks_to_a_third_worker(&agent, 9);

    // A fork of a fork: w0's user goes to w2, which passes it on back to w0.
    let rref = agent
        .remote("w1", "make", make_message(256, 6))
        .unwrap_or_else(|e| panic!("remote: {e}"));
    let fork = rref.fork_to("w2").unwrap_or_else(|e| panic!("fork: {e}"));
    call(&agent, "w2", "hold", keyed("b", &fork));
    drop(rref);
    call(&agent, "w2", "forward", keyed("b", b"w0"));
    call(&agent, "w2", "drop", keyed("b", &[]));
    let chained = held()
        .remove("chain")
        .unwrap_or_else(|| panic!("w2's fork never reached w0"));
    assert!(!chained.is_owner());
    wait_confirmed(&chained);
    expect_counts(&agent, 1, 1, 1, "only the forwarded fork is left");
    let value = chained
        .to_here(PATIENCE)
        .unwrap_or_else(|e| panic!("to_here of a fork of a fork: {e}"));
    check_tensor(&value, 256, 6, "to_here of a fork of a fork");
    drop(chained);
    expect_counts(&agent, 0, 0, 1, "the forwarded fork dropped");

    // The owner forks its own RRef to a user, and drops its handle.
    call(
        &agent,
        "w1",
        "own_and_send",
        Message::from_payload(b"w2".to_vec()),
    );
    expect_counts(&agent, 1, 1, 1, "the owner's fork to w2");
    let value = call(&agent, "w2", "fetch", keyed("own", &[]));
    check_tensor(&value, 4096, 3, "to_here of the owner's fork");
    call(&agent, "w2", "drop", keyed("own", &[]));
    expect_counts(&agent, 0, 0, 1, "the owner's fork dropped");

    // A fork back to its owner is the owner's own handle.
    let rref = agent
        .remote("w1", "make", make_message(64, 5))
        .unwrap_or_else(|e| panic!("remote: {e}"));
    let fork = rref.fork_to("w1").unwrap_or_else(|e| panic!("fork: {e}"));
    let owner = call(&agent, "w1", "hold", keyed("back", &fork));
    assert_eq!(owner.payload, [1], "w1 got a user of its own value");
    drop(rref);
    expect_counts(&agent, 1, 0, 1, "the owner's local handle keeps its value");
    call(&agent, "w1", "drop", keyed("back", &[]));
    expect_counts(&agent, 0, 0, 1, "the owner's handle dropped");

    // A user dropped before its value exists: the value is dropped when it comes.
    let rref = agent
        .remote("w1", "slow", Message::default())
        .unwrap_or_else(|e| panic!("remote: {e}"));
    drop(rref);
    expect_counts(&agent, 0, 0, 1, "a user dropped before its value existed");

    // to_here before the value exists: the owner answers when it does (or says it is
    // not ready when the wait is over).
    let rref = agent
        .remote("w1", "slow", Message::default())
        .unwrap_or_else(|e| panic!("remote: {e}"));
    let early = rref
        .to_here(Duration::from_millis(20))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        early.contains("not ready") && early.contains("w1"),
        "{early}"
    );
    let value = rref
        .to_here(PATIENCE)
        .unwrap_or_else(|e| panic!("to_here of a slow value: {e}"));
    assert_eq!(value.payload, b"slow");
    drop(rref);
    expect_counts(&agent, 0, 0, 1, "the slow value dropped");

    // A failing handler: to_here says why, and where.
    let rref = agent
        .remote("w1", "fail", Message::default())
        .unwrap_or_else(|e| panic!("remote: {e}"));
    let error = rref
        .to_here(PATIENCE)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        error.contains("the handler said no") && error.contains("w1"),
        "{error}"
    );
    drop(rref);

    // remote() to oneself: the owner's handle.
    let rref = agent
        .remote("w0", "make", make_message(128, 2))
        .unwrap_or_else(|e| panic!("remote: {e}"));
    assert!(rref.is_owner() && rref.confirmed_by_owner());
    let value = rref
        .to_here(PATIENCE)
        .unwrap_or_else(|e| panic!("local to_here: {e}"));
    check_tensor(&value, 128, 2, "to_here on the owner");
    let local = rref.local_value().and_then(Result::ok);
    assert!(local.is_some_and(|m| m == value));
    expect_counts(&agent, 1, 0, 0, "w0 owns its own value");
    drop(rref);

    finish(agent, peers, 3);
}

#[test]
fn dropped_control_messages_are_retried_until_they_converge() {
    // Every worker fails its first two sends of each control message.
    let (agent, peers, _dir) = start(
        "dropped_control_messages_are_retried_until_they_converge",
        3,
        true,
    );
    user_forks_to_a_third_worker(&agent, 4);
    let rref = agent
        .remote("w2", "make", make_message(10, 1))
        .unwrap_or_else(|e| panic!("remote: {e}"));
    let fork = rref.fork_to("w1").unwrap_or_else(|e| panic!("fork: {e}"));
    call(&agent, "w1", "hold", keyed("c", &fork));
    drop(rref);
    call(&agent, "w1", "drop", keyed("c", &[]));
    expect_counts(&agent, 0, 0, 2, "w2's value after retried control messages");
    // w0's first two USER_DELETEs (to w1) failed on purpose, and were sent again.
    let errors = agent.network_data().get("w1").map_or(0, |d| d.total_errors);
    assert!(
        errors >= 2,
        "only {errors} sends to w1 failed: no fault was injected"
    );
    finish(agent, peers, 3);
}

#[test]
fn owner_killed_to_here_fails_fast_naming_the_owner() {
    let (agent, mut peers, _dir) =
        start("owner_killed_to_here_fails_fast_naming_the_owner", 2, false);
    let rref = agent
        .remote("w1", "make", make_message(1 << 20, 8))
        .unwrap_or_else(|e| panic!("remote: {e}"));
    let value = rref
        .to_here(PATIENCE)
        .unwrap_or_else(|e| panic!("to_here: {e}"));
    check_tensor(&value, 1 << 20, 8, "to_here before the kill");
    let mut owner = peers.remove(0);
    let _ = owner.child_mut().kill();
    let _ = owner.wait(PEER_EXIT_LIMIT);
    let started = Instant::now();
    let error = rref.to_here(Duration::from_secs(60));
    let elapsed = started.elapsed();
    let text = match error {
        Ok(_) => panic!("to_here succeeded with its owner dead"),
        Err(e) => {
            // The owner could not be reached: the kind is the pipe's, not the handler's.
            assert!(!e.is_remote() && e.peer() == Some("w1"), "{e:?}");
            e.to_string()
        }
    };
    match rref.to_here(Duration::from_secs(60)) {
        Err(e @ CallError::RRef { .. }) => assert!(
            matches!(
                e.kind(),
                CallErrorKind::PipeBroken | CallErrorKind::Connect | CallErrorKind::Handshake
            ),
            "{e:?}"
        ),
        other => panic!("expected an RRef error, got {other:?}"),
    }
    assert!(
        text.contains("w1"),
        "the error does not name the owner: {text}"
    );
    assert!(
        elapsed < Duration::from_secs(10),
        "to_here took {elapsed:?} to fail with its owner dead"
    );
    drop(rref);
    // remote() to the dead owner: the call fails, the user is not left pending, and
    // to_here says why, naming the owner.
    let rref = agent
        .remote("w1", "make", make_message(16, 1))
        .unwrap_or_else(|e| panic!("remote to a dead owner: {e}"));
    let deadline = Instant::now() + PATIENCE;
    while agent.rref_debug_info().num_pending_users > 0 {
        assert!(
            Instant::now() < deadline,
            "a remote() call to a dead owner left its user pending"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let text = to_here_error(&rref, "w1");
    assert!(
        text.contains("RRef creation via rpc.remote() failed"),
        "{text}"
    );
    drop(rref);
    expect_counts(&agent, 0, 0, 0, "w0 owns nothing and counts no fork");
    assert_eq!(agent.shutdown(false).map_err(|e| e.to_string()), Ok(()));
}

/// The error of `rref.to_here`, as text, checking that it is about the RRef and names
/// its owner.
fn to_here_error(rref: &RRef, owner: &str) -> String {
    match rref.to_here(PATIENCE) {
        Ok(_) => panic!("to_here of {rref:?} succeeded"),
        Err(e @ CallError::RRef { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains(&format!("owned by {owner}")),
                "the error does not name the owner {owner}: {text}"
            );
            text
        }
        Err(other) => panic!("to_here of {rref:?} failed with {other:?}, not an RRef error"),
    }
}

fn assert_no_pending_user(agent: &RpcAgent, what: &str) {
    if let Err(e) = agent.wait_until_pending_futures_and_users_flushed(PATIENCE) {
        panic!("{what}: {e}");
    }
    assert_eq!(agent.rref_debug_info().num_pending_users, 0, "{what}");
}

#[test]
fn a_failed_remote_call_leaves_no_pending_user_and_no_leak() {
    // w0 fails its first send of a remote() call, as PyTorch's faulty agent fails
    // PYTHON_REMOTE_CALL: the owner is never reached.
    let (agent, peers, _dir) = start_with(
        "a_failed_remote_call_leaves_no_pending_user_and_no_leak",
        3,
        false,
        None,
        |mut options| {
            options.fault_injection = FaultInjection {
                fail_handlers: vec!["PYTHON_REMOTE_CALL".into()],
                num_fail_sends: 1,
                delays: Vec::new(),
            };
            options
        },
    );
    // The pipe is open, so the refused send fails remote()'s call before it returns.
    call(&agent, "w1", "rss", Message::default());
    let rref = agent
        .remote("w1", "make", make_message(64, 1))
        .unwrap_or_else(|e| panic!("remote: {e}"));
    assert_no_pending_user(&agent, "after a remote() call that never left");
    assert!(!rref.confirmed_by_owner());
    let error = to_here_error(&rref, "w1");
    assert!(
        error.contains("RRef creation via rpc.remote() failed")
            && error.contains("Send attempt failed intentionally"),
        "{error}"
    );
    let fork = rref.fork_to("w2").err().map(|e| e.to_string());
    assert!(
        fork.as_deref()
            .is_some_and(|e| e.contains("cannot be forked") && e.contains("RRef creation")),
        "fork_to of a failed RRef: {fork:?}"
    );
    drop(rref);
    expect_counts(&agent, 0, 0, 1, "the owner never had it");

    // The call times out while its handler runs: the owner made the value, the user
    // fails, and dropping it deletes the owner's value too.
    let rref = agent
        .remote_with_timeout(
            "w1",
            "slow",
            Message::default(),
            Some(Duration::from_millis(50)),
        )
        .unwrap_or_else(|e| panic!("remote: {e}"));
    assert_no_pending_user(&agent, "after a remote() call that timed out");
    let error = to_here_error(&rref, "w1");
    assert!(
        error.contains("RRef creation via rpc.remote() failed"),
        "{error}"
    );
    assert!(!rref.confirmed_by_owner());
    drop(rref);
    expect_counts(&agent, 0, 0, 1, "a timed-out call's value dropped");

    // The call times out in the owner's queue (its 4 pool threads busy): the caller's
    // delete reaches the owner before a pool thread takes the call, which must count
    // nothing then.
    let busy: Vec<_> = (0..4)
        .map(|_| agent.rpc_async("w1", "slow", Message::default()))
        .collect();
    let rref = agent
        .remote_with_timeout(
            "w1",
            "make",
            make_message(16, 2),
            Some(Duration::from_millis(50)),
        )
        .unwrap_or_else(|e| panic!("remote: {e}"));
    let deadline = Instant::now() + PATIENCE;
    while agent.rref_debug_info().num_pending_users > 0 {
        assert!(Instant::now() < deadline, "the queued call never failed");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        !busy.iter().any(|call| call.is_done()),
        "the pool was not busy"
    );
    drop(rref);
    for call in busy {
        assert!(call.wait().is_ok());
    }
    expect_counts(
        &agent,
        0,
        0,
        1,
        "a call that timed out in the owner's queue",
    );

    // A handler the owner does not have, and a handler that fails: the call itself
    // succeeds (the user is confirmed), and to_here returns the owner's error.
    for (handler, says) in [
        ("no_such_handler", "no RPC handler named no_such_handler"),
        ("fail", "the handler said no"),
    ] {
        let rref = agent
            .remote("w1", handler, Message::default())
            .unwrap_or_else(|e| panic!("remote: {e}"));
        let error = to_here_error(&rref, "w1");
        assert!(error.contains(says) && error.contains("w1"), "{error}");
        wait_confirmed(&rref);
        assert_no_pending_user(&agent, handler);
        expect_counts(&agent, 1, 1, 1, handler);
        drop(rref);
        expect_counts(&agent, 0, 0, 1, handler);
    }
    // No such worker: no RRef at all.
    assert!(matches!(
        agent.remote("w9", "make", Message::default()),
        Err(CallError::Usage(UsageError::UnknownWorker { .. }))
    ));
    // finish: every count at zero, and join reports no leak.
    finish(agent, peers, 3);
}

#[test]
fn join_reports_what_leaks_by_owner() {
    // Short retries (the fault options), so that join's waits end soon.
    let (agent, peers, _dir) = start("join_reports_what_leaks_by_owner", 2, true);
    let rref = agent
        .remote("w1", "make", make_message(16, 1))
        .unwrap_or_else(|e| panic!("remote: {e}"));
    wait_confirmed(&rref);
    // A fork whose bytes never reach w1: its child never accepts, so w0's user is held.
    let _lost = rref.fork_to("w1").unwrap_or_else(|e| panic!("fork: {e}"));
    drop(rref);
    // The owner still counts w0's user, which the lost fork holds.
    expect_counts(&agent, 1, 1, 1, "w0's user held by its lost fork");
    assert_eq!(agent.join().map_err(|e| e.to_string()), Ok(()));
    let report = agent
        .rref_shutdown_report()
        .unwrap_or_else(|| panic!("no shutdown report after join"));
    assert!(!report.is_clean());
    assert_eq!(report.by_owner().get("w1"), Some(&1), "{report:?}");
    let what = report.leaks.first().map(|l| l.what.as_str()).unwrap_or("");
    assert!(what.contains("never accepted by its child"), "{what}");
    for peer in peers {
        peer.expect_success(PEER_EXIT_LIMIT);
    }
}

/// How many RRefs the soak makes (`RDZV_RREF_SOAK`; the figure is 100000).
fn soak_count() -> usize {
    std::env::var("RDZV_RREF_SOAK")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000)
}

#[test]
fn soak_of_rrefs_created_forked_and_dropped_leaves_every_table_empty() {
    let (agent, peers, _dir) = start(
        "soak_of_rrefs_created_forked_and_dropped_leaves_every_table_empty",
        3,
        false,
    );
    let total = soak_count();
    let batch = 100;
    let rss = |to: &str| {
        let reply = call(&agent, to, "rss", Message::default());
        <[u8; 8]>::try_from(reply.payload.as_slice()).map_or(0, u64::from_le_bytes)
    };
    let mut first = None;
    let started = Instant::now();
    let mut made = 0;
    while made < total {
        let n = batch.min(total - made);
        // Owners alternate between w1 and w2; each RRef is forked to the other one.
        let (owner, third) = if (made / batch) % 2 == 0 {
            ("w1", "w2")
        } else {
            ("w2", "w1")
        };
        let rrefs: Vec<RRef> = (0..n)
            .map(|i| {
                agent
                    .remote(owner, "make", make_message(8, i as u8))
                    .unwrap_or_else(|e| panic!("remote {}: {e}", made + i))
            })
            .collect();
        let mut forks = Vec::new();
        for rref in &rrefs {
            let fork = rref.fork_to(third).unwrap_or_else(|e| panic!("fork: {e}"));
            forks.extend_from_slice(&u16::try_from(fork.len()).unwrap_or(0).to_le_bytes());
            forks.extend_from_slice(&fork);
        }
        call(&agent, third, "take_and_drop", Message::from_payload(forks));
        drop(rrefs);
        made += n;
        if first.is_none() {
            for r in [1, 2] {
                expect_counts(&agent, 0, 0, r, "after the first batch");
            }
            first = Some((rss("w1"), rss("w2"), rss_kib()));
        }
    }
    for r in 0..3 {
        expect_counts(&agent, 0, 0, r, "after the soak");
    }
    let elapsed = started.elapsed();
    let last = (rss("w1"), rss("w2"), rss_kib());
    let first = first.unwrap_or(last);
    println!(
        "soak: {total} RRefs in {elapsed:?}; resident KiB after the first batch {first:?}, at the end {last:?}"
    );
    // Flat: every table is empty, so what grew is the allocator's slack, not the RRefs.
    let grew = [
        last.0.saturating_sub(first.0),
        last.1.saturating_sub(first.1),
        last.2.saturating_sub(first.2),
    ];
    assert!(
        grew.iter().all(|&g| g < 32 * 1024),
        "memory grew by {grew:?} KiB over {total} RRefs"
    );
    finish(agent, peers, 3);
}

#[test]
fn to_here_of_a_64_mib_tensor_over_each_transport() {
    // ibv: rdma/tests/ibv_rref.rs, in the Soft-RoCE VM.
    let test = "to_here_of_a_64_mib_tensor_over_each_transport";
    if std::env::var_os(CHILD_ENV).is_some() {
        run_child();
    }
    let shm = rdzv_uring::rpc::shm_transport::ShmTransport::new().err();
    for transport in ["tcp", "shm"] {
        if transport == "shm" {
            if let Some(why) = &shm {
                println!("skipping to_here over shm: {why}");
                continue;
            }
        }
        let (agent, peers, _dir) = start_over(test, 2, false, Some(transport));
        let len = 64 << 20;
        let rref = agent
            .remote("w1", "make", make_message(len as u64, 11))
            .unwrap_or_else(|e| panic!("remote over {transport}: {e}"));
        let value = rref
            .to_here(PATIENCE)
            .unwrap_or_else(|e| panic!("to_here over {transport}: {e}"));
        check_tensor(&value, len, 11, transport);
        assert_eq!(
            agent.pipe_transport("w1").map(|k| k.name()),
            Some(transport)
        );
        drop(rref);
        finish(agent, peers, 2);
    }
}
