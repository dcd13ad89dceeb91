//! Remote references as the application holds them: the [`RRef`] handle (`to_here`,
//! `fork_to`, `local_value`, ...) and what a graceful shutdown reports of them. `remote()`
//! itself is [`RpcClient::remote`](super::RpcClient::remote).
//!
//! This module decides nothing and sends nothing: every rule of the reference counting
//! is core's machine (`rdzv_core::rpc::rref`), and the agent's runtime that drives it
//! (`rref_runtime`: the owner's values, the reserved handlers, the pump) sits above the
//! pipes. An [`RRef`] reaches that runtime through the `RRefRuntime` seam, as an
//! [`RpcClient`](super::RpcClient) reaches its pipes through `Caller`, so that the
//! handle can live in the calls layer, beside the futures.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::rref::{DebugInfo, ForkData, Leak, RRefHandle, RRefId};

use super::error::{CallError, RRefFailure, UsageError};
use super::message::Message;

/// What an [`RRef`] and `remote()` need of the agent's RRef runtime
/// (`rref_runtime::RRefs` implements it). Errors that are about one RRef come back as
/// text (with their kind, for `to_here`), which the handle wraps in
/// [`CallError::RRef`] or [`UsageError::RRef`] with the RRef's id and owner.
pub(crate) trait RRefRuntime: Send + Sync + 'static {
    /// `remote(to, handler, message)` with a call timeout (`None`: the agent's
    /// default).
    fn remote(
        self: Arc<Self>,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<RRef, CallError>;

    /// A `remote()` call from worker `caller` arrived, with its request `payload`: the
    /// owner's machine takes its `RemoteCall` now, in the order the pipe delivered it,
    /// before the worker pool runs its handler, so that the caller's later messages on
    /// that pipe (its `USER_DELETE` after a call that timed out in the pool's queue) are
    /// handled after it, as core's machine assumes.
    fn remote_call_arrived(self: Arc<Self>, caller: WorkerId, payload: &[u8]);

    /// A `to_here` request arrived with `payload` (already counted as a server call): it
    /// is answered through `respond` at once if the value exists, else once the value is
    /// stored or the request's wait is over, holding no thread meanwhile (an async
    /// server call). The inbound lane hands it here on its reader, never to the pool.
    fn fetch_arrived(&self, payload: &[u8], respond: Respond);

    /// Turns the bytes of [`RRef::fork_to`] back into an RRef on this worker.
    fn from_fork(self: Arc<Self>, bytes: &[u8]) -> Result<RRef, UsageError>;

    /// This worker's RRef counts.
    fn debug_info(&self) -> DebugInfo;

    /// One more local reference to `handle`.
    fn clone_handle(&self, handle: &RRefHandle);

    /// One local reference to `handle` fewer.
    fn drop_handle(&self, handle: &RRefHandle);

    /// Whether the owner has confirmed this user.
    fn confirmed_by_owner(&self, handle: &RRefHandle) -> bool;

    /// The owner's value of `rref` (or its handler's error), once it exists.
    fn local_value(&self, rref: RRefId) -> Option<Result<Message, String>>;

    /// Fetches the value from its owner `owner`, waiting at most `timeout` (zero: no
    /// limit).
    fn to_here(
        &self,
        handle: &RRefHandle,
        owner: &str,
        timeout: Duration,
    ) -> Result<Message, RRefFailure>;

    /// The id of worker `name`.
    fn worker_id(&self, name: &str) -> Result<WorkerId, UsageError>;

    /// Forks `handle` to worker `to`.
    fn fork(&self, handle: &RRefHandle, to: WorkerId) -> Result<ForkData, String>;
}

/// Sends the response of a request that arrived on an inbound lane.
pub(crate) type Respond = Box<dyn FnOnce(Result<Message, String>) + Send>;

/// A remote reference: to a value on its owner, returned by `remote()` at once.
///
/// Clone it for another local reference; drop the last one and the owner learns
/// (`RREF_USER_DELETE`). Send it to another worker with [`fork_to`](RRef::fork_to).
pub struct RRef {
    runtime: Arc<dyn RRefRuntime>,
    handle: RRefHandle,
    owner: String,
}

/// PyTorch's name for an RRef held by a worker that is not its owner; [`RRef`] is
/// either.
pub type UserRRef = RRef;

impl std::fmt::Debug for RRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RRef")
            .field("rref", &self.handle.rref)
            .field("owner", &self.owner)
            .field("fork", &self.handle.fork)
            .finish()
    }
}

impl Clone for RRef {
    fn clone(&self) -> RRef {
        self.runtime.clone_handle(&self.handle);
        RRef {
            runtime: Arc::clone(&self.runtime),
            handle: self.handle,
            owner: self.owner.clone(),
        }
    }
}

impl Drop for RRef {
    fn drop(&mut self) {
        self.runtime.drop_handle(&self.handle);
    }
}

