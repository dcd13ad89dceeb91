//! The RPC API beside the calls, with real agents over tcp on a `file://` store: worker
//! infos by name and id, futures chained with `then` and gathered with `wait_all` /
//! `collect_all` over real calls, async handlers and their metric, the handler queue
//! wait metric, what `remote()` + `to_here` cost in calls (two, and none back from the
//! owner), `join(shutdown = false)` (the group waits for every call, then goes on
//! serving) before a graceful shutdown, and timeouts of both naming who never joined
//! (a peer process that never shuts down, through `rdzv-test-support`'s `Peer`); after
//! a timed-out join or graceful shutdown, a second graceful call fails at once saying
//! to shut down with `shutdown(false)`, unless the join timed out before its barriers.

use std::thread;
use std::time::{Duration, Instant};

use rdzv_uring::rpc::{
    collect_all, init_rpc, wait_all, Async, CallContext, CallError, Inline, Message, RpcAgent,
    RpcOptions, ShutdownError,
};

mod common;

use common::{echo, loopback_tcp, metric, pair_of, sleep_message, sleep_ms};

fn options(url: &str) -> RpcOptions {
    loopback_tcp(url)
        .with_handler("sleep", sleep_ms)
        .with_handler("inline_echo", Inline(echo))
}

fn pair(dir: &tempfile::TempDir) -> (RpcAgent, RpcAgent) {
    pair_of(dir, |url, _| options(url))
}

/// Runs `f` on both agents at once (a group barrier), `a` on this thread.
fn both<T: Send + 'static>(
    a: RpcAgent,
    b: RpcAgent,
    f: impl Fn(&RpcAgent) -> T + Send + Copy + 'static,
) -> (RpcAgent, RpcAgent, T, T) {
    let t = thread::spawn(move || {
        let r = f(&b);
        (b, r)
    });
    let ra = f(&a);
    let (b, rb) = t.join().unwrap_or_else(|_| panic!("bob's thread panicked"));
    (a, b, ra, rb)
}

#[test]
fn worker_infos_by_name_and_id() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let bob = a.get_worker_info("bob").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((bob.name(), bob.id().get()), ("bob", 1));
    let alice = b.get_worker_info_by_id(0).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&alice, a.worker_info());
    assert_eq!(
        a.get_worker_info("alice").ok().as_ref(),
        Some(a.worker_info())
    );
    let names: Vec<String> = a
        .get_worker_infos()
        .iter()
        .map(|w| w.name().to_string())
        .collect();
    assert_eq!(names, ["alice", "bob"]);
    assert_eq!(
        a.get_worker_info("carol").map_err(|e| e.to_string()),
        Err("could not find destination worker carol: it is not a member of this RPC group".into())
    );
    assert_eq!(
        a.get_worker_info_by_id(7).map_err(|e| e.to_string()),
        Err("unknown worker id 7: no member of this RPC group has it".into())
    );
    let (_, _, ra, rb) = both(a, b, |agent| agent.join().map_err(|e| e.to_string()));
    assert_eq!((ra, rb), (Ok(()), Ok(())));
}

#[test]
fn futures_chain_and_gather_over_real_calls() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let chained = a
        .rpc_async("bob", "echo", Message::from_payload(b"ping".to_vec()))
        .then(|r| {
            r.map(|mut m| {
                m.payload.extend_from_slice(b"-then");
                m
            })
        });
    assert_eq!(
        chained.wait().map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"ping-then".to_vec())
    );
    // A remote error travels through `then` and is the first error of `wait_all`.
    let futures = vec![
        a.rpc_async("bob", "sleep", sleep_message(50)),
        a.rpc_async("bob", "no_such_handler", Message::default())
            .then(|r| r),
        a.rpc_async("bob", "echo", Message::from_payload(vec![1])),
    ];
    let first = wait_all(futures).map(|_| ()).map_err(|e| e.to_string());
    assert!(
        first
            .as_ref()
            .is_err_and(|e| e.contains("no RPC handler named no_such_handler")),
        "{first:?}"
    );
    let all = collect_all(
        (0u8..8)
            .map(|i| a.rpc_async("bob", "echo", Message::from_payload(vec![i])))
            .collect(),
    )
    .wait();
    let payloads: Result<Vec<u8>, String> = all
        .into_iter()
        .map(|r| r.map(|m| m.payload[0]).map_err(|e| e.to_string()))
        .collect();
    assert_eq!(payloads, Ok((0u8..8).collect()));
    let (_, _, ra, rb) = both(a, b, |agent| agent.join().map_err(|e| e.to_string()));
    assert_eq!((ra, rb), (Ok(()), Ok(())));
}

