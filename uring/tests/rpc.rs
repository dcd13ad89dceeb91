//! The RPC agent over tcp (`transports = ["tcp"]`): round trips, tensors byte for byte,
//! static-group errors, timeouts, graceful and non-graceful shutdown, a peer killed
//! mid-call, reconnects and metrics. In-process groups run one agent per thread on a `file://` store; the
//! killed-peer test runs the peer as a child process (this test binary, re-run with
//! `RDZV_RPC_TEST_CHILD` set).

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use rdzv_core::device::Device;
use rdzv_core::device_map::{DeviceMap, DeviceMaps};
use rdzv_core::negotiate::ChannelKind;
use rdzv_uring::rpc::{
    init_rpc, CallContext, CallError, CallErrorKind, FaultInjection, InitError, Inline, Message,
    RpcAgent, RpcOptions, Tensor, UsageError,
};

mod common;

use common::{echo, metric, pattern, sleep_message, sleep_ms, spawn_peer};

const CHILD_ENV: &str = "RDZV_RPC_TEST_CHILD";
const STORE_ENV: &str = "RDZV_RPC_TEST_STORE";

fn base_options(url: &str) -> RpcOptions {
    let mut options = RpcOptions::new(url)
        .with_handler("echo", echo)
        .with_handler("sleep", sleep_ms)
        .with_handler(
            "fail",
            |_: &CallContext, _: Message| -> Result<Message, String> {
                Err("the handler said no".to_string())
            },
        )
        .with_handler(
            "relay",
            |ctx: &CallContext, m: Message| -> Result<Message, String> {
                // A nested call back to the caller, through the handler's client.
                let caller = ctx.caller.clone();
                ctx.client
                    .rpc_sync(&caller, "whoami", m)
                    .map_err(|e| e.to_string())
            },
        )
        .with_handler(
            "panic",
            |_: &CallContext, _: Message| -> Result<Message, String> { panic!("boom") },
        )
        .with_handler("inline_echo", Inline(echo))
        .with_handler(
            "inline_relay",
            Inline(|ctx: &CallContext, m: Message| -> Result<Message, String> {
                // Blocking on the I/O thread would deadlock: refused before sending.
                let caller = ctx.caller.clone();
                ctx.client
                    .rpc_sync(&caller, "whoami", m)
                    .map_err(|e| e.to_string())
            }),
        )
        .with_handler(
            "inline_notify",
            Inline(|ctx: &CallContext, m: Message| -> Result<Message, String> {
                // Not waiting is fine: the nested call's future is dropped unawaited.
                let caller = ctx.caller.clone();
                let future = ctx.client.rpc_async(&caller, "echo", m);
                Ok(Message::from_payload(vec![u8::from(future.is_done())]))
            }),
        )
        .with_handler(
            "inline_panic",
            Inline(|_: &CallContext, _: Message| -> Result<Message, String> {
                panic!("inline boom")
            }),
        )
        .with_handler(
            "whoami",
            |ctx: &CallContext, _: Message| -> Result<Message, String> {
                Ok(Message::from_payload(
                    format!("{}:{}:{}", ctx.caller, ctx.caller_id, ctx.handler).into_bytes(),
                ))
            },
        );
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.num_worker_threads = 4;
    // These tests cover tcp; `rpc_shm.rs` covers shm, which workers on one host pick by
    // default.
    options.transports = Some(vec!["tcp".into()]);
    options
}

fn store_url(dir: &tempfile::TempDir) -> String {
    format!("file://{}", dir.path().join("store").display())
}

/// Starts one agent per name, each on its own thread, and returns them in rank order.
fn start_group(
    names: &[&str],
    url: &str,
    configure: impl Fn(usize, RpcOptions) -> RpcOptions,
) -> Vec<Result<RpcAgent, InitError>> {
    let world = names.len() as u32;
    let handles: Vec<_> = names
        .iter()
        .enumerate()
        .map(|(rank, name)| {
            let name = name.to_string();
            let options = configure(rank, base_options(url));
            thread::spawn(move || init_rpc(&name, rank as u32, Some(world), options))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|_| panic!("init thread panicked")))
        .collect()
}

fn pair(dir: &tempfile::TempDir) -> (RpcAgent, RpcAgent) {
    let mut agents = start_group(&["alice", "bob"], &store_url(dir), |_, o| o).into_iter();
    let a = agents
        .next()
        .map(|r| r.unwrap_or_else(|e| panic!("alice: {e}")));
    let b = agents
        .next()
        .map(|r| r.unwrap_or_else(|e| panic!("bob: {e}")));
    match (a, b) {
        (Some(a), Some(b)) => (a, b),
        _ => panic!("two agents expected"),
    }
}

/// Both agents' graceful shutdown, concurrently (it is a group barrier).
fn join_both(a: RpcAgent, b: RpcAgent) {
    let t = thread::spawn(move || b.join().map_err(|e| e.to_string()));
    assert_eq!(a.join().map_err(|e| e.to_string()), Ok(()));
    assert_eq!(t.join().ok(), Some(Ok(())));
}

