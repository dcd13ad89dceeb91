//! An open round's tick: once per keep-alive interval, a node waiting in an open round
//! (for the quorum, the size, or as a hot spare for `over`) beats its heartbeat, reads
//! the arrivals, looks at the heartbeat of the slot it watches (striking it when it
//! stood still for the keep-alive timeout), checks `closed`, and resumes its wait.

use super::steps::{AfterGone, Join, KeepAlive, LastCall, Leave, Member, Resume, Tick};

use super::super::key_use::beat_expired;
use super::roster::ring_target;
use super::{
    ElasticNode, ElasticSettings, Instant, Mismatch, Next, Seat, Step, StoreAction, StoreReply,
    MAX_SLOTS,
};

impl Resume {
    fn seat(&self) -> Seat {
        match *self {
            Resume::Quorum(seat) | Resume::Size { seat, .. } => seat,
            Resume::Spare(m) => Seat {
                round: m.round,
                slot: m.slot,
            },
        }
    }
}

impl Tick {
    /// The wait this tick resumes.
    pub(super) fn resume(&self) -> Resume {
        match self {
            Tick::Beat(r) | Tick::Count(r) | Tick::Watch { resume: r, .. } | Tick::Recheck(r) => *r,
        }
    }

    /// What this node sends.
    pub(super) fn action(&self, n: &ElasticNode) -> StoreAction {
        match self {
            Tick::Beat(resume) => {
                let Seat { round, slot } = resume.seat();
                n.add_hb(round, slot, 1)
            }
            Tick::Count(resume) => n.add(resume.seat().round, "arrivals", 0),
            Tick::Watch { resume, target } => n.add_hb(resume.seat().round, *target, 0),
            Tick::Recheck(_) => n.check_closed(),
        }
    }

    /// What a reply does.
    pub(super) fn on_reply(self, n: &mut ElasticNode, reply: StoreReply<'_>, now: Instant) -> Next {
        use StoreReply as R;
        Ok(match (self, reply) {
            (Tick::Beat(resume), R::Added(_)) => Step::Tick(Tick::Count(resume)),
            (Tick::Count(resume), R::Added(value)) => {
                n.open_live = ElasticSettings::live_count(value);
                let count = ((value & 0xffff_ffff) as u32).min(MAX_SLOTS);
                match ring_target(resume.seat().slot, count, &n.open.marked) {
                    Some(target) => {
                        if target != n.open.target {
                            // A new neighbour gets one interval to show its first beat.
                            n.open.target = target;
                            n.open.seen = -1;
                            n.open.seen_at = now.saturating_add(n.settings.keep_alive_interval);
                        }
                        Step::Tick(Tick::Watch { resume, target })
                    }
                    None => Step::Tick(Tick::Recheck(resume)),
                }
            }
            (Tick::Watch { resume, target }, R::Added(value)) => {
                n.watched_open(resume, target, value, now)
            }
            (Tick::Recheck(_), R::Checked(true)) => n.fail(n.closed_error()),
            (Tick::Recheck(resume), R::Checked(false)) => match resume {
                Resume::Quorum(seat) => Step::Join(Join::WaitQuorum(seat)),
                Resume::Size { seat, last_call } => {
                    Step::LastCall(LastCall::WaitSize { seat, last_call })
                }
                Resume::Spare(m) => Step::KeepAlive(KeepAlive::SpareWatch(Member {
                    next_tick: now.saturating_add(n.settings.keep_alive_interval),
                    ..m
                })),
            },
            _ => return Err(Mismatch),
        })
    }
}

impl ElasticNode {
    /// The heartbeat counter of the watched slot `target` of an open round is `value`:
    /// strike the slot when it is gone or stood still for the keep-alive timeout.
    fn watched_open(&mut self, resume: Resume, target: u32, value: i64, now: Instant) -> Step {
        // A lease store's "gone" (`BEAT_GONE`): struck at once if it was seen there;
        // never seen, it is a counter at 0.
        let expired = beat_expired(self.open.seen, value);
        let value = value.max(0);
        let dead = if expired {
            true
        } else if value != self.open.seen {
            self.open.seen = value;
            self.open.seen_at = self.open.seen_at.max(now);
            false
        } else {
            // The neighbour is dead: it must not be counted into the round.
            now.saturating_duration_since(self.open.seen_at) >= self.settings.keep_alive_timeout()
        };
        if dead {
            self.open.marked.push(target);
            Step::Leave(Leave::GoneClaim {
                seat: Seat {
                    round: resume.seat().round,
                    slot: target,
                },
                after: AfterGone::Resume(resume),
            })
        } else {
            Step::Tick(Tick::Recheck(resume))
        }
    }
}
