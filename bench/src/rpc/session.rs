//! One benchmark run between its two sides, and what they tell each other through the
//! store.
//!
//! The *serving side* (`--listen`, or the child process of a local run) hosts the store
//! and is rank 1: it answers echoes and runs the raw-tcp echo server. The *measuring
//! side* (`--connect`, or the command a local run starts from) is rank 0 and times
//! everything. They agree through three store keys:
//!
//! 1. the measuring side writes `rdzv-bench-rpc/plan`: the (transport, channel) pairs it
//!    can run itself, its shared-memory domain, and the address it reached the serving
//!    side at;
//! 2. the serving side answers `rdzv-bench-rpc/reply`: the raw echo server's address and,
//!    per pair, whether it can run it too (and if not, why);
//! 3. both then run one agent pair per pair both can run, in plan order, the k-th on the
//!    store prefix `rpc_prefix_k` (so one store and one port serve every pair), each
//!    worker offering only that transport and that channel (or the agent's own default
//!    channel list, named `default` in the plan); then the measuring side
//!    times the raw ping-pong and writes `rdzv-bench-rpc/done` (`ok`, or `failed: why`),
//!    which ends the serving side.
//!
//! The agents rendezvous through the `rdzvbench://HOST:PORT` scheme this module
//! registers: a plain client of the serving side's store, so that neither side starts a
//! second store and the rank that hosts the store need not be rank 0. This module runs
//! the protocol; timing is `pair`'s, `raw`'s and `cuda`'s.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use rdzv_core::env::Env;
use rdzv_core::query::QueryView;
use rdzv_core::url::RendezvousUrl;
use rdzv_uring::rendezvous::{
    register_rendezvous_handler, Rendezvous, RendezvousError, RendezvousOptions,
};
use rdzv_uring::rpc::{init_rpc, CallContext, Inline, Message, RpcOptions};
use rdzv_uring::store::tcp::TcpStore;
use rdzv_uring::{Store, StoreError};
use serde::{Deserialize, Serialize};

use super::raw::{self, RawEchoServer};
use super::row::{Row, RunMode, Skip};
use super::spec::{Channels, Pair, ECHO, NAMES};
use super::viability::{pair_here, pair_on_serving_side, shm_domain};
use crate::BenchError;

/// The rendezvous scheme of the benchmark's agents.
const SCHEME: &str = "rdzvbench";
const PLAN_KEY: &str = "rdzv-bench-rpc/plan";
const REPLY_KEY: &str = "rdzv-bench-rpc/reply";
const DONE_KEY: &str = "rdzv-bench-rpc/done";
/// Bumped when the plan or the reply changes shape (2: the `default` channel list).
const PROTOCOL: u32 = 2;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the measuring side waits for the serving side's reply.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the serving side waits for the run to end once it has answered.
const DONE_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long one store wait lasts before the waiting side checks on other things.
const POLL: Duration = Duration::from_millis(200);
/// Calls run for minutes at most (64 MiB echoes on a loaded host included).
const RPC_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct PairSpec {
    transport: String,
    channel: String,
}

impl PairSpec {
    fn of(pair: Pair) -> PairSpec {
        PairSpec {
            transport: pair.transport.name().to_string(),
            channel: pair.channel.name().to_string(),
        }
    }

    fn parse(&self) -> Result<Pair, String> {
        let unknown = |e: &dyn std::fmt::Display| format!("unknown to this build: {e}");
        let transport = self.transport.parse().map_err(|e| unknown(&e))?;
        let channel = match self.channel.as_str() {
            Channels::DEFAULT_NAME => Channels::Default,
            name => Channels::Only(name.parse().map_err(|e| unknown(&e))?),
        };
        Ok(Pair { transport, channel })
    }
}

/// What the measuring side asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Plan {
    protocol: u32,
    /// The address the measuring side reached the serving side at: where the serving
    /// side's agents and raw echo server listen.
    serving_host: String,
    /// The measuring side's shared-memory domain, when it has one.
    shm_domain: Option<String>,
    pairs: Vec<PairSpec>,
}