#[test]
fn round_trips_payloads_handlers_and_errors() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    assert_eq!(a.world_size(), Some(2));
    let names: Vec<String> = a.worker_infos().iter().map(|w| w.to_string()).collect();
    assert_eq!(names.len(), 2);

    let request = Message {
        metadata: b"meta".to_vec(),
        payload: b"hello".to_vec(),
        tensors: Vec::new(),
    };
    let reply = a.rpc_sync("bob", "echo", request.clone());
    assert_eq!(reply.map_err(|e| e.to_string()), Ok(request.clone()));

    // The handler sees who called.
    let who = a.rpc_sync("bob", "whoami", Message::default());
    assert_eq!(
        who.map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"alice:0:whoami".to_vec())
    );
    // Both directions, and a call to oneself.
    let back = b.rpc_sync("alice", "echo", request.clone());
    assert_eq!(back.map_err(|e| e.to_string()), Ok(request.clone()));
    let own = a.rpc_sync("alice", "whoami", Message::default());
    assert_eq!(
        own.map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"alice:0:whoami".to_vec())
    );

    // A handler's nested call: bob asks alice who called.
    let nested = a.rpc_sync("bob", "relay", Message::default());
    assert_eq!(
        nested.map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"bob:1:whoami".to_vec())
    );
    // A client handle works from other threads.
    let client = a.client();
    let from_thread = thread::spawn(move || client.rpc_sync("bob", "echo", Message::default()));
    assert!(from_thread.join().map(|r| r.is_ok()).unwrap_or(false));

    // Many calls in flight at once, awaited out of order.
    let futures: Vec<_> = (0..64u32)
        .map(|i| {
            a.rpc_async(
                "bob",
                "echo",
                Message::from_payload(i.to_le_bytes().to_vec()),
            )
        })
        .collect();
    for (i, f) in futures.into_iter().enumerate().rev() {
        let got = futures_lite::future::block_on(f).map(|m| m.payload);
        assert_eq!(got.ok(), Some((i as u32).to_le_bytes().to_vec()));
    }

    // Handler errors and panics come back as remote errors; unknown names are errors.
    let failed = a.rpc_sync("bob", "fail", Message::default());
    assert!(failed
        .as_ref()
        .is_err_and(|e| e.is_remote() && !e.is_retryable()));
    match failed {
        Err(CallError::Remote {
            peer,
            handler,
            message,
        }) => {
            assert_eq!(peer, "bob");
            assert_eq!(handler, "fail");
            assert_eq!(message, "the handler said no");
        }
        other => panic!("expected a remote error, got {other:?}"),
    }
    let panicked = a.rpc_sync("bob", "panic", Message::default());
    let text = panicked.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("handler panic panicked: boom"), "{text}");
    let missing = a.rpc_sync("bob", "nope", Message::default());
    let text = missing.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        text.contains("no RPC handler named nope is registered on worker bob"),
        "{text}"
    );
    let unknown = a.rpc_sync("carol", "echo", Message::default());
    match &unknown {
        Err(e) => {
            assert!(e.is_usage() && !e.is_retryable(), "{e:?}");
            assert_eq!(e.kind(), CallErrorKind::Usage);
            assert_eq!(e.peer(), Some("carol"));
            assert!(matches!(
                e.usage(),
                Some(UsageError::UnknownWorker { name }) if name == "carol"
            ));
        }
        Ok(_) => panic!("a call to an unknown worker succeeded"),
    }
    assert!(matches!(
        a.get_worker_info("carol"),
        Err(UsageError::UnknownWorker { .. })
    ));
    // A handler registered later is reachable.
    b.register_handler("late", echo)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        b.register_handler("late", echo),
        Err(UsageError::HandlerExists { .. })
    ));
    assert!(a.rpc_sync("bob", "late", Message::default()).is_ok());
    // Fire and forget.
    assert!(a.remote("bob", "echo", Message::default()).is_ok());
    // A message over the frame limits fails alone, before anything is sent; the pipe
    // keeps working.
    let long = "h".repeat(2_000);
    let text = a
        .rpc_sync("bob", &long, Message::default())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        text.starts_with("cannot encode the RPC message for bob: "),
        "{text}"
    );
    assert!(text.contains("handler name"), "{text}");
    assert!(a.rpc_sync("bob", "echo", Message::default()).is_ok());

    join_both(a, b);
}

#[test]
fn inline_handlers_answer_on_the_io_thread_and_refuse_to_block() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let request = Message {
        metadata: b"m".to_vec(),
        payload: pattern(100_000, 3),
        tensors: vec![Tensor::cpu(pattern(1 << 20, 4))],
    };
    for _ in 0..3 {
        let reply = a.rpc_sync("bob", "inline_echo", request.clone());
        assert_eq!(reply.map_err(|e| e.to_string()), Ok(request.clone()));
    }
    // A blocking nested call fails with a text that says why, instead of hanging.
    let nested = a.rpc_sync("bob", "inline_relay", Message::default());
    let text = nested.map(|_| ()).map_err(|e| e.to_string());
    assert!(
        text.as_ref()
            .err()
            .is_some_and(|t| t.contains("inline handler")),
        "{text:?}"
    );
    // A nested call that is not awaited goes out.
    let notified = a.rpc_sync("bob", "inline_notify", Message::default());
    assert_eq!(notified.map(|m| m.payload.len()).ok(), Some(1));
    // A panic is the caller's error, and the I/O thread goes on serving.
    let panicked = a.rpc_sync("bob", "inline_panic", Message::default());
    let text = panicked.map(|_| ()).map_err(|e| e.to_string());
    assert!(
        text.as_ref()
            .err()
            .is_some_and(|t| t.contains("inline boom")),
        "{text:?}"
    );
    let after = a.rpc_sync("bob", "inline_echo", Message::default());
    assert!(after.is_ok(), "{after:?}");
    join_both(a, b);
}

