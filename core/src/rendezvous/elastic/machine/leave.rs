//! Leaving: striking a slot from an open round (this node's own as it departs, or a dead
//! neighbour's), ending a complete round (`over`), and closing the rendezvous for good.
//!
//! A slot is struck once: whoever claims `{round}/gone/{slot}` first logs it in the
//! roster and counts it as departed. A node that departs an open round then checks
//! whether the round closed with it before it left, and ends it for the others if so.

use super::steps::{AfterGone, Leave, Shutdown, Then, Tick};
use alloc::format;
use alloc::vec::Vec;

use super::roster::parse_world;
use super::{
    ElasticNode, Event, Instant, Mismatch, Next, Seat, Step, StoreAction, StoreReply,
    ARRIVALS_CLOSED, CLOSED_MARK,
};

/// The arrivals counter counts departures in its high 32 bits: one `ADD` of this marks a
/// slot gone (see [`ElasticSettings::live_count`](super::ElasticSettings::live_count)).
const DEPARTED: i64 = 1 << 32;

impl Leave {
    /// What this node sends.
    pub(super) fn action(&self, n: &ElasticNode) -> StoreAction {
        match self {
            Leave::GoneClaim { seat, .. } => StoreAction::CompareSet {
                key: n.key(format_args!("{}/gone/{}", seat.round, seat.slot)),
                expected: Vec::new(),
                desired: n.node.as_bytes().to_vec(),
            },
            Leave::GoneLog { seat, .. } => StoreAction::Append {
                key: n.round_key(seat.round, "roster"),
                value: format!("-{}\n", seat.slot).into_bytes(),
            },
            Leave::GoneCount { seat, .. } => n.add(seat.round, "arrivals", DEPARTED),
            Leave::OwnCheck(seat, _) => StoreAction::Check {
                key: n.round_key(seat.round, "size"),
            },
            Leave::OwnRead(seat, _) => n.get(seat.round, "size"),
            Leave::MarkOver { round, reason, .. } => {
                n.set(*round, "over", reason.as_bytes().to_vec())
            }
        }
    }

    /// What a reply does.
    pub(super) fn on_reply(self, n: &mut ElasticNode, reply: StoreReply<'_>, now: Instant) -> Next {
        use StoreReply as R;
        Ok(match (self, reply) {
            (Leave::GoneClaim { seat, after }, R::Value(value)) => {
                if value == n.node.as_bytes() {
                    Step::Leave(Leave::GoneLog { seat, after })
                } else {
                    // Somebody marked it first (the node itself, or another watcher).
                    after_gone(seat, after)
                }
            }
            (Leave::GoneLog { seat, after }, R::Set) => {
                Step::Leave(Leave::GoneCount { seat, after })
            }
            (Leave::GoneCount { seat, after }, R::Added(_)) => after_gone(seat, after),
            (Leave::OwnCheck(seat, then), R::Checked(true)) => {
                Step::Leave(Leave::OwnRead(seat, then))
            }
            (Leave::OwnCheck(_, then), R::Checked(false)) => n.then(then, now),
            (Leave::OwnRead(seat, then), R::Value(value)) => {
                match parse_world(value, n.settings.nodes.max) {
                    Some((world, ..)) if world.contains(&seat.slot) => {
                        // The round closed with this node in it: end it for the others.
                        Step::Leave(Leave::MarkOver {
                            round: seat.round,
                            reason: format!("node '{}' left the round as it closed", n.node),
                            then,
                        })
                    }
                    Some(_) => n.then(then, now),
                    None => n.foreign(seat.round, "size", value),
                }
            }
            (
                Leave::MarkOver {
                    round,
                    reason,
                    then: Then::Rejoin,
                },
                R::Set,
            ) => n.round_over(round, reason, now),
            (Leave::MarkOver { then, .. }, R::Set) => n.then(then, now),
            _ => return Err(Mismatch),
        })
    }
}

/// After a slot of an open round is marked gone.
fn after_gone(seat: Seat, after: AfterGone) -> Step {
    match after {
        AfterGone::Resume(resume) => Step::Tick(Tick::Recheck(resume)),
        AfterGone::Own(then) => Step::Leave(Leave::OwnCheck(seat, then)),
    }
}

impl Shutdown {
    /// What this node sends.
    pub(super) fn action(&self, n: &ElasticNode) -> StoreAction {
        match self {
            Shutdown::Closed => StoreAction::Set {
                key: n.key(format_args!("closed")),
                value: format!("shut down by node '{}'", n.node).into_bytes(),
            },
            Shutdown::Mark => StoreAction::Add {
                key: n.key(format_args!("round")),
                delta: CLOSED_MARK,
            },
            Shutdown::Arrivals => n.add(0, "arrivals", ARRIVALS_CLOSED),
            Shutdown::Size { round } => n.create(*round, "size", b"0".to_vec()),
            Shutdown::Quorum { round } => n.set(*round, "quorum", Vec::new()),
        }
    }

    /// What a reply does.
    pub(super) fn on_reply(self, n: &mut ElasticNode, reply: StoreReply<'_>) -> Next {
        use StoreReply as R;
        Ok(match (self, reply) {
            (Shutdown::Closed, R::Set) => Step::Shutdown(Shutdown::Mark),
            (Shutdown::Mark, R::Added(_)) => Step::Shutdown(Shutdown::Arrivals),
            (Shutdown::Arrivals, R::Added(_)) => match n.holding {
                Some(round) => Step::Shutdown(Shutdown::Size { round }),
                None => n.finish(Event::ShutDown),
            },
            (Shutdown::Size { round }, R::Value(_)) => Step::Shutdown(Shutdown::Quorum { round }),
            (Shutdown::Quorum { .. }, R::Set) => n.finish(Event::ShutDown),
            _ => return Err(Mismatch),
        })
    }
}

impl ElasticNode {
    /// This node leaves the open round where it holds `seat`.
    pub(super) fn depart(&self, seat: Seat, then: Then) -> Step {
        Step::Leave(Leave::GoneClaim {
            seat,
            after: AfterGone::Own(then),
        })
    }

    /// What follows a departure (or a round ended on the way out).
    fn then(&mut self, then: Then, now: Instant) -> Step {
        match then {
            Then::Rejoin => self.rejoin(self.holding, now),
            Then::Left => self.finish(Event::Left),
            Then::Failed(error) => self.fail(error),
        }
    }
}
