//! [`ElasticNode`]: one node's side of the elastic rendezvous (see the module above for
//! the protocol and the key layout).

use alloc::collections::VecDeque;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;
use core::time::Duration;

use super::{ElasticSettings, Instant};
use crate::store::semantics::parse_counter;

/// A store operation the runtime must perform, then answer with one [`StoreReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreAction {
    /// `check([key])`; answer [`StoreReply::Checked`].
    Check {
        /// The key.
        key: String,
    },
    /// `add(key, delta)`; answer [`StoreReply::Added`].
    Add {
        /// The key.
        key: String,
        /// The amount (0 reads a counter without waiting).
        delta: i64,
    },
    /// `set(key, value)`; answer [`StoreReply::Set`].
    Set {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
    },
    /// `compare_set(key, expected, desired)`; answer [`StoreReply::Value`] with what the
    /// store returned.
    CompareSet {
        /// The key.
        key: String,
        /// The value expected (empty: the key is missing).
        expected: Vec<u8>,
        /// The value to write.
        desired: Vec<u8>,
    },
    /// `get(key)` of a key known to exist; answer [`StoreReply::Value`].
    Get {
        /// The key.
        key: String,
    },
    /// `wait([key])` until `until`; answer [`StoreReply::Waited`] or, once `until` has
    /// passed, [`StoreReply::TimedOut`].
    Wait {
        /// The key.
        key: String,
        /// The deadline.
        until: Instant,
    },
}

impl StoreAction {
    /// A short name, for errors.
    pub const fn name(&self) -> &'static str {
        match self {
            Self::Check { .. } => "check",
            Self::Add { .. } => "add",
            Self::Set { .. } => "set",
            Self::CompareSet { .. } => "compare_set",
            Self::Get { .. } => "get",
            Self::Wait { .. } => "wait",
        }
    }

    /// The key the action names.
    pub fn key(&self) -> &str {
        match self {
            Self::Check { key }
            | Self::Add { key, .. }
            | Self::Set { key, .. }
            | Self::CompareSet { key, .. }
            | Self::Get { key }
            | Self::Wait { key, .. } => key,
        }
    }
}

/// The result of a [`StoreAction`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreReply<'a> {
    /// Whether the key exists.
    Checked(bool),
    /// The counter after the add.
    Added(i64),
    /// The set is done.
    Set,
    /// The value returned by `get` or `compare_set`.
    Value(&'a [u8]),
    /// The key exists.
    Waited,
    /// The wait's deadline passed first.
    TimedOut,
}

impl StoreReply<'_> {
    const fn name(&self) -> &'static str {
        match self {
            Self::Checked(_) => "checked",
            Self::Added(_) => "added",
            Self::Set => "set",
            Self::Value(_) => "value",
            Self::Waited => "waited",
            Self::TimedOut => "timed out",
        }
    }
}

/// A [`StoreReply`] that owns its value, for a driver that keeps a reply past the
/// buffer it was read into (a thread, an event loop, a test's store model).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnedStoreReply {
    /// Whether the key exists.
    Checked(bool),
    /// The counter after the add.
    Added(i64),
    /// The set is done.
    Set,
    /// The value returned by `get` or `compare_set`.
    Value(Vec<u8>),
    /// The key exists.
    Waited,
    /// The wait's deadline passed first.
    TimedOut,
}

impl OwnedStoreReply {
    /// The reply to hand to [`ElasticNode::handle_reply`].
    pub fn as_reply(&self) -> StoreReply<'_> {
        match self {
            Self::Checked(b) => StoreReply::Checked(*b),
            Self::Added(n) => StoreReply::Added(*n),
            Self::Set => StoreReply::Set,
            Self::Value(v) => StoreReply::Value(v),
            Self::Waited => StoreReply::Waited,
            Self::TimedOut => StoreReply::TimedOut,
        }
    }
}