#[test]
fn join_without_shutdown_waits_for_the_group_then_serves_on() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    // Bob's call to alice is in flight when both join: alice's join waits for it too.
    let slow = b.rpc_async("alice", "sleep", sleep_message(300));
    let started = Instant::now();
    let (a, b, ra, rb) = both(a, b, |agent| {
        agent.join_with(false, None).map_err(|e| e.to_string())
    });
    assert_eq!((ra, rb), (Ok(()), Ok(())));
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "join returned after {:?}, before bob's call to alice finished",
        started.elapsed()
    );
    assert!(slow.is_done(), "no call may be in flight after the join");
    assert_eq!(
        slow.wait().map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"slept".to_vec())
    );
    // Not shut down: calls go on both ways, and a second join (new barriers) works.
    for (from, to) in [(&a, "bob"), (&b, "alice")] {
        assert_eq!(
            from.rpc_sync(to, "echo", Message::from_payload(b"again".to_vec()))
                .map(|m| m.payload)
                .map_err(|e| e.to_string()),
            Ok(b"again".to_vec())
        );
    }
    let (a, b, ra, rb) = both(a, b, |agent| {
        agent.join_with(false, None).map_err(|e| e.to_string())
    });
    assert_eq!((ra, rb), (Ok(()), Ok(())));
    let (a, _b, ra, rb) = both(a, b, |agent| {
        agent.join_with(true, None).map_err(|e| e.to_string())
    });
    assert_eq!((ra, rb), (Ok(()), Ok(())));
    assert!(matches!(
        a.rpc_sync("bob", "echo", Message::default()),
        Err(CallError::ShutDown { .. })
    ));
    assert!(matches!(
        a.join_with(false, None),
        Err(ShutdownError::ShutDown { .. })
    ));
}

#[test]
fn handler_queue_wait_is_measured_while_profiling_is_on() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    const KEY: &str = "agent.gil_average_wait_time_us";
    let wait_metric = |agent: &RpcAgent| {
        agent
            .get_metrics()
            .into_iter()
            .find(|(key, _)| key == KEY)
            .map(|(_, value)| value)
    };
    assert_eq!(wait_metric(&b), None, "listed only while profiling is on");
    b.enable_wait_profiling(true);
    assert_eq!(wait_metric(&b).as_deref(), Some("0.000000"));
    // Bob's pool has 2 threads: of 4 calls of 150 ms sent at once, 2 wait ~150 ms for a
    // thread, so the average wait is ~75 ms.
    let calls = (0..4)
        .map(|_| a.rpc_async("bob", "sleep", sleep_message(150)))
        .collect();
    assert!(wait_all(calls).is_ok());
    let average: f64 = wait_metric(&b)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {KEY} in {:?}", b.get_metrics()));
    assert!(
        (30_000.0..2_000_000.0).contains(&average),
        "average queue wait {average} µs; about 75,000 expected"
    );
    b.enable_wait_profiling(false);
    assert_eq!(wait_metric(&b), None);
    let (_, _, ra, rb) = both(a, b, |agent| agent.join().map_err(|e| e.to_string()));
    assert_eq!((ra, rb), (Ok(()), Ok(())));
}

