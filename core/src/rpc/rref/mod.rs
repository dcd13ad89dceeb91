//! The remote-reference (RRef) reference-counting protocol of one worker, as a pure
//! state machine: PyTorch's `RRefContext` rules, with no I/O, no clock and no values.
//!
//! An RRef names a value that lives on one worker, its *owner*. The owner keeps an
//! [`OwnerRRef`] slot; every other worker that holds the RRef holds a *user*, named by a
//! fork id unique to that copy. The owner deletes its value once no user and no local
//! handle can reach it. The machine decides when that is, which control messages to send,
//! and when to retry them; the runtime keeps the values (keyed by [`RRefId`]), moves the
//! messages, and keeps time. It does not fetch values (`to_here`), time out calls, or
//! know what a handler is: those stay with the runtime's call table and handlers.
//!
//! # The rules (PyTorch's `docs/source/rpc/rref.rst`)
//!
//! - **`remote()`** creates a user on the caller, *pending* until the owner confirms it
//!   (the owner's [`RRefMessage::RemoteRet`]). The owner creates its slot when the
//!   [`RRefMessage::RemoteCall`] arrives, counts the caller's fork, and fills the value
//!   when the handler finishes ([`RRefContext::value_ready`]). `remote()` to oneself
//!   creates the owner slot at once, held by one local handle.
//! - **A fork** is an RRef passed inside a message to another worker ([`RRefContext::fork`]
//!   on the sender, the *parent*; [`RRefContext::receive_fork`] on the receiver, the
//!   *child*):
//!   - the owner forking counts the new fork at once, and its child is confirmed on
//!     arrival;
//!   - a user forking keeps the child as a *pending child*, which holds the parent's user
//!     alive until the child accepts (`CHILD_ACCEPT`);
//!   - a child that is not the owner asks the owner to count it (`FORK_REQUEST`), is a
//!     pending user until the owner answers, and only then accepts to its parent: **a
//!     fork from a non-owner is confirmed through the owner before the forker drops it**;
//!   - a child that is the owner accepts to its parent at once and takes a local handle
//!     (PyTorch's "phantom fork": the owner does not count itself).
//! - **A user is deleted** (`USER_DELETE` to the owner) once it has no local handle, is
//!   confirmed and has no pending child. The owner removes that fork; with no fork and no
//!   local handle left it deletes the value ([`RRefEvent::DeleteValue`]).
//! - **`FORK_REQUEST`, `CHILD_ACCEPT` and `USER_DELETE` are sent with retries**
//!   (PyTorch's `sendWithRetries`): each waits for its [`RRefMessage::Ack`] and is sent
//!   again at `rpc_retry_duration * retry_backoff ^ attempt` after the previous try, at
//!   most `max_retries` times ([`RetryOptions`]); then the machine gives up and says so
//!   ([`RRefEvent::GaveUp`]). Every handler is idempotent: a duplicate or retried
//!   message changes nothing and is acked again. PyTorch resends only when the send
//!   itself fails; here a message whose answer has not come by its retry time is sent
//!   again too, which also covers a lost answer (a failed send simply goes unanswered).
//! - **A fork that reaches the owner before the `RemoteCall` that creates its RRef**
//!   (over another worker) makes an early slot ([`OwnerRRef::called`] false), which is
//!   never deleted before the call arrives and counts its caller's fork.
//! - **A failed `remote()` call** (PyTorch's `confirmPendingUser` with an error,
//!   [`RRefContext::remote_failed`]): the error goes on the user, which stops being
//!   pending ([`UserState::Failed`]: not confirmed by its owner, never counted as a
//!   pending user or a leak, and refused as a fork, as PyTorch's `prepareChildFork`
//!   refuses a timed-out RRef). Dropped, it still sends `USER_DELETE`, with retries, as
//!   PyTorch's `delUser` does: the call may have reached the owner before it failed (a
//!   timeout, a broken pipe), and `delForkOfOwner` is idempotent if it did not. That
//!   delete is the caller's last word on the call: the caller's own fork (the one fork
//!   whose id, like its RRef's, was made by the worker sending the delete) arrives after
//!   the call on the same ordered wire, so if the call has not arrived by then it never
//!   will, and an early slot waiting for it is released (it counts as called; a slot a
//!   fork makes only after that delete starts as called: the owner remembers the
//!   abandoned call, up to [`MAX_ABANDONED_CALLS`]). This is
//!   best effort, as in PyTorch: a call still queued behind a pipe that was opening when
//!   it failed can reach the owner after the delete, and its slot then stays until the
//!   owner's graceful shutdown reports it.
//! - **Graceful shutdown** ([`RRefContext::release_all`], PyTorch's
//!   `delAllUsersAndUnforkedOwners`): once nothing is pending, every user left is
//!   deleted whatever the application holds, and the owner drops its own handles.
//!   What cannot be settled is reported by [`RRefContext::leaks`], never dropped
//!   silently.
//!
//! One deliberate difference from PyTorch: there the owner's value lives on in the
//! Python `OwnerRRef` object after its `owners_` entry goes, so local references on the
//! owner do not keep the entry. Here the runtime keeps values in a table keyed by
//! [`RRefId`], so the owner's local handles keep the slot (and count in
//! `num_owner_rrefs`) until they are dropped. With no local handle held the counts
//! are PyTorch's.
//!
//! The machine assumes what a pipe gives: messages from one worker to another arrive in
//! the order they were sent (a retry is a new send, behind the earlier ones), may be lost
//! (then retried) or duplicated. That order is what keeps a late retried `FORK_REQUEST`
//! from counting a fork again after its `USER_DELETE`.
//!
//! ```text
//!  a fork of RRef r, owned by O, from user P to worker C (none of them the same)
//!
//!     P (parent, a user)            C (child)                      O (owner)
//!     fork(): pending child f
//!        |---- message carrying ----->|
//!        |     ForkData{r, f, P}      | receive_fork(): user f, pending
//!        |                            |---- FORK_REQUEST(r, f) ------>| forks[r] += f
//!        |                            |<--- Ack(FORK_REQUEST, f) -----|
//!        |                            | f confirmed (Confirmed event)
//!        |<--- CHILD_ACCEPT(f) -------|
//!        |---- Ack(CHILD_ACCEPT, f) ->|
//!     pending child f gone: P's user may now be deleted
//!        |---- USER_DELETE(r, P's fork) (once P's handles are gone) ->| forks[r] -= P
//!                                     ... C drops f ...
//!                                     |---- USER_DELETE(r, f) ------->| forks[r] -= f
//!                                                                      | no fork, no handle:
//!                                                                      | DeleteValue(r)
//! ```
//!
//! Inputs: local calls ([`remote`](RRefContext::remote), [`fork`](RRefContext::fork),
//! [`receive_fork`](RRefContext::receive_fork), [`clone_handle`](RRefContext::clone_handle),
//! [`drop_handle`](RRefContext::drop_handle), [`value_ready`](RRefContext::value_ready)),
//! messages ([`handle_message`](RRefContext::handle_message), or
//! [`handle_call`](RRefContext::handle_call) for one that arrived as a call, whose answer
//! travels in that call's response) and time
//! ([`handle_timeout`](RRefContext::handle_timeout)). Outputs, drained after each input
//! in this order: [`poll_event`](RRefContext::poll_event),
//! [`poll_transmit`](RRefContext::poll_transmit), then
//! [`poll_timeout`](RRefContext::poll_timeout) (when to call `handle_timeout` next).
//! [`debug_info`](RRefContext::debug_info) gives PyTorch's counts.

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use core::fmt;
use core::time::Duration;

