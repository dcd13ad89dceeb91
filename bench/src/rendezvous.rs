//! `rdzv bench rendezvous --nodes N`: N elastic-rendezvous nodes, each a
//! `rdzv_core::rendezvous::elastic::ElasticNode` on its own non-blocking TCPStore
//! connection, all driven by one `mio` event loop (no thread per node), against a store
//! server (embedded, or any at `--addr`). It measures how long the N nodes take to form
//! one round, the store operations and request bytes each node sent to join, and, over a
//! heartbeat phase, the operations per node per keep-alive interval; then prints the same
//! counts for torchrun's c10d design, computed from its algorithm.
//!
//! The protocol is the core's; this file only moves its requests over the load
//! generators' connection (`bench::conn::StoreConn`: requests encoded by
//! `rdzv_core::store::codec`, keys with PyTorch's `/` prefix, as `rdzv rendezvous` sends
//! them) and ends a wait at its deadline with the connection's CANCEL_WAIT exchange.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant as StdInstant};

use clap::Args;
use rdzv_core::rendezvous::elastic::{
    ElasticNode, ElasticSettings, Event, Instant, LocalEvent, OwnedStoreReply, StoreAction,
};
use rdzv_core::store::codec::{Limits, ResponseView};
use rdzv_core::store::{CheckResponse, KeyList, Request, WaitResponse};

use super::conn::{one_key_list, Fill, Reactor, StoreConn};
use super::BenchError;

/// The size of torchrun's c10d rendezvous state per node, in bytes: the
/// `_RendezvousState` of PyTorch 2.15's `dynamic_rendezvous.py` with N participants and
/// their heartbeats, pickled and base64'd as `c10d_rendezvous_backend.py` stores it,
/// measured at 113 B per node for N = 4096 with 24-character host names (464,056 B;
/// each node descriptor is pickled once and referenced from the heartbeats).
const TORCHRUN_BLOB_BYTES_PER_NODE: f64 = 113.0;

/// Options of `rdzv bench rendezvous`.
#[derive(Debug, Args)]
pub struct RendezvousBenchArgs {
    /// How many nodes join (one round of exactly this many).
    #[arg(long, default_value_t = 1024)]
    nodes: u32,
    /// The store, as HOST:PORT, or an etcd cluster as etcd://HOST:PORT[,HOST:PORT...];
    /// without it an rdzv server is started in this process.
    #[arg(long)]
    addr: Option<String>,
    /// Keep-alive interval, in milliseconds (a wait lasts at most one interval, so a
    /// short one adds CANCEL_WAITs to a slow join).
    #[arg(long, default_value_t = 1000)]
    keep_alive_ms: u64,
    /// How long the heartbeat phase runs, in seconds (0: skip it).
    #[arg(long, default_value_t = 5.0)]
    heartbeat_secs: f64,
}

/// One simulated node.
struct Node {
    machine: ElasticNode,
    conn: StoreConn,
    /// The action being performed.
    action: Option<StoreAction>,
    /// A wait's generation, so that a stale timer does nothing.
    wait_gen: u64,
    ops: u64,
    bytes: u64,
    rank: Option<(u64, u32, u32)>,
    failed: Option<String>,
}

impl Node {
    /// Queues `request`, counting it among the node's operations and request bytes.
    fn queue(&mut self, request: &Request<'_>) {
        self.bytes += request.encoded_len() as u64;
        self.ops += 1;
        self.conn.queue(request);
    }

    fn flush(&mut self) {
        if let Err(e) = self.conn.flush() {
            self.failed.get_or_insert(format!("send: {e}"));
        }
    }
}

/// `/` + key, as PyTorch's TCPStore client sends user keys.
fn wire(key: &str) -> Vec<u8> {
    [b"/", key.as_bytes()].concat()
}

/// Sends the request of `action`.
fn send_action(node: &mut Node, action: &StoreAction) {
    let key = wire(action.key());
    match action {
        StoreAction::Check { .. } | StoreAction::Wait { .. } => {
            let list = one_key_list(&key);
            let Some(keys) = KeyList::new(1, &list) else {
                node.failed = Some(format!("cannot encode the key {:?}", action.key()));
                return;
            };
            if matches!(action, StoreAction::Check { .. }) {
                node.queue(&Request::Check { keys });
            } else {
                node.queue(&Request::Wait { keys });
            }
        }
        StoreAction::Add { delta, .. } => node.queue(&Request::Add {
            key: &key,
            delta: *delta,
        }),
        StoreAction::Set { value, .. } => node.queue(&Request::Set { key: &key, value }),
        StoreAction::Append { value, .. } => node.queue(&Request::Append { key: &key, value }),
        StoreAction::CompareSet {
            expected, desired, ..
        } => node.queue(&Request::CompareSet {
            key: &key,
            expected,
            desired,
        }),
        StoreAction::Get { .. } => node.queue(&Request::Get { key: &key }),
        // No request: its timer answers it.
        StoreAction::Pause { .. } => {}
    }
}

