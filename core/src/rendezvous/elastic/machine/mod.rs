//! [`ElasticNode`]: one node's side of the elastic rendezvous (see the module above for
//! the protocol and the key layout).
//!
//! A node is in one phase at a time, each a module with its steps' "what I send"
//! (`action`) and "what a reply does" (`on_reply`) side by side; the steps themselves
//! are types in [`steps`], below every phase, since a reply in one phase names a step of
//! the next and the phases must not import each other:
//!
//! - [`join`]: take a slot in the current round, announce it, wait for `min_nodes`; after
//!   a round, advance the round hint to the next one;
//! - [`tick`]: an open round's keep-alive, once per interval of any wait there;
//! - [`last_call`]: wait for the round's size; the closer reads the roster and
//!   compare-sets the size;
//! - [`confirm`]: every member acknowledges the world, and is released by `go`;
//! - [`keep_alive`]: a complete round's heartbeats and watch, and its hot spares';
//! - [`leave`]: strike a slot from an open round, end a complete one (`over`), or close
//!   the rendezvous for good ([`steps::Shutdown`]).
//!
//! [`roster`] parses what the closer reads and writes, and deals the ranks.
//!
//! ```text
//!              LocalEvent::Join
//!   Idle -------------------------+
//!                                 v
//!       +-------------------> +------+  arrive (a fresh node guesses round 0),
//!       |  the next round     | Join |  announce, wait on the quorum
//!       |  (advance the hint) +------+ <=========+
//!       |                        |               H
//!       |        min_nodes live  |           +------+  once per interval of a wait
//!       |        (last call), or |           | Tick |  in an open round: heartbeat,
//!       |        max_nodes live  v           +------+  arrivals, the watched slot,
//!       |                   +----------+       H  H    `closed`
//!       |                   | LastCall | <=====+  H
//!       |                   +----------+          H    a dead neighbour: struck,
//!       |  wait for the size; the closer reads    H    then the wait resumes
//!       |  roster and compare-sets it             H
//!       |                        | the world  +-------+
//!       |                        v            | Leave |  strike a slot; end a round
//!       |  late: ask for    +---------+       +-------+  (`over`); shut down
//!       +------------------ | Confirm |          ^  |
//!       |  the next round   +---------+ ---------+  |    round over: rejoin (left,
//!       |                go |   |  verdict `fail`|  |    or failed: Done)
//!       |                   v   v not in the     |  |
//!       |        +-----------+    world, round   |  |
//!       +------- | KeepAlive |    full (spare)   |  |
//!       | `over` +-----------+ ------------------+  |
//!       |  set    a dead member, workers failed     |
//!       +-------------------------------------------+
//!
//!   H: a wait that times out ticks, then resumes (a hot spare's in KeepAlive too)
//!   join timeout, LocalEvent::Leave in an open round:  Join, LastCall --> Leave
//!   LocalEvent::Leave in a complete round:  KeepAlive, Confirm --> Leave (`over`)
//!   LocalEvent::Shutdown, from any phase:  Shutdown --> Done
//!   a foreign value, a closed rendezvous, a misdriven reply:  --> Done (failed)
//! ```

use alloc::collections::VecDeque;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;
use core::time::Duration;
use steps::{Confirm, Join, KeepAlive, LastCall, Leave, OpenWatch, Resume, Shutdown, Then, Tick};

mod confirm;
mod join;
mod keep_alive;
mod last_call;
mod leave;
pub(super) mod roster;
mod steps;
mod tick;