#[test]
fn concurrent_callers_share_a_pipe_and_each_gets_its_own_reply() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let a = std::sync::Arc::new(a);
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let a = std::sync::Arc::clone(&a);
            thread::spawn(move || {
                for i in 0..100u32 {
                    // Pool handlers (echo) and inline ones, small and 300 KiB tensors.
                    let handler = if i % 2 == 0 { "echo" } else { "inline_echo" };
                    let len = if i % 10 == 0 { 300 * 1024 } else { 16 };
                    let mut payload = vec![t];
                    payload.extend_from_slice(&i.to_le_bytes());
                    let request = Message {
                        metadata: Vec::new(),
                        payload,
                        tensors: vec![Tensor::cpu(pattern(len, t ^ i as u8))],
                    };
                    let reply = a.rpc_sync("bob", handler, request.clone());
                    assert_eq!(reply.map_err(|e| e.to_string()), Ok(request), "{t}/{i}");
                }
            })
        })
        .collect();
    // Meanwhile, futures nobody waits on right away.
    let futures: Vec<_> = (0..50u32)
        .map(|i| {
            a.rpc_async(
                "bob",
                "echo",
                Message::from_payload(i.to_le_bytes().to_vec()),
            )
        })
        .collect();
    for thread in threads {
        assert!(thread.join().is_ok());
    }
    for (i, f) in futures.into_iter().enumerate() {
        assert_eq!(
            f.wait().map(|m| m.payload).ok(),
            Some((i as u32).to_le_bytes().to_vec())
        );
    }
    let a = std::sync::Arc::try_unwrap(a).unwrap_or_else(|_| panic!("agent still shared"));
    join_both(a, b);
}

#[test]
fn tensors_arrive_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    for (len, seed) in [(0usize, 1u8), (1, 2), (1 << 20, 3), (64 << 20, 4)] {
        let data = pattern(len, seed);
        let request = Message::from_payload(vec![seed]).with_tensor(Tensor::cpu(data.clone()));
        let reply = a
            .rpc_sync("bob", "echo", request)
            .unwrap_or_else(|e| panic!("{len} bytes: {e}"));
        assert_eq!(reply.tensors.len(), 1, "{len} bytes");
        let tensor = reply
            .tensors
            .first()
            .cloned()
            .unwrap_or_else(|| Tensor::cpu(Vec::new()));
        assert_eq!(tensor.device, Device::cpu());
        assert_eq!(tensor.data.len(), len);
        assert!(tensor.data == data, "{len} bytes differ");
    }
    // Several tensors in one message keep their order.
    let many = Message::default()
        .with_tensor(Tensor::cpu(pattern(3, 9)))
        .with_tensor(Tensor::cpu(Vec::new()))
        .with_tensor(Tensor::cpu(pattern(70_000, 10)));
    let reply = a.rpc_sync("bob", "echo", many.clone());
    assert_eq!(reply.map_err(|e| e.to_string()), Ok(many));
    // Large (read straight into the tensor) and small (through the receive buffer)
    // frames back to back on one pipe, in flight together.
    let sizes: Vec<usize> = (0..24)
        .map(|i| if i % 2 == 0 { 300_000 + i } else { 10 + i })
        .collect();
    let futures: Vec<_> = sizes
        .iter()
        .map(|&len| {
            let m = Message::default().with_tensor(Tensor::cpu(pattern(len, len as u8)));
            a.rpc_async("bob", "echo", m)
        })
        .collect();
    for (future, &len) in futures.into_iter().zip(&sizes) {
        let reply = future.wait().unwrap_or_else(|e| panic!("{len} bytes: {e}"));
        let data = reply
            .tensors
            .first()
            .map(|t| t.data.clone())
            .unwrap_or_default();
        assert!(data == pattern(len, len as u8), "{len} bytes differ");
    }
    // Without CUDA runtimes no channel serves a CUDA tensor: a clear error, nothing
    // sent.
    let cuda = Message::default().with_tensor(Tensor {
        device: Device::cuda(0),
        data: vec![1],
        memory: None,
    });
    let text = a
        .rpc_sync("bob", "echo", cuda)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        text.contains("no negotiated channel serves that pair"),
        "{text}"
    );
    join_both(a, b);
}

#[test]
fn duplicate_names_fail_on_every_worker() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let results = start_group(&["twin", "twin"], &store_url(&dir), |_, o| o);
    for (rank, result) in results.into_iter().enumerate() {
        let text = result.err().map(|e| e.to_string()).unwrap_or_default();
        let expected = if rank == 0 {
            "RPC worker name twin is not unique. Workers 0 and 1 share the same name."
        } else {
            "RPC worker name twin is not unique. Workers 1 and 0 share the same name."
        };
        assert_eq!(text, expected, "rank {rank}");
    }
}

