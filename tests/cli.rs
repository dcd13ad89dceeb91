//! The `rdzv` binary as users run it: `store serve` prints its address, the store
//! subcommands print values and use exit codes, SIGTERM stops the server cleanly, and
//! `demo` and `rdma probe` run.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const RDZV: &str = env!("CARGO_BIN_EXE_rdzv");

struct Served {
    child: Child,
    addr: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve() -> Served {
    serve_with(&[])
}

fn serve_with(extra: &[&str]) -> Served {
    let mut child = Command::new(RDZV)
        .args(["store", "serve", "--host", "127.0.0.1", "--port", "0"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rdzv store serve");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read first line");
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    Served { child, addr }
}

fn store(addr: &str, args: &[&str]) -> Output {
    Command::new(RDZV)
        .args(["store", "--addr", addr])
        .args(args)
        .output()
        .expect("run rdzv store")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `--io epoll` with two loops, and the open-file limit raised and logged at start.
#[test]
fn serve_on_epoll_with_two_loops() {
    let served = serve_with(&["--io", "epoll", "--threads", "2", "--world-size", "8"]);
    let a = served.addr.as_str();
    let o = store(a, &["set", "k", "v"]);
    assert!(o.status.success(), "{o:?}");
    for _ in 0..4 {
        // New connections, spread over both loops.
        assert_eq!(stdout(&store(a, &["get", "k"])), "v\n");
    }
    let o = Command::new(RDZV)
        .args(["store", "serve", "--io", "kqueue"])
        .output()
        .expect("run rdzv store serve");
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("expected `auto`, `io-uring` or `epoll`"),
        "{o:?}"
    );
}

#[test]
fn store_subcommands_against_a_served_store() {
    let served = serve();
    let a = served.addr.as_str();
    assert!(a.starts_with("127.0.0.1:"), "{a}");

    let o = store(a, &["set", "greeting", "hello world"]);
    assert!(o.status.success(), "{o:?}");
    let o = store(a, &["get", "greeting"]);
    assert_eq!(stdout(&o), "hello world\n");
    let o = store(a, &["add", "counter", "5"]);
    assert_eq!(stdout(&o), "5\n");
    let o = store(a, &["add", "counter", "-2"]);
    assert_eq!(stdout(&o), "3\n");
    let o = store(a, &["check", "greeting", "counter"]);
    assert_eq!((stdout(&o).as_str(), o.status.code()), ("true\n", Some(0)));
    let o = store(a, &["check", "missing"]);
    assert_eq!((stdout(&o).as_str(), o.status.code()), ("false\n", Some(1)));
    let o = store(a, &["wait", "greeting"]);
    assert!(o.status.success(), "{o:?}");
    let o = store(a, &["wait", "missing", "--timeout", "0.2"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("timeout"),
        "{o:?}"
    );
    let o = store(a, &["num-keys"]);
    assert_eq!(stdout(&o), "2\n");
    let o = store(a, &["keys"]);
    let owned = stdout(&o);
    let mut keys: Vec<&str> = owned.lines().collect();
    keys.sort();
    assert_eq!(keys, ["counter", "greeting"]);
    let o = store(a, &["delete", "greeting"]);
    assert_eq!(stdout(&o), "true\n");
    let o = store(a, &["delete", "greeting"]);
    assert_eq!(stdout(&o), "false\n");
}

#[test]
fn errors_go_to_stderr_with_exit_code_1() {
    // Nothing listens on this port: a short connect timeout, then a clear error.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let o = Command::new(RDZV)
        .args([
            "store",
            "--addr",
            &format!("127.0.0.1:{port}"),
            "--connect-timeout",
            "0.3",
        ])
        .args(["get", "x"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(o.stdout.is_empty());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("cannot reach the store"), "{err}");
    let o = store("not-an-address", &["get", "x"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("HOST:PORT"));
}

#[test]
fn sigterm_stops_the_server_with_exit_0() {
    let mut served = serve();
    let o = store(&served.addr, &["set", "k", "v"]);
    assert!(o.status.success());
    let pid = served.child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = served.child.try_wait().unwrap() {
            assert_eq!(status.code(), Some(0), "serve exited with {status}");
            break;
        }
        assert!(Instant::now() < deadline, "server did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn demo_runs_and_agrees() {
    let o = Command::new(RDZV)
        .args(["demo", "--workers", "3"])
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains("every worker saw the same 3 names: yes"),
        "{out}"
    );
}

#[test]
fn rdma_probe_reports_without_panicking() {
    let o = Command::new(RDZV).args(["rdma", "probe"]).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    let out = stdout(&o);
    assert!(out.contains("ibv"), "{out}");
    assert!(out.contains("cuda"), "{out}");
}
