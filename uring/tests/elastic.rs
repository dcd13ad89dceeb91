//! The elastic rendezvous over a real store server: `rendezvous("elastic://…")` in
//! threads (rounds, re-rendezvous after a worker failure, leave, shutdown), and eight
//! real processes of which one is killed (SIGKILL): the next round forms with the other
//! seven within the keep-alive timeout.
//!
//! The processes are this test binary, re-run with `--ignored --exact elastic_child`;
//! each child asks the kernel to kill it when its parent dies (`PR_SET_PDEATHSIG`) and
//! checks that the parent it was started by is still there, so none outlives the test.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use std::sync::Arc;

use rdzv_core::rendezvous::elastic::{ElasticErrorKind, ElasticSettings, NodeRange};
use rdzv_core::rendezvous::NodeParams;
use rdzv_uring::rendezvous::elastic::{ElasticFailure, ElasticRendezvous};
use rdzv_uring::rendezvous::{rendezvous_with, ProcessEnv, Rendezvous, RendezvousOptions};
use rdzv_uring::store::tcp::TcpStore;
use rdzv_uring::{ServerOptions, Store, StoreServer};

fn server() -> StoreServer {
    StoreServer::start(ServerOptions {
        host: Some("127.0.0.1".into()),
        port: 0,
        ..ServerOptions::default()
    })
    .expect("start a store server")
}

fn join(url: &str) -> Rendezvous {
    rendezvous_with(
        url,
        NodeParams::Given {
            rank: None,
            world_size: None,
        },
        &ProcessEnv::default(),
        &RendezvousOptions::with_timeout(Duration::from_secs(10)),
    )
    .unwrap_or_else(|e| panic!("{url}: {e}"))
}

const WAIT: Duration = Duration::from_secs(20);

#[test]
fn rounds_in_threads() {
    let server = server();
    let base = format!(
        // A keep-alive timeout of 3 s: on a loaded machine nobody is declared dead by
        // mistake, so rounds end only as the test makes them end.
        "elastic://127.0.0.1:{}/threads?nodes=2:6&last_call=300ms&keep_alive_interval=100ms\
         &keep_alive_max_attempts=30&join_timeout=30s",
        server.port()
    );
    let nodes: Vec<Rendezvous> = thread::scope(|scope| {
        let joins: Vec<_> = (0..6)
            .map(|i| {
                let url = format!("{base}&node_id=t{i}");
                scope.spawn(move || join(&url))
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("join thread"))
            .collect()
    });
    let mut ranks: Vec<u32> = nodes.iter().map(|r| r.rank).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2, 3, 4, 5]);
    assert!(nodes.iter().all(|r| r.world_size == Some(6)));
    // The round's store is PrefixStore("torch.rendezvous.threads.0").
    let rank0 = nodes.iter().find(|r| r.rank == 0).expect("rank 0");
    rank0.store.set("hello", b"round 0").expect("set");
    for r in &nodes {
        assert_eq!(r.store.get("hello").expect("get"), b"round 0");
    }
    let raw = rdzv_uring::store::tcp::TcpStore::connect("127.0.0.1", server.port(), WAIT)
        .expect("connect");
    assert_eq!(
        raw.get("torch.rendezvous.threads.0/hello").expect("raw"),
        b"round 0"
    );

    // A worker failure on one node: everybody rejoins round 1.
    let handles: Vec<_> = nodes
        .iter()
        .map(|r| r.elastic.clone().expect("elastic handle"))
        .collect();
    handles[2].worker_failed();
    for h in &handles {
        let round = h.next_round(Some(0), WAIT).expect("round 1");
        assert_eq!((round.round, round.world_size), (1, 6), "{}", h.node());
    }

    // One node leaves: round 2 of five, after the last call.
    drop(nodes);
    let mut handles = handles;
    let leaver = handles.remove(5);
    let leaver = Arc::try_unwrap(leaver).expect("sole owner");
    assert!(leaver.leave(WAIT));
    for h in &handles {
        let round = h.next_round(Some(1), WAIT).expect("round 2");
        assert_eq!((round.round, round.world_size), (2, 5), "{}", h.node());
    }

    // Shutdown closes it for good: the others' next rendezvous fails with
    // RendezvousClosedError once they see the shut-down node gone.
    let first = Arc::try_unwrap(handles.remove(0)).expect("sole owner");
    assert!(first.shutdown());
    for h in &handles {
        match h.next_round(Some(2), WAIT) {
            Err(e @ ElasticFailure::Protocol(_)) => {
                assert!(e.to_string().starts_with("RendezvousClosedError: "), "{e}");
                assert_eq!(e.kind(), ElasticErrorKind::Closed);
            }
            other => panic!("{}: {other:?}", h.node()),
        }
    }
}