use super::name::WorkerId;
use super::timeouts::Instant;

#[cfg(test)]
mod tests;
pub mod wire;

/// A globally unique id (PyTorch's `GloballyUniqueId`): the worker that made it and a
/// number local to that worker. RRef ids and fork ids are both of this kind.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct GloballyUniqueId {
    /// The worker that created the id.
    pub created_on: WorkerId,
    /// Its number on that worker.
    pub local_id: u64,
}

impl fmt::Display for GloballyUniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // PyTorch's `GloballyUniqueId::operator<<`: "GloballyUniqueId(created_on=.., local_id=..)".
        write!(
            f,
            "GloballyUniqueId(created_on={}, local_id={})",
            self.created_on.get(),
            self.local_id
        )
    }
}

/// An RRef's id.
pub type RRefId = GloballyUniqueId;
/// A fork's id: one user's copy of an RRef.
pub type ForkId = GloballyUniqueId;

/// What the runtime holds for one RRef on this worker: the owner's value (`fork: None`)
/// or one user (`fork: Some`). Handles are counted: [`clone_handle`](RRefContext::clone_handle)
/// and [`drop_handle`](RRefContext::drop_handle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RRefHandle {
    /// The RRef.
    pub rref: RRefId,
    /// Its owner.
    pub owner: WorkerId,
    /// The user's fork id; `None` on the owner.
    pub fork: Option<ForkId>,
}

impl RRefHandle {
    /// Whether this handle is the owner's (`is_owner()`).
    pub const fn is_owner(&self) -> bool {
        self.fork.is_none()
    }
}

/// An RRef as it travels inside a message to another worker (PyTorch's `RRefForkData`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct ForkData {
    /// The owner.
    pub owner: WorkerId,
    /// The RRef.
    pub rref: RRefId,
    /// The new fork's id.
    pub fork: ForkId,
    /// The worker that sent it (the parent).
    pub parent: WorkerId,
}

/// The three control messages sent with retries.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum ControlKind {
    /// `RREF_FORK_REQUEST`: a child asks the owner to count its fork.
    ForkRequest,
    /// `RREF_CHILD_ACCEPT`: a confirmed child tells its parent it may drop its hold.
    ChildAccept,
    /// `RREF_USER_DELETE`: a user tells the owner it is gone.
    UserDelete,
}

impl ControlKind {
    /// PyTorch's `MessageType` name, which fault injection names.
    pub const fn name(self) -> &'static str {
        match self {
            ControlKind::ForkRequest => "RREF_FORK_REQUEST",
            ControlKind::ChildAccept => "RREF_CHILD_ACCEPT",
            ControlKind::UserDelete => "RREF_USER_DELETE",
        }
    }
}

