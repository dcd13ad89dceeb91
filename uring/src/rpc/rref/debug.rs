//! What a worker can learn about its RRefs: PyTorch's debug counts (its own, or another
//! worker's over RPC), the `dist_utils` waits the seeds' tests use, and graceful
//! shutdown's settling of RRefs with its leak report.

use super::*;

/// One thing a graceful shutdown could not settle, with the owner's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RRefLeak {
    /// The owner (for an unanswered message: the worker it went to).
    pub owner: String,
    /// What leaks, in words (the RRef and fork ids, and why).
    pub what: String,
    /// The core's record of it.
    pub leak: Leak,
}

/// What a graceful shutdown left of the RRefs: PyTorch's leak check, reported by count
/// and owner rather than raised.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RRefShutdownReport {
    /// Users, forks and messages that were never settled.
    pub leaks: Vec<RRefLeak>,
    /// Owner values here that other workers still referenced when the wait ended.
    pub owner_rrefs_left: usize,
    /// The counts when the wait ended.
    pub debug_info: DebugInfo,
}

impl RRefShutdownReport {
    /// Whether everything was settled.
    pub fn is_clean(&self) -> bool {
        self.leaks.is_empty() && self.owner_rrefs_left == 0
    }

    /// Leaks by owner name.
    pub fn by_owner(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for leak in &self.leaks {
            *counts.entry(leak.owner.clone()).or_insert(0) += 1;
        }
        counts
    }
}
impl crate::rpc::RpcAgent {
    /// [`RpcClient::remote_with_timeout`].
    ///
    /// # Errors
    /// As there.
    pub fn remote_with_timeout(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<RRef, RpcError> {
        self.client()
            .remote_with_timeout(to, handler, message, timeout)
    }

    /// [`RpcClient::rref_from_fork`].
    ///
    /// # Errors
    /// As there.
    pub fn rref_from_fork(&self, bytes: &[u8]) -> Result<RRef, RpcError> {
        self.client().rref_from_fork(bytes)
    }

    /// `_rref_context_get_debug_info()`: `num_owner_rrefs`, `num_pending_futures`,
    /// `num_pending_users`, `num_forks`.
    pub fn rref_debug_info(&self) -> DebugInfo {
        self.client().rref_debug_info()
    }

    /// `rref_debug_info` as PyTorch's text keys and values.
    pub fn rref_debug_info_map(&self) -> Vec<(String, String)> {
        let info = self.rref_debug_info();
        [
            ("num_owner_rrefs", info.num_owner_rrefs),
            ("num_pending_futures", info.num_pending_futures),
            ("num_pending_users", info.num_pending_users),
            ("num_forks", info.num_forks),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// The RRef counts of worker `rank` (over RPC unless it is this worker).
    ///
    /// # Errors
    /// The call's error.
    pub fn rref_debug_info_of(&self, rank: WorkerId) -> Result<DebugInfo, RpcError> {
        debug_info_of(self.client().shared(), rank)
    }

    /// PyTorch's `get_num_owners_and_forks` for worker `rank` (over RPC unless it is
    /// this worker).
    ///
    /// # Errors
    /// The call's error.
    pub fn get_num_owners_and_forks(&self, rank: WorkerId) -> Result<(usize, usize), RpcError> {
        let info = debug_info_of(self.client().shared(), rank)?;
        Ok((info.num_owner_rrefs, info.num_forks))
    }

    /// PyTorch's `dist_utils.wait_until_owners_and_forks_on_rank`: polls worker `rank`
    /// until it has `num_owners` owner RRefs and `num_forks` forks.
    ///
    /// # Errors
    /// [`RpcError::RRefWait`] with the counts seen last after `timeout`, or a call's
    /// error.
    pub fn wait_until_owners_and_forks_on_rank(
        &self,
        num_owners: usize,
        num_forks: usize,
        rank: WorkerId,
        timeout: Duration,
    ) -> Result<(), RpcError> {
        wait_until_owners_and_forks_on_rank(
            self.client().shared(),
            num_owners,
            num_forks,
            rank,
            timeout,
        )
    }

    /// PyTorch's `dist_utils.wait_until_pending_futures_and_users_flushed`: no RRef
    /// control message unanswered, no user unconfirmed, no call in flight here.
    ///
    /// # Errors
    /// [`RpcError::RRefWait`] with what was left after `timeout`.
    pub fn wait_until_pending_futures_and_users_flushed(
        &self,
        timeout: Duration,
    ) -> Result<(), RpcError> {
        wait_until_pending_futures_and_users_flushed(self.client().shared(), timeout)
    }

    /// What the last graceful shutdown left of the RRefs (PyTorch's leak check, by
    /// count and owner; also logged); `None` before one.
    pub fn rref_shutdown_report(&self) -> Option<RRefShutdownReport> {
        self.client().shared().rrefs.report()
    }
}

/// The debug counts of worker `rank`, asked over RPC (this worker's own, locally).
pub(crate) fn debug_info_of(shared: &Arc<Shared>, rank: WorkerId) -> Result<DebugInfo, RpcError> {
    if rank == shared.me.id() {
        return Ok(shared.rrefs.debug_info());
    }
    let name = worker_name(shared, rank).ok_or_else(|| RpcError::UnknownWorker {
        name: format!("rank {}", rank.get()),
    })?;
    let reply =
        RpcClient::new(Arc::clone(shared)).rpc_sync(&name, DEBUG_INFO, Message::default())?;
    decode_counts(&reply.payload).ok_or_else(|| RpcError::Remote {
        peer: name,
        handler: DEBUG_INFO.into(),
        message: format!("{} bytes are not four counts", reply.payload.len()),
    })
}

/// PyTorch's `wait_until_owners_and_forks_on_rank`.
pub(crate) fn wait_until_owners_and_forks_on_rank(
    shared: &Arc<Shared>,
    num_owners: usize,
    num_forks: usize,
    rank: WorkerId,
    timeout: Duration,
) -> Result<(), RpcError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let info = debug_info_of(shared, rank)?;
        if info.num_owner_rrefs == num_owners && info.num_forks == num_forks {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(RpcError::RRefWait {
                reason: format!(
                    "Timed out waiting {timeout:?} for {num_owners} owners and {num_forks} forks \
                     on rank {}, had {} owners and {} forks",
                    rank.get(),
                    info.num_owner_rrefs,
                    info.num_forks
                ),
            });
        }
        std::thread::sleep(HELPER_POLL);
    }
}

/// PyTorch's `wait_until_pending_futures_and_users_flushed`: no RRef control message
/// unanswered, no user unconfirmed, and no call in flight on this worker.
pub(crate) fn wait_until_pending_futures_and_users_flushed(
    shared: &Shared,
    timeout: Duration,
) -> Result<(), RpcError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let info = shared.rrefs.debug_info();
        let calls = shared.lock_calls().metrics.calls.client_active();
        if info.num_pending_futures == 0 && info.num_pending_users == 0 && calls == 0 {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(RpcError::RRefWait {
                reason: format!(
                    "Timed out waiting {timeout:?} to flush pending futures and users, had {} \
                     pending RRef futures, {} pending users and {calls} calls in flight",
                    info.num_pending_futures, info.num_pending_users
                ),
            });
        }
        std::thread::sleep(HELPER_POLL);
    }
}