/// What the node's owner asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalEvent {
    /// Join the rendezvous (`next_rendezvous`).
    Join,
    /// Leave for good; a round this node is part of ends.
    Leave,
    /// Close the rendezvous for good (`shutdown`): no node can join any more.
    Shutdown,
    /// This node's workers failed: end the round and rejoin the next one.
    WorkerFailed,
}

/// A complete round, as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundOutcome {
    /// The round number (0 first).
    pub round: u64,
    /// This node's rank, `0..world_size`.
    pub rank: u32,
    /// The number of members.
    pub world_size: u32,
    /// PyTorch's per-round store prefix, `torch.rendezvous.{run_id}.{round}`.
    pub store_prefix: String,
}

/// What happened; drain with [`ElasticNode::poll_event`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// This node is a member of a complete round.
    Complete(RoundOutcome),
    /// This node arrived after the round closed; it asks for the next round, or (the
    /// round being full) waits as a hot spare.
    Waiting {
        /// The round it arrived too late for.
        round: u64,
        /// Whether it waits as a hot spare (the round has `max_nodes` members).
        hot_spare: bool,
    },
    /// The round this node was a member of is over; it rejoins the next one.
    RoundOver {
        /// The round.
        round: u64,
        /// Why (as written to `{round}/over`).
        reason: String,
    },
    /// This node left ([`LocalEvent::Leave`]). Final.
    Left,
    /// This node closed the rendezvous ([`LocalEvent::Shutdown`]). Final.
    ShutDown,
    /// The rendezvous failed for this node. Final.
    Failed(ElasticError),
}

/// Which of PyTorch's rendezvous exceptions a failure is (`torch.distributed.elastic.
/// rendezvous.api`), so that a binding can raise the right class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ElasticErrorKind {
    /// `RendezvousClosedError`: the rendezvous is closed (or this node left it).
    Closed,
    /// `RendezvousTimeoutError`: no complete round in time.
    Timeout,
    /// `RendezvousConnectionError`: the store could not be reached or failed.
    Connection,
    /// `RendezvousStateError`: the keys hold what this protocol never writes.
    State,
    /// `RendezvousGracefulExitError`: the rendezvous closed while this node waited
    /// outside every round (a hot spare, or a late node): it should exit with success.
    GracefulExit,
}

impl ElasticErrorKind {
    /// PyTorch's class name, e.g. `"RendezvousClosedError"`.
    pub const fn torch_name(self) -> &'static str {
        match self {
            Self::Closed => "RendezvousClosedError",
            Self::Timeout => "RendezvousTimeoutError",
            Self::Connection => "RendezvousConnectionError",
            Self::State => "RendezvousStateError",
            Self::GracefulExit => "RendezvousGracefulExitError",
        }
    }
}

/// Why the rendezvous failed. `Display` starts with PyTorch's exception name.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ElasticError {
    /// The rendezvous was shut down.
    Closed {
        /// The run id.
        run_id: String,
    },
    /// The rendezvous was shut down while this node waited outside every round (a hot
    /// spare or a late node): PyTorch's graceful exit, not a failure of the job.
    GracefulExit {
        /// This node.
        node: String,
        /// The run id.
        run_id: String,
    },
    /// No complete round within the join timeout.
    Timeout {
        /// This node.
        node: String,
        /// The run id.
        run_id: String,
        /// The join timeout.
        timeout: Duration,
    },
    /// A key holds what this protocol never writes: something else uses the keys.
    BadValue {
        /// The key.
        key: String,
        /// The value, lossily decoded.
        value: String,
    },
    /// The reply does not answer the pending action (a driver bug).
    UnexpectedReply {
        /// The pending action.
        expected: &'static str,
        /// The reply given.
        got: &'static str,
    },
}

impl ElasticError {
    /// Which of PyTorch's exceptions this is.
    pub const fn kind(&self) -> ElasticErrorKind {
        match self {
            Self::Closed { .. } => ElasticErrorKind::Closed,
            Self::GracefulExit { .. } => ElasticErrorKind::GracefulExit,
            Self::Timeout { .. } => ElasticErrorKind::Timeout,
            Self::BadValue { .. } | Self::UnexpectedReply { .. } => ElasticErrorKind::State,
        }
    }
}

