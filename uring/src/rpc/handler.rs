//! What a handler sees of its caller ([`CallContext`], with a client for nested calls),
//! the [`Handler`] trait, and [`Inline`] handlers. Handlers are registered by name
//! (`super::registry`) and run on the worker pool or, inline, on the thread that read
//! the request.

use rdzv_core::rpc::name::WorkerId;

use super::client::RpcClient;
use super::message::Message;

/// Who called a handler, and a client for calls the handler makes itself (nested calls
/// count as this worker's client calls, so `join` waits for them too).
#[derive(Debug, Clone)]
pub struct CallContext {
    /// The caller's worker name.
    pub caller: String,
    /// The caller's worker id.
    pub caller_id: WorkerId,
    /// The handler name the caller asked for.
    pub handler: String,
    /// The request's message id (unique per caller).
    pub message_id: u64,
    /// Calls through the agent that runs the handler.
    pub client: RpcClient,
}

/// A function peers can call by name. It runs on the agent's worker pool (or, if
/// [`runs_inline`](Handler::runs_inline), on its I/O thread); an `Err` travels back to
/// the caller as the text of [`RpcError::Remote`](super::RpcError::Remote), and so does a panic.
pub trait Handler: Send + Sync + 'static {
    /// Answers `request`.
    ///
    /// # Errors
    /// Any text; the caller's future fails with it.
    fn call(&self, ctx: &CallContext, request: Message) -> Result<Message, String>;

    /// Whether the agent may run this handler on its I/O thread, right where the request
    /// arrived, instead of handing it to the worker pool and the response back: two
    /// thread hand-offs fewer per call (see [`Inline`]). Default `false`.
    fn runs_inline(&self) -> bool {
        false
    }
}

/// A handler that runs on the agent's I/O thread, for short non-blocking work (an echo,
/// a counter, a lookup): it saves the two thread hand-offs of the worker pool, the
/// largest part of a small call's latency.
///
/// While it runs, no other pipe of this worker is read or written, so it must not block.
/// A blocking wait for another call ([`RpcFuture::wait`](super::RpcFuture::wait), `rpc_sync`) from inside it fails
/// at once with an error saying so instead of deadlocking; use `rpc_async` and do not
/// wait, or register the handler normally.
#[derive(Debug, Clone, Copy)]
pub struct Inline<H>(pub H);

impl<H: Handler> Handler for Inline<H> {
    fn call(&self, ctx: &CallContext, request: Message) -> Result<Message, String> {
        self.0.call(ctx, request)
    }

    fn runs_inline(&self) -> bool {
        true
    }
}

/// Runs `handler`, turning a panic into the error text the caller gets.
pub(crate) fn run_handler(
    handler: &dyn Handler,
    ctx: &CallContext,
    message: Message,
) -> Result<Message, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.call(ctx, message)))
        .unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-text panic".to_string());
            Err(format!("handler {} panicked: {what}", ctx.handler))
        })
}

impl<F> Handler for F
where
    F: Fn(&CallContext, Message) -> Result<Message, String> + Send + Sync + 'static,
{
    fn call(&self, ctx: &CallContext, request: Message) -> Result<Message, String> {
        self(ctx, request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::message::Tensor;

    #[test]
    fn closures_are_handlers() {
        fn handler<H: Handler>(h: H) -> H {
            h
        }
        let echo = handler(|_: &CallContext, m: Message| -> Result<Message, String> { Ok(m) });
        let m = Message::from_payload(b"x".to_vec()).with_tensor(Tensor::cpu(vec![1, 2]));
        assert_eq!(m.tensors.len(), 1);
        let _: &dyn Handler = &echo;
    }
}
