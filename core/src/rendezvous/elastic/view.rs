//! What a store's keys say about the elastic runs it holds, for a status page: each run's
//! round and state, its members, the nodes waiting for the next round, the nodes struck
//! and why, and how the round formed; and a store's footprint by key prefix.
//!
//! It reads the key layout of this module's machine (see the parent module's table) from
//! `(key, value)` pairs, a key with or without the leading `/` rdzv's and PyTorch's
//! clients put before a user key. It does no I/O and reads no clock: the caller passes
//! the pairs and `now`. The store keeps no timestamps, so times come from watching:
//! [`ElasticView`] remembers when it first saw a round's arrivals and its size, and when
//! each heartbeat counter last moved, across calls; until it has watched one change, an
//! age is unknown (`None`) rather than guessed.
//!
//! It decides nothing and writes nothing. What it gives out is run ids, node names,
//! contacts' hosts, slot numbers and the reasons nodes wrote to `over`; [`PrefixTally`]
//! gives key prefixes, counts and sizes, never a value.

use alloc::collections::BTreeMap;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::time::Duration;

use super::machine::roster::{self, Entry, Line as RosterLine};
use super::machine::MAX_SLOTS;
use super::Instant;

/// The prefix of the machine's keys (the parent module's layout).
const PREFIX: &str = "rdzv.elastic.";
/// `round`'s mark of a closed rendezvous (the machine's `CLOSED_MARK`).
const CLOSED_MARK: i64 = 1 << 40;

/// Where a run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// The round is open and fewer than `min_nodes` have arrived (or, with
    /// `min_nodes == max_nodes`, fewer than `max_nodes`).
    WaitingForMinNodes,
    /// `min_nodes` arrived; the last call runs until the round closes.
    LastCall,
    /// The round closed; its members are acknowledging it.
    Confirming,
    /// Every member acknowledged: the round is running.
    Complete,
    /// The round ended (see [`RunView::over`]) and the next has not started.
    Over,
    /// The rendezvous is closed for good.
    Closed,
}

/// A node of a round, member or not.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Arrival {
    /// The node's name (its node id).
    pub node: String,
    /// Its slot in the round's arrivals.
    pub slot: u32,
    /// The host of its contact (`host` of `host:port`), when it gave one.
    pub host: Option<String>,
    /// How long since its heartbeat counter was last seen to move (or, until it has been
    /// seen to move, since it was first seen); `None` while it has no heartbeat key.
    pub beat_age_ms: Option<u64>,
    /// Whether [`Arrival::beat_age_ms`] is only a lower bound: the counter has not been
    /// seen to move yet.
    pub beat_age_at_least: bool,
}

/// A member of a run's round: an arrival with a rank (one flat object in JSON).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Member {
    /// Its rank, `0..world_size`.
    pub rank: u32,
    /// The node.
    #[serde(flatten)]
    pub arrival: Arrival,
}

/// A node struck from a round, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Struck {
    /// The node's name.
    pub node: String,
    /// The round it was struck from.
    pub round: u64,
    /// Why, in words.
    pub why: String,
}

/// One elastic run as its keys show it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RunView {
    /// The run id.
    pub run_id: String,
    /// The newest round that has keys.
    pub round: u64,
    /// Where that round stands.
    pub state: RunState,
    /// The round's world size, once it closed.
    pub world_size: Option<u32>,
    /// Its members by rank, once it closed.
    pub members: Vec<Member>,
    /// Live arrivals that are not members: all of them while the round is open, the hot
    /// spares and late arrivals once it closed.
    pub waiting: Vec<Arrival>,
    /// Nodes struck from this round or the one before, and members of the round before
    /// that this one lost.
    pub struck: Vec<Struck>,
    /// Why the round (or, when it is running, the round before it) ended, as written.
    pub over: Option<String>,
    /// How long ago the round closed, to within the time between two looks: known when
    /// this view looked at the run before the round closed.
    pub formed_ago_ms: Option<u64>,
    /// How long the round took to form, from the first sight of its arrivals to that of
    /// its size (to within the time between looks): known only when both were seen
    /// apart.
    pub formed_in_ms: Option<u64>,
}