use super::{ElasticSettings, Instant};

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
    /// `append(key, value)` (creating the key when missing); answer [`StoreReply::Set`].
    Append {
        /// The key.
        key: String,
        /// The bytes to add at the end.
        value: Vec<u8>,
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
    /// No store operation: wait until `until` (a closer's pause before it reads the
    /// roster again), then answer [`StoreReply::TimedOut`]. A runtime sleeps, or serves
    /// other work meanwhile; it sends nothing to the store.
    Pause {
        /// When to answer.
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
            Self::Append { .. } => "append",
            Self::Wait { .. } => "wait",
            Self::Pause { .. } => "pause",
        }
    }

    /// The key the action names (empty for [`StoreAction::Pause`], which names none).
    pub fn key(&self) -> &str {
        match self {
            Self::Check { key }
            | Self::Add { key, .. }
            | Self::Set { key, .. }
            | Self::Append { key, .. }
            | Self::CompareSet { key, .. }
            | Self::Get { key }
            | Self::Wait { key, .. } => key,
            Self::Pause { .. } => "",
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
    /// The set (or append) is done.
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
    /// Rank 0's contact ([`ElasticNode::set_contact`], e.g. torchrun's `MASTER_ADDR` and
    /// `MASTER_PORT` as `addr:port`), when it gave one: it comes with the world, so no
    /// rank needs a store request to learn it.
    pub master: Option<String>,
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
    /// The round this node was a member of is over (or, closed with this node, failed
    /// before it was complete: a member never acknowledged it); it rejoins the next one.
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

/// Added to the round hint when the rendezvous is closed: a joiner's first read, and the
/// compare-set that advances the hint, tell closed runs apart at no extra cost.
pub(super) const CLOSED_MARK: i64 = 1 << 40;

/// Added to round 0's arrivals counter by its closer once the round is closed, when it
/// handed out fewer than `max_nodes` slots (and by closing the rendezvous), so that a
/// fresh node's guessed arrival in round 0 finds out at once that it must read the round
/// hint; after a closer that handed out `max_nodes` or more, the guess's slot above
/// `max_nodes` says so instead. Above every count of arrivals and departures (at most
/// [`MAX_SLOTS`] each).
pub(super) const ARRIVALS_CLOSED: i64 = 1 << 48;

/// The most slots one round may hand out; a counter beyond it is a foreign value.
pub(super) const MAX_SLOTS: u32 = 1 << 16;

/// A slot of a round: this node's while it waits in the round, or the one it strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seat {
    round: u64,
    slot: u32,
}

/// Where a node is: one phase (each a module below with its own steps), or idle before
/// [`LocalEvent::Join`], or done.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Idle,
    Join(Join),
    Tick(Tick),
    LastCall(LastCall),
    Confirm(Confirm),
    KeepAlive(KeepAlive),
    Leave(Leave),
    Shutdown(Shutdown),
    Done,
}

impl Step {
    /// What this node sends in this step; `None` when idle or done.
    fn action(&self, n: &ElasticNode, now: Instant) -> Option<StoreAction> {
        Some(match self {
            Step::Idle | Step::Done => return None,
            Step::Join(s) => s.action(n, now),
            Step::Tick(s) => s.action(n),
            Step::LastCall(s) => s.action(n, now),
            Step::Confirm(s) => s.action(n, now),
            Step::KeepAlive(s) => s.action(n, now),
            Step::Leave(s) => s.action(n),
            Step::Shutdown(s) => s.action(n),
        })
    }

    /// What a reply does: the next step. A finishing step records its final event and
    /// returns `Done`.
    fn on_reply(self, n: &mut ElasticNode, reply: StoreReply<'_>, now: Instant) -> Next {
        match self {
            Step::Idle | Step::Done => Err(Mismatch),
            Step::Join(s) => s.on_reply(n, reply, now),
            Step::Tick(s) => s.on_reply(n, reply, now),
            Step::LastCall(s) => s.on_reply(n, reply, now),
            Step::Confirm(s) => s.on_reply(n, reply, now),
            Step::KeepAlive(s) => s.on_reply(n, reply, now),
            Step::Leave(s) => s.on_reply(n, reply, now),
            Step::Shutdown(s) => s.on_reply(n, reply),
        }
    }
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
    /// The round this node holds a slot in (open or complete): leaving ends or leaves it.
    holding: Option<u64>,
    wait_until: Option<Instant>,
    /// Whether this node waits as a hot spare (outside a full round).
    spare: bool,
    /// This node's slot in the round it holds, while the round is open.
    open_slot: Option<u32>,
    open: OpenWatch,
    /// The slots of the round just closed, by rank.
    world: Vec<u32>,
    /// Rank 0's contact in the round just closed.
    master: Option<String>,
    /// The slot of the closer whose compare-set closed the round just closed (it counts
    /// as acknowledged), when the size value names one.
    closer: Option<u32>,
    /// This node's contact, written with its arrivals ([`ElasticNode::set_contact`]).
    contact: Option<String>,
    /// Whether an arrival's roster line has carried `contact` already
    /// ([`ElasticNode::wants_contact`]).
    contact_carried: bool,
    /// The round and rank this node held last, for stable ranks.
    prev: Option<(u64, u32)>,
    /// The live arrivals of the open round this node holds a slot in, as last read.
    open_live: u32,
}

/// Where the open round a node waits in stands ([`ElasticNode::open_round`]), for a
/// progress line: "3 of min 4 nodes; last call ends in 12 s".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpenRound {
    /// The round.
    pub round: u64,
    /// The nodes in it that were still there when this node last read its arrivals.
    pub live: u32,
    /// `min_nodes`.
    pub min: u32,
    /// `max_nodes`.
    pub max: u32,
    /// When this node's last call ends (the round closes with the nodes there by then),
    /// or `None` before `min_nodes` have arrived.
    pub last_call_ends: Option<Instant>,
}

