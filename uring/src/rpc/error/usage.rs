//! [`UsageError`]: the application used the API wrongly. Retrying the same call cannot
//! help; the program must change.

/// The API was used wrongly (h2's `UserError`): an unknown worker, a handler registered
/// twice, a blocking wait inside an [`Inline`](crate::rpc::Inline) handler, a callback that
/// panicked, an RRef used in a way it cannot be.
///
/// Calls that can fail only by misuse return it directly; a call that can also fail on
/// the network carries it inside [`CallError::Usage`](super::CallError::Usage).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UsageError {
    /// No worker of that name is in the group.
    #[error("could not find destination worker {name}: it is not a member of this RPC group")]
    UnknownWorker {
        /// The name asked for.
        name: String,
    },
    /// No worker of that id is in the group.
    #[error("unknown worker id {id}: no member of this RPC group has it")]
    UnknownWorkerId {
        /// The id asked for.
        id: i64,
    },
    /// A handler with that name is registered already (names starting with `__rdzv_` are
    /// the agent's own).
    #[error("an RPC handler named {name} is already registered")]
    HandlerExists {
        /// The name.
        name: String,
    },
    /// A blocking wait ran on the agent's I/O thread (inside an inline handler).
    #[error("a blocking wait for an RPC result inside an inline handler (rpc::Inline) would stop this worker's I/O thread and deadlock; use rpc_async without waiting, or register the handler without Inline")]
    BlockingInline,
    /// A future's callback ([`RpcFuture::then`](crate::rpc::RpcFuture::then)) panicked.
    #[error("an RPC future's callback panicked: {what}")]
    CallbackPanicked {
        /// The panic's text.
        what: String,
    },
    /// A future's result was taken already (it was polled after it completed).
    #[error(
        "invalid use of an RpcFuture: the result was taken already (polled after it completed)"
    )]
    FutureTaken,
    /// The [`RpcPromise`](crate::rpc::RpcPromise) of a future was dropped unkept.
    #[error("the promise of this RPC future was dropped without completing it (the code that was to answer it ended early)")]
    PromiseDropped,
    /// An argument has a value the call cannot use.
    #[error("invalid argument {argument}: {reason}")]
    InvalidArgument {
        /// The argument.
        argument: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An RRef was used in a way it cannot be: bytes that are no fork, a fork whose owner
    /// is not in the group or that was received twice, a fork to this worker itself, a
    /// released RRef.
    #[error("RRef {rref} owned by {owner}: {reason}")]
    RRef {
        /// The RRef's id (`?` when the bytes do not say).
        rref: String,
        /// Its owner's worker name.
        owner: String,
        /// Why.
        reason: String,
    },
}

impl UsageError {
    /// The worker the misuse names, where it names one.
    pub fn peer(&self) -> Option<&str> {
        match self {
            UsageError::UnknownWorker { name } => Some(name),
            UsageError::RRef { owner, .. } => Some(owner),
            _ => None,
        }
    }
}
