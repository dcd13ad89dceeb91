//! `rdzv rendezvous elastic://…` as operators run it: three nodes (processes of the
//! binary) against a store server, one of them stopped with SIGTERM (it leaves and exits
//! 0), the other two print the next round; a fourth node joining the full round waits as
//! a hot spare.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use rdzv::uring::{ServerOptions, StoreServer};

struct Node {
    child: Child,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(url: &str, name: &str, lines: &mpsc::Sender<(String, String)>) -> Node {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rdzv"))
        .args(["rendezvous", url, "--node-id", name])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn rdzv rendezvous");
    let stdout = child.stdout.take().expect("piped");
    let lines = lines.clone();
    let name = name.to_string();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines.send((name.clone(), line));
        }
    });
    Node { child }
}

/// Reads lines until `want` lines satisfy `pred`, or 30 s pass.
fn expect_lines(
    lines: &mpsc::Receiver<(String, String)>,
    want: usize,
    pred: impl Fn(&str, &str) -> bool,
) -> Vec<(String, String)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok((node, line)) if pred(&node, &line) => got.push((node, line)),
            Ok(_) => {}
            Err(_) => panic!("only {got:?} after 30 s"),
        }
    }
    got
}

#[test]
fn rendezvous_command_prints_rounds_and_leaves_on_sigterm() {
    let server = StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        ..ServerOptions::default()
    })
    .expect("server");
    let url = format!(
        // A generous keep-alive timeout (3 s): nobody is declared dead by a loaded machine,
        // rounds here end only by leaving.
        "elastic://127.0.0.1:{}/cli?nodes=2:3&last_call=300ms&keep_alive_interval=200ms\
         &keep_alive_max_attempts=15",
        server.port()
    );
    let (tx, rx) = mpsc::channel();
    let mut nodes: Vec<Node> = ["a", "b", "c"]
        .iter()
        .map(|name| spawn(&url, name, &tx))
        .collect();
    let round0 = expect_lines(&rx, 3, |_, line| line.starts_with("round 0 "));
    let mut ranks: Vec<&str> = round0
        .iter()
        .map(|(_, line)| {
            assert!(
                line.ends_with("world_size 3 store_prefix torch.rendezvous.cli.0"),
                "{line}"
            );
            line.split_whitespace().nth(3).expect("rank")
        })
        .collect();
    ranks.sort_unstable();
    assert_eq!(ranks, ["0", "1", "2"]);

    // A fourth node finds the round full: a hot spare.
    let _spare = spawn(&url, "d", &tx);
    expect_lines(&rx, 1, |node, line| {
        node == "d" && line == "waiting after round 0 (hot spare)"
    });

    // SIGTERM: node a leaves and exits 0; the round ends, and the next one takes the
    // spare in: b, c and d.
    let a = nodes.remove(0);
    let status = Command::new("kill")
        .args(["-TERM", &a.child.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(status.success());
    expect_lines(&rx, 1, |node, line| node == "a" && line == "left");
    let mut a = a;
    let exit = a.child.wait().expect("wait for a");
    assert!(exit.success(), "{exit}");
    let round1 = expect_lines(&rx, 3, |_, line| line.starts_with("round 1 "));
    let mut who: Vec<&str> = round1.iter().map(|(node, _)| node.as_str()).collect();
    who.sort_unstable();
    assert_eq!(who, ["b", "c", "d"]);
    assert!(round1
        .iter()
        .all(|(_, line)| line.contains(" world_size 3 ")));

    // A new hot spare, then `--close`: the spare exits gracefully (0), and a node that
    // joins a closed run fails with RendezvousClosedError.
    let mut spare = spawn(&url, "e", &tx);
    expect_lines(&rx, 1, |node, line| {
        node == "e" && line == "waiting after round 1 (hot spare)"
    });
    let out = Command::new(env!("CARGO_BIN_EXE_rdzv"))
        .args(["rendezvous", "--close", &url])
        .output()
        .expect("rdzv rendezvous --close");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "closed rendezvous cli\n"
    );
    expect_lines(&rx, 1, |node, line| {
        node == "e" && line.starts_with("graceful exit: RendezvousGracefulExitError: ")
    });
    let exit = spare.child.wait().expect("wait for e");
    assert!(exit.success(), "{exit}");
    let late = Command::new(env!("CARGO_BIN_EXE_rdzv"))
        .args(["rendezvous", &url, "--node-id", "f"])
        .output()
        .expect("run rdzv rendezvous");
    assert!(!late.status.success());
    let stderr = String::from_utf8_lossy(&late.stderr);
    assert!(stderr.contains("RendezvousClosedError: "), "{stderr}");
}

#[test]
fn rendezvous_command_refuses_bad_urls() {
    let out = Command::new(env!("CARGO_BIN_EXE_rdzv"))
        .args(["rendezvous", "elastic://127.0.0.1:1/job?nodes=3:2"])
        .output()
        .expect("run rdzv");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "The maximum number of rendezvous nodes (2) must be greater than or equal to the \
             minimum number of rendezvous nodes (3)."
        ),
        "{stderr}"
    );
}

#[test]
fn bench_rendezvous_forms_one_round() {
    // `rdzv bench rendezvous`: event-driven nodes on one loop, against an embedded server.
    let out = Command::new(env!("CARGO_BIN_EXE_rdzv"))
        .args(["bench", "rendezvous", "--nodes", "48"])
        // A keep-alive interval long enough that the round forms within one on a loaded
        // machine (a closer's poll of the roster can take tens of ms there; past one
        // interval every waiting node spends an open-round tick of requests).
        .args(["--keep-alive-ms", "300", "--heartbeat-secs", "1.5"])
        .output()
        .expect("run rdzv bench rendezvous");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("rdzv elastic rendezvous: 48 nodes, one round"),
        "{stdout}"
    );
    // Join: ADD (arrival; a fresh node guesses round 0), APPEND (roster), WAIT and GET
    // of the size (the closer: its roster GET and the COMPARE_SET), the acknowledgement's
    // ADD and WAIT (the last one: its SET of go; the closer: no ADD, its compare-set is
    // its acknowledgement), and the first WAIT on the round's end: 7 for every node but
    // the closer (6), whatever N.
    let join = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("store ops per node (join) "))
        .unwrap_or_else(|| panic!("no join line in {stdout}"));
    let figure = |label: &str| -> f64 {
        join.split(label)
            .nth(1)
            .and_then(|l| l.split([',', ' ']).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {label:?} in {join:?}"))
    };
    let total: u64 = join
        .split(", ")
        .find_map(|part| part.strip_suffix(" in all (with the first wait on the round's end)"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no total in {join:?}"));
    // Beyond that, only the closer's polls of the roster for an arrival whose line is
    // still in flight: a pause (no request) and a GET per poll, the pauses doubling from
    // 5 ms up to one keep-alive interval (300 ms here: at most 6 polls). That depends on
    // the machine's load, never on N. So the closer sends 6 to 12, everyone else 7.
    let min = figure("min ");
    assert!((6.0..=7.0).contains(&min), "{stdout}");
    assert!(total <= 7 * 48 - 1 + 6, "{stdout}");
    assert!(figure("max ") <= 6.0 + 6.0, "{stdout}");
    assert!(
        stdout.contains("store ops per node per keep-alive interval"),
        "{stdout}"
    );
    assert!(stdout.contains("torchrun's c10d design"), "{stdout}");
}
