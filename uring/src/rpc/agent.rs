//! [`init_rpc`] and the [`RpcAgent`] handle: the static group's start-up through the
//! store, the calls, and shutdown.
//!
//! Start-up (static group, PyTorch's `_tensorpipe_init_backend_handler` plus the agent's
//! constructor and `startImpl`): rendezvous through `init_method`; claim
//! `rpcIsStaticGroup`; publish `names/{rank}` and read every other rank's name (duplicate
//! names fail); publish this worker's `(name, device_count, device_maps, devices)` under
//! `devices/{rank}` (PyTorch gathers it with a process group; rdzv uses the store) and
//! check every worker's maps with the core; start the I/O thread and listen on the
//! lowest-priority transport (the bootstrap one); publish `addrs/{name}`, read every
//! peer's address; then a store barrier.
//!
//! Dynamic groups (no world size; PyTorch's `_group_membership_management` and
//! `_update_group_membership`): under the store token `RpcGroupManagementToken`, a
//! newcomer claims `names/{rank}`, reads `_ALL_WORKER_INFOS`, checks device maps as a
//! dynamic group, starts, tells every member (a reserved `__rdzv_group_join` call
//! carrying its name, id, address and devices), then lists itself. Leaving (graceful
//! shutdown) takes the token, tells every other member (`__rdzv_group_leave`), then runs
//! the core's `Leave`. Unlike PyTorch, a leave drops only the leaver's reverse device
//! map on the others, not all of them, and device information travels through the store
//! (`devices/{rank}`) instead of `_get_device_infos` calls.
//!
//! The handle is `Send + Sync`: every method may be called from any thread. Calls are
//! handed to the I/O thread and complete an [`RpcFuture`]; handlers run on a pool of
//! `num_worker_threads` threads.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use glommio::{LocalExecutorBuilder, Placement};
use rdzv_core::device::{Device, DeviceType};
use rdzv_core::device_map::{
    create_reverse_mapping, exchange_and_check_device_maps, validate_device_maps, DeviceMaps,
    GroupKind, WorkerDevices,
};
use rdzv_core::negotiate::{rank, ChannelKind, RankError, Ranked, Ranking, TransportKind};
use rdzv_core::rpc::membership::{decode_leave, JoinAnnouncement, GROUP_JOIN, GROUP_LEAVE};
use rdzv_core::rpc::metrics::{AgentMetrics, NetworkData};
use rdzv_core::rpc::name::{WorkerId, WorkerInfo};
use rdzv_core::rpc::shutdown::{Action, Join, JoinError, Leave, Outcome};
use rdzv_core::rpc::store_keys::{
    append_worker_info, check_rank_claim, check_static_group, decode_worker_devices,
    encode_worker_devices, membership_token, parse_worker_infos, static_group_value,
    static_ranks_to_fetch, token_step, Membership, NameTable, RpcKeys, TokenStep, TOKEN_DONE,
};
use rdzv_core::rpc::timeouts::RpcTimeout;

use super::calls::Calls;
use super::client::RpcClient;
use super::device::{DevicePlugin, Devices};
use super::error::{RpcError, TransportError};
use super::io::Io;
use super::lane::{Job, Lanes};
use super::message::{default_wait_spin, mark_io_thread, run_handler, Handler, Message, RpcFuture};
use super::mpt::MptSetup;
use super::shared::{CallState, Command, Group, Mailbox, OfferSpec, Peer, Shared};
use super::shm::ShmTransport;
use super::tcp::TcpTransport;
use super::transport::{join_addresses, Transport, TransportPlugin};
use crate::rendezvous::{rendezvous_with, ProcessEnv, RendezvousOptions};
use crate::store::Store;
use rdzv_core::rendezvous::NodeParams;

/// The handler name [`RpcAgent::wait_until_node_failure`] probes with (never registered).
const NODE_PROBE: &str = "__rdzv_node_probe";
/// How often it probes.
const NODE_PROBE_INTERVAL: Duration = Duration::from_millis(100);

/// PyTorch's default handler pool size (`numWorkerThreads`).
pub const DEFAULT_NUM_WORKER_THREADS: usize = 16;

/// `_init_counter`: the `n` of `rpc_prefix_n`, counting `init_rpc` calls in the process.
static INIT_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The options of [`init_rpc`] (PyTorch's `TensorPipeRpcBackendOptions`).
#[derive(Clone)]
#[non_exhaustive]
pub struct RpcOptions {
    /// The default timeout of a call; zero means calls never expire. Default 60 s.
    pub rpc_timeout: Duration,
    /// Any rendezvous URL (`tcp://`, `env://`, `file://`, registered schemes). Default
    /// `env://`.
    pub init_method: String,
    /// How many threads run handlers. Default 16.
    pub num_worker_threads: usize,
    /// The transports to register, highest priority first; `None` for every one this
    /// build runs here: `shm` (when shared memory works), the
    /// [`transport_plugins`](Self::transport_plugins)' and `tcp`, by the core's
    /// priorities (two workers on one host then talk over shm). Unknown names are
    /// errors, and so is a name this build implements neither itself nor through a
    /// plugin.
    pub transports: Option<Vec<String>>,
    /// Transports implemented outside this crate, e.g. `rdzv_rdma`'s ibv:
    /// `vec![Arc::new(rdzv_rdma::ibv::transport::IbvPlugin::default())]`. A plugin that is
    /// not viable here is left out with its reason logged. Default: none.
    pub transport_plugins: Vec<Arc<dyn TransportPlugin>>,
    /// Device runtimes built outside this crate, e.g. `rdzv_rdma`'s CUDA one:
    /// `vec![Arc::new(rdzv_rdma::cuda::agent::CudaPlugin)]`. With one, tensors in device
    /// memory ([`Tensor::on_device`](super::Tensor::on_device)) move over `cuda_xth`,
    /// `cuda_ipc`, `cuda_gdr` or `cuda_basic` (see [`super::device`]). A runtime that cannot open here
    /// (no driver, no GPU) is left out with its reason logged. Default: none.
    pub device_plugins: Vec<Arc<dyn DevicePlugin>>,
    /// The channels to register, highest priority first; `None` for every channel this
    /// build runs (`xth`, `cma`, `mpt`, `basic`, `cuda_xth`, `cuda_ipc`, `cuda_gdr`,
    /// `cuda_basic`). Unknown names are errors; a channel that cannot work in this
    /// process (cma under a seccomp policy or Yama `ptrace_scope` 3, `cuda_ipc` without a
    /// CUDA runtime that runs it, ...) is left out with its reason
    /// logged, and so is `mpt` when this worker runs no tcp transport.
    pub channels: Option<Vec<String>>,
    /// How many extra TCP connections ("lanes") a pipe that negotiated `mpt` opens, 1 to
    /// 64; a tensor is split evenly over up to this many, in stripes of at least 1 MiB.
    /// Default
    /// [`DEFAULT_MPT_LANES`](super::DEFAULT_MPT_LANES).
    pub mpt_lanes: u16,
    /// Tensors smaller than this many bytes travel inline in the pipe's frames (the
    /// `basic` channel) even where `cma`, `xth` or `mpt` was negotiated. Default
    /// [`DEFAULT_MIN_CHANNEL_BYTES`](super::channels::DEFAULT_MIN_CHANNEL_BYTES).
    pub min_channel_bytes: u64,
    /// Per destination worker: where this worker's tensors land there.
    pub device_maps: DeviceMaps,
    /// The devices this worker uses (empty: derived from the maps).
    pub devices: Vec<Device>,
    /// How many CUDA devices this worker has (for device-map validation); 0 takes the
    /// count from the CUDA device plugin, when one opened.
    pub device_count: u32,
    /// The address to listen on; `None` guesses it from the host name, falling back to
    /// 127.0.0.1 as PyTorch does.
    pub listen_host: Option<IpAddr>,
    /// The `n` of the store prefix `rpc_prefix_n`; `None` counts `init_rpc` calls in the
    /// process as PyTorch does. Set it when several agents of one group live in one
    /// process (tests).
    pub init_counter: Option<u64>,
    /// Handlers registered before the agent starts listening, so that no peer can call
    /// in before they exist.
    pub handlers: Vec<(String, Arc<dyn Handler>)>,
    /// Faults to inject into this worker's sends (PyTorch's faulty agent), for tests.
    pub fault_injection: FaultInjection,
    /// How long a thread blocked in [`RpcFuture::wait`] (and `rpc_sync`) spins before
    /// it sleeps: a reply that arrives meanwhile costs no wake-up. Default 50 µs on hosts
    /// with two or more CPUs, zero on one; set zero where threads outnumber CPUs.
    pub wait_spin: Duration,
    /// How RRef control messages (`RREF_FORK_REQUEST`, `RREF_CHILD_ACCEPT`,
    /// `RREF_USER_DELETE`) are retried: PyTorch's `RpcRetryOptions` (1 s, backoff 1.5,
    /// 5 retries). A graceful `join` waits for RRefs at most this long twice over.
    pub rref_retry: rdzv_core::rpc::rref::RetryOptions,
}

/// PyTorch's `FaultyTensorPipeAgent` for tests, keyed by handler name (rdzv's message
/// type): the first `num_fail_sends` requests to each handler in `fail_handlers` fail
/// with "Send attempt failed intentionally for {handler}" instead of being sent, and
/// requests to a handler in `delays` are held that long before they are sent. The
/// default injects nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultInjection {
    /// Handlers whose requests fail to send.
    pub fail_handlers: Vec<String>,
    /// How many requests to each of them fail before they go through.
    pub num_fail_sends: u32,
    /// Handlers whose requests are delayed, and by how much.
    pub delays: Vec<(String, Duration)>,
}

