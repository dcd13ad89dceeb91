//! The agent's RRef methods: `remote`, forks, and PyTorch's RRef debug counts and
//! waits (`rpc::rref_runtime` does the work).

use std::time::Duration;

use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::rref::DebugInfo;

use super::RpcAgent;
use crate::rpc::error::{CallError, UsageError};
use crate::rpc::message::Message;
use crate::rpc::rref::{RRef, RRefShutdownReport};
use crate::rpc::rref_runtime;

impl RpcAgent {
    /// [`RpcClient::remote`]: an [`RRef`] to the handler's result on `to`.
    ///
    /// # Errors
    /// As [`RpcClient::remote`]: misuse or a shut down agent, at once.
    pub fn remote(&self, to: &str, handler: &str, message: Message) -> Result<RRef, CallError> {
        self.client.remote(to, handler, message)
    }

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
    ) -> Result<RRef, CallError> {
        self.client
            .remote_with_timeout(to, handler, message, timeout)
    }

    /// [`RpcClient::rref_from_fork`].
    ///
    /// # Errors
    /// As there.
    pub fn rref_from_fork(&self, bytes: &[u8]) -> Result<RRef, UsageError> {
        self.client.rref_from_fork(bytes)
    }

    /// `_rref_context_get_debug_info()`: `num_owner_rrefs`, `num_pending_futures`,
    /// `num_pending_users`, `num_forks`.
    pub fn rref_debug_info(&self) -> DebugInfo {
        self.client.rref_debug_info()
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
    pub fn rref_debug_info_of(&self, rank: WorkerId) -> Result<DebugInfo, CallError> {
        rref_runtime::debug_info_of(&self.rrefs, rank)
    }

    /// PyTorch's `get_num_owners_and_forks` for worker `rank` (over RPC unless it is
    /// this worker).
    ///
    /// # Errors
    /// The call's error.
    pub fn get_num_owners_and_forks(&self, rank: WorkerId) -> Result<(usize, usize), CallError> {
        let info = self.rref_debug_info_of(rank)?;
        Ok((info.num_owner_rrefs, info.num_forks))
    }

    /// PyTorch's `dist_utils.wait_until_owners_and_forks_on_rank`: polls worker `rank`
    /// until it has `num_owners` owner RRefs and `num_forks` forks.
    ///
    /// # Errors
    /// [`CallError::RRefWait`] with the counts seen last after `timeout`, or a call's
    /// error.
    pub fn wait_until_owners_and_forks_on_rank(
        &self,
        num_owners: usize,
        num_forks: usize,
        rank: WorkerId,
        timeout: Duration,
    ) -> Result<(), CallError> {
        rref_runtime::wait_until_owners_and_forks_on_rank(
            &self.rrefs,
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
    /// [`CallError::RRefWait`] with what was left after `timeout`.
    pub fn wait_until_pending_futures_and_users_flushed(
        &self,
        timeout: Duration,
    ) -> Result<(), CallError> {
        rref_runtime::wait_until_pending_futures_and_users_flushed(&self.rrefs, timeout)
    }

    /// What the last graceful shutdown left of the RRefs (PyTorch's leak check, by
    /// count and owner; also logged); `None` before one.
    pub fn rref_shutdown_report(&self) -> Option<RRefShutdownReport> {
        self.rrefs.report()
    }
}
