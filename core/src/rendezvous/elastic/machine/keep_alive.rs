//! Keep-alive of a complete round: once per keep-alive interval a member beats its
//! heartbeat and looks at the next rank's (a hot spare at one member's), and waits on
//! `over` meanwhile. A heartbeat that stood still for the keep-alive timeout, or a lease
//! store's key found gone, ends the round; `over`, once set, sends every member (and
//! spare) to the next round.

use super::steps::{KeepAlive, Member, Resume, Tick};
use alloc::format;
use alloc::string::String;

use super::super::key_use::beat_expired;
use super::{end_round, ElasticNode, Instant, Mismatch, Next, Step, StoreAction, StoreReply};

impl KeepAlive {
    /// What this node sends.
    pub(super) fn action(&self, n: &ElasticNode, now: Instant) -> StoreAction {
        match self {
            KeepAlive::Beat(m) => n.add_hb(m.round, m.slot, 1),
            KeepAlive::Watch(m) | KeepAlive::SpareWatch(m) => n.add_hb(m.round, m.watch_slot, 0),
            KeepAlive::WaitOver(m) | KeepAlive::Spare(m) => {
                n.wait(m.round, "over", m.next_tick.max(now))
            }
            KeepAlive::ReadOver { round } => n.get(*round, "over"),
        }
    }

    /// What a reply does.
    pub(super) fn on_reply(self, n: &mut ElasticNode, reply: StoreReply<'_>, now: Instant) -> Next {
        use StoreReply as R;
        Ok(match (self, reply) {
            (KeepAlive::Beat(m), R::Added(_)) => Step::KeepAlive(if m.world > 1 {
                KeepAlive::Watch(m)
            } else {
                KeepAlive::WaitOver(m)
            }),
            (KeepAlive::Watch(m), R::Added(value)) => match n.watch(m, value, now) {
                Ok(m) => Step::KeepAlive(KeepAlive::WaitOver(m)),
                Err(dead) => dead,
            },
            (KeepAlive::WaitOver(m), R::Waited) => {
                Step::KeepAlive(KeepAlive::ReadOver { round: m.round })
            }
            (KeepAlive::WaitOver(m), R::TimedOut) => Step::KeepAlive(KeepAlive::Beat(Member {
                next_tick: now.saturating_add(n.settings.keep_alive_interval),
                ..m
            })),
            (KeepAlive::ReadOver { round }, R::Value(reason)) => {
                n.round_over(round, String::from_utf8_lossy(reason).into_owned(), now)
            }
            (KeepAlive::Spare(m), R::Waited) => n.rejoin(Some(m.round), now),
            (KeepAlive::Spare(m), R::TimedOut) => Step::Tick(Tick::Recheck(Resume::Spare(m))),
            (KeepAlive::SpareWatch(m), R::Added(value)) => match n.watch(m, value, now) {
                Ok(m) => Step::KeepAlive(KeepAlive::Spare(m)),
                Err(dead) => dead,
            },
            _ => return Err(Mismatch),
        })
    }
}

impl ElasticNode {
    /// Records the watched member's heartbeat counter; `Err` with the step that ends the
    /// round when it has stood still for the keep-alive timeout.
    /// A lease store's "gone" (`BEAT_GONE`) ends it at once if this node saw the key there.
    fn watch(&self, mut m: Member, value: i64, now: Instant) -> Result<Member, Step> {
        if beat_expired(m.seen, value) {
            return Err(end_round(
                m.round,
                format!(
                    "rank {}'s heartbeat key is gone: its lease expired (seen by node '{}')",
                    m.watch_rank, self.node
                ),
            ));
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
            Err(end_round(
                m.round,
                format!(
                    "rank {} had no heartbeat for {}s (seen by node '{}')",
                    m.watch_rank,
                    self.settings.keep_alive_timeout().as_secs_f64(),
                    self.node
                ),
            ))
        } else {
            Ok(m)
        }
    }
}