impl fmt::Display for ElasticError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::GracefulExit { node, run_id } => write!(
                f,
                "RendezvousGracefulExitError: the rendezvous '{run_id}' is closed, terminating \
                 pending rendezvous (node '{node}' was waiting outside the round)"
            ),
            Self::Closed { run_id } => write!(
                f,
                "RendezvousClosedError: the rendezvous '{run_id}' is closed (a node shut it \
                 down); start the job with a new run id"
            ),
            Self::Timeout {
                node,
                run_id,
                timeout,
            } => write!(
                f,
                "RendezvousTimeoutError: node '{node}' did not become a member of a complete \
                 round of rendezvous '{run_id}' within the join timeout ({}s); fewer than \
                 min_nodes nodes may have joined",
                timeout.as_secs_f64()
            ),
            Self::BadValue { key, value } => write!(
                f,
                "RendezvousStateError: elastic rendezvous key {key} holds '{value}', which this protocol never \
                 writes: another program is using the same run id"
            ),
            Self::UnexpectedReply { expected, got } => write!(
                f,
                "RendezvousStateError: elastic rendezvous misdriven: the pending action is '{expected}' but the \
                 reply given is '{got}'"
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for ElasticError {}

/// A member's view of its round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Member {
    round: u64,
    slot: u32,
    world: u32,
    next_tick: Instant,
    /// The neighbour's heartbeat counter as last read, and when it last moved.
    seen: i64,
    seen_at: Instant,
}

/// What comes after marking a round over.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Then {
    Rejoin,
    Left,
    Failed(ElasticError),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Idle,
    CheckClosed {
        round: Option<u64>,
    },
    ReadHint,
    Arrive {
        round: u64,
    },
    Announce {
        round: u64,
        slot: u32,
    },
    SetQuorum {
        round: u64,
        slot: u32,
    },
    WaitQuorum {
        round: u64,
        slot: u32,
    },
    WaitSize {
        round: u64,
        slot: u32,
        last_call: Instant,
    },
    Count {
        round: u64,
        slot: u32,
    },
    Close {
        round: u64,
        slot: u32,
        size: u32,
    },
    ReadSize {
        round: u64,
        slot: u32,
    },
    QuorumAfterClose {
        round: u64,
        slot: u32,
        size: u32,
    },
    Recheck {
        resume: Resume,
    },
    AskNext {
        round: u64,
    },
    Spare(Member),
    SpareWatch(Member),
    Advance {
        round: u64,
    },
    Beat(Member),
    Watch(Member),
    WaitOver(Member),
    ReadOver {
        round: u64,
    },
    MarkOver {
        round: u64,
        reason: String,
        then: Then,
    },
    ShutClosed,
    ShutSize {
        round: u64,
    },
    ShutQuorum {
        round: u64,
    },
    Done,
}

/// A wait to resume after a `CHECK` of `closed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resume {
    Quorum {
        round: u64,
        slot: u32,
    },
    Size {
        round: u64,
        slot: u32,
        last_call: Instant,
    },
    Spare(Member),
}

/// One node of the elastic rendezvous, as a state machine. See the module documentation
/// for the protocol and how to drive it.
#[derive(Debug, Clone)]
pub struct ElasticNode {
    settings: ElasticSettings,
    node: String,
    base: String,
    step: Step,
    awaiting: bool,
    local: VecDeque<LocalEvent>,
    events: VecDeque<Event>,
    join_deadline: Instant,
    /// The round this node holds a member's slot in (open or complete): leaving ends it.
    holding: Option<u64>,
    wait_until: Option<Instant>,
    /// Whether this node waits as a hot spare (outside a full round).
    spare: bool,
}