/// What a reply means for the node's machine. A cancelled wait's replies come out of
/// the connection as one: `STOP_WAITING` (released) or `WAIT_CANCELED` (timed out).
fn store_reply(view: &ResponseView<'_>) -> Result<OwnedStoreReply, String> {
    Ok(match *view {
        ResponseView::Check(c) => OwnedStoreReply::Checked(c == CheckResponse::Ready),
        ResponseView::Int(n) => OwnedStoreReply::Added(n),
        ResponseView::Value(v) => OwnedStoreReply::Value(v.to_vec()),
        ResponseView::Wait(WaitResponse::StopWaiting) => OwnedStoreReply::Waited,
        ResponseView::Wait(WaitResponse::WaitCanceled) => OwnedStoreReply::TimedOut,
        ref other => return Err(format!("unexpected reply {other:?}")),
    })
}

/// Hands the node's replies to its machine and sends what it asks next.
fn step_node(node: &mut Node, i: usize, epoch: StdInstant, timers: &mut Timers) {
    loop {
        let reply = match node.conn.next_response(|view, _| store_reply(view)) {
            Ok(Some(reply)) => reply,
            Ok(None) => break,
            Err(e) => Err(e.to_string()),
        };
        match reply {
            Ok(reply) => answer(node, &reply, epoch),
            Err(e) => {
                node.failed = Some(e);
                return;
            }
        }
    }
    while node.action.is_none() && node.failed.is_none() {
        let Some(action) = node.machine.poll_action(now(epoch)) else {
            break;
        };
        send_action(node, &action);
        if node.failed.is_some() {
            return;
        }
        match action {
            // SET and APPEND have no reply in the TCPStore protocol: done once queued.
            StoreAction::Set { .. } | StoreAction::Append { .. } => {
                answer(node, &OwnedStoreReply::Set, epoch)
            }
            StoreAction::Wait { until, .. } | StoreAction::Pause { until } => {
                node.wait_gen += 1;
                timers.push(Reverse((until, i, node.wait_gen)));
                node.action = Some(action);
            }
            other => node.action = Some(other),
        }
    }
    node.flush();
}

fn answer(node: &mut Node, reply: &OwnedStoreReply, epoch: StdInstant) {
    node.action = None;
    node.machine.handle_reply(reply.as_reply(), now(epoch));
    while let Some(event) = node.machine.poll_event() {
        match event {
            Event::Complete(o) => node.rank = Some((o.round, o.rank, o.world_size)),
            Event::Failed(e) => node.failed = Some(e.to_string()),
            _ => {}
        }
    }
}

fn now(epoch: StdInstant) -> Instant {
    Instant::from_duration(epoch.elapsed())
}

/// Runs `rdzv bench rendezvous`.
pub(super) fn run(args: RendezvousBenchArgs) -> Result<ExitCode, BenchError> {
    if args.nodes == 0 {
        return Err(BenchError::invalid("--nodes must be at least 1"));
    }
    if let Some(etcd) = args.addr.as_deref().filter(|a| a.starts_with("etcd://")) {
        let interval = Duration::from_millis(args.keep_alive_ms.max(1));
        return super::rendezvous_etcd::run(etcd, args.nodes, interval, args.heartbeat_secs);
    }
    // The store: an embedded server (kept alive for the whole run), or the one at --addr.
    let target = super::Target::open(args.addr.as_deref(), None)?;
    let addr = target.addr;
    super::ensure_fd_limit(u64::from(args.nodes) + 64)?;
    let n = args.nodes;
    let interval = Duration::from_millis(args.keep_alive_ms.max(1));
    let run_id = super::harness::bench_run_id();
    let settings = super::harness::one_round(run_id, n, interval, Duration::from_secs(120))?;
    let mut reactor = Reactor::new(1024)?;
    let mut nodes = connect_nodes(addr, &settings, &reactor)?;
    eprintln!("{n} connections to {addr} opened; joining");
    let measured = drive(&mut nodes, &mut reactor, args.heartbeat_secs)?;
    let ranks: Vec<(u64, u32, u32)> = nodes.iter().filter_map(|node| node.rank).collect();
    super::harness::check_world(&ranks, n)?;
    print_report(&nodes, &measured, n, addr, interval, args.heartbeat_secs);
    print_torchrun_design(n);
    Ok(ExitCode::SUCCESS)
}