/// The serving side's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Reply {
    protocol: u32,
    raw_addr: String,
    /// One per planned pair, in plan order.
    pairs: Vec<Verdict>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Verdict {
    #[serde(flatten)]
    pair: PairSpec,
    skipped: Option<String>,
}

/// Registers the `rdzvbench://` rendezvous scheme, once per process.
fn register_scheme() -> Result<(), BenchError> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            register_rendezvous_handler(SCHEME, store_client_rendezvous).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|e| BenchError::Unexpected(format!("cannot register {SCHEME}://: {e}")))
}

/// `rdzvbench://HOST:PORT?rank=R&world_size=W`: a client of the store at `HOST:PORT`.
fn store_client_rendezvous(
    url: &str,
    _env: &dyn Env,
    options: &RendezvousOptions,
) -> Result<Rendezvous, RendezvousError> {
    let fail = |what: String| RendezvousError::Plan(format!("{url}: {what}"));
    let parsed = RendezvousUrl::parse(url).map_err(|e| fail(e.to_string()))?;
    let host = parsed
        .hostname()
        .map(|h| h.as_written())
        .filter(|h| !h.is_empty())
        .ok_or_else(|| fail("no host".into()))?;
    let port = parsed
        .port()
        .map_err(|e| fail(e.to_string()))?
        .ok_or_else(|| fail("no port".into()))?;
    let query = QueryView::parse(parsed.query()).map_err(|e| fail(e.to_string()))?;
    let number = |name: &str| {
        let value = query.get(name);
        let parsed = value.map(|value| value.parse::<u32>().map_err(|_| value));
        parsed
            .transpose()
            .map_err(|value| fail(format!("{name} is not a number: {value}")))
    };
    let rank = number("rank")?.ok_or_else(|| fail("no rank".into()))?;
    let world_size = number("world_size")?;
    let store = TcpStore::connect(host, port, options.timeout)
        .map_err(|e| fail(format!("cannot connect to the benchmark's store: {e}")))?;
    Ok(Rendezvous::new(Arc::new(store), rank, world_size))
}

/// The options of one side's agent for the `counter`-th pair.
pub(super) fn agent_options(
    store: SocketAddr,
    listen: IpAddr,
    pair: Pair,
    counter: u64,
) -> RpcOptions {
    // The echo only moves the message: it runs where the request arrives (`Inline`).
    let mut options = RpcOptions::new(format!("{SCHEME}://{store}")).with_handler(
        ECHO,
        Inline(|_: &CallContext, m: Message| -> Result<Message, String> { Ok(m) }),
    );
    options.listen_host = Some(listen);
    options.init_counter = Some(counter);
    options.rpc_timeout = RPC_TIMEOUT;
    options.transports = Some(vec![pair.transport.name().to_string()]);
    options.channels = pair.channel.option();
    options.transport_plugins = vec![rdzv_rdma::ibv::transport::IbvPlugin::default().into()];
    options.device_plugins = vec![Arc::new(rdzv_rdma::cuda::agent::CudaPlugin)];
    options
}

/// A client of the serving side's store: the records both sides write and wait for.
struct SessionStore {
    addr: SocketAddr,
    store: TcpStore,
}

impl SessionStore {
    fn connect(addr: SocketAddr) -> Result<SessionStore, BenchError> {
        let store = TcpStore::connect(&addr.ip().to_string(), addr.port(), CONNECT_TIMEOUT)
            .map_err(store_failed(addr, "connecting"))?;
        Ok(SessionStore { addr, store })
    }

    /// For `map_err`: `what` failed with the store's error.
    fn failed(&self, what: impl Into<String>) -> impl FnOnce(StoreError) -> BenchError {
        store_failed(self.addr, what)
    }