impl ElasticNode {
    /// A node called `node` (any text; it is only written for operators to read), idle
    /// until [`LocalEvent::Join`].
    pub fn new(settings: ElasticSettings, node: impl Into<String>) -> Self {
        let base = format!("rdzv.elastic.{}", settings.run_id);
        ElasticNode {
            settings,
            node: node.into(),
            base,
            step: Step::Idle,
            awaiting: false,
            local: VecDeque::new(),
            events: VecDeque::new(),
            join_deadline: Instant::ZERO,
            holding: None,
            wait_until: None,
            spare: false,
        }
    }

    /// The settings.
    pub fn settings(&self) -> &ElasticSettings {
        &self.settings
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The key prefix of this rendezvous, `rdzv.elastic.{run_id}`.
    pub fn base_key(&self) -> &str {
        &self.base
    }

    /// Whether the node is finished (left, shut down or failed): it has no more actions.
    pub fn is_done(&self) -> bool {
        self.step == Step::Done
    }

    /// Queues a local event; it takes effect at the next [`ElasticNode::poll_action`]
    /// once the outstanding action (if any) is answered.
    pub fn handle_local(&mut self, event: LocalEvent) {
        self.local.push_back(event);
    }

    /// The deadline of the outstanding wait, if one is outstanding.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.awaiting {
            self.wait_until
        } else {
            None
        }
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// The store operation to perform now, or `None` while one is outstanding, before
    /// [`LocalEvent::Join`] and once done. Every action returned must be answered with
    /// [`ElasticNode::handle_reply`] before the next call.
    #[must_use]
    pub fn poll_action(&mut self, now: Instant) -> Option<StoreAction> {
        if self.awaiting {
            return None;
        }
        while let Some(event) = self.local.pop_front() {
            self.apply_local(event, now);
        }
        let action = self.action(now)?;
        self.wait_until = match &action {
            StoreAction::Wait { until, .. } => Some(*until),
            _ => None,
        };
        self.awaiting = true;
        Some(action)
    }

    fn key(&self, suffix: core::fmt::Arguments<'_>) -> String {
        format!("{}/{}", self.base, suffix)
    }

    fn round_key(&self, round: u64, name: &str) -> String {
        self.key(format_args!("{round}/{name}"))
    }

    /// A wait's deadline: `limit`, but never more than one keep-alive interval away.
    fn capped(&self, now: Instant, limit: Instant) -> Instant {
        limit.min(now.saturating_add(self.settings.keep_alive_interval))
    }

