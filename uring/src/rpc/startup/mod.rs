//! [`init_rpc`]: the group's start-up through the store, up to a running [`RpcAgent`].
//! The protocols are the core's machines (`rdzv_core::rpc::startup::{StaticInit,
//! DynamicJoin}`), driven by `drive`; `static_init` and `dynamic` run them, `host` starts
//! the agent when they ask, `probe` checks the options first, `io_thread` starts the I/O
//! thread.
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

mod dynamic;
mod host;
mod io_thread;
pub(crate) mod probe;
mod secret;
mod static_init;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rdzv_core::device::DeviceType;
use rdzv_core::device_map::WorkerDevices;
use rdzv_core::negotiate::{ChannelKind, TransportKind};
use rdzv_core::rpc::name::WorkerInfo;
use rdzv_core::rpc::shutdown::JoinSequence;
use rdzv_core::rpc::store_keys::{
    check_static_group, membership_token, static_group_value, Membership, RpcKeys,
};
use rdzv_core::rpc::timeouts::RpcTimeout;

use self::dynamic::{join_dynamic, register_membership_handlers};
use self::io_thread::spawn_io;
use self::probe::{guess_host, probe, Probed};
use self::static_init::init_static;
use crate::rendezvous::{rendezvous_with, ProcessEnv, RendezvousOptions};
use crate::rpc::agent::RpcAgent;
use crate::rpc::calls::Calls;
use crate::rpc::client::{Caller, RpcClient};
use crate::rpc::counters::{Counters, JoinGate};
use crate::rpc::device::Devices;
use crate::rpc::dispatch::{CallIds, Dispatch};
use crate::rpc::drive::{acquire_token, release_token};
use crate::rpc::error::store_error;
use crate::rpc::error::{InitError, TransportError};
use crate::rpc::handler::Handler;
use crate::rpc::io::IoPieces;
use crate::rpc::lane::{self, Job, LaneContext, Lanes, Runner, Server, Slots, StallWatch};
use crate::rpc::mailbox::Mailbox;
use crate::rpc::mpt::MptSetup;
use crate::rpc::offer::OfferSpec;
use crate::rpc::options::RpcOptions;
use crate::rpc::outgoing::Framer;
use crate::rpc::pool::spawn_pool;
use crate::rpc::registry::Registry;
use crate::rpc::rref_runtime::{register_handlers as register_rref_handlers, RRefs};
use crate::rpc::shm_transport::ShmTransport;
use crate::rpc::tcp_transport::TcpTransport;
use crate::rpc::transport::Transport;
use crate::store::Store;
use rdzv_core::rendezvous::NodeParams;
use rdzv_core::rpc::address::join_addresses;

/// `_init_counter`: the `n` of `rpc_prefix_n`, counting `init_rpc` calls in the process.
static INIT_COUNTER: AtomicU64 = AtomicU64::new(0);

