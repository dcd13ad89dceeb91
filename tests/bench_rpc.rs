//! `rdzv bench rpc` as users run it: a two-host run between `--listen` and `--connect`
//! processes on this host, and a local run, both with `--json`. The benchmark checks
//! every echo byte for byte and fails otherwise, so a successful run with its rows is a
//! run whose payloads round-tripped; these tests check the rows' fields, that every
//! size was measured over tcp and raw-tcp (with the agent's default channels, and with
//! `--channel basic`), and that what cannot run says why.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const RDZV: &str = env!("CARGO_BIN_EXE_rdzv");

/// A `--listen` process, killed if the test fails before it exits.
struct Listener {
    child: Child,
    addr: String,
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `rdzv bench rpc --listen 127.0.0.1:0`, or `None` (after saying why) where the
/// io_uring store cannot start.
fn listen() -> Option<Listener> {
    let mut child = Command::new(RDZV)
        .args(["bench", "rpc", "--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rdzv bench rpc --listen");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.expect("read stderr");
        if let Some(rest) = line.strip_prefix("rdzv bench rpc: listening on ") {
            let addr = rest.split(';').next().unwrap_or_default().to_string();
            // Keep draining stderr so that the listener never blocks on a full pipe.
            std::thread::spawn(move || lines.for_each(drop));
            return Some(Listener { child, addr });
        }
        seen.push(line);
    }
    let status = child.wait().expect("wait");
    eprintln!("SKIP: the listener exited ({status}) without listening: {seen:?}");
    None
}

fn json_lines(output: &Output) -> Vec<Value> {
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}")))
        .collect()
}