/// A graceful shutdown's RRef part (see the module documentation). Each wait lasts at
/// most as long as a control message keeps being retried.
pub(crate) fn settle_for_join(shared: &Arc<Shared>) -> RRefShutdownReport {
    let rrefs = &shared.rrefs;
    let window = rrefs.retry_window();
    rrefs.wait_for(window, |s| s.machine.is_settled() && s.outbox.is_empty());
    rrefs.update(|state, now| state.machine.release_all(now));
    // Users that could not settle above never will: wait for the deletes just sent
    // and for the other workers' deletes of the values here.
    rrefs.wait_for(window, |s| {
        let info = s.machine.debug_info();
        s.outbox.is_empty() && info.num_pending_futures == 0 && info.num_owner_rrefs == 0
    });
    let report = {
        let mut state = rrefs.lock();
        let leaks = state
            .machine
            .leaks()
            .map(|leak| describe(shared, leak))
            .collect();
        let debug_info = state.machine.debug_info();
        let report = RRefShutdownReport {
            leaks,
            owner_rrefs_left: debug_info.num_owner_rrefs,
            debug_info,
        };
        state.report = Some(report.clone());
        report
    };
    if !report.is_clean() {
        for (owner, count) in report.by_owner() {
            tracing::warn!(
                worker = shared.me.name(),
                owner = %owner,
                count,
                "RRefs leak at shutdown: never confirmed or never answered by their owner"
            );
        }
        if report.owner_rrefs_left > 0 {
            tracing::warn!(
                worker = shared.me.name(),
                count = report.owner_rrefs_left,
                "owner RRefs still referenced by other workers at shutdown"
            );
        }
    }
    report
}

fn describe(shared: &Shared, leak: Leak) -> RRefLeak {
    let name =
        |id: WorkerId| worker_name(shared, id).unwrap_or_else(|| format!("worker id {}", id.get()));
    let (owner, what) = match leak {
        Leak::PendingUser { owner, rref, fork } => (
            name(owner),
            format!("user {fork} of RRef {rref} was never confirmed by its owner"),
        ),
        Leak::PendingChild { owner, rref, child } => (
            name(owner),
            format!("fork {child} of RRef {rref} was never accepted by its child"),
        ),
        Leak::Unanswered { to, kind, fork } => (
            name(to),
            format!("{kind} for fork {fork} was never answered"),
        ),
    };
    RRefLeak { owner, what, leak }
}