/// Opens one non-blocking connection per node, registered with `reactor` under the
/// node's index.
fn connect_nodes(
    addr: SocketAddr,
    settings: &ElasticSettings,
    reactor: &Reactor,
) -> Result<Vec<Node>, BenchError> {
    let n = settings.nodes.max;
    let mut nodes = Vec::with_capacity(n as usize);
    for i in 0..n {
        let conn = reactor
            .connect(addr, Limits::PYTORCH, None, i as usize)
            .map_err(|source| BenchError::Connect { addr, source })?;
        nodes.push(Node {
            machine: ElasticNode::new(settings.clone(), format!("bench-node-{i}")),
            conn,
            action: None,
            wait_gen: 0,
            ops: 0,
            bytes: 0,
            rank: None,
            failed: None,
        });
    }
    Ok(nodes)
}

/// What the run measured: when the round formed, each node's operations and request
/// bytes by then, and its operations when the heartbeat phase began.
struct Measured {
    took: Duration,
    join_ops: Vec<u64>,
    join_bytes: Vec<u64>,
    heartbeats: bool,
}

/// Wait deadlines: `(until, node, generation)`, earliest first.
type Timers = BinaryHeap<Reverse<(Instant, usize, u64)>>;

/// Joins every node and drives the event loop until the round has formed and the
/// heartbeat phase (`heartbeat_secs`, 0 for none) has run.
fn drive(
    nodes: &mut [Node],
    reactor: &mut Reactor,
    heartbeat_secs: f64,
) -> Result<Measured, BenchError> {
    let n = nodes.len() as u32;
    let epoch = StdInstant::now();
    for node in nodes.iter_mut() {
        node.machine.handle_local(LocalEvent::Join);
    }
    let mut timers = Timers::new();
    let mut measured: Option<Measured> = None;
    let mut complete = 0u32;
    let mut hb_end = None;
    let mut ready: Vec<usize> = (0..nodes.len()).collect();
    loop {
        complete += step_ready(nodes, &mut ready, epoch, &mut timers)?;
        if complete == n && measured.is_none() {
            measured = Some(Measured {
                took: epoch.elapsed(),
                join_ops: nodes.iter().map(|node| node.ops).collect(),
                join_bytes: nodes.iter().map(|node| node.bytes).collect(),
                heartbeats: heartbeat_secs > 0.0,
            });
            if heartbeat_secs <= 0.0 {
                break;
            }
            hb_end = Some(StdInstant::now() + Duration::from_secs_f64(heartbeat_secs));
        }
        if hb_end.is_some_and(|end| StdInstant::now() >= end) {
            break;
        }
        if epoch.elapsed() > Duration::from_secs(120) {
            return Err(BenchError::Unexpected(format!(
                "only {complete} of {n} nodes in a round after 120 s"
            )));
        }
        let wake = fire_deadlines(nodes, &mut ready, epoch, &mut timers);
        for event in reactor.wait(wake)? {
            on_socket_event(nodes, event.token().0, &mut ready);
        }
    }
    measured.ok_or_else(|| BenchError::Unexpected("the round never formed".into()))
}

/// Steps every node that can move; returns how many became members of the round.
fn step_ready(
    nodes: &mut [Node],
    ready: &mut Vec<usize>,
    epoch: StdInstant,
    timers: &mut Timers,
) -> Result<u32, BenchError> {
    let mut completed = 0;
    while let Some(i) = ready.pop() {
        let Some(node) = nodes.get_mut(i) else {
            continue;
        };
        let was_complete = node.rank.is_some();
        if node.conn.is_connected() && node.failed.is_none() {
            step_node(node, i, epoch, timers);
        }
        if !was_complete && node.rank.is_some() {
            completed += 1;
        }
        if let Some(failure) = &node.failed {
            return Err(BenchError::Unexpected(format!(
                "node {i} failed: {failure}"
            )));
        }
    }
    Ok(completed)
}