impl fmt::Display for ControlKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A message of the RRef protocol.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum RRefMessage {
    /// The RRef part of a `remote()` call (`SCRIPT_REMOTE_CALL` / `PYTHON_REMOTE_CALL`):
    /// the owner creates the slot and counts `fork`. The call itself (handler, payload)
    /// is the runtime's.
    RemoteCall {
        /// The RRef.
        rref: RRefId,
        /// The caller's fork.
        fork: ForkId,
    },
    /// The owner's answer to a `RemoteCall` (`REMOTE_RET`): the caller's user is
    /// confirmed.
    RemoteRet {
        /// The RRef.
        rref: RRefId,
        /// The caller's fork.
        fork: ForkId,
    },
    /// A control message, sent with retries.
    Control {
        /// Which one.
        kind: ControlKind,
        /// The RRef.
        rref: RRefId,
        /// The fork it is about.
        fork: ForkId,
    },
    /// The answer to a control message (`RREF_ACK`).
    Ack {
        /// Which control message it answers.
        kind: ControlKind,
        /// The RRef.
        rref: RRefId,
        /// The fork.
        fork: ForkId,
    },
}

/// A message for the runtime to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// The worker to send it to.
    pub to: WorkerId,
    /// The message.
    pub message: RRefMessage,
    /// For a control message, which try this is (0 for the first send).
    pub attempt: u32,
}

/// The state of an owner's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueState {
    /// The handler has not finished.
    Pending,
    /// The handler finished with a value.
    Ready,
    /// The handler failed; `to_here` raises its error.
    Error,
}

/// Where a user stands with its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UserState {
    /// Waiting for the owner's confirmation (PyTorch's `pendingUsers_`).
    Pending,
    /// Confirmed by the owner (`confirmed_by_owner()`).
    Confirmed,
    /// Its `remote()` call failed ([`RRefContext::remote_failed`]): never confirmed, no
    /// longer pending, and not forked further.
    Failed,
}

/// One owner slot (PyTorch's `OwnerRRef` in `owners_`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnerRRef {
    /// The value's state.
    pub value: ValueState,
    /// Local handles on the owner (the owner's own references).
    pub local_handles: u32,
    /// Whether the slot is live: created here by `remote()` to oneself, or its
    /// `RemoteCall` arrived. A slot made early by a fork arriving back at the owner
    /// before the call is kept until the call arrives (the call's fork counts it then),
    /// or until the caller's `USER_DELETE` of its own fork says it never will (a failed
    /// call).
    pub called: bool,
}

/// What the runtime must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RRefEvent {
    /// No user and no local handle can reach this owner value any more: drop it (or,
    /// if it is still pending, drop it when the handler finishes; `value_ready` then
    /// answers [`ValueOutcome::Discard`]).
    DeleteValue {
        /// The RRef.
        rref: RRefId,
    },
    /// A user was confirmed by its owner (`confirmed_by_owner()` is now true).
    Confirmed {
        /// The RRef.
        rref: RRefId,
        /// The user's fork.
        fork: ForkId,
    },
    /// A control message was sent `max_retries + 1` times without an answer; the
    /// machine stopped trying. What it protected leaks and is reported by
    /// [`RRefContext::leaks`].
    GaveUp {
        /// Where it went.
        to: WorkerId,
        /// Which message.
        kind: ControlKind,
        /// The fork.
        fork: ForkId,
    },
}

/// What to do with a finished handler's value ([`RRefContext::value_ready`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueOutcome {
    /// Keep it in the slot.
    Store,
    /// No slot holds it (every reference went before the value existed): drop it.
    Discard,
}

/// PyTorch's `RpcRetryOptions` for `sendWithRetries`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryOptions {
    /// How many times a message is sent again (`maxRetries`, 5).
    pub max_retries: u32,
    /// The first wait before a retry (`rpcRetryDuration`, 1 s).
    pub rpc_retry_duration: Duration,
    /// Each further wait is this many times longer (`retryBackoff`, 1.5).
    pub retry_backoff: f64,
}

impl Default for RetryOptions {
    fn default() -> Self {
        RetryOptions {
            max_retries: 5,
            rpc_retry_duration: Duration::from_millis(1000),
            retry_backoff: 1.5,
        }
    }
}

impl RetryOptions {
    /// The wait after try `attempt` (0-based): `rpc_retry_duration * retry_backoff ^ attempt`
    /// (PyTorch's `computeNewRpcRetryTime`), saturating.
    pub fn delay(&self, attempt: u32) -> Duration {
        let mut factor = 1.0f64;
        for _ in 0..attempt.min(1024) {
            factor *= self.retry_backoff;
            if !factor.is_finite() || factor > 1e12 {
                factor = 1e12;
                break;
            }
        }
        let nanos = self.rpc_retry_duration.as_nanos() as f64 * factor;
        if !nanos.is_finite() || nanos >= u64::MAX as f64 {
            Duration::from_nanos(u64::MAX)
        } else if nanos <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_nanos(nanos as u64)
        }
    }
}

