//! Joining: take a slot in the current round and say so, then wait for `min_nodes`; after
//! a round, ask for the next one and advance the round hint.
//!
//! A fresh node guesses round 0 (a job's start) and reads the hint only when the guess
//! was wrong. An arrival that makes `max_nodes` live closes the round at once (the last
//! call's closer); one that makes `min_nodes` live sets the quorum and starts the last
//! call; fewer wait on the quorum, ticking as every node in an open round does.

use super::steps::{Join, LastCall, OpenWatch, Resume, RosterRead, Then, Tick};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use super::{
    ElasticNode, ElasticSettings, Event, Instant, Mismatch, Next, Seat, Step, StoreAction,
    StoreReply, ARRIVALS_CLOSED, CLOSED_MARK, MAX_SLOTS,
};

impl Join {
    /// What this node sends.
    pub(super) fn action(&self, n: &ElasticNode, now: Instant) -> StoreAction {
        match self {
            Join::ReadHint(_) => StoreAction::Add {
                key: n.key(format_args!("round")),
                delta: 0,
            },
            Join::Arrive { round, .. } => n.add(*round, "arrivals", 1),
            Join::Announce { seat, .. } => StoreAction::Append {
                key: n.round_key(seat.round, "roster"),
                value: n.roster_line(seat.slot),
            },
            Join::SetQuorum(seat) => n.set(seat.round, "quorum", Vec::new()),
            Join::WaitQuorum(seat) => n.wait(seat.round, "quorum", n.capped(now, n.join_deadline)),
            Join::AskNext(round) => n.set(
                *round,
                "over",
                format!("node '{}' is waiting for the next round", n.node).into_bytes(),
            ),
            // Nobody need have read the hint in round 0 (a fresh node guesses round 0), so
            // it may be missing then: round 0's advance creates it.
            Join::Advance(0) => StoreAction::CompareSet {
                key: n.key(format_args!("round")),
                expected: Vec::new(),
                desired: b"1".to_vec(),
            },
            Join::Advance(round) | Join::AdvanceRead(round) => StoreAction::CompareSet {
                key: n.key(format_args!("round")),
                expected: format!("{round}").into_bytes(),
                desired: format!("{}", round.saturating_add(1)).into_bytes(),
            },
        }
    }

    /// What a reply does.
    pub(super) fn on_reply(self, n: &mut ElasticNode, reply: StoreReply<'_>, now: Instant) -> Next {
        use StoreReply as R;
        Ok(match (self, reply) {
            (Join::ReadHint(_), R::Added(round)) if round >= CLOSED_MARK => {
                n.fail(n.closed_error())
            }
            // Round 0 is still the current one: this node's guessed arrival stands (a
            // late one, or one in a round still open).
            (Join::ReadHint(Some(value)), R::Added(0)) => n.arrived(0, false, value),
            (Join::ReadHint(_), R::Added(round)) => match u64::try_from(round) {
                Ok(round) => Step::Join(Join::Arrive {
                    round,
                    guessed: false,
                }),
                Err(_) => {
                    let key = n.key(format_args!("round"));
                    n.fail(n.bad_value(key, format!("{round}").as_bytes()))
                }
            },
            (Join::Arrive { round, guessed }, R::Added(value)) => n.arrived(round, guessed, value),
            (Join::Announce { seat, live }, R::Set) => n.announced(seat, live, now),
            (Join::SetQuorum(seat), R::Set) | (Join::WaitQuorum(seat), R::Waited) => {
                n.wait_size(seat, now)
            }
            (Join::WaitQuorum(seat), R::TimedOut) if now >= n.join_deadline => {
                n.depart(seat, Then::Failed(n.timeout_error()))
            }
            (Join::WaitQuorum(seat), R::TimedOut) => Step::Tick(Tick::Beat(Resume::Quorum(seat))),
            (Join::AskNext(round), R::Set) => Step::Join(Join::Advance(round)),
            (Join::Advance(0), R::Value(b"0")) => Step::Join(Join::AdvanceRead(0)),
            (Join::Advance(round) | Join::AdvanceRead(round), R::Value(hint)) => {
                n.advanced(round, hint)
            }
            _ => return Err(Mismatch),
        })
    }
}

impl ElasticNode {
    /// Joins again after `round` (a fresh join timeout): advances the round hint past it,
    /// or, holding no round, reads the hint.
    pub(super) fn rejoin(&mut self, round: Option<u64>, now: Instant) -> Step {
        self.join_deadline = now.saturating_add(self.settings.join_timeout);
        Step::Join(match round {
            Some(round) => Join::Advance(round),
            None => Join::ReadHint(None),
        })
    }

    /// Reports the end of `round` (as `over` says, for `reason`), then joins the next.
    pub(super) fn round_over(&mut self, round: u64, reason: String, now: Instant) -> Step {
        self.events.push_back(Event::RoundOver { round, reason });
        self.rejoin(Some(round), now)
    }

    /// The arrivals counter after this node's `ADD 1` in `round`: its slot.
    fn arrived(&mut self, round: u64, guessed: bool, mut value: i64) -> Step {
        let max = self.settings.nodes.max;
        let marked = value >= ARRIVALS_CLOSED;
        if guessed && (marked || (value & 0xffff_ffff) > i64::from(max)) {
            // Round 0 is closed (marked), or may be: its closer marks it only when it
            // handed out fewer than `max_nodes` slots, so a slot above `max_nodes` comes
            // after a closer that did not. Find the current round (the hint says 0 too
            // while round 0 is still open).
            return Step::Join(Join::ReadHint(Some(value)));
        }
        if marked {
            // A late arrival in a closed round: it finds out as any late node.
            value -= ARRIVALS_CLOSED;
        }
        let slot = (value & 0xffff_ffff) as u32;
        if value < 1 || !(1..=MAX_SLOTS).contains(&slot) {
            return self.foreign(round, "arrivals", format!("{value}").as_bytes());
        }
        self.holding = Some(round);
        self.open_slot = Some(slot);
        self.open = OpenWatch::default();
        self.open_live = ElasticSettings::live_count(value);
        Step::Join(Join::Announce {
            seat: Seat { round, slot },
            live: self.open_live,
        })
    }

    /// This node's roster line is written; `live` nodes were there with it.
    fn announced(&self, seat: Seat, live: u32, now: Instant) -> Step {
        let (min, max) = (self.settings.nodes.min, self.settings.nodes.max);
        if live >= max {
            // This arrival fills the round: close it now.
            Step::LastCall(LastCall::ReadRoster(RosterRead {
                seat,
                count: seat.slot,
                since: now,
                tries: 0,
            }))
        } else if live == min && min < max {
            Step::Join(Join::SetQuorum(seat))
        } else if live < min && min < max {
            Step::Join(Join::WaitQuorum(seat))
        } else {
            self.wait_size(seat, now)
        }
    }

    /// The compare-set of the round hint past `round` answered `hint`: arrive in the next
    /// round, unless the rendezvous is closed.
    fn advanced(&mut self, round: u64, hint: &[u8]) -> Step {
        self.holding = None;
        self.open_slot = None;
        let closed = core::str::from_utf8(hint)
            .ok()
            .and_then(|h| h.parse::<i64>().ok())
            .is_some_and(|h| h >= CLOSED_MARK);
        if closed {
            return self.fail(self.closed_error());
        }
        self.spare = false;
        Step::Join(Join::Arrive {
            round: round.saturating_add(1),
            guessed: false,
        })
    }
}
