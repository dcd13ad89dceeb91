//! What a handler sees of its caller ([`CallContext`], with a client for nested calls),
//! the [`Handler`] trait, and [`Inline`] handlers. Handlers are registered by name
//! (`super::registry`) and run on the worker pool, on the thread that read the request
//! in a worker slot ([`Handler::runs_on_reader`]), or, inline, on the thread that read
//! the request.

use rdzv_core::rpc::name::WorkerId;

use super::client::RpcClient;
use super::message::{Message, RpcFuture};

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
/// [`runs_inline`](Handler::runs_inline), on its I/O thread; if
/// [`runs_on_reader`](Handler::runs_on_reader), on the thread that read the request
/// while a worker slot is free); an `Err` travels back to
/// the caller as the text of [`CallError::Remote`](super::CallError::Remote), and so does a panic.
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

    /// Whether the thread that read the request may run this handler itself, which may
    /// block: the reader hands its pipe to another thread if the handler runs past
    /// 2 ms, and a request finds a free worker slot
    /// (`num_worker_threads` of them, shared with the pool) or goes to the pool. It
    /// saves the pool's two thread hand-offs where handlers are quick. Default `false`;
    /// `rdzv.rpc`'s Python handler says `true`.
    fn runs_on_reader(&self) -> bool {
        false
    }

    /// Answers `request` now or later: the worker pool calls this, and the default
    /// answers now with [`call`](Handler::call). An [`Async`] handler answers later.
    fn reply(&self, ctx: &CallContext, request: Message) -> Reply {
        Reply::Now(self.call(ctx, request))
    }
}

/// A handler's answer, as the worker pool sees it.
#[derive(Debug)]
pub enum Reply {
    /// The response (or the error text), ready.
    Now(Result<Message, String>),
    /// A future of the response: the pool thread goes on to the next request, and the
    /// response is sent when the future completes (an error as its text).
    Later(RpcFuture),
}

/// A handler that answers later (PyTorch's `@rpc.functions.async_execution`): it
/// returns an [`RpcFuture`] at once, typically of a nested call
/// (`ctx.client.rpc_async(...)`, perhaps chained with [`RpcFuture::then`]), and the pool
/// thread is free for the next request while it is pending. The response is sent from
/// the thread that completes the future. While pending, the request is counted in
/// `agent.server_active_async_calls` (and in `agent.server_active_calls`).
///
/// Run inline (inside [`Inline`]) or through [`call`](Handler::call), it waits for its
/// future.
#[derive(Debug, Clone, Copy)]
pub struct Async<F>(pub F);

impl<F> Handler for Async<F>
where
    F: Fn(&CallContext, Message) -> RpcFuture + Send + Sync + 'static,
{
    fn call(&self, ctx: &CallContext, request: Message) -> Result<Message, String> {
        (self.0)(ctx, request).wait().map_err(|e| e.to_string())
    }

    fn reply(&self, ctx: &CallContext, request: Message) -> Reply {
        Reply::Later((self.0)(ctx, request))
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

/// Where a request's handler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// On the thread that read the request, which must not block ([`Inline`]).
    Inline,
    /// On the thread that read the request, in a worker slot, watched
    /// ([`Handler::runs_on_reader`]).
    Reader,
    /// On the worker pool.
    Pool,
}

/// Where `handler` runs.
pub(crate) fn placement(handler: &dyn Handler) -> Placement {
    if handler.runs_inline() {
        Placement::Inline
    } else if handler.runs_on_reader() {
        Placement::Reader
    } else {
        Placement::Pool
    }
}

/// Runs `handler`, turning a panic into the error text the caller gets.
pub(crate) fn run_handler(
    handler: &dyn Handler,
    ctx: &CallContext,
    message: Message,
) -> Result<Message, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.call(ctx, message)))
        .unwrap_or_else(|panic| Err(panic_text(ctx, panic.as_ref())))
}

/// [`run_handler`] for the worker pool: the handler may answer later.
pub(crate) fn run_handler_reply(
    handler: &dyn Handler,
    ctx: &CallContext,
    message: Message,
) -> Reply {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.reply(ctx, message)))
        .unwrap_or_else(|panic| Reply::Now(Err(panic_text(ctx, panic.as_ref()))))
}

fn panic_text(ctx: &CallContext, panic: &(dyn std::any::Any + Send)) -> String {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text panic".to_string());
    format!("handler {} panicked: {what}", ctx.handler)
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
    use std::time::Duration;

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

    /// A caller whose calls echo at once.
    struct Echoes(rdzv_core::rpc::name::WorkerInfo);

    impl crate::rpc::client::Caller for Echoes {
        fn worker_info(&self) -> &rdzv_core::rpc::name::WorkerInfo {
            &self.0
        }
        fn call(&self, _: &str, _: &str, m: Message, _: Option<Duration>) -> RpcFuture {
            RpcFuture::ready(Ok(m))
        }
        fn call_and_wait(
            &self,
            _: &str,
            _: &str,
            m: Message,
            _: Option<Duration>,
        ) -> Result<Message, crate::rpc::CallError> {
            Ok(m)
        }
        fn rrefs(&self) -> std::sync::Arc<dyn crate::rpc::rref::RRefRuntime> {
            panic!("these handler tests make no RRefs")
        }
    }

    fn context() -> CallContext {
        let me = rdzv_core::rpc::name::WorkerInfo::new("b", 1).unwrap_or_else(|e| panic!("{e}"));
        CallContext {
            caller: "a".into(),
            caller_id: WorkerId::from(0),
            handler: "h".into(),
            message_id: 1,
            client: RpcClient::new(std::sync::Arc::new(Echoes(me))),
        }
    }

    #[test]
    fn async_handlers_answer_later_and_wait_when_called_directly() {
        let relay = Async(|ctx: &CallContext, m: Message| {
            ctx.client.rpc_async(&ctx.caller, "echo", m).then(|r| {
                r.map(|mut m| {
                    m.payload.push(9);
                    m
                })
            })
        });
        let ctx = context();
        match run_handler_reply(&relay, &ctx, Message::from_payload(vec![1])) {
            Reply::Later(future) => {
                assert_eq!(future.wait().map(|m| m.payload).ok(), Some(vec![1, 9]));
            }
            Reply::Now(r) => panic!("answered now: {r:?}"),
        }
        assert_eq!(
            relay.call(&ctx, Message::default()).map(|m| m.payload),
            Ok(vec![9])
        );
        let sync = |_: &CallContext, m: Message| -> Result<Message, String> { Ok(m) };
        assert!(matches!(
            run_handler_reply(&sync, &ctx, Message::default()),
            Reply::Now(Ok(_))
        ));
    }

    #[test]
    fn an_async_handler_that_panics_answers_now_with_the_text() {
        let boom = Async(|_: &CallContext, _: Message| -> RpcFuture { panic!("async boom") });
        match run_handler_reply(&boom, &context(), Message::default()) {
            Reply::Now(Err(text)) => assert_eq!(text, "handler h panicked: async boom"),
            other => panic!("{other:?}"),
        }
    }
}