#[test]
fn inconsistent_device_maps_fail_on_every_worker() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let results = start_group(&["gpu0", "gpu1"], &store_url(&dir), |rank, mut o| {
        o.device_count = 1;
        if rank == 0 {
            let mut maps = DeviceMaps::new();
            maps.insert(
                "gpu1",
                DeviceMap::from([(Device::cuda(0), Device::cuda(1))]),
            );
            o.device_maps = maps;
        }
        o
    });
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(InitError::DeviceMaps(e)) => {
                let text = e.to_string();
                assert!(
                    text.starts_with(
                        "Node gpu0 has target devices with invalid indices in its device map for gpu1"
                    ),
                    "rank {rank}: {text}"
                );
            }
            other => panic!("rank {rank}: expected a device map error, got {other:?}"),
        }
    }
}

#[test]
fn unusable_options_fail_before_the_rendezvous() {
    let mut options = RpcOptions::new("file:///nonexistent/never/created");
    options.transports = Some(vec!["carrier-pigeon".into()]);
    let error = init_rpc("w", 0, Some(1), options).err();
    // An `InitError` about configuration: retrying cannot help.
    assert!(
        error
            .as_ref()
            .is_some_and(|e| e.is_configuration() && !e.is_retryable()),
        "{error:?}"
    );
    assert!(matches!(
        error,
        Some(InitError::Offer {
            option: "transports",
            ..
        })
    ));
    let text = error.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        text.starts_with("invalid RPC option transports: "),
        "{text}"
    );
    assert!(text.contains("carrier-pigeon"), "{text}");
    let mut options = RpcOptions::new("file:///nonexistent/never/created");
    options.channels = Some(vec!["basic".into(), "cuda_magic".into()]);
    let text = init_rpc("w", 0, Some(1), options)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(text.contains("cuda_magic"), "{text}");
    // A CUDA channel without a CUDA runtime is left out, saying why; with nothing left,
    // that is the error.
    let mut options = RpcOptions::new("file:///nonexistent/never/created");
    options.channels = Some(vec!["cuda_ipc".into()]);
    let text = init_rpc("w", 0, Some(1), options)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        text.contains("no channel left") && text.contains("cuda_ipc needs a CUDA runtime"),
        "{text}"
    );
}

#[test]
fn timeouts_fail_with_pytorchs_text_and_late_replies_are_dropped() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let started = Instant::now();
    let result = a.rpc_sync_with_timeout(
        "bob",
        "sleep",
        sleep_message(1_500),
        Some(Duration::from_millis(100)),
    );
    let elapsed = started.elapsed();
    let error = result.err();
    assert!(
        error
            .as_ref()
            .is_some_and(|e| e.is_timeout() && e.is_retryable() && e.peer() == Some("bob")),
        "{error:?}"
    );
    let text = error.map(|e| e.to_string()).unwrap_or_default();
    assert_eq!(
        text,
        "RPC ran for more than set timeout (100 ms) and will now be marked with an error"
    );
    assert!(elapsed >= Duration::from_millis(100), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(1_400), "{elapsed:?}");
    assert_eq!(
        metric(&a, "agent.client_active_calls").as_deref(),
        Some("0")
    );

    // The late reply arrives and is dropped; the pipe keeps working.
    thread::sleep(Duration::from_millis(1_600));
    let ok = a.rpc_sync("bob", "echo", Message::from_payload(b"after".to_vec()));
    assert_eq!(
        ok.map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"after".to_vec())
    );
    let data = a.network_data();
    let bob = data.get("bob").copied().unwrap_or_default();
    assert_eq!(bob.num_calls, 2);
    assert_eq!(bob.total_errors, 1);

    // A zero timeout never expires, even with a tiny agent default.
    let result = a.rpc_sync_with_timeout("bob", "sleep", sleep_message(150), Some(Duration::ZERO));
    assert_eq!(
        result.map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"slept".to_vec())
    );
    join_both(a, b);
}

/// The timer thread is not woken by back-to-back calls (it sleeps until an earlier
/// call's deadline): a short timeout after many calls, and one behind a long call still in
/// flight, must still fire on time.
#[test]
fn a_short_timeout_fires_on_time_after_many_calls_and_behind_a_long_one() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    for _ in 0..50 {
        let ok = a.rpc_sync("bob", "echo", Message::from_payload(b"x".to_vec()));
        assert!(ok.is_ok(), "{ok:?}");
    }
    let long = a.rpc_async_with_timeout(
        "bob",
        "sleep",
        sleep_message(1_000),
        Some(Duration::from_secs(30)),
    );
    let started = Instant::now();
    let short = a.rpc_sync_with_timeout(
        "bob",
        "sleep",
        sleep_message(1_500),
        Some(Duration::from_millis(100)),
    );
    let elapsed = started.elapsed();
    assert!(
        short.as_ref().err().is_some_and(|e| e.is_timeout()),
        "{short:?}"
    );
    assert!(
        elapsed < Duration::from_millis(900),
        "timed out after {elapsed:?}"
    );
    assert_eq!(
        long.wait().map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"slept".to_vec())
    );
    join_both(a, b);
}

