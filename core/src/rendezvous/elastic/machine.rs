//! [`ElasticNode`]: one node's side of the elastic rendezvous (see the module above for
//! the protocol and the key layout).

use alloc::collections::VecDeque;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;
use core::time::Duration;

use super::key_use::beat_expired;
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

/// The arrivals counter counts departures in its high 32 bits: one `ADD` of this marks a
/// slot gone (see [`ElasticSettings::live_count`]).
const DEPARTED: i64 = 1 << 32;

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

/// Added to a round's acknowledgement counter (`{round}/ready`, whose low 32 bits count
/// the acknowledgements) by each member that waited in vain for `go`, before it decides:
/// the acknowledgement that completes the count sees whether anybody gave up before it.
const GAVE_UP: i64 = 1 << 32;

/// A round's confirmation verdict (`{round}/verdict`), compare-set once from missing: the
/// round stands, or it failed.
const VERDICT_GO: &[u8] = b"go";
const VERDICT_FAIL: &[u8] = b"fail";

/// The most slots one round may hand out; a counter beyond it is a foreign value.
const MAX_SLOTS: u32 = 1 << 16;

/// The first pause before the closer reads the roster again, for an arrival whose entry
/// is not there yet (counted, its `APPEND` still in flight); each later one twice as
/// long, up to one keep-alive interval in all. A pause costs no store request; long
/// enough that one usually suffices on a loaded machine, short beside a round's close.
const ROSTER_POLL: Duration = Duration::from_millis(5);

/// A member's (or hot spare's) view of its round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Member {
    round: u64,
    slot: u32,
    world: u32,
    /// The slot and rank of the member whose heartbeat this node watches.
    watch_slot: u32,
    watch_rank: u32,
    next_tick: Instant,
    /// The watched heartbeat counter as last read, and when it last moved.
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