/// Ends the waits whose deadline has passed (CANCEL_WAIT); returns how long the loop
/// may sleep (until the next deadline, at most 100 ms).
fn fire_deadlines(
    nodes: &mut [Node],
    ready: &mut Vec<usize>,
    epoch: StdInstant,
    timers: &mut Timers,
) -> Duration {
    let t = now(epoch);
    while let Some(&Reverse((until, i, gen))) = timers.peek() {
        if until > t {
            break;
        }
        timers.pop();
        let Some(node) = nodes.get_mut(i) else {
            continue;
        };
        if node.wait_gen == gen && matches!(node.action, Some(StoreAction::Pause { .. })) {
            // A pause sends nothing: it ends here, and the node moves on.
            answer(node, &OwnedStoreReply::TimedOut, epoch);
            ready.push(i);
        } else if node.wait_gen == gen
            && !node.conn.cancelling()
            && matches!(node.action, Some(StoreAction::Wait { .. }))
        {
            // Counted as an operation, as the heartbeat figures say.
            node.ops += 1;
            node.bytes += Request::CancelWait.encoded_len() as u64;
            node.conn.cancel_wait();
            node.flush();
            if node.failed.is_some() {
                ready.push(i);
            }
        }
    }
    let wake = timers.peek().map(|Reverse((until, ..))| {
        Duration::from_nanos(until.as_nanos().saturating_sub(t.as_nanos()))
    });
    wake.unwrap_or(Duration::from_millis(100))
        .min(Duration::from_millis(100))
}

/// Node `i`'s socket is ready: finish its connect (VALIDATE, connection setup, is not
/// counted), flush, read.
fn on_socket_event(nodes: &mut [Node], i: usize, ready: &mut Vec<usize>) {
    let Some(node) = nodes.get_mut(i) else {
        return;
    };
    match node.conn.pump() {
        Ok(None) => return,
        Ok(Some(Fill::Open)) => {}
        Ok(Some(Fill::Closed)) => {
            node.failed
                .get_or_insert_with(|| "the server closed the connection".into());
        }
        Err(e) => {
            node.failed.get_or_insert(e.to_string());
        }
    }
    ready.push(i);
}

/// Prints the round's time, the join's operations and bytes per node, and the
/// heartbeat phase's operations per interval.
fn print_report(
    nodes: &[Node],
    measured: &Measured,
    n: u32,
    addr: SocketAddr,
    interval: Duration,
    heartbeat_secs: f64,
) {
    let (omin, omean, omax) = super::harness::spread(&measured.join_ops);
    let (bmin, bmean, bmax) = super::harness::spread(&measured.join_bytes);
    println!("rdzv elastic rendezvous: {n} nodes, one round, store {addr}");
    println!(
        "  round formed in           {:.3} s",
        measured.took.as_secs_f64()
    );
    let total: u64 = measured.join_ops.iter().sum();
    println!(
        "  store ops per node (join) min {omin}, mean {omean:.2}, max {omax}, {total} in all \
         (with the first wait on the round's end)"
    );
    println!("  request bytes per node    min {bmin}, mean {bmean:.0}, max {bmax}");
    if measured.heartbeats {
        let hb_ops: Vec<u64> = nodes
            .iter()
            .zip(&measured.join_ops)
            .map(|(node, start)| node.ops - start)
            .collect();
        let intervals = heartbeat_secs / interval.as_secs_f64();
        let (_, mean, max) = super::harness::spread(&hb_ops);
        println!(
            "  store ops per node per keep-alive interval ({} ms, {:.0} intervals): mean {:.2}, \
             max {:.2} (ADD own, ADD watched, WAIT on the round's end and its CANCEL_WAIT)",
            interval.as_millis(),
            intervals,
            mean / intervals,
            max as f64 / intervals
        );
    }
    println!();
}

/// Prints the same counts for torchrun's c10d design, computed from its algorithm.
fn print_torchrun_design(n: u32) {
    let blob = TORCHRUN_BLOB_BYTES_PER_NODE;
    println!("torchrun's c10d design (computed from dynamic_rendezvous.py, same N):");
    println!(
        "  state blob: every participant and its last heartbeat, pickled and base64'd, about \
         {blob:.0} B per node: {:.1} KiB at N={n}",
        blob * f64::from(n) / 1024.0
    );
    println!(
        "  join: each node compare-sets the whole blob; N nodes racing on one key, each CAS \
         won by one, so about (N+1)/2 = {:.0} COMPARE_SETs per node (plus a GET per lost \
         race), each sending the blob twice: O(N^2) bytes in all, about {:.1} MiB per node",
        (f64::from(n) + 1.0) / 2.0,
        (f64::from(n) + 1.0) / 2.0 * 2.0 * blob * f64::from(n) / 2.0 / 1_048_576.0
    );
    println!(
        "  while waiting for the round: one GET of the blob per second per node (SYNC, \
         1 s delay)"
    );
    println!(
        "  heartbeat: one COMPARE_SET of the whole blob per node per interval ({:.1} KiB \
         each way), retried on every conflict with the other N-1 heartbeats",
        blob * f64::from(n) / 1024.0
    );
}