#[test]
fn agent_default_timeout_applies() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut agents = start_group(&["x", "y"], &store_url(&dir), |_, mut o| {
        o.rpc_timeout = Duration::from_millis(50);
        o
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")));
    let (Some(x), Some(y)) = (agents.next(), agents.next()) else {
        panic!("two agents expected")
    };
    let text = x
        .rpc_sync("y", "sleep", sleep_message(300))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert_eq!(
        text,
        "RPC ran for more than set timeout (50 ms) and will now be marked with an error"
    );
    thread::sleep(Duration::from_millis(300));
    join_both(x, y);
}

#[test]
fn graceful_join_waits_for_calls_in_flight() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let slow = a.rpc_async("bob", "sleep", sleep_message(400));
    let slow_back = b.rpc_async("alice", "sleep", sleep_message(300));
    let started = Instant::now();
    let (b_done_tx, b_done_rx) = mpsc::channel();
    let t = thread::spawn(move || {
        let r = b.join().map_err(|e| e.to_string());
        let _ = b_done_tx.send(());
        (r, b)
    });
    assert_eq!(a.join().map_err(|e| e.to_string()), Ok(()));
    assert!(started.elapsed() >= Duration::from_millis(350));
    let _ = b_done_rx.recv_timeout(Duration::from_secs(10));
    let (b_result, b) = t.join().unwrap_or_else(|_| panic!("join thread panicked"));
    assert_eq!(b_result, Ok(()));
    assert_eq!(
        slow.wait().map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"slept".to_vec())
    );
    assert_eq!(
        slow_back
            .wait()
            .map(|m| m.payload)
            .map_err(|e| e.to_string()),
        Ok(b"slept".to_vec())
    );
    // After shutdown every call fails at once, and a second shutdown does nothing.
    let after = a.rpc_sync("bob", "echo", Message::default());
    assert!(
        matches!(after, Err(CallError::ShutDown { .. })),
        "{after:?}"
    );
    assert!(a.shutdown(true).is_ok());
    assert!(b.shutdown(false).is_ok());
}

#[test]
fn non_graceful_shutdown_fails_pending_futures_quickly() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let pending = a.rpc_async("bob", "sleep", sleep_message(3_000));
    thread::sleep(Duration::from_millis(100));
    assert_eq!(
        metric(&a, "agent.client_active_calls").as_deref(),
        Some("1")
    );
    assert_eq!(
        metric(&b, "agent.server_active_calls").as_deref(),
        Some("1")
    );
    let started = Instant::now();
    assert!(a.shutdown(false).is_ok());
    let result = pending.wait();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let text = result.err().map(|e| e.to_string()).unwrap_or_default();
    assert_eq!(
        text,
        "the RPC agent of worker alice is shut down; the call did not complete"
    );
    assert!(b.shutdown(false).is_ok());
}

#[test]
fn broken_pipes_fail_their_calls_and_are_recreated() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    assert!(a.rpc_sync("bob", "echo", Message::default()).is_ok());

    // The callee drops its pipes: the caller's next call opens a new one.
    b.reset_pipes();
    thread::sleep(Duration::from_millis(100));
    let again = a.rpc_sync("bob", "echo", Message::from_payload(b"again".to_vec()));
    assert_eq!(
        again.map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"again".to_vec())
    );

    // A pipe that breaks under a call fails it at once with a clear error.
    let pending = a.rpc_async("bob", "sleep", sleep_message(2_000));
    thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    b.reset_pipes();
    let result = pending.wait();
    assert!(started.elapsed() < Duration::from_secs(1));
    match result {
        Err(CallError::PipeBroken { peer, .. }) => assert_eq!(peer, "bob"),
        other => panic!("expected a broken pipe, got {other:?}"),
    }
    let text = a
        .rpc_sync("bob", "echo", Message::default())
        .map(|_| "ok".to_string())
        .unwrap_or_else(|e| e.to_string());
    assert_eq!(text, "ok");
    let bob = a.network_data().get("bob").copied().unwrap_or_default();
    assert_eq!(bob.num_calls, 4);
    assert_eq!(bob.total_errors, 1);
    thread::sleep(Duration::from_millis(2_000));
    join_both(a, b);
}

/// A pool handler that outlives its inbound pipe answers into the void: the response
/// is dropped, and the agent keeps accepting, handshaking and answering. (The response
/// used to bounce between the I/O thread and the lane registry forever, and the I/O
/// thread never accepted again.)
#[test]
fn response_after_its_pipe_ended_does_not_stall_the_agent() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    assert!(a.rpc_sync("bob", "echo", Message::default()).is_ok());
    // Bob's handler is still running when bob drops the pipe it came on.
    let pending = a.rpc_async("bob", "sleep", sleep_message(300));
    thread::sleep(Duration::from_millis(100));
    b.reset_pipes();
    assert!(matches!(pending.wait(), Err(CallError::PipeBroken { .. })));
    // The handler answers now, on a pipe that no longer exists.
    thread::sleep(Duration::from_millis(400));
    // Alice's next call needs a new pipe: bob must accept and handshake it.
    let started = Instant::now();
    let reply = a.rpc_sync_with_timeout(
        "bob",
        "echo",
        Message::from_payload(b"still here".to_vec()),
        Some(Duration::from_secs(5)),
    );
    let elapsed = started.elapsed();
    assert_eq!(
        reply.map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"still here".to_vec())
    );
    assert!(
        elapsed < Duration::from_secs(1),
        "the call took {elapsed:?}"
    );
    join_both(a, b);
}

