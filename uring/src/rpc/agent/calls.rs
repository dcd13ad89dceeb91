//! The agent's calls: [`RpcAgent::rpc_sync`], [`RpcAgent::rpc_async`] and their
//! timeouts (each the agent's [`RpcClient`]'s), and PyTorch's `wait_until_node_failure`
//! test helpers, which probe a peer with calls until one fails.

use std::time::{Duration, Instant};

use super::RpcAgent;
use crate::rpc::client::RpcClient;
use crate::rpc::error::{CallError, UsageError};
use crate::rpc::message::{Message, RpcFuture};

/// The handler name [`RpcAgent::wait_until_node_failure`] probes with (never registered).
const NODE_PROBE: &str = "__rdzv_node_probe";
/// How often it probes.
const NODE_PROBE_INTERVAL: Duration = Duration::from_millis(100);

impl RpcAgent {
    /// A handle that makes calls through this agent, for other threads and for
    /// handlers (see [`CallContext::client`](crate::rpc::CallContext::client)).
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
    pub fn rpc_sync(
        &self,
        to: &str,
        handler: &str,
        message: Message,
    ) -> Result<Message, CallError> {
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
    ) -> Result<Message, CallError> {
        self.client
            .rpc_sync_with_timeout(to, handler, message, timeout)
    }

    /// PyTorch's `wait_until_node_failure` test helper: probes `peer` every 100 ms until
    /// a call to it fails for a reason other than the handler (broken pipe, refused
    /// connection, timeout) and returns that error; `None` if `peer` still answers after
    /// `timeout`.
    pub fn wait_until_node_failure(&self, peer: &str, timeout: Duration) -> Option<CallError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            // No handler has this name: an answer (a remote error) means `peer` is alive.
            match self.rpc_sync_with_timeout(peer, NODE_PROBE, Message::default(), Some(left)) {
                Ok(_) | Err(CallError::Remote { .. }) => {}
                Err(e) => return Some(e),
            }
            std::thread::sleep(NODE_PROBE_INTERVAL.min(left));
        }
    }

    /// PyTorch's `wait_until_node_failure(rank, expected_error_regex)` test helper: probes
    /// the worker of id `rank` every 100 ms until a call to it fails with an error whose
    /// text matches `expected_error_regex` (a `regex` pattern, searched as Python's
    /// `re.search` does; `".*"` takes any failure), and returns that text. Failures that
    /// do not match are ignored and probing goes on, as in PyTorch. `Ok(None)` if no
    /// matching failure came within `timeout` (PyTorch has no timeout and loops on).
    ///
    /// # Errors
    /// [`UsageError::UnknownWorkerId`] for an id outside the group,
    /// [`UsageError::InvalidArgument`] for a pattern that does not compile.
    pub fn wait_until_node_failure_on_rank(
        &self,
        rank: i64,
        expected_error_regex: &str,
        timeout: Duration,
    ) -> Result<Option<String>, UsageError> {
        let peer = self.get_worker_info_by_id(rank)?;
        let pattern =
            regex::Regex::new(expected_error_regex).map_err(|e| UsageError::InvalidArgument {
                argument: "expected_error_regex",
                reason: format!("{expected_error_regex:?} is not a valid regular expression: {e}"),
            })?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(failure) = self.wait_until_node_failure(peer.name(), left) else {
                return Ok(None);
            };
            let text = failure.to_string();
            if pattern.is_match(&text) {
                return Ok(Some(text));
            }
            std::thread::sleep(NODE_PROBE_INTERVAL.min(left));
        }
    }
}