impl FaultInjection {
    /// Whether it injects nothing.
    pub fn is_empty(&self) -> bool {
        self.fail_handlers.is_empty() && self.delays.is_empty()
    }
}

impl std::fmt::Debug for RpcOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcOptions")
            .field("rpc_timeout", &self.rpc_timeout)
            .field("init_method", &self.init_method)
            .field("num_worker_threads", &self.num_worker_threads)
            .field("transports", &self.transports)
            .field(
                "transport_plugins",
                &self
                    .transport_plugins
                    .iter()
                    .map(|p| p.kind())
                    .collect::<Vec<_>>(),
            )
            .field(
                "device_plugins",
                &self
                    .device_plugins
                    .iter()
                    .map(|p| p.device_type())
                    .collect::<Vec<_>>(),
            )
            .field("channels", &self.channels)
            .field("min_channel_bytes", &self.min_channel_bytes)
            .field("mpt_lanes", &self.mpt_lanes)
            .field("device_maps", &self.device_maps)
            .field("devices", &self.devices)
            .field("device_count", &self.device_count)
            .field("listen_host", &self.listen_host)
            .field("init_counter", &self.init_counter)
            .field("fault_injection", &self.fault_injection)
            .field("rref_retry", &self.rref_retry)
            .field(
                "handlers",
                &self.handlers.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Default for RpcOptions {
    fn default() -> Self {
        RpcOptions {
            rpc_timeout: rdzv_core::rpc::timeouts::DEFAULT_RPC_TIMEOUT,
            init_method: "env://".to_string(),
            num_worker_threads: DEFAULT_NUM_WORKER_THREADS,
            transports: None,
            transport_plugins: Vec::new(),
            device_plugins: Vec::new(),
            channels: None,
            min_channel_bytes: super::channels::DEFAULT_MIN_CHANNEL_BYTES,
            mpt_lanes: super::DEFAULT_MPT_LANES,
            device_maps: DeviceMaps::new(),
            devices: Vec::new(),
            device_count: 0,
            listen_host: None,
            init_counter: None,
            handlers: Vec::new(),
            fault_injection: FaultInjection::default(),
            wait_spin: default_wait_spin(),
            rref_retry: rdzv_core::rpc::rref::RetryOptions::default(),
        }
    }
}

impl RpcOptions {
    /// The defaults with this `init_method`.
    pub fn new(init_method: impl Into<String>) -> RpcOptions {
        RpcOptions {
            init_method: init_method.into(),
            ..RpcOptions::default()
        }
    }

    /// What [`init_rpc`] would offer peers with these options in this process, or the
    /// error it would give for them, without joining a group, listening or starting a
    /// thread: the same probes (shm's host identity and a test allocation, the listed
    /// transport plugins opened, the device runtimes, each listed channel's viability)
    /// and the same ranking ([`rdzv_core::negotiate::rank`]). Transports and channels come
    /// highest priority first; [`Ranked::refused`] says what was left out and why.
    /// Options that need the group (`init_method`, device maps) are not checked.
    ///
    /// ```no_run
    /// let mut options = rdzv_uring::rpc::RpcOptions::default();
    /// options.channels = Some(vec!["cma".into(), "basic".into()]);
    /// match options.check() {
    ///     Ok(offer) => println!("offers {:?} and {:?}", offer.transports, offer.channels),
    ///     Err(e) => eprintln!("init_rpc would fail: {e}"),
    /// }
    /// ```
    ///
    /// # Errors
    /// [`RpcError::Backends`] / [`RpcError::InvalidOption`] for unusable options,
    /// [`RpcError::HandlerExists`] for a reserved or repeated handler name, exactly as
    /// [`init_rpc`] gives them.
    pub fn check(&self) -> Result<Ranked<String>, RpcError> {
        probe(self).map(|probed| probed.offer)
    }

    /// These options plus a handler registered under `name`.
    pub fn with_handler(mut self, name: impl Into<String>, handler: impl Handler) -> RpcOptions {
        self.handlers.push((name.into(), Arc::new(handler)));
        self
    }
}

/// `rank`'s refusal as the error `init_rpc` gives.
fn rank_error(error: RankError) -> RpcError {
    let option = error.option();
    match error {
        RankError::Names { source, .. } => RpcError::Backends {
            option,
            source: Box::new(source),
        },
        other => RpcError::InvalidOption {
            option,
            reason: other.to_string(),
        },
    }
}

/// What probing the options found: the offer, and what was opened to make it.
struct Probed {
    offer: Ranked<String>,
    /// The shm transport, when it is viable and offered.
    shm: Option<ShmTransport>,
    /// The plugged-in transports that are viable and offered.
    plugged: Vec<(TransportKind, Box<dyn Transport + Send>)>,
    devices: Devices,
    handlers: HashMap<String, Arc<dyn Handler>>,
}

/// Checks the options that need no peer and probes what this process can run (shm, the
/// listed transport plugins, the device runtimes, the channels), then lets the core
/// rank the offer ([`rdzv_core::negotiate::rank`]). [`init_rpc`] and
/// [`RpcOptions::check`] both start here.
fn probe(options: &RpcOptions) -> Result<Probed, RpcError> {
    if options.num_worker_threads == 0 {
        return Err(RpcError::InvalidOption {
            option: "num_worker_threads",
            reason: "at least one thread must run handlers".into(),
        });
    }
    if options.mpt_lanes == 0 || options.mpt_lanes > crate::channel::mpt::MAX_LANES {
        return Err(RpcError::InvalidOption {
            option: "mpt_lanes",
            reason: format!(
                "{} lanes: a pipe opens 1 to {}",
                options.mpt_lanes,
                crate::channel::mpt::MAX_LANES
            ),
        });
    }
    // shm's viability: the host identity and a test allocation.
    let shm = ShmTransport::new();
    let plugged = open_plugins(options)?;
    let mut here = vec![(
        TransportKind::Shm,
        shm.as_ref().map(|_| ()).map_err(ToString::to_string),
    )];
    here.extend(
        plugged
            .iter()
            .map(|(kind, opened)| (*kind, opened.as_ref().map(|_| ()).map_err(Clone::clone))),
    );
    here.push((TransportKind::Tcp, Ok(())));
    // The runtimes open whatever the channels: they also count the devices that the
    // device maps are checked against.
    let devices =
        Devices::open(&options.device_plugins).map_err(|reason| RpcError::InvalidOption {
            option: "device_plugins",
            reason,
        })?;
    let offer = rank(
        options.transports.as_deref(),
        options.channels.as_deref(),
        &here,
        &super::channels::RUNNABLE,
        |kind| super::channels::domain_descriptor(kind, &devices),
    )
    .map_err(rank_error)?;
    for refused in &offer.refused {
        tracing::info!(reason = %refused.reason, "the {} is not offered", refused.backend);
    }
    let offered = |kind: TransportKind| offer.transports.iter().any(|&(k, _)| k == kind);
    let shm = shm.ok().filter(|_| offered(TransportKind::Shm));
    let plugged = plugged
        .into_iter()
        .filter_map(|(kind, opened)| Some((kind, opened.ok()?)))
        .filter(|(kind, _)| offered(*kind))
        .collect();

    let mut handlers: HashMap<String, Arc<dyn Handler>> = HashMap::new();
    for (handler_name, handler) in &options.handlers {
        if handler_name.starts_with(RESERVED_PREFIX)
            || handlers
                .insert(handler_name.clone(), Arc::clone(handler))
                .is_some()
        {
            return Err(RpcError::HandlerExists {
                name: handler_name.clone(),
            });
        }
    }
    Ok(Probed {
        offer,
        shm,
        plugged,
        devices,
        handlers,
    })
}

/// A plugged-in transport opened for this worker, or why it is not viable.
type Plugged = (TransportKind, Result<Box<dyn Transport + Send>, String>);

/// Opens the plugins whose kind the `transports` option may offer (all of them when it
/// is `None`), first plugin of a kind only.
fn open_plugins(options: &RpcOptions) -> Result<Vec<Plugged>, RpcError> {
    let mut opened: Vec<Plugged> = Vec::new();
    let mut host = None;
    for plugin in &options.transport_plugins {
        let kind = plugin.kind();
        if matches!(kind, TransportKind::Tcp | TransportKind::Shm) {
            return Err(RpcError::InvalidOption {
                option: "transport_plugins",
                reason: format!("transport {kind} is built in and cannot be plugged in"),
            });
        }
        // A bad option is reported by `rank`, with its reason.
        let listed = Ranking::<TransportKind>::from_option(options.transports.as_deref())
            .is_ok_and(|ranking| ranking.iter().any(|(k, _)| k == kind));
        if !listed || opened.iter().any(|(k, _)| *k == kind) {
            continue;
        }
        let host = *host.get_or_insert_with(|| options.listen_host.unwrap_or_else(guess_host));
        opened.push((kind, plugin.open(host)));
    }
    Ok(opened)
}

/// PyTorch's `guessAddress`: an address of the host name that can be bound, else
/// 127.0.0.1.
fn guess_host() -> IpAddr {
    let fallback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let host = match std::fs::read_to_string("/proc/sys/kernel/hostname") {
        Ok(host) => host.trim().to_string(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the host name; RPC listens on 127.0.0.1");
            return fallback;
        }
    };
    let found = (host.as_str(), 0)
        .to_socket_addrs()
        .ok()
        .into_iter()
        .flatten()
        .find(|addr| std::net::TcpListener::bind(SocketAddr::new(addr.ip(), 0)).is_ok());
    match found {
        Some(addr) => addr.ip(),
        None => {
            tracing::warn!(%host, "no bindable address for the host name; RPC listens on 127.0.0.1");
            fallback
        }
    }
}

fn store_error<'k>(
    op: &'static str,
    key: &'k str,
) -> impl FnOnce(crate::store::StoreError) -> RpcError + 'k {
    move |source| RpcError::Store {
        op,
        key: key.to_string(),
        source: Box::new(source),
    }
}