    /// Writes `record` as JSON under `key`.
    fn put<T: Serialize>(&self, key: &str, record: &T) -> Result<(), BenchError> {
        let bytes = serde_json::to_vec(record).map_err(|source| BenchError::Record {
            what: format!("encoding {key}"),
            source,
        })?;
        self.store
            .set(key, &bytes)
            .map_err(self.failed(format!("writing {key}")))
    }

    /// Whether `key` is there.
    fn has(&self, key: &str) -> Result<bool, BenchError> {
        self.store
            .check(&[key])
            .map_err(self.failed(format!("checking {key}")))
    }

    /// Waits for `key`, up to `limit` (`None`: for ever), checking `give_up` between
    /// polls.
    fn wait_for(
        &self,
        key: &str,
        limit: Option<Duration>,
        mut give_up: impl FnMut() -> Result<(), BenchError>,
    ) -> Result<Vec<u8>, BenchError> {
        let started = Instant::now();
        loop {
            match self.store.wait(&[key], Some(POLL)) {
                Ok(()) => {
                    return self
                        .store
                        .get(key)
                        .map_err(self.failed(format!("reading {key}")))
                }
                Err(StoreError::Timeout { .. }) => {}
                Err(e) => return Err(self.failed(format!("waiting for {key}"))(e)),
            }
            give_up()?;
            if let Some(limit) = limit {
                if started.elapsed() >= limit {
                    return Err(BenchError::Unexpected(format!(
                        "waited {} s for {key} in the benchmark's store at {}",
                        limit.as_secs(),
                        self.addr
                    )));
                }
            }
        }
    }

    /// Waits for the JSON record under `key` (see [`wait_for`](Self::wait_for)).
    fn record<T: for<'a> Deserialize<'a>>(
        &self,
        key: &str,
        limit: Option<Duration>,
    ) -> Result<T, BenchError> {
        let bytes = self.wait_for(key, limit, || Ok(()))?;
        decode(key, &bytes)
    }
}

/// For `map_err`: `what` failed with the error of the store at `addr`.
fn store_failed(
    addr: SocketAddr,
    what: impl Into<String>,
) -> impl FnOnce(StoreError) -> BenchError {
    let what = what.into();
    move |source| BenchError::SessionStore {
        addr,
        what,
        source: Box::new(source),
    }
}

/// The JSON record `key` the other side wrote.
fn decode<T: for<'a> Deserialize<'a>>(key: &str, bytes: &[u8]) -> Result<T, BenchError> {
    serde_json::from_slice(bytes).map_err(|source| BenchError::Record {
        what: format!("malformed {key} from the other side"),
        source,
    })
}

/// The serving side's verdict on each pair of `plan`, and the pairs it can run (with
/// their counters).
fn judge(plan: &Plan) -> (Vec<Verdict>, Vec<(u64, Pair)>) {
    let mut verdicts = Vec::with_capacity(plan.pairs.len());
    let mut runnable = Vec::new();
    for (k, spec) in plan.pairs.iter().enumerate() {
        let shm_domain = plan.shm_domain.as_deref();
        let verdict = match spec.parse() {
            Ok(pair) => {
                pair_on_serving_side(pair.transport, pair.channel, shm_domain).map(|()| pair)
            }
            Err(reason) => Err(format!("on the serving side: {reason}")),
        };
        if let Ok(pair) = verdict {
            runnable.push((k as u64, pair));
        }
        verdicts.push(Verdict {
            pair: spec.clone(),
            skipped: verdict.err(),
        });
    }
    (verdicts, runnable)
}

