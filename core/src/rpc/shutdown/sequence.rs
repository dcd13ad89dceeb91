//! Where one worker's `join` barriers stand between joins, and which joins may still
//! run: PyTorch's process-wide barrier counter, made a lifecycle.
//!
//! Every worker of a static group numbers its `join` barriers with the same counter
//! (`ACTIVE_CALLS_ID_<n>`, `PROCESS_COUNT_ID_<n>`, `READY_ID_<n>`), and the group's joins
//! only line up while every worker advances it in step. A join that stops part-way (its
//! timeout passed, or a store operation failed) after entering a barrier leaves this
//! worker's counter where the others' are not: a later join would wait at a barrier the
//! others passed or never reach, or add its calls to another round's total. So once
//! that happens no join runs again; the group ends with a non-graceful shutdown
//! (PyTorch's `rpc.shutdown(graceful=False)`, which is also what PyTorch's
//! `rpc.shutdown` falls back to after its graceful part fails). A join that timed out
//! before entering any barrier (waiting for this worker's own calls) leaves the counter
//! in step, and may be tried again.
//!
//! A graceful shutdown that gave up closes the agent without the group ([`JoinSequence::abandon`]):
//! a further graceful call then says so instead of reporting success.

use core::fmt;

use super::JoinError;

/// Whether this worker may still run a `join`, and from which barrier id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinSequence {
    /// In step with the group: the next join starts at barrier `next_barrier_id`.
    InStep {
        /// The first barrier id of the next join (1 for the first join of a process).
        next_barrier_id: u64,
    },
    /// A join stopped after entering barriers `first_barrier_id..next_barrier_id`, or a
    /// graceful shutdown gave up (then the two are equal): no join runs again.
    OutOfStep {
        /// Where the join that stopped began.
        first_barrier_id: u64,
        /// The barrier it would have entered next.
        next_barrier_id: u64,
    },
}

impl Default for JoinSequence {
    fn default() -> Self {
        JoinSequence::new()
    }
}

impl JoinSequence {
    /// A fresh process: in step, at barrier 1.
    pub const fn new() -> JoinSequence {
        JoinSequence::InStep { next_barrier_id: 1 }
    }

    /// The barrier id a join starts at now.
    ///
    /// # Errors
    /// [`JoinError::OutOfStep`] once a join stopped part-way or a graceful shutdown gave
    /// up.
    pub fn start(&self) -> Result<u64, JoinError> {
        match *self {
            JoinSequence::InStep { next_barrier_id } => Ok(next_barrier_id),
            JoinSequence::OutOfStep {
                first_barrier_id,
                next_barrier_id,
            } => Err(JoinError::OutOfStep(OutOfStep {
                first_barrier_id,
                next_barrier_id,
            })),
        }
    }

    /// Records how a join that began at `first` ended: `next` is its
    /// [`Join::next_barrier_id`](super::Join::next_barrier_id), `completed` whether it
    /// reached [`Action::Done`](super::Action::Done). One that stopped before entering a
    /// barrier leaves the sequence in step.
    pub fn finish(&mut self, first: u64, next: u64, completed: bool) {
        *self = if completed || next == first {
            JoinSequence::InStep {
                next_barrier_id: next,
            }
        } else {
            JoinSequence::OutOfStep {
                first_barrier_id: first,
                next_barrier_id: next,
            }
        };
    }

    /// A graceful shutdown gave up and closed the agent without the group.
    pub fn abandon(&mut self) {
        if let JoinSequence::InStep { next_barrier_id } = *self {
            *self = JoinSequence::OutOfStep {
                first_barrier_id: next_barrier_id,
                next_barrier_id,
            };
        }
    }
}

/// Why a join is refused ([`JoinError::OutOfStep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfStep {
    /// Where the join that stopped began.
    pub first_barrier_id: u64,
    /// The barrier it would have entered next (equal to `first_barrier_id` after a
    /// graceful shutdown that gave up before its barriers).
    pub next_barrier_id: u64,
}

impl fmt::Display for OutOfStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first_barrier_id == self.next_barrier_id {
            write!(
                f,
                "an earlier graceful shutdown of this worker gave up (it timed out or \
                 failed) and closed the agent without the rest of the group, so there is no \
                 graceful shutdown left to do; end the other workers with \
                 shutdown(false) too (PyTorch: rpc.shutdown(graceful=False))"
            )
        } else {
            write!(
                f,
                "an earlier join of this worker stopped part-way (it timed out or failed \
                 inside shutdown barriers {}..{}), so its barriers are out of step with the \
                 rest of the group and another join or graceful shutdown would wait for \
                 ever or count the wrong round; end every worker with shutdown(false) \
                 (PyTorch: rpc.shutdown(graceful=False))",
                self.first_barrier_id,
                self.next_barrier_id.saturating_sub(1)
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completed_joins_keep_the_sequence_in_step() {
        let mut s = JoinSequence::new();
        assert_eq!(s.start(), Ok(1));
        s.finish(1, 4, true);
        assert_eq!(s.start(), Ok(4));
        // Timed out before its first barrier: nothing shared was touched.
        s.finish(4, 4, false);
        assert_eq!(s.start(), Ok(4));
    }

    #[test]
    fn a_join_that_stops_between_barriers_refuses_every_later_join() {
        let mut s = JoinSequence::new();
        s.finish(1, 3, false);
        let refused = s.start();
        assert_eq!(
            refused,
            Err(JoinError::OutOfStep(OutOfStep {
                first_barrier_id: 1,
                next_barrier_id: 3
            }))
        );
        let text = alloc::string::ToString::to_string(&refused.expect_err("refused"));
        assert!(
            text.contains("barriers 1..2") && text.contains("shutdown(false)"),
            "{text}"
        );
        // It stays out of step.
        s.abandon();
        assert!(s.start().is_err());
    }

    #[test]
    fn a_graceful_shutdown_that_gave_up_says_so() {
        let mut s = JoinSequence::new();
        s.finish(1, 4, true);
        s.abandon();
        let text = s
            .start()
            .map_err(|e| alloc::string::ToString::to_string(&e))
            .err()
            .unwrap_or_default();
        assert!(
            text.contains("gave up") && text.contains("shutdown(false)"),
            "{text}"
        );
    }
}
