//! The state the agent's user-facing handle, its I/O thread and its worker pool share:
//! the group, the handlers, the command mailbox and the call counters.
//!
//! Locks are held only for bookkeeping, never across I/O or a handler.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use rdzv_core::device::DeviceType;
use rdzv_core::device_map::DeviceMaps;
use rdzv_core::negotiate::{ChannelKind, DeviceDescriptors, Offer, OfferError, TransportKind};
use rdzv_core::rpc::metrics::{AgentMetrics, NetworkData};
use rdzv_core::rpc::name::{WorkerId, WorkerInfo};
use rdzv_core::rpc::timeouts::RpcTimeout;

use super::channels::ChannelBytes;
use super::message::{on_io_thread, Completion, Handler, Message};

/// The domain descriptor of the basic channel: it runs over any transport.
pub(crate) const BASIC_DESCRIPTOR: &str = "basic:any";

/// A member of the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Peer {
    pub id: WorkerId,
    pub address: String,
}

/// What init learned about the group (a dynamic group's members change it).
#[derive(Debug, Clone, Default)]
pub(crate) struct Group {
    /// Every member, this worker included, by name.
    pub peers: HashMap<String, Peer>,
    /// Maps for requests, by destination name.
    pub device_maps: DeviceMaps,
    /// Maps for responses, by caller name.
    pub reverse_device_maps: DeviceMaps,
}

/// A call on its way to the I/O thread.
pub(crate) struct Call {
    pub message_id: u64,
    pub peer: String,
    pub handler: String,
    pub message: Message,
    pub timeout: RpcTimeout,
    pub completion: Arc<Completion>,
}

/// What user threads and pool threads ask of the I/O thread.
pub(crate) enum Command {
    /// Send a request.
    Call(Call),
    /// Close every pipe; calls on them fail, later calls open new ones.
    ResetPipes,
    /// Close everything and stop; `goodbye` sends goodbye frames first.
    Close { goodbye: bool },
}

/// The commands for the I/O thread: many threads push, its task takes them in batches.
pub(crate) type Mailbox = crate::queue::Queue<Command>;

/// The call counters and per-peer data, with `join`'s freeze.
#[derive(Debug)]
pub(crate) struct CallState {
    pub metrics: AgentMetrics,
    pub network: NetworkData,
    /// `join` froze the client call count.
    pub frozen: bool,
    /// Client calls that finished while frozen, to subtract on release.
    pub deferred_finishes: u32,
    /// Peers closing pipes is expected from now on.
    pub shutting_down: bool,
    /// The transport of the last client pipe opened to each peer.
    pub pipe_transports: HashMap<String, TransportKind>,
    /// Threads waiting on `calls_changed`.
    pub waiters: u32,
    /// The CPU-to-CPU channel of the last client pipe opened to each peer (`None`: no
    /// channel serves CPU tensors on it).
    pub pipe_channels: HashMap<String, Option<ChannelKind>>,
    /// Tensor bytes this worker sent, per channel (requests and responses).
    pub channel_bytes: ChannelBytes,
}

/// The ranked backends this worker offers, with their descriptors, and how it uses its
/// channels.
#[derive(Debug, Clone)]
pub(crate) struct OfferSpec {
    pub transports: Vec<(TransportKind, i64, String)>,
    /// Each channel with its priority and its domain descriptor (for CPU memory; for
    /// CUDA memory, `cuda_xth`, `cuda_ipc` and `cuda_gdr`, and `cuda_basic` too when
    /// `serves_cuda`).
    pub channels: Vec<(ChannelKind, i64, String)>,
    /// Whether `cuda_basic` is also offered for CUDA memory (a CUDA runtime is open).
    pub serves_cuda: bool,
    /// Tensors below this size go inline even where a channel was negotiated.
    pub min_channel_bytes: u64,
}

