//! The status page in a real browser: Debian's `chromium`, headless, loads `/status` while
//! `rdzv rendezvous` node processes join an elastic run, a fourth waits as a hot spare,
//! one member is killed and the next round forms. At each step the test asserts what the
//! page drew, from the rendered DOM (`--dump-dom` after a virtual-time budget in which
//! the page's script fetched `/status.json` and redrew), and keeps a screenshot of each
//! step under `target/tmp/` (`status-page-*.png`) as the test's artifact.
//!
//! Without `chromium` on `PATH` (or `RDZV_CHROMIUM`), it prints SKIPPED and why.

mod status_nodes;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rdzv::core::store::access::{AccessPolicy, TokenTable};
use serde_json::Value;
use status_nodes::{node, server};

fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("RDZV_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| ["chromium", "chromium-browser"].map(|name| dir.join(name)))
        .find(|p| p.is_file())
}

/// Runs headless chromium on `url` with the flags a container needs, plus `extra`.
fn browse(chromium: &Path, profile: &Path, url: &str, extra: &[&str]) -> String {
    let out = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1100,800",
            // Enough virtual time for the page's first fetches and redraws.
            "--virtual-time-budget=3000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .output()
        .expect("run chromium");
    assert!(out.status.success(), "chromium failed: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What the page drew: the DOM, and a screenshot saved as `status-page-{step}.png`.
fn look(chromium: &Path, profile: &Path, url: &str, step: &str) -> String {
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("status-page-{step}.png"));
    browse(
        chromium,
        profile,
        url,
        &[&format!("--screenshot={}", shot.display())],
    );
    assert!(
        std::fs::metadata(&shot).is_ok_and(|m| m.len() > 1000),
        "no screenshot at {}",
        shot.display()
    );
    eprintln!("screenshot of step {step}: {}", shot.display());
    browse(chromium, profile, url, &["--dump-dom"])
}

fn status_json(addr: SocketAddr) -> Value {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    stream
        .write_all(b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("read");
    let body = reply.split_once("\r\n\r\n").expect("a body").1;
    serde_json::from_str(body).expect("JSON")
}

/// Waits (30 s at most) until `/status.json` shows the run as `pred` wants.
fn until(addr: SocketAddr, pred: impl Fn(&Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let doc = status_json(addr);
        if doc["runs"]
            .as_array()
            .is_some_and(|runs| runs.iter().any(&pred))
        {
            return;
        }
        assert!(Instant::now() < deadline, "not yet after 30 s: {doc:#}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The `data-node` of every element of `class` in `dom`, sorted.
fn nodes_of(dom: &str, class: &str) -> Vec<String> {
    let mut found: Vec<String> = dom
        .split('<')
        .filter(|tag| tag.contains(&format!("class=\"{class}\"")))
        .filter_map(|tag| {
            let rest = tag.split_once("data-node=\"")?.1;
            Some(rest.split_once('"')?.0.to_string())
        })
        .collect();
    found.sort_unstable();
    found
}

fn members(n: usize, round: u64) -> impl Fn(&Value) -> bool {
    move |r| {
        r["run_id"] == "browsed"
            && r["round"] == round
            && r["state"] == "complete"
            && r["members"].as_array().map(Vec::len) == Some(n)
    }
}

#[test]
fn the_page_in_a_browser_shows_members_a_spare_the_struck_node_and_the_next_round() {
    let Some(chromium) = chromium() else {
        eprintln!(
            "SKIPPED the status page in a browser: no chromium on PATH (apt-get install -y \
             chromium), and RDZV_CHROMIUM is not set"
        );
        return;
    };
    let profile = tempfile::tempdir().expect("a browser profile directory");
    let server = server(AccessPolicy::open());
    let metrics = server.metrics_addr().expect("metrics");
    let page = format!("http://{metrics}/status");

    // Nothing yet.
    let dom = browse(&chromium, profile.path(), &page, &["--dump-dom"]);
    assert!(dom.contains("id=\"runs\""), "{dom}");
    assert!(!dom.contains("data-run-id=\""), "{dom}");
    assert!(
        dom.contains("rdzv status") && dom.contains("updated "),
        "{dom}"
    );

    let url = format!(
        "elastic://127.0.0.1:{}/browsed?nodes=2:3&last_call=300ms&keep_alive_interval=200ms\
         &keep_alive_max_attempts=5",
        server.port()
    );
    let mut nodes: Vec<_> = ["a", "b", "c"].iter().map(|n| node(&url, n)).collect();
    until(metrics, members(3, 0));
    let dom = look(&chromium, profile.path(), &page, "1-round-0");
    assert!(dom.contains("data-run-id=\"browsed\""), "{dom}");
    assert!(dom.contains("data-state=\"complete\""), "{dom}");
    assert_eq!(nodes_of(&dom, "member"), ["a", "b", "c"], "{dom}");
    assert!(dom.contains(">complete<"), "the state in words: {dom}");

    // A fourth node finds the round full: the page lists it as waiting.
    nodes.push(node(&url, "d"));
    until(metrics, |r| {
        members(3, 0)(r) && r["waiting"].as_array().is_some_and(|w| w.len() == 1)
    });
    let dom = look(&chromium, profile.path(), &page, "2-hot-spare");
    assert_eq!(nodes_of(&dom, "waiting-node"), ["d"], "{dom}");

    // b is killed outright: the next round takes the spare in, and b is struck.
    let mut b = nodes.remove(1);
    b.0.kill().expect("kill b");
    let _ = b.0.wait();
    until(metrics, members(3, 1));
    let dom = look(&chromium, profile.path(), &page, "3-round-1");
    assert!(dom.contains("data-round=\"1\""), "{dom}");
    assert_eq!(nodes_of(&dom, "member"), ["a", "c", "d"], "{dom}");
    assert_eq!(nodes_of(&dom, "struck-node"), ["b"], "{dom}");
    assert!(dom.contains("had no heartbeat"), "why b was struck: {dom}");
    drop(nodes);
}

#[test]
fn in_token_mode_the_page_asks_for_a_token_and_shows_nothing_else() {
    let Some(chromium) = chromium() else {
        eprintln!("SKIPPED the status page's login form in a browser: no chromium on PATH");
        return;
    };
    let profile = tempfile::tempdir().expect("a browser profile directory");
    let tokens = TokenTable::parse(b"Wq8c2Lm0Zp5Vw9XyTb1Cf0H3 @status\n").expect("a token file");
    let server = server(AccessPolicy::new(None, Some(tokens)));
    let page = format!("http://{}/status", server.metrics_addr().expect("metrics"));
    let dom = browse(&chromium, profile.path(), &page, &["--dump-dom"]);
    assert!(
        dom.contains("<form id=\"login\" style=\"display: block;\">"),
        "the login form is shown: {dom}"
    );
    assert!(dom.contains(">a token is required<"), "{dom}");
    assert!(
        !dom.contains("<h2>Server</h2>"),
        "no figures without a token: {dom}"
    );
}
