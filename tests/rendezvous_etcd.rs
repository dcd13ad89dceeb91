//! The elastic rendezvous on etcd (`etcd://…`), end to end: nodes are `rdzv rendezvous`
//! processes, the cluster is real etcd members.
//!
//! Tests that only need a cluster use the shared one (`RDZV_ETCD_ENDPOINTS`, as `.ci/run`
//! exports for its three members, or one member this binary starts); tests that kill
//! members start their own (`etcd_cluster`). Without a cluster and without an `etcd`
//! binary on `PATH`, each test prints SKIPPED and why.
//!
//! Each node runs under a `sh` wrapper holding the test's lifeline on its standard input:
//! when the test lets go of a node (or dies), the wrapper kills it with SIGKILL, which is
//! also how a test kills a node. Only the node writes to the pipes the test reads, so the
//! end of its standard output means the node has exited.

mod etcd_cluster;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use etcd_cluster::{
    fastrand_u64, granted_ttl, keys_under, leader, shared_endpoints, Cluster, KeyState,
};
use rdzv_test_support::Peer;

/// What a node printed, line by line; `Exited` when its standard output closed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Said {
    Out(String),
    Err(String),
    Exited,
}

struct Nodes {
    tx: mpsc::Sender<(String, Said)>,
    rx: mpsc::Receiver<(String, Said)>,
    running: Vec<(String, Peer)>,
}

impl Nodes {
    fn new() -> Nodes {
        let (tx, rx) = mpsc::channel();
        Nodes {
            tx,
            rx,
            running: Vec::new(),
        }
    }

    /// Starts `rdzv rendezvous URL` as each of `names`.
    fn start(url: &str, names: &[&str]) -> Nodes {
        let mut nodes = Nodes::new();
        for name in names {
            nodes.spawn(url, name);
        }
        nodes
    }

    /// Starts `rdzv rendezvous URL --node-id NAME`.
    fn spawn(&mut self, url: &str, name: &str) {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(
                r#"exec 3>&1 4>&2 >/dev/null 2>&1; "$@" >&3 2>&4 3>&- 4>&- & pid=$!; exec 3>&- 4>&-; cat >/dev/null; kill -KILL $pid 2>/dev/null; wait $pid"#,
            )
            .arg("sh")
            .arg(env!("CARGO_BIN_EXE_rdzv"))
            .args(["rendezvous", url, "--node-id", name])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut peer = Peer::spawn(format!("rdzv rendezvous node {name}"), command);
        let stdout = peer.child_mut().stdout.take().expect("piped stdout");
        let stderr = peer.child_mut().stderr.take().expect("piped stderr");
        for (pipe, is_out) in [
            (Box::new(stdout) as Box<dyn Read + Send>, true),
            (Box::new(stderr), false),
        ] {
            let (tx, name) = (self.tx.clone(), name.to_string());
            thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let said = if is_out {
                        Said::Out(line)
                    } else {
                        Said::Err(line)
                    };
                    let _ = tx.send((name.clone(), said));
                }
                if is_out {
                    let _ = tx.send((name, Said::Exited));
                }
            });
        }
        self.running.push((name.to_string(), peer));
    }

    /// Kills node `name` with SIGKILL.
    fn kill(&mut self, name: &str) {
        let index = self
            .running
            .iter()
            .position(|(n, _)| n == name)
            .expect("a running node");
        let (_, mut peer) = self.running.remove(index);
        peer.release();
        peer.wait(Duration::from_secs(10));
    }

    /// Reads until `want` lines satisfy `pred` (within `limit`), failing the test on a node
    /// error other than what `pred` accepts.
    fn expect(
        &self,
        want: usize,
        limit: Duration,
        pred: impl Fn(&str, &Said) -> bool,
    ) -> Vec<(String, Said)> {
        let deadline = Instant::now() + limit;
        let mut got = Vec::new();
        let mut seen = Vec::new();
        while got.len() < want {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok((node, said)) if pred(&node, &said) => got.push((node, said)),
                Ok((node, Said::Err(line))) if line.contains("rdzv:") => {
                    panic!("node {node} failed: {line}\n(so far: {seen:?})")
                }
                Ok(other) => seen.push(other),
                Err(_) => panic!("only {got:?} within {limit:?}; also seen: {seen:?}"),
            }
        }
        got
    }

    /// The round lines (`round R rank K world_size N …`) of `count` nodes for round `round`.
    fn round(&self, round: u64, count: usize, limit: Duration) -> Vec<(String, u32, u32)> {
        let prefix = format!("round {round} ");
        self.expect(
            count,
            limit,
            |_, said| matches!(said, Said::Out(line) if line.starts_with(&prefix)),
        )
        .into_iter()
        .map(|(node, said)| {
            let Said::Out(line) = said else {
                unreachable!()
            };
            let words: Vec<&str> = line.split_whitespace().collect();
            let rank = words[3].parse().expect("rank");
            let world = words[5].parse().expect("world size");
            (node, rank, world)
        })
        .collect()
    }
}

