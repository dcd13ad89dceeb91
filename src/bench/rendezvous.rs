//! `rdzv bench rendezvous --nodes N`: N elastic-rendezvous nodes, each a
//! `rdzv_core::rendezvous::elastic::ElasticNode` on its own non-blocking TCPStore
//! connection, all driven by one `mio` event loop (no thread per node), against a store
//! server (embedded, or any at `--addr`). It measures how long the N nodes take to form
//! one round, the store operations and request bytes each node sent to join, and, over a
//! heartbeat phase, the operations per node per keep-alive interval; then prints the same
//! counts for torchrun's c10d design, computed from its algorithm.
//!
//! The protocol is the core's; this file only moves its requests (encoded by
//! `rdzv_core::store::codec`, keys with PyTorch's `/` prefix, as `rdzv rendezvous` sends
//! them) and implements a wait's deadline with PyTorch's CANCEL_WAIT exchange.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::io::{self, Read, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant as StdInstant};

use clap::Args;
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};
use rdzv_core::rendezvous::elastic::{
    ElasticNode, ElasticSettings, Event, Instant, LocalEvent, NodeRange, OwnedStoreReply,
    StoreAction,
};
use rdzv_core::store::codec::{self, Decoded, Limits, PendingReply, ResponseView};
use rdzv_core::store::{CheckResponse, KeyList, Request, WaitResponse, VALIDATION_MAGIC};

use super::BenchError;
use crate::cli::CliError;

/// Options of `rdzv bench rendezvous`.
#[derive(Debug, Args)]
pub(crate) struct RendezvousBenchArgs {
    /// How many nodes join (one round of exactly this many).
    #[arg(long, default_value_t = 1024)]
    nodes: u32,
    /// The store, as HOST:PORT; without it an rdzv server is started in this process.
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
    stream: TcpStream,
    connected: bool,
    out: Vec<u8>,
    out_pos: usize,
    input: Vec<u8>,
    /// Replies owed, oldest first.
    owed: VecDeque<PendingReply>,
    /// The action being performed; for a wait, whether CANCEL_WAIT was sent.
    action: Option<StoreAction>,
    cancel_sent: bool,
    /// After a cancel: the server released the wait before it saw the cancel.
    released: bool,
    /// A wait's generation, so that a stale timer does nothing.
    wait_gen: u64,
    ops: u64,
    bytes: u64,
    rank: Option<(u64, u32, u32)>,
    failed: Option<String>,
}