#[test]
fn async_handlers_free_the_pool_and_are_counted_until_they_answer() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    // Bob answers with alice's own (slow) answer to a nested call, chained.
    let relay = Async(|ctx: &CallContext, m: Message| {
        ctx.client.rpc_async(&ctx.caller, "sleep", m).then(|r| {
            r.map(|mut m| {
                m.payload.extend_from_slice(b"-relayed");
                m
            })
        })
    });
    let fail = Async(|ctx: &CallContext, _: Message| {
        ctx.client
            .rpc_async(&ctx.caller, "no_such_handler", Message::default())
    });
    assert!(b.register_handler("relay_later", relay).is_ok());
    assert!(b.register_handler("fail_later", fail).is_ok());
    let pending = a.rpc_async("bob", "relay_later", sleep_message(400));
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(&b, "agent.server_active_async_calls").as_deref() != Some("1") {
        assert!(Instant::now() < deadline, "{:?}", b.get_metrics());
        thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        metric(&b, "agent.server_active_calls").as_deref(),
        Some("1")
    );
    // The pool thread is free while the answer is pending.
    assert_eq!(metric(&b, "agent.num_idle_threads").as_deref(), Some("2"));
    assert_eq!(
        pending.wait().map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"slept-relayed".to_vec())
    );
    assert_eq!(
        metric(&b, "agent.server_active_async_calls").as_deref(),
        Some("0")
    );
    assert_eq!(
        metric(&b, "agent.server_active_calls").as_deref(),
        Some("0")
    );
    let failed = a
        .rpc_sync("bob", "fail_later", Message::default())
        .map_err(|e| e.to_string());
    assert!(
        failed
            .as_ref()
            .is_err_and(|e| e.contains("no RPC handler named no_such_handler")),
        "{failed:?}"
    );
    assert_eq!(
        metric(&b, "agent.server_active_async_calls").as_deref(),
        Some("0")
    );
    let (_, _, ra, rb) = both(a, b, |agent| agent.join().map_err(|e| e.to_string()));
    assert_eq!((ra, rb), (Ok(()), Ok(())));
}

const CHILD_ENV: &str = "RDZV_RPC_API_TEST_CHILD";
const STORE_ENV: &str = "RDZV_RPC_API_TEST_STORE";

/// The peer of [`a_graceful_shutdown_that_times_out_names_who_never_joined`]: serves
/// and never shuts down; it exits when the parent is gone.
fn serve_without_joining() -> ! {
    common::exit_when_parent_gone();
    let Ok(url) = std::env::var(STORE_ENV) else {
        std::process::exit(2)
    };
    match init_rpc("lazy", 1, Some(2), options(&url)) {
        Ok(agent) => {
            thread::sleep(Duration::from_secs(60));
            drop(agent);
            std::process::exit(3);
        }
        Err(e) => {
            eprintln!("child init failed: {e}");
            std::process::exit(4);
        }
    }
}

