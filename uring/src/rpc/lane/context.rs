//! [`LaneContext`]: what starting a lane takes, assembled once by start-up: the
//! registry of lanes ([`Lanes`]), the calls in flight ([`Calls`]) and frame building
//! ([`Framer`]), which each lane keeps from its start (so a lane sends, answers and
//! ends with nothing passed in), the device runtimes, the mpt listener, fault injection
//! and the spin. What serving a request needs beyond that (the handlers, the call
//! counts, the RRef runtime, the client handlers call through) is
//! [`Server`](super::Server)'s; the group, the mailbox and message ids are the
//! dispatcher's, a layer up.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Lanes;
use crate::rpc::calls::Calls;
use crate::rpc::device::Devices;
use crate::rpc::faults::Faults;
use crate::rpc::mpt::MptSetup;
use crate::rpc::outgoing::Framer;

/// What starting a lane takes (the I/O thread starts them).
pub(crate) struct LaneContext {
    /// Every call in flight, and their timer.
    pub calls: Arc<Calls>,
    /// Builds outgoing frames; each lane holds it from its start.
    pub framer: Arc<Framer>,
    /// The pipes served by threads (each lane holds it weakly, to leave it).
    pub lanes: Arc<Mutex<Lanes>>,
    /// Faults to inject into client lanes' requests (tests), if any.
    pub faults: Option<Arc<Faults>>,
    /// The mpt lane listener and lane count, when this worker offers mpt.
    pub mpt: Option<Arc<MptSetup>>,
    /// The device runtimes (they lend, borrow and stage device memory).
    pub devices: Devices,
    /// `RpcOptions::wait_spin`.
    pub wait_spin: Duration,
}
