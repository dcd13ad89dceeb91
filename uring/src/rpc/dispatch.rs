//! How a call finds its way out: the client lane to its peer when one is open, else the
//! I/O thread's mailbox (which opens the pipe). [`Shared`] is the [`Caller`] behind every
//! [`RpcClient`](super::RpcClient); on a polled lane a caller waiting in `rpc_sync`
//! reads its own reply for a while.

use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::name::WorkerInfo;
use rdzv_core::rpc::timeouts::RpcTimeout;

use super::client::Caller;
use super::error::{CallError, UsageError};
use super::lane::{self, Lane, Shared};
use super::mailbox::{Call, Command};
use super::message::{Message, RpcFuture};
use super::rref::RRefRuntime;

impl Caller for Shared {
    fn worker_info(&self) -> &WorkerInfo {
        &self.me
    }

    fn call(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> RpcFuture {
        start(self, to, handler, message, timeout).0
    }

    fn call_and_wait(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<Message, CallError> {
        let (future, lane) = start(self, to, handler, message, timeout);
        match lane {
            // On a lane the caller reads its reply itself for a while.
            Some(lane) => {
                lane.read_own_reply(self, future.completion(), self.wait_spin);
                future.wait_sleeping()
            }
            None => future.wait(),
        }
    }

    fn rrefs(&self) -> Arc<dyn RRefRuntime> {
        Arc::clone(&self.rrefs)
    }
}

/// Starts a call; the lane it went on, if it went on one.
fn start(
    shared: &Shared,
    to: &str,
    handler: &str,
    message: Message,
    timeout: Option<Duration>,
) -> (RpcFuture, Option<Arc<Lane>>) {
    let (future, completion) = RpcFuture::with_spin(shared.wait_spin);
    let known = shared.registry.group().peers.contains_key(to);
    if !known {
        completion.complete(Err(CallError::Usage(UsageError::UnknownWorker {
            name: to.to_string(),
        })));
        return (future, None);
    }
    if !shared.gate.start_client_call() {
        // An inline handler called while `join` holds the count frozen: waiting for
        // the thaw here would stop the I/O thread that `join` needs.
        completion.complete(Err(CallError::ShutDown {
            name: shared.me.name().to_string(),
        }));
        return (future, None);
    }
    let call = Call {
        message_id: shared.next_message_id(),
        peer: to.to_string(),
        handler: handler.to_string(),
        message,
        timeout: timeout.map_or(shared.default_timeout, RpcTimeout::from_duration),
        completion,
    };
    // A pipe served by threads takes the request from this thread; otherwise the
    // I/O thread sends it.
    if let Some(lane) = lane::client_lane(shared, to) {
        lane.call(shared, call);
        return (future, Some(lane));
    }
    if let Err(Command::Call(call)) = shared.mailbox.push(Command::Call(call)) {
        call.completion.complete_then(
            Err(CallError::ShutDown {
                name: shared.me.name().to_string(),
            }),
            || shared.gate.finish_client_call(),
        );
    }
    (future, None)
}
