//! The last call and the close: wait for the round's size until the last call ends, then
//! (the closer) read the roster, propose the world and compare-set the size; whoever
//! loses, or only waited, reads the world that won.
//!
//! No second read of the roster after the compare-set: a member struck between the
//! closer's read and its compare-set never acknowledges, so the confirmation fails
//! (within the keep-alive timeout) and everyone rejoins.

use super::steps::{LastCall, Proposal, Resume, RosterRead, Then, Tick};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::time::Duration;

use super::roster::{deal_ranks, parse_roster, parse_world, Entry, Line};
use super::{
    ElasticNode, Instant, Mismatch, Next, Seat, Step, StoreAction, StoreReply, ARRIVALS_CLOSED,
    MAX_SLOTS,
};

/// The first pause before the closer reads the roster again, for an arrival whose entry
/// is not there yet (counted, its `APPEND` still in flight); each later one twice as
/// long, up to one keep-alive interval in all. A pause costs no store request; long
/// enough that one usually suffices on a loaded machine, short beside a round's close.
const ROSTER_POLL: Duration = Duration::from_millis(5);

impl LastCall {
    /// What this node sends.
    pub(super) fn action(&self, n: &ElasticNode, now: Instant) -> StoreAction {
        match self {
            LastCall::WaitSize { seat, last_call } => n.wait(
                seat.round,
                "size",
                n.capped(now, n.join_deadline.min(*last_call)),
            ),
            LastCall::Count(seat) => n.add(seat.round, "arrivals", 0),
            LastCall::ReadRoster(read) => n.get(read.seat.round, "roster"),
            // No store request while it waits: a concurrent closer is caught anyway by the
            // compare-set of the size, whose reply is the world that won.
            LastCall::RosterPoll(read) => {
                let grace = read.since.saturating_add(n.settings.keep_alive_interval);
                let pause = ROSTER_POLL.saturating_mul(1u32 << read.tries.min(20));
                StoreAction::Pause {
                    until: now.saturating_add(pause).min(grace).max(now),
                }
            }
            LastCall::QuorumBeforeClose(p) => n.set(p.seat.round, "quorum", Vec::new()),
            LastCall::Close(p) => n.create(p.seat.round, "size", p.value.as_bytes().to_vec()),
            LastCall::MarkArrivals(seat) => n.add(seat.round, "arrivals", ARRIVALS_CLOSED),
            LastCall::ReadSize(seat) => n.get(seat.round, "size"),
        }
    }

    /// What a reply does.
    pub(super) fn on_reply(self, n: &mut ElasticNode, reply: StoreReply<'_>, now: Instant) -> Next {
        use StoreReply as R;
        Ok(match (self, reply) {
            (LastCall::WaitSize { seat, .. }, R::Waited) => {
                Step::LastCall(LastCall::ReadSize(seat))
            }
            (LastCall::WaitSize { seat, last_call }, R::TimedOut) => {
                if now >= last_call {
                    Step::LastCall(LastCall::Count(seat))
                } else if now >= n.join_deadline {
                    n.depart(seat, Then::Failed(n.timeout_error()))
                } else {
                    Step::Tick(Tick::Beat(Resume::Size { seat, last_call }))
                }
            }
            (LastCall::Count(seat), R::Added(value)) => {
                Step::LastCall(LastCall::ReadRoster(RosterRead {
                    seat,
                    count: ((value & 0xffff_ffff) as u32).clamp(seat.slot, MAX_SLOTS),
                    since: now,
                    tries: 0,
                }))
            }
            (LastCall::ReadRoster(read), R::Value(roster)) => n.read_roster(read, roster, now),
            (LastCall::RosterPoll(read), R::TimedOut) => {
                Step::LastCall(LastCall::ReadRoster(RosterRead {
                    tries: read.tries.saturating_add(1),
                    ..read
                }))
            }
            (LastCall::QuorumBeforeClose(p), R::Set) => Step::LastCall(LastCall::Close(p)),
            (LastCall::Close(p), R::Value(value)) => {
                // A proposal names its closer, so only the winner finds its own.
                let won = value == p.value.as_bytes();
                if !n.read_world(p.seat.round, value) {
                    Step::Done
                } else if won && p.mark {
                    Step::LastCall(LastCall::MarkArrivals(p.seat))
                } else {
                    n.decide(p.seat, won, now)
                }
            }
            (LastCall::MarkArrivals(seat), R::Added(_)) => n.decide(seat, true, now),
            (LastCall::ReadSize(seat), R::Value(value)) => {
                if n.read_world(seat.round, value) {
                    n.decide(seat, false, now)
                } else {
                    Step::Done
                }
            }
            _ => return Err(Mismatch),
        })
    }
}

