//! `--metrics`' status page over real sockets: `/status.json` while `rdzv rendezvous`
//! node processes join an elastic run, one is killed and the next round forms (its
//! schema, field by field, at each step); `/status`, the page; and in token mode, a read
//! without a token of the `@status` grant is refused.

mod status_nodes;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rdzv::core::store::access::{AccessPolicy, TokenTable};
use serde_json::Value;
use status_nodes::{node, server, Node};

const OPERATOR: &str = "6tq2bX0n8Wc1pFv4LmZs7QyR";
const WATCHER: &str = "Wq8c2Lm0Zp5Vw9XyTb1Cf0H3";
const JOB: &str = "f0H3kd8Jq2LmZp5Vw9XyTb1C";

/// `GET path` with optional extra header lines: (status code, headers, body).
fn get(addr: SocketAddr, path: &str, headers: &str) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).expect("connect to the metrics port");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n");
    stream.write_all(request.as_bytes()).expect("send");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("read the reply");
    let (head, body) = reply.split_once("\r\n\r\n").expect("a head and a body");
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status code");
    (code, head.to_ascii_lowercase(), body.to_string())
}

fn status_json(addr: SocketAddr) -> Value {
    let (code, head, body) = get(addr, "/status.json", "");
    assert_eq!(code, 200, "{head}\n{body}");
    assert!(head.contains("content-type: application/json"), "{head}");
    serde_json::from_str(&body).expect("/status.json is JSON")
}

fn uint(v: &Value, what: &str) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("{what} is an unsigned integer: {v}"))
}

fn opt_uint(v: &Value, what: &str) {
    assert!(
        v.is_null() || v.is_u64(),
        "{what} is null or an integer: {v}"
    );
}

fn string<'a>(v: &'a Value, what: &str) -> &'a str {
    v.as_str()
        .unwrap_or_else(|| panic!("{what} is a string: {v}"))
}

fn array<'a>(v: &'a Value, what: &str) -> &'a Vec<Value> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what} is an array: {v}"))
}

/// `/status.json`'s schema (version 1), checked field by field; no value of a key may
/// appear in it.
fn check_schema(doc: &Value) {
    assert_eq!(uint(&doc["schema"], "schema"), 1);
    let s = &doc["server"];
    assert!(!string(&s["version"], "version").is_empty());
    assert!(s["uptime_s"].as_f64().is_some_and(|u| u >= 0.0), "{s}");
    assert!(
        ["io_uring", "epoll"].contains(&string(&s["io"], "io")),
        "{s}"
    );
    assert!(uint(&s["loops"], "loops") >= 1);
    for field in [
        "connections",
        "keys",
        "waiters",
        "requests_total",
        "bytes_in",
        "bytes_out",
    ] {
        uint(&s[field], field);
    }
    assert!(
        s["requests_per_second"].is_null() || s["requests_per_second"].is_f64(),
        "{s}"
    );
    for reason in ["peers", "tokens", "requests"] {
        uint(&s["refusals"][reason], reason);
    }
    assert!(s["tokens_required"].is_boolean());
    let limits = array(&s["limits"], "limits");
    let names: Vec<&str> = limits.iter().map(|l| string(&l["name"], "name")).collect();
    assert_eq!(
        names,
        [
            "--max-store-bytes",
            "--max-value-bytes",
            "--max-conn-bytes",
            "descriptors"
        ]
    );
    for l in limits {
        opt_uint(&l["limit"], "limit");
        opt_uint(&l["in_use"], "in_use");
        string(&l["what"], "what");
    }
    assert!(uint(&limits[0]["in_use"], "store bytes") <= uint(&limits[0]["limit"], "limit"));
    assert!(uint(&limits[3]["in_use"], "open descriptors") >= 3);
    for run in array(&doc["runs"], "runs") {
        string(&run["run_id"], "run_id");
        uint(&run["round"], "round");
        let state = string(&run["state"], "state");
        assert!(
            [
                "waiting_for_min_nodes",
                "last_call",
                "confirming",
                "complete",
                "over",
                "closed"
            ]
            .contains(&state),
            "{state}"
        );
        opt_uint(&run["world_size"], "world_size");
        opt_uint(&run["formed_ago_ms"], "formed_ago_ms");
        opt_uint(&run["formed_in_ms"], "formed_in_ms");
        assert!(run["over"].is_null() || run["over"].is_string());
        for m in array(&run["members"], "members") {
            string(&m["node"], "node");
            uint(&m["rank"], "rank");
            uint(&m["slot"], "slot");
            assert!(m["host"].is_null() || m["host"].is_string());
            opt_uint(&m["beat_age_ms"], "beat_age_ms");
            assert!(m["beat_age_at_least"].is_boolean());
        }
        for w in array(&run["waiting"], "waiting") {
            string(&w["node"], "node");
            uint(&w["slot"], "slot");
        }
        for s in array(&run["struck"], "struck") {
            string(&s["node"], "node");
            uint(&s["round"], "round");
            string(&s["why"], "why");
        }
    }
    let keys = &doc["keys"];
    let total = uint(&keys["total"], "total");
    uint(&keys["bytes"], "bytes");
    let top = array(&keys["top_prefixes"], "top_prefixes");
    assert!(top.len() <= 20);
    let listed: u64 = top.iter().map(|p| uint(&p["keys"], "keys")).sum();
    assert!(listed <= total);
    for p in top {
        string(&p["prefix"], "prefix");
        uint(&p["bytes"], "bytes");
    }
}

