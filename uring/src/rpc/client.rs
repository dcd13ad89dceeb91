//! [`RpcClient`]: the calling half of the agent, a cheap clonable handle that any
//! thread, and any handler (through its [`CallContext`](super::CallContext)), can use to
//! make calls. It hands calls to the I/O thread and never blocks on I/O itself; only
//! `join` holding the call count frozen can make a new call wait.

use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::name::WorkerInfo;
use rdzv_core::rpc::rref::DebugInfo;

use super::error::{CallError, UsageError};
use super::message::{on_io_thread, Message, RpcFuture};
use super::rref::{RRef, RRefRuntime};

/// What sends a client's calls: the agent's lanes and I/O thread (`super::dispatch`),
/// and its RRef runtime. The client knows nothing of pipes.
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
    ) -> Result<Message, CallError>;

    /// The agent's RRef runtime, which `remote()` and received forks go through.
    fn rrefs(&self) -> Arc<dyn RRefRuntime>;
}

/// Makes calls through an agent. Clone it freely; calls made after the agent shut down
/// fail with [`CallError::ShutDown`].
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
    pub fn rpc_sync(
        &self,
        to: &str,
        handler: &str,
        message: Message,
    ) -> Result<Message, CallError> {
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
    ) -> Result<Message, CallError> {
        if on_io_thread() {
            // Checked before sending: the call must not go out if its wait cannot happen.
            return Err(UsageError::BlockingInline.into());
        }
        self.caller.call_and_wait(to, handler, message, timeout)
    }

    /// `remote(to, handler, message)`: runs `handler` on `to`, which keeps its result,
    /// and returns at once an [`RRef`] to it (`to_here` fetches it). The
    /// call counts as in flight until the handler finished, so
    /// [`join`](super::RpcAgent::join) waits for it. Dropping the RRef at once makes
    /// this fire-and-forget.
    ///
    /// # Errors
    /// [`UsageError::UnknownWorker`] (in [`CallError::Usage`]) or [`CallError::ShutDown`]
    /// at once; later failures (the call's, the handler's) come out of
    /// [`RRef::to_here`], naming the owner. A failed call (the owner not reached, the
    /// send refused, a timeout) leaves no pending user: the RRef is marked failed,
    /// [`RRef::fork_to`] refuses it, and dropping it still tells the owner, as PyTorch's
    /// best-effort handling of a failed `rpc.remote()` does.
    pub fn remote(&self, to: &str, handler: &str, message: Message) -> Result<RRef, CallError> {
        self.remote_with_timeout(to, handler, message, None)
    }

    /// [`remote`](Self::remote) with a timeout for the call (`None`: the agent's
    /// default; zero: none); past it, `to_here` fails with the timeout.
    ///
    /// # Errors
    /// As [`remote`](Self::remote).
    pub fn remote_with_timeout(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<RRef, CallError> {
        self.caller.rrefs().remote(to, handler, message, timeout)
    }

    /// Turns the bytes of [`RRef::fork_to`], received in a message, back into an RRef
    /// (unpickling it). Call it once per fork, in the handler that received them.
    ///
    /// # Errors
    /// [`UsageError::RRef`] for bytes that are no fork, a fork whose owner is not in the
    /// group, or one received twice.
    pub fn rref_from_fork(&self, bytes: &[u8]) -> Result<RRef, UsageError> {
        self.caller.rrefs().from_fork(bytes)
    }

    /// This worker's RRef counts (`_rref_context_get_debug_info`).
    pub fn rref_debug_info(&self) -> DebugInfo {
        self.caller.rrefs().debug_info()
    }
}