/// One round's keys, raw.
#[derive(Default)]
struct RoundKeys<'a> {
    arrivals: Option<i64>,
    roster: &'a [u8],
    size: Option<&'a [u8]>,
    quorum: bool,
    verdict: Option<&'a [u8]>,
    go: bool,
    over: Option<&'a [u8]>,
    /// Slot → who claimed its strike.
    gone: BTreeMap<u32, &'a [u8]>,
    /// Slot → heartbeat counter key.
    beats: BTreeMap<u32, String>,
}

/// One run's keys, raw.
#[derive(Default)]
struct RunKeys<'a> {
    round: Option<i64>,
    closed: Option<&'a [u8]>,
    rounds: BTreeMap<u64, RoundKeys<'a>>,
}

/// One arrival's roster line, as the machine writes and reads it.
type Line<'a> = Entry<'a>;

/// What a round's size value says: its slots by rank (none when shut down).
struct World {
    slots: Vec<u32>,
}

/// The size value, by the machine's own reading of it.
fn parse_world(value: &[u8]) -> Option<World> {
    roster::parse_world(value, MAX_SLOTS).map(|(slots, _, _)| World { slots })
}

/// The roster, by the machine's own reading of it: arrivals by slot, and the slots
/// struck.
fn parse_roster(roster: &[u8]) -> (BTreeMap<u32, Line<'_>>, Vec<u32>) {
    let mut joined = BTreeMap::new();
    let mut gone = Vec::new();
    for line in roster::parse_roster(roster) {
        match line {
            RosterLine::Joined(entry) => {
                joined.insert(entry.slot, entry);
            }
            RosterLine::Gone(slot) => gone.push(slot),
        }
    }
    (joined, gone)
}

/// The host of a `host:port` contact (`[v6]:port` too).
fn host_of(contact: &str) -> String {
    let host = contact.rsplit_once(':').map_or(contact, |(host, _)| host);
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
}

fn number(value: &[u8]) -> Option<i64> {
    core::str::from_utf8(value).ok()?.trim().parse().ok()
}

fn text(value: &[u8]) -> String {
    String::from_utf8_lossy(value).into_owned()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Splits `rdzv.elastic.{run}/{rest}` (after an optional leading `/`).
fn split_key(key: &[u8]) -> Option<(&str, &str)> {
    let key = core::str::from_utf8(key).ok()?;
    let key = key.strip_prefix('/').unwrap_or(key);
    key.strip_prefix(PREFIX)?.split_once('/')
}

/// Groups the machine's keys by run and round.
fn gather<'a>(entries: &[(&'a [u8], &'a [u8])]) -> BTreeMap<&'a str, RunKeys<'a>> {
    let mut runs: BTreeMap<&str, RunKeys<'_>> = BTreeMap::new();
    for &(key, value) in entries {
        let Some((run_id, rest)) = split_key(key) else {
            continue;
        };
        let run = runs.entry(run_id).or_default();
        match rest {
            "round" => run.round = number(value),
            "closed" => run.closed = Some(value),
            _ => {
                let Some((round, what)) = rest.split_once('/') else {
                    continue;
                };
                let Ok(round) = round.parse::<u64>() else {
                    continue;
                };
                let keys = run.rounds.entry(round).or_default();
                match what {
                    "arrivals" => keys.arrivals = number(value),
                    "roster" => keys.roster = value,
                    "size" => keys.size = Some(value),
                    "quorum" => keys.quorum = true,
                    "verdict" => keys.verdict = Some(value),
                    "go" => keys.go = true,
                    "over" => keys.over = Some(value),
                    _ => {
                        if let Some(slot) = what.strip_prefix("gone/").and_then(|s| s.parse().ok())
                        {
                            keys.gone.insert(slot, value);
                        } else if let Some(slot) =
                            what.strip_prefix("hb/").and_then(|s| s.parse().ok())
                        {
                            keys.beats.insert(slot, text(key));
                        }
                    }
                }
            }
        }
    }
    runs
}

