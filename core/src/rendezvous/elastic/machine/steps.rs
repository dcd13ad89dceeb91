//! The phases' steps, as types: each phase's module (`join`, `tick`, `last_call`,
//! `confirm`, `keep_alive`, `leave`) holds what its steps send and what a reply does
//! (`action` and `on_reply`), and names the steps of the phase it moves to from here. The
//! types live below every phase, so that the phases form no import circle.

use alloc::string::String;
use alloc::vec::Vec;

use super::{ElasticError, Instant, Seat};

/// A member's place in the world just closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    pub(super) seat: Seat,
    pub(super) rank: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Confirm {
    /// A member acknowledges the round (`ready`); the last one releases the others.
    Ack(Place),
    SetGo(Place),
    WaitGo {
        at: Place,
        deadline: Instant,
    },
    /// A member that waited in vain for the release counts itself into `ready` (high
    /// bits), which reads the acknowledgements and tells a later last acknowledger that
    /// somebody may have decided before it.
    ReadReady(Place),
    /// The one decision on the round's confirmation: the first compare-set of the verdict
    /// wins, and every member obeys it (`go`: a member that waited in vain and found every
    /// acknowledgement in, or the last acknowledger when one gave up before it; `fail`: a
    /// member that waited in vain and did not).
    Verdict {
        at: Place,
        go: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Join {
    /// Reads the round hint; holds the arrivals counter of round 0 as this node's first
    /// guess found it (closed), to be used as its arrival if the hint says 0.
    ReadHint(Option<i64>),
    Arrive {
        round: u64,
        /// A fresh node's arrival in round 0 without reading the hint first.
        guessed: bool,
    },
    Announce {
        seat: Seat,
        live: u32,
    },
    SetQuorum(Seat),
    WaitQuorum(Seat),
    /// A late node in a round with room asks for the next one (ends this one).
    AskNext(u64),
    /// Advances the round hint past this round (compare-set), to arrive in the next one.
    Advance(u64),
    /// Round 0's advance found the hint at `0` (a node read it then, which creates it):
    /// advance it from there.
    AdvanceRead(u64),
}

/// A member's (or hot spare's) view of its round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Member {
    pub(super) round: u64,
    pub(super) slot: u32,
    pub(super) world: u32,
    /// The slot and rank of the member whose heartbeat this node watches.
    pub(super) watch_slot: u32,
    pub(super) watch_rank: u32,
    pub(super) next_tick: Instant,
    /// The watched heartbeat counter as last read, and when it last moved.
    pub(super) seen: i64,
    pub(super) seen_at: Instant,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum KeepAlive {
    Beat(Member),
    Watch(Member),
    WaitOver(Member),
    ReadOver {
        round: u64,
    },
    /// A hot spare waits on `over` of the full round it is not in.
    Spare(Member),
    SpareWatch(Member),
}

/// The closer's reading of the roster of the first `count` slots, begun at `since`, after
/// `tries` pauses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RosterRead {
    pub(super) seat: Seat,
    pub(super) count: u32,
    pub(super) since: Instant,
    pub(super) tries: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum LastCall {
    WaitSize {
        seat: Seat,
        last_call: Instant,
    },
    Count(Seat),
    ReadRoster(RosterRead),
    /// A pause before the next read, for an arrival whose line is in flight.
    RosterPoll(RosterRead),
    /// The closer sets the quorum before it compare-sets the size, for nodes below
    /// `min_nodes` still waiting on it: no arrival may have seen exactly `min_nodes` live
    /// (a departure counted late), and a closer that leaves or dies right after its
    /// compare-set must not leave them waiting.
    QuorumBeforeClose(Proposal),
    /// The closer compare-sets the size.
    Close(Proposal),
    /// Round 0's closer marks its arrivals closed (see [`ARRIVALS_CLOSED`]).
    MarkArrivals(Seat),
    ReadSize(Seat),
}

/// The closer's proposal for the size value; `mark`: it is round 0's and fewer than
/// `max_nodes` slots were handed out when it read the roster, so a fresh node's guess
/// could not tell that the round is closed: it marks the arrivals after winning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Proposal {
    pub(super) seat: Seat,
    pub(super) value: String,
    pub(super) mark: bool,
}

/// What comes after marking a round over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Then {
    Rejoin,
    Left,
    Failed(ElasticError),
}

/// What comes after marking a slot of an open round gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum AfterGone {
    /// A watcher marked a dead neighbour: go on waiting.
    Resume(Resume),
    /// This node departs (timed out, left): see whether the round closed with it first.
    Own(Then),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Leave {
    /// Marking a slot of an open round gone: claim it, log it in the roster, count it.
    GoneClaim {
        seat: Seat,
        after: AfterGone,
    },
    GoneLog {
        seat: Seat,
        after: AfterGone,
    },
    GoneCount {
        seat: Seat,
        after: AfterGone,
    },
    /// A departing node: did the round close (with it) before it left?
    OwnCheck(Seat, Then),
    OwnRead(Seat, Then),
    MarkOver {
        round: u64,
        reason: String,
        then: Then,
    },
}

/// Closing the rendezvous for good (`shutdown`): `closed`, the round hint's mark, round
/// 0's arrivals' mark (so that a fresh node's guess finds out at once), then, for a round
/// this node holds, its size and quorum, so that nobody waits on them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Shutdown {
    Closed,
    Mark,
    Arrivals,
    Size { round: u64 },
    Quorum { round: u64 },
}

/// A wait to resume after an open round's tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Resume {
    Quorum(Seat),
    Size { seat: Seat, last_call: Instant },
    Spare(Member),
}

/// What a node waiting in an open round knows of the neighbour it watches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct OpenWatch {
    pub(super) target: u32,
    pub(super) seen: i64,
    pub(super) seen_at: Instant,
    /// The slots this node has found dead (or gone) in this round: skipped.
    pub(super) marked: Vec<u32>,
}

/// The tick's steps: this node's heartbeat, the arrivals, the watched slot's heartbeat,
/// then `closed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Tick {
    Beat(Resume),
    Count(Resume),
    Watch { resume: Resume, target: u32 },
    Recheck(Resume),
}