/// Asserts distinct ranks `0..world` and one world size for all of `members`.
fn assert_world(members: &[(String, u32, u32)], world: u32) {
    let mut ranks: Vec<u32> = members.iter().map(|(_, rank, _)| *rank).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, (0..world).collect::<Vec<_>>(), "{members:?}");
    assert!(members.iter().all(|(_, _, w)| *w == world), "{members:?}");
}

fn url(endpoints: &[String], run: &str, query: &str) -> String {
    run_url(endpoints, run, query).0
}

/// A URL for a fresh run id, and the etcd key prefix of its round `0`'s heartbeat keys.
fn run_url(endpoints: &[String], run: &str, query: &str) -> (String, String) {
    let run_id = format!("{run}-{:x}", fastrand_u64());
    (
        format!(
            "etcd://{}/{run_id}?etcd_prefix=rdzv-test&{query}",
            endpoints.join(",")
        ),
        format!("/rdzv-test/rdzv.elastic.{run_id}/0/hb/"),
    )
}

/// Waits (up to 10 s) until `count` heartbeat keys are under `prefix`, each bound to a
/// lease of its own; returns them and the longest TTL etcd granted their leases.
fn leased_heartbeats(endpoint: &str, prefix: &str, count: usize) -> (Vec<KeyState>, Duration) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let keys = keys_under(endpoint, prefix);
        if keys.len() == count {
            let mut leases: Vec<i64> = keys.iter().map(|k| k.lease).collect();
            leases.sort_unstable();
            leases.dedup();
            assert!(
                leases.len() == count && leases[0] != 0,
                "one lease per node: {keys:?}"
            );
            let ttl = leases
                .iter()
                .map(|&id| granted_ttl(endpoint, id).expect("the lease is there"))
                .max()
                .expect("a lease");
            return (keys, ttl);
        }
        assert!(Instant::now() < deadline, "heartbeat keys: {keys:?}");
        thread::sleep(Duration::from_millis(50));
    }
}

fn shared(test: &str) -> Option<Vec<String>> {
    shared_endpoints()
        .map_err(|why| eprintln!("SKIPPED {test}: {why}"))
        .ok()
}

/// A cluster of `size` members of the test's own, and a URL for a fresh run `run` on it.
fn own_run(test: &str, size: usize, run: &str, query: &str) -> Option<(Cluster, String)> {
    let Some(cluster) = Cluster::start(size) else {
        eprintln!("SKIPPED {test}: no etcd binary on PATH to start a cluster of its own");
        return None;
    };
    let url = url(&cluster.endpoints(), run, query);
    Some((cluster, url))
}

/// Generous liveness for loaded CI machines: a node is dead after 10 × 300 ms.
const LIVENESS: &str = "keep_alive_interval=300ms&keep_alive_max_attempts=10&read_timeout=10s";

