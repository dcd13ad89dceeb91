//! The application's side of an RRef: the [`RRef`] handle (`to_here`, `fork_to`,
//! `local_value`, ...), `remote()`, and turning a received fork back into an RRef. Each
//! call feeds the worker's RRef machine through [`RRefs`](super::RRefs) and leaves the
//! sending to the pump.

use super::*;

/// A remote reference: to a value on its owner, returned by `remote()` at once.
///
/// Clone it for another local reference; drop the last one and the owner learns
/// (`RREF_USER_DELETE`). Send it to another worker with [`fork_to`](RRef::fork_to).
pub struct RRef {
    shared: Arc<Shared>,
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
        let shared = &self.shared;
        let handle = self.handle;
        shared.rrefs.update(|state, _| {
            if let Err(e) = state.machine.clone_handle(&handle) {
                // After a graceful shutdown released it: the copy is as stale as this.
                tracing::debug!(error = %e, "cloning a released RRef");
            }
        });
        RRef {
            shared: Arc::clone(shared),
            handle,
            owner: self.owner.clone(),
        }
    }
}

impl Drop for RRef {
    fn drop(&mut self) {
        let handle = self.handle;
        self.shared.rrefs.update(|state, now| {
            // Released by a graceful shutdown already: nothing to drop.
            let _ = state.machine.drop_handle(now, &handle);
        });
    }
}