#[test]
fn metrics_count_calls_bytes_and_active_calls() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let keys: Vec<String> = a.get_metrics().into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        keys,
        [
            "agent.thread_pool_size",
            "agent.num_idle_threads",
            "agent.client_active_calls",
            "agent.server_active_calls",
            "agent.server_active_async_calls",
        ]
    );
    assert_eq!(metric(&a, "agent.thread_pool_size").as_deref(), Some("4"));
    for _ in 0..3 {
        let reply = a.rpc_sync("bob", "echo", Message::from_payload(vec![0; 10]));
        assert!(reply.is_ok());
    }
    // Request: 40-byte header + "echo" + 10 payload bytes; response: header + payload.
    let bob = a.network_data().get("bob").copied().unwrap_or_default();
    assert_eq!(bob.num_calls, 3);
    assert_eq!(bob.total_sent_bytes, 3 * (40 + 4 + 10));
    assert_eq!(bob.total_recv_bytes, 3 * (40 + 10));
    assert_eq!(bob.total_errors, 0);
    assert!(b.network_data().get("alice").is_none());

    let pending = a.rpc_async("bob", "sleep", sleep_message(300));
    thread::sleep(Duration::from_millis(100));
    assert_eq!(
        metric(&a, "agent.client_active_calls").as_deref(),
        Some("1")
    );
    assert_eq!(
        metric(&b, "agent.server_active_calls").as_deref(),
        Some("1")
    );
    assert_eq!(metric(&b, "agent.num_idle_threads").as_deref(), Some("3"));
    assert!(pending.wait().is_ok());
    assert_eq!(
        metric(&a, "agent.client_active_calls").as_deref(),
        Some("0")
    );
    thread::sleep(Duration::from_millis(50));
    assert_eq!(
        metric(&b, "agent.server_active_calls").as_deref(),
        Some("0")
    );
    assert_eq!(metric(&b, "agent.num_idle_threads").as_deref(), Some("4"));
    join_both(a, b);
}

