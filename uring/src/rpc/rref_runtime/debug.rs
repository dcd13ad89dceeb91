//! What a worker can learn about its RRefs: PyTorch's debug counts (its own, or another
//! worker's over RPC), the `dist_utils` waits the seeds' tests use, and graceful
//! shutdown's settling of RRefs with its leak report.

use std::time::Duration;

use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::rref::wire::handler;
use rdzv_core::rpc::rref::{DebugInfo, Leak};

use super::serve::decode_counts;
use super::{RRefs, HELPER_POLL};
use crate::rpc::error::{CallError, RRefWaitTimeout, UsageError};
use crate::rpc::message::Message;
use crate::rpc::rref::{RRefLeak, RRefRuntime, RRefShutdownReport};

/// The debug counts of worker `rank`, asked over RPC (this worker's own, locally).
pub(crate) fn debug_info_of(rrefs: &RRefs, rank: WorkerId) -> Result<DebugInfo, CallError> {
    if rank == rrefs.me.id() {
        return Ok(rrefs.debug_info());
    }
    let name = rrefs.worker_name(rank).ok_or_else(|| {
        CallError::Usage(UsageError::UnknownWorker {
            name: format!("rank {}", rank.get()),
        })
    })?;
    let reply = rrefs
        .client()?
        .rpc_sync(&name, handler::DEBUG_INFO, Message::default())?;
    decode_counts(&reply.payload).ok_or_else(|| CallError::Remote {
        peer: name,
        handler: handler::DEBUG_INFO.into(),
        message: format!("{} bytes are not four counts", reply.payload.len()),
    })
}

/// PyTorch's `wait_until_owners_and_forks_on_rank`.
pub(crate) fn wait_until_owners_and_forks_on_rank(
    rrefs: &RRefs,
    num_owners: usize,
    num_forks: usize,
    rank: WorkerId,
    timeout: Duration,
) -> Result<(), CallError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let info = debug_info_of(rrefs, rank)?;
        if info.num_owner_rrefs == num_owners && info.num_forks == num_forks {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(CallError::RRefWait(RRefWaitTimeout::OwnersAndForks {
                timeout,
                owners: num_owners,
                forks: num_forks,
                rank: rank.get(),
                had_owners: info.num_owner_rrefs,
                had_forks: info.num_forks,
            }));
        }
        std::thread::sleep(HELPER_POLL);
    }
}

/// PyTorch's `wait_until_pending_futures_and_users_flushed`: no RRef control message
/// unanswered, no user unconfirmed, and no call in flight on this worker.
pub(crate) fn wait_until_pending_futures_and_users_flushed(
    rrefs: &RRefs,
    timeout: Duration,
) -> Result<(), CallError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let info = rrefs.debug_info();
        let calls = rrefs.gate.counts().client_active();
        if info.num_pending_futures == 0 && info.num_pending_users == 0 && calls == 0 {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(CallError::RRefWait(RRefWaitTimeout::Flush {
                timeout,
                futures: info.num_pending_futures,
                users: info.num_pending_users,
                calls,
            }));
        }
        std::thread::sleep(HELPER_POLL);
    }
}

/// A graceful shutdown's RRef part (see the module documentation). Each wait lasts at
/// most as long as a control message keeps being retried, and ends by `deadline` (the
/// shutdown's timeout), if given.
pub(crate) fn settle_for_join(
    rrefs: &RRefs,
    deadline: Option<std::time::Instant>,
) -> RRefShutdownReport {
    let window = || {
        let window = rrefs.retry_window();
        match deadline {
            Some(d) => window.min(d.saturating_duration_since(std::time::Instant::now())),
            None => window,
        }
    };
    rrefs.wait_for(window(), |s| s.machine.is_settled() && s.outbox.is_empty());
    rrefs.update(|state, now| state.machine.release_all(now));
    // Users that could not settle above never will: wait for the deletes just sent
    // and for the other workers' deletes of the values here.
    rrefs.wait_for(window(), |s| {
        let info = s.machine.debug_info();
        s.outbox.is_empty() && info.num_pending_futures == 0 && info.num_owner_rrefs == 0
    });
    let report = {
        let mut state = rrefs.lock();
        let leaks = state
            .machine
            .leaks()
            .map(|leak| describe(rrefs, leak))
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
                worker = rrefs.me.name(),
                owner = %owner,
                count,
                "RRefs leak at shutdown: never confirmed or never answered by their owner"
            );
        }
        if report.owner_rrefs_left > 0 {
            tracing::warn!(
                worker = rrefs.me.name(),
                count = report.owner_rrefs_left,
                "owner RRefs still referenced by other workers at shutdown"
            );
        }
    }
    report
}

fn describe(rrefs: &RRefs, leak: Leak) -> RRefLeak {
    let name = |id: WorkerId| {
        rrefs
            .worker_name(id)
            .unwrap_or_else(|| format!("worker id {}", id.get()))
    };
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