/// PyTorch's `_rref_context_get_debug_info` counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DebugInfo {
    /// Owner slots (`num_owner_rrefs`).
    pub num_owner_rrefs: usize,
    /// Control messages sent and not yet answered (`num_pending_futures`).
    pub num_pending_futures: usize,
    /// Users not yet confirmed by their owner (`num_pending_users`).
    pub num_pending_users: usize,
    /// Forks counted by this worker as owner, over all its RRefs (`num_forks`).
    pub num_forks: usize,
}

/// A local call the machine refuses (a runtime bug, never peer input).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RRefError {
    /// The handle is not held on this worker (never created, or every copy dropped).
    UnknownHandle {
        /// The RRef.
        rref: RRefId,
    },
    /// A fork to this worker itself (or one received naming this worker as its
    /// parent): a local copy is [`RRefContext::clone_handle`].
    ForkToSelf {
        /// The RRef.
        rref: RRefId,
    },
    /// A fork received twice (the fork id is already a user here).
    DuplicateFork {
        /// The fork.
        fork: ForkId,
    },
    /// A fork of a user whose `remote()` call failed (PyTorch's `prepareChildFork`
    /// refuses a timed-out RRef the same way).
    CreationFailed {
        /// The RRef.
        rref: RRefId,
    },
}

impl fmt::Display for RRefError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RRefError::UnknownHandle { rref } => write!(
                f,
                "RRef {rref} is not held on this worker (it was never created here, or every \
                 handle to it was dropped)"
            ),
            RRefError::ForkToSelf { rref } => write!(
                f,
                "RRef {rref} was forked to this worker itself; a local copy is a cloned \
                 handle, not a fork"
            ),
            RRefError::DuplicateFork { fork } => {
                write!(
                    f,
                    "fork {fork} was received twice; a fork is delivered once"
                )
            }
            RRefError::CreationFailed { rref } => write!(
                f,
                "RRef creation via rpc.remote() failed for RRef {rref}, and it is possible \
                 that the RRef on the owner node does not exist: it cannot be forked; \
                 call remote() again"
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for RRefError {}

/// What a leak check reports: a reference this worker could not settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leak {
    /// A user still waiting for its owner's confirmation.
    PendingUser {
        /// The owner.
        owner: WorkerId,
        /// The RRef.
        rref: RRefId,
        /// The fork.
        fork: ForkId,
    },
    /// A fork handed out whose child has not accepted.
    PendingChild {
        /// The owner.
        owner: WorkerId,
        /// The RRef.
        rref: RRefId,
        /// The child's fork.
        child: ForkId,
    },
    /// A control message that is still unanswered (or that the machine gave up on).
    Unanswered {
        /// Where it went.
        to: WorkerId,
        /// Which message.
        kind: ControlKind,
        /// The fork.
        fork: ForkId,
    },
}

/// One user on this worker (PyTorch's `UserRRef`, with what `pendingUsers_` and
/// `pendingChildren_` hold for it).
#[derive(Debug, Clone, PartialEq, Eq)]
struct User {
    rref: RRefId,
    owner: WorkerId,
    handles: u32,
    state: UserState,
    /// Forks handed out by this user, waiting for their child's accept.
    pending_children: BTreeSet<ForkId>,
    /// For an unconfirmed child: the parent to accept to once confirmed (`None` for a
    /// `remote()` caller).
    parent: Option<WorkerId>,
}

/// A control message waiting for its ack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pending {
    to: WorkerId,
    rref: RRefId,
    attempt: u32,
    /// When it is sent again; `None` once the machine gave up.
    next_retry: Option<Instant>,
}

/// One worker's RRef protocol state (PyTorch's `RRefContext`).
#[derive(Debug, Clone)]
pub struct RRefContext {
    me: WorkerId,
    options: RetryOptions,
    next_local_id: u64,
    owners: BTreeMap<RRefId, OwnerRRef>,
    forks: BTreeMap<RRefId, BTreeSet<ForkId>>,
    users: BTreeMap<ForkId, User>,
    /// Pending children (PyTorch's `pendingChildren_`): child fork -> the user here
    /// that handed it out.
    children: BTreeMap<ForkId, ForkId>,
    /// Control messages waiting for their ack.
    sends: BTreeMap<(ControlKind, ForkId), Pending>,
    events: VecDeque<RRefEvent>,
    transmits: VecDeque<Transmit>,
    /// RRefs owned here whose caller's own `USER_DELETE` arrived before anything made
    /// their slot: their `RemoteCall` never will, so a slot that a fork makes later
    /// starts as called (at most [`MAX_ABANDONED_CALLS`], the oldest ids forgotten first).
    abandoned_calls: BTreeSet<RRefId>,
}

/// How many [`RRefContext`] remembers of the calls their callers gave up on before any
/// fork reached the owner (a failed `remote()` leaves one until a fork of it arrives or
/// the context is released). Forgetting one only risks that a fork still in flight
/// then keeps its slot until the graceful shutdown reports it.
pub const MAX_ABANDONED_CALLS: usize = 4096;