fn start(port: u16, run_id: &str, nodes: NodeRange, node: &str) -> ElasticRendezvous {
    let store = TcpStore::connect("127.0.0.1", port, WAIT).expect("connect");
    let mut settings = ElasticSettings::new(run_id, nodes);
    settings.last_call = Duration::from_millis(300);
    settings.keep_alive_interval = Duration::from_millis(100);
    settings.keep_alive_max_attempts = 30;
    settings.join_timeout = Duration::from_secs(30);
    settings.close_timeout = Duration::from_secs(10);
    ElasticRendezvous::start(Arc::new(store), settings, node).expect("start")
}

/// What torchrun's `RendezvousHandler` calls, on the Rust handle: `next_rendezvous`,
/// `num_nodes_waiting` (a late node makes it positive), `is_closed`, `set_closed`, and the
/// error kinds that map to PyTorch's exceptions (closed; graceful exit of a hot spare).
#[test]
fn handler_api() {
    // A binding shares the handle across threads (and releases the GIL around calls).
    fn shared<T: Send + Sync>() {}
    shared::<ElasticRendezvous>();
    shared::<ElasticFailure>();
    let server = server();
    let port = server.port();
    let nodes = NodeRange::new(2, 3).expect("range");
    let (a, b) = thread::scope(|scope| {
        let a = scope.spawn(|| start(port, "api", nodes, "a"));
        let b = scope.spawn(|| start(port, "api", nodes, "b"));
        (a.join().expect("a"), b.join().expect("b"))
    });
    let (ra, rb) = (
        a.next_rendezvous().expect("a"),
        b.next_rendezvous().expect("b"),
    );
    assert_eq!((ra.round, ra.world_size, rb.world_size), (0, 2, 2));
    assert_eq!(ra.rank + rb.rank, 1);
    assert_eq!(a.num_nodes_waiting().expect("waiting"), 0);
    assert!(!a.is_closed().expect("is_closed"));
    assert_eq!(a.run_id(), "api");

    // A third node arrives: the round has room, so it ends; the agents see a node waiting.
    let c = start(port, "api", nodes, "c");
    let deadline = Instant::now() + WAIT;
    while a.num_nodes_waiting().expect("waiting") == 0 {
        assert!(Instant::now() < deadline, "no node waiting");
        thread::sleep(Duration::from_millis(20));
    }
    let next: Vec<_> = [&a, &b, &c]
        .iter()
        .map(|h| h.next_rendezvous().expect("round 1"))
        .collect();
    assert!(
        next.iter().all(|o| (o.round, o.world_size) == (1, 3)),
        "{next:?}"
    );
    assert_eq!(a.num_nodes_waiting().expect("waiting"), 0);

    // next_rendezvous again while the round goes on (the agent restarted its workers):
    // the round ends for everyone and the next one forms.
    let again = b.next_rendezvous().expect("round 2");
    assert_eq!((again.round, again.world_size), (2, 3));
    for h in [&a, &c] {
        assert_eq!(h.next_rendezvous().expect("round 2").round, 2);
    }

    // A hot spare of the full round, then set_closed: everyone's next rendezvous fails
    // with RendezvousClosedError; the spare exits gracefully.
    let spare = start(port, "api", nodes, "spare");
    let deadline = Instant::now() + WAIT;
    while spare.waiting().is_none() {
        assert!(Instant::now() < deadline, "the spare never waited");
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(spare.waiting(), Some((2, true)));
    a.set_closed().expect("set_closed");
    assert!(b.is_closed().expect("is_closed"));
    let closed = a.next_rendezvous().expect_err("closed");
    assert_eq!(closed.kind(), ElasticErrorKind::Closed, "{closed}");
    for h in [&b, &c] {
        let e = h.next_rendezvous().expect_err("closed");
        assert_eq!(e.kind(), ElasticErrorKind::Closed, "{}: {e}", h.node());
        assert!(e.to_string().starts_with("RendezvousClosedError: "), "{e}");
    }
    let graceful = spare.next_rendezvous().expect_err("graceful exit");
    assert_eq!(
        graceful.kind(),
        ElasticErrorKind::GracefulExit,
        "{graceful}"
    );
    assert_eq!(graceful.kind().torch_name(), "RendezvousGracefulExitError");
    // Closing twice is fine.
    b.set_closed().expect("set_closed again");
    assert!(b.shutdown());
}

/// A child process that is killed when the test process goes away.
struct Node {
    name: String,
    child: Child,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `(node, round, rank, world)` as the children print them.
type Report = (String, u64, u32, u32);

fn spawn_node(url: &str, name: &str, reports: &mpsc::Sender<Report>) -> Node {
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args(["--ignored", "--exact", "elastic_child", "--nocapture"])
        .args(["--test-threads", "1"])
        .env("RDZV_ELASTIC_CHILD_URL", format!("{url}&node_id={name}"))
        .env("RDZV_ELASTIC_PARENT", std::process::id().to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn a node");
    let stdout = child.stdout.take().expect("piped stdout");
    let reports = reports.clone();
    let node = name.to_string();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest prints "test elastic_child ... " before the child's first line.
            let Some(at) = line.find("ELASTIC ROUND") else {
                continue;
            };
            let fields: Vec<&str> = line[at..].split_whitespace().collect();
            if let ["ELASTIC", "ROUND", round, "RANK", rank, "WORLD", world] = fields[..] {
                let parsed = (round.parse(), rank.parse(), world.parse());
                if let (Ok(round), Ok(rank), Ok(world)) = parsed {
                    let _ = reports.send((node.clone(), round, rank, world));
                }
            }
        }
    });
    Node {
        name: name.to_string(),
        child,
    }
}