/// Polls `/status.json` until run `id` satisfies `pred` (30 s at most); returns it.
fn until(addr: SocketAddr, id: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let doc = status_json(addr);
        check_schema(&doc);
        let run = array(&doc["runs"], "runs")
            .iter()
            .find(|r| r["run_id"] == id)
            .cloned();
        if let Some(run) = run.filter(|r| pred(r)) {
            return run;
        }
        assert!(Instant::now() < deadline, "no {what} after 30 s: {doc:#}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn nodes_of(list: &Value) -> Vec<String> {
    let mut names: Vec<String> = array(list, "nodes")
        .iter()
        .map(|n| string(&n["node"], "node").to_string())
        .collect();
    names.sort_unstable();
    names
}

#[test]
fn the_status_follows_a_run_through_a_kill_and_the_next_round() {
    let server = server(AccessPolicy::open());
    let addr = server.metrics_addr().expect("a metrics address");
    let empty = status_json(addr);
    check_schema(&empty);
    assert_eq!(array(&empty["runs"], "runs").len(), 0);
    let url = format!(
        "elastic://127.0.0.1:{}/watched?nodes=2:3&last_call=300ms&keep_alive_interval=200ms\
         &keep_alive_max_attempts=5",
        server.port()
    );
    let mut nodes: Vec<Node> = ["a", "b", "c"].iter().map(|n| node(&url, n)).collect();
    let run = until(addr, "watched", "complete round 0 of 3", |r| {
        r["state"] == "complete"
            && r["round"] == 0
            && r["members"].as_array().map(Vec::len) == Some(3)
    });
    assert_eq!(nodes_of(&run["members"]), ["a", "b", "c"]);
    assert_eq!(run["world_size"], 3);
    let ranks: Vec<u64> = array(&run["members"], "members")
        .iter()
        .map(|m| uint(&m["rank"], "rank"))
        .collect();
    assert_eq!(ranks, [0, 1, 2]);

    // Heartbeats are seen to move: an age below the keep-alive timeout, not a bound.
    let run = until(addr, "watched", "moving heartbeats", |r| {
        r["members"]
            .as_array()
            .is_some_and(|ms| ms.iter().all(|m| m["beat_age_at_least"] == false))
    });
    for m in array(&run["members"], "members") {
        assert!(uint(&m["beat_age_ms"], "beat age") < 1_000, "{m}");
    }

    // Kill b (SIGKILL: no goodbye): the next round forms with a and c, and b is struck
    // with the reason the round ended.
    let mut b = nodes.remove(1);
    b.0.kill().expect("kill b");
    let _ = b.0.wait();
    let run = until(addr, "watched", "round 1 of a and c", |r| {
        r["round"] == 1 && r["state"] == "complete"
    });
    assert_eq!(nodes_of(&run["members"]), ["a", "c"]);
    let struck = array(&run["struck"], "struck");
    assert_eq!(struck.len(), 1, "{run:#}");
    assert_eq!(
        (&struck[0]["node"], &struck[0]["round"]),
        (&"b".into(), &0.into())
    );
    let why = string(&struck[0]["why"], "why");
    assert!(why.contains("had no heartbeat"), "{why}");
    assert_eq!(run["over"].as_str(), Some(why));
    // It was watched as it formed: when, and how long it took, are known.
    opt_uint(&run["formed_in_ms"], "formed_in_ms");
    assert!(run["formed_ago_ms"].is_u64(), "{run:#}");

    // The keys by prefix show the run's footprint, and never a value.
    let doc = status_json(addr);
    let top = array(&doc["keys"]["top_prefixes"], "top_prefixes");
    let mine = top
        .iter()
        .find(|p| p["prefix"] == "/rdzv.elastic.watched/")
        .unwrap_or_else(|| panic!("the run's prefix in {top:?}"));
    assert!(uint(&mine["keys"], "keys") >= 10, "{mine}");
    let text = doc.to_string();
    assert!(!text.contains("+0 "), "a roster line leaked: {text}");

    // The page: one document, no external asset, drawn from /status.json.
    let (code, head, page) = get(addr, "/status", "");
    assert_eq!(code, 200);
    assert!(head.contains("content-type: text/html"), "{head}");
    assert!(
        head.contains("content-security-policy: default-src 'none'"),
        "{head}"
    );
    assert!(
        page.contains("fetch(\"status.json\""),
        "the page reads /status.json"
    );
    for external in ["src=\"http", "href=\"http", "@import", "<link"] {
        assert!(!page.contains(external), "an external asset: {external}");
    }
    drop(nodes);
}

#[test]
fn in_token_mode_only_a_status_grant_reads_the_status() {
    let file = format!("{OPERATOR}\n{WATCHER} @status\n{JOB} /job/\n");
    let tokens = TokenTable::parse(file.as_bytes()).expect("a token file");
    let server = server(AccessPolicy::new(None, Some(tokens)));
    let addr = server.metrics_addr().expect("a metrics address");
    let bearer = |token: &str| format!("Authorization: Bearer {token}\r\n");
    for (headers, why) in [
        (String::new(), "no token"),
        (bearer(JOB), "a prefix-bound token"),
        (bearer("not-a-token-at-all!!"), "an unknown token"),
        (
            format!("Authorization: Basic {WATCHER}\r\n"),
            "not a bearer token",
        ),
    ] {
        let (code, head, body) = get(addr, "/status.json", &headers);
        assert_eq!(code, 401, "{why}: {head}\n{body}");
        assert!(head.contains("www-authenticate: bearer"), "{why}: {head}");
        assert!(body.contains("@status"), "{body}");
        assert!(!body.contains("schema"), "{why}: no status in a refusal");
    }
    for headers in [
        bearer(WATCHER),
        bearer(OPERATOR),
        format!("authorization: bearer {WATCHER}\r\n"),
    ] {
        let (code, _, body) = get(addr, "/status.json", &headers);
        assert_eq!(code, 200, "{body}");
        let doc: Value = serde_json::from_str(&body).expect("JSON");
        check_schema(&doc);
        assert_eq!(doc["server"]["tokens_required"], true);
    }
    // The page itself holds no data: it asks for a token, and keeps it for the tab.
    let (code, _, page) = get(addr, "/status", "");
    assert_eq!(code, 200);
    assert!(
        page.contains("sessionStorage"),
        "the token is kept for the tab"
    );
    assert!(page.contains("id=\"login\""));
    // /metrics is as before (the allowlist and network are its guard).
    assert_eq!(get(addr, "/metrics", "").0, 200);
}