/// Starts the thread that runs the serving side's agent for each of `runnable` in turn;
/// it sends how many it served, or why it stopped.
fn spawn_agents(
    store_addr: SocketAddr,
    host: IpAddr,
    runnable: Vec<(u64, Pair)>,
    log: bool,
) -> Result<mpsc::Receiver<Result<usize, BenchError>>, BenchError> {
    let (served_tx, served_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("rdzv-bench-serve".into())
        .spawn(move || {
            let result = (|| {
                for &(counter, pair) in &runnable {
                    let in_pair = |source: BenchError| BenchError::Pair {
                        pair: pair.to_string(),
                        source: Box::new(source),
                    };
                    let options = agent_options(store_addr, host, pair, counter);
                    let agent =
                        init_rpc(NAMES[1], 1, Some(2), options).map_err(|e| in_pair(e.into()))?;
                    agent.join().map_err(|e| in_pair(e.into()))?;
                    if log {
                        eprintln!("rdzv bench rpc: served {pair}");
                    }
                }
                Ok(runnable.len())
            })();
            let _ = served_tx.send(result);
        })
        .map_err(BenchError::io("start the serving side's agent thread"))?;
    Ok(served_rx)
}

/// The serving side failed: `source` says why.
fn serving_failed(source: BenchError) -> BenchError {
    BenchError::Unexpected(format!("the serving side failed: {source}"))
}

/// Runs the serving side against its own store at `store`: waits for a plan (up to
/// `plan_wait`; `None`: for ever), answers it, serves every pair it accepted, and
/// returns once the measuring side says the run is over. Returns how many pairs it
/// served.
pub(super) fn serve(
    store_addr: SocketAddr,
    plan_wait: Option<Duration>,
    log: bool,
) -> Result<usize, BenchError> {
    register_scheme()?;
    let store = SessionStore::connect(store_addr)?;
    let plan: Plan = store.record(PLAN_KEY, plan_wait)?;
    if plan.protocol != PROTOCOL {
        return Err(BenchError::Unexpected(format!(
            "the measuring side speaks bench-rpc protocol {}, this build {PROTOCOL}: run one \
             rdzv version on both hosts",
            plan.protocol
        )));
    }
    let host: IpAddr = plan.serving_host.parse().map_err(|e| {
        BenchError::Unexpected(format!(
            "the plan's serving host {:?}: {e}",
            plan.serving_host
        ))
    })?;
    let raw = RawEchoServer::start(host).map_err(BenchError::io("start the raw echo server"))?;
    let (verdicts, runnable) = judge(&plan);
    let reply = Reply {
        protocol: PROTOCOL,
        raw_addr: raw.addr().to_string(),
        pairs: verdicts,
    };
    store.put(REPLY_KEY, &reply)?;
    let served_rx = spawn_agents(store_addr, host, runnable, log)?;
    let mut served = None;
    let done = store.wait_for(DONE_KEY, Some(DONE_TIMEOUT), || {
        if served.is_none() {
            if let Ok(result) = served_rx.try_recv() {
                // A failure here ends the run: the store goes with this process, which
                // the measuring side notices at once.
                served = Some(result.map_err(serving_failed)?);
            }
        }
        // The measuring side says `done` before it lets go of the control connection.
        if raw.control_closed() && !store.has(DONE_KEY)? {
            return Err(BenchError::Unexpected(
                "the measuring side went away before the run was over".into(),
            ));
        }
        Ok(())
    })?;
    drop(raw);
    let done = String::from_utf8_lossy(&done);
    if done != "ok" {
        return Err(BenchError::Unexpected(format!(
            "the measuring side stopped: {done}"
        )));
    }
    match served {
        Some(count) => Ok(count),
        // Every agent has joined on the measuring side, so this one is leaving too.
        None => served_rx
            .recv_timeout(CONNECT_TIMEOUT)
            .map_err(|_| {
                BenchError::Unexpected(
                    "the serving side's agents did not leave after the run".into(),
                )
            })?
            .map_err(serving_failed),
    }
}

/// The measuring side of one run.
#[derive(Debug)]
pub(super) struct Measurement<'a> {
    /// The serving side's store.
    pub(super) store: SocketAddr,
    /// Where this side's agents listen (reachable from the serving side).
    pub(super) local_ip: IpAddr,
    /// Where the serving side was reached.
    pub(super) serving_ip: IpAddr,
    pub(super) mode: RunMode,
    /// Every pair asked for, in column order.
    pub(super) pairs: Vec<Pair>,
    /// `(payload bytes, iterations)`.
    pub(super) sizes: Vec<(usize, usize)>,
    pub(super) bar: &'a ProgressBar,
}