/// Collects reports until `done` says the picture is complete.
fn collect(
    reports: &mpsc::Receiver<Report>,
    deadline: Instant,
    mut done: impl FnMut(&Report) -> bool,
) -> bool {
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match reports.recv_timeout(left) {
            Ok(report) => {
                if done(&report) {
                    return true;
                }
            }
            Err(_) => return false,
        }
    }
    false
}

#[test]
fn eight_processes_one_killed() {
    let server = server();
    // keep-alive timeout 3 × 200 ms; last call 300 ms.
    let url = format!(
        "elastic://127.0.0.1:{}/procs?nodes=2:8&last_call=300ms&keep_alive_interval=200ms\
         &keep_alive_max_attempts=3&join_timeout=60s",
        server.port()
    );
    let (tx, rx) = mpsc::channel();
    let mut nodes: Vec<Node> = (0..8)
        .map(|i| spawn_node(&url, &format!("p{i}"), &tx))
        .collect();
    let mut round0 = Vec::new();
    let mut first_rank: std::collections::HashMap<String, u32> = Default::default();
    let formed = collect(&rx, Instant::now() + Duration::from_secs(60), |r| {
        assert_eq!((r.1, r.3), (0, 8), "{r:?}");
        round0.push(r.2);
        first_rank.insert(r.0.clone(), r.2);
        round0.len() == 8
    });
    assert!(formed, "round 0 of 8 did not form: {round0:?}");
    round0.sort_unstable();
    assert_eq!(round0, [0, 1, 2, 3, 4, 5, 6, 7]);

    let victim = nodes.remove(3);
    let victim_name = victim.name.clone();
    let killed_at = Instant::now();
    drop(victim); // SIGKILL

    // Done when the seven survivors' latest rounds are one round of seven. (On a loaded
    // machine a node may be declared dead wrongly and an extra round run; what matters
    // is the round without the victim.)
    let mut latest: std::collections::HashMap<String, (u64, u32, u32)> = Default::default();
    let formed = collect(&rx, killed_at + Duration::from_secs(30), |r| {
        assert_ne!(r.0, victim_name, "the killed node reported {r:?}");
        latest.insert(r.0.clone(), (r.1, r.2, r.3));
        let rounds: Vec<_> = latest.values().collect();
        rounds.len() == 7
            && rounds
                .iter()
                .all(|(round, _, world)| *world == 7 && *round == rounds[0].0)
    });
    let took = killed_at.elapsed();
    assert!(formed, "no round of the seven survivors: {latest:?}");
    let mut ranks: Vec<u32> = latest.values().map(|(_, rank, _)| *rank).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2, 3, 4, 5, 6]);
    // Stable ranks: every survivor keeps its rank of round 0, except the one at rank 7
    // (beyond the new world), which takes the victim's.
    let victim_rank = first_rank[&victim_name];
    for (node, (_, rank, _)) in &latest {
        let before = first_rank[node];
        let want = if before == 7 { victim_rank } else { before };
        assert_eq!(*rank, want, "{node} had rank {before}: {latest:?}");
    }
    // Keep-alive timeout (600 ms), at most one interval late (200 ms), the last call
    // (300 ms), with slack for seven processes on a loaded two-core machine.
    println!("the round of 7 formed {took:?} after the kill");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

