//! [`RpcOptions`]: what [`init_rpc`](super::init_rpc) is given, and the handler names
//! the agent keeps for itself. Checking and probing them is `startup::probe`'s.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use rdzv_core::device::Device;
use rdzv_core::device_map::DeviceMaps;

use crate::rpc::device::DevicePlugin;
use crate::rpc::handler::Handler;
use crate::rpc::message::{default_wait_spin, Message};
use crate::rpc::transport::TransportPlugin;

/// PyTorch's default handler pool size (`numWorkerThreads`).
pub const DEFAULT_NUM_WORKER_THREADS: usize = 16;

/// The options of [`init_rpc`](crate::rpc::init_rpc) (PyTorch's
/// `TensorPipeRpcBackendOptions`).
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
    /// `vec![rdzv_rdma::ibv::transport::IbvPlugin::default().into()]`. A plugin that is
    /// not viable here is left out with its reason logged. Default: none.
    pub transport_plugins: Vec<TransportPlugin>,
    /// Device runtimes built outside this crate, e.g. `rdzv_rdma`'s CUDA one:
    /// `vec![Arc::new(rdzv_rdma::cuda::agent::CudaPlugin)]`. With one, tensors in device
    /// memory ([`Tensor::on_device`](super::Tensor::on_device)) move over `cuda_xth`,
    /// `cuda_ipc`, `cuda_gdr` or `cuda_basic` (see [`super::device`]). A runtime that
    /// cannot open here (no driver, no GPU) is left out with its reason logged. Default:
    /// none.
    pub device_plugins: Vec<Arc<dyn DevicePlugin>>,
    /// The channels to register, highest priority first; `None` for every channel this
    /// build runs (`xth`, `cma`, `mpt`, `basic`, `cuda_xth`, `cuda_ipc`, `cuda_gdr`,
    /// `cuda_basic`). Unknown names are errors; a channel that cannot work in this
    /// process (cma under a seccomp policy or Yama `ptrace_scope` 3, `cuda_ipc` without a
    /// CUDA runtime that runs it, ...) is left out with its reason
    /// logged, and so is `mpt` when this worker runs no tcp transport.
    pub channels: Option<Vec<String>>,
    /// How many extra TCP connections a pipe that negotiated `mpt` opens, 1 to
    /// 64; a tensor is split evenly over up to this many, in stripes of at least 1 MiB.
    /// Default
    /// [`DEFAULT_MPT_CONNECTIONS`](crate::rpc::DEFAULT_MPT_CONNECTIONS).
    pub mpt_connections: u16,
    /// Tensors smaller than this many bytes travel inline in the pipe's frames (the
    /// `basic` channel) even where `cma`, `xth` or `mpt` was negotiated. Default
    /// [`DEFAULT_MIN_CHANNEL_BYTES`](crate::rpc::tensors::DEFAULT_MIN_CHANNEL_BYTES).
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
    /// How long a thread blocked in [`RpcFuture::wait`](crate::rpc::RpcFuture::wait) (and
    /// `rpc_sync`) spins before it sleeps: a reply that arrives meanwhile costs no wake-up.
    /// Default 50 µs on hosts with two or more CPUs, zero on one; set zero where threads
    /// outnumber CPUs.
    pub wait_spin: Duration,
    /// How RRef control messages (`RREF_FORK_REQUEST`, `RREF_CHILD_ACCEPT`,
    /// `RREF_USER_DELETE`) are retried: PyTorch's `RpcRetryOptions` (1 s, backoff 1.5,
    /// 5 retries). A graceful `join` waits for RRefs at most this long twice over.
    pub rref_retry: rdzv_core::rpc::rref::RetryOptions,
    /// Called with an owner's value when the agent lets go of it (every reference to
    /// its RRef is gone, or none was left when its `remote()` handler finished), so that
    /// a binding keeping state beside the value (Python's live objects) can drop it. It
    /// runs on the thread that released the value (an agent thread, outside the RRef
    /// runtime's lock): it must return at once. Default: none.
    pub on_value_released: Option<ValueReleased>,
    /// How this worker's peers prove they belong to the group (and it to them), before
    /// any call they send is read. Default [`RpcSecret::Shared`].
    pub secret: RpcSecret,
    /// What a peer that connects to this worker gets before its handshake is done: how
    /// long it may take, and how many such peers may be waited on at once.
    pub inbound_handshakes: InboundHandshakes,
}