/// The agent: make calls, register handlers, read metrics, shut down.
pub struct RpcAgent {
    shared: Arc<Shared>,
    client: RpcClient,
    store: Arc<dyn Store>,
    keys: RpcKeys,
    io_thread: Mutex<Option<JoinHandle<()>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    address: String,
    next_barrier_id: Mutex<u64>,
}

impl std::fmt::Debug for RpcAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcAgent")
            .field("me", &self.shared.me)
            .field("world_size", &self.shared.world_size)
            .field("address", &self.address)
            .finish()
    }
}

/// `rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)`:
/// joins the group and starts the agent. With a world size (static group) it blocks
/// until every worker of the group has started (a store barrier); without one it joins
/// a dynamic group (the rendezvous must allow that, e.g. `tcp://`).
///
/// # Errors
/// [`RpcError::InvalidWorker`] for a bad name or rank; [`RpcError::Backends`] /
/// [`RpcError::InvalidOption`] for unusable options (unknown transport or channel names,
/// no worker threads); [`RpcError::DuplicateId`] for a dynamic member whose rank is
/// taken; [`RpcError::Rendezvous`] and [`RpcError::Store`]
/// when the store cannot be reached; [`RpcError::MixedGroup`], [`RpcError::Names`]
/// (duplicate names) and [`RpcError::DeviceMaps`] when the group is inconsistent;
/// [`RpcError::Transport`] / [`RpcError::Executor`] when listening fails.
pub fn init_rpc(
    name: &str,
    rank: u32,
    world_size: Option<u32>,
    options: RpcOptions,
) -> Result<RpcAgent, RpcError> {
    let me =
        WorkerInfo::new(name, i64::from(rank)).map_err(|e| RpcError::InvalidWorker(Box::new(e)))?;
    if let Some(world_size) = world_size {
        if rank >= world_size {
            return Err(RpcError::InvalidOption {
                option: "rank",
                reason: format!("rank {rank} is not below the world size {world_size}"),
            });
        }
    }
    let Probed {
        offer,
        shm,
        plugged,
        devices,
        handlers,
    } = probe(&options)?;
    let (transports, channels) = (offer.transports, offer.channels);

    // A dynamic member builds its store as `_create_store_from_options` does: no world
    // size argument.
    let params = match world_size {
        Some(world_size) => NodeParams::Given {
            rank: Some(rank),
            world_size: Some(world_size),
        },
        None => NodeParams::Inferred { rank: Some(rank) },
    };
    let rdzv = rendezvous_with(
        &options.init_method,
        params,
        &ProcessEnv::snapshot(),
        &RendezvousOptions::default(),
    )
    .map_err(|source| RpcError::Rendezvous {
        init_method: options.init_method.clone(),
        source: Box::new(source),
    })?;
    let store = rdzv.store;
    let counter = options
        .init_counter
        .unwrap_or_else(|| INIT_COUNTER.fetch_add(1, Ordering::Relaxed));
    let keys = RpcKeys::new(counter);

    // rpcIsStaticGroup.
    let is_static = world_size.is_some();
    let key = keys.is_static_group();
    let returned = store
        .compare_set(&key, b"", static_group_value(is_static))
        .map_err(store_error("compare_set", &key))?;
    check_static_group(is_static, &returned)?;

    let start = Start {
        me,
        options,
        store,
        keys,
        transports,
        shm,
        plugged,
        channels,
        devices,
        handlers,
    };
    match world_size {
        Some(world_size) => init_static(start, world_size),
        None => {
            let token = membership_token(start.me.name(), Membership::Join);
            acquire_token(&*start.store, &start.keys, &token)?;
            let (store, keys) = (Arc::clone(&start.store), start.keys.clone());
            let joined = join_dynamic(start);
            release_token(&*store, &keys, &token).and(joined)
        }
    }
}

/// What both kinds of group start from.
struct Start {
    me: WorkerInfo,
    options: RpcOptions,
    store: Arc<dyn Store>,
    keys: RpcKeys,
    /// Highest priority first.
    transports: Vec<(TransportKind, i64)>,
    /// The shm transport, when it is viable and offered.
    shm: Option<ShmTransport>,
    /// The plugged-in transports that are viable and offered.
    plugged: Vec<(TransportKind, Box<dyn Transport + Send>)>,
    /// Highest priority first, with their domain descriptors.
    channels: Vec<(ChannelKind, i64, String)>,
    /// The opened device runtimes.
    devices: Devices,
    handlers: HashMap<String, Arc<dyn Handler>>,
}

impl Start {
    fn devices(&self) -> WorkerDevices {
        WorkerDevices {
            name: self.me.name().to_string(),
            device_count: match (
                self.options.device_count,
                self.devices.runtime(DeviceType::Cuda),
            ) {
                (0, Some(cuda)) => u32::try_from(cuda.device_count()).unwrap_or(u32::MAX),
                (count, _) => count,
            },
            device_maps: self.options.device_maps.clone(),
            devices: self.options.devices.clone(),
        }
    }

    fn devices_key(&self, rank: u32) -> String {
        self.keys.devices(rank)
    }

    /// Publishes this worker's device information under `devices/{rank}`.
    fn publish_devices(&self) -> Result<(), RpcError> {
        let rank = self.rank();
        let encoded = encode_worker_devices(&self.devices())
            .map_err(|reason| RpcError::BadDeviceInfo { rank, reason })?;
        let key = self.devices_key(rank);
        self.store
            .set(&key, &encoded)
            .map_err(store_error("set", &key))
    }

    /// Reads a worker's device information.
    fn read_devices(&self, rank: u32) -> Result<WorkerDevices, RpcError> {
        let key = self.devices_key(rank);
        let value = self.store.get(&key).map_err(store_error("get", &key))?;
        decode_worker_devices(&value).map_err(|reason| RpcError::BadDeviceInfo { rank, reason })
    }

    fn rank(&self) -> u32 {
        u32::try_from(self.me.id().get()).unwrap_or(0)
    }

    /// Reads a worker's published address.
    fn read_address(&self, name: &str) -> Result<String, RpcError> {
        let key = self.keys.address(name);
        let value = self.store.get(&key).map_err(store_error("get", &key))?;
        Ok(String::from_utf8_lossy(&value).into_owned())
    }