fn run(args: &[&str]) -> Output {
    let output = Command::new(RDZV)
        .args(["bench", "rpc"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run rdzv bench rpc");
    assert!(
        output.status.success(),
        "rdzv bench rpc {args:?}: {}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Checks every line and returns the measured ones as (transport, channel, payload).
fn check_rows(
    lines: &[Value],
    mode: &str,
    sizes: &[u64],
    iters: (u64, u64),
) -> BTreeSet<(String, String, u64)> {
    let mut measured = BTreeSet::new();
    for line in lines {
        assert_eq!(line["bench"], "rpc", "{line}");
        assert_eq!(line["mode"], mode, "{line}");
        let transport = line["transport"].as_str().expect("transport").to_string();
        let channel = line["channel"].as_str().expect("channel").to_string();
        if let Some(reason) = line.get("skipped") {
            let reason = reason.as_str().expect("skipped is text");
            assert!(!reason.is_empty(), "{line}");
            assert!(line.get("p50_us").is_none(), "a skip with numbers: {line}");
            continue;
        }
        let payload = line["payload_bytes"].as_u64().expect("payload_bytes");
        assert!(sizes.contains(&payload), "{line}");
        let expected_iters = if payload >= 1 << 20 { iters.1 } else { iters.0 };
        assert_eq!(line["iters"].as_u64(), Some(expected_iters), "{line}");
        let p50 = line["p50_us"].as_f64().expect("p50_us");
        let p99 = line["p99_us"].as_f64().expect("p99_us");
        let gbytes = line["gbytes_per_s"].as_f64().expect("gbytes_per_s");
        assert!(p50 > 0.0 && p99 >= p50, "{line}");
        assert!(gbytes.is_finite() && gbytes >= 0.0, "{line}");
        if payload > 0 {
            assert!(gbytes > 0.0, "{line}");
        }
        if transport == "raw-tcp" {
            assert_eq!(channel, "-", "{line}");
        }
        assert!(
            measured.insert((transport, channel, payload)),
            "a row twice: {line}"
        );
    }
    measured
}

/// The one channel the default list's rows of `transport` name.
fn negotiated_channel(measured: &BTreeSet<(String, String, u64)>, transport: &str) -> String {
    let channels: BTreeSet<&str> = measured
        .iter()
        .filter(|m| m.0 == transport)
        .map(|m| m.1.as_str())
        .collect();
    match channels.into_iter().collect::<Vec<_>>().as_slice() {
        [one] if ["xth", "cma", "mpt", "basic"].contains(one) => one.to_string(),
        other => panic!("{transport} rows name channels {other:?}, not one CPU channel"),
    }
}

#[test]
fn two_host_mode_between_listen_and_connect() {
    let Some(mut listener) = listen() else { return };
    let connect = listener.addr.clone();
    let sizes = [0u64, 1, 4096, 1 << 20];
    let output = run(&[
        "--connect",
        &connect,
        "--json",
        "--sizes",
        "0,1,4K,1M",
        "--iters",
        "20",
        "--big-iters",
        "3",
        "--transport",
        "tcp,shm,ibv",
    ]);
    let lines = json_lines(&output);
    let measured = check_rows(&lines, "two-host", &sizes, (20, 3));
    // No --channel: the agent's default list, and the rows name the channel the pipe
    // negotiated (cma where it is viable, else mpt over tcp; never a CUDA one for CPU
    // tensors).
    let channel = negotiated_channel(&measured, "tcp");
    for size in sizes {
        for (transport, channel) in [("tcp", channel.as_str()), ("raw-tcp", "-")] {
            assert!(
                measured.contains(&(transport.into(), channel.into(), size)),
                "no {transport} row for {size} bytes: {lines:?}"
            );
        }
    }
    // ibv and shm are measured at every size, or skipped with a reason: never silent.
    for transport in ["shm", "ibv"] {
        let rows = measured.iter().filter(|m| m.0 == transport).count();
        let skipped = lines
            .iter()
            .any(|l| l["transport"] == transport && l.get("skipped").is_some());
        assert!(
            rows == sizes.len() || (rows == 0 && skipped),
            "{transport}: {rows} rows, skipped: {skipped}"
        );
    }
    // The listener serves one run and exits on its own.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = listener.child.try_wait().expect("try_wait") {
            assert!(status.success(), "listener: {status}");
            break;
        }
        assert!(Instant::now() < deadline, "the listener did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_local_run_and_the_cuda_limit_row() {
    let output = run(&[
        "--json",
        "--sizes",
        "0,64K",
        "--iters",
        "10",
        "--transport",
        "tcp",
        "--channel",
        "basic",
        "--device",
        "cuda:0",
    ]);
    let lines = json_lines(&output);
    let measured = check_rows(&lines, "local", &[0, 64 << 10], (10, 10));
    for size in [0, 64 << 10] {
        assert!(measured.contains(&("tcp".into(), "basic".into(), size)));
        assert!(measured.contains(&("raw-tcp".into(), "-".into(), size)));
    }
    // The CUDA limit rows are measured, or skipped with the reason: never faked. A 0-byte
    // payload has only the device-to-device row.
    for (limit, rows_when_measured) in [("cuda-d2d", 2), ("h2d-pinned", 1), ("d2h-pinned", 1)] {
        let rows = measured.iter().filter(|m| m.0 == limit).count();
        let skip = lines
            .iter()
            .find(|l| l["transport"] == limit && l.get("skipped").is_some());
        match skip {
            Some(skip) => {
                assert_eq!(rows, 0, "{limit}");
                eprintln!("the {limit} limit row was skipped: {}", skip["skipped"]);
            }
            None => assert_eq!(rows, rows_when_measured, "{limit}"),
        }
    }
    // 0 B also gets a remote + to_here row.
    assert!(measured.contains(&("tcp rref".into(), "basic".into(), 0)));
    // Only tcp was asked for.
    assert!(lines.iter().all(|l| {
        [
            "tcp",
            "tcp rref",
            "raw-tcp",
            "cuda-d2d",
            "h2d-pinned",
            "d2h-pinned",
        ]
        .contains(&l["transport"].as_str().unwrap_or(""))
    }));
}

#[test]
fn the_table_puts_transports_side_by_side() {
    let output = run(&["--sizes", "0", "--iters", "5", "--transport", "tcp,ibv"]);
    let text = String::from_utf8_lossy(&output.stdout);
    let mut lines = text.lines();
    let header = lines.next().expect("a header");
    // The default channel list: columns name the channel each pipe negotiated.
    assert!(
        header.contains("tcp/") && header.contains("raw-tcp"),
        "{text}"
    );
    assert!(!header.contains("tcp/default"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("0 B")), "{text}");
    // ibv runs, or the output says why it did not.
    assert!(
        header.contains("ibv/") || text.contains("skipped ibv/default: "),
        "{text}"
    );
}