/// What a run measured, and what it skipped.
#[derive(Debug, Default)]
pub(super) struct Outcome {
    pub(super) rows: Vec<Row>,
    pub(super) skips: Vec<Skip>,
}

impl Measurement<'_> {
    /// Runs the measuring side: plans with the serving side, measures each pair both can
    /// run, then the raw ping-pong, and releases the serving side (also on failure).
    pub(super) fn run(&self) -> Result<Outcome, BenchError> {
        register_scheme()?;
        let store = SessionStore::connect(self.store)?;
        let mut outcome = Outcome::default();
        let mut asked = Vec::new();
        for &pair in &self.pairs {
            match pair_here(pair.transport, pair.channel) {
                Ok(()) => asked.push(pair),
                Err(reason) => outcome.skips.push(self.skip(pair, self.here(reason))),
            }
        }
        let plan = Plan {
            protocol: PROTOCOL,
            serving_host: self.serving_ip.to_string(),
            shm_domain: shm_domain(),
            pairs: asked.iter().copied().map(PairSpec::of).collect(),
        };
        store.put(PLAN_KEY, &plan)?;
        let mut control = None;
        let measured = self.after_plan(&store, &plan, &asked, &mut outcome, &mut control);
        let done = match &measured {
            Ok(()) => "ok".to_string(),
            Err(e) => format!("failed: {e}"),
        };
        // Best effort: if the store is gone, so is the serving side. The control
        // connection closes only after `done` is written (see `raw`).
        let _ = store.store.set(DONE_KEY, done.as_bytes());
        drop(control);
        measured?;
        Ok(outcome)
    }

    fn after_plan(
        &self,
        store: &SessionStore,
        plan: &Plan,
        asked: &[Pair],
        outcome: &mut Outcome,
        control: &mut Option<TcpStream>,
    ) -> Result<(), BenchError> {
        let reply: Reply = store.record(REPLY_KEY, Some(REPLY_TIMEOUT))?;
        if reply.protocol != PROTOCOL
            || reply.pairs.len() != plan.pairs.len()
            || reply
                .pairs
                .iter()
                .zip(&plan.pairs)
                .any(|(v, p)| &v.pair != p)
        {
            return Err(BenchError::Unexpected(format!(
                "the serving side answered another plan (protocol {}, {} pairs); run one rdzv \
                 version on both hosts",
                reply.protocol,
                reply.pairs.len()
            )));
        }
        let raw_addr: SocketAddr = reply.raw_addr.parse().map_err(|e| {
            BenchError::Unexpected(format!(
                "the serving side's raw echo address {:?}: {e}",
                reply.raw_addr
            ))
        })?;
        *control = Some(raw::hold_control(raw_addr)?);
        // Every round trip of the run: each accepted pair's, then raw-tcp's.
        let accepted = reply.pairs.iter().filter(|v| v.skipped.is_none()).count();
        let per_column: usize = self.sizes.iter().map(|&(_, iters)| iters).sum();
        self.bar
            .set_length(((accepted + 1) as u64).saturating_mul(per_column as u64));
        for (counter, (&pair, verdict)) in asked.iter().zip(&reply.pairs).enumerate() {
            if let Some(reason) = &verdict.skipped {
                outcome.skips.push(self.skip(pair, reason.clone()));
                continue;
            }
            let options = agent_options(self.store, self.local_ip, pair, counter as u64);
            outcome.rows.extend(super::pair::measure(
                options,
                pair,
                &self.sizes,
                self.mode,
                self.bar,
            )?);
        }
        for &(len, iters) in &self.sizes {
            outcome
                .rows
                .push(raw::measure(raw_addr, len, iters, self.mode, self.bar)?);
        }
        Ok(())
    }

    /// A reason from this side, said so between two hosts.
    fn here(&self, reason: String) -> String {
        match self.mode {
            RunMode::Local => reason,
            RunMode::TwoHost => format!("on the measuring side: {reason}"),
        }
    }

    fn skip(&self, pair: Pair, reason: String) -> Skip {
        Skip {
            transport: pair.transport.name().to_string(),
            channel: pair.channel.name().to_string(),
            mode: self.mode,
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use rdzv_core::negotiate::{ChannelKind, TransportKind};

    use super::*;

    #[test]
    fn plans_and_replies_round_trip_through_json() {
        let plan = Plan {
            protocol: PROTOCOL,
            serving_host: "10.0.0.2".into(),
            shm_domain: Some("shm:abc_1".into()),
            pairs: vec![PairSpec::of(Pair {
                transport: TransportKind::Tcp,
                channel: Channels::Only(ChannelKind::Basic),
            })],
        };
        let bytes = serde_json::to_vec(&plan).unwrap();
        assert_eq!(decode::<Plan>(PLAN_KEY, &bytes).unwrap(), plan);
        let reply = Reply {
            protocol: PROTOCOL,
            raw_addr: "10.0.0.2:4000".into(),
            pairs: vec![Verdict {
                pair: plan.pairs[0].clone(),
                skipped: Some("why".into()),
            }],
        };
        let text = serde_json::to_string(&reply).unwrap();
        assert!(text.contains(r#""transport":"tcp","channel":"basic","skipped":"why""#));
        assert_eq!(decode::<Reply>(REPLY_KEY, text.as_bytes()).unwrap(), reply);
        assert!(decode::<Reply>(REPLY_KEY, b"{\"protocol\":1}").is_err());
    }

    #[test]
    fn pair_names_from_the_other_side_are_checked() {
        let spec = PairSpec {
            transport: "tcp".into(),
            channel: "basic".into(),
        };
        assert_eq!(
            spec.parse().unwrap(),
            Pair {
                transport: TransportKind::Tcp,
                channel: Channels::Only(ChannelKind::Basic)
            }
        );
        let spec = PairSpec {
            transport: "shm".into(),
            channel: "default".into(),
        };
        assert_eq!(
            spec.parse().unwrap(),
            Pair {
                transport: TransportKind::Shm,
                channel: Channels::Default
            }
        );
        let spec = PairSpec {
            transport: "carrier-pigeon".into(),
            channel: "basic".into(),
        };
        assert!(spec
            .parse()
            .unwrap_err()
            .starts_with("unknown to this build"));
    }

    #[test]
    fn the_scheme_is_a_client_of_an_existing_store() {
        let server = match rdzv_uring::StoreServer::start(rdzv_uring::ServerOptions {
            host: Some("127.0.0.1".into()),
            port: 0,
            ..rdzv_uring::ServerOptions::default()
        }) {
            Ok(server) => server,
            Err(e) => {
                eprintln!("SKIP: cannot start the io_uring store server here: {e}");
                return;
            }
        };
        let addr = server.local_addr();
        let options = RendezvousOptions::with_timeout(Duration::from_secs(5));
        let env = rdzv_uring::rendezvous::ProcessEnv::default();
        let url = format!("{SCHEME}://{addr}?rank=1&world_size=2");
        let rdzv = store_client_rendezvous(&url, &env, &options).unwrap();
        assert_eq!((rdzv.rank, rdzv.world_size), (1, Some(2)));
        rdzv.store.set("k", b"v").unwrap();
        assert_eq!(rdzv.store.get("k").unwrap(), b"v");
        for bad in [
            format!("{SCHEME}://{addr}?world_size=2"),
            format!("{SCHEME}://{addr}?rank=x"),
            format!("{SCHEME}://127.0.0.1?rank=0"),
        ] {
            assert!(
                store_client_rendezvous(&bad, &env, &options).is_err(),
                "{bad}"
            );
        }
        register_scheme().unwrap();
        register_scheme().unwrap();
        server.shutdown();
    }
}
