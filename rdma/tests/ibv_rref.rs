//! `to_here` of a 64 MiB tensor over the `ibv` transport, with three workers in three
//! processes (`w0`, this test, and `w1`, `w2`, this binary re-run with
//! `RDZV_IBV_RREF_CHILD` set), every pipe negotiated from the tcp bootstrap to ibv:
//!
//! - `w0` calls `remote()` on `w1` for a 64 MiB tensor and fetches it with `to_here`
//!   (the owner's answer crosses the `w0`→`w1` ibv pipe);
//! - `w0` forks its user to `w2`, which fetches the same 64 MiB from `w1` over its own
//!   ibv pipe and drops its fork;
//! - `w0` drops its user, and every worker's RRef counts end at zero before a graceful
//!   `join` that reports no leak.
//!
//! Skipped (with the reason) on hosts without verbs; `rdma/softroce/run` runs it in a
//! Soft-RoCE VM, where a missing device fails it. (`uring/tests/rref.rs` covers tcp and
//! shm.)

mod verbs_env;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdzv_core::negotiate::TransportKind;
use rdzv_core::rpc::name::WorkerId;
use rdzv_rdma::ibv::transport::IbvPlugin;
use rdzv_test_support::Peer;
use rdzv_uring::rpc::{init_rpc, CallContext, Message, RpcAgent, RpcOptions, Tensor};

const CHILD_ENV: &str = "RDZV_IBV_RREF_CHILD";
const STORE_ENV: &str = "RDZV_IBV_RREF_STORE";
const TEST: &str = "to_here_of_64_mib_over_ibv_between_three_workers";
const LEN: usize = 64 << 20;
/// Generous: Soft-RoCE under qemu's TCG moves tens of MB/s.
const PATIENCE: Duration = Duration::from_secs(120);

/// A child's agent, for its handlers (set right after `init_rpc` returns).
static AGENT: OnceLock<Arc<RpcAgent>> = OnceLock::new();

/// The RRefs a child keeps for the parent, by key.
static HELD: Mutex<Vec<rdzv_uring::rpc::RRef>> = Mutex::new(Vec::new());

/// `len` bytes of `seed` with the offset written every 4 KiB, so that a misplaced or
/// missing page shows (cheap to build, even unoptimised under TCG).
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    let mut data = vec![seed; len];
    for (i, page) in data.chunks_mut(4096).enumerate() {
        let mark = ((i as u64) << 8 | u64::from(seed)).to_le_bytes();
        let n = mark.len().min(page.len());
        page[..n].copy_from_slice(&mark[..n]);
    }
    data
}

/// The request of `make`: the length (8 bytes) and the seed.
fn make_message(len: usize, seed: u8) -> Message {
    Message::from_payload(rdzv_test_support::make_request(len as u64, seed))
}

fn make(_: &CallContext, m: Message) -> Result<Message, String> {
    let (len, seed) = rdzv_test_support::parse_make_request(&m.payload)?;
    Ok(Message::from_payload(b"made".to_vec()).with_tensor(Tensor::cpu(pattern(len, seed))))
}

/// Whether `m` carries `pattern(len, seed)`.
fn carries(m: &Message, len: usize, seed: u8) -> bool {
    m.tensors.len() == 1
        && m.tensors
            .first()
            .is_some_and(|t| t.data == pattern(len, seed))
}