    /// Starts the pool and the I/O thread, and publishes this worker's address.
    fn start_agent(self, world_size: Option<u32>) -> Result<RpcAgent, RpcError> {
        let Start {
            me,
            options,
            store,
            keys,
            transports,
            shm,
            mut plugged,
            channels,
            devices,
            handlers,
        } = self;
        let host = options.listen_host.unwrap_or_else(guess_host);
        // Highest priority first; the last one is the bootstrap transport.
        let mut running: Vec<Box<dyn Transport + Send>> = Vec::new();
        let mut offered = Vec::new();
        for &(kind, priority) in &transports {
            let transport: Box<dyn Transport + Send> = match kind {
                TransportKind::Tcp => Box::new(TcpTransport::new(host)),
                TransportKind::Shm => match &shm {
                    Some(shm) => Box::new(shm.clone()),
                    None => continue,
                },
                other => match plugged.iter().position(|(k, _)| *k == other) {
                    Some(at) => plugged.swap_remove(at).1,
                    None => continue,
                },
            };
            offered.push((kind, priority, transport.domain_descriptor().to_string()));
            running.push(transport);
        }
        let mpt = if channels.iter().any(|&(k, _, _)| k == ChannelKind::Mpt) {
            let started = MptSetup::start(host, options.mpt_lanes).map_err(|source| {
                RpcError::from(TransportError::Listen {
                    address: format!("mpt://{}", SocketAddr::new(host, 0)),
                    source,
                })
            })?;
            Some(started)
        } else {
            None
        };
        let offer = OfferSpec {
            transports: offered,
            channels,
            serves_cuda: devices.has_cuda(),
            min_channel_bytes: options.min_channel_bytes,
        };
        let pool_size = u32::try_from(options.num_worker_threads).unwrap_or(u32::MAX);
        let shared = Arc::new(Shared {
            me: me.clone(),
            world_size,
            group: RwLock::new(Group::default()),
            dynamic: world_size.is_none(),
            handlers: RwLock::new(handlers),
            mailbox: Mailbox::default(),
            calls: Mutex::new(CallState {
                metrics: AgentMetrics::new(pool_size),
                network: NetworkData::new(),
                frozen: false,
                deferred_finishes: 0,
                shutting_down: false,
                pipe_transports: HashMap::new(),
                waiters: 0,
                pipe_channels: HashMap::new(),
                channel_bytes: Default::default(),
            }),
            calls_changed: Condvar::new(),
            next_message_id: AtomicU64::new(1),
            default_timeout: RpcTimeout::from_duration(options.rpc_timeout),
            offer,
            calls_table: Calls::new(),
            lanes: Mutex::new(Lanes::default()),
            faults: super::faults::Faults::new(&options.fault_injection),
            mpt,
            devices,
            wait_spin: options.wait_spin,
            rrefs: super::rref::RRefs::new(me.id(), options.rref_retry),
        });
        super::rref::register_handlers(&shared);
        if world_size.is_none() {
            register_membership_handlers(&shared);
        }
        let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
        let mut workers = spawn_pool(&shared, jobs_rx, options.num_worker_threads)?;
        workers.push(
            Calls::start_timer(&shared)
                .map_err(|e| RpcError::Executor(format!("timer thread: {e}")))?,
        );
        let (io_thread, address) = spawn_io(&shared, running, jobs_tx)?;
        // The mpt lane listener's address goes last: it is no transport.
        let address = match &shared.mpt {
            Some(mpt) => join_addresses([address.as_str(), mpt.published().as_str()]),
            None => address,
        };
        let agent = RpcAgent {
            shared: Arc::clone(&shared),
            client: RpcClient::new(Arc::clone(&shared)),
            store: Arc::clone(&store),
            keys: keys.clone(),
            io_thread: Mutex::new(Some(io_thread)),
            workers: Mutex::new(workers),
            address: address.clone(),
            next_barrier_id: Mutex::new(1),
        };
        let key = keys.address(me.name());
        store
            .set(&key, address.as_bytes())
            .map_err(store_error("set", &key))?;
        Ok(agent)
    }
}

/// The static group's start-up: names, device maps, agent, addresses, barrier.
fn init_static(start: Start, world_size: u32) -> Result<RpcAgent, RpcError> {
    let me = start.me.clone();
    let rank = start.rank();
    let (store, keys) = (Arc::clone(&start.store), start.keys.clone());
    let key = keys.rank_name(me.id());
    store
        .set(&key, me.name().as_bytes())
        .map_err(store_error("set", &key))?;
    let world = u16::try_from(world_size).map_err(|_| RpcError::InvalidOption {
        option: "world_size",
        reason: format!("{world_size} workers exceed the worker id range"),
    })?;
    let mut names = NameTable::new(&me);
    let mut ranked_names: Vec<(WorkerId, String)> = vec![(me.id(), me.name().to_string())];
    for id in static_ranks_to_fetch(me.id(), world) {
        let key = keys.rank_name(id);
        let value = store.get(&key).map_err(store_error("get", &key))?;
        names.insert(&value, id)?;
        ranked_names.push((id, String::from_utf8_lossy(&value).into_owned()));
    }
    ranked_names.sort_by_key(|(id, _)| id.get());

    // Devices: every worker's (name, device_count, device_maps, devices).
    let mine = start.devices();
    start.publish_devices()?;
    let mut workers = Vec::with_capacity(ranked_names.len());
    for r in 0..world_size {
        workers.push(if r == rank {
            mine.clone()
        } else {
            start.read_devices(r)?
        });
    }
    let setup = exchange_and_check_device_maps(&mine, &workers)?;

    let mut peers = HashMap::new();
    let device_maps = start.options.device_maps.clone();
    let reader = Start {
        me: me.clone(),
        options: RpcOptions::default(),
        store: Arc::clone(&store),
        keys: keys.clone(),
        transports: Vec::new(),
        shm: None,
        plugged: Vec::new(),
        channels: Vec::new(),
        devices: Devices::default(),
        handlers: HashMap::new(),
    };
    let agent = start.start_agent(Some(world_size))?;
    for (id, peer_name) in &ranked_names {
        let address = if *id == me.id() {
            agent.address.clone()
        } else {
            reader.read_address(peer_name)?
        };
        peers.insert(peer_name.clone(), Peer { id: *id, address });
    }
    *agent.shared.group_mut() = Group {
        peers,
        device_maps,
        reverse_device_maps: setup.reverse_device_maps,
    };
    let key = keys.init_barrier();
    store
        .barrier(&key, i64::from(world_size), None)
        .map_err(store_error("barrier", &key))?;
    tracing::info!(name = %me.name(), rank, address = %agent.address, "RPC agent started");
    Ok(agent)
}

/// A dynamic member's join, under the group token: claim the rank, read the members,
/// check device maps, start, tell every member, then list this worker.
fn join_dynamic(start: Start) -> Result<RpcAgent, RpcError> {
    let me = start.me.clone();
    let (store, keys) = (Arc::clone(&start.store), start.keys.clone());
    let key = keys.rank_name(me.id());
    let returned = store
        .compare_set(&key, b"", me.name().as_bytes())
        .map_err(store_error("compare_set", &key))?;
    check_rank_claim(&me, &returned)?;
    let list_key = keys.all_worker_infos();
    // compare_set from "" to "" reads the list, creating it empty if it is missing.
    let list = store
        .compare_set(&list_key, b"", b"")
        .map_err(store_error("compare_set", &list_key))?;
    let members: Vec<(String, WorkerId)> = parse_worker_infos(&list)?
        .into_iter()
        .map(|(n, id)| (n.to_string(), id))
        .collect();
    let mut names = NameTable::new(&me);
    for (name, id) in &members {
        names.insert(name.as_bytes(), *id)?;
    }

    let mine = start.devices();
    start.publish_devices()?;
    let mut workers = vec![mine.clone()];
    for (_, id) in &members {
        workers.push(start.read_devices(u32::try_from(id.get()).unwrap_or(0))?);
    }
    validate_device_maps(&workers, GroupKind::Dynamic)?;
    let reverse_device_maps = create_reverse_mapping(me.name(), &workers);

    let mut peers = HashMap::new();
    for (name, id) in &members {
        peers.insert(
            name.clone(),
            Peer {
                id: *id,
                address: start.read_address(name)?,
            },
        );
    }
    let device_maps = start.options.device_maps.clone();
    let agent = start.start_agent(None)?;
    peers.insert(
        me.name().to_string(),
        Peer {
            id: me.id(),
            address: agent.address.clone(),
        },
    );
    *agent.shared.group_mut() = Group {
        peers,
        device_maps,
        reverse_device_maps,
    };
    let announcement = JoinAnnouncement {
        name: me.name().to_string(),
        id: me.id().get(),
        address: agent.address.clone(),
        devices: mine.clone(),
    }
    .encode()
    .map_err(|reason| RpcError::BadDeviceInfo {
        rank: u32::try_from(me.id().get()).unwrap_or(0),
        reason,
    })?;
    for (name, _) in &members {
        agent.rpc_sync(
            name,
            GROUP_JOIN,
            Message::from_payload(announcement.clone()),
        )?;
    }
    let text = String::from_utf8_lossy(&list).into_owned();
    let listed = append_worker_info(&text, &me)?;
    store
        .set(&list_key, listed.as_bytes())
        .map_err(store_error("set", &list_key))?;
    tracing::info!(name = %me.name(), members = members.len(), "RPC agent joined a dynamic group");
    Ok(agent)
}

