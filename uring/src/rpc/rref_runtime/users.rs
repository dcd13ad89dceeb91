//! The [`RRefRuntime`] seam: what an application's [`RRef`] and `remote()` do to this
//! worker's machine. Each call feeds the machine and leaves the sending to the pump.

use std::sync::Arc;
use std::time::Duration;

use rdzv_core::rpc::name::WorkerId;
use rdzv_core::rpc::rref::wire::{handler, FetchRequest, RemoteCallHeader};
use rdzv_core::rpc::rref::{
    DebugInfo, ForkData, ForkId, RRefError, RRefHandle, RRefId, RRefMessage,
};

use super::pump::{on_sent, Sent};
use super::serve::run_user_handler;
use super::RRefs;
use crate::rpc::error::{CallError, RRefFailure, UsageError};
use crate::rpc::handler::CallContext;
use crate::rpc::message::Message;
use crate::rpc::rref::{RRef, RRefRuntime, Respond};

impl RRefRuntime for RRefs {
    fn remote(
        self: Arc<Self>,
        to: &str,
        handler: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<RRef, CallError> {
        let to_id = self.worker_id(to).map_err(CallError::Usage)?;
        self.ensure_pump();
        let handle = self.update(|state, _| state.machine.remote(to_id));
        let rref = RRef::new(
            Arc::clone(&self) as Arc<dyn RRefRuntime>,
            handle,
            to.to_string(),
        );
        let Some(fork) = handle.fork else {
            self.run_locally(handle.rref, handler, message)?;
            return Ok(rref);
        };
        let header = RemoteCallHeader {
            rref: handle.rref,
            fork,
            handler: handler.to_string(),
        };
        let payload = header
            .prepend(&message.payload)
            .map_err(|e| rref.call_error(RRefFailure::Encode(e)))?;
        let future = self.client()?.rpc_async_with_timeout(
            to,
            handler::REMOTE,
            Message { payload, ..message },
            timeout,
        );
        let sent = Sent::RemoteCall {
            rref: handle.rref,
            fork,
            to: to_id,
        };
        // The answer (or the failure) is fed to the machine on the thread that completes
        // the call, at once if it failed already (a send refused before it left, as fault
        // injection's: the RRef then comes back failed, as in PyTorch, rather than a
        // moment later). The pump is woken only if that leaves something to send.
        let weak = Arc::downgrade(&self);
        future.on_done(move |result| {
            if let Some(rrefs) = weak.upgrade() {
                rrefs.update(|state, now| on_sent(state, now, sent, result));
            }
        });
        Ok(rref)
    }

    fn remote_call_arrived(self: Arc<Self>, caller: WorkerId, payload: &[u8]) {
        // A header that does not parse fails the call when the pool runs it.
        let Ok((header, _)) = RemoteCallHeader::split(payload) else {
            return;
        };
        let (rref, fork) = (header.rref, header.fork);
        // The machine's `RemoteRet` is the call's own response, sent when the handler has
        // run (`handle_call` returns it rather than queuing a call of its own).
        self.update(|state, now| {
            state
                .machine
                .handle_call(now, caller, RRefMessage::RemoteCall { rref, fork });
        });
        self.ensure_pump();
    }

    fn fetch_arrived(&self, payload: &[u8], respond: Respond) {
        self.serve_fetch(payload, respond);
    }

    fn from_fork(self: Arc<Self>, bytes: &[u8]) -> Result<RRef, UsageError> {
        let data = ForkData::from_bytes(bytes).map_err(|e| UsageError::RRef {
            rref: "?".into(),
            owner: "?".into(),
            reason: e.to_string(),
        })?;
        let owner = self
            .worker_name(data.owner)
            .ok_or_else(|| UsageError::RRef {
                rref: data.rref.to_string(),
                owner: format!("worker id {}", data.owner.get()),
                reason: "its owner is not a member of this RPC group".into(),
            })?;
        self.ensure_pump();
        let handle = self
            .update(|state, now| state.machine.receive_fork(now, data))
            .map_err(|e| UsageError::RRef {
                rref: data.rref.to_string(),
                owner: owner.clone(),
                reason: e.to_string(),
            })?;
        Ok(RRef::new(self as Arc<dyn RRefRuntime>, handle, owner))
    }

    fn debug_info(&self) -> DebugInfo {
        self.lock().machine.debug_info()
    }

    fn clone_handle(&self, handle: &RRefHandle) {
        self.update(|state, _| {
            if let Err(e) = state.machine.clone_handle(handle) {
                // After a graceful shutdown released it: the copy is as stale as this.
                tracing::debug!(error = %e, "cloning a released RRef");
            }
        });
    }

    fn drop_handle(&self, handle: &RRefHandle) {
        self.update(|state, now| {
            // Released by a graceful shutdown already: nothing to drop.
            let _ = state.machine.drop_handle(now, handle);
        });
    }

    fn confirmed_by_owner(&self, handle: &RRefHandle) -> bool {
        self.lock().machine.confirmed_by_owner(handle)
    }

    fn local_value(&self, rref: RRefId) -> Option<Result<Message, String>> {
        self.lock().values.get(&rref).cloned()
    }

    fn to_here(
        &self,
        handle: &RRefHandle,
        owner: &str,
        timeout: Duration,
    ) -> Result<Message, RRefFailure> {
        let deadline = (!timeout.is_zero()).then(|| std::time::Instant::now() + timeout);
        if handle.is_owner() {
            return match self.wait_value(handle.rref, deadline) {
                Ok(value) => value.map_err(|message| RRefFailure::Handler { message }),
                Err(()) => Err(RRefFailure::NotReady { timeout }),
            };
        }
        let Some(fork) = handle.fork else {
            return Err(RRefFailure::NoFork);
        };
        if let Some(error) = self.creation_failure(fork) {
            return Err(error);
        }
        let request = FetchRequest {
            rref: handle.rref,
            wait_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        }
        .to_bytes()
        .map_err(RRefFailure::Encode)?;
        let call_timeout = if timeout.is_zero() {
            Some(Duration::ZERO)
        } else {
            // The owner answers "not ready" at `timeout`; the call's own limit is a bit
            // later so that this answer, not a bare timeout, is what arrives.
            Some(timeout + Duration::from_millis(200))
        };
        let unreachable = |e: CallError| RRefFailure::Unreachable {
            source: Box::new(e),
        };
        let client = self.client().map_err(unreachable)?;
        client
            .rpc_sync_with_timeout(
                owner,
                handler::FETCH,
                Message::from_payload(request),
                call_timeout,
            )
            .map_err(|e| {
                // The call that creates it may have failed meanwhile: that is the reason.
                if let Some(error) = self.creation_failure(fork) {
                    return error;
                }
                match e {
                    CallError::Remote { message, .. } => RRefFailure::Owner { message },
                    other => unreachable(other),
                }
            })
    }

    fn worker_id(&self, name: &str) -> Result<WorkerId, UsageError> {
        self.registry
            .group()
            .peers
            .get(name)
            .map(|peer| peer.id)
            .ok_or_else(|| UsageError::UnknownWorker {
                name: name.to_string(),
            })
    }

    fn fork(&self, handle: &RRefHandle, to: WorkerId) -> Result<ForkData, String> {
        self.update(|state, _| state.machine.fork(handle, to))
            .map_err(|e| {
                let failure = handle.fork.and_then(|fork| self.creation_failure(fork));
                match (e, failure) {
                    (RRefError::CreationFailed { .. }, Some(why)) => {
                        format!("it cannot be forked: {why}")
                    }
                    (e, _) => e.to_string(),
                }
            })
    }
}

impl RRefs {
    /// Why the `remote()` call that made the user `fork` failed, as `to_here` says it
    /// (PyTorch: "RRef creation via rpc.remote() timed out, and it is possible that the
    /// RRef on the owner node does not exist"); `None` unless it failed.
    fn creation_failure(&self, fork: ForkId) -> Option<RRefFailure> {
        let state = self.lock();
        let error = state.failed.get(&fork)?;
        Some(RRefFailure::CreationFailed {
            source: Arc::clone(error),
        })
    }

    /// `remote()` to this worker itself: the handler runs on a thread of its own.
    fn run_locally(
        self: &Arc<Self>,
        rref: RRefId,
        handler: &str,
        message: Message,
    ) -> Result<(), CallError> {
        let ctx = CallContext {
            caller: self.me.name().to_string(),
            caller_id: self.me.id(),
            handler: handler.to_string(),
            message_id: 0,
            client: self.client()?,
        };
        let owner = Arc::clone(self);
        let handler = handler.to_string();
        std::thread::Builder::new()
            .name("rdzv-rref-local".into())
            .spawn(move || {
                let result = run_user_handler(&owner, &ctx, &handler, message);
                owner.store_value(rref, result);
            })
            .map(drop)
            .map_err(|source| CallError::Resources {
                what: "the RRef local handler thread",
                source,
            })
    }
}
