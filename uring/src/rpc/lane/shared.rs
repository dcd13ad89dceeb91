//! [`Shared`]: the pieces that the lanes' threads, the I/O thread and the worker pool
//! all reach, assembled once by start-up. Each piece is its own module's, with its own
//! lock: the group and handlers ([`Registry`]), the counts ([`Counters`], [`JoinGate`]),
//! the calls in flight ([`Calls`]), frame building ([`Framer`]), the lanes
//! ([`Lanes`](super::Lanes)). Lower layers take only the piece they use.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdzv_core::rpc::name::WorkerInfo;
use rdzv_core::rpc::timeouts::RpcTimeout;

use super::Lanes;
use crate::rpc::calls::Calls;
use crate::rpc::counters::{Counters, JoinGate};
use crate::rpc::device::Devices;
use crate::rpc::faults::Faults;
use crate::rpc::mailbox::Mailbox;
use crate::rpc::mpt::MptSetup;
use crate::rpc::offer::OfferSpec;
use crate::rpc::outgoing::Framer;
use crate::rpc::registry::Registry;
use crate::rpc::rref::RRefRuntime;

/// What the lanes, the I/O thread and the pool share.
pub(crate) struct Shared {
    pub me: WorkerInfo,
    /// Members join and leave (no world size).
    pub dynamic: bool,
    pub registry: Arc<Registry>,
    pub mailbox: Mailbox,
    pub gate: Arc<JoinGate>,
    pub counters: Arc<Counters>,
    pub next_message_id: AtomicU64,
    pub default_timeout: RpcTimeout,
    pub offer: OfferSpec,
    /// Every call in flight, and their timer.
    pub calls_table: Arc<Calls>,
    /// Builds outgoing frames.
    pub framer: Framer,
    /// The pipes served by threads.
    pub lanes: Mutex<Lanes>,
    /// Faults to inject into client lanes' requests (tests), if any.
    pub faults: Option<Arc<Faults>>,
    /// The mpt lane listener and lane count, when this worker offers mpt.
    pub mpt: Option<MptSetup>,
    /// The device runtimes (they lend, borrow and stage device memory).
    pub devices: Devices,
    /// `RpcOptions::wait_spin`.
    pub wait_spin: Duration,
    /// The RRef runtime, which `remote()` and forks go through (the `rref` module's
    /// seam; the runtime itself sits above the lanes).
    pub rrefs: Arc<dyn RRefRuntime>,
}

impl Shared {
    pub(crate) fn next_message_id(&self) -> u64 {
        self.next_message_id.fetch_add(1, Ordering::Relaxed)
    }
}