/// What the view remembers between calls: when it saw things first, or move.
#[derive(Debug, Default, Clone)]
pub struct ElasticView {
    /// Heartbeat key → (last value seen, when it was seen to move or else first seen,
    /// whether it was seen to move).
    beats: BTreeMap<String, (Vec<u8>, Instant, bool)>,
    /// (run, round) → when its arrivals were first seen.
    arrived: BTreeMap<(String, u64), Instant>,
    /// (run, round) → when its size was first seen, and whether it was seen appear
    /// (`false`: it was there at the first look).
    formed: BTreeMap<(String, u64), (Instant, bool)>,
    /// Run → when it was first seen.
    runs: BTreeMap<String, Instant>,
}

impl ElasticView {
    /// A view that has seen nothing yet.
    pub fn new() -> ElasticView {
        ElasticView::default()
    }

    /// The runs `entries` (every key of a store, or a run's) hold at `now`, by run id.
    /// Keys outside the machine's layout are ignored.
    pub fn observe(&mut self, entries: &[(&[u8], &[u8])], now: Instant) -> Vec<RunView> {
        let runs = gather(entries);
        let values: BTreeMap<&[u8], &[u8]> = entries.iter().copied().collect();
        self.watch_beats(&runs, &values, now);
        let mut views = Vec::new();
        for (run_id, run) in &runs {
            if let Some(view) = self.run_view(run_id, run, now) {
                views.push(view);
            }
        }
        // Forget what is gone, so that the view does not grow with a long server's life.
        self.runs.retain(|run, _| runs.contains_key(run.as_str()));
        self.arrived.retain(|(run, round), _| {
            runs.get(run.as_str())
                .is_some_and(|r| r.rounds.contains_key(round))
        });
        self.formed.retain(|(run, round), _| {
            runs.get(run.as_str())
                .is_some_and(|r| r.rounds.contains_key(round))
        });
        views
    }

    fn watch_beats(
        &mut self,
        runs: &BTreeMap<&str, RunKeys<'_>>,
        values: &BTreeMap<&[u8], &[u8]>,
        now: Instant,
    ) {
        let mut seen = BTreeMap::new();
        for run in runs.values() {
            for keys in run.rounds.values() {
                for key in keys.beats.values() {
                    let value = values.get(key.as_bytes()).copied().or_else(|| {
                        let slashed = alloc::format!("/{key}");
                        values.get(slashed.as_bytes()).copied()
                    });
                    let value = value.unwrap_or_default();
                    let (at, moved) = match self.beats.remove(key) {
                        Some((old, at, moved)) if old == value => (at, moved),
                        Some(_) => (now, true),
                        None => (now, false),
                    };
                    seen.insert(key.clone(), (value.to_vec(), at, moved));
                }
            }
        }
        self.beats = seen;
    }

    /// A slot's heartbeat age, and whether it is only a lower bound.
    fn beat_age(&self, keys: &RoundKeys<'_>, slot: u32, now: Instant) -> (Option<u64>, bool) {
        let Some(&(_, at, moved)) = keys.beats.get(&slot).and_then(|key| self.beats.get(key))
        else {
            return (None, false);
        };
        (Some(millis(now.saturating_duration_since(at))), !moved)
    }

    fn arrival(&self, keys: &RoundKeys<'_>, line: &Line<'_>, now: Instant) -> Arrival {
        let (beat_age_ms, beat_age_at_least) = self.beat_age(keys, line.slot, now);
        Arrival {
            node: line.node.to_string(),
            slot: line.slot,
            host: line.contact.map(host_of),
            beat_age_ms,
            beat_age_at_least,
        }
    }

    fn run_view(&mut self, run_id: &str, run: &RunKeys<'_>, now: Instant) -> Option<RunView> {
        let view = self.round_view(run_id, run, now);
        self.runs.entry(run_id.to_string()).or_insert(now);
        view
    }