#[test]
fn eight_node_processes_form_a_round() {
    let Some(endpoints) = shared("eight_node_processes_form_a_round") else {
        return;
    };
    let url = url(&endpoints, "eight", &format!("nodes=8&{LIVENESS}"));
    let mut nodes = Nodes::new();
    for i in 0..8 {
        nodes.spawn(&url, &format!("n{i}"));
    }
    let round = nodes.round(0, 8, Duration::from_secs(30));
    assert_world(&round, 8);
}

#[test]
fn rendezvous_api_gives_a_shared_round_store() {
    let Some(endpoints) = shared("rendezvous_api_gives_a_shared_round_store") else {
        return;
    };
    let url = url(
        &endpoints,
        "api",
        &format!("nodes=2&last_call=200ms&{LIVENESS}"),
    );
    let joins: Vec<_> = (0..2)
        .map(|i| {
            let url = format!("{url}&node_id=api{i}");
            thread::spawn(move || rdzv::uring::rendezvous::rendezvous(&url, None, None))
        })
        .collect();
    let mut got: Vec<_> = joins
        .into_iter()
        .map(|join| join.join().expect("join thread").expect("rendezvous"))
        .collect();
    got.sort_by_key(|r| r.rank);
    assert_eq!(
        got.iter()
            .map(|r| (r.rank, r.world_size))
            .collect::<Vec<_>>(),
        [(0, Some(2)), (1, Some(2))]
    );
    // The round's store is shared, and prefixed by the round.
    got[0].store.set("hello", b"from rank 0").expect("set");
    got[1]
        .store
        .wait(&["hello"], Some(Duration::from_secs(10)))
        .expect("wait");
    assert_eq!(got[1].store.get("hello").expect("get"), b"from rank 0");
    let handle = got[0].elastic.as_ref().expect("the elastic handle");
    assert_eq!(
        handle.current().map(|round| round.store_prefix),
        Some(format!("torch.rendezvous.{}.0", handle.run_id()))
    );
    assert!(!handle.is_closed().expect("is_closed"));
}

#[test]
fn leader_killed_mid_round_the_round_forms_on_the_other_two() {
    let test = "leader_killed_mid_round_the_round_forms_on_the_other_two";
    let Some((mut cluster, url)) = own_run(test, 3, "leader", &format!("nodes=4&{LIVENESS}"))
    else {
        return;
    };
    let mut nodes = Nodes::start(&url, &["a", "b"]);
    nodes.expect(
        2,
        Duration::from_secs(10),
        |_, said| matches!(said, Said::Out(line) if line.starts_with("node ")),
    );
    // Let the first two arrive (and heartbeat) before the leader dies.
    thread::sleep(Duration::from_millis(500));
    let victim = leader(&cluster).expect("a member that leads");
    cluster.members[victim].kill();
    for name in ["c", "d"] {
        nodes.spawn(&url, name);
    }
    let round = nodes.round(0, 4, Duration::from_secs(30));
    assert_world(&round, 4);
}