    fn action(&self, now: Instant) -> Option<StoreAction> {
        let closed = || StoreAction::Check {
            key: self.key(format_args!("closed")),
        };
        Some(match &self.step {
            Step::Idle | Step::Done => return None,
            Step::CheckClosed { .. } | Step::Recheck { .. } => closed(),
            Step::ReadHint => StoreAction::Add {
                key: self.key(format_args!("round")),
                delta: 0,
            },
            Step::Arrive { round } => StoreAction::Add {
                key: self.round_key(*round, "arrivals"),
                delta: 1,
            },
            Step::Announce { round, slot } => StoreAction::Set {
                key: self.key(format_args!("{round}/node/{slot}")),
                value: self.node.as_bytes().to_vec(),
            },
            Step::SetQuorum { round, .. }
            | Step::QuorumAfterClose { round, .. }
            | Step::ShutQuorum { round } => StoreAction::Set {
                key: self.round_key(*round, "quorum"),
                value: Vec::new(),
            },
            Step::WaitQuorum { round, .. } => StoreAction::Wait {
                key: self.round_key(*round, "quorum"),
                until: self.capped(now, self.join_deadline),
            },
            Step::WaitSize {
                round, last_call, ..
            } => StoreAction::Wait {
                key: self.round_key(*round, "size"),
                until: self.capped(now, self.join_deadline.min(*last_call)),
            },
            Step::Count { round, .. } => StoreAction::Add {
                key: self.round_key(*round, "arrivals"),
                delta: 0,
            },
            Step::Close { round, size, .. } => StoreAction::CompareSet {
                key: self.round_key(*round, "size"),
                expected: Vec::new(),
                desired: format!("{size}").into_bytes(),
            },
            Step::ShutSize { round } => StoreAction::CompareSet {
                key: self.round_key(*round, "size"),
                expected: Vec::new(),
                desired: b"0".to_vec(),
            },
            Step::ReadSize { round, .. } => StoreAction::Get {
                key: self.round_key(*round, "size"),
            },
            Step::AskNext { round } => StoreAction::Set {
                key: self.round_key(*round, "over"),
                value: format!("node '{}' is waiting for the next round", self.node).into_bytes(),
            },
            Step::Spare(m) => StoreAction::Wait {
                key: self.round_key(m.round, "over"),
                until: m.next_tick.max(now),
            },
            Step::Advance { round } => StoreAction::CompareSet {
                key: self.key(format_args!("round")),
                expected: format!("{round}").into_bytes(),
                desired: format!("{}", round.saturating_add(1)).into_bytes(),
            },
            Step::Beat(m) => StoreAction::Add {
                key: self.key(format_args!("{}/hb/{}", m.round, m.slot)),
                delta: 1,
            },
            Step::Watch(m) | Step::SpareWatch(m) => StoreAction::Add {
                key: self.key(format_args!("{}/hb/{}", m.round, watched(m))),
                delta: 0,
            },
            Step::WaitOver(m) => StoreAction::Wait {
                key: self.round_key(m.round, "over"),
                until: m.next_tick.max(now),
            },
            Step::ReadOver { round } => StoreAction::Get {
                key: self.round_key(*round, "over"),
            },
            Step::MarkOver { round, reason, .. } => StoreAction::Set {
                key: self.round_key(*round, "over"),
                value: reason.as_bytes().to_vec(),
            },
            Step::ShutClosed => StoreAction::Set {
                key: self.key(format_args!("closed")),
                value: format!("shut down by node '{}'", self.node).into_bytes(),
            },
        })
    }

    fn apply_local(&mut self, event: LocalEvent, now: Instant) {
        if self.step == Step::Done {
            return;
        }
        match event {
            LocalEvent::Join => {
                if self.step == Step::Idle {
                    self.join_deadline = now.saturating_add(self.settings.join_timeout);
                    self.step = Step::CheckClosed { round: None };
                }
            }
            LocalEvent::Leave => match self.holding {
                Some(round) => {
                    self.step = Step::MarkOver {
                        round,
                        reason: format!("node '{}' left", self.node),
                        then: Then::Left,
                    }
                }
                None => self.finish(Event::Left),
            },
            LocalEvent::Shutdown => self.step = Step::ShutClosed,
            LocalEvent::WorkerFailed => {
                if let Step::Beat(m) | Step::Watch(m) | Step::WaitOver(m) = self.step {
                    self.step = Step::MarkOver {
                        round: m.round,
                        reason: format!("the workers of node '{}' failed", self.node),
                        then: Then::Rejoin,
                    };
                }
            }
        }
    }

    fn finish(&mut self, event: Event) {
        self.events.push_back(event);
        self.step = Step::Done;
        self.holding = None;
    }

    fn fail(&mut self, error: ElasticError) {
        self.finish(Event::Failed(error));
    }

    /// The rendezvous is closed: a graceful exit for a hot spare (PyTorch's redundancy
    /// list), `RendezvousClosedError` for anyone else.
    fn closed_error(&self) -> ElasticError {
        if self.spare {
            ElasticError::GracefulExit {
                node: self.node.clone(),
                run_id: self.settings.run_id.clone(),
            }
        } else {
            ElasticError::Closed {
                run_id: self.settings.run_id.clone(),
            }
        }
    }

    fn timeout_error(&self) -> ElasticError {
        ElasticError::Timeout {
            node: self.node.clone(),
            run_id: self.settings.run_id.clone(),
            timeout: self.settings.join_timeout,
        }
    }