#[test]
fn a_graceful_shutdown_that_times_out_names_who_never_joined() {
    if std::env::var_os(CHILD_ENV).is_some() {
        serve_without_joining();
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    let child = common::spawn_peer(
        "a_graceful_shutdown_that_times_out_names_who_never_joined",
        &[(CHILD_ENV, "1"), (STORE_ENV, &url)],
    );
    let agent =
        init_rpc("eager", 0, Some(2), options(&url)).unwrap_or_else(|e| panic!("parent init: {e}"));
    assert!(agent.rpc_sync("lazy", "echo", Message::default()).is_ok());
    let started = Instant::now();
    let result = agent.shutdown_with_timeout(true, Duration::from_millis(800));
    let elapsed = started.elapsed();
    assert!(
        (Duration::from_millis(700)..Duration::from_secs(5)).contains(&elapsed),
        "{elapsed:?}"
    );
    match &result {
        Err(e @ ShutdownError::JoinTimeout { name, missing, .. }) => {
            assert!(e.is_timeout());
            assert_eq!(e.missing_workers(), &["lazy".to_string()][..]);
            assert_eq!(
                (name.as_str(), missing.as_slice()),
                ("eager", &["lazy".to_string()][..])
            );
        }
        other => panic!("expected a join timeout, got {other:?}"),
    }
    // It closed anyway.
    assert!(matches!(
        agent.rpc_sync("lazy", "echo", Message::default()),
        Err(CallError::ShutDown { .. })
    ));
    drop(child);
}

#[test]
fn a_join_that_times_out_names_the_workers_missing_from_the_barrier() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let started = Instant::now();
    let result = a.join_with(false, Some(Duration::from_millis(500)));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let text = result.map_err(|e| e.to_string()).err().unwrap_or_default();
    assert_eq!(
        text,
        "graceful RPC shutdown of worker alice timed out after 500ms: workers that did not \
         reach the shutdown barrier: bob; shut them down too (every worker of the group must \
         call it)"
    );
    // Not shut down: alice still calls bob.
    assert!(a.rpc_sync("bob", "echo", Message::default()).is_ok());
    // Alice's barriers are out of step now: another join fails at once, saying what to
    // do, instead of waiting for ever.
    let started = Instant::now();
    for again in [
        a.join_without_shutdown(None),
        a.join_with(false, Some(Duration::from_secs(30))),
    ] {
        let text = again.map_err(|e| e.to_string()).err().unwrap_or_default();
        assert!(
            text.contains("out of step") && text.contains("shutdown(false)"),
            "{text}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert!(a.rpc_sync("bob", "echo", Message::default()).is_ok());
    // So does a graceful shutdown, which closes the agent without the group; asked
    // again, it says the same rather than that all went well.
    for _ in 0..2 {
        assert!(matches!(a.join(), Err(ShutdownError::Join { .. })));
    }
    assert!(matches!(
        a.rpc_sync("bob", "echo", Message::default()),
        Err(CallError::ShutDown { .. })
    ));
    // The group ends without its barriers.
    assert!(a.shutdown(false).is_ok());
    assert!(b.shutdown(false).is_ok());
}

#[test]
fn a_join_that_times_out_on_its_own_calls_may_be_tried_again() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    // Alice's own call is still in flight when her wait ends: she entered no barrier,
    // so her barriers are still in step with bob's.
    let pending = a.rpc_async("bob", "sleep", sleep_message(400));
    let timed_out = a.join_without_shutdown(Some(Duration::from_millis(50)));
    assert!(
        matches!(timed_out, Err(ShutdownError::JoinTimeout { .. })),
        "{timed_out:?}"
    );
    assert!(pending.wait().is_ok());
    let (a, b, ra, rb) = both(a, b, |agent| {
        agent
            .join_without_shutdown(Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())
    });
    assert_eq!((ra, rb), (Ok(()), Ok(())));
    let (_, _, ra, rb) = both(a, b, |agent| agent.join().map_err(|e| e.to_string()));
    assert_eq!((ra, rb), (Ok(()), Ok(())));
}

#[test]
fn a_timed_shutdown_with_its_own_call_in_flight_closes_and_fails_the_call() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let pending = a.rpc_async("bob", "sleep", sleep_message(10_000));
    let started = Instant::now();
    let text = a
        .shutdown_with_timeout(true, Duration::from_millis(300))
        .map_err(|e| e.to_string())
        .err()
        .unwrap_or_default();
    assert_eq!(
        text,
        "graceful RPC shutdown of worker alice timed out after 300ms: every worker reached \
         the shutdown barrier, but calls were still in flight; give it more time or find the \
         call that does not end"
    );
    assert_eq!(
        pending.wait().map_err(|e| e.to_string()).err().as_deref(),
        Some("the RPC agent of worker alice is shut down; the call did not complete")
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // Asked again for a graceful shutdown, alice says hers gave up (not that all went
    // well); a non-graceful one has nothing left to do.
    let again = a
        .join()
        .map_err(|e| e.to_string())
        .err()
        .unwrap_or_default();
    assert!(
        again.contains("gave up") && again.contains("shutdown(false)"),
        "{again}"
    );
    assert!(a.shutdown(false).is_ok());
    assert!(b.shutdown(false).is_ok());
}

/// `remote()` and `to_here` cost the caller two calls and its `USER_DELETE` one more,
/// whether the handler runs on the pool (`echo`) or inline (`inline_echo`); the owner makes no
/// call back: its `RemoteRet` is the `remote()` call's response, as in PyTorch.
#[test]
fn remote_and_to_here_take_two_calls_and_the_owner_none_back() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    const ROUNDS: u64 = 20;
    for round in 0..ROUNDS {
        for handler in ["echo", "inline_echo"] {
            let message = Message::from_payload(vec![7; 64]);
            let expected = message.payload.clone();
            let rref = a
                .remote("bob", handler, message)
                .unwrap_or_else(|e| panic!("remote({handler}), round {round}: {e}"));
            let value = rref
                .to_here(Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("to_here({handler}), round {round}: {e}"));
            assert_eq!(value.payload, expected, "{handler}, round {round}");
            drop(rref);
        }
    }
    a.wait_until_pending_futures_and_users_flushed(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("the deletes were not acked: {e}"));
    let made = |agent: &RpcAgent, to: &str| agent.network_data().get(to).map_or(0, |d| d.num_calls);
    assert_eq!(
        made(&a, "bob"),
        ROUNDS * 2 * 3,
        "remote, to_here and USER_DELETE each"
    );
    assert_eq!(made(&b, "alice"), 0, "the owner called the caller back");
    let (_, _, ra, rb) = both(a, b, |agent| agent.join().map_err(|e| e.to_string()));
    assert_eq!((ra, rb), (Ok(()), Ok(())));
}
