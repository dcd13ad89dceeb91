//! etcd clusters for tests: members started on free loopback ports (each with its own data
//! directory, killed with the test process), the shared cluster of a test binary
//! (`RDZV_ETCD_ENDPOINTS`, or one member it starts), and which member leads. Used by
//! `store_etcd.rs` and `rendezvous_etcd.rs`.
//!
//! Every member runs under a `sh` wrapper that kills it (SIGKILL) when the wrapper's
//! standard input, held by the test process, closes, so no member outlives a dead test.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use rdzv::uring::store::etcd::{EtcdConfig, EtcdStore};
use rdzv::uring::Store;
use rdzv_test_support::Peer;

/// The variable naming an existing cluster's client endpoints.
pub(crate) const ENDPOINTS_VAR: &str = "RDZV_ETCD_ENDPOINTS";

pub(crate) fn etcd_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("etcd"))
        .find(|candidate| candidate.is_file())
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind a free loopback port")
}

/// One etcd member started by a test, killed (SIGKILL) when dropped or when the test
/// process dies.
pub(crate) struct Member {
    pub(crate) name: String,
    pub(crate) client: u16,
    pub(crate) peer: u16,
    dir: PathBuf,
    process: Option<Peer>,
}

impl Member {
    pub(crate) fn start(&mut self, binary: &Path, cluster: &str) {
        let data = self.dir.join(&self.name);
        let args = [
            format!("--name={}", self.name),
            format!("--data-dir={}", data.display()),
            format!("--listen-client-urls=http://127.0.0.1:{}", self.client),
            format!("--advertise-client-urls=http://127.0.0.1:{}", self.client),
            format!("--listen-peer-urls=http://127.0.0.1:{}", self.peer),
            format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{}",
                self.peer
            ),
            format!("--initial-cluster={cluster}"),
            "--initial-cluster-state=new".into(),
            "--initial-cluster-token=rdzv-test".into(),
            "--heartbeat-interval=50".into(),
            "--election-timeout=500".into(),
        ];
        let log = self.dir.join(format!("{}.log", self.name));
        let mut command = Command::new("sh");
        // The wrapper kills etcd when its stdin (the test's lifeline) reaches end of file.
        command
            .arg("-c")
            .arg(r#"bin="$1"; log="$2"; shift 2; "$bin" "$@" </dev/null >>"$log" 2>&1 & pid=$!; cat >/dev/null; kill -KILL $pid; wait $pid"#)
            .arg("sh")
            .arg(binary)
            .arg(log)
            .args(args)
            .stdout(Stdio::null());
        self.process = Some(Peer::spawn(format!("etcd member {}", self.name), command));
    }

    /// Kills the member (SIGKILL, as a crash) and waits until it is gone.
    pub(crate) fn kill(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.release();
            process.wait(Duration::from_secs(10));
        }
    }

    pub(crate) fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client)
    }
}

/// Members started by a test, in a temporary directory.
pub(crate) struct Cluster {
    binary: PathBuf,
    pub(crate) members: Vec<Member>,
    initial: String,
    _dir: tempfile::TempDir,
}

impl Cluster {
    pub(crate) fn start(size: usize) -> Option<Cluster> {
        let binary = etcd_binary()?;
        let dir = tempfile::tempdir().expect("temporary directory for etcd");
        let mut members: Vec<Member> = (0..size)
            .map(|i| Member {
                name: format!("m{i}"),
                client: free_port(),
                peer: free_port(),
                dir: dir.path().to_path_buf(),
                process: None,
            })
            .collect();
        let initial = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        for member in &mut members {
            member.start(&binary, &initial);
        }
        let cluster = Cluster {
            binary,
            members,
            initial,
            _dir: dir,
        };
        cluster.wait_healthy(&cluster.endpoints());
        Some(cluster)
    }

