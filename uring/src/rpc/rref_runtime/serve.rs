//! The owner's and receiver's side: the reserved handlers that take the machine's
//! messages and `remote()` calls, and the `to_here` fetches the inbound lanes hand over,
//! answered now or once the value exists, without holding a thread.

use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::rref::wire::{handler, FetchRequest, RemoteCallHeader};
use rdzv_core::rpc::rref::{DebugInfo, RRefMessage};

use super::{RRefs, Waiter};
use crate::rpc::handler::{run_handler, CallContext, Handler, Inline};
use crate::rpc::message::Message;
use crate::rpc::rref::RRefRuntime;
use crate::rpc::rref::Respond;

/// Registers the reserved handlers (the agent owns its handlers; they hold the runtime
/// weakly).
pub(crate) fn register_handlers(rrefs: &Arc<RRefs>) {
    let mut handlers = rrefs.registry.handlers_mut();
    let weak = Arc::downgrade(rrefs);
    let message = move |ctx: &CallContext, m: Message| -> Result<Message, String> {
        let rrefs = weak.upgrade().ok_or("the agent is gone")?;
        on_message(&rrefs, ctx, &m)
    };
    let message: Arc<dyn Handler> = Arc::new(Inline(message));
    for name in [
        handler::REMOTE_RET,
        handler::FORK_REQUEST,
        handler::CHILD_ACCEPT,
        handler::USER_DELETE,
        handler::ACK,
    ] {
        handlers.insert(name.to_string(), Arc::clone(&message));
    }
    let weak = Arc::downgrade(rrefs);
    let remote = move |ctx: &CallContext, m: Message| -> Result<Message, String> {
        let rrefs = weak.upgrade().ok_or("the agent is gone")?;
        on_remote(&rrefs, ctx, m)
    };
    handlers.insert(handler::REMOTE.to_string(), Arc::new(remote));
    let weak = Arc::downgrade(rrefs);
    let debug = move |_: &CallContext, _: Message| -> Result<Message, String> {
        let rrefs = weak.upgrade().ok_or("the agent is gone")?;
        Ok(Message::from_payload(encode_counts(&rrefs.debug_info())))
    };
    handlers.insert(handler::DEBUG_INFO.to_string(), Arc::new(Inline(debug)));
}

/// A machine message from `ctx.caller_id`; a control message's `Ack` is the response.
fn on_message(rrefs: &Arc<RRefs>, ctx: &CallContext, m: &Message) -> Result<Message, String> {
    let message = RRefMessage::from_bytes(&m.payload).map_err(|e| e.to_string())?;
    if let RRefMessage::RemoteCall { .. } = message {
        return Err("a RemoteCall travels in the remote() call, not alone".into());
    }
    let from = ctx.caller_id;
    let answer = rrefs.update(|state, now| state.machine.handle_call(now, from, message));
    rrefs.ensure_pump();
    match answer {
        Some(answer) => answer
            .to_bytes()
            .map(Message::from_payload)
            .map_err(|e| e.to_string()),
        None => Ok(Message::default()),
    }
}

/// The owner's side of `remote()`, on the pool: the handler's value. The slot and
/// `RemoteRet` came first, when the request arrived (`remote_call_arrived`).
fn on_remote(rrefs: &Arc<RRefs>, ctx: &CallContext, m: Message) -> Result<Message, String> {
    let (header, payload) = RemoteCallHeader::split(&m.payload).map_err(|e| e.to_string())?;
    let RemoteCallHeader { rref, handler, .. } = header;
    let payload = payload.to_vec();
    let request = Message { payload, ..m };
    let result = run_user_handler(rrefs, ctx, &handler, request);
    rrefs.store_value(rref, result);
    Ok(Message::default())
}

/// Runs the application's `handler` for a `remote()` call.
pub(super) fn run_user_handler(
    rrefs: &RRefs,
    ctx: &CallContext,
    handler: &str,
    request: Message,
) -> Result<Message, String> {
    let found = (!handler.starts_with("__rdzv_"))
        .then(|| rrefs.registry.handler(handler))
        .flatten();
    let Some(found) = found else {
        return Err(format!(
            "no RPC handler named {handler} is registered on worker {}; register it before \
             peers call remote() with it",
            rrefs.me.name()
        ));
    };
    let ctx = CallContext {
        handler: handler.to_string(),
        ..ctx.clone()
    };
    run_handler(found.as_ref(), &ctx, request)
}

impl RRefs {
    /// `to_here` on the owner ([`RRefRuntime::fetch_arrived`]): a request whose value
    /// exists is answered at once; one whose value does not yet waits without a thread
    /// (an async server call) until the value is stored or its deadline.
    pub(super) fn serve_fetch(&self, payload: &[u8], respond: Respond) {
        let request = match FetchRequest::from_bytes(payload) {
            Ok(request) => request,
            Err(e) => {
                self.gate.server_call_finished();
                return respond(Err(e.to_string()));
            }
        };
        let wait = Duration::from_millis(request.wait_ms);
        let mut state = self.lock();
        if let Some(value) = state.values.get(&request.rref).cloned() {
            drop(state);
            self.gate.server_call_finished();
            return respond(value);
        }
        let deadline = (request.wait_ms != 0).then(|| std::time::Instant::now() + wait);
        self.gate.server_call_went_async();
        state.waiters.push(Waiter {
            rref: request.rref,
            respond,
            deadline,
            wait,
        });
        drop(state);
        // The pump keeps the deadline.
        self.signal.notify();
    }
}

/// The four debug counts as the `DEBUG_INFO` handler's answer.
fn encode_counts(info: &DebugInfo) -> Vec<u8> {
    [
        info.num_owner_rrefs,
        info.num_pending_futures,
        info.num_pending_users,
        info.num_forks,
    ]
    .iter()
    .flat_map(|&n| (n as u64).to_le_bytes())
    .collect()
}

/// Reads [`encode_counts`]' bytes; `None` unless they are exactly four counts.
pub(super) fn decode_counts(bytes: &[u8]) -> Option<DebugInfo> {
    let mut numbers = bytes
        .chunks_exact(8)
        .map(|c| <[u8; 8]>::try_from(c).ok().map(u64::from_le_bytes));
    let mut next = || {
        numbers
            .next()
            .flatten()
            .and_then(|n| usize::try_from(n).ok())
    };
    let info = DebugInfo {
        num_owner_rrefs: next()?,
        num_pending_futures: next()?,
        num_pending_users: next()?,
        num_forks: next()?,
    };
    (bytes.len() == 32).then_some(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_trip_and_bad_bytes_are_refused() {
        let info = DebugInfo {
            num_owner_rrefs: 3,
            num_pending_futures: 1,
            num_pending_users: 0,
            num_forks: 7,
        };
        assert_eq!(decode_counts(&encode_counts(&info)), Some(info));
        assert_eq!(decode_counts(&[0; 31]), None);
        assert_eq!(decode_counts(&[0; 40]), None);
    }
}