impl RRefContext {
    /// The context of worker `me`.
    pub fn new(me: WorkerId, options: RetryOptions) -> RRefContext {
        RRefContext {
            me,
            options,
            next_local_id: 0,
            owners: BTreeMap::new(),
            forks: BTreeMap::new(),
            users: BTreeMap::new(),
            children: BTreeMap::new(),
            sends: BTreeMap::new(),
            events: VecDeque::new(),
            transmits: VecDeque::new(),
            abandoned_calls: BTreeSet::new(),
        }
    }

    /// This worker.
    pub const fn worker(&self) -> WorkerId {
        self.me
    }

    fn gen_id(&mut self) -> GloballyUniqueId {
        let id = GloballyUniqueId {
            created_on: self.me,
            local_id: self.next_local_id,
        };
        self.next_local_id = self.next_local_id.wrapping_add(1);
        id
    }

    /// `remote(to, ...)`: a new RRef owned by `to`, and its handle here. For another
    /// worker, the runtime sends the call with [`RRefMessage::RemoteCall`]'s ids (see
    /// [`remote_call`](Self::remote_call)); the user is pending until the
    /// [`RRefMessage::RemoteRet`]. For this worker, the owner slot is created at once,
    /// pending its value.
    pub fn remote(&mut self, to: WorkerId) -> RRefHandle {
        let rref = self.gen_id();
        if to == self.me {
            self.owners.insert(
                rref,
                OwnerRRef {
                    value: ValueState::Pending,
                    local_handles: 1,
                    called: true,
                },
            );
            return RRefHandle {
                rref,
                owner: to,
                fork: None,
            };
        }
        // PyTorch's `createUserRRef` with a fresh fork id, added to `pendingUsers_`.
        let fork = self.gen_id();
        self.users.insert(
            fork,
            User {
                rref,
                owner: to,
                handles: 1,
                state: UserState::Pending,
                pending_children: BTreeSet::new(),
                parent: None,
            },
        );
        RRefHandle {
            rref,
            owner: to,
            fork: Some(fork),
        }
    }

    /// The message the `remote()` call for `handle` carries to its owner.
    pub fn remote_call(handle: &RRefHandle) -> Option<RRefMessage> {
        handle.fork.map(|fork| RRefMessage::RemoteCall {
            rref: handle.rref,
            fork,
        })
    }

    /// Another handle to the same reference (a local copy).
    ///
    /// # Errors
    /// [`RRefError::UnknownHandle`] if it is not held here.
    pub fn clone_handle(&mut self, handle: &RRefHandle) -> Result<(), RRefError> {
        let count = self.handles_mut(handle)?;
        *count = count.saturating_add(1);
        Ok(())
    }

    fn handles_mut(&mut self, handle: &RRefHandle) -> Result<&mut u32, RRefError> {
        let unknown = RRefError::UnknownHandle { rref: handle.rref };
        match handle.fork {
            None => self
                .owners
                .get_mut(&handle.rref)
                .filter(|o| o.local_handles > 0)
                .map(|o| &mut o.local_handles)
                .ok_or(unknown),
            Some(fork) => self
                .users
                .get_mut(&fork)
                .filter(|u| u.handles > 0 && u.rref == handle.rref)
                .map(|u| &mut u.handles)
                .ok_or(unknown),
        }
    }

    /// Drops one handle. The last handle of a user deletes it once it is confirmed and
    /// has no pending child (`USER_DELETE`); the owner's last handle deletes the value
    /// if no fork is left.
    ///
    /// # Errors
    /// [`RRefError::UnknownHandle`] if it is not held here.
    pub fn drop_handle(&mut self, now: Instant, handle: &RRefHandle) -> Result<(), RRefError> {
        let count = self.handles_mut(handle)?;
        *count -= 1;
        match handle.fork {
            None => self.maybe_delete_owner(handle.rref),
            Some(fork) => self.maybe_delete_user(now, fork),
        }
        Ok(())
    }

    /// Whether the user `handle` is confirmed by its owner (`confirmed_by_owner()`;
    /// always true on the owner).
    pub fn confirmed_by_owner(&self, handle: &RRefHandle) -> bool {
        match handle.fork {
            None => true,
            Some(fork) => self
                .users
                .get(&fork)
                .is_some_and(|u| u.state == UserState::Confirmed),
        }
    }

    /// Where the user `handle` stands with its owner; `None` on the owner or for a
    /// handle not held here.
    pub fn user_state(&self, handle: &RRefHandle) -> Option<UserState> {
        let user = self.users.get(&handle.fork?)?;
        (user.rref == handle.rref).then_some(user.state)
    }