    pub(crate) fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::endpoint).collect()
    }

    pub(crate) fn restart(&mut self, index: usize) {
        let (binary, initial) = (self.binary.clone(), self.initial.clone());
        self.members[index].start(&binary, &initial);
        self.wait_healthy(&[self.members[index].endpoint()]);
    }

    /// Waits until a write through `endpoints` succeeds (a leader is elected).
    pub(crate) fn wait_healthy(&self, endpoints: &[String]) {
        let mut config = EtcdConfig::new(endpoints.to_vec(), "health");
        config.request_timeout = Duration::from_secs(1);
        let store = EtcdStore::new(config);
        let started = Instant::now();
        loop {
            match store.set("up", b"1") {
                Ok(()) => return,
                Err(err) if started.elapsed() > Duration::from_secs(30) => {
                    panic!("etcd at {endpoints:?} did not become healthy in 30 s: {err}")
                }
                Err(_) => thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// The battery's cluster: `RDZV_ETCD_ENDPOINTS`, or one member for this test binary.
pub(crate) fn shared_endpoints() -> Result<Vec<String>, String> {
    /// The endpoints, and the member this binary started (kept alive until it exits).
    type Shared = Result<(Vec<String>, Option<Cluster>), String>;
    static SHARED: OnceLock<Shared> = OnceLock::new();
    let shared = SHARED.get_or_init(|| {
        if let Ok(list) = std::env::var(ENDPOINTS_VAR) {
            let endpoints: Vec<String> = list
                .split(',')
                .filter(|e| !e.is_empty())
                .map(|e| e.trim_start_matches("http://").to_string())
                .collect();
            return Ok((endpoints, None));
        }
        match Cluster::start(1) {
            Some(cluster) => Ok((cluster.endpoints(), Some(cluster))),
            None => Err(format!(
                "{ENDPOINTS_VAR} is not set and no etcd binary is on PATH"
            )),
        }
    });
    shared
        .as_ref()
        .map(|(e, _)| e.clone())
        .map_err(Clone::clone)
}

pub(crate) fn fastrand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    hasher.finish()
}

/// Posts `body` to etcd's JSON gateway at `endpoint` (`path` e.g. `/v3/kv/range`) and
/// reads the reply; `None` when the member does not answer.
pub(crate) fn post(
    endpoint: &str,
    path: &str,
    body: &serde_json::Value,
) -> Option<serde_json::Value> {
    use std::io::{Read, Write};
    let body = body.to_string();
    let mut stream = std::net::TcpStream::connect(endpoint).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: {endpoint}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).ok()?;
    serde_json::from_str(reply.split_once("\r\n\r\n")?.1).ok()
}

/// A key as etcd holds it: its name, the lease it is bound to (0: none) and the revision
/// it was created at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyState {
    pub(crate) key: String,
    pub(crate) lease: i64,
    pub(crate) create_revision: i64,
}

/// Every key under `prefix` (an etcd key prefix), read from `endpoint`.
pub(crate) fn keys_under(endpoint: &str, prefix: &str) -> Vec<KeyState> {
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine as _;
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    let reply = post(
        endpoint,
        "/v3/kv/range",
        &serde_json::json!({"key": STANDARD.encode(prefix), "range_end": STANDARD.encode(&end), "keys_only": true}),
    )
    .unwrap_or_else(|| panic!("etcd at {endpoint} did not answer a range"));
    let int = |v: &serde_json::Value| v.as_str().and_then(|s| s.parse().ok()).unwrap_or(0i64);
    reply["kvs"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|kv| KeyState {
            key: kv["key"]
                .as_str()
                .and_then(|k| STANDARD.decode(k).ok())
                .map(|k| String::from_utf8_lossy(&k).into_owned())
                .unwrap_or_default(),
            lease: int(&kv["lease"]),
            create_revision: int(&kv["create_revision"]),
        })
        .collect()
}

/// The TTL etcd granted lease `id` (`None` when it has no such lease).
pub(crate) fn granted_ttl(endpoint: &str, id: i64) -> Option<Duration> {
    let reply = post(
        endpoint,
        "/v3/kv/lease/timetolive",
        &serde_json::json!({"ID": id.to_string()}),
    )?;
    let granted: u64 = reply["grantedTTL"].as_str()?.parse().ok()?;
    // The seconds left, left out when 0; -1 for a lease etcd does not have.
    let left: i64 = reply["TTL"].as_str().map_or(Some(0), |t| t.parse().ok())?;
    (left >= 0).then(|| Duration::from_secs(granted))
}

/// The index of the member that leads, asked of each member's `/v3/maintenance/status`.
pub(crate) fn leader(cluster: &Cluster) -> Option<usize> {
    let status = |endpoint: &str| post(endpoint, "/v3/maintenance/status", &serde_json::json!({}));
    cluster.members.iter().position(|m| {
        status(&m.endpoint()).is_some_and(|s| {
            s["leader"].as_str().is_some() && s["leader"] == s["header"]["member_id"]
        })
    })
}
