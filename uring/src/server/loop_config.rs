//! What each store loop thread is given ([`LoopConfig`]) and what it starts from
//! ([`LoopParts`]: its serving state and its admission), made once for the io_uring and
//! epoll loops. Each loop's `LoopSetup` adds its poller and listener.

use std::sync::Arc;
use std::time::Duration;

use rdzv_core::store::access::AccessPolicy;
use rdzv_core::store::budget::Budget;
use rdzv_core::store::codec::Limits;

use super::admission::Admission;
use super::shared_engine::{Serving, SharedEngine};
use super::StatsCells;

/// What every event loop thread is given, on io_uring and epoll alike (each loop's
/// `LoopSetup` adds its poller and listener).
pub(super) struct LoopConfig {
    /// The loop's index: its connection ids carry it.
    pub(super) index: usize,
    pub(super) shared: Arc<SharedEngine>,
    pub(super) limits: Limits,
    pub(super) budget: Budget,
    /// `--allow` and `--token-file`; `None` when neither is set.
    pub(super) access: Option<Arc<AccessPolicy>>,
    pub(super) stats: Arc<StatsCells>,
    /// How long shutdown waits for connections to flush.
    pub(super) drain: Duration,
    /// Keep polling this long after the last event before sleeping in the kernel
    /// (`--spin-us`); `None` sleeps at once.
    pub(super) spin: Option<Duration>,
}

/// What a loop starts from, made of its [`LoopConfig`] once for both loops.
pub(super) struct LoopParts {
    pub(super) serving: Serving,
    pub(super) admission: Admission,
    pub(super) budget: Budget,
    pub(super) drain: Duration,
    pub(super) spin: Option<Duration>,
}

impl LoopConfig {
    /// The loop's [`Serving`] and [`Admission`], and what else it keeps.
    pub(super) fn into_parts(self) -> LoopParts {
        let LoopConfig {
            index,
            shared,
            limits,
            budget,
            access,
            stats,
            drain,
            spin,
        } = self;
        LoopParts {
            admission: Admission::new(index, Arc::clone(&shared), limits, budget, access),
            serving: Serving::new(index, shared, stats),
            budget,
            drain,
            spin,
        }
    }
}