/// What comes after marking a slot of an open round gone.
#[derive(Debug, Clone, PartialEq, Eq)]
enum AfterGone {
    /// A watcher marked a dead neighbour: go on waiting.
    Resume(Resume),
    /// This node departs (timed out, left): see whether the round closed with it first.
    Own(Then),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Idle,
    /// Reads the round hint; `guess` is the arrivals counter of round 0 as this node's
    /// first guess found it (closed), to be used as its arrival if the hint says 0.
    ReadHint {
        guess: Option<i64>,
    },
    Arrive {
        round: u64,
        /// A fresh node's arrival in round 0 without reading the hint first.
        guessed: bool,
    },
    Announce {
        round: u64,
        slot: u32,
        live: u32,
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
    /// An open round's tick: this node's heartbeat, the arrivals, the watched slot's
    /// heartbeat, then `closed`.
    OpenBeat {
        resume: Resume,
    },
    OpenCount {
        resume: Resume,
    },
    OpenWatch {
        resume: Resume,
        target: u32,
    },
    Recheck {
        resume: Resume,
    },
    /// Marking `slot` of an open round gone: claim it, log it in the roster, count it.
    GoneClaim {
        round: u64,
        slot: u32,
        after: AfterGone,
    },
    GoneLog {
        round: u64,
        slot: u32,
        after: AfterGone,
    },
    GoneCount {
        round: u64,
        slot: u32,
        after: AfterGone,
    },
    /// A departing node: did the round close (with it) before it left?
    OwnCheck {
        round: u64,
        slot: u32,
        then: Then,
    },
    OwnRead {
        round: u64,
        slot: u32,
        then: Then,
    },
    Count {
        round: u64,
        slot: u32,
    },
    ReadRoster {
        round: u64,
        slot: u32,
        count: u32,
        since: Instant,
        tries: u32,
    },
    RosterPoll {
        round: u64,
        slot: u32,
        count: u32,
        since: Instant,
        tries: u32,
    },
    /// The closer compare-sets the size; `mark`: it is round 0's and fewer than
    /// `max_nodes` slots were handed out when it read the roster, so a fresh node's guess
    /// could not tell that the round is closed: it marks the arrivals after winning.
    Close {
        round: u64,
        slot: u32,
        proposal: String,
        mark: bool,
    },
    /// Round 0's closer marks its arrivals closed (see [`ARRIVALS_CLOSED`]).
    MarkArrivals {
        round: u64,
        slot: u32,
    },
    ReadSize {
        round: u64,
        slot: u32,
    },
    /// The closer sets the quorum before it compare-sets the size, for nodes below
    /// `min_nodes` still waiting on it: no arrival may have seen exactly `min_nodes` live
    /// (a departure counted late), and a closer that leaves or dies right after its
    /// compare-set must not leave them waiting.
    QuorumBeforeClose {
        round: u64,
        slot: u32,
        proposal: String,
        mark: bool,
    },
    /// A member acknowledges the round (`ready`); the last one releases the others.
    Ack {
        round: u64,
        slot: u32,
        rank: u32,
    },
    SetGo {
        round: u64,
        slot: u32,
        rank: u32,
    },
    WaitGo {
        round: u64,
        slot: u32,
        rank: u32,
        deadline: Instant,
    },
    /// A member that waited in vain for the release counts itself into `ready` (high
    /// bits), which reads the acknowledgements and tells a later last acknowledger that
    /// somebody may have decided before it.
    ReadReady {
        round: u64,
        slot: u32,
        rank: u32,
    },
    /// The one decision on the round's confirmation: the first compare-set of the verdict
    /// wins, and every member obeys it (`go`: a member that waited in vain and found every
    /// acknowledgement in, or the last acknowledger when one gave up before it; `fail`: a
    /// member that waited in vain and did not).
    Verdict {
        round: u64,
        slot: u32,
        rank: u32,
        go: bool,
    },
    AskNext {
        round: u64,
    },
    Spare(Member),
    SpareWatch(Member),
    /// Advances the round hint past `round` (compare-set), to arrive in the next round.
    Advance {
        round: u64,
    },
    /// Round 0's advance found the hint at `0` (a node read it then, which creates it):
    /// advance it from there.
    AdvanceRead {
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
    ShutMark,
    /// Marks round 0's arrivals too, so that a fresh node's guess finds out at once.
    ShutArrivals,
    ShutSize {
        round: u64,
    },
    ShutQuorum {
        round: u64,
    },
    Done,
}

/// A wait to resume after an open round's tick.
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

impl Resume {
    fn round_slot(&self) -> (u64, u32) {
        match *self {
            Resume::Quorum { round, slot } | Resume::Size { round, slot, .. } => (round, slot),
            Resume::Spare(m) => (m.round, m.slot),
        }
    }
}

/// What a node waiting in an open round knows of the neighbour it watches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct OpenWatch {
    target: u32,
    seen: i64,
    seen_at: Instant,
    /// The slots this node has found dead (or gone) in this round: skipped.
    marked: Vec<u32>,
}

/// One arrival of a round, as its roster says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry<'a> {
    slot: u32,
    /// The round and rank this node held last.
    prev: Option<(u64, u32)>,
    /// What it tells the others when it is rank 0.
    contact: Option<&'a str>,
    node: &'a str,
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
        self.contact = (!contact.is_empty()).then(|| {
            contact
                .chars()
                .map(|c| {
                    if c.is_whitespace() || c.is_control() || c == ',' || c == ';' {
                        '?'
                    } else {
                        c
                    }
                })
                .collect()
        });
    }

    /// Whether the next action announces an arrival (this node's roster line) with a
    /// contact that an earlier arrival's line carried already. A driver that offers a
    /// fresh contact in every round (c10d picks a free `MASTER_PORT` for each) calls
    /// [`ElasticNode::set_contact`] when this is true, before
    /// [`ElasticNode::poll_action`]; the node's old contact is used otherwise.
    pub fn wants_contact(&self) -> bool {
        !self.awaiting && self.contact_carried && matches!(self.step, Step::Announce { .. })
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
            Step::WaitQuorum { round, .. } => (*round, None),
            Step::WaitSize {
                round, last_call, ..
            } => (*round, Some(*last_call)),
            Step::OpenBeat { resume }
            | Step::OpenCount { resume }
            | Step::OpenWatch { resume, .. }
            | Step::Recheck { resume } => match resume {
                Resume::Quorum { round, .. } => (*round, None),
                Resume::Size {
                    round, last_call, ..
                } => (*round, Some(*last_call)),
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
        let action = self.action(now)?;
        if matches!(self.step, Step::Announce { .. }) {
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
        line.extend(
            self.node
                .chars()
                .map(|c| if c.is_control() { '?' } else { c }),
        );
        line.push('\n');
        line.into_bytes()
    }

    fn action(&self, now: Instant) -> Option<StoreAction> {
        let closed = || StoreAction::Check {
            key: self.key(format_args!("closed")),
        };
        Some(match &self.step {
            Step::Idle | Step::Done => return None,
            Step::Recheck { .. } => closed(),
            Step::ReadHint { .. } => StoreAction::Add {
                key: self.key(format_args!("round")),
                delta: 0,
            },
            Step::Arrive { round, .. } => StoreAction::Add {
                key: self.round_key(*round, "arrivals"),
                delta: 1,
            },
            Step::Announce { round, slot, .. } => StoreAction::Append {
                key: self.round_key(*round, "roster"),
                value: self.roster_line(*slot),
            },
            Step::SetQuorum { round, .. }
            | Step::QuorumBeforeClose { round, .. }
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
            Step::OpenBeat { resume } => {
                let (round, slot) = resume.round_slot();
                StoreAction::Add {
                    key: self.hb_key(round, slot),
                    delta: 1,
                }
            }
            Step::OpenCount { resume } => StoreAction::Add {
                key: self.round_key(resume.round_slot().0, "arrivals"),
                delta: 0,
            },
            Step::OpenWatch { resume, target } => StoreAction::Add {
                key: self.hb_key(resume.round_slot().0, *target),
                delta: 0,
            },
            Step::GoneClaim { round, slot, .. } => StoreAction::CompareSet {
                key: self.key(format_args!("{round}/gone/{slot}")),
                expected: Vec::new(),
                desired: self.node.as_bytes().to_vec(),
            },
            Step::GoneLog { round, slot, .. } => StoreAction::Append {
                key: self.round_key(*round, "roster"),
                value: format!("-{slot}\n").into_bytes(),
            },
            Step::GoneCount { round, .. } => StoreAction::Add {
                key: self.round_key(*round, "arrivals"),
                delta: DEPARTED,
            },
            Step::OwnCheck { round, .. } => StoreAction::Check {
                key: self.round_key(*round, "size"),
            },
            Step::OwnRead { round, .. } | Step::ReadSize { round, .. } => StoreAction::Get {
                key: self.round_key(*round, "size"),
            },
            Step::Count { round, .. } => StoreAction::Add {
                key: self.round_key(*round, "arrivals"),
                delta: 0,
            },
            Step::MarkArrivals { round, .. } => StoreAction::Add {
                key: self.round_key(*round, "arrivals"),
                delta: ARRIVALS_CLOSED,
            },
            Step::ReadRoster { round, .. } => StoreAction::Get {
                key: self.round_key(*round, "roster"),
            },
            // No store request while it waits: a concurrent closer is caught anyway by the
            // compare-set of the size, whose reply is the world that won.
            Step::RosterPoll { since, tries, .. } => {
                let grace = since.saturating_add(self.settings.keep_alive_interval);
                let pause = ROSTER_POLL.saturating_mul(1u32 << (*tries).min(20));
                StoreAction::Pause {
                    until: now.saturating_add(pause).min(grace).max(now),
                }
            }
            Step::Close {
                round, proposal, ..
            } => StoreAction::CompareSet {
                key: self.round_key(*round, "size"),
                expected: Vec::new(),
                desired: proposal.as_bytes().to_vec(),
            },
            Step::Ack { round, .. } => StoreAction::Add {
                key: self.round_key(*round, "ready"),
                delta: 1,
            },
            Step::ReadReady { round, .. } => StoreAction::Add {
                key: self.round_key(*round, "ready"),
                delta: GAVE_UP,
            },
            Step::Verdict { round, go, .. } => StoreAction::CompareSet {
                key: self.round_key(*round, "verdict"),
                expected: Vec::new(),
                desired: if *go { VERDICT_GO } else { VERDICT_FAIL }.to_vec(),
            },
            Step::SetGo { round, .. } => StoreAction::Set {
                key: self.round_key(*round, "go"),
                value: Vec::new(),
            },
            Step::WaitGo {
                round, deadline, ..
            } => StoreAction::Wait {
                key: self.round_key(*round, "go"),
                until: self.capped(now, *deadline),
            },
            Step::ShutArrivals => StoreAction::Add {
                key: self.round_key(0, "arrivals"),
                delta: ARRIVALS_CLOSED,
            },
            Step::ShutMark => StoreAction::Add {
                key: self.key(format_args!("round")),
                delta: CLOSED_MARK,
            },
            Step::ShutSize { round } => StoreAction::CompareSet {
                key: self.round_key(*round, "size"),
                expected: Vec::new(),
                desired: b"0".to_vec(),
            },
            Step::AskNext { round } => StoreAction::Set {
                key: self.round_key(*round, "over"),
                value: format!("node '{}' is waiting for the next round", self.node).into_bytes(),
            },
            Step::Spare(m) => StoreAction::Wait {
                key: self.round_key(m.round, "over"),
                until: m.next_tick.max(now),
            },
            // Nobody need have read the hint in round 0 (a fresh node guesses round 0), so
            // it may be missing then: round 0's advance creates it.
            Step::Advance { round: 0 } => StoreAction::CompareSet {
                key: self.key(format_args!("round")),
                expected: Vec::new(),
                desired: b"1".to_vec(),
            },
            Step::Advance { round } | Step::AdvanceRead { round } => StoreAction::CompareSet {
                key: self.key(format_args!("round")),
                expected: format!("{round}").into_bytes(),
                desired: format!("{}", round.saturating_add(1)).into_bytes(),
            },
            Step::Beat(m) => StoreAction::Add {
                key: self.hb_key(m.round, m.slot),
                delta: 1,
            },
            Step::Watch(m) | Step::SpareWatch(m) => StoreAction::Add {
                key: self.hb_key(m.round, m.watch_slot),
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
                    // A fresh node guesses round 0 (a job's start) instead of reading the
                    // hint; round 0's closer marks its arrivals, so a wrong guess costs
                    // one request.
                    self.step = Step::Arrive {
                        round: 0,
                        guessed: true,
                    };
                }
            }
            LocalEvent::Leave => match (self.holding, self.open_slot) {
                // In an open round: leave it, so that it closes without this node.
                (Some(round), Some(slot)) => self.step = self.depart(round, slot, Then::Left),
                (Some(round), None) => {
                    self.step = Step::MarkOver {
                        round,
                        reason: format!("node '{}' left", self.node),
                        then: Then::Left,
                    }
                }
                _ => self.finish(Event::Left),
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

    /// This node leaves the open round `round`, where it holds `slot`.
    fn depart(&self, round: u64, slot: u32, then: Then) -> Step {
        Step::GoneClaim {
            round,
            slot,
            after: AfterGone::Own(then),
        }
    }

    fn finish(&mut self, event: Event) {
        self.events.push_back(event);
        self.step = Step::Done;
        self.holding = None;
        self.open_slot = None;
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

    /// Fails with a foreign value at `{round}/{name}`; returns `Done`.
    fn foreign(&mut self, round: u64, name: &str, value: &[u8]) -> Step {
        let key = self.round_key(round, name);
        self.fail(self.bad_value(key, value));
        Step::Done
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
        Ok(match (step, reply) {
            (Step::ReadHint { .. }, R::Added(round)) if round >= CLOSED_MARK => {
                self.fail(self.closed_error());
                Step::Done
            }
            (Step::ReadHint { guess: Some(value) }, R::Added(0)) => {
                // Round 0 is still the current one: this node's guessed arrival stands
                // (a late one, or one in a round still open).
                return self.transition(
                    Step::Arrive {
                        round: 0,
                        guessed: false,
                    },
                    R::Added(value),
                    now,
                );
            }
            (Step::ReadHint { .. }, R::Added(round)) => match u64::try_from(round) {
                Ok(round) => Step::Arrive {
                    round,
                    guessed: false,
                },
                Err(_) => {
                    let key = self.key(format_args!("round"));
                    self.fail(self.bad_value(key, format!("{round}").as_bytes()));
                    return Ok(Step::Done);
                }
            },
            (Step::Arrive { round, guessed }, R::Added(mut value)) => {
                let marked = value >= ARRIVALS_CLOSED;
                if guessed && (marked || (value & 0xffff_ffff) > i64::from(max)) {
                    // Round 0 is closed (marked), or may be: its closer marks it only
                    // when it handed out fewer than `max_nodes` slots, so a slot above
                    // `max_nodes` comes after a closer that did not. Find the current
                    // round (the hint says 0 too while round 0 is still open).
                    return Ok(Step::ReadHint { guess: Some(value) });
                }
                if marked {
                    // A late arrival in a closed round: it finds out as any late node.
                    value -= ARRIVALS_CLOSED;
                }
                let slot = (value & 0xffff_ffff) as u32;
                if value < 1 || !(1..=MAX_SLOTS).contains(&slot) {
                    return Ok(self.foreign(round, "arrivals", format!("{value}").as_bytes()));
                }
                self.holding = Some(round);
                self.open_slot = Some(slot);
                self.open = OpenWatch::default();
                self.open_live = ElasticSettings::live_count(value);
                Step::Announce {
                    round,
                    slot,
                    live: self.open_live,
                }
            }
            (Step::Announce { round, slot, live }, R::Set) => {
                if live >= max {
                    // This arrival fills the round: close it now.
                    Step::ReadRoster {
                        round,
                        slot,
                        count: slot,
                        since: now,
                        tries: 0,
                    }
                } else if live == min && min < max {
                    Step::SetQuorum { round, slot }
                } else if live < min && min < max {
                    Step::WaitQuorum { round, slot }
                } else {
                    self.wait_size(round, slot, now)
                }
            }
            (Step::SetQuorum { round, slot }, R::Set) => self.wait_size(round, slot, now),
            (Step::WaitQuorum { round, slot }, R::Waited) => self.wait_size(round, slot, now),
            (Step::WaitQuorum { round, slot }, R::TimedOut) => {
                if now >= self.join_deadline {
                    self.depart(round, slot, Then::Failed(self.timeout_error()))
                } else {
                    Step::OpenBeat {
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
                    self.depart(round, slot, Then::Failed(self.timeout_error()))
                } else {
                    Step::OpenBeat {
                        resume: Resume::Size {
                            round,
                            slot,
                            last_call,
                        },
                    }
                }
            }
            (Step::OpenBeat { resume }, R::Added(_)) => Step::OpenCount { resume },
            (Step::OpenCount { resume }, R::Added(value)) => {
                self.open_live = ElasticSettings::live_count(value);
                let (_, slot) = resume.round_slot();
                let count = ((value & 0xffff_ffff) as u32).min(MAX_SLOTS);
                match ring_target(slot, count, &self.open.marked) {
                    Some(target) => {
                        if target != self.open.target {
                            // A new neighbour gets one interval to show its first beat.
                            self.open.target = target;
                            self.open.seen = -1;
                            self.open.seen_at =
                                now.saturating_add(self.settings.keep_alive_interval);
                        }
                        Step::OpenWatch { resume, target }
                    }
                    None => Step::Recheck { resume },
                }
            }
            (Step::OpenWatch { resume, target }, R::Added(value)) => {
                // A lease store's "gone" (`BEAT_GONE`): struck at once if it was seen
                // there; never seen, it is a counter at 0.
                let expired = beat_expired(self.open.seen, value);
                let value = value.max(0);
                if expired {
                    self.open.marked.push(target);
                    Step::GoneClaim {
                        round: resume.round_slot().0,
                        slot: target,
                        after: AfterGone::Resume(resume),
                    }
                } else if value != self.open.seen {
                    self.open.seen = value;
                    self.open.seen_at = self.open.seen_at.max(now);
                    Step::Recheck { resume }
                } else if now.saturating_duration_since(self.open.seen_at)
                    >= self.settings.keep_alive_timeout()
                {
                    // The neighbour is dead: it must not be counted into the round.
                    self.open.marked.push(target);
                    Step::GoneClaim {
                        round: resume.round_slot().0,
                        slot: target,
                        after: AfterGone::Resume(resume),
                    }
                } else {
                    Step::Recheck { resume }
                }
            }
            (Step::GoneClaim { round, slot, after }, R::Value(value)) => {
                if value == self.node.as_bytes() {
                    Step::GoneLog { round, slot, after }
                } else {
                    // Somebody marked it first (the node itself, or another watcher).
                    self.after_gone(round, slot, after)
                }
            }
            (Step::GoneLog { round, slot, after }, R::Set) => {
                Step::GoneCount { round, slot, after }
            }
            (Step::GoneCount { round, slot, after }, R::Added(_)) => {
                self.after_gone(round, slot, after)
            }
            (Step::OwnCheck { round, slot, then }, R::Checked(closed)) => {
                if closed {
                    Step::OwnRead { round, slot, then }
                } else {
                    return Ok(self.then(then, now));
                }
            }
            (Step::OwnRead { round, slot, then }, R::Value(value)) => {
                match parse_world(value, max) {
                    Some((world, ..)) if world.contains(&slot) => {
                        // The round closed with this node in it: end it for the others.
                        Step::MarkOver {
                            round,
                            reason: format!("node '{}' left the round as it closed", self.node),
                            then,
                        }
                    }
                    Some(_) => return Ok(self.then(then, now)),
                    None => return Ok(self.foreign(round, "size", value)),
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
            (Step::Count { round, slot }, R::Added(value)) => Step::ReadRoster {
                round,
                slot,
                count: ((value & 0xffff_ffff) as u32).clamp(slot, MAX_SLOTS),
                since: now,
                tries: 0,
            },
            (
                Step::ReadRoster {
                    round,
                    slot,
                    count,
                    since,
                    tries,
                },
                R::Value(roster),
            ) => {
                let grace =
                    now.saturating_duration_since(since) >= self.settings.keep_alive_interval;
                // Every arrival after this read takes a slot above `count`: with `count`
                // at least `max_nodes`, a fresh node's guess sees a slot above
                // `max_nodes` and reads the round hint without a mark.
                let mark = round == 0 && count < max;
                match self.propose(roster, count, grace, slot) {
                    Proposal::Close(proposal) if min < max => Step::QuorumBeforeClose {
                        round,
                        slot,
                        proposal,
                        mark,
                    },
                    Proposal::Close(proposal) => Step::Close {
                        round,
                        slot,
                        proposal,
                        mark,
                    },
                    Proposal::Poll => Step::RosterPoll {
                        round,
                        slot,
                        count,
                        since,
                        tries,
                    },
                    Proposal::TooFew => Step::WaitSize {
                        round,
                        slot,
                        last_call: Instant::from_nanos(u64::MAX),
                    },
                }
            }
            (
                Step::RosterPoll {
                    round,
                    slot,
                    count,
                    since,
                    tries,
                },
                R::TimedOut,
            ) => Step::ReadRoster {
                round,
                slot,
                count,
                since,
                tries: tries.saturating_add(1),
            },
            (
                Step::Close {
                    round,
                    slot,
                    proposal,
                    mark,
                },
                R::Value(value),
            ) => {
                // A proposal names its closer, so only the winner finds its own.
                let won = value == proposal.as_bytes();
                match parse_world(value, max) {
                    Some((world, master, closer)) => {
                        self.world = world;
                        self.master = master;
                        self.closer = closer;
                        if won && mark {
                            Step::MarkArrivals { round, slot }
                        } else {
                            // No second read of the roster: a member struck between the
                            // closer's read and its compare-set never acknowledges, so the
                            // confirmation fails (within the keep-alive timeout) and
                            // everyone rejoins.
                            self.decide(round, slot, won, now)
                        }
                    }
                    None => return Ok(self.foreign(round, "size", value)),
                }
            }
            (Step::MarkArrivals { round, slot }, R::Added(_)) => {
                self.decide(round, slot, true, now)
            }
            (Step::ReadSize { round, slot }, R::Value(value)) => match parse_world(value, max) {
                Some((world, master, closer)) => {
                    self.world = world;
                    self.master = master;
                    self.closer = closer;
                    self.decide(round, slot, false, now)
                }
                None => return Ok(self.foreign(round, "size", value)),
            },
            (
                Step::QuorumBeforeClose {
                    round,
                    slot,
                    proposal,
                    mark,
                },
                R::Set,
            ) => Step::Close {
                round,
                slot,
                proposal,
                mark,
            },
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
            (Step::Advance { round: 0 }, R::Value(b"0")) => Step::AdvanceRead { round: 0 },
            (Step::Advance { round } | Step::AdvanceRead { round }, R::Value(hint)) => {
                self.holding = None;
                self.open_slot = None;
                let closed = core::str::from_utf8(hint)
                    .ok()
                    .and_then(|h| h.parse::<i64>().ok())
                    .is_some_and(|h| h >= CLOSED_MARK);
                if closed {
                    self.fail(self.closed_error());
                    return Ok(Step::Done);
                }
                self.spare = false;
                Step::Arrive {
                    round: round.saturating_add(1),
                    guessed: false,
                }
            }
            (Step::Ack { round, slot, rank }, R::Added(value)) => {
                let size = self.acks_needed();
                let (acks, gave_up) = (value & 0xffff_ffff, value >> 32);
                if acks >= size && gave_up == 0 {
                    // The last acknowledgement, before any member gave up: each one that
                    // gives up from now on counts itself after it, finds every
                    // acknowledgement in and compare-sets `go`, so `go` is the only
                    // verdict there can be. Release the others without writing it.
                    Step::SetGo { round, slot, rank }
                } else if acks >= size {
                    // A member gave up first and may have decided `fail`: the verdict
                    // decides.
                    Step::Verdict {
                        round,
                        slot,
                        rank,
                        go: true,
                    }
                } else {
                    Step::WaitGo {
                        round,
                        slot,
                        rank,
                        deadline: now.saturating_add(self.settings.keep_alive_timeout()),
                    }
                }
            }
            (Step::SetGo { round, slot, rank }, R::Set)
            | (
                Step::WaitGo {
                    round, slot, rank, ..
                },
                R::Waited,
            ) => self.complete(round, slot, rank, now),
            (
                Step::WaitGo {
                    round,
                    slot,
                    rank,
                    deadline,
                },
                R::TimedOut,
            ) => {
                if now >= deadline {
                    Step::ReadReady { round, slot, rank }
                } else {
                    Step::WaitGo {
                        round,
                        slot,
                        rank,
                        deadline,
                    }
                }
            }
            (Step::ReadReady { round, slot, rank }, R::Added(value)) => Step::Verdict {
                round,
                slot,
                rank,
                go: (value & 0xffff_ffff) >= self.acks_needed(),
            },
            (
                Step::Verdict {
                    round, slot, rank, ..
                },
                R::Value(verdict),
            ) => {
                if verdict == VERDICT_GO {
                    // Release the others (again, when a member that waited in vain finds
                    // the round standing: the last acknowledger may have died after its
                    // verdict).
                    Step::SetGo { round, slot, rank }
                } else if verdict == VERDICT_FAIL {
                    self.unconfirmed(round)
                } else {
                    return Ok(self.foreign(round, "verdict", verdict));
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
                other => return Ok(self.then(other, now)),
            },
            (Step::ShutClosed, R::Set) => Step::ShutMark,
            (Step::ShutMark, R::Added(_)) => Step::ShutArrivals,
            (Step::ShutArrivals, R::Added(_)) => match self.holding {
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

    /// What follows a departure (or a round ended on the way out).
    fn then(&mut self, then: Then, now: Instant) -> Step {
        match then {
            Then::Rejoin => {
                self.join_deadline = now.saturating_add(self.settings.join_timeout);
                match self.holding {
                    Some(round) => Step::Advance { round },
                    None => Step::ReadHint { guess: None },
                }
            }
            Then::Left => {
                self.finish(Event::Left);
                Step::Done
            }
            Then::Failed(error) => {
                self.fail(error);
                Step::Done
            }
        }
    }

    /// After a slot of an open round is marked gone.
    fn after_gone(&mut self, round: u64, slot: u32, after: AfterGone) -> Step {
        match after {
            AfterGone::Resume(resume) => Step::Recheck { resume },
            AfterGone::Own(then) => Step::OwnCheck { round, slot, then },
        }
    }

    /// Waits for the round's size, through a last call when `min_nodes < max_nodes`; with
    /// `min_nodes == max_nodes` only the arrival that fills the round closes it.
    fn wait_size(&self, round: u64, slot: u32, now: Instant) -> Step {
        let nodes = self.settings.nodes;
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

    /// The closer's decision from the roster of the first `count` slots: the live ones
    /// (arrived, not gone), at most `max_nodes` of them in slot order, ranked by
    /// [`deal_ranks`]. An arrival whose roster line is not there yet is waited for (it is
    /// in flight) until `grace`, then left out.
    fn propose(&self, roster: &[u8], count: u32, grace: bool, closer: u32) -> Proposal {
        let mut joined: Vec<Entry<'_>> = Vec::new();
        let mut gone: Vec<u32> = Vec::new();
        for line in parse_roster(roster) {
            match line {
                Line::Joined(e) if e.slot <= count => joined.push(e),
                Line::Gone(s) => gone.push(s),
                Line::Joined(_) => {}
            }
        }
        joined.sort_unstable_by_key(|e| e.slot);
        joined.dedup_by_key(|e| e.slot);
        gone.sort_unstable();
        let is_gone = |s: &u32| gone.binary_search(s).is_ok();
        let missing = (count as usize).saturating_sub(joined.len());
        let in_flight = (1..=count)
            .any(|s| !is_gone(&s) && joined.binary_search_by_key(&s, |e| e.slot).is_err());
        if missing > 0 && in_flight && !grace {
            return Proposal::Poll;
        }
        joined.retain(|e| !is_gone(&e.slot));
        joined.truncate(self.settings.nodes.max as usize);
        if (joined.len() as u32) < self.settings.nodes.min {
            return Proposal::TooFew;
        }
        let ranks = deal_ranks(&joined);
        let mut text = format!("{}:{closer};", ranks.len());
        for (i, slot) in ranks.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            text.push_str(&format!("{slot}"));
        }
        let master = ranks
            .first()
            .and_then(|s| joined.iter().find(|e| e.slot == *s))
            .and_then(|e| e.contact);
        if let Some(contact) = master {
            text.push(';');
            text.push_str(contact);
        }
        Proposal::Close(text)
    }

    /// Records the watched member's heartbeat counter; `Err` with the step that ends the
    /// round when it has stood still for the keep-alive timeout.
    /// A lease store's "gone" (`BEAT_GONE`) ends it at once if this node saw the key there.
    fn watch(&self, mut m: Member, value: i64, now: Instant) -> Result<Member, Step> {
        if beat_expired(m.seen, value) {
            return Err(Step::MarkOver {
                round: m.round,
                reason: format!(
                    "rank {}'s heartbeat key is gone: its lease expired (seen by node '{}')",
                    m.watch_rank, self.node
                ),
                then: Then::Rejoin,
            });
        }
        // Never seen there: a counter at 0.
        let value = value.max(0);
        if m.seen < 0 {
            // The first look: the timeout keeps running from when the watch began.
            m.seen = value;
            Ok(m)
        } else if value != m.seen {
            m.seen = value;
            m.seen_at = now;
            Ok(m)
        } else if now.saturating_duration_since(m.seen_at) >= self.settings.keep_alive_timeout() {
            Err(Step::MarkOver {
                round: m.round,
                reason: format!(
                    "rank {} had no heartbeat for {}s (seen by node '{}')",
                    m.watch_rank,
                    self.settings.keep_alive_timeout().as_secs_f64(),
                    self.node
                ),
                then: Then::Rejoin,
            })
        } else {
            Ok(m)
        }
    }

    /// Every member acknowledged the round: it is complete. The acknowledgement was this
    /// member's first sign of life; its first heartbeat and its first look at the watched
    /// member are one interval away, and until then it only waits on `over`. The watched
    /// member's keep-alive timeout runs from now.
    fn complete(&mut self, round: u64, slot: u32, rank: u32, now: Instant) -> Step {
        let size = self.world.len() as u32;
        self.events.push_back(Event::Complete(RoundOutcome {
            round,
            rank,
            world_size: size,
            store_prefix: format!("torch.rendezvous.{}.{round}", self.settings.run_id),
            master: self.master.clone(),
        }));
        self.prev = Some((round, rank));
        let next = (rank + 1) % size;
        let m = Member {
            round,
            slot,
            world: size,
            watch_slot: self.world[next as usize],
            watch_rank: next,
            next_tick: now.saturating_add(self.settings.keep_alive_interval),
            seen: -1,
            seen_at: now,
        };
        Step::WaitOver(m)
    }

    /// A member did not acknowledge the round within the keep-alive timeout: it is dead,
    /// and the round fails before anyone is told it is complete.
    fn unconfirmed(&self, round: u64) -> Step {
        Step::MarkOver {
            round,
            reason: format!(
                "a member did not confirm the round within {}s (seen by node '{}')",
                self.settings.keep_alive_timeout().as_secs_f64(),
                self.node
            ),
            then: Then::Rejoin,
        }
    }

    /// How many `ADD`s to `ready` confirm the round just closed: one per member, but
    /// none for the closer whose compare-set closed it (alive then, it acknowledged by
    /// closing).
    fn acks_needed(&self) -> i64 {
        let closer_is_member = self.closer.is_some_and(|c| self.world.contains(&c));
        self.world.len() as i64 - i64::from(closer_is_member)
    }

    /// The round closed with the slots in `self.world` (by rank): a member acknowledges
    /// it (the closer, `won`, by its compare-set: it waits for the release at once, or
    /// completes a round of one), a late node waits.
    fn decide(&mut self, round: u64, slot: u32, won: bool, now: Instant) -> Step {
        self.open_slot = None;
        let size = self.world.len() as u32;
        let member_of = |rank: u32| (self.world[rank as usize], rank);
        if let Some(rank) = self.world.iter().position(|&s| s == slot) {
            let rank = rank as u32;
            if won && self.acks_needed() == 0 {
                // Nobody else to hear from.
                self.complete(round, slot, rank, now)
            } else if won && self.closer == Some(slot) {
                Step::WaitGo {
                    round,
                    slot,
                    rank,
                    deadline: now.saturating_add(self.settings.keep_alive_timeout()),
                }
            } else {
                Step::Ack { round, slot, rank }
            }
        } else {
            let hot_spare = size > 0 && size >= self.settings.nodes.max;
            self.events.push_back(Event::Waiting { round, hot_spare });
            self.spare = hot_spare;
            // A late node holds no member's slot: leaving must not end the round.
            self.holding = None;
            if hot_spare {
                // A hot spare watches one member too, so that a round whose members all
                // died (or a round of one) still ends.
                let (watch_slot, watch_rank) = member_of(slot.saturating_sub(1) % size);
                Step::SpareWatch(Member {
                    round,
                    slot,
                    world: size,
                    watch_slot,
                    watch_rank,
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

/// The closer's reading of the roster.
enum Proposal {
    /// Close with this size value.
    Close(String),
    /// An arrival's line is not there yet: read again shortly.
    Poll,
    /// Fewer than `min_nodes` are still there: wait for more.
    TooFew,
}

/// One line of a round's roster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line<'a> {
    Joined(Entry<'a>),
    Gone(u32),
}

/// The roster's lines: `+{slot} {round}:{rank}|- {contact}|- {node}` for an arrival,
/// `-{slot}` for a departure. Lines that are neither are skipped.
fn parse_roster(roster: &[u8]) -> impl Iterator<Item = Line<'_>> {
    // A round's roster has a line per arrival and per departure: more lines than twice
    // the most slots are not ours.
    let most = 2 * MAX_SLOTS as usize;
    roster.split(|&b| b == b'\n').take(most).filter_map(|line| {
        let line = core::str::from_utf8(line).ok()?;
        if let Some(slot) = line.strip_prefix('-') {
            return slot.parse().ok().map(Line::Gone);
        }
        let mut parts = line.strip_prefix('+')?.splitn(4, ' ');
        let slot = parts.next()?.parse().ok()?;
        let prev = match parts.next()? {
            "-" => None,
            text => {
                let (round, rank) = text.split_once(':')?;
                Some((round.parse().ok()?, rank.parse().ok()?))
            }
        };
        let contact = match parts.next()? {
            "-" => None,
            text => Some(text),
        };
        let node = parts.next().unwrap_or("");
        Some(Line::Joined(Entry {
            slot,
            prev,
            contact,
            node,
        }))
    })
}

/// The size value: `{N};{slot of rank 0},{slot of rank 1},…[;{rank 0's contact}]`, or
/// `0` (shut down): the slots by rank and rank 0's contact. `None` when it is anything
/// else, or names more than `max` members.
fn parse_world(value: &[u8], max: u32) -> Option<(Vec<u32>, Option<String>, Option<u32>)> {
    let text = core::str::from_utf8(value).ok()?;
    if text == "0" {
        return Some((Vec::new(), None, None));
    }
    let (size, rest) = text.split_once(';')?;
    let (slots, master) = match rest.split_once(';') {
        Some((slots, contact)) => (slots, Some(String::from(contact))),
        None => (rest, None),
    };
    let (size, closer) = match size.split_once(':') {
        Some((size, closer)) => (size, Some(closer.parse().ok()?)),
        None => (size, None),
    };
    let size: u32 = size.parse().ok()?;
    if size == 0 || size > max {
        return None;
    }
    let mut world = Vec::new();
    world.try_reserve_exact(size as usize).ok()?;
    for slot in slots.split(',') {
        if world.len() == size as usize {
            return None;
        }
        world.push(slot.parse().ok()?);
    }
    (world.len() == size as usize).then_some((world, master, closer))
}

/// Deals ranks `0..N` to the members (`N = members.len()`, in any order); returns their
/// slots by rank. A member that held rank `r < N` in its last round keeps it (when two
/// claim one rank, the later round's holder wins, then the lower slot); the others take
/// the free ranks in the order of their node names (then slots), as PyTorch sorts
/// participants by node descriptor.
fn deal_ranks(members: &[Entry<'_>]) -> Vec<u32> {
    let n = members.len();
    let mut by_rank: Vec<Option<u32>> = alloc::vec![None; n];
    let mut claims: Vec<&Entry<'_>> = members
        .iter()
        .filter(|e| e.prev.is_some_and(|(_, rank)| (rank as usize) < n))
        .collect();
    claims.sort_by_key(|e| (core::cmp::Reverse(e.prev.map(|(round, _)| round)), e.slot));
    let mut placed: Vec<u32> = Vec::new();
    for e in claims {
        if let Some((_, rank)) = e.prev {
            if by_rank[rank as usize].is_none() {
                by_rank[rank as usize] = Some(e.slot);
                placed.push(e.slot);
            }
        }
    }
    placed.sort_unstable();
    let mut rest: Vec<&Entry<'_>> = members
        .iter()
        .filter(|e| placed.binary_search(&e.slot).is_err())
        .collect();
    rest.sort_by(|a, b| a.node.cmp(b.node).then(a.slot.cmp(&b.slot)));
    let mut rest = rest.into_iter();
    by_rank
        .into_iter()
        .map(|slot| slot.or_else(|| rest.next().map(|e| e.slot)).unwrap_or(0))
        .collect()
}

/// The slot that the node at `slot` watches in an open round of `count` arrivals: the
/// nearest one below it round the ring (`slot − 1`, …, `1`, `count`, …) that it has not
/// found gone; `None` when there is none.
fn ring_target(slot: u32, count: u32, marked: &[u32]) -> Option<u32> {
    let count = count.max(slot);
    (1..count)
        .map(|k| (slot + count - 1 - k) % count + 1)
        .find(|t| *t != slot && !marked.contains(t))
}

/// A reply that does not answer the pending action.
struct Mismatch;

#[cfg(test)]
mod unit {
    use super::*;

    fn entry(slot: u32, prev: Option<(u64, u32)>, node: &str) -> Entry<'_> {
        Entry {
            slot,
            prev,
            contact: None,
            node,
        }
    }

    #[test]
    fn ranks_stay_with_survivors_and_newcomers_sort_by_name() {
        // Survivors of round 3 at ranks 2 and 0; newcomers z and b; a stale claim of rank
        // 0 from round 1 loses to round 3's.
        let members = [
            entry(1, Some((3, 2)), "s2"),
            entry(2, None, "z"),
            entry(3, Some((3, 0)), "s0"),
            entry(4, Some((1, 0)), "old"),
            entry(5, None, "b"),
        ];
        assert_eq!(deal_ranks(&members), [3, 5, 1, 4, 2]);
        // A claim beyond the new world size is a newcomer's.
        assert_eq!(
            deal_ranks(&[entry(7, Some((0, 5)), "x"), entry(8, None, "a")]),
            [8, 7]
        );
    }

    #[test]
    fn ring_targets_skip_the_marked() {
        assert_eq!(ring_target(3, 5, &[]), Some(2));
        assert_eq!(ring_target(1, 5, &[]), Some(5));
        assert_eq!(ring_target(1, 5, &[5, 4]), Some(3));
        assert_eq!(ring_target(2, 3, &[1, 3]), None);
        assert_eq!(ring_target(1, 1, &[]), None);
    }

    #[test]
    fn rosters_and_worlds_parse_or_refuse() {
        let lines: Vec<Line<'_>> =
            parse_roster(b"+1 - - a b\n+2 4:1 h:29500 n2\n-1\ngarbage\n+x - - y\n+3 -\n").collect();
        let mut with_contact = entry(2, Some((4, 1)), "n2");
        with_contact.contact = Some("h:29500");
        assert_eq!(
            lines,
            [
                Line::Joined(entry(1, None, "a b")),
                Line::Joined(with_contact),
                Line::Gone(1),
            ]
        );
        assert_eq!(
            parse_world(b"3;4,1,2", 4),
            Some((alloc::vec![4, 1, 2], None, None))
        );
        assert_eq!(
            parse_world(b"3:2;4,1,2", 4),
            Some((alloc::vec![4, 1, 2], None, Some(2)))
        );
        assert_eq!(
            parse_world(b"2:5;4,1;[::1]:29500", 4),
            Some((alloc::vec![4, 1], Some("[::1]:29500".into()), Some(5)))
        );
        assert_eq!(parse_world(b"0", 4), Some((Vec::new(), None, None)));
        for bad in [
            &b"3;1,2"[..],
            b"5;1,2,3,4,5",
            b"2;1,2,3",
            b"lots",
            b"2;a,b",
            b"2:x;1,2",
            b"2",
        ] {
            assert_eq!(parse_world(bad, 4), None, "{bad:?}");
        }
    }
}
