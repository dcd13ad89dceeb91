//! The confirmation: every member of a closed round acknowledges it (`ready`), and the
//! round is complete only once the last acknowledgement releases the others (`go`), or
//! the one verdict says so. A node left out of the world waits instead: a hot spare, or
//! a late node that asks for the next round.

use super::steps::{Confirm, Join, KeepAlive, Member, Place};
use alloc::format;
use alloc::vec::Vec;

use super::{
    end_round, ElasticNode, Event, Instant, Mismatch, Next, RoundOutcome, Seat, Step, StoreAction,
    StoreReply,
};

/// Added to a round's acknowledgement counter (`{round}/ready`, whose low 32 bits count
/// the acknowledgements) by each member that waited in vain for `go`, before it decides:
/// the acknowledgement that completes the count sees whether anybody gave up before it.
const GAVE_UP: i64 = 1 << 32;

/// A round's confirmation verdict (`{round}/verdict`), compare-set once from missing: the
/// round stands, or it failed.
const VERDICT_GO: &[u8] = b"go";
const VERDICT_FAIL: &[u8] = b"fail";

impl Confirm {
    /// What this node sends.
    pub(super) fn action(&self, n: &ElasticNode, now: Instant) -> StoreAction {
        match self {
            Confirm::Ack(at) => n.add(at.seat.round, "ready", 1),
            Confirm::SetGo(at) => n.set(at.seat.round, "go", Vec::new()),
            Confirm::WaitGo { at, deadline } => {
                n.wait(at.seat.round, "go", n.capped(now, *deadline))
            }
            Confirm::ReadReady(at) => n.add(at.seat.round, "ready", GAVE_UP),
            Confirm::Verdict { at, go } => {
                let verdict = if *go { VERDICT_GO } else { VERDICT_FAIL };
                n.create(at.seat.round, "verdict", verdict.to_vec())
            }
        }
    }

    /// What a reply does.
    pub(super) fn on_reply(self, n: &mut ElasticNode, reply: StoreReply<'_>, now: Instant) -> Next {
        use StoreReply as R;
        Ok(match (self, reply) {
            (Confirm::Ack(at), R::Added(value)) => Step::Confirm(n.acknowledged(at, value, now)),
            (Confirm::SetGo(at), R::Set) | (Confirm::WaitGo { at, .. }, R::Waited) => {
                n.complete(at, now)
            }
            (Confirm::WaitGo { at, deadline }, R::TimedOut) => Step::Confirm(if now >= deadline {
                Confirm::ReadReady(at)
            } else {
                Confirm::WaitGo { at, deadline }
            }),
            (Confirm::ReadReady(at), R::Added(value)) => Step::Confirm(Confirm::Verdict {
                at,
                go: (value & 0xffff_ffff) >= n.acks_needed(),
            }),
            (Confirm::Verdict { at, .. }, R::Value(verdict)) => {
                if verdict == VERDICT_GO {
                    // Release the others (again, when a member that waited in vain finds
                    // the round standing: the last acknowledger may have died after its
                    // verdict).
                    Step::Confirm(Confirm::SetGo(at))
                } else if verdict == VERDICT_FAIL {
                    n.unconfirmed(at.seat.round)
                } else {
                    n.foreign(at.seat.round, "verdict", verdict)
                }
            }
            _ => return Err(Mismatch),
        })
    }
}

impl ElasticNode {
    /// This member's acknowledgement made the count `value`.
    fn acknowledged(&self, at: Place, value: i64, now: Instant) -> Confirm {
        let size = self.acks_needed();
        let (acks, gave_up) = (value & 0xffff_ffff, value >> 32);
        if acks >= size && gave_up == 0 {
            // The last acknowledgement, before any member gave up: each one that gives up
            // from now on counts itself after it, finds every acknowledgement in and
            // compare-sets `go`, so `go` is the only verdict there can be. Release the
            // others without writing it.
            Confirm::SetGo(at)
        } else if acks >= size {
            // A member gave up first and may have decided `fail`: the verdict decides.
            Confirm::Verdict { at, go: true }
        } else {
            Confirm::WaitGo {
                at,
                deadline: now.saturating_add(self.settings.keep_alive_timeout()),
            }
        }
    }