/// A node's heartbeat key is bound to its lease: SIGKILLed, its key is gone from etcd when
/// the lease's TTL ends (etcd's expiry sweep runs every 500 ms), its watcher strikes it at
/// once, and the next round forms within the TTL plus one keep-alive interval (and the
/// last call); the others' keys stay.
#[test]
fn node_killed_its_key_expires_with_its_lease_and_the_next_round_forms_within_the_ttl() {
    let test = "node_killed_its_key_expires_with_its_lease_and_the_next_round_forms_within_the_ttl";
    let Some(endpoints) = shared(test) else {
        return;
    };
    // TTL asked: (3 + 2) × 300 ms + 1 s (`lease_ttl`); etcd grants whole seconds, at least its
    // minimum.
    let interval = Duration::from_millis(300);
    let last_call = Duration::from_millis(300);
    let (url, prefix) = run_url(
        &endpoints,
        "killed",
        "nodes=2:3&last_call=300ms&keep_alive_interval=300ms&keep_alive_max_attempts=3&read_timeout=10s",
    );
    let mut nodes = Nodes::start(&url, &["a", "b", "c"]);
    assert_world(&nodes.round(0, 3, Duration::from_secs(30)), 3);
    let (before, ttl) = leased_heartbeats(&endpoints[0], &prefix, 3);
    let killed = Instant::now();
    nodes.kill("b");
    // The key goes within the TTL (its last keep-alive was before the kill), give or take
    // etcd's 500 ms expiry sweep and a loaded machine.
    let gone = loop {
        let now = keys_under(&endpoints[0], &prefix);
        if now.len() < before.len() {
            break now;
        }
        assert!(
            killed.elapsed() < ttl + Duration::from_secs(2),
            "no heartbeat key expired {:?} after the kill (TTL {ttl:?}): {now:?}",
            killed.elapsed()
        );
        thread::sleep(Duration::from_millis(25));
    };
    let expired = killed.elapsed();
    assert_eq!(
        gone.len(),
        2,
        "only the killed node's key expires: {gone:?}"
    );
    assert!(gone.iter().all(|k| before.contains(k)), "{gone:?}");
    let round = nodes.round(1, 2, Duration::from_secs(20));
    let took = killed.elapsed();
    assert_world(&round, 2);
    let mut who: Vec<&str> = round.iter().map(|(node, _, _)| node.as_str()).collect();
    who.sort_unstable();
    assert_eq!(who, ["a", "c"]);
    // The TTL, one interval for the watcher's next look, the last call; with room for
    // etcd's sweep and a loaded machine.
    let bound = ttl + interval + last_call + Duration::from_secs(2);
    assert!(
        took < bound,
        "the next round took {took:?} (key expired after {expired:?}, TTL {ttl:?})"
    );
}

