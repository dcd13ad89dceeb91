//! The tokio example driver (`examples/tokio_store.rs`) holds every rule of core's store
//! step: rdzv's own TCP client through every operation (PyTorch's `StoreTestBase` cases,
//! `store_base`), the hostile cases that need no loop-specific feature
//! (`store_attacks`, which `store_hostile.rs` runs on both of rdzv's loops), and, with
//! `RDZV_TORCH_PYTHON` set to a Python that has torch, PyTorch's own TCPStore client
//! (`tests/pytorch/pytorch_client.py`, what `tests/pytorch/run.sh` runs against
//! `rdzv store serve`).

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use rdzv::core::store::budget::Budget;
use rdzv::uring::store::tcp::TcpStore;
use rdzv::uring::Store;

#[allow(dead_code, unreachable_pub)] // `main` and the `pub` of a binary's items
#[path = "../examples/tokio_store.rs"]
mod tokio_store;
#[macro_use]
mod store_attacks;
mod store_base;
mod store_serve;

/// The example's server on 127.0.0.1, on a runtime of its own (dropped with it).
struct TokioServer {
    server: Arc<tokio_store::Server>,
    port: u16,
    _runtime: tokio::runtime::Runtime,
}

fn tokio_server() -> TokioServer {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_io()
        .build()
        .expect("build a tokio runtime");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener
        .set_nonblocking(true)
        .expect("non-blocking listener");
    let port = listener.local_addr().expect("listener address").port();
    let server = tokio_store::Server::new(Budget::default());
    let serving = Arc::clone(&server);
    runtime.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("register listener");
        if let Err(error) = serving.serve(listener).await {
            panic!("the tokio store stopped accepting: {error}");
        }
    });
    TokioServer {
        server,
        port,
        _runtime: runtime,
    }
}

impl store_attacks::Target for TokioServer {
    fn port(&self) -> u16 {
        self.port
    }
    fn waiters(&self) -> usize {
        self.server.counts().0
    }
    fn connections(&self) -> usize {
        self.server.counts().1
    }
}

fn client(server: &TokioServer) -> TcpStore {
    TcpStore::connect("127.0.0.1", server.port, Duration::from_secs(10)).expect("connect")
}

#[test]
fn every_operation_of_rdzvs_client() {
    let server = tokio_server();
    let store = client(&server);
    // set, add, get, check, num_keys; compare_set; wait (with a timeout); append;
    // multi_set, multi_get; queue push, pop, len, non-blocking pop.
    store_base::set_get_check(&store, 5);
    store_base::compare_set(&store);
    store_base::simple_wait(&store);
    store_base::append(&store);
    store_base::multi_set_get(&store);
    store_base::queues(&store);
    store_base::queues_nonblocking(&store);
    store_base::queues_bidirectional(&store);
    store_base::clone_shares(&store);
    // A wait released by a set on another connection: a wake-up that crosses tasks.
    let a: Arc<dyn Store> = Arc::new(client(&server));
    store_base::multi_threaded_wait(a, Arc::new(client(&server)));
    let keys = store.num_keys().unwrap();
    assert!(store.delete_key("key0").unwrap());
    assert!(!store.delete_key("key0").unwrap());
    assert_eq!(store.num_keys().unwrap(), keys - 1);
    store_base::queues_timeout(&store);
}

/// The native `BARRIER` (append's test leaves a `bar` key above, so on a fresh server).
#[test]
fn a_barrier_of_four_clients() {
    store_base::barrier(&client(&tokio_server()), 4);
}

for_each_attack!(attack_tests!(tokio_server));

/// PyTorch's TCPStore client through every `Store` call, then a 4-rank gloo
/// `init_process_group` + `all_reduce` whose agent store is this server: parts 1 and 3
/// of `tests/pytorch/run.sh`, against the tokio driver.
#[test]
fn pytorch_tcpstore_client_and_gloo_agent_store() {
    let Ok(python) = std::env::var("RDZV_TORCH_PYTHON") else {
        println!("skipped: set RDZV_TORCH_PYTHON to a python with torch to run PyTorch's client");
        return;
    };
    let server = tokio_server();
    let port = server.port.to_string();
    let Some(out) = torch_script(&python, "pytorch_client.py", &["127.0.0.1", &port]) else {
        return;
    };
    assert!(out.contains("PYTORCH CLIENT OK"), "{out}");
    let out = torch_script(&python, "gloo_agent_store.py", &[&port]).unwrap_or_default();
    assert!(out.contains("gloo all_reduce over rdzv store: OK"), "{out}");
}

/// Runs `tests/pytorch/<script>` with `python`: its stdout, or `None` (with the reason
/// printed) when that Python has no torch. Panics with its output if it fails.
fn torch_script(python: &str, script: &str, args: &[&str]) -> Option<String> {
    let path = format!("{}/tests/pytorch/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python)
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python} {path}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    if stderr.contains("No module named 'torch'") {
        println!("skipped: {python} cannot import torch");
        return None;
    }
    assert!(out.status.success(), "{script}: {stdout}\n{stderr}");
    Some(stdout)
}