    fn round_view(&mut self, run_id: &str, run: &RunKeys<'_>, now: Instant) -> Option<RunView> {
        let (&round, keys) = run.rounds.iter().next_back()?;
        let id = (run_id.to_string(), round);
        if keys.arrivals.is_some() {
            self.arrived.entry(id.clone()).or_insert(now);
        }
        let closed = run.closed.is_some() || run.round.is_some_and(|r| r >= CLOSED_MARK);
        let world = keys.size.and_then(parse_world);
        if keys.size.is_some() {
            let first = !self.formed.contains_key(&id);
            // Seen appear if this run was looked at before without it: then it formed
            // between that look and this one.
            let seen_before = self.runs.get(run_id).is_some_and(|&at| at < now);
            if first {
                self.formed.insert(id.clone(), (now, seen_before));
            }
        }
        let (formed_ago_ms, formed_in_ms) = match self.formed.get(&id) {
            Some(&(at, seen_appear)) => (
                seen_appear.then(|| millis(now.saturating_duration_since(at))),
                seen_appear
                    .then(|| self.arrived.get(&id))
                    .flatten()
                    .filter(|&&first| first < at)
                    .map(|&first| millis(at.saturating_duration_since(first))),
            ),
            None => (None, None),
        };
        let (lines, struck_slots) = parse_roster(keys.roster);
        let mut members = Vec::new();
        let mut in_world = Vec::new();
        if let Some(world) = &world {
            for (rank, &slot) in world.slots.iter().enumerate() {
                in_world.push(slot);
                let arrival = match lines.get(&slot) {
                    Some(line) => self.arrival(keys, line, now),
                    None => self.arrival(
                        keys,
                        &Line {
                            slot,
                            prev: None,
                            contact: None,
                            node: "",
                        },
                        now,
                    ),
                };
                members.push(Member {
                    rank: u32::try_from(rank).unwrap_or(u32::MAX),
                    arrival,
                });
            }
        }
        let waiting = lines
            .values()
            .filter(|l| !in_world.contains(&l.slot) && !struck_slots.contains(&l.slot))
            .map(|l| self.arrival(keys, l, now))
            .collect();
        let mut struck = struck_in(round, keys, &lines);
        let previous = round
            .checked_sub(1)
            .and_then(|r| run.rounds.get(&r).map(|k| (r, k)));
        if let Some((prev, prev_keys)) = previous {
            let (prev_lines, _) = parse_roster(prev_keys.roster);
            struck.extend(struck_in(prev, prev_keys, &prev_lines));
            struck.extend(lost_members(prev, prev_keys, &prev_lines, &members));
        }
        let state = if closed {
            RunState::Closed
        } else if keys.over.is_some() || keys.verdict == Some(b"fail".as_slice()) {
            RunState::Over
        } else if keys.go
            || keys.verdict == Some(b"go".as_slice())
            || world.as_ref().is_some_and(|w| w.slots.len() == 1)
        {
            RunState::Complete
        } else if keys.size.is_some() {
            RunState::Confirming
        } else if keys.quorum {
            RunState::LastCall
        } else {
            RunState::WaitingForMinNodes
        };
        let over = keys
            .over
            .or_else(|| previous.and_then(|(_, k)| k.over))
            .or(run.closed)
            .map(text);
        Some(RunView {
            run_id: run_id.to_string(),
            round,
            state,
            world_size: world
                .as_ref()
                .map(|w| u32::try_from(w.slots.len()).unwrap_or(u32::MAX)),
            members,
            waiting,
            struck,
            over,
            formed_ago_ms,
            formed_in_ms,
        })
    }
}