    /// The `remote()` call that created the user `fork` of `rref` failed (PyTorch's
    /// `confirmPendingUser` with an error: `handleError` marks the RRef, and
    /// `delPendingUser` removes the pending user). A pending user becomes
    /// [`UserState::Failed`]; one the owner confirmed already (its `RemoteRet` came
    /// before the call failed, e.g. timed out) fails too, so that `to_here` and forks
    /// say so. Either way it is deleted like a confirmed user once dropped (see the
    /// module documentation). Nothing happens for a fork that is not this worker's own
    /// `remote()` user, or is already gone.
    pub fn remote_failed(&mut self, now: Instant, rref: RRefId, fork: ForkId) {
        if !Self::is_callers_fork(self.me, rref, fork) {
            return;
        }
        let Some(user) = self.users.get_mut(&fork) else {
            return;
        };
        if user.rref != rref || user.state == UserState::Failed {
            return;
        }
        user.state = UserState::Failed;
        self.maybe_delete_user(now, fork);
    }

    /// Whether `fork` is the fork a `remote()` call of worker `caller` made for `rref`:
    /// the only user whose fork id, like its RRef id, was made by the worker holding it
    /// (every other user's fork id was made by its parent, another worker).
    fn is_callers_fork(caller: WorkerId, rref: RRefId, fork: ForkId) -> bool {
        rref.created_on == caller && fork.created_on == caller && fork != rref
    }

    /// Passes `handle` inside a message to worker `to` (pickling an RRef): the data to
    /// put in the message. The owner counts the fork at once; a user keeps it as a
    /// pending child, which holds the user until the child accepts.
    ///
    /// # Errors
    /// [`RRefError::UnknownHandle`] if it is not held here; [`RRefError::ForkToSelf`]
    /// if `to` is this worker; [`RRefError::CreationFailed`] if its `remote()` call
    /// failed.
    pub fn fork(&mut self, handle: &RRefHandle, to: WorkerId) -> Result<ForkData, RRefError> {
        self.handles_mut(handle)?;
        if to == self.me {
            return Err(RRefError::ForkToSelf { rref: handle.rref });
        }
        if self.user_state(handle) == Some(UserState::Failed) {
            return Err(RRefError::CreationFailed { rref: handle.rref });
        }
        let fork = self.gen_id();
        let data = ForkData {
            owner: handle.owner,
            rref: handle.rref,
            fork,
            parent: self.me,
        };
        match handle.fork {
            None => {
                self.forks.entry(handle.rref).or_default().insert(fork);
            }
            Some(user) => {
                if let Some(u) = self.users.get_mut(&user) {
                    u.pending_children.insert(fork);
                    self.children.insert(fork, user);
                }
            }
        }
        Ok(data)
    }

    /// Receives an RRef in a message (unpickling it): its handle here. A child that is
    /// not the owner and whose parent is not the owner sends `FORK_REQUEST` and is
    /// pending; a child that is the owner accepts to its parent at once.
    ///
    /// # Errors
    /// [`RRefError::ForkToSelf`] if the data names this worker as the parent;
    /// [`RRefError::DuplicateFork`] if the fork is already a user here.
    pub fn receive_fork(&mut self, now: Instant, data: ForkData) -> Result<RRefHandle, RRefError> {
        if data.parent == self.me {
            return Err(RRefError::ForkToSelf { rref: data.rref });
        }
        if data.owner == self.me {
            // The phantom fork: not counted; the parent's hold is released at once. A
            // slot made here before its call counts as called if the caller gave up.
            let abandoned = &mut self.abandoned_calls;
            let slot = self.owners.entry(data.rref).or_insert_with(|| OwnerRRef {
                value: ValueState::Pending,
                local_handles: 0,
                called: abandoned.remove(&data.rref),
            });
            slot.local_handles = slot.local_handles.saturating_add(1);
            self.send_control(
                now,
                data.parent,
                ControlKind::ChildAccept,
                data.rref,
                data.fork,
            );
            return Ok(RRefHandle {
                rref: data.rref,
                owner: self.me,
                fork: None,
            });
        }
        if self.users.contains_key(&data.fork) {
            return Err(RRefError::DuplicateFork { fork: data.fork });
        }
        let confirmed = data.parent == data.owner;
        self.users.insert(
            data.fork,
            User {
                rref: data.rref,
                owner: data.owner,
                handles: 1,
                state: if confirmed {
                    UserState::Confirmed
                } else {
                    UserState::Pending
                },
                pending_children: BTreeSet::new(),
                parent: (!confirmed).then_some(data.parent),
            },
        );
        if !confirmed {
            self.send_control(
                now,
                data.owner,
                ControlKind::ForkRequest,
                data.rref,
                data.fork,
            );
        }
        Ok(RRefHandle {
            rref: data.rref,
            owner: data.owner,
            fork: Some(data.fork),
        })
    }

    /// The owner's handler for `rref` finished (`ok`: with a value, else with an error).
    pub fn value_ready(&mut self, rref: RRefId, ok: bool) -> ValueOutcome {
        match self.owners.get_mut(&rref) {
            Some(slot) if slot.value == ValueState::Pending => {
                slot.value = if ok {
                    ValueState::Ready
                } else {
                    ValueState::Error
                };
                ValueOutcome::Store
            }
            // A second completion for the same slot, or no slot: nothing keeps it.
            _ => ValueOutcome::Discard,
        }
    }

    /// The owner slot of `rref`, if this worker holds one.
    pub fn owner_rref(&self, rref: RRefId) -> Option<OwnerRRef> {
        self.owners.get(&rref).copied()
    }