/// `_group_membership_management`'s acquire: compare-set the group token until it is
/// ours, waiting for the holder's `Done` in between.
fn acquire_token(store: &dyn Store, keys: &RpcKeys, token: &str) -> Result<(), RpcError> {
    let key = keys.group_management_token();
    loop {
        let returned = store
            .compare_set(&key, b"", token.as_bytes())
            .map_err(store_error("compare_set", &key))?;
        match token_step(keys, token, &returned) {
            TokenStep::Acquired => return Ok(()),
            TokenStep::WaitFor { key: wait } => {
                store
                    .wait(&[&wait], None)
                    .map_err(store_error("wait", &wait))?;
                if wait == key {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
}

/// `_group_membership_management`'s release.
fn release_token(store: &dyn Store, keys: &RpcKeys, token: &str) -> Result<(), RpcError> {
    let key = keys.group_management_token();
    store.set(&key, b"").map_err(store_error("set", &key))?;
    let done = keys.token_done(token);
    store
        .set(&done, TOKEN_DONE)
        .map_err(store_error("set", &done))
}

/// The handler names of the dynamic group's membership updates.
const RESERVED_PREFIX: &str = "__rdzv_";

/// `_update_group_membership` for joins and leaves, as handlers that hold the agent
/// weakly (the agent owns its handlers).
fn register_membership_handlers(shared: &Arc<Shared>) {
    let weak = Arc::downgrade(shared);
    let join = move |_: &super::CallContext, m: Message| -> Result<Message, String> {
        let shared = weak.upgrade().ok_or("the agent is gone")?;
        let JoinAnnouncement {
            name,
            id,
            address,
            devices,
        } = JoinAnnouncement::decode(&m.payload)?;
        let me = shared.me.name().to_string();
        let reverse = create_reverse_mapping(&me, std::slice::from_ref(&devices));
        let mut group = shared.group_mut();
        group.peers.insert(
            name.clone(),
            Peer {
                id: WorkerId::from(id),
                address,
            },
        );
        if let Some(map) = reverse.get(&name) {
            group.reverse_device_maps.insert(name, map.clone());
        }
        Ok(Message::default())
    };
    let weak = Arc::downgrade(shared);
    let leave = move |_: &super::CallContext, m: Message| -> Result<Message, String> {
        let shared = weak.upgrade().ok_or("the agent is gone")?;
        let name = decode_leave(&m.payload)?.to_string();
        let mut group = shared.group_mut();
        group.peers.remove(&name);
        let kept: DeviceMaps = group
            .reverse_device_maps
            .iter()
            .filter(|(peer, _)| *peer != name)
            .map(|(peer, map)| (peer.to_string(), map.clone()))
            .collect();
        group.reverse_device_maps = kept;
        Ok(Message::default())
    };
    let mut handlers = shared.handlers.write().unwrap_or_else(|p| p.into_inner());
    handlers.insert(GROUP_JOIN.to_string(), Arc::new(join));
    handlers.insert(GROUP_LEAVE.to_string(), Arc::new(leave));
}

fn spawn_pool(
    shared: &Arc<Shared>,
    jobs: Receiver<Job>,
    threads: usize,
) -> Result<Vec<JoinHandle<()>>, RpcError> {
    let jobs = Arc::new(Mutex::new(jobs));
    let mut handles = Vec::with_capacity(threads);
    for index in 0..threads {
        let jobs = Arc::clone(&jobs);
        let shared = Arc::clone(shared);
        let handle = std::thread::Builder::new()
            .name(format!("rdzv-rpc-worker-{index}"))
            .spawn(move || loop {
                let job = {
                    let receiver = jobs.lock().unwrap_or_else(|p| p.into_inner());
                    receiver.recv()
                };
                let Ok(job) = job else { return };
                run_job(&shared, job);
            })
            .map_err(|e| RpcError::Executor(format!("worker thread: {e}")))?;
        handles.push(handle);
    }
    Ok(handles)
}

fn run_job(shared: &Shared, job: Job) {
    let Some(job) = super::rref::take_fetch(shared, job) else {
        return;
    };
    {
        let mut calls = shared.lock_calls();
        calls.metrics.num_idle_threads = calls.metrics.num_idle_threads.saturating_sub(1);
    }
    let Job {
        responder,
        ctx,
        message,
        tensors,
    } = job;
    // Out-of-band tensors are read here, off the I/O thread, before the handler runs.
    let result = match (tensors.pull(), shared.handler(&ctx.handler)) {
        (Err(e), _) => Err(e.to_string()),
        (Ok(tensors), Some(handler)) => {
            run_handler(handler.as_ref(), &ctx, Message { tensors, ..message })
        }
        (Ok(_), None) => Err(format!(
            "no RPC handler named {} is registered on worker {}; register it before peers call it",
            ctx.handler,
            shared.me.name()
        )),
    };
    {
        let mut calls = shared.lock_calls();
        calls.metrics.calls.server_call_finished(false);
        calls.metrics.num_idle_threads = calls.metrics.num_idle_threads.saturating_add(1);
    }
    responder.respond(shared, ctx.message_id, result);
}

/// `Some(reason)` when this host refuses io_uring, which the I/O thread's glommio
/// executor needs (glommio panics there rather than returning an error): the store
/// server falls back to epoll on such hosts, the agent's I/O thread has no fallback yet.
fn io_uring_refused() -> Option<String> {
    match crate::server::io_mode::probe_io_uring() {
        Ok(Err(refusal)) => Some(format!(
            "the RPC agent's I/O thread runs on io_uring, and this host refuses it ({}); \
             allow io_uring_setup (e.g. a seccomp profile that permits it) to run the agent \
             here; unlike the store server (`--io epoll`), the agent has no epoll fallback yet",
            refusal.0
        )),
        _ => None,
    }
}

fn spawn_io(
    shared: &Arc<Shared>,
    transports: Vec<Box<dyn Transport + Send>>,
    jobs: std::sync::mpsc::Sender<Job>,
) -> Result<(JoinHandle<()>, String), RpcError> {
    if let Some(reason) = io_uring_refused() {
        return Err(RpcError::Executor(reason));
    }
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<String, RpcError>>();
    let shared = Arc::clone(shared);
    let name = format!("rdzv-rpc-io-{}", shared.me.name());
    let handle = std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            mark_io_thread();
            let built = LocalExecutorBuilder::new(Placement::Unbound)
                .name(&name)
                .io_memory(1 << 20)
                .make();
            let executor = match built {
                Ok(executor) => executor,
                Err(e) => {
                    let _ = ready_tx.send(Err(RpcError::Executor(e.to_string())));
                    return;
                }
            };
            executor.run(async move {
                let mut listeners = Vec::with_capacity(transports.len());
                for transport in &transports {
                    match transport.listen() {
                        Ok(listener) => listeners.push(listener),
                        Err(e) => {
                            let _ = ready_tx.send(Err(RpcError::from(e)));
                            return;
                        }
                    }
                }
                let address = join_addresses(listeners.iter().map(|l| l.address()));
                let _ = ready_tx.send(Ok(address));
                let transports = transports
                    .into_iter()
                    .map(|t| -> Box<dyn Transport> { t })
                    .collect();
                Io::run(shared, transports, listeners, jobs).await;
            });
        })
        .map_err(|e| RpcError::Executor(e.to_string()))?;
    match ready_rx.recv() {
        Ok(Ok(address)) => Ok((handle, address)),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => {
            let _ = handle.join();
            Err(RpcError::Executor(
                "the I/O thread exited during start".into(),
            ))
        }
    }
}

impl RpcAgent {
    /// This worker.
    pub fn worker_info(&self) -> &WorkerInfo {
        &self.shared.me
    }

    /// The group's size.
    pub fn world_size(&self) -> Option<u32> {
        self.shared.world_size
    }

    /// The address peers reach this worker at: its listeners' addresses, highest
    /// priority first, joined by `;` (`shm://@name;tcp://ip:port`).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Every member of the group, this worker included, in id order.
    pub fn worker_infos(&self) -> Vec<WorkerInfo> {
        let mut infos: Vec<WorkerInfo> = self
            .shared
            .group()
            .peers
            .iter()
            .filter_map(|(name, peer)| WorkerInfo::with_id(name, peer.id).ok())
            .collect();
        infos.sort_by_key(|w| w.id().get());
        infos
    }

    /// Registers `handler` under `name`; peers calling `name` before this get an error.
    ///
    /// # Errors
    /// [`RpcError::HandlerExists`] if the name is taken (names starting with `__rdzv_`
    /// are the agent's own).
    pub fn register_handler(&self, name: &str, handler: impl Handler) -> Result<(), RpcError> {
        let mut handlers = self
            .shared
            .handlers
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if handlers.contains_key(name) || name.starts_with(RESERVED_PREFIX) {
            return Err(RpcError::HandlerExists {
                name: name.to_string(),
            });
        }
        handlers.insert(name.to_string(), Arc::new(handler));
        Ok(())
    }

    /// A handle that makes calls through this agent, for other threads and for
    /// handlers (see [`CallContext::client`](super::CallContext::client)).
    pub fn client(&self) -> RpcClient {
        self.client.clone()
    }

    /// [`RpcClient::rpc_async`].
    pub fn rpc_async(&self, to: &str, handler: &str, message: Message) -> RpcFuture {
        self.client.rpc_async(to, handler, message)
    }

    /// [`RpcClient::rpc_async_with_timeout`].
    pub fn rpc_async_with_timeout(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> RpcFuture {
        self.client
            .rpc_async_with_timeout(to, handler, message, timeout)
    }

    /// [`RpcClient::rpc_sync`].
    ///
    /// # Errors
    /// As the future of [`rpc_async`](Self::rpc_async).
    pub fn rpc_sync(&self, to: &str, handler: &str, message: Message) -> Result<Message, RpcError> {
        self.client.rpc_sync(to, handler, message)
    }

    /// [`RpcClient::rpc_sync_with_timeout`].
    ///
    /// # Errors
    /// As the future of [`rpc_async`](Self::rpc_async).
    pub fn rpc_sync_with_timeout(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<Message, RpcError> {
        self.client
            .rpc_sync_with_timeout(to, handler, message, timeout)
    }

    /// [`RpcClient::remote`]: an [`RRef`](super::RRef) to the handler's result on `to`.
    ///
    /// # Errors
    /// [`RpcError::UnknownWorker`], at once.
    pub fn remote(
        &self,
        to: &str,
        handler: &str,
        message: Message,
    ) -> Result<super::RRef, RpcError> {
        self.client.remote(to, handler, message)
    }

    /// The transport that the last pipe this worker opened to `peer` runs on (`shm`
    /// between workers on one host unless `transports` leaves it out, else `tcp`);
    /// `None` before the first call to `peer`.
    pub fn pipe_transport(&self, peer: &str) -> Option<TransportKind> {
        self.shared.lock_calls().pipe_transports.get(peer).copied()
    }

    /// The channel that the last pipe this worker opened to `peer` uses for CPU tensors
    /// of at least [`RpcOptions::min_channel_bytes`] (`xth` within one process, `cma`
    /// between processes of one host that pass its checks, else `basic`); `None` before
    /// the first call to `peer`, or when no channel serves CPU tensors on that pipe.
    pub fn pipe_channel(&self, peer: &str) -> Option<ChannelKind> {
        self.shared
            .lock_calls()
            .pipe_channels
            .get(peer)
            .copied()
            .flatten()
    }

    /// Tensor bytes this worker has sent (in requests and responses) per channel, for
    /// every channel that moved any.
    pub fn tensor_bytes_by_channel(&self) -> Vec<(ChannelKind, u64)> {
        self.shared.lock_calls().channel_bytes.iter().collect()
    }

    /// `get_metrics()`: PyTorch's agent keys (`agent.client_active_calls`,
    /// `agent.server_active_calls`, ...) with their values as text, in a fixed order.
    pub fn get_metrics(&self) -> Vec<(String, String)> {
        let calls = self.shared.lock_calls();
        calls
            .metrics
            .metrics()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect()
    }

    /// Per-peer network data: calls made to each peer, bytes sent and received, errors.
    pub fn network_data(&self) -> NetworkData {
        self.shared.lock_calls().network.clone()
    }

    /// PyTorch's `wait_until_node_failure` test helper: probes `peer` every 100 ms until
    /// a call to it fails for a reason other than the handler (broken pipe, refused
    /// connection, timeout) and returns that error; `None` if `peer` still answers after
    /// `timeout`.
    pub fn wait_until_node_failure(&self, peer: &str, timeout: Duration) -> Option<RpcError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            // No handler has this name: an answer (a remote error) means `peer` is alive.
            match self.rpc_sync_with_timeout(peer, NODE_PROBE, Message::default(), Some(left)) {
                Ok(_) | Err(RpcError::Remote { .. }) => {}
                Err(e) => return Some(e),
            }
            std::thread::sleep(NODE_PROBE_INTERVAL.min(left));
        }
    }

    /// PyTorch's `wait_until_pending_futures_and_users_flushed` test helper: waits until
    /// this worker has no call in flight.
    ///
    /// # Errors
    /// [`RpcError::FlushTimeout`] naming the calls left after `timeout`.
    pub fn wait_until_pending_futures_flushed(&self, timeout: Duration) -> Result<(), RpcError> {
        let mut calls = self.shared.lock_calls();
        calls.waiters += 1;
        let (mut calls, _) = self
            .shared
            .calls_changed
            .wait_timeout_while(calls, timeout, |c| c.metrics.calls.client_active() > 0)
            .unwrap_or_else(|p| p.into_inner());
        calls.waiters -= 1;
        match calls.metrics.calls.client_active() {
            0 => Ok(()),
            pending => Err(RpcError::FlushTimeout { pending }),
        }
    }

    /// Closes every pipe now (e.g. after a network change): calls in flight on them fail
    /// with [`RpcError::PipeBroken`], and the next call to each peer opens a new pipe.
    pub fn reset_pipes(&self) {
        let _ = self.shared.mailbox.push(Command::ResetPipes);
    }

    /// Graceful shutdown: `shutdown(true)`.
    ///
    /// # Errors
    /// As [`shutdown`](Self::shutdown).
    pub fn join(&self) -> Result<(), RpcError> {
        self.shutdown(true)
    }

    /// `rpc.shutdown(graceful)`. Graceful: settle this worker's RRefs first (wait until
    /// its users are confirmed, release them, report leaks by owner: see
    /// [`rref_shutdown_report`](Self::rref_shutdown_report)); wait until this worker has no calls in flight,
    /// then run the store barriers that sum every worker's in-flight calls until the
    /// total is zero (the core's `join` protocol), then say goodbye on every pipe and
    /// close. Not graceful: close at once. Either way every pending future fails with
    /// [`RpcError::ShutDown`] rather than hang. Calling it again does nothing.
    ///
    /// # Errors
    /// [`RpcError::Store`] or [`RpcError::Join`] if the graceful protocol fails; the
    /// agent is closed anyway.
    pub fn shutdown(&self, graceful: bool) -> Result<(), RpcError> {
        let running = self
            .io_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if !running {
            return Ok(());
        }
        let protocol = if graceful {
            super::rref::settle_for_join(&self.shared);
            self.run_join()
        } else {
            Ok(())
        };
        self.close(graceful && protocol.is_ok());
        protocol
    }

    fn close(&self, goodbye: bool) {
        let _ = self.shared.mailbox.push(Command::Close { goodbye });
        let io = self
            .io_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(io) = io {
            let _ = io.join();
        }
        if let Some(mpt) = &self.shared.mpt {
            mpt.listener.close();
        }
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        if goodbye {
            // Every call in the group is over: the pool's threads exit at once.
            for worker in workers {
                let _ = worker.join();
            }
        }
        // Otherwise a handler may still be running; its thread exits when it returns.
    }

    fn run_join(&self) -> Result<(), RpcError> {
        let first = *self
            .next_barrier_id
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(world_size) = self.shared.world_size else {
            return self.run_leave();
        };
        let mut join = Join::new(self.keys.clone(), world_size, first, true);
        let result = self.drive_join(&mut join);
        *self
            .next_barrier_id
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = join.next_barrier_id();
        if result.is_err() {
            self.release_calls();
        }
        result
    }

    fn release_calls(&self) {
        let mut calls = self.shared.lock_calls();
        calls.frozen = false;
        for _ in 0..std::mem::take(&mut calls.deferred_finishes) {
            calls.metrics.calls.client_call_finished();
        }
        drop(calls);
        self.shared.calls_changed.notify_all();
    }

    /// A dynamic member's graceful leave, under the group token: tell every other
    /// member, then the core's `Leave` (no calls in flight, unlist, mark shutting down).
    fn run_leave(&self) -> Result<(), RpcError> {
        let me = self.shared.me.clone();
        let token = membership_token(me.name(), Membership::Leave);
        acquire_token(&*self.store, &self.keys, &token)?;
        let left = (|| {
            let others: Vec<String> = self
                .shared
                .group()
                .peers
                .keys()
                .filter(|name| name.as_str() != me.name())
                .cloned()
                .collect();
            for name in others {
                self.rpc_sync(
                    &name,
                    GROUP_LEAVE,
                    Message::from_payload(me.name().as_bytes().to_vec()),
                )?;
            }
            let mut leave = Leave::new(&self.keys, me.clone());
            self.drive_join(&mut leave)
        })();
        if left.is_err() {
            self.release_calls();
        }
        release_token(&*self.store, &self.keys, &token).and(left)
    }

    fn drive_join(&self, join: &mut impl Protocol) -> Result<(), RpcError> {
        enum Done {
            NoClientCalls,
            Held(u32),
            Released,
            Marked,
            Added(i64),
            Set,
            Waited,
            Got(Vec<u8>),
        }
        let name = self.shared.me.name().to_string();
        loop {
            let done = match join.poll_action() {
                Action::AwaitNoClientCalls => {
                    let mut calls = self.shared.lock_calls();
                    while calls.metrics.calls.client_active() > 0 {
                        calls = self.shared.wait_calls_changed(calls);
                    }
                    Done::NoClientCalls
                }
                Action::HoldClientCalls => {
                    let mut calls = self.shared.lock_calls();
                    calls.frozen = true;
                    Done::Held(calls.metrics.calls.client_active())
                }
                Action::ReleaseClientCalls => {
                    self.release_calls();
                    Done::Released
                }
                Action::MarkShuttingDown => {
                    self.shared.lock_calls().shutting_down = true;
                    Done::Marked
                }
                Action::StoreAdd { key, delta } => Done::Added(
                    self.store
                        .add(key, delta)
                        .map_err(store_error("add", key))?,
                ),
                Action::StoreSet { key, value } => {
                    self.store
                        .set(key, value)
                        .map_err(store_error("set", key))?;
                    Done::Set
                }
                Action::StoreWait { key } => {
                    self.store
                        .wait(&[key], None)
                        .map_err(store_error("wait", key))?;
                    Done::Waited
                }
                Action::StoreGet { key } => {
                    Done::Got(self.store.get(key).map_err(store_error("get", key))?)
                }
                Action::Done => return Ok(()),
                Action::Failed => {
                    return Err(match join.error() {
                        Some(e) => RpcError::Join {
                            name,
                            source: Box::new(e.clone()),
                        },
                        None => RpcError::ShutDown { name },
                    })
                }
            };
            let outcome = match &done {
                Done::NoClientCalls => Outcome::NoClientCalls,
                Done::Held(n) => Outcome::ClientCallsHeld(*n),
                Done::Released => Outcome::Released,
                Done::Marked => Outcome::MarkedShuttingDown,
                Done::Added(v) => Outcome::Added(*v),
                Done::Set => Outcome::Set,
                Done::Waited => Outcome::Waited,
                Done::Got(v) => Outcome::Got(v),
            };
            join.handle(outcome).map_err(|source| RpcError::Join {
                name: name.clone(),
                source: Box::new(source),
            })?;
        }
    }
}

/// The two shutdown machines of the core, driven alike.
trait Protocol {
    fn poll_action(&self) -> Action<'_>;
    fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), JoinError>;
    fn error(&self) -> Option<&JoinError>;
}

impl Protocol for Join {
    fn poll_action(&self) -> Action<'_> {
        Join::poll_action(self)
    }
    fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), JoinError> {
        Join::handle(self, outcome)
    }
    fn error(&self) -> Option<&JoinError> {
        Join::error(self)
    }
}