/// The slots struck from an open `round`, with who struck them.
fn struck_in(round: u64, keys: &RoundKeys<'_>, lines: &BTreeMap<u32, Line<'_>>) -> Vec<Struck> {
    keys.gone
        .iter()
        .map(|(slot, by)| {
            let node = lines
                .get(slot)
                .map_or_else(|| alloc::format!("slot {slot}"), |l| l.node.to_string());
            let by = text(by);
            let why = if by == node {
                "left or timed out before the round closed".to_string()
            } else {
                alloc::format!("no heartbeat; struck by '{by}'")
            };
            Struck { node, round, why }
        })
        .collect()
}

/// The members of the closed round `prev` that are not members of the round after it,
/// with the reason `prev` ended.
fn lost_members(
    prev: u64,
    keys: &RoundKeys<'_>,
    lines: &BTreeMap<u32, Line<'_>>,
    now_members: &[Member],
) -> Vec<Struck> {
    let Some(world) = keys.size.and_then(parse_world) else {
        return Vec::new();
    };
    if now_members.is_empty() {
        return Vec::new();
    }
    let why = keys
        .over
        .map_or_else(|| "not in the next round".to_string(), text);
    world
        .slots
        .iter()
        .filter_map(|slot| lines.get(slot))
        .filter(|l| !now_members.iter().any(|m| m.arrival.node == l.node))
        .map(|l| Struck {
            node: l.node.to_string(),
            round: prev,
            why: why.clone(),
        })
        .collect()
}

/// Keys and bytes under one prefix.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PrefixUse {
    /// The prefix: a key up to and including its first `/` after an optional leading
    /// one (`/rdzv.elastic.job/`), or the whole key when it has none.
    pub prefix: String,
    /// Keys under it.
    pub keys: u64,
    /// Their keys' and values' bytes.
    pub bytes: u64,
}

/// A store's footprint by key prefix: add every key with its value's length.
#[derive(Debug, Default, Clone)]
pub struct PrefixTally {
    by_prefix: BTreeMap<Vec<u8>, (u64, u64)>,
    keys: u64,
    bytes: u64,
}

impl PrefixTally {
    /// Counts `key`, whose value is `value_len` bytes long.
    pub fn add(&mut self, key: &[u8], value_len: usize) {
        let start = usize::from(key.first() == Some(&b'/'));
        let end = key
            .iter()
            .skip(start)
            .position(|&b| b == b'/')
            .map_or(key.len(), |i| start + i + 1);
        let prefix = key.get(..end).unwrap_or(key);
        let bytes = (key.len() + value_len) as u64;
        let entry = match self.by_prefix.get_mut(prefix) {
            Some(entry) => entry,
            None => self.by_prefix.entry(prefix.to_vec()).or_default(),
        };
        entry.0 += 1;
        entry.1 += bytes;
        self.keys += 1;
        self.bytes += bytes;
    }

    /// All keys counted, and their bytes.
    pub fn totals(&self) -> (u64, u64) {
        (self.keys, self.bytes)
    }

    /// The `n` prefixes holding the most bytes, most first (ties by name).
    pub fn top(&self, n: usize) -> Vec<PrefixUse> {
        let mut all: Vec<PrefixUse> = self
            .by_prefix
            .iter()
            .map(|(prefix, &(keys, bytes))| PrefixUse {
                prefix: text(prefix),
                keys,
                bytes,
            })
            .collect();
        all.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.prefix.cmp(&b.prefix)));
        all.truncate(n);
        all
    }
}

#[cfg(test)]
mod tests {
    use alloc::format;
    use alloc::vec;

    use super::super::{
        ElasticNode, ElasticSettings, LocalEvent, NodeRange, OwnedStoreReply, StoreAction,
    };
    use super::*;

    /// The machine's own nodes against a map with the TCPStore's semantics, keys sent as
    /// rdzv's client sends them (`/` before each): the layouts are the machine's, not
    /// written by hand.
    struct Cluster {
        now: Instant,
        kv: BTreeMap<String, Vec<u8>>,
        nodes: Vec<(ElasticNode, Option<StoreAction>, bool)>,
        settings: ElasticSettings,
    }

