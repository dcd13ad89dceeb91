//! `join(shutdown = false)` by its clear name, and the bookkeeping that keeps a join
//! from running once this worker's barriers are out of step with the group's (core's
//! [`JoinSequence`]; the table on [`RpcAgent`] says what a caller sees).

use std::time::Duration;

use rdzv_core::rpc::shutdown::JoinSequence;

use super::RpcAgent;
use crate::rpc::error::ShutdownError;

impl RpcAgent {
    /// PyTorch's `agent.join(shutdown=False, timeout)`: waits until no worker of the
    /// group has a call in flight (the same barriers as a graceful shutdown; every worker
    /// must call it), then goes on serving, so calls may be made again at once and the
    /// agent is shut down later. `timeout` (`None`: none) ends the wait. In a dynamic
    /// group it waits only for this worker's own calls. The same as
    /// [`join_with(false, timeout)`](Self::join_with).
    ///
    /// # Errors
    /// [`ShutdownError::JoinTimeout`] naming the workers that never joined, when `timeout`
    /// passes first; [`ShutdownError::Store`] or [`ShutdownError::Join`] if the protocol fails;
    /// [`ShutdownError::ShutDown`] after a shutdown. After a timeout or a failure inside the
    /// barriers, every later join or graceful shutdown fails at once with
    /// [`ShutdownError::Join`] (the barriers are out of step): end the group with
    /// [`shutdown(false)`](Self::shutdown) on every worker.
    pub fn join_without_shutdown(&self, timeout: Option<Duration>) -> Result<(), ShutdownError> {
        self.join_with(false, timeout)
    }

    fn join_sequence(&self) -> std::sync::MutexGuard<'_, JoinSequence> {
        self.join_sequence.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The barrier id a join starts at, or why no join may run.
    pub(super) fn join_start(&self) -> Result<u64, ShutdownError> {
        self.join_sequence()
            .start()
            .map_err(|source| ShutdownError::Join {
                name: self.dispatch.me.name().to_string(),
                source: Box::new(source),
            })
    }

    /// A join begun at barrier `first` ended before barrier `next`.
    pub(super) fn join_finished(&self, first: u64, next: u64, completed: bool) {
        self.join_sequence().finish(first, next, completed);
    }

    /// A graceful shutdown gave up; the agent closes without the group.
    pub(super) fn join_gave_up(&self) {
        self.join_sequence().abandon();
    }
}

/// A graceful shutdown's timeout error names the timeout its caller gave, not what was
/// left of it once the RRefs were settled.
pub(super) fn timeout_as_asked(error: ShutdownError, asked: Option<Duration>) -> ShutdownError {
    match (error, asked) {
        (ShutdownError::JoinTimeout { name, missing, .. }, Some(timeout)) => {
            ShutdownError::JoinTimeout {
                name,
                timeout,
                missing,
            }
        }
        (error, _) => error,
    }
}