/// A live node's heartbeat key stays through several TTLs, bound to the same lease and
/// never re-created; when the node leaves, its lease is revoked and its key goes at once,
/// long before the TTL.
#[test]
fn a_live_nodes_key_stays_through_several_ttls_and_goes_at_once_when_it_leaves() {
    let test = "a_live_nodes_key_stays_through_several_ttls_and_goes_at_once_when_it_leaves";
    let Some(endpoints) = shared(test) else {
        return;
    };
    // TTL asked: (10 + 2) × 300 ms + 1 s = 4.6 s (`lease_ttl`).
    let (url, prefix) = run_url(
        &endpoints,
        "live",
        &format!("nodes=2&last_call=200ms&{LIVENESS}"),
    );
    let mut joined: Vec<_> = (0..2)
        .map(|i| {
            let url = format!("{url}&node_id=live{i}");
            thread::spawn(move || rdzv::uring::rendezvous::rendezvous(&url, None, None))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|join| join.join().expect("join thread").expect("rendezvous"))
        .collect();
    let (keys, ttl) = leased_heartbeats(&endpoints[0], &prefix, 2);
    assert!(ttl >= Duration::from_secs(3), "granted {ttl:?}");
    let until = Instant::now() + ttl * 3;
    while Instant::now() < until {
        let now = keys_under(&endpoints[0], &prefix);
        assert_eq!(now, keys, "the live nodes' keys changed");
        thread::sleep(Duration::from_millis(100));
    }
    for rendezvous in &joined {
        let handle = rendezvous.elastic.as_ref().expect("the elastic handle");
        assert_eq!(handle.current().map(|r| r.round), Some(0), "still round 0");
    }
    // One leaves: its driver ends within a keep-alive interval and revokes its lease.
    let left = Instant::now();
    drop(joined.pop());
    let deadline = left + ttl;
    while keys_under(&endpoints[0], &prefix).len() == 2 {
        assert!(
            Instant::now() < deadline,
            "the leaver's key stayed until its TTL ({ttl:?})"
        );
        thread::sleep(Duration::from_millis(25));
    }
    let gone_after = left.elapsed();
    assert!(
        gone_after < ttl / 2,
        "the key went {gone_after:?} after leaving (TTL {ttl:?}): expired, not revoked"
    );
}

#[test]
fn member_restarted_nodes_carry_on() {
    let test = "member_restarted_nodes_carry_on";
    let Some((mut cluster, url)) = own_run(
        test,
        3,
        "restart",
        // A last call long enough for a node slowed by the restarts (its watch on the
        // round's end reconnects) to make the next round: it closes at once with all three.
        &format!("nodes=2:3&last_call=2s&{LIVENESS}"),
    ) else {
        return;
    };
    let mut nodes = Nodes::start(&url, &["a", "b"]);
    assert_world(&nodes.round(0, 2, Duration::from_secs(30)), 2);
    // The first endpoint (the one the nodes talk to) dies and comes back; then another.
    for victim in [0, 1] {
        cluster.members[victim].kill();
        thread::sleep(Duration::from_millis(700));
        cluster.restart(victim);
    }
    // Nobody failed or moved on (a node error fails `expect`), and the round still
    // works: a third node asks for the next one, which all three form.
    nodes.spawn(&url, "c");
    let round = nodes.round(1, 3, Duration::from_secs(30));
    assert_world(&round, 3);
}

#[test]
fn whole_cluster_stopped_every_node_fails_naming_etcd_within_its_timeout() {
    let test = "whole_cluster_stopped_every_node_fails_naming_etcd_within_its_timeout";
    // Each request may keep retrying for read_timeout (2 s), then the node fails.
    let Some((mut cluster, url)) = own_run(
        test,
        1,
        "stopped",
        "nodes=3&last_call=300ms&keep_alive_interval=300ms&keep_alive_max_attempts=10&read_timeout=2s",
    ) else {
        return;
    };
    let endpoint = cluster.endpoints()[0].clone();
    let nodes = Nodes::start(&url, &["a", "b", "c"]);
    assert_world(&nodes.round(0, 3, Duration::from_secs(30)), 3);
    let stopped = Instant::now();
    cluster.members[0].kill();
    // Each node prints its error, then exits.
    let (errors, exits): (Vec<_>, Vec<_>) = nodes
        .expect(6, Duration::from_secs(20), |_, said| match said {
            Said::Err(line) => line.contains("rdzv:"),
            Said::Exited => true,
            Said::Out(_) => false,
        })
        .into_iter()
        .partition(|(_, said)| *said != Said::Exited);
    let took = stopped.elapsed();
    assert_eq!(exits.len(), 3, "{exits:?}");
    for (node, said) in &errors {
        let Said::Err(line) = said else {
            unreachable!()
        };
        assert!(line.contains("etcd"), "{node}: {line}");
        assert!(line.contains(&endpoint), "{node}: {line}");
        assert!(line.contains("RendezvousConnectionError"), "{node}: {line}");
    }
    let mut who: Vec<&str> = errors.iter().map(|(node, _)| node.as_str()).collect();
    who.sort_unstable();
    assert_eq!(who, ["a", "b", "c"]);
    // read_timeout, one keep-alive interval, and room for a loaded machine.
    assert!(
        took < Duration::from_secs(10),
        "the nodes failed after {took:?}"
    );
}

#[test]
fn rendezvous_command_refuses_bad_etcd_urls() {
    for (url, says) in [
        ("etcd://127.0.0.1:0/run", "is not HOST or HOST:PORT"),
        ("etcd://127.0.0.1:2379/run?nodes=3:2", "maximum number"),
        ("etcd://127.0.0.1:2379/run?etcd_prefix=/", "etcd_prefix"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_rdzv"))
            .args(["rendezvous", url])
            .output()
            .expect("run rdzv");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{url}: {err}");
        assert!(err.contains(says), "{url}: {err}");
    }
}

/// `rdzv bench rendezvous --addr etcd://…`: 64 nodes form one round, and a join costs
/// O(1) etcd requests per node (the arrivals, acknowledgements and roster never make a
/// node retry a compare-and-swap against the others): the mean stays near a lone node's
/// count whatever N, where one key per counter cost about N/2 retries each.
#[test]
fn bench_over_etcd_joins_in_o1_requests_per_node() {
    let Some(endpoints) = shared("bench_over_etcd_joins_in_o1_requests_per_node") else {
        return;
    };
    let output = Command::new(env!("CARGO_BIN_EXE_rdzv"))
        .args([
            "bench",
            "rendezvous",
            "--nodes",
            "64",
            "--keep-alive-ms",
            "2000",
        ])
        .args(["--heartbeat-secs", "0"])
        .arg("--addr")
        .arg(format!("etcd://{}", endpoints.join(",")))
        .output()
        .expect("run rdzv bench rendezvous");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mean: f64 = text
        .lines()
        .find_map(|l| l.split("mean ").nth(1))
        .and_then(|rest| rest.split(',').next())
        .and_then(|m| m.trim().parse().ok())
        .unwrap_or_else(|| panic!("no mean in: {text}"));
    // A lone node's join is 8–10 requests; the closer adds a few, a member restarted or a
    // leader change a retry or two. 64 nodes racing on one key would cost about 30 each.
    assert!(
        mean <= 14.0,
        "mean {mean} etcd requests per join at N=64: {text}"
    );
}

/// The heartbeat lease's edges, on `MachineStore` itself: a watcher reads a key that is
/// there as a value that moves and a revoked one as `BEAT_GONE`; a keep-alive of a lease
/// etcd no longer has fails naming the lease and saying to rejoin; a new key (the next
/// round's) is put under a fresh lease.
#[test]
fn a_keep_alive_of_a_lease_etcd_no_longer_has_fails_saying_so() {
    use rdzv::uring::rendezvous::etcd::MachineStore;
    use rdzv::uring::store::etcd::{EtcdConfig, EtcdStore};
    use rdzv::uring::Store;
    use rdzv_core::rendezvous::elastic::BEAT_GONE;

    let Some(endpoints) = shared("a_keep_alive_of_a_lease_etcd_no_longer_has_fails_saying_so")
    else {
        return;
    };
    let prefix = format!("rdzv-test-lease-{:x}", fastrand_u64());
    let store = MachineStore::new(EtcdStore::new(EtcdConfig::new(endpoints, &prefix)))
        .with_lease_ttl(Duration::from_secs(30));
    let own = "rdzv.elastic.job/0/hb/0";
    assert!(
        store.lease().is_none(),
        "no lease before the first heartbeat"
    );
    let first = store.add(own, 1).expect("first heartbeat: a leased put");
    let lease = store.lease().expect("granted at the first heartbeat");
    assert!(lease.ttl >= Duration::from_secs(30), "{lease:?}");
    let again = store.add(own, 1).expect("a keep-alive");
    let read = store.add(own, 0).expect("a watcher's read");
    assert!(
        first > 0 && again > first && read > again,
        "{first} {again} {read}"
    );
    assert_eq!(store.lease(), Some(lease), "one lease");

    store
        .etcd()
        .lease_revoke(&lease, Instant::now() + Duration::from_secs(10))
        .expect("revoke");
    assert_eq!(store.add(own, 0).expect("read"), BEAT_GONE);
    let text = store
        .add(own, 1)
        .expect_err("the lease is gone")
        .to_string();
    for says in ["etcd", "lease", &format!("{:x}", lease.id), own, "rejoin"] {
        assert!(text.contains(says), "{says:?} not in: {text}");
    }
    // The next round's key: a fresh lease, and nobody has seen the key yet.
    let next = "rdzv.elastic.job/1/hb/0";
    store.add(next, 1).expect("a new key under a fresh lease");
    assert_ne!(store.lease().map(|l| l.id), Some(lease.id));
    assert!(store.add(next, 0).expect("read") > 0);
}