    impl Cluster {
        fn new(min: u32, max: u32) -> Cluster {
            let mut settings = ElasticSettings::new("job", NodeRange::new(min, max).unwrap());
            settings.last_call = Duration::from_secs(2);
            settings.keep_alive_interval = Duration::from_secs(1);
            settings.keep_alive_max_attempts = 3;
            Cluster {
                now: Instant::ZERO,
                kv: BTreeMap::new(),
                nodes: Vec::new(),
                settings,
            }
        }

        fn join(&mut self, name: &str) -> usize {
            let mut node = ElasticNode::new(self.settings.clone(), name);
            node.set_contact(&format!("{name}.example:29500"));
            node.handle_local(LocalEvent::Join);
            self.nodes.push((node, None, true));
            self.nodes.len() - 1
        }

        fn apply(
            kv: &mut BTreeMap<String, Vec<u8>>,
            action: &StoreAction,
            now: Instant,
        ) -> Option<OwnedStoreReply> {
            let wire = |key: &str| format!("/{key}");
            Some(match action {
                StoreAction::Pause { until } => {
                    return (now >= *until).then_some(OwnedStoreReply::TimedOut)
                }
                StoreAction::Check { key } => OwnedStoreReply::Checked(kv.contains_key(&wire(key))),
                StoreAction::Add { key, delta } => {
                    let old: i64 = kv.get(&wire(key)).and_then(|v| number(v)).unwrap_or(0);
                    kv.insert(wire(key), format!("{}", old + delta).into_bytes());
                    OwnedStoreReply::Added(old + delta)
                }
                StoreAction::Set { key, value } => {
                    kv.insert(wire(key), value.clone());
                    OwnedStoreReply::Set
                }
                StoreAction::Append { key, value } => {
                    kv.entry(wire(key)).or_default().extend_from_slice(value);
                    OwnedStoreReply::Set
                }
                StoreAction::CompareSet {
                    key,
                    expected,
                    desired,
                } => {
                    let current = kv.get(&wire(key)).cloned();
                    match current {
                        None if expected.is_empty() => {
                            kv.insert(wire(key), desired.clone());
                            OwnedStoreReply::Value(desired.clone())
                        }
                        None => OwnedStoreReply::Value(expected.clone()),
                        Some(v) if v == *expected => {
                            kv.insert(wire(key), desired.clone());
                            OwnedStoreReply::Value(desired.clone())
                        }
                        Some(v) => OwnedStoreReply::Value(v),
                    }
                }
                StoreAction::Get { key } => OwnedStoreReply::Value(kv.get(&wire(key))?.clone()),
                StoreAction::Wait { key, until } => {
                    if kv.contains_key(&wire(key)) {
                        OwnedStoreReply::Waited
                    } else if now >= *until {
                        OwnedStoreReply::TimedOut
                    } else {
                        return None;
                    }
                }
            })
        }

        /// Steps every live node until none can move, then moves time on to the next
        /// deadline; stops at `now + d`.
        fn run_for(&mut self, d: Duration) {
            let until = self.now.saturating_add(d);
            loop {
                let mut moved = false;
                for (node, pending, _) in self.nodes.iter_mut().filter(|n| n.2) {
                    loop {
                        if pending.is_none() {
                            *pending = node.poll_action(self.now);
                        }
                        let Some(action) = pending.as_ref() else {
                            break;
                        };
                        let Some(reply) = Self::apply(&mut self.kv, action, self.now) else {
                            break;
                        };
                        *pending = None;
                        node.handle_reply(reply.as_reply(), self.now);
                        while node.poll_event().is_some() {}
                        moved = true;
                    }
                }
                if moved {
                    continue;
                }
                let next = self
                    .nodes
                    .iter()
                    .filter(|n| n.2)
                    .filter_map(|n| n.0.poll_timeout())
                    .min();
                match next {
                    Some(t) if t <= until => self.now = t.max(self.now),
                    _ => {
                        self.now = until.max(self.now);
                        return;
                    }
                }
            }
        }