/// The limits on peers that connected but have not finished the pipe handshake: an
/// honest peer sends its hello at once after connecting and its proof at once after the
/// answer, so neither wait is long; a client that sends nothing, or dribbles its frames,
/// holds a waiting thread until `timeout` only. At most `max_in_flight` such peers are
/// waited on at once: beyond that the listener stops accepting (connections wait in the
/// kernel's backlog, nothing is refused) until one ends, so a flood of idle connections
/// can delay new pipes but cannot exhaust threads or memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboundHandshakes {
    /// How long the whole inbound handshake (hello, then proof) may take. Default 10 s.
    pub timeout: Duration,
    /// How many inbound handshakes may be in progress at once. Default 256.
    pub max_in_flight: usize,
}

impl Default for InboundHandshakes {
    fn default() -> Self {
        InboundHandshakes {
            timeout: Duration::from_secs(10),
            max_in_flight: 256,
        }
    }
}

/// The group secret of the pipe handshake ([`rdzv_core::rpc::auth`]): every worker of a
/// group must resolve the same one, or none.
#[derive(Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RpcSecret {
    /// `RDZV_RPC_SECRET` if set, else the contents of the file `RDZV_RPC_SECRET_FILE`,
    /// else a random secret that the group's first worker to start puts in the
    /// rendezvous store (`{prefix}/rpcGroupSecret`, by compare-set) and the others read:
    /// anyone who can read that store can then join, so protect the store (`--allow`,
    /// tokens) or give a secret.
    #[default]
    Shared,
    /// This secret, at least 16 bytes (the same on every worker).
    Given(Vec<u8>),
    /// No secret: peers prove nothing, as torch's do; a worker with a secret refuses
    /// this one and is refused by it.
    Disabled,
}

impl std::fmt::Debug for RpcSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RpcSecret::Shared => f.write_str("Shared"),
            RpcSecret::Given(secret) => write!(f, "Given(<{} bytes>)", secret.len()),
            RpcSecret::Disabled => f.write_str("Disabled"),
        }
    }
}

/// The type of [`RpcOptions::on_value_released`].
pub type ValueReleased = Arc<dyn Fn(Message) + Send + Sync>;

/// PyTorch's `FaultyTensorPipeAgent` for tests, keyed by handler name (rdzv's message type;
/// the agent's own RRef calls also by PyTorch's message-type names: `RREF_FORK_REQUEST`,
/// `RREF_CHILD_ACCEPT`, `RREF_USER_DELETE`, `REMOTE_RET`,
/// `PYTHON_REMOTE_CALL`/`SCRIPT_REMOTE_CALL`, `PYTHON_RREF_FETCH_CALL`/
/// `SCRIPT_RREF_FETCH_CALL`): the first `num_fail_sends` requests to each handler in
/// `fail_handlers` fail with "Send attempt failed intentionally for {handler}" instead of
/// being sent, and requests to a handler in `delays` are held that long before they are
/// sent. The default injects nothing.
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
            .field("mpt_connections", &self.mpt_connections)
            .field("device_maps", &self.device_maps)
            .field("devices", &self.devices)
            .field("device_count", &self.device_count)
            .field("listen_host", &self.listen_host)
            .field("init_counter", &self.init_counter)
            .field("fault_injection", &self.fault_injection)
            .field("rref_retry", &self.rref_retry)
            .field("on_value_released", &self.on_value_released.is_some())
            .field("secret", &self.secret)
            .field("inbound_handshakes", &self.inbound_handshakes)
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
            min_channel_bytes: crate::rpc::tensors::DEFAULT_MIN_CHANNEL_BYTES,
            mpt_connections: crate::rpc::DEFAULT_MPT_CONNECTIONS,
            device_maps: DeviceMaps::new(),
            devices: Vec::new(),
            device_count: 0,
            listen_host: None,
            init_counter: None,
            handlers: Vec::new(),
            fault_injection: FaultInjection::default(),
            wait_spin: default_wait_spin(),
            rref_retry: rdzv_core::rpc::rref::RetryOptions::default(),
            on_value_released: None,
            secret: RpcSecret::Shared,
            inbound_handshakes: InboundHandshakes::default(),
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

    /// These options plus a handler registered under `name`.
    pub fn with_handler(mut self, name: impl Into<String>, handler: impl Handler) -> RpcOptions {
        self.handlers.push((name.into(), Arc::new(handler)));
        self
    }
}

/// The handler names of the dynamic group's membership updates.
pub(crate) const RESERVED_PREFIX: &str = "__rdzv_";
