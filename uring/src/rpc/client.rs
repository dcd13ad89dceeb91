//! [`RpcClient`]: the calling half of the agent, a cheap clonable handle that any
//! thread, and any handler (through its [`CallContext`](super::CallContext)), can use to
//! make calls. It hands calls to the I/O thread and never blocks on I/O itself; only
//! `join` holding the call count frozen can make a new call wait.

use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::name::WorkerInfo;
use rdzv_core::rpc::timeouts::RpcTimeout;

use super::error::RpcError;
use super::lane::{self, Lane};
use super::message::{on_io_thread, Message, RpcFuture};
use super::shared::{Call, Command, Shared};

/// Makes calls through an agent. Clone it freely; calls made after the agent shut down
/// fail with [`RpcError::ShutDown`].
#[derive(Clone)]
pub struct RpcClient {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RpcClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcClient")
            .field("me", &self.shared.me)
            .finish()
    }
}

impl RpcClient {
    pub(crate) fn new(shared: Arc<Shared>) -> RpcClient {
        RpcClient { shared }
    }

    /// The agent's shared state (for `rref`).
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The worker the calls come from.
    pub fn worker_info(&self) -> &WorkerInfo {
        &self.shared.me
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
        self.call(to, handler, message, timeout).0
    }

    /// Starts a call; the lane it went on, if it went on one.
    fn call(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> (RpcFuture, Option<Arc<Lane>>) {
        let (future, completion) = RpcFuture::with_spin(self.shared.wait_spin);
        let known = self.shared.group().peers.contains_key(to);
        if !known {
            completion.complete(Err(RpcError::UnknownWorker {
                name: to.to_string(),
            }));
            return (future, None);
        }
        if !self.shared.start_client_call() {
            // An inline handler called while `join` holds the count frozen: waiting for
            // the thaw here would stop the I/O thread that `join` needs.
            completion.complete(Err(RpcError::ShutDown {
                name: self.shared.me.name().to_string(),
            }));
            return (future, None);
        }
        let call = Call {
            message_id: self.shared.next_message_id(),
            peer: to.to_string(),
            handler: handler.to_string(),
            message,
            timeout: timeout.map_or(self.shared.default_timeout, RpcTimeout::from_duration),
            completion,
        };
        // A pipe served by threads takes the request from this thread; otherwise the
        // I/O thread sends it.
        if let Some(lane) = lane::client_lane(&self.shared, to) {
            lane.call(&self.shared, call);
            return (future, Some(lane));
        }
        if let Err(Command::Call(call)) = self.shared.mailbox.push(Command::Call(call)) {
            call.completion.complete_then(
                Err(RpcError::ShutDown {
                    name: self.shared.me.name().to_string(),
                }),
                || self.shared.finish_client_call(),
            );
        }
        (future, None)
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
        let (future, lane) = self.call(to, handler, message, timeout);
        match lane {
            // On a polled lane (shm) the caller reads its reply itself for a while.
            Some(lane) if lane.is_polled() => {
                lane.read_own_reply(&self.shared, future.completion(), self.shared.wait_spin);
                future.wait_sleeping()
            }
            _ => future.wait(),
        }
    }

    /// `remote(to, handler, message)`: runs `handler` on `to`, which keeps its result,
    /// and returns at once an [`RRef`](super::RRef) to it (`to_here` fetches it). The
    /// call counts as in flight until the handler finished, so
    /// [`join`](super::RpcAgent::join) waits for it. Dropping the RRef at once makes
    /// this fire-and-forget.
    ///
    /// # Errors
    /// [`RpcError::UnknownWorker`] at once; later failures (the call's, the handler's)
    /// come out of [`RRef::to_here`](super::RRef::to_here).
    pub fn remote(
        &self,
        to: &str,
        handler: &str,
        message: Message,
    ) -> Result<super::RRef, RpcError> {
        super::rref::remote(&self.shared, to, handler, message, None)
    }
}