impl OfferSpec {
    /// The core's offer, borrowing the descriptors.
    pub(crate) fn offer(&self) -> Result<Offer<'_>, OfferError> {
        let mut offer = Offer::new();
        for (kind, priority, descriptor) in &self.transports {
            offer.add_transport(*kind, *priority, descriptor)?;
        }
        for (kind, priority, descriptor) in &self.channels {
            let descriptors = match kind {
                ChannelKind::CudaBasic if self.serves_cuda => {
                    DeviceDescriptors::cpu(descriptor).with(DeviceType::Cuda, descriptor)
                }
                ChannelKind::CudaXth | ChannelKind::CudaIpc | ChannelKind::CudaGdr => {
                    DeviceDescriptors::cuda(descriptor)
                }
                _ => DeviceDescriptors::cpu(descriptor),
            };
            offer.add_channel(*kind, *priority, descriptors)?;
        }
        Ok(offer)
    }
}

/// Everything shared.
pub(crate) struct Shared {
    pub me: WorkerInfo,
    /// `None` for a dynamic group.
    pub world_size: Option<u32>,
    pub group: RwLock<Group>,
    /// Members join and leave (no world size).
    pub dynamic: bool,
    pub handlers: RwLock<HashMap<String, Arc<dyn Handler>>>,
    pub mailbox: Mailbox,
    pub calls: Mutex<CallState>,
    pub calls_changed: Condvar,
    pub next_message_id: AtomicU64,
    pub default_timeout: RpcTimeout,
    pub offer: OfferSpec,
    /// Every call in flight, and their timer.
    pub calls_table: super::calls::Calls,
    /// The pipes served by threads.
    pub lanes: Mutex<super::lane::Lanes>,
    /// Faults to inject into client lanes' requests (tests), if any.
    pub faults: Option<Arc<super::faults::Faults>>,
    /// The mpt lane listener and lane count, when this worker offers mpt.
    pub mpt: Option<super::mpt::MptSetup>,
    /// The device runtimes (they lend, borrow and stage device memory).
    pub devices: super::device::Devices,
    /// `RpcOptions::wait_spin`.
    pub wait_spin: std::time::Duration,
    /// The RRefs: the core's machine, the owner's values, the pump.
    pub rrefs: super::rref::RRefs,
}

impl Shared {
    pub(crate) fn lock_calls(&self) -> MutexGuard<'_, CallState> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn next_message_id(&self) -> u64 {
        self.next_message_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Counts a new client call, waiting while `join` has the count frozen; on an I/O
    /// thread (an inline handler), where waiting would deadlock, returns `false` instead
    /// of waiting and counts nothing.
    pub(crate) fn start_client_call(&self) -> bool {
        let mut calls = self.lock_calls();
        if calls.frozen && on_io_thread() {
            return false;
        }
        while calls.frozen {
            calls = self.wait_calls_changed(calls);
        }
        calls.metrics.calls.client_call_started();
        true
    }

    /// A client call completed (answered, failed or timed out).
    pub(crate) fn finish_client_call(&self) {
        let mut calls = self.lock_calls();
        if calls.frozen {
            calls.deferred_finishes = calls.deferred_finishes.saturating_add(1);
        } else {
            calls.metrics.calls.client_call_finished();
        }
        let waiters = calls.waiters;
        drop(calls);
        // Waking nobody still costs a system call, on every call's critical path.
        if waiters > 0 {
            self.calls_changed.notify_all();
        }
    }

    /// Waits once on `calls_changed`, counted in `waiters` so that finishing calls
    /// only signal when someone waits.
    pub(crate) fn wait_calls_changed<'a>(
        &self,
        mut calls: MutexGuard<'a, CallState>,
    ) -> MutexGuard<'a, CallState> {
        calls.waiters += 1;
        let mut calls = self
            .calls_changed
            .wait(calls)
            .unwrap_or_else(|p| p.into_inner());
        calls.waiters -= 1;
        calls
    }

    pub(crate) fn handler(&self, name: &str) -> Option<Arc<dyn Handler>> {
        self.handlers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .map(Arc::clone)
    }

    pub(crate) fn group(&self) -> RwLockReadGuard<'_, Group> {
        self.group.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn group_mut(&self) -> RwLockWriteGuard<'_, Group> {
        self.group.write().unwrap_or_else(|p| p.into_inner())
    }
}