    /// Handles a message from worker `from`. Every handler is idempotent. The message
    /// that answers it (see [`handle_call`](Self::handle_call)) is queued to
    /// [`poll_transmit`](Self::poll_transmit) like any other.
    pub fn handle_message(&mut self, now: Instant, from: WorkerId, message: RRefMessage) {
        if let Some(answer) = self.apply(now, from, message) {
            self.transmits.push_back(Transmit {
                to: from,
                message: answer,
                attempt: 0,
            });
        }
    }

    /// Handles a message that arrived as a call of its own from worker `from`, and
    /// returns the message that answers it in that call's response rather than as a
    /// call: a control message's `Ack` (the control call's response), or a
    /// `RemoteCall`'s `RemoteRet` (the `remote()` call's response, which confirms the
    /// caller's user there). An `Ack` or a `RemoteRet` has no answer. Only what the
    /// message set off beside its answer is queued to
    /// [`poll_transmit`](Self::poll_transmit).
    pub fn handle_call(
        &mut self,
        now: Instant,
        from: WorkerId,
        message: RRefMessage,
    ) -> Option<RRefMessage> {
        self.apply(now, from, message)
    }

    /// Applies `message` from `from`; returns its answer (`handle_call`).
    fn apply(&mut self, now: Instant, from: WorkerId, message: RRefMessage) -> Option<RRefMessage> {
        match message {
            RRefMessage::RemoteCall { rref, fork } => {
                self.abandoned_calls.remove(&rref);
                self.owners
                    .entry(rref)
                    .or_insert(OwnerRRef {
                        value: ValueState::Pending,
                        local_handles: 0,
                        called: false,
                    })
                    .called = true;
                if fork != rref {
                    self.forks.entry(rref).or_default().insert(fork);
                }
                Some(RRefMessage::RemoteRet { rref, fork })
            }
            RRefMessage::RemoteRet { rref, fork } => {
                self.confirm(now, rref, fork);
                None
            }
            RRefMessage::Control { kind, rref, fork } => {
                match kind {
                    ControlKind::ForkRequest => {
                        // addForkOfOwnerIfNotPresent
                        self.forks.entry(rref).or_default().insert(fork);
                    }
                    ControlKind::ChildAccept => {
                        // delPendingChild
                        if let Some(parent) = self.children.remove(&fork) {
                            if let Some(user) = self.users.get_mut(&parent) {
                                user.pending_children.remove(&fork);
                            }
                            self.maybe_delete_user(now, parent);
                        }
                    }
                    ControlKind::UserDelete => {
                        // The caller's own delete comes after its call on this wire:
                        // a slot still waiting for that call waits no more.
                        if Self::is_callers_fork(from, rref, fork) {
                            if let Some(slot) = self.owners.get_mut(&rref) {
                                slot.called = true;
                            } else if self.abandoned_calls.insert(rref)
                                && self.abandoned_calls.len() > MAX_ABANDONED_CALLS
                            {
                                // No slot yet: a fork of it may still be on its way here.
                                self.abandoned_calls.pop_first();
                            }
                        }
                        // delForkOfOwner
                        if let Some(set) = self.forks.get_mut(&rref) {
                            set.remove(&fork);
                            if set.is_empty() {
                                self.forks.remove(&rref);
                            }
                        }
                        self.maybe_delete_owner(rref);
                    }
                }
                Some(RRefMessage::Ack { kind, rref, fork })
            }
            RRefMessage::Ack { kind, rref, fork } => {
                // None: a duplicate, or an answer after giving up.
                if self.sends.remove(&(kind, fork)).is_some() && kind == ControlKind::ForkRequest {
                    self.confirm(now, rref, fork);
                }
                None
            }
        }
    }

    /// The user `fork` is confirmed by its owner: a forked child now accepts to its
    /// parent; a user with no handle left is deleted.
    fn confirm(&mut self, now: Instant, rref: RRefId, fork: ForkId) {
        let Some(user) = self.users.get_mut(&fork) else {
            return;
        };
        if user.state != UserState::Pending || user.rref != rref {
            return;
        }
        user.state = UserState::Confirmed;
        let parent = user.parent.take();
        self.events.push_back(RRefEvent::Confirmed { rref, fork });
        if let Some(parent) = parent {
            self.send_control(now, parent, ControlKind::ChildAccept, rref, fork);
        }
        self.maybe_delete_user(now, fork);
    }

    fn maybe_delete_user(&mut self, now: Instant, fork: ForkId) {
        let Some(user) = self.users.get(&fork) else {
            return;
        };
        if user.handles > 0 || user.state == UserState::Pending || !user.pending_children.is_empty()
        {
            return;
        }
        let (owner, rref) = (user.owner, user.rref);
        self.users.remove(&fork);
        self.send_control(now, owner, ControlKind::UserDelete, rref, fork);
    }

    fn maybe_delete_owner(&mut self, rref: RRefId) {
        let Some(slot) = self.owners.get(&rref) else {
            return;
        };
        if !slot.called || slot.local_handles > 0 || self.forks.contains_key(&rref) {
            return;
        }
        self.owners.remove(&rref);
        self.events.push_back(RRefEvent::DeleteValue { rref });
    }

