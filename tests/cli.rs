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
    /// The rest of the server's standard output.
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
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
    let mut command = Command::new(RDZV);
    command
        .args(["store", "serve", "--host", "127.0.0.1", "--port", "0"])
        .args(extra)
        .env_remove("RDZV_ADDR");
    serve_command(command)
}

/// Runs `command` (a `store serve`) and waits for its "listening on" line.
fn serve_command(mut command: Command) -> Served {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rdzv store serve");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    let mut reader = BufReader::new(stdout);
    reader.read_line(&mut line).expect("read first line");
    let Some(addr) = line
        .trim()
        .strip_prefix("listening on ")
        .map(str::to_string)
    else {
        // Say why: the server's stderr (it has exited, or will once killed).
        let _ = child.kill();
        let mut stderr = String::new();
        if let Some(mut err) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut err, &mut stderr);
        }
        let status = child.wait();
        panic!("unexpected first line {line:?} from {command:?} ({status:?}); stderr:\n{stderr}");
    };
    Served {
        child,
        addr,
        lines: reader.lines(),
    }
}

fn store(addr: &str, args: &[&str]) -> Output {
    Command::new(RDZV)
        .args(["store", "--addr", addr])
        .args(args)
        .output()
        .expect("run rdzv store")
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{o:?}");
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

/// Runs `rdzv store ARGS` with `env` added and `--addr` left out.
fn store_env(env: &[(&str, &str)], args: &[&str]) -> Output {
    Command::new(RDZV)
        .arg("store")
        .args(args)
        .env_remove("RDZV_ADDR")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .envs(env.iter().copied())
        .output()
        .expect("run rdzv store")
}

#[test]
fn every_store_operation_is_a_subcommand() {
    let served = serve();
    let a = served.addr.as_str();
    let ok = |o: &Output| assert!(o.status.success(), "{o:?}");

    ok(&store(a, &["multi-set", "x=1", "y=2"]));
    assert_eq!(stdout(&store(a, &["multi-get", "x", "y"])), "1\n2\n");
    assert_eq!(
        stdout(&store(a, &["compare-set", "x", "1", "one"])),
        "one\n"
    );
    assert_eq!(
        stdout(&store(a, &["compare-set", "x", "1", "uno"])),
        "one\n"
    );
    // A missing key with an empty EXPECTED is created.
    assert_eq!(
        stdout(&store(a, &["compare-set", "fresh", "", "new"])),
        "new\n"
    );
    ok(&store(a, &["append", "x", "-more"]));
    assert_eq!(stdout(&store(a, &["get", "x"])), "one-more\n");

    ok(&store(a, &["queue", "push", "jobs", "first"]));
    ok(&store(a, &["queue", "push", "jobs", "second"]));
    assert_eq!(stdout(&store(a, &["queue", "len", "jobs"])), "2\n");
    assert_eq!(stdout(&store(a, &["queue", "pop", "jobs"])), "first\n");
    assert_eq!(stdout(&store(a, &["queue", "pop", "jobs"])), "second\n");
    let o = store(a, &["queue", "pop", "jobs", "--no-wait"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("empty"),
        "{o:?}"
    );

    ok(&store(a, &["barrier", "b", "--world-size", "1"]));
    let o = store(
        a,
        &["barrier", "b2", "--world-size", "2", "--timeout", "0.2"],
    );
    assert_eq!(o.status.code(), Some(2), "{o:?}");

    let o = store(a, &["stats"]);
    ok(&o);
    let text = stdout(&o);
    assert!(text.starts_with("connections  "), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("requests ") && l.contains(" VALIDATE ")),
        "{text}"
    );
    let o = store(a, &["stats", "-o", "json"]);
    ok(&o);
    let stats: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("stats json");
    assert!(stats["connections"].as_u64() >= Some(1), "{stats}");
    assert!(stats["keys"].as_u64() >= Some(2), "{stats}");
    assert!(stats["requests"]["VALIDATE"].as_u64() >= Some(1), "{stats}");
    assert!(stats["requests"]["STATS"].as_u64() >= Some(2), "{stats}");
    assert!(stats["bytes_in"].as_u64() > Some(0), "{stats}");
    assert!(stats["uptime_ms"].is_u64(), "{stats}");

    let o = store(a, &["ping", "--count", "3"]);
    ok(&o);
    assert_eq!(
        stdout(&o)
            .lines()
            .filter(|l| l.starts_with("pong in "))
            .count(),
        3
    );

    let o = store(a, &["get", "nothing-here", "--no-wait"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(o.stdout.is_empty());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("nothing-here"),
        "{o:?}"
    );

    let o = store(a, &["keys", "--prefix", "f"]);
    assert_eq!(stdout(&o), "fresh\n");
}

#[test]
fn values_are_binary_safe_and_json_output_is_one_object_per_result() {
    let served = serve();
    let a = served.addr.as_str();
    let dir = tempfile::tempdir().expect("temp dir");
    let binary: Vec<u8> = (0..=255u8).rev().collect();
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &binary).expect("write input");

    let o = store(
        a,
        &[
            "set",
            "blob",
            "--value-file",
            input.to_str().expect("utf-8 path"),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let output = dir.path().join("out.bin");
    let o = store(
        a,
        &["get", "blob", "--out", output.to_str().expect("utf-8 path")],
    );
    assert!(o.status.success(), "{o:?}");
    assert_eq!(std::fs::read(&output).expect("read output"), binary);

    // --hex both ways.
    let o = store(a, &["--hex", "set", "h", "00ff10"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(stdout(&store(a, &["get", "h", "--hex"])), "00ff10\n");
    let o = store(a, &["--hex", "set", "bad", "0g"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not hex"),
        "{o:?}"
    );

    // JSON: text values as text, others as base64, counts as numbers.
    store(a, &["set", "t", "plain"]);
    let o = store(a, &["-o", "json", "multi-get", "t", "h"]);
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 2, "{o:?}");
    assert_eq!(lines[0]["key"], "t");
    assert_eq!(lines[0]["value"], "plain");
    assert_eq!(lines[1]["value_base64"], "AP8Q");
    let o = store(a, &["add", "n", "7", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("json");
    assert_eq!(v["value"], 7);
    let o = store(a, &["check", "n", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("json");
    assert_eq!(v["ready"], true);
}

#[test]
fn the_address_defaults_to_rdzv_addr_then_master_addr_and_port() {
    let served = serve();
    let a = served.addr.as_str();
    let port = a.rsplit_once(':').map(|(_, p)| p).expect("HOST:PORT");
    let o = store(a, &["set", "where", "here"]);
    assert!(o.status.success(), "{o:?}");
    let o = store_env(&[("RDZV_ADDR", a)], &["get", "where"]);
    assert_eq!(stdout(&o), "here\n", "{o:?}");
    let o = store_env(
        &[("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)],
        &["get", "where"],
    );
    assert_eq!(stdout(&o), "here\n", "{o:?}");
    let o = store_env(&[], &["get", "where"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("RDZV_ADDR") && err.contains("MASTER_ADDR"),
        "{err}"
    );
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
    // The real cause, said plainly; never a name lookup that did not fail.
    assert!(err.contains("connection refused"), "{err}");
    assert!(!err.contains("no address"), "{err}");
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

#[test]
fn completions_and_man_pages_come_from_the_clap_definitions() {
    for (shell, marker) in [
        ("bash", "_rdzv()"),
        ("zsh", "#compdef rdzv"),
        ("fish", "complete -c rdzv"),
    ] {
        let o = Command::new(RDZV)
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(o.status.success(), "{shell}: {o:?}");
        let script = stdout(&o);
        assert!(script.contains(marker), "{shell}: {script:.200}");
        assert!(
            script.contains("compare-set"),
            "{shell} completes the store subcommands"
        );
    }
    let o = Command::new(RDZV).arg("man").output().unwrap();
    assert!(o.status.success(), "{o:?}");
    assert!(stdout(&o).contains(".TH rdzv 1"), "{}", stdout(&o));
    let dir = tempfile::tempdir().expect("temp dir");
    let o = Command::new(RDZV)
        .args(["man", "--out-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    for page in [
        "rdzv.1",
        "rdzv-store.1",
        "rdzv-store-serve.1",
        "rdzv-store-queue-pop.1",
    ] {
        let text = std::fs::read_to_string(dir.path().join(page))
            .unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.contains(".TH"), "{page}");
    }
}

#[test]
fn json_logs_are_one_object_per_line() {
    let o = Command::new(RDZV)
        .args([
            "--log-format",
            "json",
            "store",
            "--addr",
            "127.0.0.1:1",
            "--connect-timeout",
            "0.2",
            "get",
            "k",
        ])
        .env("RUST_LOG", "debug")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    let logs: Vec<serde_json::Value> = err
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert!(!logs.is_empty(), "no JSON log line in {err}");
    assert!(logs
        .iter()
        .all(|l| l["level"].is_string() && l["fields"].is_object()));
    // The error itself is still one plain line for people.
    assert!(
        err.lines()
            .any(|l| l.starts_with("rdzv: cannot reach the store")),
        "{err}"
    );
}

/// `--listen-fd N` serves on a socket the parent bound and left open across exec, and
/// systemd's socket activation (fd 3, `LISTEN_PID` = the server's pid, set through
/// `sh -c 'exec ...'` so the pid is the server's) does the same with two epoll loops
/// sharing the one listener. A descriptor that is not a listening socket is refused
/// with an error naming it.
#[test]
fn serve_on_an_inherited_listening_socket() {
    use std::os::fd::AsRawFd;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address").to_string();
    // Inherited by the children (and, harmlessly, by any other child spawned meanwhile).
    rustix::io::fcntl_setfd(&listener, rustix::io::FdFlags::empty()).expect("clear FD_CLOEXEC");
    let fd = listener.as_raw_fd();

    let mut command = Command::new(RDZV);
    command.args(["store", "serve", "--listen-fd", &fd.to_string()]);
    let served = serve_command(command);
    assert_eq!(served.addr, addr, "it serves on the inherited socket");
    ok(&store(&addr, &["set", "k", "inherited"]));
    assert_eq!(stdout(&store(&addr, &["get", "k"])), "inherited\n");
    drop(served);

    // bash, not sh: dash refuses a descriptor above 9 in a redirection ("Bad fd
    // number"), and the listener's number depends on what the test process has open.
    let mut command = Command::new("bash");
    command
        .arg("-c")
        .arg(format!(
            "exec 3<&{fd}; export LISTEN_PID=$$ LISTEN_FDS=1; \
             exec \"$0\" store serve --io epoll --threads 2"
        ))
        .arg(RDZV);
    let served = serve_command(command);
    assert_eq!(served.addr, addr, "systemd's fd 3 is served");
    ok(&store(&addr, &["set", "k", "activated"]));
    for _ in 0..4 {
        // New connections, accepted by either loop.
        assert_eq!(stdout(&store(&addr, &["get", "k"])), "activated\n");
    }
    drop(served);

    // Several io_uring loops (`--io auto`: epoll where io_uring is refused), each
    // accepting on a duplicate of the one socket.
    let mut command = Command::new(RDZV);
    command.args([
        "store",
        "serve",
        "--threads",
        "2",
        "--listen-fd",
        &fd.to_string(),
    ]);
    let served = serve_command(command);
    assert_eq!(served.addr, addr);
    for i in 0..4 {
        ok(&store(&addr, &["set", "k", &format!("loop{i}")]));
    }
    assert_eq!(stdout(&store(&addr, &["get", "k"])), "loop3\n");
    drop(served);

    let o = Command::new(RDZV)
        .args(["store", "serve", "--listen-fd", "0"])
        .stdin(Stdio::null())
        .output()
        .expect("run rdzv store serve");
    assert!(!o.status.success(), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("inherited file descriptor 0") && err.contains("is not a socket"),
        "{err}"
    );
}

/// One HTTP/1.1 GET over a raw socket: the status line and the body.
fn http_get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the metrics port");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/plain\r\n\r\n"
    )
    .expect("send the request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the response");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of head in {response:?}"));
    let status = head.lines().next().unwrap_or_default().to_string();
    let length: usize = head
        .lines()
        // Header names are case-insensitive (hyper writes them in lower case).
        .find_map(|l| {
            l.split_once(':')
                .filter(|(name, _)| name.eq_ignore_ascii_case("content-length"))
                .map(|(_, n)| n)
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no Content-Length in {head:?}"));
    assert_eq!(length, body.len(), "Content-Length matches the body");
    (status, body.to_string())
}

/// Parses Prometheus' text format: every sample line as (name with labels, value), and
/// checks that each sample's family was declared with `# TYPE` before it.
fn parse_prometheus(text: &str) -> Vec<(String, f64)> {
    let mut declared = Vec::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            declared.push(parts.next().expect("family name").to_string());
            let kind = parts.next().expect("family type");
            assert!(["gauge", "counter", "histogram"].contains(&kind), "{line}");
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let name = series.split('{').next().unwrap_or_default();
        assert!(
            declared.iter().any(|family| name == family
                || name
                    .strip_prefix(family.as_str())
                    .is_some_and(|suffix| { ["_bucket", "_sum", "_count"].contains(&suffix) })),
            "{name} has no # TYPE line before it"
        );
        samples.push((series.to_string(), value));
    }
    samples
}

/// `store serve --metrics 127.0.0.1:0` prints where it serves, and a scrape after some
/// requests shows them: gauges, request counters, bytes and a duration histogram whose
/// buckets are cumulative and end in `+Inf` = `_count`.
#[test]
fn serve_metrics_in_prometheus_text_format() {
    let mut served = serve_with(&["--metrics", "127.0.0.1:0"]);
    let line = served
        .lines
        .next()
        .expect("a second line")
        .expect("read it");
    let url = line
        .strip_prefix("metrics on http://")
        .unwrap_or_else(|| panic!("unexpected line {line:?}"));
    let metrics_addr = url.strip_suffix("/metrics").expect("the /metrics path");
    let a = served.addr.clone();
    ok(&store(&a, &["set", "k", "v"]));
    ok(&store(&a, &["set", "k2", "v"]));
    // SET has no reply: a GET of each key (which waits for it) makes sure both were
    // served before the scrape.
    assert_eq!(stdout(&store(&a, &["get", "k"])), "v\n");
    assert_eq!(stdout(&store(&a, &["get", "k2"])), "v\n");

    let (status, body) = http_get(metrics_addr, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    let samples = parse_prometheus(&body);
    let value = |series: &str| {
        samples
            .iter()
            .find(|(name, _)| name == series)
            .map(|&(_, v)| v)
            .unwrap_or_else(|| panic!("no {series} in\n{body}"))
    };
    assert_eq!(value("rdzv_store_keys"), 2.0);
    assert_eq!(value("rdzv_store_waiters"), 0.0);
    assert_eq!(value("rdzv_store_requests_total{query=\"SET\"}"), 2.0);
    assert!(value("rdzv_store_requests_total{query=\"VALIDATE\"}") >= 3.0);
    assert!(value("rdzv_store_received_bytes_total") > 0.0);
    assert!(value("rdzv_store_sent_bytes_total") > 0.0);
    // The server process's own figures, as Prometheus' client libraries name them.
    assert!(value("process_resident_memory_bytes") > 0.0);
    assert!(value("process_open_fds") >= 3.0);
    assert!(value("process_cpu_seconds_total") >= 0.0);
    assert!(value("rdzv_store_uptime_seconds") >= 0.0);
    let count = value("rdzv_store_request_duration_seconds_count{query=\"SET\"}");
    assert_eq!(count, 2.0);
    let buckets: Vec<f64> = samples
        .iter()
        .filter(|(name, _)| {
            name.starts_with("rdzv_store_request_duration_seconds_bucket{query=\"SET\"")
        })
        .map(|&(_, v)| v)
        .collect();
    assert!(buckets.len() > 2, "{body}");
    assert!(
        buckets.windows(2).all(|w| w[0] <= w[1]),
        "cumulative: {buckets:?}"
    );
    assert_eq!(
        value("rdzv_store_request_duration_seconds_bucket{query=\"SET\",le=\"+Inf\"}"),
        count
    );
    assert!(value("rdzv_store_request_duration_seconds_sum{query=\"SET\"}") > 0.0);

    let (status, _) = http_get(metrics_addr, "/nothing");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
}

/// `serve --addr H:P` and `RDZV_ADDR` bind where they say (they were silently ignored);
/// with --host as well, or unbindable, they are refused.
#[test]
fn serve_binds_where_addr_and_rdzv_addr_say() {
    let mut command = Command::new(RDZV);
    command
        .args(["store", "serve", "--addr", "127.0.0.1:0"])
        .env_remove("RDZV_ADDR");
    let served = serve_command(command);
    assert!(served.addr.starts_with("127.0.0.1:"), "{}", served.addr);
    assert!(!served.addr.ends_with(":29500"), "{}", served.addr);
    drop(served);

    let mut command = Command::new(RDZV);
    command
        .args(["store", "serve"])
        .env("RDZV_ADDR", "127.0.0.1:0");
    let served = serve_command(command);
    assert!(served.addr.starts_with("127.0.0.1:"), "{}", served.addr);
    drop(served);

    let o = Command::new(RDZV)
        .args(["store", "serve", "--host", "127.0.0.1"])
        .env("RDZV_ADDR", "127.0.0.1:0")
        .output()
        .unwrap();
    assert!(!o.status.success(), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("RDZV_ADDR") && err.contains("--host"), "{err}");

    // An address this host does not have: refused, not bound elsewhere.
    let o = Command::new(RDZV)
        .args(["store", "serve", "--addr", "192.0.2.1:0"])
        .env_remove("RDZV_ADDR")
        .output()
        .unwrap();
    assert!(!o.status.success(), "{o:?}");
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("listening on"),
        "{o:?}"
    );

    let o = Command::new(RDZV)
        .args(["store", "serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("--addr") && help.contains("--port"), "{help}");
    for client in ["--connect-timeout", "--hex", "--output"] {
        assert!(!help.contains(client), "{client} in serve --help:\n{help}");
    }
}

/// A value over the server's limit is refused by the client before it is sent, naming the
/// limit; `add` on a value that is not an integer, which the server answers by closing
/// the connection, is explained, with where to look.
#[test]
fn refusals_are_explained() {
    let served = serve();
    let a = served.addr.as_str();
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big");
    std::fs::write(&big, vec![b'x'; 8 * 1024 * 1024 + 1]).unwrap();
    let o = store(a, &["set", "big", "--value-file", big.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("exceeds the limit of 8388608"), "{err}");
    assert!(err.contains("not sent"), "{err}");
    assert!(!err.contains("reset by peer"), "{err}");

    ok(&store(a, &["set", "word", "hello"]));
    let o = store(a, &["add", "word", "1"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not an integer"), "{err}");
    assert!(err.contains("log"), "{err}");
    assert!(!err.contains("Did the remote server shutdown"), "{err}");
    // The server is still there for everyone else.
    assert_eq!(stdout(&store(a, &["get", "word"])), "hello\n");
}

/// `serve --allow` / `--token-file` are checked (a bad entry stops serve), and valid ones
/// start a server that enforces them; a client's `--token-file` is sent, and a server
/// without tokens refuses it with a sentence that says so.
#[test]
fn access_flags_are_checked_and_never_silently_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "# job 1\nf0H3kd8Jq2LmZp5Vw9XyTb1C /job1/\n").unwrap();
    let serve = |args: &[&str]| {
        Command::new(RDZV)
            .args(["store", "serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .env_remove("RDZV_ADDR")
            .output()
            .unwrap()
    };
    let o = serve(&["--allow", "10.0.0.0/8,nonsense"]);
    assert!(!o.status.success(), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("entry 2"),
        "{o:?}"
    );
    // Valid flags start a server that enforces them: the token reaches its prefix, a
    // client without a token is refused.
    let guarded = serve_with(&[
        "--allow",
        "127.0.0.0/8",
        "--token-file",
        tokens.to_str().unwrap(),
    ]);
    let o = store(
        &guarded.addr,
        &[
            "--token-file",
            tokens.to_str().unwrap(),
            "set",
            "job1/k",
            "v",
        ],
    );
    assert!(o.status.success(), "{o:?}");
    // Without a token the server closes the handshake and the client retries until its
    // connect timeout (30 s by default): a short one keeps the test quick.
    let started = std::time::Instant::now();
    let o = store(
        &guarded.addr,
        &["--connect-timeout", "0.5", "get", "job1/k"],
    );
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("see its log"), "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "the refused client took {:?}",
        started.elapsed()
    );
    // The value was set: the token's client reads it back.
    let o = store(
        &guarded.addr,
        &["--token-file", tokens.to_str().unwrap(), "get", "job1/k"],
    );
    assert_eq!(stdout(&o), "v\n", "{o:?}");

    let served = serve_with(&[]);
    let o = store(
        &served.addr,
        &["--token-file", tokens.to_str().unwrap(), "get", "k"],
    );
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("refused this client's token"), "{err}");
    assert!(!err.contains("f0H3kd8Jq2LmZp5Vw9XyTb1C"), "{err}");
}