impl RRef {
    fn rref_error(&self, reason: String) -> RpcError {
        RpcError::RRef {
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

    /// Whether the owner has confirmed this user (always true on the owner).
    pub fn confirmed_by_owner(&self) -> bool {
        self.shared
            .rrefs
            .lock()
            .machine
            .confirmed_by_owner(&self.handle)
    }

    /// The value, on the owner: `None` while the handler runs (or on a user).
    ///
    /// # Errors
    /// [`RpcError::RRef`] with the handler's error, if it failed.
    pub fn local_value(&self) -> Option<Result<Message, RpcError>> {
        if !self.is_owner() {
            return None;
        }
        let value = self
            .shared
            .rrefs
            .lock()
            .values
            .get(&self.handle.rref)
            .cloned()?;
        Some(value.map_err(|e| self.rref_error(format!("its handler failed: {e}"))))
    }

    /// Fetches the value (payload and tensors) from the owner, waiting for it at most
    /// `timeout` (zero: no limit).
    ///
    /// # Errors
    /// [`RpcError::RRef`], naming the owner: the `remote()` call failed, its handler
    /// failed, the value was not ready in time, or the owner could not be reached (a
    /// dead owner fails at once with the pipe's error).
    pub fn to_here(&self, timeout: Duration) -> Result<Message, RpcError> {
        let rrefs = &self.shared.rrefs;
        let deadline = (!timeout.is_zero()).then(|| std::time::Instant::now() + timeout);
        if self.is_owner() {
            return match rrefs.wait_value(self.handle.rref, deadline) {
                Ok(value) => value.map_err(|e| self.rref_error(format!("its handler failed: {e}"))),
                Err(()) => {
                    Err(self.rref_error(format!("the value is not ready after {timeout:?}")))
                }
            };
        }
        if let Some(failed) = rrefs.lock().failed.get(&self.handle.rref) {
            return Err(self.rref_error(format!(
                "the remote() call that creates it failed: {failed}"
            )));
        }
        let request = FetchRequest {
            rref: self.handle.rref,
            wait_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        }
        .to_bytes()
        .map_err(|e| self.rref_error(e.to_string()))?;
        let client = RpcClient::new(Arc::clone(&self.shared));
        let call_timeout = if timeout.is_zero() {
            Some(Duration::ZERO)
        } else {
            // The owner answers "not ready" at `timeout`; the call's own limit is a bit
            // later so that this answer, not a bare timeout, is what arrives.
            Some(timeout + Duration::from_millis(200))
        };
        client
            .rpc_sync_with_timeout(
                &self.owner,
                FETCH,
                Message::from_payload(request),
                call_timeout,
            )
            .map_err(|e| match e {
                RpcError::Remote { message, .. } => self.rref_error(message),
                other => self.rref_error(format!("to_here could not reach the owner: {other}")),
            })
    }

    /// Passes this RRef to worker `to` (pickling it): bytes to put inside a message to
    /// `to`, which turns them back into an RRef with [`RpcClient::rref_from_fork`]. The
    /// bytes must reach `to` and be turned back exactly once: until then this RRef is
    /// held for them (a user's fork is pending until its child accepts).
    ///
    /// # Errors
    /// [`RpcError::UnknownWorker`] for a worker not in the group; [`RpcError::RRef`]
    /// for this worker itself (clone the RRef instead) or a released RRef.
    pub fn fork_to(&self, to: &str) -> Result<Vec<u8>, RpcError> {
        let to_id = worker_id(&self.shared, to)?;
        let handle = self.handle;
        let data = self
            .shared
            .rrefs
            .update(|state, _| state.machine.fork(&handle, to_id))
            .map_err(|e| self.rref_error(e.to_string()))?;
        data.to_bytes().map_err(|e| self.rref_error(e.to_string()))
    }
}

impl RpcClient {
    /// [`remote`](Self::remote) with a timeout for the call (`None`: the agent's
    /// default; zero: none); past it, `to_here` fails with the timeout.
    ///
    /// # Errors
    /// [`RpcError::UnknownWorker`], at once.
    pub fn remote_with_timeout(
        &self,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<RRef, RpcError> {
        remote(self.shared(), to, handler, message, timeout)
    }

    /// Turns the bytes of [`RRef::fork_to`], received in a message, back into an RRef
    /// (unpickling it). Call it once per fork, in the handler that received them.
    ///
    /// # Errors
    /// [`RpcError::RRef`] for bytes that are no fork, a fork whose owner is not in the
    /// group, or one received twice.
    pub fn rref_from_fork(&self, bytes: &[u8]) -> Result<RRef, RpcError> {
        from_fork(self.shared(), bytes)
    }

    /// This worker's RRef counts (`_rref_context_get_debug_info`).
    pub fn rref_debug_info(&self) -> DebugInfo {
        self.shared().rrefs.debug_info()
    }
}

/// `remote(to, handler, message)` (see the module documentation).
pub(crate) fn remote(
    shared: &Arc<Shared>,
    to: &str,
    handler: &str,
    message: Message,
    timeout: Option<Duration>,
) -> Result<RRef, RpcError> {
    let to_id = worker_id(shared, to)?;
    let rrefs = &shared.rrefs;
    rrefs.ensure_pump(shared);
    let handle = rrefs.update(|state, _| state.machine.remote(to_id));
    let rref = RRef {
        shared: Arc::clone(shared),
        handle,
        owner: to.to_string(),
    };
    let Some(fork) = handle.fork else {
        run_locally(shared, handle.rref, handler, message)?;
        return Ok(rref);
    };
    let header = RemoteCallHeader {
        rref: handle.rref,
        fork,
        handler: handler.to_string(),
    };
    let payload = header
        .prepend(&message.payload)
        .map_err(|e| rref.rref_error(e.to_string()))?;
    let future = RpcClient::new(Arc::clone(shared)).rpc_async_with_timeout(
        to,
        REMOTE,
        Message { payload, ..message },
        timeout,
    );
    rrefs.update(|state, _| {
        state.handed.push((
            Sent::RemoteCall {
                rref: handle.rref,
                fork,
                to: to_id,
            },
            future,
        ));
    });
    Ok(rref)
}

/// `remote()` to this worker itself: the handler runs on a thread of its own.
fn run_locally(
    shared: &Arc<Shared>,
    rref: RRefId,
    handler: &str,
    message: Message,
) -> Result<(), RpcError> {
    let ctx = CallContext {
        caller: shared.me.name().to_string(),
        caller_id: shared.me.id(),
        handler: handler.to_string(),
        message_id: 0,
        client: RpcClient::new(Arc::clone(shared)),
    };
    let owner = Arc::clone(shared);
    let handler = handler.to_string();
    std::thread::Builder::new()
        .name("rdzv-rref-local".into())
        .spawn(move || {
            let result = run_user_handler(&owner, &ctx, &handler, message);
            owner.rrefs.store_value(&owner, rref, result);
        })
        .map(drop)
        .map_err(|e| RpcError::Executor(format!("RRef local handler thread: {e}")))
}

/// Turns the bytes of [`RRef::fork_to`] back into an RRef on this worker.
pub(crate) fn from_fork(shared: &Arc<Shared>, bytes: &[u8]) -> Result<RRef, RpcError> {
    let data = ForkData::from_bytes(bytes).map_err(|e| RpcError::RRef {
        rref: "?".into(),
        owner: "?".into(),
        reason: e.to_string(),
    })?;
    let owner = worker_name(shared, data.owner).ok_or_else(|| RpcError::RRef {
        rref: data.rref.to_string(),
        owner: format!("worker id {}", data.owner.get()),
        reason: "its owner is not a member of this RPC group".into(),
    })?;
    shared.rrefs.ensure_pump(shared);
    let handle = shared
        .rrefs
        .update(|state, now| state.machine.receive_fork(now, data))
        .map_err(|e| RpcError::RRef {
            rref: data.rref.to_string(),
            owner: owner.clone(),
            reason: e.to_string(),
        })?;
    Ok(RRef {
        shared: Arc::clone(shared),
        handle,
        owner,
    })
}