/// `rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)`:
/// joins the group and starts the agent. With a world size (static group) it blocks
/// until every worker of the group has started (a store barrier); without one it joins
/// a dynamic group (the rendezvous must allow that, e.g. `tcp://`).
///
/// # Errors
/// An [`InitError`]: [`InitError::InvalidWorker`] for a bad name or rank;
/// [`InitError::Offer`] / [`InitError::InvalidOption`] for unusable options (unknown
/// transport or channel names, no worker threads); [`InitError::DuplicateId`] for a
/// dynamic member whose rank is taken; [`InitError::Rendezvous`] and [`InitError::Store`]
/// when the store cannot be reached (these, and a start-up timeout, are
/// [`InitError::is_retryable`]); [`InitError::MixedGroup`], [`InitError::Names`]
/// (duplicate names) and [`InitError::DeviceMaps`] when the group is inconsistent;
/// [`InitError::Transport`] / [`InitError::Thread`] when listening fails;
/// [`InitError::Startup`] when other workers do not publish within the store timeout
/// (it names their ranks).
pub fn init_rpc(
    name: &str,
    rank: u32,
    world_size: Option<u32>,
    options: RpcOptions,
) -> Result<RpcAgent, InitError> {
    let me = WorkerInfo::new(name, i64::from(rank))
        .map_err(|e| InitError::InvalidWorker(Box::new(e)))?;
    if let Some(world_size) = world_size {
        if rank >= world_size {
            return Err(InitError::InvalidOption {
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
    .map_err(|source| InitError::Rendezvous {
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
    let secret = secret::group_secret(&options.secret, &*store, &keys)?;

    let start = Start {
        me,
        options,
        secret,
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
            acquire_token::<InitError>(&*start.store, &start.keys, &token, start.me.name())?;
            let (store, keys) = (Arc::clone(&start.store), start.keys.clone());
            let name = start.me.name().to_string();
            let joined = join_dynamic(start);
            release_token(&*store, &keys, &token, &name).and(joined)
        }
    }
}

/// What both kinds of group start from.
pub(super) struct Start {
    pub(super) me: WorkerInfo,
    pub(super) options: RpcOptions,
    /// The group secret peers prove (`None`: none, as torch's).
    pub(super) secret: Option<Arc<[u8]>>,
    pub(super) store: Arc<dyn Store>,
    pub(super) keys: RpcKeys,
    /// Highest priority first.
    pub(super) transports: Vec<(TransportKind, i64)>,
    /// The shm transport, when it is viable and offered.
    pub(super) shm: Option<ShmTransport>,
    /// The plugged-in transports that are viable and offered.
    pub(super) plugged: Vec<(TransportKind, Box<dyn Transport + Send>)>,
    /// Highest priority first, with their domain descriptors.
    pub(super) channels: Vec<(ChannelKind, i64, String)>,
    /// The opened device runtimes.
    pub(super) devices: Devices,
    pub(super) handlers: HashMap<String, Arc<dyn Handler>>,
}

impl Start {
    pub(super) fn devices(&self) -> WorkerDevices {
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

    /// Starts the pool and the I/O thread; the start-up machine publishes the address.
    pub(super) fn start_agent(self, world_size: Option<u32>) -> Result<RpcAgent, InitError> {
        let Start {
            me,
            options,
            secret,
            store,
            keys,
            transports,
            mut shm,
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
                TransportKind::Shm => match shm.take() {
                    Some(shm) => Box::new(shm),
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
            let started = MptSetup::start(host, options.mpt_connections).map_err(|source| {
                InitError::from(TransportError::Listen {
                    address: format!("mpt://{}", SocketAddr::new(host, 0)),
                    source,
                })
            })?;
            Some(Arc::new(started))
        } else {
            None
        };
        let offer = OfferSpec {
            transports: offered,
            channels,
            serves_cuda: devices.has_cuda(),
        };
        let pool_size = u32::try_from(options.num_worker_threads).unwrap_or(u32::MAX);
        let registry = Arc::new(Registry::new(handlers));
        let gate = Arc::new(JoinGate::default());
        let counters = Arc::new(Counters::new(pool_size));
        let calls_table = Arc::new(Calls::new(
            me.name(),
            Arc::clone(&gate),
            Arc::clone(&counters),
            devices.clone(),
        ));
        let framer = Arc::new(Framer {
            registry: Arc::clone(&registry),
            devices: devices.clone(),
            min_channel_bytes: options.min_channel_bytes,
            counters: Arc::clone(&counters),
        });
        let lanes = Arc::new(LaneContext {
            calls: calls_table,
            framer,
            lanes: Arc::new(Mutex::new(Lanes::default())),
            faults: crate::rpc::faults::Faults::new(&options.fault_injection),
            mpt,
            devices,
            wait_spin: options.wait_spin,
        });
        let mailbox = Arc::new(Mailbox::default());
        let mut rrefs = None;
        let dispatch = Arc::new_cyclic(|agent| {
            let runtime = Arc::new(RRefs::new(
                me.clone(),
                Arc::clone(&registry),
                Arc::clone(&gate),
                agent.clone(),
                options.rref_retry,
                options.on_value_released.clone(),
            ));
            rrefs = Some(Arc::clone(&runtime));
            Dispatch {
                me: me.clone(),
                registry: Arc::clone(&registry),
                gate: Arc::clone(&gate),
                ids: CallIds::new(RpcTimeout::from_duration(options.rpc_timeout)),
                lanes: Arc::clone(&lanes.lanes),
                wait_spin: options.wait_spin,
                mailbox: Arc::clone(&mailbox),
                rrefs: runtime,
            }
        });
        let rrefs = rrefs.ok_or(InitError::Internal("the RRef runtime was not built"))?;
        register_rref_handlers(&rrefs);
        if world_size.is_none() {
            register_membership_handlers(&registry, me.name());
        }
        // One queue that every worker waits on: a job wakes one of them.
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
        let runner = Arc::new(Runner {
            name: me.name().to_string(),
            registry: Arc::clone(&registry),
            gate: Arc::clone(&gate),
            counters: Arc::clone(&counters),
            slots: Slots::new(options.num_worker_threads),
        });
        let mut workers = spawn_pool(Arc::clone(&runner), jobs_rx, options.num_worker_threads)?;
        workers.push(
            lanes
                .calls
                .start_timer()
                .map_err(|source| InitError::Thread {
                    thread: "timer thread",
                    source,
                })?,
        );
        let server = Arc::new(Server {
            runner,
            rrefs: Arc::clone(&dispatch.rrefs),
            caller: Arc::clone(&dispatch) as Arc<dyn Caller>,
            stall: StallWatch::default(),
        });
        lane::watch_stalls(&lanes, &server).map_err(|source| InitError::Thread {
            thread: "stall watcher",
            source,
        })?;
        let pieces = IoPieces {
            me: me.clone(),
            dynamic: world_size.is_none(),
            offer,
            registry,
            mailbox,
            counters: Arc::clone(&counters),
            lanes: Arc::clone(&lanes),
            server,
            secret,
            inbound_handshakes: options.inbound_handshakes,
        };
        let (io_thread, address) = spawn_io(pieces, running, jobs_tx)?;
        // The mpt connection listener's address goes last: it is no transport.
        let address = match &lanes.mpt {
            Some(mpt) => join_addresses([address.as_str(), mpt.published().as_str()]),
            None => address,
        };
        let agent = RpcAgent {
            dispatch: Arc::clone(&dispatch),
            counters,
            mpt: lanes.mpt.clone(),
            rrefs,
            client: RpcClient::new(dispatch as Arc<dyn Caller>),
            world_size,
            store: Arc::clone(&store),
            keys: keys.clone(),
            io_thread: Mutex::new(Some(io_thread)),
            workers: Mutex::new(workers),
            address: address.clone(),
            join_sequence: Mutex::new(JoinSequence::new()),
        };
        Ok(agent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::message::Message;

    #[test]
    fn bad_names_and_ranks_fail_before_any_io() {
        let bad = init_rpc(
            "no spaces",
            0,
            Some(1),
            RpcOptions::new("file:///nonexistent"),
        );
        assert!(matches!(bad, Err(InitError::InvalidWorker(_))));
        let bad = init_rpc("w", 2, Some(2), RpcOptions::new("file:///nonexistent"));
        assert!(matches!(
            bad,
            Err(InitError::InvalidOption { option: "rank", .. })
        ));
        let reserved = RpcOptions::new("file:///nonexistent").with_handler(
            "__rdzv_group_join",
            |_: &crate::rpc::CallContext, m: Message| -> Result<Message, String> { Ok(m) },
        );
        let bad = init_rpc("w", 0, Some(1), reserved);
        assert!(matches!(bad, Err(InitError::HandlerExists { .. })));
    }
}