    fn bad_value(&self, key: String, value: &[u8]) -> ElasticError {
        ElasticError::BadValue {
            key,
            value: String::from_utf8_lossy(value).into_owned(),
        }
    }

    /// Answers the outstanding action. `now` is when the reply arrived.
    pub fn handle_reply(&mut self, reply: StoreReply<'_>, now: Instant) {
        if !self.awaiting {
            self.fail(ElasticError::UnexpectedReply {
                expected: "nothing",
                got: reply.name(),
            });
            return;
        }
        self.awaiting = false;
        let expected = self.action(now).map_or("nothing", |a| a.name());
        let step = core::mem::replace(&mut self.step, Step::Done);
        let next = self.transition(step, reply, now);
        match next {
            // A finishing transition has already recorded its final event; it returns
            // `Done`.
            Ok(step) => self.step = step,
            Err(Mismatch) => self.fail(ElasticError::UnexpectedReply {
                expected,
                got: reply.name(),
            }),
        }
    }

    fn transition(
        &mut self,
        step: Step,
        reply: StoreReply<'_>,
        now: Instant,
    ) -> Result<Step, Mismatch> {
        use StoreReply as R;
        let max = self.settings.nodes.max;
        let min = self.settings.nodes.min;
        let step_kind = match step {
            Step::Close { .. } => StepKind::Close,
            _ => StepKind::Other,
        };
        Ok(match (step, reply) {
            (Step::CheckClosed { round }, R::Checked(closed)) => {
                if closed {
                    self.fail(self.closed_error());
                    return Ok(Step::Done);
                }
                match round {
                    Some(round) => Step::Arrive { round },
                    None => Step::ReadHint,
                }
            }
            (Step::ReadHint, R::Added(round)) => match u64::try_from(round) {
                Ok(round) => Step::Arrive { round },
                Err(_) => {
                    let key = self.key(format_args!("round"));
                    self.fail(self.bad_value(key, format!("{round}").as_bytes()));
                    return Ok(Step::Done);
                }
            },
            (Step::Arrive { round }, R::Added(slot)) => match u32::try_from(slot) {
                Ok(slot) if slot >= 1 => {
                    self.holding = Some(round);
                    Step::Announce { round, slot }
                }
                _ => {
                    let key = self.round_key(round, "arrivals");
                    self.fail(self.bad_value(key, format!("{slot}").as_bytes()));
                    return Ok(Step::Done);
                }
            },
            (Step::Announce { round, slot }, R::Set) => {
                // With min_nodes == max_nodes there is no last call, so no quorum key:
                // the node with slot max_nodes closes the round on arrival.
                if slot == min && min < max {
                    Step::SetQuorum { round, slot }
                } else {
                    self.after_quorum(round, slot, now, slot < min)
                }
            }
            (Step::SetQuorum { round, slot }, R::Set) => self.after_quorum(round, slot, now, false),
            (Step::WaitQuorum { round, slot }, R::Waited) => {
                self.after_quorum(round, slot, now, false)
            }
            (Step::WaitQuorum { round, slot }, R::TimedOut) => {
                if now >= self.join_deadline {
                    self.timed_out(round)
                } else {
                    Step::Recheck {
                        resume: Resume::Quorum { round, slot },
                    }
                }
            }
            (Step::WaitSize { round, slot, .. }, R::Waited) => Step::ReadSize { round, slot },
            (
                Step::WaitSize {
                    round,
                    slot,
                    last_call,
                },
                R::TimedOut,
            ) => {
                if now >= last_call {
                    Step::Count { round, slot }
                } else if now >= self.join_deadline {
                    self.timed_out(round)
                } else {
                    Step::Recheck {
                        resume: Resume::Size {
                            round,
                            slot,
                            last_call,
                        },
                    }
                }
            }
            (Step::Recheck { resume }, R::Checked(closed)) => {
                if closed {
                    self.fail(self.closed_error());
                    return Ok(Step::Done);
                }
                match resume {
                    Resume::Quorum { round, slot } => Step::WaitQuorum { round, slot },
                    Resume::Size {
                        round,
                        slot,
                        last_call,
                    } => Step::WaitSize {
                        round,
                        slot,
                        last_call,
                    },
                    Resume::Spare(m) => Step::SpareWatch(Member {
                        next_tick: now.saturating_add(self.settings.keep_alive_interval),
                        ..m
                    }),
                }
            }
            (Step::Count { round, slot }, R::Added(count)) => {
                let count = u32::try_from(count).unwrap_or(u32::MAX).max(slot);
                Step::Close {
                    round,
                    slot,
                    size: count.min(max),
                }
            }
            (Step::Close { round, slot, .. }, R::Value(value))
            | (Step::ReadSize { round, slot }, R::Value(value)) => {
                let closer = matches!(step_kind, StepKind::Close);
                match parse_counter(value)
                    .ok()
                    .and_then(|n| u32::try_from(n).ok())
                {
                    // The closer sets the quorum too, for nodes below min_nodes still
                    // waiting on it (the node with slot min_nodes may have died).
                    Some(size) if size <= max && closer && min < max => {
                        Step::QuorumAfterClose { round, slot, size }
                    }
                    Some(size) if size <= max => self.decide(round, slot, size, now),
                    _ => {
                        let key = self.round_key(round, "size");
                        self.fail(self.bad_value(key, value));
                        return Ok(Step::Done);
                    }
                }
            }
            (Step::QuorumAfterClose { round, slot, size }, R::Set) => {
                self.decide(round, slot, size, now)
            }
            (Step::AskNext { round }, R::Set) => Step::Advance { round },
            (Step::Spare(m), R::Waited) => {
                self.join_deadline = now.saturating_add(self.settings.join_timeout);
                Step::Advance { round: m.round }
            }
            (Step::Spare(m), R::TimedOut) => Step::Recheck {
                resume: Resume::Spare(m),
            },
            (Step::SpareWatch(m), R::Added(value)) => match self.watch(m, value, now) {
                Ok(m) => Step::Spare(m),
                Err(dead) => dead,
            },
            (Step::Advance { round }, R::Value(_)) => {
                self.holding = None;
                self.spare = false;
                Step::CheckClosed {
                    round: Some(round.saturating_add(1)),
                }
            }
            (Step::Beat(m), R::Added(_)) => {
                if m.world > 1 {
                    Step::Watch(m)
                } else {
                    Step::WaitOver(m)
                }
            }
            (Step::Watch(m), R::Added(value)) => match self.watch(m, value, now) {
                Ok(m) => Step::WaitOver(m),
                Err(dead) => dead,
            },
            (Step::WaitOver(m), R::Waited) => Step::ReadOver { round: m.round },
            (Step::WaitOver(m), R::TimedOut) => Step::Beat(Member {
                next_tick: now.saturating_add(self.settings.keep_alive_interval),
                ..m
            }),
            (Step::ReadOver { round }, R::Value(reason)) => {
                self.events.push_back(Event::RoundOver {
                    round,
                    reason: String::from_utf8_lossy(reason).into_owned(),
                });
                self.join_deadline = now.saturating_add(self.settings.join_timeout);
                Step::Advance { round }
            }
            (
                Step::MarkOver {
                    round,
                    then,
                    reason,
                },
                R::Set,
            ) => match then {
                Then::Rejoin => {
                    self.events.push_back(Event::RoundOver { round, reason });
                    self.join_deadline = now.saturating_add(self.settings.join_timeout);
                    Step::Advance { round }
                }
                Then::Left => {
                    self.finish(Event::Left);
                    return Ok(Step::Done);
                }
                Then::Failed(error) => {
                    self.fail(error);
                    return Ok(Step::Done);
                }
            },
            (Step::ShutClosed, R::Set) => match self.holding {
                Some(round) => Step::ShutSize { round },
                None => {
                    self.finish(Event::ShutDown);
                    return Ok(Step::Done);
                }
            },
            (Step::ShutSize { round }, R::Value(_)) => Step::ShutQuorum { round },
            (Step::ShutQuorum { .. }, R::Set) => {
                self.finish(Event::ShutDown);
                return Ok(Step::Done);
            }
            _ => return Err(Mismatch),
        })
    }