impl ElasticNode {
    /// A node called `node` (any text; it is written to the roster, and orders newcomers'
    /// ranks), idle until [`LocalEvent::Join`].
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
            open_slot: None,
            open: OpenWatch::default(),
            world: Vec::new(),
            master: None,
            closer: None,
            contact: None,
            contact_carried: false,
            prev: None,
            open_live: 0,
        }
    }

    /// Sets what this node tells the others when it is rank 0 (torchrun: `MASTER_ADDR`
    /// and a free `MASTER_PORT`, as `addr:port`); it travels with each later arrival's
    /// roster line, and rank 0's comes with the world to every member
    /// ([`RoundOutcome::master`]), at no extra store request. Whitespace, `,` and `;`
    /// become `?`; empty text clears it.
    ///
    /// It takes effect at this node's next arrival. A node rejoins as soon as it sees its
    /// round end, before its driver's caller hears of it, so a contact that must be fresh
    /// in every round (torchrun's free `MASTER_PORT`) is set when
    /// [`ElasticNode::wants_contact`] says so.
    pub fn set_contact(&mut self, contact: &str) {
        self.contact_carried = false;
        let odd = |c: char| c.is_whitespace() || c.is_control() || c == ',' || c == ';';
        self.contact = (!contact.is_empty()).then(|| contact.replace(odd, "?"));
    }

    /// Whether the next action announces an arrival (this node's roster line) with a
    /// contact that an earlier arrival's line carried already. A driver that offers a
    /// fresh contact in every round (c10d picks a free `MASTER_PORT` for each) calls
    /// [`ElasticNode::set_contact`] when this is true, before
    /// [`ElasticNode::poll_action`]; the node's old contact is used otherwise.
    pub fn wants_contact(&self) -> bool {
        !self.awaiting
            && self.contact_carried
            && matches!(self.step, Step::Join(Join::Announce { .. }))
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

    /// The open round this node waits in for more nodes, or `None` (joining, closing, a
    /// member of a complete round, a hot spare, done). A read-only view: no store work.
    pub fn open_round(&self) -> Option<OpenRound> {
        let (round, last_call) = match &self.step {
            Step::Join(Join::WaitQuorum(seat)) => (seat.round, None),
            Step::LastCall(LastCall::WaitSize { seat, last_call }) => {
                (seat.round, Some(*last_call))
            }
            Step::Tick(tick) => match tick.resume() {
                Resume::Quorum(seat) => (seat.round, None),
                Resume::Size { seat, last_call } => (seat.round, Some(last_call)),
                Resume::Spare(_) => return None,
            },
            _ => return None,
        };
        let nodes = self.settings.nodes;
        Some(OpenRound {
            round,
            live: self.open_live,
            min: nodes.min,
            max: nodes.max,
            // `min == max` (no last call) and a round that fell below `min` wait forever.
            last_call_ends: last_call.filter(|at| *at != Instant::from_nanos(u64::MAX)),
        })
    }

    /// Queues a local event; it takes effect at the next [`ElasticNode::poll_action`]
    /// once the outstanding action (if any) is answered.
    pub fn handle_local(&mut self, event: LocalEvent) {
        self.local.push_back(event);
    }

    /// The deadline of the outstanding wait or pause, if one is outstanding.
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
        let action = self.step.action(self, now)?;
        if matches!(self.step, Step::Join(Join::Announce { .. })) {
            self.contact_carried = true;
        }
        self.wait_until = match &action {
            StoreAction::Wait { until, .. } | StoreAction::Pause { until } => Some(*until),
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

    fn hb_key(&self, round: u64, slot: u32) -> String {
        self.key(format_args!("{round}/hb/{slot}"))
    }

    /// A wait's deadline: `limit`, but never more than one keep-alive interval away.
    fn capped(&self, now: Instant, limit: Instant) -> Instant {
        limit.min(now.saturating_add(self.settings.keep_alive_interval))
    }

    /// This node's roster line: `+{slot} {round}:{rank}|- {contact}|- {node}`.
    fn roster_line(&self, slot: u32) -> Vec<u8> {
        let mut line = match self.prev {
            Some((round, rank)) => format!("+{slot} {round}:{rank} "),
            None => format!("+{slot} - "),
        };
        line.push_str(self.contact.as_deref().unwrap_or("-"));
        line.push(' ');
        line.push_str(&self.node.replace(char::is_control, "?"));
        line.push('\n');
        line.into_bytes()
    }

    /// `ADD delta` to `{round}/{name}`.
    fn add(&self, round: u64, name: &str, delta: i64) -> StoreAction {
        StoreAction::Add {
            key: self.round_key(round, name),
            delta,
        }
    }

    /// `ADD delta` to the heartbeat of `slot` in `round`.
    fn add_hb(&self, round: u64, slot: u32, delta: i64) -> StoreAction {
        StoreAction::Add {
            key: self.hb_key(round, slot),
            delta,
        }
    }

    /// `SET {round}/{name}` to `value`.
    fn set(&self, round: u64, name: &str, value: Vec<u8>) -> StoreAction {
        StoreAction::Set {
            key: self.round_key(round, name),
            value,
        }
    }

    /// `GET {round}/{name}`.
    fn get(&self, round: u64, name: &str) -> StoreAction {
        StoreAction::Get {
            key: self.round_key(round, name),
        }
    }

    /// `WAIT {round}/{name}` until `until`.
    fn wait(&self, round: u64, name: &str, until: Instant) -> StoreAction {
        StoreAction::Wait {
            key: self.round_key(round, name),
            until,
        }
    }

    /// `COMPARE_SET {round}/{name}` from missing to `desired`.
    fn create(&self, round: u64, name: &str, desired: Vec<u8>) -> StoreAction {
        StoreAction::CompareSet {
            key: self.round_key(round, name),
            expected: Vec::new(),
            desired,
        }
    }

    /// `CHECK closed`.
    fn check_closed(&self) -> StoreAction {
        StoreAction::Check {
            key: self.key(format_args!("closed")),
        }
    }

    fn apply_local(&mut self, event: LocalEvent, now: Instant) {
        if self.step == Step::Done {
            return;
        }
        match event {
            LocalEvent::Join => {
                if self.step == Step::Idle {
                    self.join_deadline = now.saturating_add(self.settings.join_timeout);
                    // A fresh node guesses round 0 (a job's start) instead of reading the
                    // hint; round 0's closer marks its arrivals, so a wrong guess costs
                    // one request.
                    self.step = Step::Join(Join::Arrive {
                        round: 0,
                        guessed: true,
                    });
                }
            }
            LocalEvent::Leave => match (self.holding, self.open_slot) {
                // In an open round: leave it, so that it closes without this node.
                (Some(round), Some(slot)) => {
                    self.step = self.depart(Seat { round, slot }, Then::Left)
                }
                (Some(round), None) => {
                    self.step = Step::Leave(Leave::MarkOver {
                        round,
                        reason: format!("node '{}' left", self.node),
                        then: Then::Left,
                    })
                }
                _ => self.step = self.finish(Event::Left),
            },
            LocalEvent::Shutdown => self.step = Step::Shutdown(Shutdown::Closed),
            LocalEvent::WorkerFailed => {
                if let Step::KeepAlive(
                    KeepAlive::Beat(m) | KeepAlive::Watch(m) | KeepAlive::WaitOver(m),
                ) = self.step
                {
                    let reason = format!("the workers of node '{}' failed", self.node);
                    self.step = end_round(m.round, reason);
                }
            }
        }
    }

    /// Records the final `event`; returns `Done`.
    fn finish(&mut self, event: Event) -> Step {
        self.events.push_back(event);
        self.step = Step::Done;
        self.holding = None;
        self.open_slot = None;
        Step::Done
    }

    /// Fails with `error`; returns `Done`.
    fn fail(&mut self, error: ElasticError) -> Step {
        self.finish(Event::Failed(error))
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
        let expected = self.step.action(self, now).map_or("nothing", |a| a.name());
        let step = core::mem::replace(&mut self.step, Step::Done);
        // A finishing transition has already recorded its final event; it returns `Done`.
        let next = step.on_reply(self, reply, now);
        self.step = next.unwrap_or_else(|Mismatch| {
            self.fail(ElasticError::UnexpectedReply {
                expected,
                got: reply.name(),
            })
        });
    }

    /// Fails with a foreign value at `{round}/{name}`; returns `Done`.
    fn foreign(&mut self, round: u64, name: &str, value: &[u8]) -> Step {
        let key = self.round_key(round, name);
        self.fail(self.bad_value(key, value))
    }
}

/// Marks `round` over for `reason` (a member died, failed or did not confirm), then
/// rejoins.
fn end_round(round: u64, reason: String) -> Step {
    Step::Leave(Leave::MarkOver {
        round,
        reason,
        then: Then::Rejoin,
    })
}

/// A reply that does not answer the pending action.
struct Mismatch;

/// What a reply leads to: the next step, or [`Mismatch`].
type Next = Result<Step, Mismatch>;