impl Node {
    fn queue(&mut self, request: &Request<'_>) {
        let before = self.out.len();
        request.encode_into(&mut self.out);
        self.bytes += (self.out.len() - before) as u64;
        self.ops += 1;
        if let Some(pending) = PendingReply::for_request(request) {
            self.owed.push_back(pending);
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        while self.out_pos < self.out.len() {
            match self.stream.write(&self.out[self.out_pos..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.out.clear();
        self.out_pos = 0;
        Ok(())
    }

    fn fill(&mut self) -> io::Result<bool> {
        let mut chunk = [0u8; 4096];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(n) => self.input.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// `/` + key, as PyTorch's TCPStore client sends user keys.
fn wire(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(b'/');
    k.extend_from_slice(key.as_bytes());
    k
}

fn key_list(key: &[u8]) -> Vec<u8> {
    let mut out = (key.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(key);
    out
}

/// Sends the request of `action`.
fn send_action(node: &mut Node, action: &StoreAction) {
    let key = wire(action.key());
    match action {
        StoreAction::Check { .. } | StoreAction::Wait { .. } => {
            let list = key_list(&key);
            let keys = KeyList::new(1, &list).expect("one well-formed key");
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
        StoreAction::CompareSet {
            expected, desired, ..
        } => node.queue(&Request::CompareSet {
            key: &key,
            expected,
            desired,
        }),
        StoreAction::Get { .. } => node.queue(&Request::Get { key: &key }),
    }
}

/// What a decoded reply means for the node's action.
enum Answer {
    Reply(OwnedStoreReply),
    /// A part of the CANCEL_WAIT exchange; nothing to hand the machine yet.
    Nothing,
}

/// Decodes the next complete reply, if one is there.
fn next_answer(node: &mut Node, limits: &Limits) -> Result<Option<Answer>, String> {
    let Some(&pending) = node.owed.front() else {
        return if node.input.is_empty() {
            Ok(None)
        } else {
            Err(format!(
                "{} unexpected bytes from the server",
                node.input.len()
            ))
        };
    };
    let (answer, used) = match codec::decode_response_view(pending, &node.input, limits) {
        Ok(Decoded::Partial(_)) => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", pending.query().name())),
        Ok(Decoded::Complete(view, used)) => {
            let answer = match view {
                ResponseView::Check(c) => {
                    Answer::Reply(OwnedStoreReply::Checked(c == CheckResponse::Ready))
                }
                ResponseView::Int(n) => Answer::Reply(OwnedStoreReply::Added(n)),
                ResponseView::Value(v) => Answer::Reply(OwnedStoreReply::Value(v.to_vec())),
                ResponseView::Wait(w) => wait_answer(node, w),
                other => return Err(format!("unexpected reply {other:?}")),
            };
            (answer, used)
        }
    };
    node.owed.pop_front();
    node.input.drain(..used);
    Ok(Some(answer))
}

/// The WAIT / CANCEL_WAIT exchange. Without a cancel, STOP_WAITING answers the wait.
/// After a cancel (replies owed: the wait's, then the cancel's), the server answers
/// WAIT_CANCELED alone (the wait's reply never comes), or STOP_WAITING (it released us
/// before it saw the cancel) and then WAIT_CANCELED.
fn wait_answer(node: &mut Node, wait: WaitResponse) -> Answer {
    if !node.cancel_sent {
        return Answer::Reply(OwnedStoreReply::Waited);
    }
    match (wait, node.owed.len()) {
        (WaitResponse::StopWaiting, 2) => {
            node.released = true;
            Answer::Nothing
        }
        (WaitResponse::WaitCanceled, 2) => {
            // The cancel's reply, in the wait's place: the wait's reply never comes.
            node.owed.pop_back();
            node.cancel_sent = false;
            Answer::Reply(OwnedStoreReply::TimedOut)
        }
        _ => {
            node.cancel_sent = false;
            let released = std::mem::take(&mut node.released);
            Answer::Reply(if released {
                OwnedStoreReply::Waited
            } else {
                OwnedStoreReply::TimedOut
            })
        }
    }
}

/// Hands the node's replies to its machine and sends what it asks next.
fn step_node(
    node: &mut Node,
    i: usize,
    epoch: StdInstant,
    limits: &Limits,
    timers: &mut BinaryHeap<Reverse<(Instant, usize, u64)>>,
) {
    loop {
        match next_answer(node, limits) {
            Ok(Some(Answer::Reply(reply))) => answer(node, &reply, epoch),
            Ok(Some(Answer::Nothing)) => {}
            Ok(None) => break,
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
        match action {
            // SET has no reply in the TCPStore protocol: done once queued.
            StoreAction::Set { .. } => answer(node, &OwnedStoreReply::Set, epoch),
            StoreAction::Wait { until, .. } => {
                node.wait_gen += 1;
                timers.push(Reverse((until, i, node.wait_gen)));
                node.action = Some(action);
            }
            other => node.action = Some(other),
        }
    }
    if let Err(e) = node.flush() {
        node.failed = Some(format!("send: {e}"));
    }
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
pub(super) fn run(args: RendezvousBenchArgs) -> Result<ExitCode, CliError> {
    if args.nodes == 0 {
        return Err("--nodes must be at least 1".into());
    }
    // Keeps an embedded server alive for the whole run.
    let target = super::Target::open(args.addr.as_deref(), None)?;
    let addr = target.addr;
    super::ensure_fd_limit(u64::from(args.nodes) + 64)?;
    let n = args.nodes;
    let interval = Duration::from_millis(args.keep_alive_ms.max(1));
    let run_id = format!(
        "bench-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    let mut settings = ElasticSettings::new(run_id, NodeRange::new(n, n)?);
    settings.keep_alive_interval = interval;
    settings.join_timeout = Duration::from_secs(120);
    let limits = Limits::PYTORCH;

    let mut poll = Poll::new().map_err(|source| BenchError::Io {
        what: "create an epoll instance",
        source,
    })?;
    let mut nodes = Vec::with_capacity(n as usize);
    for i in 0..n {
        let mut stream =
            TcpStream::connect(addr).map_err(|source| BenchError::Connect { addr, source })?;
        poll.registry()
            .register(
                &mut stream,
                Token(i as usize),
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(|source| BenchError::Io {
                what: "register a connection",
                source,
            })?;
        nodes.push(Node {
            machine: ElasticNode::new(settings.clone(), format!("bench-node-{i}")),
            stream,
            connected: false,
            out: Vec::new(),
            out_pos: 0,
            input: Vec::new(),
            owed: VecDeque::new(),
            action: None,
            cancel_sent: false,
            released: false,
            wait_gen: 0,
            ops: 0,
            bytes: 0,
            rank: None,
            failed: None,
        });
    }
    eprintln!("{n} connections to {addr} opened; joining");
    let epoch = StdInstant::now();
    for node in &mut nodes {
        node.machine.handle_local(LocalEvent::Join);
    }
    let mut timers: BinaryHeap<Reverse<(Instant, usize, u64)>> = BinaryHeap::new();
    let mut events = Events::with_capacity(1024);
    let mut round_at = None;
    let mut complete = 0u32;
    let mut join_ops = Vec::new();
    let mut join_bytes = Vec::new();
    let mut phase_start_ops: Vec<u64> = Vec::new();
    let mut hb_end = None;
    let mut ready: Vec<usize> = (0..nodes.len()).collect();
    loop {
        // Step every node that can move.
        while let Some(i) = ready.pop() {
            let node = &mut nodes[i];
            let was_complete = node.rank.is_some();
            if node.connected && node.failed.is_none() {
                step_node(node, i, epoch, &limits, &mut timers);
            }
            if !was_complete && node.rank.is_some() {
                complete += 1;
            }
            if let Some(failure) = &node.failed {
                return Err(format!("node {i} failed: {failure}").into());
            }
        }
        if complete == n && round_at.is_none() {
            round_at = Some(epoch.elapsed());
            join_ops = nodes.iter().map(|node| node.ops).collect();
            join_bytes = nodes.iter().map(|node| node.bytes).collect();
            phase_start_ops.clone_from(&join_ops);
            if args.heartbeat_secs <= 0.0 {
                break;
            }
            hb_end = Some(StdInstant::now() + Duration::from_secs_f64(args.heartbeat_secs));
        }
        if hb_end.is_some_and(|end| StdInstant::now() >= end) {
            break;
        }
        if epoch.elapsed() > Duration::from_secs(120) {
            return Err(format!("only {complete} of {n} nodes in a round after 120 s").into());
        }
        // Fire due wait deadlines: CANCEL_WAIT.
        let t = now(epoch);
        while let Some(&Reverse((until, i, gen))) = timers.peek() {
            if until > t {
                break;
            }
            timers.pop();
            let node = &mut nodes[i];
            if node.wait_gen == gen
                && !node.cancel_sent
                && matches!(node.action, Some(StoreAction::Wait { .. }))
            {
                node.queue(&Request::CancelWait);
                node.cancel_sent = true;
                if let Err(e) = node.flush() {
                    node.failed = Some(format!("send: {e}"));
                    ready.push(i);
                }
            }
        }
        let wake = timers.peek().map(|Reverse((until, ..))| {
            Duration::from_nanos(until.as_nanos().saturating_sub(t.as_nanos()))
        });
        let wake = wake
            .unwrap_or(Duration::from_millis(100))
            .min(Duration::from_millis(100));
        // A signal's EINTR is a wake-up, not a failure (as in the other load generators).
        super::conn::poll_events(&mut poll, &mut events, Some(wake)).map_err(|source| {
            BenchError::Io {
                what: "wait for socket events",
                source,
            }
        })?;
        for event in &events {
            let i = event.token().0;
            let node = &mut nodes[i];
            if !node.connected {
                match node.stream.peer_addr() {
                    Ok(_) => {
                        node.connected = true;
                        let _ = node.stream.set_nodelay(true);
                        // PyTorch's clients start with VALIDATE (no reply); servers
                        // close connections that do not. Connection setup, not counted.
                        Request::Validate {
                            magic: VALIDATION_MAGIC,
                        }
                        .encode_into(&mut node.out);
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotConnected => continue,
                    Err(e) => node.failed = Some(format!("connect: {e}")),
                }
            }
            if event.is_readable() {
                match node.fill() {
                    Ok(true) => {}
                    Ok(false) => node.failed = Some("the server closed the connection".into()),
                    Err(e) => node.failed = Some(format!("recv: {e}")),
                }
            }
            if event.is_writable() {
                if let Err(e) = node.flush() {
                    node.failed = Some(format!("send: {e}"));
                }
            }
            ready.push(i);
        }
    }
    let took = round_at.unwrap_or_default();
    // Every node must agree: one round, world n, distinct ranks.
    let mut ranks: Vec<u32> = nodes
        .iter()
        .filter_map(|node| node.rank)
        .map(|(round, rank, world)| {
            debug_assert_eq!((round, world), (0, n));
            rank
        })
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    if ranks.len() != n as usize {
        return Err(format!("ranks are not distinct: {} distinct of {n}", ranks.len()).into());
    }
    let stats = |v: &[u64]| {
        let min = v.iter().copied().min().unwrap_or(0);
        let max = v.iter().copied().max().unwrap_or(0);
        let mean = v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
        (min, mean, max)
    };
    let (omin, omean, omax) = stats(&join_ops);
    let (bmin, bmean, bmax) = stats(&join_bytes);
    println!("rdzv elastic rendezvous: {n} nodes, one round, store {addr}");
    println!("  round formed in           {:.3} s", took.as_secs_f64());
    println!(
        "  store ops per node (join) min {omin}, mean {omean:.1}, max {omax} (with the first \
         heartbeat)"
    );
    println!("  request bytes per node    min {bmin}, mean {bmean:.0}, max {bmax}");
    if let (Some(_), true) = (hb_end, args.heartbeat_secs > 0.0) {
        let hb_ops: Vec<u64> = nodes
            .iter()
            .zip(&phase_start_ops)
            .map(|(node, start)| node.ops - start)
            .collect();
        let intervals = args.heartbeat_secs / interval.as_secs_f64();
        let (_, mean, max) = stats(&hb_ops);
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
    println!("torchrun's c10d design (computed from dynamic_rendezvous.py, same N):");
    println!(
        "  state blob: every participant and its last heartbeat, pickled and base64'd, about \
         200 B per node: {:.1} KiB at N={n}",
        200.0 * f64::from(n) / 1024.0
    );
    println!(
        "  join: each node compare-sets the whole blob; N nodes racing on one key, each CAS \
         won by one, so about (N+1)/2 = {:.0} COMPARE_SETs per node (plus a GET per lost \
         race), each sending the blob twice: O(N^2) bytes in all, about {:.1} MiB per node",
        (f64::from(n) + 1.0) / 2.0,
        (f64::from(n) + 1.0) / 2.0 * 2.0 * 200.0 * f64::from(n) / 2.0 / 1_048_576.0
    );
    println!(
        "  while waiting for the round: one GET of the blob per second per node (SYNC, \
         1 s delay)"
    );
    println!(
        "  heartbeat: one COMPARE_SET of the whole blob per node per interval ({:.1} KiB \
         each way), retried on every conflict with the other N-1 heartbeats",
        200.0 * f64::from(n) / 1024.0
    );
    Ok(ExitCode::SUCCESS)
}