    /// After the quorum: wait for the round's size (the last call), or close it at once
    /// when this node fills it; `below` means the quorum is not there yet.
    fn after_quorum(&self, round: u64, slot: u32, now: Instant, below: bool) -> Step {
        let nodes = self.settings.nodes;
        if slot >= nodes.max {
            Step::Close {
                round,
                slot,
                size: nodes.max,
            }
        } else if below && nodes.min < nodes.max {
            Step::WaitQuorum { round, slot }
        } else {
            // With min_nodes == max_nodes only the arrival of slot max_nodes closes the
            // round: no last call.
            let last_call = if nodes.min < nodes.max {
                now.saturating_add(self.settings.last_call)
            } else {
                Instant::from_nanos(u64::MAX)
            };
            Step::WaitSize {
                round,
                slot,
                last_call,
            }
        }
    }

    /// Records the watched member's heartbeat counter; `Err` with the step that ends the
    /// round when it has stood still for the keep-alive timeout.
    fn watch(&self, mut m: Member, value: i64, now: Instant) -> Result<Member, Step> {
        if value != m.seen {
            m.seen = value;
            m.seen_at = now;
            Ok(m)
        } else if now.saturating_duration_since(m.seen_at) >= self.settings.keep_alive_timeout() {
            Err(Step::MarkOver {
                round: m.round,
                reason: format!(
                    "rank {} had no heartbeat for {}s (seen by node '{}')",
                    watched(&m) - 1,
                    self.settings.keep_alive_timeout().as_secs_f64(),
                    self.node
                ),
                then: Then::Rejoin,
            })
        } else {
            Ok(m)
        }
    }