/// A node SIGKILLed while its round is open (waiting for a third node) is not counted
/// into the round that the next arrivals form seconds later: the round of three is
/// round 0, with the live nodes only.
#[test]
fn killed_while_its_round_is_open() {
    let server = server();
    let url = format!(
        "elastic://127.0.0.1:{}/open?nodes=3:3&keep_alive_interval=200ms\
         &keep_alive_max_attempts=3&join_timeout=60s",
        server.port()
    );
    let (tx, rx) = mpsc::channel();
    let a = spawn_node(&url, "a", &tx);
    let b = spawn_node(&url, "b", &tx);
    // Both have joined and wait for a third; then b dies.
    let raw = rdzv_uring::store::tcp::TcpStore::connect("127.0.0.1", server.port(), WAIT)
        .expect("connect");
    let deadline = Instant::now() + WAIT;
    while raw.add("rdzv.elastic.open/0/arrivals", 0).expect("add") < 2 {
        assert!(Instant::now() < deadline, "a and b never joined");
        thread::sleep(Duration::from_millis(20));
    }
    drop(b); // SIGKILL
             // Longer than the keep-alive timeout (600 ms) and a watcher's interval.
    thread::sleep(Duration::from_secs(3));
    let c = spawn_node(&url, "c", &tx);
    let d = spawn_node(&url, "d", &tx);
    let mut seen: Vec<Report> = Vec::new();
    let formed = collect(&rx, Instant::now() + Duration::from_secs(30), |r| {
        seen.push(r.clone());
        seen.len() == 3
    });
    assert!(formed, "no round of a, c and d: {seen:?}");
    seen.sort();
    let names: Vec<&str> = seen.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(names, ["a", "c", "d"], "{seen:?}");
    assert!(
        seen.iter().all(|r| (r.1, r.3) == (0, 3)),
        "the first round is the one without b: {seen:?}"
    );
    let mut ranks: Vec<u32> = seen.iter().map(|r| r.2).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2]);
    drop((a, c, d));
}

/// One node of `eight_processes_one_killed` (run only by it, through `--ignored`).
#[test]
#[ignore = "a child process of eight_processes_one_killed"]
fn elastic_child() {
    let (Ok(url), Ok(parent)) = (
        std::env::var("RDZV_ELASTIC_CHILD_URL"),
        std::env::var("RDZV_ELASTIC_PARENT"),
    ) else {
        println!("skipped: elastic_child runs only as a child of eight_processes_one_killed");
        return;
    };
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .expect("PR_SET_PDEATHSIG");
    // The parent may have died before the signal was armed.
    let ppid = rustix::process::getppid().map(|p| p.as_raw_nonzero().get());
    if ppid.map(|p| p.to_string()) != Some(parent) {
        return;
    }
    let first = join(&url);
    let handle = first.elastic.clone().expect("elastic handle");
    let mut round = handle
        .next_round(None, Duration::from_secs(3600))
        .unwrap_or_else(|e| panic!("{e}"));
    loop {
        println!(
            "ELASTIC ROUND {} RANK {} WORLD {}",
            round.round, round.rank, round.world_size
        );
        round = match handle.next_round(Some(round.round), Duration::from_secs(3600)) {
            Ok(next) => next,
            Err(e) => panic!("{e}"),
        };
    }
}
