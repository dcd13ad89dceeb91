//! [`RpcClient`]: the calling half of the agent, a cheap clonable handle that any
//! thread, and any handler (through its [`CallContext`](super::CallContext)), can use to
//! make calls. It hands calls to the I/O thread and never blocks on I/O itself; only
//! `join` holding the call count frozen can make a new call wait.

use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::name::WorkerInfo;

use super::error::RpcError;
use super::message::{on_io_thread, Message, RpcFuture};

/// What sends a client's calls: the agent's lanes and I/O thread (`super::dispatch`).
/// The client knows nothing of pipes.
pub(crate) trait Caller: Send + Sync + 'static {
    /// The worker the calls come from.
    fn worker_info(&self) -> &WorkerInfo;

    /// Starts a call (`None`: the agent's default timeout).
    fn call(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> RpcFuture;

    /// Makes a call and waits for its result; never called on an I/O thread.
    fn call_and_wait(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<Message, RpcError>;
}

/// Makes calls through an agent. Clone it freely; calls made after the agent shut down
/// fail with [`RpcError::ShutDown`].
#[derive(Clone)]
pub struct RpcClient {
    caller: Arc<dyn Caller>,
}

impl std::fmt::Debug for RpcClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcClient")
            .field("me", self.caller.worker_info())
            .finish()
    }
}

impl RpcClient {
    pub(crate) fn new(caller: Arc<dyn Caller>) -> RpcClient {
        RpcClient { caller }
    }

    /// The worker the calls come from.
    pub fn worker_info(&self) -> &WorkerInfo {
        self.caller.worker_info()
    }

    /// `rpc_async(to, handler, message)` with the agent's default timeout.
    pub fn rpc_async(&self, to: &str, handler: &str, message: Message) -> RpcFuture {
        self.rpc_async_with_timeout(to, handler, message, None)
    }

    /// `rpc_async` with a per-call timeout: `None` for the agent's default, zero for
    /// never. Failures (unknown worker, shut down agent, timeouts, broken pipes, the
    /// handler's error) arrive through the future.
    pub fn rpc_async_with_timeout(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> RpcFuture {
        self.caller.call(to, handler, message, timeout)
    }

    /// `rpc_sync(to, handler, message)`: calls and waits.
    ///
    /// # Errors
    /// As the future of [`rpc_async`](Self::rpc_async).
    pub fn rpc_sync(&self, to: &str, handler: &str, message: Message) -> Result<Message, RpcError> {
        self.rpc_sync_with_timeout(to, handler, message, None)
    }

    /// `rpc_sync` with a per-call timeout (see
    /// [`rpc_async_with_timeout`](Self::rpc_async_with_timeout)).
    ///
    /// # Errors
    /// As the future of [`rpc_async`](Self::rpc_async).
    pub fn rpc_sync_with_timeout(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<Message, RpcError> {
        if on_io_thread() {
            // Checked before sending: the call must not go out if its wait cannot happen.
            return Err(RpcError::BlockingInline);
        }
        self.caller.call_and_wait(to, handler, message, timeout)
    }

    /// Fire-and-forget: runs `handler` on `to` and drops its result. The call still
    /// counts as in flight until it completes, so [`join`](super::RpcAgent::join) waits for it; a
    /// failure is only logged and counted in the peer's network data.
    ///
    /// # Errors
    /// [`RpcError::UnknownWorker`] or [`RpcError::ShutDown`], at once.
    pub fn remote(&self, to: &str, handler: &str, message: Message) -> Result<(), RpcError> {
        let future = self.rpc_async(to, handler, message);
        if future.is_done() {
            return future.wait().map(|_| ());
        }
        Ok(())
    }
}