    fn timed_out(&self, round: u64) -> Step {
        Step::MarkOver {
            round,
            reason: format!("node '{}' timed out joining", self.node),
            then: Then::Failed(self.timeout_error()),
        }
    }

    /// The round closed with `size` members: a member, or a late node.
    fn decide(&mut self, round: u64, slot: u32, size: u32, now: Instant) -> Step {
        if slot <= size {
            self.events.push_back(Event::Complete(RoundOutcome {
                round,
                rank: slot - 1,
                world_size: size,
                store_prefix: format!("torch.rendezvous.{}.{round}", self.settings.run_id),
            }));
            Step::Beat(Member {
                round,
                slot,
                world: size,
                next_tick: now.saturating_add(self.settings.keep_alive_interval),
                seen: -1,
                seen_at: now,
            })
        } else {
            let hot_spare = size > 0 && size >= self.settings.nodes.max;
            self.events.push_back(Event::Waiting { round, hot_spare });
            self.spare = hot_spare;
            // A late node holds no member's slot: leaving must not end the round.
            self.holding = None;
            if hot_spare {
                // A hot spare watches one member too, so that a round whose members all
                // died (or a round of one) still ends.
                Step::SpareWatch(Member {
                    round,
                    slot,
                    world: size,
                    next_tick: now.saturating_add(self.settings.keep_alive_interval),
                    seen: -1,
                    seen_at: now,
                })
            } else {
                Step::AskNext { round }
            }
        }
    }
}

/// The member this one watches: a member the next slot round the ring, a hot spare the
/// member its slot falls on modulo the world size.
fn watched(m: &Member) -> u32 {
    if m.slot > m.world {
        (m.slot - 1) % m.world + 1
    } else {
        m.slot % m.world + 1
    }
}

/// A reply that does not answer the pending action.
struct Mismatch;

/// Whether the step answered was the closing compare-set.
enum StepKind {
    Close,
    Other,
}