impl ElasticNode {
    /// Waits for the round's size, through a last call when `min_nodes < max_nodes`; with
    /// `min_nodes == max_nodes` only the arrival that fills the round closes it.
    pub(super) fn wait_size(&self, seat: Seat, now: Instant) -> Step {
        let nodes = self.settings.nodes;
        let last_call = if nodes.min < nodes.max {
            now.saturating_add(self.settings.last_call)
        } else {
            Instant::from_nanos(u64::MAX)
        };
        Step::LastCall(LastCall::WaitSize { seat, last_call })
    }

    /// Records the world that closed `round` (its size value); `false`, having failed
    /// with a foreign value, when the value is not one.
    fn read_world(&mut self, round: u64, value: &[u8]) -> bool {
        match parse_world(value, self.settings.nodes.max) {
            Some((world, master, closer)) => {
                self.world = world;
                self.master = master;
                self.closer = closer;
                true
            }
            None => {
                self.foreign(round, "size", value);
                false
            }
        }
    }

    /// The closer read the roster: close, pause for a line in flight, or wait for more.
    fn read_roster(&self, read: RosterRead, roster: &[u8], now: Instant) -> Step {
        let (min, max) = (self.settings.nodes.min, self.settings.nodes.max);
        let grace = now.saturating_duration_since(read.since) >= self.settings.keep_alive_interval;
        let RosterRead { seat, count, .. } = read;
        // Every arrival after this read takes a slot above `count`: with `count` at least
        // `max_nodes`, a fresh node's guess sees a slot above `max_nodes` and reads the
        // round hint without a mark.
        let mark = seat.round == 0 && count < max;
        Step::LastCall(match self.propose(roster, count, grace, seat.slot) {
            Reading::Close(value) => {
                let proposal = Proposal { seat, value, mark };
                if min < max {
                    LastCall::QuorumBeforeClose(proposal)
                } else {
                    LastCall::Close(proposal)
                }
            }
            Reading::Poll => LastCall::RosterPoll(read),
            Reading::TooFew => LastCall::WaitSize {
                seat,
                last_call: Instant::from_nanos(u64::MAX),
            },
        })
    }

    /// The closer's decision from the roster of the first `count` slots: the live ones
    /// (arrived, not gone), at most `max_nodes` of them in slot order, ranked by
    /// [`deal_ranks`]. An arrival whose roster line is not there yet is waited for (it is
    /// in flight) until `grace`, then left out.
    fn propose(&self, roster: &[u8], count: u32, grace: bool, closer: u32) -> Reading {
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
            return Reading::Poll;
        }
        joined.retain(|e| !is_gone(&e.slot));
        joined.truncate(self.settings.nodes.max as usize);
        if (joined.len() as u32) < self.settings.nodes.min {
            return Reading::TooFew;
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
        Reading::Close(text)
    }
}

/// The closer's reading of the roster.
enum Reading {
    /// Close with this size value.
    Close(String),
    /// An arrival's line is not there yet: read again shortly.
    Poll,
    /// Fewer than `min_nodes` are still there: wait for more.
    TooFew,
}
