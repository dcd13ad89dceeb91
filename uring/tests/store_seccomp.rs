//! `IoMode::Auto` where io_uring is refused, as in Docker ≥ 25 and containerd 2, whose
//! default seccomp profiles fail `io_uring_setup` with `EPERM`.
//!
//! The test re-runs this test binary as a child that installs such a filter (with the
//! `seccompiler` crate) on itself, checks that io_uring really is refused, and starts a
//! store server with the default options. The parent then talks to that server like any
//! client. The child also starts two RPC agents (whose I/O threads need no io_uring) and
//! makes a call with a tensor between them. The child dies with the parent
//! (`PR_SET_PDEATHSIG`) and exits when the parent closes its stdin.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdzv_uring::rpc::{init_rpc, CallContext, Message, RpcAgent, RpcOptions, Tensor};
use rdzv_uring::store::tcp::TcpStore;
use rdzv_uring::{IoMode, ServerOptions, Store, StoreServer};
use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

/// Set in the child's environment.
const CHILD_ENV: &str = "RDZV_SECCOMP_CHILD";
const TEST_NAME: &str = "auto_falls_back_to_epoll_where_io_uring_is_refused";

#[test]
fn auto_falls_back_to_epoll_where_io_uring_is_refused() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return child();
    }
    let exe = std::env::current_exe().expect("path of this test binary");
    let mut child = Command::new(exe)
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("re-run this test binary as the filtered child");
    let stdout = child.stdout.take().expect("child stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut probe = None;
    let mut rpc = None;
    let (addr, io) = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .expect("the child reports its server within 30 s");
        // libtest may print "test NAME ... " just before the child's first line.
        let after = |marker: &str| line.find(marker).map(|at| &line[at + marker.len()..]);
        if let Some(rest) = after("io_uring_setup under the filter: ") {
            probe = Some(rest.to_string());
        }
        if let Some(rest) = after("rpc under the filter: ") {
            rpc = Some(rest.to_string());
        }
        if let Some(reason) = after("skipped: ") {
            // The kernel has no seccomp filters: nothing to test here.
            println!("skipped: {reason}");
            let _ = child.wait();
            return;
        }
        if let Some(rest) = after("listening on ") {
            let (addr, io) = rest.split_once(" io=").expect("address and io mode");
            break (addr.to_string(), io.to_string());
        }
        assert!(!line.contains("child failed"), "{line}");
    };
    assert_eq!(
        probe.as_deref(),
        Some("EPERM"),
        "the filter must refuse io_uring the way Docker's profile does"
    );
    assert_eq!(io, "epoll", "auto must fall back to epoll");
    assert_eq!(
        rpc.as_deref(),
        Some("a 1 MiB tensor went there and back"),
        "two RPC agents under the filter"
    );
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    let host = host.to_string();
    let port: u16 = port.parse().expect("port");
    let store = TcpStore::connect(&host, port, Duration::from_secs(10)).expect("connect");
    store.set("fallback", b"served").unwrap();
    assert_eq!(store.get("fallback").unwrap(), b"served");
    assert_eq!(store.add("count", 2).unwrap(), 2);
    // A wait released by another connection.
    let waiter = std::thread::spawn(move || {
        let other = TcpStore::connect(&host, port, Duration::from_secs(10)).expect("connect");
        other.wait(&["late"], Some(Duration::from_secs(10)))
    });
    std::thread::sleep(Duration::from_millis(50));
    store.set("late", b"1").unwrap();
    waiter.join().unwrap().unwrap();
    drop(child.stdin.take());
    let stopped = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().expect("child status") {
            assert!(status.success(), "the child exited with {status}");
            break;
        }
        if Instant::now() >= stopped {
            let _ = child.kill();
            panic!("the child did not exit after its stdin closed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// In the child: die with the parent, refuse io_uring, serve until stdin closes.
fn child() {
    if let Err(e) = run_child() {
        println!("child failed: {e}");
        std::process::exit(1);
    }
}

fn run_child() -> Result<(), String> {
    let parent = rustix::process::getppid();
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .map_err(|e| format!("PR_SET_PDEATHSIG: {e}"))?;
    if rustix::process::getppid() != parent {
        // The parent died before the death signal was armed.
        std::process::exit(1);
    }
    let arch = TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|e| format!("no seccomp filter for this architecture: {e}"))?;
    let rules = BTreeMap::from([(libc::SYS_io_uring_setup, Vec::new())]);
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| format!("seccomp filter: {e}"))?;
    let program: BpfProgram = filter
        .try_into()
        .map_err(|e| format!("compile the filter: {e:?}"))?;
    if let Err(e) = seccompiler::apply_filter_all_threads(&program) {
        // Only a kernel without seccomp filters (EINVAL) is a reason to skip.
        let text = format!("{e}");
        if text.contains("Invalid argument") || text.contains("os error 22") {
            println!("skipped: this kernel cannot install a seccomp filter ({text})");
            return Ok(());
        }
        return Err(format!("install the seccomp filter: {text}"));
    }
    let probe = match io_uring::IoUring::new(2) {
        Ok(_) => "allowed".to_string(),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => "EPERM".to_string(),
        Err(e) => e.to_string(),
    };
    println!("io_uring_setup under the filter: {probe}");
    let server = StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        io: IoMode::Auto,
        ..ServerOptions::default()
    })
    .map_err(|e| format!("start the server: {e}"))?;
    let rpc = rpc_round_trip().unwrap_or_else(|e| format!("failed: {e}"));
    println!("rpc under the filter: {}", rpc.replace('\n', " "));
    println!(
        "listening on {} io={}",
        server.local_addr(),
        server.io_mode()
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // Serve until the parent closes our stdin (or dies, taking us with it).
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    server.shutdown();
    Ok(())
}

/// Two agents (default transports and channels, as users get them) and one `rpc_sync`
/// with a tensor between them, then both leave gracefully.
fn rpc_round_trip() -> Result<String, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let url = format!("file://{}", dir.path().join("store").display());
    let start = |name: &'static str, rank: u32| {
        let mut options = RpcOptions::new(&url).with_handler(
            "echo",
            |_: &CallContext, m: Message| -> Result<Message, String> { Ok(m) },
        );
        options.listen_host = Some([127, 0, 0, 1].into());
        // Both agents live in this process: one store prefix for the group.
        options.init_counter = Some(0);
        std::thread::spawn(move || init_rpc(name, rank, Some(2), options))
    };
    let (alice, bob) = (start("alice", 0), start("bob", 1));
    let started = |h: std::thread::JoinHandle<Result<RpcAgent, _>>, name: &str| {
        h.join()
            .map_err(|_| format!("{name}'s init_rpc panicked"))?
            .map_err(|e| format!("{name}'s init_rpc: {e}"))
    };
    let alice = started(alice, "alice")?;
    let bob = started(bob, "bob")?;
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let request = Message::from_payload(b"hi".to_vec()).with_tensor(Tensor::cpu(data.clone()));
    let reply = alice
        .rpc_sync("bob", "echo", request)
        .map_err(|e| format!("rpc_sync: {e}"))?;
    if reply.payload != b"hi" || reply.tensors.first().map(|t| &t.data) != Some(&data) {
        return Err("the reply differs from the request".into());
    }
    let leaving = std::thread::spawn(move || bob.join().map_err(|e| e.to_string()));
    alice.join().map_err(|e| format!("alice's join: {e}"))?;
    leaving
        .join()
        .map_err(|_| "bob's join panicked".to_string())?
        .map_err(|e| format!("bob's join: {e}"))?;
    Ok("a 1 MiB tensor went there and back".into())
}