    /// The round closed with the slots in `self.world` (by rank): a member acknowledges
    /// it (the closer, `won`, by its compare-set: it waits for the release at once, or
    /// completes a round of one), a late node waits.
    pub(super) fn decide(&mut self, seat: Seat, won: bool, now: Instant) -> Step {
        self.open_slot = None;
        let Some(rank) = self.world.iter().position(|&s| s == seat.slot) else {
            return self.wait_outside(seat, now);
        };
        let at = Place {
            seat,
            rank: rank as u32,
        };
        if won && self.acks_needed() == 0 {
            // Nobody else to hear from.
            self.complete(at, now)
        } else if won && self.closer == Some(seat.slot) {
            Step::Confirm(Confirm::WaitGo {
                at,
                deadline: now.saturating_add(self.settings.keep_alive_timeout()),
            })
        } else {
            Step::Confirm(Confirm::Ack(at))
        }
    }

    /// The round closed without this node: a hot spare when it is full, else a late
    /// node that asks for the next round.
    fn wait_outside(&mut self, Seat { round, slot }: Seat, now: Instant) -> Step {
        let size = self.world.len() as u32;
        let hot_spare = size > 0 && size >= self.settings.nodes.max;
        self.events.push_back(Event::Waiting { round, hot_spare });
        self.spare = hot_spare;
        // A late node holds no member's slot: leaving must not end the round.
        self.holding = None;
        if !hot_spare {
            return Step::Join(Join::AskNext(round));
        }
        // A hot spare watches one member too, so that a round whose members all died (or
        // a round of one) still ends.
        let watch_rank = slot.saturating_sub(1) % size;
        Step::KeepAlive(KeepAlive::SpareWatch(
            self.member(round, slot, watch_rank, now),
        ))
    }

    /// Every member acknowledged the round: it is complete. The acknowledgement was this
    /// member's first sign of life; its first heartbeat and its first look at the watched
    /// member are one interval away, and until then it only waits on `over`. The watched
    /// member's keep-alive timeout runs from now.
    fn complete(&mut self, Place { seat, rank }: Place, now: Instant) -> Step {
        let (round, size) = (seat.round, self.world.len() as u32);
        self.events.push_back(Event::Complete(RoundOutcome {
            round,
            rank,
            world_size: size,
            store_prefix: format!("torch.rendezvous.{}.{round}", self.settings.run_id),
            master: self.master.clone(),
        }));
        self.prev = Some((round, rank));
        let next = (rank + 1) % size;
        Step::KeepAlive(KeepAlive::WaitOver(
            self.member(round, seat.slot, next, now),
        ))
    }

    /// A member (or hot spare) at `slot` of the world of `round` just closed, watching
    /// the member of rank `watch_rank`, its first tick one interval away.
    fn member(&self, round: u64, slot: u32, watch_rank: u32, now: Instant) -> Member {
        Member {
            round,
            slot,
            world: self.world.len() as u32,
            watch_slot: self.world[watch_rank as usize],
            watch_rank,
            next_tick: now.saturating_add(self.settings.keep_alive_interval),
            seen: -1,
            seen_at: now,
        }
    }

    /// A member did not acknowledge the round within the keep-alive timeout: it is dead,
    /// and the round fails before anyone is told it is complete.
    fn unconfirmed(&self, round: u64) -> Step {
        end_round(
            round,
            format!(
                "a member did not confirm the round within {}s (seen by node '{}')",
                self.settings.keep_alive_timeout().as_secs_f64(),
                self.node
            ),
        )
    }

    /// How many `ADD`s to `ready` confirm the round just closed: one per member, but
    /// none for the closer whose compare-set closed it (alive then, it acknowledged by
    /// closing).
    fn acks_needed(&self) -> i64 {
        let closer_is_member = self.closer.is_some_and(|c| self.world.contains(&c));
        self.world.len() as i64 - i64::from(closer_is_member)
    }
}
