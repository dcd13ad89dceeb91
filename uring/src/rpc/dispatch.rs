//! How a call finds its way out: the client lane to its peer when one is open, else the
//! I/O thread's mailbox (which opens the pipe). [`Dispatch`] is the [`Caller`] behind
//! every [`RpcClient`](super::RpcClient); on a polled lane a caller waiting in
//! `rpc_sync` reads its own reply for a while.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdzv_core::rpc::name::WorkerInfo;
use rdzv_core::rpc::timeouts::RpcTimeout;

use super::client::Caller;
use super::counters::JoinGate;
use super::error::{CallError, UsageError};
use super::lane::{self, ClientLane, Lanes};
use super::mailbox::{Call, Command, Mailbox};
use super::message::{Message, RpcFuture};
use super::registry::Registry;
use super::rref::RRefRuntime;

/// What starting a call reads: the group (is the peer known?), the client call count
/// (`join` freezes it), the message ids and default timeout, and where the call goes
/// (a lane, or the I/O thread's mailbox).
pub(crate) struct Dispatch {
    pub me: WorkerInfo,
    pub registry: Arc<Registry>,
    pub gate: Arc<JoinGate>,
    /// The message ids and default timeout of this worker's calls.
    pub ids: CallIds,
    /// The lanes a call may go on.
    pub lanes: Arc<Mutex<Lanes>>,
    /// `RpcOptions::wait_spin`: how long a caller spins on its reply.
    pub wait_spin: Duration,
    /// Calls whose pipe is not open yet go to the I/O thread through it.
    pub mailbox: Arc<Mailbox>,
    /// The RRef runtime, which `remote()` and forks go through (the `rref` module's
    /// seam; the runtime itself sits above the lanes).
    pub rrefs: Arc<dyn RRefRuntime>,
}

/// Issues a call's message id and deadline.
pub(crate) struct CallIds {
    next_message_id: AtomicU64,
    default_timeout: RpcTimeout,
}

impl CallIds {
    /// Ids from 1; calls without a timeout of their own get `default_timeout`.
    pub(crate) fn new(default_timeout: RpcTimeout) -> Self {
        CallIds {
            next_message_id: AtomicU64::new(1),
            default_timeout,
        }
    }

    fn next_message_id(&self) -> u64 {
        self.next_message_id.fetch_add(1, Ordering::Relaxed)
    }
}

impl Dispatch {
    /// Whether a lane to `to` is open (a call to it would not open a pipe).
    pub(crate) fn has_lane(&self, to: &str) -> bool {
        lane::client_lane(&self.lanes, to).is_some()
    }
}

impl Caller for Dispatch {
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
            Some(lane) => lane.wait_reply(future, self.wait_spin),
            None => future.wait(),
        }
    }

    fn rrefs(&self) -> Arc<dyn RRefRuntime> {
        Arc::clone(&self.rrefs)
    }
}

/// Starts a call; the lane it went on, if it went on one.
fn start(
    dispatch: &Dispatch,
    to: &str,
    handler: &str,
    message: Message,
    timeout: Option<Duration>,
) -> (RpcFuture, Option<Arc<ClientLane>>) {
    let (future, completion) = RpcFuture::with_spin(dispatch.wait_spin);
    let known = dispatch.registry.group().peers.contains_key(to);
    if !known {
        completion.complete(Err(CallError::Usage(UsageError::UnknownWorker {
            name: to.to_string(),
        })));
        return (future, None);
    }
    if !dispatch.gate.start_client_call() {
        // An inline handler called while `join` holds the count frozen: waiting for
        // the thaw here would stop the I/O thread that `join` needs.
        completion.complete(Err(CallError::ShutDown {
            name: dispatch.me.name().to_string(),
        }));
        return (future, None);
    }
    let call = Call {
        message_id: dispatch.ids.next_message_id(),
        peer: to.to_string(),
        handler: handler.to_string(),
        message,
        timeout: timeout.map_or(dispatch.ids.default_timeout, RpcTimeout::from_duration),
        completion,
    };
    // A pipe served by threads takes the request from this thread; otherwise the
    // I/O thread sends it.
    if let Some(lane) = lane::client_lane(&dispatch.lanes, to) {
        lane.call(dispatch.me.name(), call);
        return (future, Some(lane));
    }
    if let Err(Command::Call(call)) = dispatch.mailbox.push(Command::Call(call)) {
        call.completion.complete_then(
            Err(CallError::ShutDown {
                name: dispatch.me.name().to_string(),
            }),
            || dispatch.gate.finish_client_call(),
        );
    }
    (future, None)
}