    fn send_control(
        &mut self,
        now: Instant,
        to: WorkerId,
        kind: ControlKind,
        rref: RRefId,
        fork: ForkId,
    ) {
        self.sends.insert(
            (kind, fork),
            Pending {
                to,
                rref,
                attempt: 0,
                next_retry: Some(now.saturating_add(self.options.delay(0))),
            },
        );
        self.transmits.push_back(Transmit {
            to,
            message: RRefMessage::Control { kind, rref, fork },
            attempt: 0,
        });
    }

    /// Sends again every control message whose retry time has come; gives up on those
    /// past `max_retries`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let options = self.options;
        for (&(kind, fork), pending) in self.sends.iter_mut() {
            let Some(at) = pending.next_retry else {
                continue;
            };
            if at > now {
                continue;
            }
            if pending.attempt >= options.max_retries {
                pending.next_retry = None;
                self.events.push_back(RRefEvent::GaveUp {
                    to: pending.to,
                    kind,
                    fork,
                });
                continue;
            }
            pending.attempt += 1;
            pending.next_retry = Some(now.saturating_add(options.delay(pending.attempt)));
            self.transmits.push_back(Transmit {
                to: pending.to,
                message: RRefMessage::Control {
                    kind,
                    rref: pending.rref,
                    fork,
                },
                attempt: pending.attempt,
            });
        }
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.sends.values().filter_map(|p| p.next_retry).min()
    }

    /// The next thing for the runtime to do.
    pub fn poll_event(&mut self) -> Option<RRefEvent> {
        self.events.pop_front()
    }

    /// The next message to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// PyTorch's debug-info counts.
    pub fn debug_info(&self) -> DebugInfo {
        DebugInfo {
            num_owner_rrefs: self.owners.len(),
            num_pending_futures: self.sends.len(),
            num_pending_users: self
                .users
                .values()
                .filter(|u| u.state == UserState::Pending)
                .count(),
            num_forks: self.forks.values().map(BTreeSet::len).sum(),
        }
    }

    /// Whether the user `fork` is still held on this worker (it is gone once deleted).
    pub fn holds_user(&self, fork: ForkId) -> bool {
        self.users.contains_key(&fork)
    }

    /// Users held on this worker (confirmed or not).
    pub fn num_users(&self) -> usize {
        self.users.len()
    }

    /// Whether nothing this worker handed out or asked for is still unsettled: no
    /// pending user, no pending child, no unanswered control message. A graceful
    /// `join` waits for this.
    pub fn is_settled(&self) -> bool {
        self.sends.is_empty()
            && self
                .users
                .values()
                .all(|u| u.state != UserState::Pending && u.pending_children.is_empty())
    }

    /// Graceful shutdown, after [`is_settled`](Self::is_settled) (PyTorch's
    /// `delAllUsersAndUnforkedOwners`): deletes every confirmed user without a pending
    /// child, whatever handles the application still holds (`USER_DELETE` to each
    /// owner), and drops this worker's own handles on the owner slots here, deleting
    /// those no fork holds. The application's handles are then unknown here. Returns how
    /// many users could not be released (pending, or with pending children); they are
    /// in [`leaks`](Self::leaks). The runtime then waits, with a timeout, until
    /// `num_owner_rrefs` is 0 and the machine is settled again (the owners have answered
    /// every `USER_DELETE` and received those of the other workers).
    pub fn release_all(&mut self, now: Instant) -> usize {
        self.abandoned_calls.clear();
        let forks: alloc::vec::Vec<ForkId> = self.users.keys().copied().collect();
        let mut kept = 0;
        for fork in forks {
            if let Some(user) = self.users.get_mut(&fork) {
                if user.state != UserState::Pending && user.pending_children.is_empty() {
                    user.handles = 0;
                    self.maybe_delete_user(now, fork);
                } else {
                    kept += 1;
                }
            }
        }
        let owned: alloc::vec::Vec<RRefId> = self.owners.keys().copied().collect();
        for rref in owned {
            if let Some(slot) = self.owners.get_mut(&rref) {
                slot.local_handles = 0;
            }
            self.maybe_delete_owner(rref);
        }
        kept
    }

    /// What is still unsettled, for the leak report at shutdown.
    pub fn leaks(&self) -> impl Iterator<Item = Leak> + '_ {
        let users = self.users.iter().flat_map(|(&fork, u)| {
            let pending = (u.state == UserState::Pending).then_some(Leak::PendingUser {
                owner: u.owner,
                rref: u.rref,
                fork,
            });
            pending
                .into_iter()
                .chain(
                    u.pending_children
                        .iter()
                        .map(move |&child| Leak::PendingChild {
                            owner: u.owner,
                            rref: u.rref,
                            child,
                        }),
                )
        });
        let sends = self
            .sends
            .iter()
            .map(|(&(kind, fork), p)| Leak::Unanswered {
                to: p.to,
                kind,
                fork,
            });
        users.chain(sends)
    }
}
