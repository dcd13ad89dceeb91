//! How the machine uses each of its keys, for stores that can keep a key better than as
//! one value: the machine's own rule, stated once, so that a store never guesses it.
//!
//! Two kinds of key are written by every node of a round at about the same moment: the
//! round's counters (`{r}/arrivals`, `{r}/ready`) and its roster (`{r}/roster`). On a
//! store whose `ADD` and `APPEND` are served in one place (the TCP store) that costs one
//! request each. On a store where they are compare-and-swap loops on one value (etcd), N
//! writers at once make every loser retry, and a join costs O(N) requests. Such a store
//! may instead keep
//! - a [`KeyUse::Tally`] as one key per increment: the counter's value is the sum over
//!   [`TALLY_UNITS`] of the unit times the number of its increments (the machine only
//!   ever adds 0 or exactly one unit), and an increment's reply is that sum as of its own
//!   write;
//! - a [`KeyUse::Log`] as one key per line: its value is the lines in the order they were
//!   written (the machine only appends lines and reads the whole log).
//!
//! Both are what `ADD` and `APPEND` would give, so the machine cannot tell them apart.
//! A [`KeyUse::Beat`] is a heartbeat counter, where counting an increment twice does no
//! harm, so a store may resend one whose answer was lost instead of failing. A store with
//! leases (etcd) may instead bind each node's Beat keys to that node's lease: an `ADD 1`
//! is the lease's keep-alive, and the watcher's `ADD 0` answers a value that moves while
//! the key is there and [`BEAT_GONE`] once it is not, so that a dead node is struck when
//! its lease expires rather than after the watcher counted stalled intervals.
//! This module decides nothing else: how a store lays such keys out is the store's.

use core::time::Duration;

/// What the machine does with a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUse {
    /// Only `ADD`s of 0 (a read) or of exactly one of [`TALLY_UNITS`].
    Tally,
    /// Only `APPEND`s and reads of the whole value.
    Log,
    /// A heartbeat counter (`{r}/hb/{s}`): only `ADD 1` by its owner and `ADD 0` by its
    /// watcher, who looks only for change, so an increment applied twice (resent after a
    /// lost answer) is harmless: a store may resend it rather than fail.
    Beat,
    /// Anything else: keep it as one value.
    Value,
}

/// The answer to a watcher's `ADD 0` of a [`KeyUse::Beat`] key that is gone: its owner's
/// lease expired (the owner did not beat for the lease's TTL) or was revoked (it left).
/// A watcher that has seen the key there strikes its owner at once. One that has not
/// (its owner may not have beaten yet) reads it as a counter at 0, which the keep-alive
/// timeout judges as before. No store answers it otherwise: a counter that only ever
/// grows by 1 from 0 is never negative.
pub const BEAT_GONE: i64 = -1;

/// The TTL a lease store gives a node's heartbeat lease, for a rendezvous whose nodes
/// beat every `keep_alive_interval` and are dead after `keep_alive_max_attempts` missed
/// beats: longer than the longest a live node goes without beating one key, or a slow
/// confirmation would cost a live node its lease. That gap is up to one interval in the
/// open round before the close, the wait for `go` (at most the keep-alive timeout), and
/// one interval to its first beat as a member: the keep-alive timeout plus two intervals,
/// plus a second for request latency and the store's rounding. A dead node's key is gone
/// that long after its last beat.
pub fn beat_lease_ttl(keep_alive_interval: Duration, keep_alive_max_attempts: u32) -> Duration {
    keep_alive_interval
        .saturating_mul(keep_alive_max_attempts.saturating_add(2))
        .saturating_add(Duration::from_secs(1))
}

/// Whether a watcher that last read `seen` of a [`KeyUse::Beat`] key (negative: not yet,
/// or only [`BEAT_GONE`]; a present key reads at least 1 on a lease store) and now reads
/// `value` has watched the key go: present before, gone now.
pub(super) fn beat_expired(seen: i64, value: i64) -> bool {
    value == BEAT_GONE && seen > 0
}

/// The increments of a [`KeyUse::Tally`]: an arrival or an acknowledgement (1), a
/// departure or a member giving up on the confirmation (2^32), the "round 0 is closed"
/// mark (2^48).
pub const TALLY_UNITS: [i64; 3] = [1, 1 << 32, 1 << 48];

/// The prefix of every key of the machine (`rdzv.elastic.{run_id}/…`).
const MACHINE_PREFIX: &str = "rdzv.elastic.";

/// How the machine uses `key` (a store key as [`super::StoreAction::key`] gives it; any
/// other key, a round's store's included, is a [`KeyUse::Value`]).
pub fn key_use(key: &str) -> KeyUse {
    if !key.starts_with(MACHINE_PREFIX) {
        return KeyUse::Value;
    }
    let Some((parent, last)) = key.rsplit_once('/') else {
        return KeyUse::Value;
    };
    match last {
        "arrivals" | "ready" => KeyUse::Tally,
        "roster" => KeyUse::Log,
        _ if parent.ends_with("/hb") && last.bytes().all(|b| b.is_ascii_digit()) => KeyUse::Beat,
        _ => KeyUse::Value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_outlives_the_longest_gap_between_a_live_nodes_beats() {
        let s = |n| Duration::from_secs(n);
        // PyTorch's defaults: a beat every 5 s, dead after 3 missed.
        assert_eq!(beat_lease_ttl(s(5), 3), s(26));
        let (interval, attempts) = (Duration::from_millis(300), 4);
        let gap = interval + interval * attempts + interval;
        assert!(beat_lease_ttl(interval, attempts) > gap);
    }

    // That the machine keeps to the rule is checked on every action of the virtual-time
    // suite and its proptests, by their store model (`super::super::tests::Model`).

    #[test]
    fn the_rounds_counters_are_tallies_and_its_roster_a_log() {
        assert_eq!(key_use("rdzv.elastic.job/0/arrivals"), KeyUse::Tally);
        assert_eq!(key_use("rdzv.elastic.job/3/ready"), KeyUse::Tally);
        assert_eq!(key_use("rdzv.elastic.job/3/roster"), KeyUse::Log);
        assert_eq!(key_use("rdzv.elastic.job/round"), KeyUse::Value);
        assert_eq!(key_use("rdzv.elastic.job/3/hb/2"), KeyUse::Beat);
        assert_eq!(key_use("rdzv.elastic.job/3/gone/2"), KeyUse::Value);
        assert_eq!(key_use("torch.rendezvous.job.3/arrivals"), KeyUse::Value);
    }

    #[test]
    fn a_beat_key_has_expired_only_once_it_was_seen_there() {
        assert!(beat_expired(1, BEAT_GONE));
        assert!(beat_expired(7, BEAT_GONE));
        // Never seen, or only seen missing: the owner may not have beaten yet.
        assert!(!beat_expired(-1, BEAT_GONE));
        assert!(!beat_expired(0, BEAT_GONE));
        assert!(!beat_expired(3, 4));
    }
}
