//! `rdzv status` against real servers: a TCP store read through its keys and through
//! `--metrics`' `/status.json` (with tokens: refused without the `@status` grant), `-o
//! json`, `--watch`, and an `etcd://` run read from etcd (`RDZV_ETCD_ENDPOINTS`, or one
//! member started for this binary; SKIPPED with the reason when there is neither).

mod etcd_cluster;
mod status_nodes;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rdzv::core::store::access::{AccessPolicy, TokenTable};
use serde_json::Value;

use etcd_cluster::{fastrand_u64, shared_endpoints};
use status_nodes::{node, server, Node};

const WATCHER: &str = "Wq8c2Lm0Zp5Vw9XyTb1Cf0H3";
const JOB: &str = "f0H3kd8Jq2LmZp5Vw9XyTb1C";
const OPERATOR: &str = "6tq2bX0n8Wc1pFv4LmZs7QyR";

fn status(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rdzv"))
        .arg("status")
        .args(args)
        .output()
        .expect("run rdzv status")
}

/// Runs `rdzv status ARGS -o json` until the run `id` satisfies `pred` (30 s at most).
fn until(args: &[&str], id: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let out = status(&all);
        assert!(out.status.success(), "{out:?}");
        let doc: Value = serde_json::from_slice(&out.stdout).expect("one JSON document");
        let run = doc["runs"]
            .as_array()
            .and_then(|runs| runs.iter().find(|r| r["run_id"] == id))
            .cloned();
        if let Some(run) = run.filter(|r| pred(r)) {
            return run;
        }
        assert!(Instant::now() < deadline, "not yet after 30 s: {doc:#}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn complete_with(n: usize) -> impl Fn(&Value) -> bool {
    move |r| r["state"] == "complete" && r["members"].as_array().map(Vec::len) == Some(n)
}

fn members(run: &Value) -> Vec<String> {
    let mut names: Vec<String> = run["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| m["node"].as_str().expect("a node").to_string())
        .collect();
    names.sort_unstable();
    names
}

#[test]
fn status_of_a_tcp_store_by_its_keys_and_by_its_metrics() {
    let server = server(AccessPolicy::open());
    let addr = format!("127.0.0.1:{}", server.port());
    let metrics = server.metrics_addr().expect("metrics").to_string();
    let url = format!("elastic://{addr}/tabled?nodes=2:3&last_call=300ms&keep_alive_interval=200ms&keep_alive_max_attempts=15");
    let _nodes: Vec<Node> = ["a", "b", "c"].iter().map(|n| node(&url, n)).collect();
    let other = format!("elastic://{addr}/other?nodes=1:1&keep_alive_interval=200ms");
    let _other = node(&other, "z");

    // By the keys: both runs; by `elastic://…/RUN`, that one only.
    let run = until(&[&addr], "tabled", complete_with(3));
    assert_eq!(members(&run), ["a", "b", "c"]);
    until(&[&addr], "other", complete_with(1));
    let only = status(&[&format!("elastic://{addr}/tabled"), "-o", "json"]);
    let doc: Value = serde_json::from_slice(&only.stdout).expect("JSON");
    let ids: Vec<&Value> = doc["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .map(|r| &r["run_id"])
        .collect();
    assert_eq!(ids, ["tabled"]);

    // The table.
    let out = status(&[&addr]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("run tabled  round 0  complete  world size 3"),
        "{text}"
    );
    assert!(text.contains("RANK  NODE  HOST  KEEP-ALIVE"), "{text}");
    for rank in ["0", "1", "2"] {
        assert!(
            text.lines()
                .any(|l| l.trim_start().starts_with(&format!("{rank}     "))),
            "rank {rank} in\n{text}"
        );
    }

    // Through /status.json: the server's figures as well.
    let run = until(&[&addr, "--metrics", &metrics], "tabled", complete_with(3));
    assert_eq!(members(&run), ["a", "b", "c"]);
    let out = status(&[&addr, "--metrics", &metrics]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("server  rdzv "), "{text}");
    assert!(text.contains("--max-store-bytes"), "{text}");
    assert!(text.contains("/rdzv.elastic.tabled/"), "{text}");

    // --watch redraws until stopped: two documents, a moment apart.
    let mut watch = Command::new(env!("CARGO_BIN_EXE_rdzv"))
        .args(["status", &addr, "--watch", "0.2", "-o", "json"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("rdzv status --watch");
    let mut lines = BufReader::new(watch.stdout.take().expect("piped")).lines();
    for _ in 0..2 {
        let line = lines.next().expect("a redraw").expect("text");
        let doc: Value = serde_json::from_str(&line).expect("a JSON line");
        assert!(doc["runs"].is_array(), "{doc}");
    }
    watch.kill().expect("stop --watch");
    let _ = watch.wait();
}

#[test]
fn status_through_metrics_needs_a_status_grant_in_token_mode() {
    let file = format!("{OPERATOR}\n{WATCHER} @status\n{JOB} /job/\n");
    let tokens = TokenTable::parse(file.as_bytes()).expect("tokens");
    let server = server(AccessPolicy::new(None, Some(tokens)));
    let addr = format!("127.0.0.1:{}", server.port());
    let metrics = server.metrics_addr().expect("metrics").to_string();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let token_file = |name: &str, line: &str| {
        let path = dir.path().join(name);
        let mut f = std::fs::File::create(&path).expect("a token file");
        writeln!(f, "{line}").expect("write it");
        path.to_string_lossy().into_owned()
    };
    let job = token_file("job", &format!("{JOB} /job/"));
    let watcher = token_file("watcher", &format!("{WATCHER} @status"));
    for args in [
        vec![addr.as_str(), "--metrics", &metrics],
        vec![addr.as_str(), "--metrics", &metrics, "--token-file", &job],
    ] {
        let out = status(&args);
        assert!(!out.status.success(), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("refused (401)") && err.contains("@status"),
            "{err}"
        );
    }
    let out = status(&[
        &addr,
        "--metrics",
        &metrics,
        "--token-file",
        &watcher,
        "-o",
        "json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(doc["server"]["tokens_required"], true);
    // A prefix-bound token may not list the store's keys: the error says what to use.
    let out = status(&[&addr, "--token-file", &job]);
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("@status"), "{err}");
}

#[test]
fn status_of_an_etcd_run() {
    let endpoints = match shared_endpoints() {
        Ok(endpoints) => endpoints,
        Err(why) => {
            eprintln!("SKIPPED status_of_an_etcd_run: {why}");
            return;
        }
    };
    let run_id = format!("status-{:x}", fastrand_u64());
    let base = format!(
        "etcd://{}/{run_id}?etcd_prefix=rdzv-test",
        endpoints.join(",")
    );
    let url = format!(
        "{base}&nodes=2:2&keep_alive_interval=300ms&keep_alive_max_attempts=10&read_timeout=10s"
    );
    let _nodes: Vec<Node> = ["a", "b"].iter().map(|n| node(&url, n)).collect();
    let run = until(&[&base], &run_id, complete_with(2));
    assert_eq!(members(&run), ["a", "b"]);
    assert_eq!(run["world_size"], 2);
    // A heartbeat there is a lease's keep-alive, which changes no value: once the
    // members beat, their ages are only bounds.
    let beating = |r: &Value| {
        complete_with(2)(r)
            && r["members"]
                .as_array()
                .is_some_and(|ms| ms.iter().all(|m| m["beat_age_ms"].is_u64()))
    };
    let run = until(&[&base], &run_id, beating);
    for m in run["members"].as_array().expect("members") {
        assert_eq!(m["beat_age_at_least"], true, "{m}");
    }
    let out = status(&[&base]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("run {run_id}  round 0  complete  world size 2")),
        "{text}"
    );
}