#[test]
fn fault_injection_fails_and_delays_chosen_handlers() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut agents = start_group(&["faulty", "fine"], &store_url(&dir), |rank, mut o| {
        if rank == 0 {
            o.fault_injection = FaultInjection {
                fail_handlers: vec!["echo".into()],
                num_fail_sends: 2,
                delays: vec![("whoami".into(), Duration::from_millis(300))],
            };
        }
        o
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")));
    let (Some(faulty), Some(fine)) = (agents.next(), agents.next()) else {
        panic!("two agents expected")
    };
    for _ in 0..2 {
        let text = faulty
            .rpc_sync("fine", "echo", Message::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(text, "Send attempt failed intentionally for echo");
    }
    assert!(faulty.rpc_sync("fine", "echo", Message::default()).is_ok());
    // Other handlers and the other worker are not affected.
    assert!(faulty.rpc_sync("fine", "sleep", sleep_message(0)).is_ok());
    assert!(fine.rpc_sync("faulty", "echo", Message::default()).is_ok());
    // A delayed handler arrives late but arrives.
    let started = Instant::now();
    let who = faulty.rpc_sync("fine", "whoami", Message::default());
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(
        who.map(|m| m.payload).map_err(|e| e.to_string()),
        Ok(b"faulty:0:whoami".to_vec())
    );
    let data = faulty
        .network_data()
        .get("fine")
        .copied()
        .unwrap_or_default();
    assert_eq!(data.total_errors, 2);
    join_both(faulty, fine);
}

/// Fault injection wraps a lane's sender, so a faulty worker's pipes carry channels
/// like any other: a request that lends a tensor and fails on purpose fails alone (the
/// pipe stays, and its machine forgets the request), and the next ones lend, are
/// answered and acked, both ways.
#[test]
fn fault_injection_runs_on_lanes_and_lends_tensors() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut agents = start_group(&["faulty", "fine"], &store_url(&dir), |rank, mut o| {
        if rank == 0 {
            o.fault_injection = FaultInjection {
                fail_handlers: vec!["echo".into()],
                num_fail_sends: 1,
                delays: Vec::new(),
            };
        }
        o
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")));
    let (Some(faulty), Some(fine)) = (agents.next(), agents.next()) else {
        panic!("two agents expected")
    };
    let big = pattern(2 << 20, 7);
    let call = |agent: &RpcAgent, to: &str| {
        agent
            .rpc_sync(
                to,
                "echo",
                Message::default().with_tensor(Tensor::cpu(big.clone())),
            )
            .map(|m| m.tensors.into_iter().map(|t| t.data).collect::<Vec<_>>())
            .map_err(|e| e.to_string())
    };
    assert_eq!(
        call(&faulty, "fine"),
        Err("Send attempt failed intentionally for echo".to_string())
    );
    for _ in 0..3 {
        assert_eq!(call(&faulty, "fine"), Ok(vec![big.clone()]));
        assert_eq!(call(&fine, "faulty"), Ok(vec![big.clone()]));
    }
    // In one process the pipe lends over xth, both ways.
    assert_eq!(faulty.pipe_channel("fine"), Some(ChannelKind::Xth));
    assert_eq!(fine.pipe_channel("faulty"), Some(ChannelKind::Xth));
    join_both(faulty, fine);
}

/// A faulty worker runs lanes, so it also runs mpt (pushed stripes, nothing lent).
#[test]
fn fault_injection_runs_mpt() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut agents = start_group(&["faulty", "fine"], &store_url(&dir), |rank, mut o| {
        o.channels = Some(vec!["mpt".into(), "basic".into()]);
        if rank == 0 {
            o.fault_injection.fail_handlers = vec!["sleep".into()];
            o.fault_injection.num_fail_sends = 1;
        }
        o
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")));
    let (Some(faulty), Some(fine)) = (agents.next(), agents.next()) else {
        panic!("two agents expected")
    };
    let big = pattern(1 << 20, 3);
    for (from, to) in [(&faulty, "fine"), (&fine, "faulty")] {
        let reply = from
            .rpc_sync(
                to,
                "echo",
                Message::default().with_tensor(Tensor::cpu(big.clone())),
            )
            .map(|m| m.tensors.into_iter().map(|t| t.data).collect::<Vec<_>>())
            .map_err(|e| e.to_string());
        assert_eq!(reply, Ok(vec![big.clone()]));
    }
    assert_eq!(faulty.pipe_channel("fine"), Some(ChannelKind::Mpt));
    assert!(faulty.rpc_sync("fine", "sleep", sleep_message(0)).is_err());
    assert!(faulty.rpc_sync("fine", "sleep", sleep_message(0)).is_ok());
    join_both(faulty, fine);
}

#[test]
fn test_helpers_wait_for_flushes_and_node_failures() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    let slow = a.rpc_async("bob", "sleep", sleep_message(300));
    let text = a
        .wait_until_pending_futures_flushed(Duration::from_millis(50))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert_eq!(
        text,
        "Timed out waiting to flush pending futures, had 1 pending futures"
    );
    let started = Instant::now();
    assert!(a
        .wait_until_pending_futures_flushed(Duration::from_secs(10))
        .is_ok());
    assert!(started.elapsed() >= Duration::from_millis(150));
    assert!(slow.is_done());
    // Bob is alive: no failure within the time given.
    assert!(a
        .wait_until_node_failure("bob", Duration::from_millis(300))
        .is_none());
    let bob = i64::from(b.worker_info().id().get());
    assert!(matches!(
        a.wait_until_node_failure_on_rank(bob, "(", Duration::from_secs(1)),
        Err(UsageError::InvalidArgument { .. })
    ));
    assert!(matches!(
        a.wait_until_node_failure_on_rank(99, ".*", Duration::from_secs(1)),
        Err(UsageError::UnknownWorkerId { id: 99 })
    ));
    assert!(b.shutdown(false).is_ok());
    // By rank, with PyTorch's `expected_error_regex`: failures that do not match are
    // ignored until the time is up, and one that matches is returned as text.
    let unmatched = a.wait_until_node_failure_on_rank(
        bob,
        "^no error reads like this$",
        Duration::from_millis(300),
    );
    assert!(matches!(unmatched, Ok(None)), "{unmatched:?}");
    let matched = a.wait_until_node_failure_on_rank(bob, "(?i)bob", Duration::from_secs(10));
    assert!(
        matches!(&matched, Ok(Some(text)) if text.to_lowercase().contains("bob")),
        "{matched:?}"
    );
    let failure = a.wait_until_node_failure("bob", Duration::from_secs(10));
    assert!(
        matches!(
            failure,
            Some(
                CallError::PipeBroken { .. }
                    | CallError::Connect { .. }
                    | CallError::Handshake { .. }
            )
        ),
        "{failure:?}"
    );
    assert!(a.shutdown(false).is_ok());
}

fn dynamic_member(name: &str, rank: u32, url: &str) -> RpcAgent {
    init_rpc(name, rank, None, base_options(url)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn member_names(agent: &RpcAgent) -> Vec<String> {
    agent
        .worker_infos()
        .iter()
        .map(|w| w.name().to_string())
        .collect()
}

#[test]
fn dynamic_members_join_call_each_other_and_leave() {
    // A tcp:// store hosted by rank 0 (which leaves last, as PyTorch requires).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!("tcp://127.0.0.1:{port}");
    let first = dynamic_member("first", 0, &url);
    assert_eq!(first.world_size(), None);
    assert_eq!(member_names(&first), ["first"]);
    let second = dynamic_member("second", 1, &url);
    // The newcomer told the member: both see both, and calls work both ways.
    assert_eq!(member_names(&first), ["first", "second"]);
    assert_eq!(member_names(&second), ["first", "second"]);
    assert_eq!(
        first
            .rpc_sync("second", "whoami", Message::default())
            .map(|m| m.payload)
            .map_err(|e| e.to_string()),
        Ok(b"first:0:whoami".to_vec())
    );
    assert!(second.rpc_sync("first", "echo", Message::default()).is_ok());
    let third = dynamic_member("third", 2, &url);
    for agent in [&first, &second, &third] {
        assert_eq!(member_names(agent), ["first", "second", "third"]);
    }
    assert!(third.rpc_sync("second", "echo", Message::default()).is_ok());

    // A taken rank is refused.
    let text = init_rpc("intruder", 1, None, base_options(&url))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert_eq!(
        text,
        "RPC worker id 1 is not unique. Worker second and already has ID and intruder cannot be added."
    );
    // A static member cannot join a dynamic group.
    let text = init_rpc("static", 5, Some(6), base_options(&url))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        text.starts_with("RPC group mixes statically and dynamically initialized members"),
        "{text}"
    );

    // The second leaves: the others forget it.
    assert!(second.join().is_ok());
    assert_eq!(member_names(&first), ["first", "third"]);
    assert_eq!(member_names(&third), ["first", "third"]);
    assert!(matches!(
        first.rpc_sync("second", "echo", Message::default()),
        Err(CallError::Usage(UsageError::UnknownWorker { .. }))
    ));
    assert!(first.rpc_sync("third", "echo", Message::default()).is_ok());
    assert!(third.join().is_ok());
    assert!(first.join().is_ok());
}

/// The child role of [`killed_peer_fails_pending_calls_quickly`]: rank 1, whose
/// `die` handler kills the process.
fn run_child() {
    common::exit_when_parent_gone();
    let Ok(url) = std::env::var(STORE_ENV) else {
        std::process::exit(2)
    };
    let options = base_options(&url).with_handler(
        "die",
        |_: &CallContext, _: Message| -> Result<Message, String> { std::process::abort() },
    );
    match init_rpc("victim", 1, Some(2), options) {
        Ok(agent) => {
            // Serve until killed; never shut down.
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
fn killed_peer_fails_pending_calls_quickly() {
    if std::env::var_os(CHILD_ENV).is_some() {
        run_child();
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = store_url(&dir);
    let mut child = spawn_peer(
        "killed_peer_fails_pending_calls_quickly",
        &[(CHILD_ENV, "1"), (STORE_ENV, &url)],
    );
    let agent = init_rpc("survivor", 0, Some(2), base_options(&url))
        .unwrap_or_else(|e| panic!("parent init: {e}"));
    assert!(agent.rpc_sync("victim", "echo", Message::default()).is_ok());
    let pending = agent.rpc_async("victim", "sleep", sleep_message(30_000));
    let started = Instant::now();
    let dying = agent.rpc_async("victim", "die", Message::default());
    let died = dying.wait();
    let first = pending.wait();
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
    for result in [died, first] {
        match result {
            Err(e @ CallError::PipeBroken { .. }) => {
                // A killed peer is worth a retry: the next call opens a new pipe.
                assert!(e.is_retryable(), "{e:?}");
                assert_eq!(e.kind(), CallErrorKind::PipeBroken);
                assert_eq!(e.peer(), Some("victim"));
            }
            other => panic!("expected a broken pipe, got {other:?}"),
        }
    }
    let status = child.wait(common::PEER_EXIT_LIMIT);
    assert!(!status.success());
    // The next call tries a new pipe and fails at once: nobody listens any more.
    let text = agent
        .rpc_sync("victim", "echo", Message::default())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    // Depending on timing the kernel refuses the connection or resets it during the
    // handshake.
    assert!(
        text.starts_with("cannot open an RPC pipe to victim at tcp://127.0.0.1:")
            || text.starts_with("RPC pipe handshake with victim failed: "),
        "{text}"
    );
    let victim = agent
        .network_data()
        .get("victim")
        .copied()
        .unwrap_or_default();
    assert_eq!(victim.total_errors, 3);
    assert_eq!(
        metric(&agent, "agent.client_active_calls").as_deref(),
        Some("0")
    );
    assert!(agent.shutdown(false).is_ok());
}

/// Latency of a noop `rpc_sync` over tcp next to a plain TCP ping-pong of the same
/// size (the physical limit). A measurement, not a check: run it with
/// `cargo test --release -p rdzv-uring --test rpc noop_latency -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement; run it in release mode on a quiet machine"]
fn noop_latency() {
    use std::io::{Read, Write};
    const ROUNDS: usize = 5_000;
    let percentile = |mut v: Vec<Duration>, p: usize| {
        v.sort();
        v.get(v.len() * p / 100).copied().unwrap_or_default()
    };

    // Raw TCP: a 40-byte ping and pong (an RPC frame header each way).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    let server = thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else {
            return;
        };
        let _ = s.set_nodelay(true);
        let mut buf = [0u8; 40];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&buf).is_err() {
                return;
            }
        }
    });
    let mut client = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("{e}"));
    let _ = client.set_nodelay(true);
    let mut raw = Vec::with_capacity(ROUNDS);
    let mut buf = [0u8; 40];
    for _ in 0..ROUNDS {
        let t = Instant::now();
        client.write_all(&buf).unwrap_or_else(|e| panic!("{e}"));
        client
            .read_exact(&mut buf)
            .unwrap_or_else(|e| panic!("{e}"));
        raw.push(t.elapsed());
    }
    drop(client);
    let _ = server.join();

    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = pair(&dir);
    for _ in 0..200 {
        assert!(a.rpc_sync("bob", "echo", Message::default()).is_ok());
    }
    let mut rpc = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        assert!(a.rpc_sync("bob", "echo", Message::default()).is_ok());
        rpc.push(t.elapsed());
    }
    let (raw50, raw99) = (percentile(raw.clone(), 50), percentile(raw, 99));
    let (rpc50, rpc99) = (percentile(rpc.clone(), 50), percentile(rpc, 99));
    println!("raw-tcp 40 B ping-pong: p50 {raw50:?} p99 {raw99:?}");
    println!("rpc_sync noop over tcp: p50 {rpc50:?} p99 {rpc99:?}");
    assert!(rpc50 < Duration::from_millis(50), "{rpc50:?}");
    join_both(a, b);
}