impl RRef {
    /// The handle for a reference the runtime has counted already.
    pub(crate) fn new(runtime: Arc<dyn RRefRuntime>, handle: RRefHandle, owner: String) -> RRef {
        RRef {
            runtime,
            handle,
            owner,
        }
    }

    /// [`CallError::RRef`] about this RRef.
    pub(crate) fn call_error(&self, reason: RRefFailure) -> CallError {
        CallError::RRef {
            rref: self.handle.rref.to_string(),
            owner: self.owner.clone(),
            reason,
        }
    }

    /// [`UsageError::RRef`] about this RRef.
    fn usage_error(&self, reason: String) -> UsageError {
        UsageError::RRef {
            rref: self.handle.rref.to_string(),
            owner: self.owner.clone(),
            reason,
        }
    }

    /// The owner's worker name (`owner_name()`).
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The owner's worker id (`owner().id`).
    pub fn owner_id(&self) -> WorkerId {
        self.handle.owner
    }

    /// The RRef's id (PyTorch's `GloballyUniqueId`).
    pub fn id(&self) -> RRefId {
        self.handle.rref
    }

    /// Whether this worker owns the value.
    pub fn is_owner(&self) -> bool {
        self.handle.is_owner()
    }

    /// Whether the owner has confirmed this user (always true on the owner; never for
    /// a user whose `remote()` call failed, which unlike PyTorch's is not reported as
    /// confirmed, though it is no longer pending either).
    pub fn confirmed_by_owner(&self) -> bool {
        self.runtime.confirmed_by_owner(&self.handle)
    }

    /// The value, on the owner: `None` while the handler runs (or on a user).
    ///
    /// # Errors
    /// [`CallError::RRef`] (kind [`CallErrorKind::Remote`](crate::rpc::CallErrorKind::Remote)) with the handler's error, if
    /// it failed.
    pub fn local_value(&self) -> Option<Result<Message, CallError>> {
        if !self.is_owner() {
            return None;
        }
        let value = self.runtime.local_value(self.handle.rref)?;
        Some(value.map_err(|e| self.call_error(RRefFailure::Handler { message: e })))
    }

    /// Fetches the value (payload and tensors) from the owner, waiting for it at most
    /// `timeout` (zero: no limit).
    ///
    /// # Errors
    /// [`CallError::RRef`], naming the owner, whose [`kind`](CallError::kind) says what
    /// failed: the `remote()` call ("RRef creation via rpc.remote() failed", as PyTorch
    /// words it; the call's own kind), its handler ([`CallErrorKind::Remote`](crate::rpc::CallErrorKind::Remote)), the value
    /// was not ready in time ([`CallErrorKind::Timeout`](crate::rpc::CallErrorKind::Timeout)), or the owner could not be
    /// reached (a dead owner fails at once with the pipe's error and kind).
    pub fn to_here(&self, timeout: Duration) -> Result<Message, CallError> {
        self.runtime
            .to_here(&self.handle, &self.owner, timeout)
            .map_err(|failure| self.call_error(failure))
    }

    /// Passes this RRef to worker `to` (pickling it): bytes to put inside a message to
    /// `to`, which turns them back into an RRef with
    /// [`RpcClient::rref_from_fork`](super::RpcClient::rref_from_fork). The bytes must
    /// reach `to` and be turned back exactly once: until then this RRef is held for them
    /// (a user's fork is pending until its child accepts).
    ///
    /// # Errors
    /// [`UsageError::UnknownWorker`] for a worker not in the group; [`UsageError::RRef`]
    /// for this worker itself (clone the RRef instead), a released RRef, or one whose
    /// `remote()` call failed.
    pub fn fork_to(&self, to: &str) -> Result<Vec<u8>, UsageError> {
        let to_id = self.runtime.worker_id(to)?;
        let data = self
            .runtime
            .fork(&self.handle, to_id)
            .map_err(|reason| self.usage_error(reason))?;
        data.to_bytes().map_err(|e| self.usage_error(e.to_string()))
    }
}

/// One thing a graceful shutdown could not settle, with the owner's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RRefLeak {
    /// The owner (for an unanswered message: the worker it went to).
    pub owner: String,
    /// What leaks, in words (the RRef and fork ids, and why).
    pub what: String,
    /// The core's record of it.
    pub leak: Leak,
}

/// What a graceful shutdown left of the RRefs: PyTorch's leak check, reported by count
/// and owner rather than raised.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RRefShutdownReport {
    /// Users, forks and messages that were never settled.
    pub leaks: Vec<RRefLeak>,
    /// Owner values here that other workers still referenced when the wait ended.
    pub owner_rrefs_left: usize,
    /// The counts when the wait ended.
    pub debug_info: DebugInfo,
}

impl RRefShutdownReport {
    /// Whether everything was settled.
    pub fn is_clean(&self) -> bool {
        self.leaks.is_empty() && self.owner_rrefs_left == 0
    }

    /// Leaks by owner name.
    pub fn by_owner(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for leak in &self.leaks {
            *counts.entry(leak.owner.clone()).or_insert(0) += 1;
        }
        counts
    }
}