/// In `w2`: turns the fork in the payload (after a seed byte) into an RRef, fetches its
/// value, checks it, and answers `[value ok, pipe to the owner is ibv]`; keeps the RRef
/// for `drop`.
fn fetch_fork(ctx: &CallContext, m: Message) -> Result<Message, String> {
    let (&seed, fork) = m.payload.split_first().ok_or("no seed")?;
    let rref = ctx.client.rref_from_fork(fork).map_err(|e| e.to_string())?;
    if rref.is_owner() {
        return Err("w2 got the owner's handle".into());
    }
    let started = Instant::now();
    let value = rref.to_here(PATIENCE).map_err(|e| e.to_string())?;
    println!(
        "w2: to_here of {LEN} bytes from {} in {:?}",
        rref.owner(),
        started.elapsed()
    );
    let ok = carries(&value, LEN, seed);
    drop(value);
    let deadline = Instant::now() + PATIENCE;
    let agent = loop {
        if let Some(agent) = AGENT.get() {
            break agent;
        }
        if Instant::now() > deadline {
            return Err("w2's agent was never set".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let ibv = agent.pipe_transport(rref.owner()) == Some(TransportKind::Ibv);
    HELD.lock().unwrap_or_else(|p| p.into_inner()).push(rref);
    Ok(Message::from_payload(vec![u8::from(ok), u8::from(ibv)]))
}

/// Drops every RRef `fetch_fork` kept.
fn drop_held(_: &CallContext, _: Message) -> Result<Message, String> {
    HELD.lock().unwrap_or_else(|p| p.into_inner()).clear();
    Ok(Message::default())
}

fn options(url: &str) -> RpcOptions {
    let mut options = RpcOptions::new(url)
        .with_handler("make", make)
        .with_handler("fetch_fork", fetch_fork)
        .with_handler("drop_held", drop_held);
    options.listen_host = Some([127, 0, 0, 1].into());
    options.init_counter = Some(0);
    options.num_worker_threads = 4;
    options.rpc_timeout = PATIENCE;
    options.transports = Some(vec!["ibv".into(), "tcp".into()]);
    options.transport_plugins = vec![IbvPlugin::default().into()];
    options
}

/// A child: serves as `w{rank}` until the parent's join.
fn run_child(rank: u32) {
    rdzv_test_support::exit_when_parent_gone();
    let url = std::env::var(STORE_ENV).unwrap_or_else(|_| panic!("{STORE_ENV} is not set"));
    let agent = init_rpc(&format!("w{rank}"), rank, Some(3), options(&url))
        .unwrap_or_else(|e| panic!("w{rank} init_rpc: {e}"));
    let agent = AGENT.get_or_init(|| Arc::new(agent));
    agent.join().unwrap_or_else(|e| panic!("w{rank} join: {e}"));
}

fn expect_counts(agent: &RpcAgent, owners: usize, forks: usize, rank: i16, what: &str) {
    if let Err(e) =
        agent.wait_until_owners_and_forks_on_rank(owners, forks, WorkerId::from(rank), PATIENCE)
    {
        panic!("{what}: {e}");
    }
}

#[test]
fn to_here_of_64_mib_over_ibv_between_three_workers() {
    if let Some(rank) = std::env::var(CHILD_ENV).ok().and_then(|r| r.parse().ok()) {
        run_child(rank);
        return;
    }
    if verbs_env::selection_or_skip(TEST).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("file://{}", dir.path().join("store").display());
    let children: Vec<Peer> = ["1", "2"]
        .into_iter()
        .map(|rank| {
            Peer::spawn_test(
                TEST,
                &["--test-threads=1"],
                &[(CHILD_ENV, rank), (STORE_ENV, url.as_str())],
            )
        })
        .collect();
    let agent = match init_rpc("w0", 0, Some(3), options(&url)) {
        Ok(agent) => agent,
        Err(e) => {
            drop(children);
            panic!("w0 init_rpc: {e}");
        }
    };

    // A user on w0 of a 64 MiB value on w1.
    let rref = agent
        .remote("w1", "make", make_message(LEN, 7))
        .unwrap_or_else(|e| panic!("remote: {e}"));
    let started = Instant::now();
    let value = rref
        .to_here(PATIENCE)
        .unwrap_or_else(|e| panic!("to_here from w1: {e}"));
    println!(
        "w0: to_here of {LEN} bytes from w1 in {:?}",
        started.elapsed()
    );
    assert_eq!(value.payload, b"made");
    assert!(
        carries(&value, LEN, 7),
        "the 64 MiB value came back different"
    );
    drop(value);
    assert_eq!(agent.pipe_transport("w1"), Some(TransportKind::Ibv));
    expect_counts(&agent, 1, 1, 1, "w0's user of w1's value");

    // The user forked to w2, which fetches the value from w1 over its own pipe.
    let mut request = vec![7];
    request.extend(rref.fork_to("w2").unwrap_or_else(|e| panic!("fork: {e}")));
    let reply = agent
        .rpc_sync("w2", "fetch_fork", Message::from_payload(request))
        .unwrap_or_else(|e| panic!("w2's to_here of the fork: {e}"));
    assert_eq!(
        reply.payload,
        [1, 1],
        "w2's value matched / w2's pipe to w1 is ibv"
    );
    assert_eq!(agent.pipe_transport("w2"), Some(TransportKind::Ibv));
    drop(rref);
    expect_counts(&agent, 1, 1, 1, "only w2's fork is left");
    agent
        .rpc_sync("w2", "drop_held", Message::default())
        .unwrap_or_else(|e| panic!("drop_held on w2: {e}"));
    for rank in 0..3 {
        expect_counts(&agent, 0, 0, rank, "at the end");
    }
    agent
        .wait_until_pending_futures_and_users_flushed(PATIENCE)
        .unwrap_or_else(|e| panic!("flush: {e}"));
    agent.join().unwrap_or_else(|e| panic!("w0 join: {e}"));
    let report = agent
        .rref_shutdown_report()
        .unwrap_or_else(|| panic!("no shutdown report after join"));
    assert!(report.is_clean(), "leaks at shutdown: {report:?}");
    for child in children {
        child.expect_success(PATIENCE);
    }
}