impl Protocol for Leave {
    fn poll_action(&self) -> Action<'_> {
        Leave::poll_action(self)
    }
    fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), JoinError> {
        Leave::handle(self, outcome)
    }
    fn error(&self) -> Option<&JoinError> {
        Leave::error(self)
    }
}

impl Drop for RpcAgent {
    fn drop(&mut self) {
        let running = self
            .io_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if running {
            self.close(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The transports `rank` offers (with `basic` as the only channel), as `init_rpc`
    /// reports them.
    fn ranked_transports(
        names: Option<&[String]>,
        shm_viable: Result<(), &str>,
        plugins: &[(TransportKind, Option<&str>)],
    ) -> Result<Vec<(TransportKind, i64)>, RpcError> {
        let mut here = vec![(TransportKind::Shm, shm_viable.map_err(str::to_string))];
        here.extend(
            plugins
                .iter()
                .map(|&(kind, reason)| (kind, reason.map_or(Ok(()), |r| Err(r.to_string())))),
        );
        here.push((TransportKind::Tcp, Ok(())));
        let basic = ["basic".to_string()];
        rank(
            names,
            Some(&basic[..]),
            &here,
            &super::super::channels::RUNNABLE,
            Ok::<_, String>,
        )
        .map(|offer| offer.transports)
        .map_err(rank_error)
    }

    /// The channels `rank` offers (over tcp), as `init_rpc` reports them.
    fn ranked_channels(
        names: Option<&[String]>,
        viability: impl Fn(ChannelKind) -> Result<String, String>,
    ) -> Result<Vec<(ChannelKind, i64, String)>, RpcError> {
        let here = [(TransportKind::Tcp, Ok(()))];
        rank(
            None,
            names,
            &here,
            &super::super::channels::RUNNABLE,
            viability,
        )
        .map(|offer| offer.channels)
        .map_err(rank_error)
    }

    #[test]
    fn transports_option() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let viable = Ok(());
        // By default shm comes first where it works (TensorPipe's priorities).
        assert!(matches!(
            ranked_transports(None, viable, &[]).as_deref(),
            Ok([(TransportKind::Shm, _), (TransportKind::Tcp, 0)])
        ));
        assert!(matches!(
            ranked_transports(None, Err("no memfd here"), &[]).as_deref(),
            Ok([(TransportKind::Tcp, 0)])
        ));
        assert!(matches!(
            ranked_transports(Some(&names(&["uv"])), viable, &[]).as_deref(),
            Ok([(TransportKind::Tcp, 0)])
        ));
        assert!(matches!(
            ranked_transports(Some(&names(&["tcp", "shm"])), viable, &[]).as_deref(),
            Ok([(TransportKind::Tcp, _), (TransportKind::Shm, _)])
        ));
        assert!(matches!(
            ranked_transports(Some(&names(&["shm"])), viable, &[]).as_deref(),
            Ok([(TransportKind::Shm, _)])
        ));
        let unknown = ranked_transports(Some(&names(&["carrier-pigeon"])), viable, &[]);
        assert!(matches!(unknown, Err(RpcError::Backends { .. })));
        let text = unknown.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("carrier-pigeon"), "{text}");
        assert!(matches!(
            ranked_transports(Some(&names(&["ibv", "tcp"])), viable, &[]),
            Err(RpcError::InvalidOption { .. })
        ));
        assert!(matches!(
            ranked_transports(Some(&names(&[])), viable, &[]),
            Err(RpcError::InvalidOption { .. })
        ));
    }

    #[test]
    fn shm_that_is_not_viable_is_not_offered() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let not_viable = Err("no /proc/sys/kernel/random/boot_id");
        assert!(matches!(
            ranked_transports(None, not_viable, &[]).as_deref(),
            Ok([(TransportKind::Tcp, 0)])
        ));
        assert!(matches!(
            ranked_transports(Some(&names(&["shm", "tcp"])), not_viable, &[]).as_deref(),
            Ok([(TransportKind::Tcp, _)])
        ));
        let only_shm = ranked_transports(Some(&names(&["shm"])), not_viable, &[]);
        let text = only_shm.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("no transport left"), "{text}");
        assert!(text.contains("boot_id"), "{text}");
    }

    struct FakePlugin(TransportKind, Result<(), &'static str>);

    impl TransportPlugin for FakePlugin {
        fn kind(&self) -> TransportKind {
            self.0
        }

        fn open(&self, host: IpAddr) -> Result<Box<dyn Transport + Send>, String> {
            self.1.map_err(str::to_string)?;
            Ok(Box::new(TcpTransport::new(host)))
        }
    }

    #[test]
    fn plugged_in_transports_count_as_implemented() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ibv = [(TransportKind::Ibv, None)];
        assert!(matches!(
            ranked_transports(Some(&names(&["ibv", "tcp"])), Ok(()), &ibv).as_deref(),
            Ok([(TransportKind::Ibv, _), (TransportKind::Tcp, _)])
        ));
        assert!(matches!(
            ranked_transports(None, Ok(()), &ibv).as_deref(),
            Ok([
                (TransportKind::Shm, 200),
                (TransportKind::Ibv, 100),
                (TransportKind::Tcp, 0)
            ])
        ));
        let not_viable = [(TransportKind::Ibv, Some("no verbs here"))];
        assert!(matches!(
            ranked_transports(Some(&names(&["ibv", "tcp"])), Ok(()), &not_viable).as_deref(),
            Ok([(TransportKind::Tcp, _)])
        ));
        let only_ibv = ranked_transports(Some(&names(&["ibv"])), Ok(()), &not_viable);
        let text = only_ibv.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("no transport left: no verbs here"), "{text}");
    }

    #[test]
    fn plugins_are_opened_when_listed() {
        let mut options = RpcOptions::new("file:///nonexistent");
        options.listen_host = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        options.transport_plugins = vec![
            Arc::new(FakePlugin(TransportKind::Ibv, Err("no verbs here"))),
            Arc::new(FakePlugin(TransportKind::Ibv, Ok(()))),
        ];
        let debug = format!("{options:?}");
        assert!(debug.contains("transport_plugins: [Ibv, Ibv]"), "{debug}");
        // The first plugin of a kind wins.
        let opened = open_plugins(&options).unwrap_or_default();
        assert!(matches!(
            opened.as_slice(),
            [(TransportKind::Ibv, Err(reason))] if reason == "no verbs here"
        ));
        options.transports = Some(vec!["tcp".into()]);
        assert!(open_plugins(&options).is_ok_and(|o| o.is_empty()));
        options.transports = Some(vec!["ibv".into(), "tcp".into()]);
        options.transport_plugins = vec![Arc::new(FakePlugin(TransportKind::Ibv, Ok(())))];
        assert!(open_plugins(&options)
            .is_ok_and(|o| matches!(o.as_slice(), [(TransportKind::Ibv, Ok(_))])));
        options.transport_plugins = vec![Arc::new(FakePlugin(TransportKind::Tcp, Ok(())))];
        assert!(matches!(
            open_plugins(&options),
            Err(RpcError::InvalidOption {
                option: "transport_plugins",
                ..
            })
        ));
    }

    #[test]
    fn channels_option() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let viable = |kind: ChannelKind| Ok(format!("{kind}:here"));
        let kinds = |r: Result<Vec<(ChannelKind, i64, String)>, RpcError>| {
            r.map(|v| v.into_iter().map(|(k, p, _)| (k, p)).collect::<Vec<_>>())
        };
        assert!(matches!(
            kinds(ranked_channels(None, viable)).as_deref(),
            Ok([
                (ChannelKind::Xth, 1300),
                (ChannelKind::Cma, 1200),
                (ChannelKind::Mpt, 1100),
                (ChannelKind::Basic, 1000),
                (ChannelKind::CudaXth, 400),
                (ChannelKind::CudaIpc, 300),
                (ChannelKind::CudaGdr, 200),
                (ChannelKind::CudaBasic, 0)
            ])
        ));
        assert!(matches!(
            kinds(ranked_channels(Some(&names(&["basic"])), viable)).as_deref(),
            Ok([(ChannelKind::Basic, 0)])
        ));
        assert!(matches!(
            kinds(ranked_channels(Some(&names(&["cma", "basic"])), viable)).as_deref(),
            Ok([(ChannelKind::Cma, 1), (ChannelKind::Basic, 0)])
        ));
        assert!(matches!(
            ranked_channels(Some(&names(&["basic", "basic"])), viable),
            Err(RpcError::Backends { .. })
        ));
        // Unknown names, and channels this build does not run, are errors.
        assert!(matches!(
            ranked_channels(Some(&names(&["carrier-pigeon"])), viable),
            Err(RpcError::Backends { .. })
        ));
        let unknown = ranked_channels(Some(&names(&["cuda_magic", "basic"])), viable);
        assert!(matches!(unknown, Err(RpcError::Backends { .. })));
        // A channel that cannot work here is left out; if nothing is left, that is an
        // error that says why.
        let no_cma = |kind: ChannelKind| match kind {
            ChannelKind::Cma => Err("cma channel not viable: ptrace_scope is 3".to_string()),
            other => Ok(format!("{other}:here")),
        };
        assert!(matches!(
            kinds(ranked_channels(None, no_cma)).as_deref(),
            Ok([
                (ChannelKind::Xth, _),
                (ChannelKind::Mpt, _),
                (ChannelKind::Basic, _),
                (ChannelKind::CudaXth, _),
                (ChannelKind::CudaIpc, _),
                (ChannelKind::CudaGdr, _),
                (ChannelKind::CudaBasic, _)
            ])
        ));
        let only_cma = ranked_channels(Some(&names(&["cma"])), no_cma);
        let text = only_cma.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("no channel left"), "{text}");
        assert!(text.contains("ptrace_scope is 3"), "{text}");
        // Descriptors come from the viability check.
        let offered = ranked_channels(Some(&names(&["xth"])), viable).unwrap_or_default();
        assert_eq!(offered, vec![(ChannelKind::Xth, 0, "xth:here".to_string())]);
    }

    #[test]
    fn check_gives_the_error_init_rpc_gives() {
        let bad: [fn(&mut RpcOptions); 7] = [
            |o| o.channels = Some(vec!["carrier-pigeon".into()]),
            |o| o.transports = Some(vec!["ibv".into()]),
            |o| o.transports = Some(Vec::new()),
            |o| o.channels = Some(vec!["cuda_ipc".into()]),
            |o| o.num_worker_threads = 0,
            |o| o.mpt_lanes = 0,
            |o| {
                o.transports = Some(vec!["shm".into()]);
                o.channels = Some(vec!["mpt".into()]);
            },
        ];
        for (i, spoil) in bad.iter().enumerate() {
            let mut options = RpcOptions::new("file:///nonexistent");
            options.listen_host = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
            spoil(&mut options);
            let checked = options.check().map(|_| ()).map_err(|e| e.to_string());
            let started = init_rpc("w", 0, Some(1), options)
                .map(|_| ())
                .map_err(|e| e.to_string());
            assert!(checked.is_err(), "case {i}: check passed");
            assert_eq!(checked, started, "case {i}");
        }
        let reserved = RpcOptions::new("file:///nonexistent").with_handler(
            "__rdzv_group_join",
            |_: &super::super::CallContext, m: Message| -> Result<Message, String> { Ok(m) },
        );
        assert!(matches!(
            reserved.check(),
            Err(RpcError::HandlerExists { .. })
        ));
    }

    #[test]
    fn check_offers_what_is_viable_by_priority() {
        let mut options = RpcOptions::new("file:///nonexistent");
        options.listen_host = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let offer = options
            .check()
            .unwrap_or_else(|e| panic!("default options: {e}"));
        assert_eq!(offer.transports.last(), Some(&(TransportKind::Tcp, 0)));
        assert!(offer
            .channels
            .iter()
            .any(|(k, _, d)| *k == ChannelKind::Basic && !d.is_empty()));
        for pair in offer.channels.windows(2) {
            assert!(pair[0].1 > pair[1].1, "{:?}", offer.channels);
        }
        // No CUDA runtime was given: the lending CUDA channels are refused, saying why.
        assert!(offer.refused.iter().any(|r| {
            r.backend == rdzv_core::negotiate::Refusable::Channel(ChannelKind::CudaIpc)
                && r.reason.contains("CUDA")
        }));
        options.transports = Some(vec!["tcp".into()]);
        options.channels = Some(vec!["mpt".into(), "basic".into()]);
        let offer = options.check().unwrap_or_else(|e| panic!("tcp, mpt: {e}"));
        assert_eq!(offer.transports, vec![(TransportKind::Tcp, 0)]);
        assert_eq!(
            offer
                .channels
                .iter()
                .map(|&(k, p, _)| (k, p))
                .collect::<Vec<_>>(),
            vec![(ChannelKind::Mpt, 1), (ChannelKind::Basic, 0)]
        );
    }

    #[test]
    fn bad_names_and_ranks_fail_before_any_io() {
        let bad = init_rpc(
            "no spaces",
            0,
            Some(1),
            RpcOptions::new("file:///nonexistent"),
        );
        assert!(matches!(bad, Err(RpcError::InvalidWorker(_))));
        let bad = init_rpc("w", 2, Some(2), RpcOptions::new("file:///nonexistent"));
        assert!(matches!(
            bad,
            Err(RpcError::InvalidOption { option: "rank", .. })
        ));
        let reserved = RpcOptions::new("file:///nonexistent").with_handler(
            "__rdzv_group_join",
            |_: &super::super::CallContext, m: Message| -> Result<Message, String> { Ok(m) },
        );
        let bad = init_rpc("w", 0, Some(1), reserved);
        assert!(matches!(bad, Err(RpcError::HandlerExists { .. })));
    }
}