        fn look(&self, view: &mut ElasticView) -> RunView {
            let entries: Vec<(&[u8], &[u8])> = self
                .kv
                .iter()
                .map(|(k, v)| (k.as_bytes(), v.as_slice()))
                .collect();
            let mut runs = view.observe(&entries, self.now);
            assert_eq!(runs.len(), 1, "one run");
            runs.remove(0)
        }
    }

    fn names<'a>(nodes: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
        let mut v: Vec<&str> = nodes.into_iter().collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn a_round_waits_for_min_nodes_runs_its_last_call_and_completes() {
        let mut c = Cluster::new(3, 4);
        let mut view = ElasticView::new();
        c.join("a");
        c.join("b");
        c.run_for(Duration::from_millis(100));
        let run = c.look(&mut view);
        assert_eq!(
            (run.run_id.as_str(), run.round, run.state),
            ("job", 0, RunState::WaitingForMinNodes)
        );
        assert!(run.members.is_empty());
        assert_eq!(
            names(run.waiting.iter().map(|w| w.node.as_str())),
            ["a", "b"]
        );
        assert_eq!(run.waiting[0].host.as_deref(), Some("a.example"));
        c.join("c");
        c.run_for(Duration::from_millis(500));
        assert_eq!(c.look(&mut view).state, RunState::LastCall);
        c.run_for(Duration::from_secs(3));
        let run = c.look(&mut view);
        assert_eq!(run.state, RunState::Complete, "{run:?}");
        assert_eq!(run.world_size, Some(3));
        assert_eq!(
            names(run.members.iter().map(|m| m.arrival.node.as_str())),
            ["a", "b", "c"]
        );
        assert_eq!(
            run.members.iter().map(|m| m.rank).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        assert!(run.waiting.is_empty() && run.struck.is_empty() && run.over.is_none());
        // It was seen open, then closed: it formed after the last call's 2 s.
        let took = run.formed_in_ms.unwrap();
        assert!((2_000..=3_600).contains(&took), "{took}");
        assert!(run.formed_ago_ms.is_some());
        // The heartbeats moved between two looks a few intervals apart.
        c.run_for(Duration::from_millis(2_500));
        let run = c.look(&mut view);
        for m in &run.members {
            let age = m.arrival.beat_age_ms.unwrap_or_else(|| panic!("{m:?}"));
            assert!(age <= 1_000 && !m.arrival.beat_age_at_least, "{m:?}");
        }
    }

    #[test]
    fn a_killed_member_is_struck_with_the_reason_and_the_next_round_forms() {
        let mut c = Cluster::new(2, 3);
        let mut view = ElasticView::new();
        for name in ["a", "b", "c"] {
            c.join(name);
        }
        c.run_for(Duration::from_secs(2));
        assert_eq!(c.look(&mut view).state, RunState::Complete);
        c.nodes[1].2 = false; // b dies
        c.run_for(Duration::from_secs(2));
        let run = c.look(&mut view);
        let b = &run
            .members
            .iter()
            .find(|m| m.arrival.node == "b")
            .unwrap()
            .arrival;
        // Seen once alive, then not moving: at least the time between the looks.
        assert!(
            b.beat_age_ms.is_some_and(|age| age >= 2_000) && b.beat_age_at_least,
            "{b:?}"
        );
        let a = &run
            .members
            .iter()
            .find(|m| m.arrival.node == "a")
            .unwrap()
            .arrival;
        assert!(
            a.beat_age_ms.is_some_and(|age| age <= 1_000) && !a.beat_age_at_least,
            "{a:?}"
        );
        c.run_for(Duration::from_secs(10));
        let run = c.look(&mut view);
        assert_eq!(
            (run.round, run.state, run.world_size),
            (1, RunState::Complete, Some(2)),
            "{run:?}"
        );
        assert_eq!(
            names(run.members.iter().map(|m| m.arrival.node.as_str())),
            ["a", "c"]
        );
        assert_eq!(run.struck.len(), 1, "{:?}", run.struck);
        assert_eq!((run.struck[0].node.as_str(), run.struck[0].round), ("b", 0));
        assert!(
            run.struck[0].why.contains("had no heartbeat"),
            "{}",
            run.struck[0].why
        );
        assert_eq!(run.over.as_deref(), Some(run.struck[0].why.as_str()));
        // The run was looked at before round 1 closed: when it did is known.
        assert!(run.formed_ago_ms.is_some(), "{run:?}");
    }

    #[test]
    fn a_node_killed_in_an_open_round_is_struck_by_its_watcher() {
        let mut c = Cluster::new(3, 3);
        let mut view = ElasticView::new();
        c.join("a");
        c.join("b");
        c.run_for(Duration::from_millis(100));
        c.nodes[1].2 = false;
        c.run_for(Duration::from_secs(6));
        let run = c.look(&mut view);
        assert_eq!(run.state, RunState::WaitingForMinNodes);
        assert_eq!(names(run.waiting.iter().map(|w| w.node.as_str())), ["a"]);
        assert_eq!(run.struck.len(), 1, "{run:?}");
        assert_eq!(run.struck[0].node, "b");
        assert_eq!(run.struck[0].why, "no heartbeat; struck by 'a'");
    }

    #[test]
    fn a_shut_down_run_is_closed_and_a_late_node_waits() {
        let mut c = Cluster::new(1, 1);
        let mut view = ElasticView::new();
        c.join("a");
        c.run_for(Duration::from_millis(100));
        c.join("spare");
        c.run_for(Duration::from_millis(100));
        let run = c.look(&mut view);
        assert_eq!((run.state, run.world_size), (RunState::Complete, Some(1)));
        assert_eq!(
            run.waiting
                .iter()
                .map(|w| w.node.as_str())
                .collect::<Vec<_>>(),
            ["spare"]
        );
        // Seen only once it had formed: when is not known, and not guessed.
        assert_eq!((run.formed_ago_ms, run.formed_in_ms), (None, None));
        c.nodes[0].0.handle_local(LocalEvent::Shutdown);
        c.run_for(Duration::from_secs(1));
        let run = c.look(&mut view);
        assert_eq!(run.state, RunState::Closed, "{run:?}");
        assert!(run
            .over
            .is_some_and(|o| o.contains("shut down by node 'a'")));
    }

    #[test]
    fn foreign_and_malformed_keys_are_ignored() {
        let entries: Vec<(&[u8], &[u8])> = vec![
            (b"/torch.rendezvous.job.0/x", b"1"),
            (b"/rdzv.elastic.job/zz/roster", b"+0 - - a\n"),
            (b"/rdzv.elastic.job/0/roster", b"+x junk\n+1 - - b\n\xff\n"),
            (b"/rdzv.elastic.job/0/size", b"garbage"),
        ];
        let runs = ElasticView::new().observe(&entries, Instant::ZERO);
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].waiting.len(), 1);
        assert_eq!(runs[0].world_size, None);
        assert_eq!(runs[0].state, RunState::Confirming);
    }

    #[test]
    fn prefixes_count_keys_and_bytes_never_values() {
        let mut tally = PrefixTally::default();
        tally.add(b"/rdzv.elastic.job/round", 1);
        tally.add(b"/rdzv.elastic.job/0/roster", 40);
        tally.add(b"/torch.rendezvous.job.0/k", 3);
        tally.add(b"plain", 10);
        assert_eq!(tally.totals(), (4, 23 + 1 + 26 + 40 + 25 + 3 + 5 + 10));
        let top = tally.top(2);
        assert_eq!(top.len(), 2);
        assert_eq!(
            (top[0].prefix.as_str(), top[0].keys, top[0].bytes),
            ("/rdzv.elastic.job/", 2, 90)
        );
        assert_eq!(
            (top[1].prefix.as_str(), top[1].keys),
            ("/torch.rendezvous.job.0/", 1)
        );
    }
}
