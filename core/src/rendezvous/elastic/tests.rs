//! The elastic rendezvous under virtual time: several [`ElasticNode`]s driven against a
//! plain in-memory model of the store (a `BTreeMap`, PyTorch's semantics for `add`,
//! `compare_set` and `wait`), with nodes killed (never stepped again) and restarted.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::time::Duration;
use std::format;

use proptest::prelude::*;

use super::*;

/// The store model: what the TCPStore does, in a map; with `lease_ttl`, what etcd does
/// with heartbeat keys bound to their owner's lease (`KeyUse::Beat`, `BEAT_GONE`).
#[derive(Default)]
struct Model {
    kv: BTreeMap<String, Vec<u8>>,
    ops: u64,
    /// How many of each operation were applied, by name and the key's last part
    /// (`"add ready"`, `"compare_set size"`).
    by_op: BTreeMap<String, u64>,
    /// Heartbeat keys live while their owner beats at least once per this TTL.
    lease_ttl: Option<Duration>,
    /// Each live heartbeat key's last beat (the lease's last keep-alive).
    beats: BTreeMap<String, Instant>,
    /// Heartbeat keys whose lease expired: gone from `kv`.
    expired: BTreeSet<String>,
    /// What a watcher reads of a heartbeat key that is there: it moves on every read.
    reads: i64,
}

impl Model {
    /// A store whose heartbeat keys expire `ttl` after their owner's last beat.
    fn with_leases(ttl: Duration) -> Model {
        Model {
            lease_ttl: Some(ttl),
            ..Model::default()
        }
    }

    /// Drops the heartbeat keys whose lease expired by `now`.
    fn expire(&mut self, now: Instant) {
        let Some(ttl) = self.lease_ttl else {
            return;
        };
        let dead: Vec<String> = self
            .beats
            .iter()
            .filter(|(_, &at)| now.saturating_duration_since(at) >= ttl)
            .map(|(key, _)| key.clone())
            .collect();
        for key in dead {
            self.beats.remove(&key);
            self.kv.remove(&key);
            self.expired.insert(key);
        }
    }

    /// Whether `action` is an owner's beat on a key whose lease expired: etcd answers the
    /// keep-alive "lease not found", and the node fails with that error.
    fn lease_lost(&mut self, action: &StoreAction, now: Instant) -> bool {
        self.expire(now);
        matches!(action, StoreAction::Add { key, delta: 1 } if self.expired.contains(key))
    }

    /// A heartbeat `ADD` on a lease store: the owner's put or keep-alive, or the watcher's
    /// read (a value that moves while the key is there, `BEAT_GONE` once it is not).
    fn leased_beat(&mut self, key: &str, delta: i64, now: Instant) -> OwnedStoreReply {
        if delta == 0 {
            if !self.beats.contains_key(key) {
                return OwnedStoreReply::Added(BEAT_GONE);
            }
            self.reads += 1;
            return OwnedStoreReply::Added(self.reads);
        }
        self.beats.insert(key.to_string(), now);
        self.kv.insert(key.to_string(), b"1".to_vec());
        self.reads += 1;
        OwnedStoreReply::Added(self.reads)
    }

    /// The reply to `action` at `now`, or `None` while a wait must go on waiting.
    fn apply(&mut self, action: &StoreAction, now: Instant) -> Option<OwnedStoreReply> {
        self.expire(now);
        if let StoreAction::Pause { until } = action {
            // No store operation: the runtime answers it when `until` has come.
            return (now >= *until).then_some(OwnedStoreReply::TimedOut);
        }
        // The machine keeps to its own rule of how it uses each key (`key_use`), so that
        // a store may keep tallies and logs as one key per write.
        match (key_use(action.key()), action) {
            (KeyUse::Tally, StoreAction::Add { delta, .. }) => {
                assert!(*delta == 0 || TALLY_UNITS.contains(delta), "{action:?}");
            }
            (KeyUse::Beat, StoreAction::Add { delta, .. }) => {
                assert!(*delta == 0 || *delta == 1, "{action:?}");
            }
            (KeyUse::Log, StoreAction::Append { .. } | StoreAction::Get { .. })
            | (KeyUse::Value, _) => {}
            (_, other) => panic!("the machine broke its key-use rule: {other:?}"),
        }
        let reply = match action {
            StoreAction::Add { key, delta }
                if self.lease_ttl.is_some() && key_use(key) == KeyUse::Beat =>
            {
                self.leased_beat(key, *delta, now)
            }
            StoreAction::Check { key } => OwnedStoreReply::Checked(self.kv.contains_key(key)),
            StoreAction::Add { key, delta } => {
                let old = self
                    .kv
                    .get(key)
                    .map_or(0, |v| core::str::from_utf8(v).unwrap().parse().unwrap());
                let new: i64 = old + delta;
                self.kv.insert(key.clone(), new.to_string().into_bytes());
                OwnedStoreReply::Added(new)
            }
            StoreAction::Set { key, value } => {
                self.kv.insert(key.clone(), value.clone());
                OwnedStoreReply::Set
            }
            StoreAction::Append { key, value } => {
                self.kv
                    .entry(key.clone())
                    .or_default()
                    .extend_from_slice(value);
                OwnedStoreReply::Set
            }
            StoreAction::CompareSet {
                key,
                expected,
                desired,
            } => match self.kv.get(key) {
                None if expected.is_empty() => {
                    self.kv.insert(key.clone(), desired.clone());
                    OwnedStoreReply::Value(desired.clone())
                }
                None => OwnedStoreReply::Value(expected.clone()),
                Some(v) if v == expected => {
                    self.kv.insert(key.clone(), desired.clone());
                    OwnedStoreReply::Value(desired.clone())
                }
                Some(v) => OwnedStoreReply::Value(v.clone()),
            },
            StoreAction::Get { key } => OwnedStoreReply::Value(self.kv.get(key)?.clone()),
            StoreAction::Wait { key, until } => {
                if self.kv.contains_key(key) {
                    OwnedStoreReply::Waited
                } else if now >= *until {
                    OwnedStoreReply::TimedOut
                } else {
                    return None;
                }
            }
            StoreAction::Pause { .. } => unreachable!("answered above"),
        };
        self.ops += 1;
        let key = action.key();
        let last = match key.rsplit_once('/') {
            // A slot's heartbeat or gone key: `hb`, `gone`.
            Some((parent, last)) if last.bytes().all(|b| b.is_ascii_digit()) => {
                parent.rsplit('/').next().unwrap_or(last)
            }
            Some((_, last)) => last,
            None => key,
        };
        *self
            .by_op
            .entry(format!("{} {last}", action.name()))
            .or_default() += 1;
        Some(reply)
    }
}

struct SimNode {
    machine: ElasticNode,
    pending: Option<StoreAction>,
    alive: bool,
    events: Vec<Event>,
    ops: u64,
    /// When it was killed, or left, failed or shut down.
    gone_at: Option<Instant>,
    /// When it learnt that a round was over.
    overs: Vec<(u64, Instant)>,
    /// The contacts it has offered, when it offers a fresh one at every arrival (as
    /// torchrun's driver offers a free port): `{name}:{n}` for the n-th.
    fresh_contacts: Option<u32>,
}

/// A round as it closed: the winning write of its size.
#[derive(Debug, Clone)]
struct Closed {
    round: u64,
    /// The member nodes (indices), by rank.
    members: Vec<usize>,
    at: Instant,
}

struct Sim {
    now: Instant,
    store: Model,
    nodes: Vec<SimNode>,
    settings: ElasticSettings,
    closed: Vec<Closed>,
    /// Nodes failed by an expired lease (lease stores only).
    lease_lost: Vec<usize>,
}

fn settings(min: u32, max: u32) -> ElasticSettings {
    let mut s = ElasticSettings::new("job", NodeRange::new(min, max).unwrap());
    s.join_timeout = Duration::from_secs(60);
    s.last_call = Duration::from_secs(2);
    s.keep_alive_interval = Duration::from_secs(1);
    s.keep_alive_max_attempts = 3;
    s
}

impl Sim {
    fn new(settings: ElasticSettings) -> Self {
        Sim {
            now: Instant::ZERO,
            store: Model::default(),
            nodes: Vec::new(),
            settings,
            closed: Vec::new(),
            lease_lost: Vec::new(),
        }
    }

    /// A simulation over a lease store whose heartbeat keys live for the keep-alive
    /// timeout after their owner's last beat (etcd's TTL, as `MachineStore` asks for).
    fn with_leases(settings: ElasticSettings) -> Self {
        let mut sim = Sim::new(settings);
        sim.store = Model::with_leases(sim.settings.keep_alive_timeout());
        sim
    }

    /// Adds a node that joins now; returns its index.
    fn join(&mut self, name: &str) -> usize {
        let mut machine = ElasticNode::new(self.settings.clone(), name);
        machine.handle_local(LocalEvent::Join);
        self.nodes.push(SimNode {
            machine,
            pending: None,
            alive: true,
            events: Vec::new(),
            ops: 0,
            gone_at: None,
            overs: Vec::new(),
            fresh_contacts: None,
        });
        self.nodes.len() - 1
    }

    /// Steps node `i` once if it can move; returns whether it did.
    fn step(&mut self, i: usize) -> bool {
        let now = self.now;
        let node = &mut self.nodes[i];
        if !node.alive {
            return false;
        }
        if node.pending.is_none() {
            if let Some(n) = node
                .fresh_contacts
                .as_mut()
                .filter(|_| node.machine.wants_contact())
            {
                *n += 1;
                let contact = format!("{}:{n}", node.machine.node());
                node.machine.set_contact(&contact);
            }
            node.pending = node.machine.poll_action(now);
        }
        let Some(action) = node.pending.as_ref() else {
            return false;
        };
        let first_size = match action {
            StoreAction::CompareSet { key, desired, .. }
                if key.ends_with("/size") && !self.store.kv.contains_key(key) =>
            {
                Some((key.clone(), desired.clone()))
            }
            _ => None,
        };
        if self.store.lease_lost(action, now) {
            // The driver fails the node with the store's error (RendezvousConnectionError).
            node.alive = false;
            node.gone_at.get_or_insert(now);
            self.lease_lost.push(i);
            return false;
        }
        let Some(reply) = self.store.apply(action, now) else {
            return false;
        };
        let request = !matches!(action, StoreAction::Pause { .. });
        node.pending = None;
        node.ops += u64::from(request);
        node.machine.handle_reply(reply.as_reply(), now);
        while let Some(event) = node.machine.poll_event() {
            if matches!(event, Event::Left | Event::ShutDown | Event::Failed(_)) {
                node.gone_at.get_or_insert(now);
            }
            if let Event::RoundOver { round, .. } = event {
                node.overs.push((round, now));
            }
            node.events.push(event);
        }
        if let Some((key, size)) = first_size {
            self.record_close(&key, &size);
        }
        true
    }

    /// Records the round whose size `key` was just written first with `size`.
    fn record_close(&mut self, key: &str, size: &[u8]) {
        let round_key = key.trim_end_matches("/size");
        let round: u64 = round_key.rsplit('/').next().unwrap().parse().unwrap();
        let size = core::str::from_utf8(size).unwrap();
        let Some((_, slots)) = size.split_once(';') else {
            return; // shut down
        };
        // Rank 0's contact, if any, follows the slots.
        let slots = slots.split(';').next().unwrap_or_default();
        let roster = core::str::from_utf8(&self.store.kv[&format!("{round_key}/roster")])
            .unwrap()
            .to_string();
        let node_at = |slot: &str| -> usize {
            let name = roster
                .lines()
                .find_map(|l| {
                    let mut parts = l.strip_prefix('+')?.splitn(4, ' ');
                    (parts.next()? == slot).then(|| parts.nth(2).unwrap().to_string())
                })
                .unwrap();
            // Names are unique among live nodes; a restarted name is the newest node.
            (0..self.nodes.len())
                .rev()
                .find(|&i| self.nodes[i].machine.node() == name)
                .unwrap()
        };
        let members = slots.split(',').map(node_at).collect();
        self.closed.push(Closed {
            round,
            members,
            at: self.now,
        });
    }

    /// Steps every node round-robin until none can move, then advances time to the
    /// earliest wait deadline; stops at `until`.
    fn run_until(&mut self, until: Instant) {
        loop {
            let mut moved = false;
            for i in 0..self.nodes.len() {
                // Bounded per pass, so that no node starves the others.
                for _ in 0..4 {
                    if !self.step(i) {
                        break;
                    }
                    moved = true;
                }
            }
            if moved {
                continue;
            }
            match self.next_deadline() {
                Some(t) if t <= until => self.now = t.max(self.now),
                _ => {
                    self.now = until.max(self.now);
                    return;
                }
            }
        }
    }

    fn run_for(&mut self, d: Duration) {
        self.run_until(self.now.saturating_add(d));
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.nodes
            .iter()
            .filter(|n| n.alive)
            .filter_map(|n| n.machine.poll_timeout())
            .min()
    }

    fn completes(&self, i: usize) -> Vec<RoundOutcome> {
        self.nodes[i]
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Complete(o) => Some(o.clone()),
                _ => None,
            })
            .collect()
    }

    fn last_complete(&self, i: usize) -> Option<RoundOutcome> {
        self.completes(i).pop()
    }

    fn kill(&mut self, i: usize) {
        self.nodes[i].alive = false;
        let now = self.now;
        self.nodes[i].gone_at.get_or_insert(now);
    }

    /// Every member of a complete round was alive when it closed (members acknowledge a
    /// round after it closes, and it is complete only once all have), and every member
    /// that stayed (did not die, leave or fail) was told, unless the round was ended (a
    /// member that gave up waiting for the last acknowledgement ends it for all).
    fn check_members_alive(&self) {
        for c in &self.closed {
            let told: Vec<usize> = c
                .members
                .iter()
                .copied()
                .filter(|&m| self.completes(m).iter().any(|o| o.round == c.round))
                .collect();
            if told.is_empty() {
                continue;
            }
            for &m in &c.members {
                if let Some(gone) = self.nodes[m].gone_at {
                    assert!(
                        gone >= c.at,
                        "round {} closed at {:?} counting node {m}, gone since {gone:?}",
                        c.round,
                        c.at
                    );
                }
                let over = self
                    .store
                    .kv
                    .contains_key(&format!("rdzv.elastic.job/{}/over", c.round));
                assert!(
                    told.contains(&m) || self.nodes[m].gone_at.is_some() || over,
                    "round {} is complete for {told:?} but not for member {m}: {:?}",
                    c.round,
                    self.nodes[m].events,
                );
            }
        }
    }

    /// Ranks are stable: a node that held rank `p` in its last round keeps it in its next
    /// one when `p` is below the new world size and no member of the new round held `p`
    /// in a later round.
    fn check_stable_ranks(&self) {
        let completes: Vec<Vec<RoundOutcome>> =
            (0..self.nodes.len()).map(|i| self.completes(i)).collect();
        let prev_of = |i: usize, round: u64| -> Option<RoundOutcome> {
            completes[i].iter().rev().find(|o| o.round < round).cloned()
        };
        for (i, outcomes) in completes.iter().enumerate() {
            for pair in outcomes.windows(2) {
                let (a, b) = (&pair[0], &pair[1]);
                if a.rank >= b.world_size {
                    continue;
                }
                let Some(closed) = self.closed.iter().find(|c| c.round == b.round) else {
                    continue;
                };
                let beaten = closed.members.iter().any(|&j| {
                    j != i
                        && prev_of(j, b.round)
                            .is_some_and(|p| p.rank == a.rank && p.round > a.round)
                });
                assert!(
                    beaten || b.rank == a.rank,
                    "node {i} moved from rank {} (round {}) to {} (round {}) in {:?}",
                    a.rank,
                    a.round,
                    b.rank,
                    b.round,
                    closed.members
                );
            }
        }
    }

    /// Every round's outcomes agree: one world size, distinct ranks below it.
    fn check_agreement(&self) {
        let mut rounds: BTreeMap<u64, (u32, Vec<u32>)> = BTreeMap::new();
        for node in &self.nodes {
            for event in &node.events {
                if let Event::Complete(o) = event {
                    let entry = rounds.entry(o.round).or_insert((o.world_size, Vec::new()));
                    assert_eq!(
                        entry.0, o.world_size,
                        "round {} world sizes differ",
                        o.round
                    );
                    assert!(o.rank < o.world_size, "{o:?}");
                    assert!(
                        !entry.1.contains(&o.rank),
                        "round {} rank {} twice",
                        o.round,
                        o.rank
                    );
                    assert_eq!(o.store_prefix, format!("torch.rendezvous.job.{}", o.round));
                    entry.1.push(o.rank);
                }
            }
        }
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn fills_to_max_and_closes_at_once() {
    let mut sim = Sim::new(settings(1, 2));
    let a = sim.join("a");
    let b = sim.join("b");
    sim.run_until(Instant::ZERO);
    assert_eq!(
        sim.now,
        Instant::ZERO,
        "no time passes: slot max closes the round"
    );
    let (oa, ob) = (sim.last_complete(a).unwrap(), sim.last_complete(b).unwrap());
    assert_eq!((oa.round, oa.world_size, ob.world_size), (0, 2, 2));
    assert_eq!(oa.rank + ob.rank, 1);
    assert_eq!(oa.store_prefix, "torch.rendezvous.job.0");
    // A third node is a hot spare of a full round and waits, without a timeout.
    let c = sim.join("c");
    sim.run_for(secs(600));
    assert_eq!(
        sim.nodes[c].events,
        [Event::Waiting {
            round: 0,
            hot_spare: true
        }]
    );
    assert_eq!(
        sim.completes(a).len(),
        1,
        "a spare does not disturb the round"
    );
    assert!(sim.store.kv["rdzv.elastic.job/0/roster"].ends_with(b"+3 - - c\n"));
    sim.check_agreement();
}

#[test]
fn last_call_after_min_nodes() {
    let mut sim = Sim::new(settings(2, 4));
    let a = sim.join("a");
    sim.run_for(secs(30));
    assert!(sim.nodes[a].events.is_empty(), "below min_nodes: open");
    let b = sim.join("b");
    sim.run_for(Duration::from_millis(1500));
    assert!(sim.completes(a).is_empty(), "within the last call: open");
    let c = sim.join("c");
    sim.run_for(Duration::from_millis(1000));
    for i in [a, b, c] {
        assert_eq!(sim.last_complete(i).unwrap().world_size, 3, "node {i}");
    }
    // Ranks are in arrival order.
    assert_eq!(sim.last_complete(c).unwrap().rank, 2);
    sim.check_agreement();
}

#[test]
fn an_open_round_shows_its_nodes_and_when_its_last_call_ends() {
    let mut sim = Sim::new(settings(2, 4));
    let a = sim.join("a");
    sim.run_for(secs(3));
    let below_min = sim.nodes[a].machine.open_round().expect("waits in round 0");
    assert_eq!(
        (
            below_min.round,
            below_min.live,
            below_min.min,
            below_min.max
        ),
        (0, 1, 2, 4)
    );
    assert_eq!(
        below_min.last_call_ends, None,
        "no last call below min_nodes"
    );
    let b = sim.join("b");
    sim.run_for(Duration::from_millis(500));
    let joined_at = sim.now;
    for i in [a, b] {
        let open = sim.nodes[i].machine.open_round().expect("in the last call");
        // `a` knows of `b` after its next tick reads the arrivals: within one interval.
        assert!(open.live == 2 || i == a, "node {i}: {open:?}");
        let ends = open
            .last_call_ends
            .expect("min_nodes are there: a last call");
        let left = ends.saturating_duration_since(joined_at);
        assert!(left <= sim.settings.last_call, "node {i}: {left:?}");
        assert!(left >= Duration::from_millis(1000), "node {i}: {left:?}");
    }
    sim.run_for(secs(3));
    assert_eq!(
        sim.nodes[a].machine.open_round(),
        None,
        "complete: no open round"
    );
    assert_eq!(sim.last_complete(a).unwrap().world_size, 2);
}

#[test]
fn wait_list_starts_the_next_round() {
    let mut sim = Sim::new(settings(1, 4));
    let a = sim.join("a");
    let b = sim.join("b");
    sim.run_for(secs(3));
    assert_eq!(sim.last_complete(a).unwrap().world_size, 2);
    let c = sim.join("c");
    sim.run_for(secs(3));
    assert_eq!(
        sim.nodes[c].events[0],
        Event::Waiting {
            round: 0,
            hot_spare: false
        }
    );
    for i in [a, b] {
        assert!(matches!(
            &sim.nodes[i].events[1],
            Event::RoundOver { round: 0, reason } if reason.contains("'c' is waiting")
        ));
    }
    for i in [a, b, c] {
        let o = sim.last_complete(i).unwrap();
        assert_eq!((o.round, o.world_size), (1, 3), "node {i}");
    }
    // A node joining now reads the round hint and lands in round 1's wait list.
    assert_eq!(sim.store.kv["rdzv.elastic.job/round"], b"1");
    sim.check_agreement();
}

#[test]
fn dead_member_ends_the_round_within_the_keep_alive_timeout() {
    let mut sim = Sim::new(settings(2, 8));
    let nodes: Vec<usize> = (0..5).map(|i| sim.join(&format!("n{i}"))).collect();
    sim.run_for(secs(3));
    assert!(nodes
        .iter()
        .all(|&i| sim.last_complete(i).unwrap().world_size == 5));
    let killed_at = sim.now;
    sim.kill(nodes[2]);
    sim.run_for(secs(10));
    let survivors = [0, 1, 3, 4].map(|k| nodes[k]);
    for &i in &survivors {
        let o = sim.last_complete(i).unwrap();
        assert_eq!((o.round, o.world_size), (1, 4), "node {i}");
    }
    // Detected within keep-alive timeout (3 s) + one interval, plus the last call (2 s).
    let reasons: Vec<&String> = survivors
        .iter()
        .flat_map(|&i| &sim.nodes[i].events)
        .filter_map(|e| match e {
            Event::RoundOver { reason, .. } => Some(reason),
            _ => None,
        })
        .collect();
    assert_eq!(reasons.len(), 4);
    assert!(
        reasons[0].contains("rank 2 had no heartbeat for 3s"),
        "{}",
        reasons[0]
    );
    let formed = sim.store.kv.contains_key("rdzv.elastic.job/1/size");
    assert!(formed && sim.now.saturating_duration_since(killed_at) <= secs(10));
    sim.check_agreement();
}

#[test]
fn dead_member_detected_in_bounded_time() {
    // Measure precisely: step in small time slices until round 1 forms.
    let mut sim = Sim::new(settings(2, 3));
    let nodes: Vec<usize> = (0..3).map(|i| sim.join(&format!("n{i}"))).collect();
    sim.run_for(Duration::ZERO);
    assert!(nodes.iter().all(|&i| sim.last_complete(i).is_some()));
    let killed_at = sim.now;
    sim.kill(nodes[0]);
    while sim.last_complete(nodes[1]).unwrap().round == 0 {
        sim.run_for(Duration::from_millis(100));
        assert!(sim.now.saturating_duration_since(killed_at) < secs(20));
    }
    let took = sim.now.saturating_duration_since(killed_at);
    // keep-alive timeout 3 s, at most one interval late, then a 2 s last call.
    assert!(
        took <= secs(3 + 1 + 2) + Duration::from_millis(200),
        "{took:?}"
    );
    assert!(took >= secs(3), "{took:?}");
}

#[test]
fn flapping_rank_converges() {
    let mut sim = Sim::new(settings(2, 4));
    let a = sim.join("a");
    let b = sim.join("b");
    let mut flapper = sim.join("f");
    sim.run_for(secs(3));
    for cycle in 0..4 {
        sim.kill(flapper);
        sim.run_for(Duration::from_millis(500 + 700 * cycle));
        flapper = sim.join("f");
        sim.run_for(secs(12));
        let round = sim.last_complete(a).unwrap().round;
        for i in [a, b, flapper] {
            let o = sim.last_complete(i).unwrap();
            assert_eq!(
                (o.round, o.world_size),
                (round, 3),
                "cycle {cycle} node {i}"
            );
        }
    }
    sim.check_agreement();
}

#[test]
fn worker_failure_and_leave_end_the_round() {
    let mut sim = Sim::new(settings(1, 4));
    let nodes: Vec<usize> = (0..3).map(|i| sim.join(&format!("n{i}"))).collect();
    sim.run_for(secs(3));
    sim.nodes[nodes[1]]
        .machine
        .handle_local(LocalEvent::WorkerFailed);
    sim.run_for(secs(1));
    for &i in &nodes {
        assert!(sim.nodes[i].events.iter().any(|e| matches!(
            e,
            Event::RoundOver { round: 0, reason } if reason.contains("workers of node 'n1' failed")
        )));
    }
    sim.run_for(secs(3));
    assert!(nodes
        .iter()
        .all(|&i| sim.last_complete(i).unwrap().round == 1));
    sim.nodes[nodes[0]].machine.handle_local(LocalEvent::Leave);
    sim.run_for(secs(5));
    assert_eq!(sim.nodes[nodes[0]].events.last(), Some(&Event::Left));
    assert!(sim.nodes[nodes[0]].machine.is_done());
    for &i in &nodes[1..] {
        let o = sim.last_complete(i).unwrap();
        assert_eq!((o.round, o.world_size), (2, 2));
    }
    sim.check_agreement();
}

#[test]
fn shutdown_closes_for_good() {
    let mut sim = Sim::new(settings(2, 4));
    let a = sim.join("a");
    let b = sim.join("b");
    sim.run_for(secs(3));
    sim.nodes[a].machine.handle_local(LocalEvent::Shutdown);
    sim.run_for(secs(1));
    assert_eq!(sim.nodes[a].events.last(), Some(&Event::ShutDown));
    // b sees a's heartbeat stop, rejoins, and finds the rendezvous closed.
    sim.run_for(secs(10));
    let closed = ElasticError::Closed {
        run_id: "job".into(),
    };
    assert_eq!(
        sim.nodes[b].events.last(),
        Some(&Event::Failed(closed.clone()))
    );
    assert!(closed.to_string().starts_with("RendezvousClosedError: "));
    let c = sim.join("c");
    sim.run_for(secs(1));
    assert_eq!(sim.nodes[c].events, [Event::Failed(closed.clone())]);
    assert_eq!(
        sim.nodes[c].ops, 2,
        "its guessed arrival in round 0 (marked closed), then the round hint"
    );

    // A node waiting in an open round is woken, not left to time out.
    let mut sim = Sim::new(settings(3, 4));
    let a = sim.join("a");
    let b = sim.join("b");
    sim.run_for(secs(5));
    sim.nodes[a].machine.handle_local(LocalEvent::Shutdown);
    sim.run_for(secs(2));
    assert_eq!(sim.nodes[b].events.last(), Some(&Event::Failed(closed)));
}

#[test]
fn join_timeout_is_rendezvous_timeout_error() {
    let mut sim = Sim::new(settings(3, 3));
    let a = sim.join("a");
    sim.join("b");
    sim.run_for(secs(59));
    assert!(sim.nodes[a].events.is_empty());
    sim.run_for(secs(2));
    let Some(Event::Failed(error)) = sim.nodes[a].events.last() else {
        panic!("{:?}", sim.nodes[a].events);
    };
    assert_eq!(
        error.to_string(),
        "RendezvousTimeoutError: node 'a' did not become a member of a complete round of \
         rendezvous 'job' within the join timeout (60s); fewer than min_nodes nodes may have \
         joined"
    );
    // The timed-out nodes left the open round: a node that comes now is not counted
    // with them (PyTorch would tell it world_size 3 with two departed nodes).
    assert_eq!(
        sim.store.kv["rdzv.elastic.job/0/roster"],
        b"+1 - - a\n+2 - - b\n-1\n-2\n"
    );
    assert!(!sim.store.kv.contains_key("rdzv.elastic.job/0/over"));
}

#[test]
fn a_node_that_timed_out_alone_is_not_counted() {
    let mut s = settings(1, 2);
    s.last_call = secs(5);
    let mut sim = Sim::new(s.clone());
    // Alone in a round of 2..2: it times out.
    let mut lone = s.clone();
    lone.nodes = NodeRange::new(2, 2).unwrap();
    lone.join_timeout = secs(3);
    sim.settings = lone;
    let a = sim.join("a");
    sim.run_for(secs(5));
    assert!(matches!(
        sim.nodes[a].events[..],
        [Event::Failed(ElasticError::Timeout { .. })]
    ));
    // The next node arrives: it is alone, so the round waits for a second one.
    sim.settings.join_timeout = secs(60);
    let b = sim.join("b");
    sim.run_for(secs(10));
    assert!(sim.nodes[b].events.is_empty(), "{:?}", sim.nodes[b].events);
    let c = sim.join("c");
    sim.run_for(secs(1));
    for i in [b, c] {
        let o = sim.last_complete(i).unwrap();
        assert_eq!((o.round, o.world_size), (0, 2), "node {i}");
    }
    sim.check_agreement();
}

#[test]
fn a_node_killed_in_an_open_round_is_not_counted() {
    // 2..4 nodes; a arrives, b arrives and is killed (SIGKILL) while the last call runs
    // and before it ends... with a last call longer than the keep-alive timeout, the
    // watcher finds b dead and the round closes with a alone? No: min_nodes is 2, so it
    // waits for c, and closes with a and c only.
    let mut s = settings(2, 4);
    s.last_call = secs(10);
    let mut sim = Sim::new(s);
    let a = sim.join("a");
    let b = sim.join("b");
    sim.run_for(secs(1));
    sim.kill(b);
    sim.run_for(secs(15));
    assert!(sim.completes(a).is_empty(), "{:?}", sim.nodes[a].events);
    let c = sim.join("c");
    sim.run_for(secs(12));
    for i in [a, c] {
        let o = sim.last_complete(i).unwrap();
        assert_eq!((o.round, o.world_size), (0, 2), "node {i}");
    }
    assert!(sim.store.kv["rdzv.elastic.job/0/roster"]
        .windows(3)
        .any(|w| w == b"-2\n"));
    sim.check_agreement();
}

#[test]
fn store_work_per_node_is_constant() {
    for n in [4u32, 64, 512] {
        let mut sim = Sim::new(settings(n, n));
        for i in 0..n {
            sim.join(&format!("n{i}"));
        }
        sim.run_for(Duration::ZERO);
        assert!((0..n as usize).all(|i| sim.last_complete(i).is_some()));
        // ADD arrival (a fresh node guesses round 0), APPEND roster, WAIT size, GET size,
        // ADD ready, WAIT go: 6, then a WAIT on the round's end that is still pending. The
        // closer's roster GET and compare-set take the place of the WAIT and the GET of
        // the size, and its compare-set is its acknowledgement (5); the last
        // acknowledger's SET of go takes the place of its WAIT: 6 for every other node
        // (`store_work_at_16_nodes_by_operation` has them by operation).
        assert_closer_5_others_6(&sim, n);
        let before: Vec<u64> = sim.nodes.iter().map(|node| node.ops).collect();
        sim.run_for(secs(10));
        for (node, before) in sim.nodes.iter().zip(before) {
            // 10 intervals: per interval two ADDs and one WAIT.
            assert!(node.ops - before <= 3 * 11, "n={n}: {}", node.ops - before);
        }
    }
}

#[test]
fn rank_zeros_contact_comes_with_the_world() {
    let mut sim = Sim::new(settings(3, 3));
    let nodes: Vec<usize> = (0..3).map(|i| sim.join(&format!("n{i}"))).collect();
    for &i in &nodes {
        let contact = format!("host{i}:2950{i}");
        sim.nodes[i].machine.set_contact(&contact);
    }
    sim.run_for(Duration::ZERO);
    let outcomes: Vec<RoundOutcome> = nodes
        .iter()
        .map(|&i| sim.last_complete(i).unwrap())
        .collect();
    let rank0 = nodes[outcomes.iter().position(|o| o.rank == 0).unwrap()];
    let want = format!("host{rank0}:2950{rank0}");
    for o in &outcomes {
        assert_eq!(o.master.as_deref(), Some(want.as_str()), "{o:?}");
    }
    // A contact cannot break the roster's or the world's format.
    let mut node = ElasticNode::new(settings(1, 1), "x");
    node.set_contact("a b,c;d\ne");
    node.handle_local(LocalEvent::Join);
    let _ = node.poll_action(Instant::ZERO);
    node.handle_reply(StoreReply::Added(1), Instant::ZERO);
    let Some(StoreAction::Append { value, .. }) = node.poll_action(Instant::ZERO) else {
        panic!("the roster line comes second");
    };
    assert_eq!(value, b"+1 - a?b?c?d?e x\n");
    // No contact: no master.
    let mut sim = Sim::new(settings(2, 2));
    let a = sim.join("a");
    sim.join("b");
    sim.run_for(Duration::ZERO);
    assert_eq!(sim.last_complete(a).unwrap().master, None);
}

#[test]
fn a_rejoining_rank_0_offers_a_fresh_contact() {
    // torchrun's MASTER_PORT: c10d picks a free port for every round, so rank 0 must not
    // offer the port its workers of the round before held. A node rejoins on its own as
    // soon as it sees its round end, so the machine asks for a fresh contact then.
    let mut sim = Sim::new(settings(2, 2));
    let a = sim.join("a");
    let b = sim.join("b");
    for i in [a, b] {
        sim.nodes[i].fresh_contacts = Some(1);
        let contact = format!("{}:1", sim.nodes[i].machine.node());
        sim.nodes[i].machine.set_contact(&contact);
        assert!(!sim.nodes[i].machine.wants_contact());
    }
    sim.run_for(secs(1));
    let first = sim.last_complete(a).unwrap();
    assert_eq!((first.round, first.rank), (0, 0));
    assert_eq!(first.master.as_deref(), Some("a:1"));
    // b's workers fail: b ends round 0, and both rejoin round 1 at once.
    sim.nodes[b].machine.handle_local(LocalEvent::WorkerFailed);
    sim.run_for(secs(3));
    for i in [a, b] {
        let o = sim.last_complete(i).unwrap();
        assert_eq!(o.round, 1, "node {i}");
        assert_eq!(o.master.as_deref(), Some("a:2"), "node {i}: {o:?}");
    }
    assert_eq!(sim.last_complete(a).unwrap().rank, 0);
    // A node that does not refresh its contact keeps offering the one it has.
    let mut sim = Sim::new(settings(2, 2));
    let a = sim.join("a");
    let b = sim.join("b");
    sim.nodes[a].machine.set_contact("a:1");
    sim.run_for(secs(1));
    sim.nodes[b].machine.handle_local(LocalEvent::WorkerFailed);
    sim.run_for(secs(3));
    let o = sim.last_complete(b).unwrap();
    assert_eq!((o.round, o.master.as_deref()), (1, Some("a:1")));
    sim.check_agreement();
}

#[test]
fn a_fresh_node_guesses_round_zero_and_finds_the_current_round() {
    let mut sim = Sim::new(settings(1, 4));
    let a = sim.join("a");
    sim.run_for(secs(3));
    assert_eq!(sim.last_complete(a).unwrap().round, 0);
    // Round 0 is closed and marked: b's guess costs one ADD, then it reads the hint (0)
    // and keeps its slot: a late arrival, which asks for the next round.
    let b = sim.join("b");
    sim.run_for(secs(5));
    assert_eq!(sim.last_complete(b).unwrap().round, 1);
    assert_eq!(sim.last_complete(a).unwrap().round, 1);
    let roster = sim.store.kv["rdzv.elastic.job/0/roster"].clone();
    assert_eq!(
        roster, b"+1 - - a\n+2 - - b\n",
        "b took one slot in round 0"
    );
    // Now the hint says 1: c's guess in round 0 is marked, so it reads the hint and
    // arrives in round 1 (ending it: it has room), without a line in round 0's roster.
    let c = sim.join("c");
    sim.run_for(secs(5));
    assert_eq!(sim.last_complete(c).unwrap().round, 2);
    assert_eq!(sim.store.kv["rdzv.elastic.job/0/roster"], roster);
    assert!(sim.nodes[c].events.contains(&Event::Waiting {
        round: 1,
        hot_spare: false
    }));
    sim.check_agreement();
    sim.check_stable_ranks();
}

#[test]
fn misdriven_replies_fail_with_a_message() {
    let mut node = ElasticNode::new(settings(1, 1), "a");
    node.handle_local(LocalEvent::Join);
    let action = node.poll_action(Instant::ZERO).unwrap();
    assert_eq!(action.name(), "add");
    assert_eq!(action.key(), "rdzv.elastic.job/0/arrivals");
    assert_eq!(node.poll_action(Instant::ZERO), None, "one at a time");
    node.handle_reply(StoreReply::Checked(true), Instant::ZERO);
    let Some(Event::Failed(error)) = node.poll_event() else {
        panic!("misdriven")
    };
    assert_eq!(
        error.to_string(),
        "RendezvousStateError: elastic rendezvous misdriven: the pending action is 'add' but \
         the reply given is 'checked'"
    );
    assert!(node.is_done() && node.poll_action(Instant::ZERO).is_none());

    // A foreign value in the size key.
    let mut sim = Sim::new(settings(1, 2));
    sim.store
        .kv
        .insert("rdzv.elastic.job/0/size".into(), b"lots".to_vec());
    let a = sim.join("a");
    sim.run_for(secs(1));
    assert!(matches!(
        &sim.nodes[a].events[..],
        [Event::Failed(ElasticError::BadValue { key, .. })] if key == "rdzv.elastic.job/0/size"
    ));
}

#[test]
fn node_ranges_and_urls() {
    assert_eq!(NodeRange::parse("1:4"), Ok(NodeRange { min: 1, max: 4 }));
    assert_eq!(NodeRange::parse("3"), Ok(NodeRange { min: 3, max: 3 }));
    for (text, message) in [
        ("1:", "nnodes=1: is not in \"MIN:MAX\" format"),
        ("a:2", "nnodes=a:2 is not in \"MIN:MAX\" format"),
        ("1:2:3", "nnodes=1:2:3 is not in \"MIN:MAX\" format"),
        (
            "0:2",
            "The minimum number of rendezvous nodes (0) must be greater than zero.",
        ),
        (
            "4:2",
            "The maximum number of rendezvous nodes (2) must be greater than or equal to the \
             minimum number of rendezvous nodes (4).",
        ),
    ] {
        assert_eq!(NodeRange::parse(text).unwrap_err().to_string(), message);
    }
    let url = ElasticUrl::parse(
        "elastic://Host:1234/job7?nodes=2:8&last_call=5s&join_timeout=2m&keep_alive_interval=\
         500ms&keep_alive_max_attempts=4&node_id=n1&rank=0",
    )
    .unwrap();
    assert_eq!((url.host.as_str(), url.port), ("host", 1234));
    assert_eq!(url.node_id.as_deref(), Some("n1"));
    let s = &url.settings;
    assert_eq!(s.run_id, "job7");
    assert_eq!(s.nodes, NodeRange { min: 2, max: 8 });
    assert_eq!(
        (s.last_call, s.join_timeout, s.keep_alive_interval),
        (secs(5), secs(120), Duration::from_millis(500))
    );
    assert_eq!(s.keep_alive_timeout(), secs(2));
    // torchrun's --rdzv-conf names, with its float seconds and booleans.
    let url = ElasticUrl::parse(
        "elastic://h/j?last_call_timeout=1.5&keep_alive_max_attempt=5&close_timeout=0.25s\
         &read_timeout=90&is_host=TRUE&join_timeout=.5",
    )
    .unwrap();
    let s = &url.settings;
    assert_eq!(s.last_call, Duration::from_millis(1500));
    assert_eq!(s.keep_alive_max_attempts, 5);
    assert_eq!(s.close_timeout, Duration::from_millis(250));
    assert_eq!(s.join_timeout, Duration::from_millis(500));
    assert_eq!((url.read_timeout, url.is_host), (secs(90), Some(true)));
    assert_eq!(s.closed_key(), "rdzv.elastic.j/closed");
    assert_eq!(s.live_count_key(3), "rdzv.elastic.j/3/arrivals");
    let mut url = ElasticUrl::parse("elastic://h/j?last_call=7").unwrap();
    assert_eq!(
        (url.read_timeout, url.is_host),
        (DEFAULT_READ_TIMEOUT, None)
    );
    assert_eq!(url.settings.close_timeout, DEFAULT_CLOSE_TIMEOUT);
    url.set("is_host", "n").unwrap();
    url.set("nodes", "2:3").unwrap();
    assert_eq!(url.is_host, Some(false));
    assert_eq!(url.settings.nodes, NodeRange { min: 2, max: 3 });
    for (key, value) in [
        ("is_host", "maybe"),
        ("read_timeout", "1.5m"),
        ("join_timeout", "."),
        ("close_timeout", "1.x"),
    ] {
        assert_eq!(
            url.set(key, value),
            Err(SettingsError::BadValue { key, value }),
            "{key}={value}"
        );
    }
    let url = ElasticUrl::parse("elastic://h/j?last_call=7").unwrap();
    assert_eq!(url.port, DEFAULT_PORT);
    assert_eq!(url.settings.nodes, NodeRange { min: 1, max: 1 });
    assert_eq!(url.settings.last_call, secs(7));
    assert_eq!(url.settings.join_timeout, DEFAULT_JOIN_TIMEOUT);
    for (text, message) in [
        (
            "elastic://h:1/?nodes=1",
            "The run id must be a non-empty string.",
        ),
        (
            "elastic://h:1/j?last_call=5x",
            "elastic:// rendezvous: last_call=5x is not valid (durations: 500ms, 5s, 2m, or \
             seconds; counts: a positive integer; is_host: true or false)",
        ),
        (
            "elastic://h:1/j?last_call=0",
            "The last_call of the elastic rendezvous must be positive.",
        ),
        (
            "elastic://h:1/j?color=red",
            "elastic:// rendezvous: unknown query key color (known: nodes, join_timeout, \
             last_call_timeout, close_timeout, keep_alive_interval, keep_alive_max_attempt, \
             read_timeout, is_host, node_id)",
        ),
        (
            "elastic://:1/j",
            "elastic:// rendezvous: the URL names no store host (elastic://host:port/run_id)",
        ),
    ] {
        assert_eq!(
            ElasticUrl::parse(text).unwrap_err().to_string(),
            message,
            "{text}"
        );
    }
}

/// What a random schedule does at one point.
#[derive(Debug, Clone)]
enum Op {
    /// Step node `i % len` up to this many times.
    Step(usize, u8),
    /// Let virtual time pass.
    Sleep(u16),
    /// Kill node `i % len`.
    Kill(usize),
    /// Start a new node.
    Join,
    /// Node `i % len`'s workers fail.
    Fail(usize),
    /// Node `i % len` leaves.
    Leave(usize),
    /// Node `i % len` shuts the rendezvous down.
    Shutdown(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (any::<usize>(), 1u8..8).prop_map(|(i, n)| Op::Step(i, n)),
        3 => (1u16..3000).prop_map(Op::Sleep),
        1 => any::<usize>().prop_map(Op::Kill),
        2 => Just(Op::Join),
        1 => any::<usize>().prop_map(Op::Fail),
        1 => any::<usize>().prop_map(Op::Leave),
        1 => (any::<usize>(), 0u8..8).prop_map(|(i, p)| if p == 0 {
            Op::Shutdown(i)
        } else {
            Op::Step(i, 1)
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Any interleaving of steps, sleeps, kills, joins and failures: every round's
    /// members agree on the world size and hold distinct ranks `0..N`; and once the
    /// schedule ends, the live nodes settle in one round together (if there are enough).
    #[test]
    fn any_interleaving_agrees(
        min in 1u32..4,
        extra in 0u32..3,
        initial in 1usize..6,
        ops in proptest::collection::vec(op(), 0..120),
    ) {
        let mut s = settings(min, min + extra);
        s.join_timeout = secs(3600);
        let mut sim = Sim::new(s);
        for i in 0..initial {
            sim.join(&format!("n{i}"));
        }
        let mut joined = initial;
        for op in ops {
            let len = sim.nodes.len();
            match op {
                Op::Step(i, n) => {
                    for _ in 0..n {
                        if !sim.step(i % len) {
                            break;
                        }
                    }
                }
                Op::Sleep(ms) => sim.now = sim.now.saturating_add(Duration::from_millis(ms.into())),
                Op::Kill(i) => sim.kill(i % len),
                Op::Join => {
                    sim.join(&format!("n{joined}"));
                    joined += 1;
                }
                Op::Fail(i) => sim.nodes[i % len].machine.handle_local(LocalEvent::WorkerFailed),
                Op::Leave(i) => sim.nodes[i % len].machine.handle_local(LocalEvent::Leave),
                Op::Shutdown(i) => sim.nodes[i % len].machine.handle_local(LocalEvent::Shutdown),
            }
            sim.check_agreement();
        }
        sim.run_for(secs(60));
        sim.check_agreement();
        sim.check_members_alive();
        sim.check_stable_ranks();
        check_one_verdict(&sim);
        // A round that is still going has only live members, each of which has it.
        for c in &sim.closed {
            let current = c.members.iter().all(|&m| {
                sim.nodes[m].alive && sim.last_complete(m).is_some_and(|o| o.round == c.round)
            });
            let anyone_current = (0..sim.nodes.len()).any(|i| {
                sim.nodes[i].alive
                    && !sim.nodes[i].machine.is_done()
                    && sim.last_complete(i).is_some_and(|o| o.round == c.round)
                    && matches!(sim.nodes[i].events.last(), Some(Event::Complete(_)))
            });
            prop_assert!(!anyone_current || current, "round {} stuck with {:?}", c.round, c.members);
        }
        // Liveness: with at least min_nodes live nodes, a final round holds them all,
        // (up to max_nodes; the rest are hot spares).
        let live: Vec<usize> = (0..sim.nodes.len())
            .filter(|&i| sim.nodes[i].alive && !sim.nodes[i].machine.is_done())
            .collect();
        if live.len() >= min as usize {
            let last = live.iter().filter_map(|&i| sim.last_complete(i)).map(|o| o.round).max();
            let members = live
                .iter()
                .filter(|&&i| sim.last_complete(i).map(|o| o.round) == last)
                .count();
            prop_assert_eq!(members, live.len().min((min + extra) as usize), "{:?}", last);
        }
    }
}

/// What a fair schedule does next (every live node keeps being stepped).
#[derive(Debug, Clone)]
enum FairOp {
    Join,
    Kill(usize),
    Leave(usize),
    Fail(usize),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(150))]

    /// Joins, SIGKILLs, leaves and worker failures at random times, with every live node
    /// stepped as its waits end (as the runtime does): every member of a complete round
    /// was alive when it closed; survivors keep their ranks.
    #[test]
    fn fair_schedules_admit_only_the_living(
        min in 1u32..4,
        extra in 0u32..3,
        leases in any::<bool>(),
        ops in proptest::collection::vec(
            (prop_oneof![
                3 => Just(FairOp::Join),
                1 => any::<usize>().prop_map(FairOp::Kill),
                1 => any::<usize>().prop_map(FairOp::Leave),
                1 => any::<usize>().prop_map(FairOp::Fail),
            ], 0u64..8000),
            1..40,
        ),
    ) {
        let mut s = settings(min, min + extra);
        s.join_timeout = secs(3600);
        let mut sim = if leases { Sim::with_leases(s) } else { Sim::new(s) };
        let mut joined = 0;
        for (op, ms) in ops {
            let len = sim.nodes.len().max(1);
            match op {
                FairOp::Join => {
                    sim.join(&format!("n{joined}"));
                    joined += 1;
                }
                FairOp::Kill(i) if i % len < sim.nodes.len() => sim.kill(i % len),
                FairOp::Leave(i) if i % len < sim.nodes.len() => {
                    sim.nodes[i % len].machine.handle_local(LocalEvent::Leave)
                }
                FairOp::Fail(i) if i % len < sim.nodes.len() => {
                    sim.nodes[i % len].machine.handle_local(LocalEvent::WorkerFailed)
                }
                _ => {}
            }
            sim.run_for(Duration::from_millis(ms));
            sim.check_agreement();
        }
        sim.run_for(secs(60));
        sim.check_agreement();
        sim.check_members_alive();
        sim.check_stable_ranks();
        check_one_verdict(&sim);
        // On a lease store, a node stepped as its waits end never lets its lease lapse.
        prop_assert!(sim.lease_lost.is_empty(), "leases lost by live nodes {:?}", sim.lease_lost);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    /// On a lease store (etcd): a member killed at any moment of a complete round is
    /// struck within the lease's TTL plus one keep-alive interval (its key expires by
    /// then, and its watcher looks once per interval), the others form the next round
    /// without it, and no live member is ever struck or loses its lease.
    #[test]
    fn a_dead_members_lease_ends_the_round_within_the_ttl(
        n in 2usize..6,
        victim in any::<usize>(),
        alive_for in 0u64..20_000,
    ) {
        let mut sim = Sim::with_leases(settings(2, n as u32));
        let ttl = sim.settings.keep_alive_timeout();
        let interval = sim.settings.keep_alive_interval;
        let nodes: Vec<usize> = (0..n).map(|i| sim.join(&format!("n{i}"))).collect();
        sim.run_for(secs(3));
        prop_assert!(nodes.iter().all(|&i| sim.last_complete(i).is_some_and(|o| o.round == 0)));
        sim.run_for(Duration::from_millis(alive_for));
        prop_assert!(nodes.iter().all(|&i| sim.nodes[i].overs.is_empty()), "a live member was struck");
        let victim = nodes[victim % n];
        sim.kill(victim);
        let killed = sim.now;
        sim.run_for(ttl + interval + secs(10));
        for &i in nodes.iter().filter(|&&i| i != victim) {
            let over = sim.nodes[i].overs.first().map(|&(round, at)| (round, at.saturating_duration_since(killed)));
            prop_assert!(
                over.is_some_and(|(round, after)| round == 0 && after <= ttl + interval),
                "node {i} learnt of the end {over:?} after the kill (TTL {ttl:?})"
            );
            if n > 2 {
                let next = sim.last_complete(i).map(|o| (o.round, o.world_size));
                prop_assert_eq!(next, Some((1, n as u32 - 1)));
            }
        }
        prop_assert!(sim.lease_lost.is_empty(), "{:?}", sim.lease_lost);
        sim.check_members_alive();
    }
}

#[test]
fn survivors_keep_their_ranks() {
    // Five nodes, the one at rank 1 dies; the next round keeps 0, 2 and 3 where they were
    // and gives rank 1 to the node that held rank 4 (4 is beyond the new world of 4).
    let mut sim = Sim::new(settings(2, 8));
    let nodes: Vec<usize> = (0..5).map(|i| sim.join(&format!("n{i}"))).collect();
    sim.run_for(secs(3));
    let rank_of = |sim: &Sim, i: usize| sim.last_complete(i).unwrap().rank;
    let before: Vec<u32> = nodes.iter().map(|&i| rank_of(&sim, i)).collect();
    let victim = nodes[before.iter().position(|&r| r == 1).unwrap()];
    sim.kill(victim);
    sim.run_for(secs(10));
    for (k, &i) in nodes.iter().enumerate() {
        if i == victim {
            continue;
        }
        let o = sim.last_complete(i).unwrap();
        assert_eq!((o.round, o.world_size), (1, 4));
        let want = if before[k] == 4 { 1 } else { before[k] };
        assert_eq!(o.rank, want, "node {i} had rank {}", before[k]);
    }
    // A newcomer takes the free rank; the others stay.
    let late = sim.join("late");
    sim.run_for(secs(10));
    for (k, &i) in nodes.iter().enumerate() {
        if i != victim {
            let want = if before[k] == 4 { 1 } else { before[k] };
            assert_eq!(sim.last_complete(i).unwrap().rank, want);
        }
    }
    assert_eq!(sim.last_complete(late).unwrap().rank, 4);
    sim.check_stable_ranks();
    sim.check_members_alive();
}

#[test]
fn settings_check() {
    let mut s = settings(1, 1);
    assert_eq!(s.check(), Ok(()));
    s.keep_alive_max_attempts = 0;
    assert_eq!(
        s.check().unwrap_err().to_string(),
        "The keep_alive_max_attempts of the elastic rendezvous must be positive."
    );
}

#[test]
fn closing_makes_a_hot_spare_exit_gracefully() {
    let mut sim = Sim::new(settings(1, 2));
    let a = sim.join("a");
    let b = sim.join("b");
    sim.run_for(secs(1));
    let spare = sim.join("spare");
    sim.run_for(secs(1));
    assert_eq!(
        sim.nodes[spare].events,
        [Event::Waiting {
            round: 0,
            hot_spare: true
        }]
    );
    sim.nodes[a].machine.handle_local(LocalEvent::Shutdown);
    sim.run_for(secs(10));
    let Some(Event::Failed(error)) = sim.nodes[spare].events.last() else {
        panic!("{:?}", sim.nodes[spare].events);
    };
    assert_eq!(error.kind(), ElasticErrorKind::GracefulExit);
    assert!(error
        .to_string()
        .starts_with("RendezvousGracefulExitError: the rendezvous 'job' is closed"));
    let Some(Event::Failed(error)) = sim.nodes[b].events.last() else {
        panic!("{:?}", sim.nodes[b].events);
    };
    assert_eq!(error.kind(), ElasticErrorKind::Closed);
    assert_eq!(error.kind().torch_name(), "RendezvousClosedError");
}

/// Every member of a round learns the same verdict on its confirmation: complete for all,
/// or failed (ended, "did not confirm") for all.
/// After round 0 failed: a fresh node `d` joins, and within 5 s it and the two
/// `survivors` complete round 1 as a world of 3, agreeing, alive, with one verdict.
fn a_newcomer_completes_round_1_with(sim: &mut Sim, survivors: [usize; 2]) {
    let d = sim.join("d");
    sim.run_for(secs(5));
    for i in [survivors[0], survivors[1], d] {
        let o = sim.last_complete(i).unwrap();
        assert_eq!((o.round, o.world_size), (1, 3), "node {i}");
    }
    sim.check_agreement();
    sim.check_members_alive();
    check_one_verdict(sim);
}

fn check_one_verdict(sim: &Sim) {
    for c in &sim.closed {
        let completed: Vec<usize> = c
            .members
            .iter()
            .copied()
            .filter(|&m| sim.completes(m).iter().any(|o| o.round == c.round))
            .collect();
        let refused: Vec<usize> = c
            .members
            .iter()
            .copied()
            .filter(|&m| {
                sim.nodes[m].events.iter().any(|e| {
                    matches!(e, Event::RoundOver { round, reason }
                        if *round == c.round && reason.contains("did not confirm"))
                }) && !completed.contains(&m)
            })
            .collect();
        assert!(
            completed.is_empty() || refused.is_empty(),
            "round {}: complete for {completed:?}, refused by {refused:?}",
            c.round
        );
    }
}

impl Sim {
    /// Steps node `i` until the action it would perform next satisfies `pred`; leaves
    /// that action pending, not performed. Other nodes are stepped in between.
    fn advance_to(&mut self, i: usize, pred: impl Fn(&StoreAction) -> bool) {
        for _ in 0..1000 {
            if self.nodes[i].pending.is_none() {
                let now = self.now;
                self.nodes[i].pending = self.nodes[i].machine.poll_action(now);
            }
            if self.nodes[i].pending.as_ref().is_some_and(&pred) {
                return;
            }
            if !self.step(i) {
                for j in 0..self.nodes.len() {
                    if j != i && !self.held(j) {
                        self.step(j);
                    }
                }
            }
        }
        panic!(
            "node {i} never reached the action: {:?}",
            self.nodes[i].pending
        );
    }

    /// Steps each of `all` to its acknowledgement, left pending, and the closer to its wait
    /// for `go` (its compare-set acknowledged); returns the acknowledgers and the closer.
    fn advance_to_confirmation(&mut self, all: &[usize]) -> (Vec<usize>, usize) {
        let is_ack = |x: &StoreAction| matches!(x, StoreAction::Add { key, delta: 1 } if key.ends_with("/ready"));
        let waits_go =
            |x: &StoreAction| matches!(x, StoreAction::Wait { key, .. } if key.ends_with("/go"));
        for &i in all {
            self.advance_to(i, |x| is_ack(x) || waits_go(x));
        }
        let (ackers, closer): (Vec<usize>, Vec<usize>) = all
            .iter()
            .partition(|&&i| self.nodes[i].pending.as_ref().is_some_and(is_ack));
        let [closer] = closer[..] else {
            panic!("one closer: {closer:?}");
        };
        (ackers, closer)
    }

    /// Whether node `j`'s pending action is one `advance_to` stopped it at.
    fn held(&self, j: usize) -> bool {
        self.nodes[j]
            .pending
            .as_ref()
            .is_some_and(|a| a.key().ends_with("/ready"))
    }
}

#[test]
fn the_last_confirmation_in_flight_splits_no_round() {
    // Three members acknowledge; the last acknowledgement is counted, but its release of
    // the others is still on its way when the other two give up waiting (their
    // keep-alive timeout passes first). Before the verdict key, the first of them to give
    // up (poisoning the acknowledgement counter) found every acknowledgement in and took
    // the round as complete, the second found no `go` yet and ended it: a split
    // decision, and everyone rejoined. Now the first compare-set of `verdict` decides for
    // all: here `go`, since every acknowledgement was in. (A round of four: the closer
    // acknowledged by closing, and waits for the release like the others.)
    let mut sim = Sim::new(settings(4, 4));
    let all: Vec<usize> = (0..4).map(|i| sim.join(&format!("n{i}"))).collect();
    let (nodes, _closer) = sim.advance_to_confirmation(&all);
    // The first two acknowledge and wait for the release.
    for &i in &nodes[..2] {
        assert!(sim.step(i), "acknowledged");
        assert!(!sim.step(i), "waits");
    }
    // The last acknowledges; what it does next is in flight, not yet performed.
    let last = nodes[2];
    assert!(sim.step(last));
    let now = sim.now;
    sim.nodes[last].pending = sim.nodes[last].machine.poll_action(now);
    assert!(sim.nodes[last].pending.is_some());
    let in_flight = sim.nodes[last].alive;
    sim.nodes[last].alive = false;
    // The others' keep-alive timeout passes (3 s) before the release lands.
    sim.now = sim.now.saturating_add(secs(4));
    for &i in &nodes[..2] {
        for _ in 0..8 {
            sim.step(i);
        }
    }
    sim.nodes[last].alive = in_flight;
    sim.run_for(secs(30));
    check_one_verdict(&sim);
    sim.check_agreement();
    sim.check_members_alive();
    // Whatever the verdict, the four end up together in one complete round.
    let rounds: Vec<u64> = all
        .iter()
        .map(|&i| sim.last_complete(i).unwrap().round)
        .collect();
    assert!(rounds.iter().all(|&r| r == rounds[0]), "{rounds:?}");
}

#[test]
fn a_closer_that_leaves_at_once_leaves_no_one_waiting_on_the_quorum() {
    let mut sim = Sim::new(settings(3, 5));
    let waits_on = |name: &'static str| move |x: &StoreAction| matches!(x, StoreAction::Wait { key, .. } if key.ends_with(name));
    let a = sim.join("a");
    let b = sim.join("b");
    sim.advance_to(a, waits_on("/quorum"));
    sim.advance_to(b, waits_on("/quorum"));
    // c arrives, then leaves: its departure is claimed and logged, not yet counted.
    let c = sim.join("c");
    assert!(sim.step(c), "c's arrival");
    sim.nodes[c].machine.handle_local(LocalEvent::Leave);
    sim.advance_to(c, |x| {
        matches!(x, StoreAction::Add { key, delta } if key.ends_with("/arrivals") && *delta > 1)
    });
    sim.nodes[c].alive = false;
    // d counts c as live (4 live): no arrival saw exactly min_nodes, so none set the
    // quorum; d waits out its last call.
    let d = sim.join("d");
    sim.advance_to(d, waits_on("/size"));
    sim.nodes[c].alive = true;
    for _ in 0..8 {
        sim.step(c);
    }
    assert_eq!(sim.nodes[c].events, [Event::Left]);
    // d's last call ends: it closes the round with a, b and itself, and leaves at once.
    sim.now = sim.now.saturating_add(secs(2));
    sim.advance_to(
        d,
        |x| matches!(x, StoreAction::CompareSet { key, .. } if key.ends_with("/size")),
    );
    assert!(sim.step(d), "d's compare-set closes round 0");
    sim.nodes[d].machine.handle_local(LocalEvent::Leave);
    // a and b must not wait on round 0's quorum for good: they learn that the round
    // ended (d left it); with a newcomer they form the next one.
    sim.run_for(secs(10));
    for i in [a, b] {
        assert!(
            sim.nodes[i]
                .events
                .iter()
                .any(|e| matches!(e, Event::RoundOver { round: 0, .. })),
            "node {i} still waits in round 0: {:?}",
            sim.nodes[i].events
        );
    }
    let e = sim.join("e");
    sim.run_for(secs(30));
    for i in [a, b, e] {
        let o = sim
            .last_complete(i)
            .unwrap_or_else(|| panic!("node {i}: {:?}", sim.nodes[i].events));
        assert_eq!(o.world_size, 3, "node {i}");
    }
    sim.check_agreement();
    sim.check_members_alive();
    check_one_verdict(&sim);
}

/// The closer (the node that compare-set the size) sent 5 requests to join, every other
/// node 6.
fn assert_closer_5_others_6(sim: &Sim, n: u32) {
    let mut ops: Vec<u64> = sim.nodes.iter().map(|node| node.ops).collect();
    ops.sort_unstable();
    let mut want = alloc::vec![6u64; n as usize];
    want[0] = 5;
    assert_eq!(ops, want, "n={n}");
}

#[test]
fn store_work_at_16_nodes_by_operation() {
    // Every node but the closer sends the same six requests to join, the last
    // acknowledger included: ADD (arrival), APPEND (roster), WAIT and GET (the size),
    // ADD (ready) and WAIT (go), then a WAIT on the round's end (still pending here). The
    // closer reads the roster once and compare-sets the size instead of the WAIT and the
    // GET (no second read, no mark: it handed out `max_nodes` slots), and does not ADD
    // to `ready` (its compare-set is its acknowledgement): 5; the last acknowledger SETs
    // go instead of its WAIT (no verdict: nobody gave up before it).
    for n in [4u32, 16, 64] {
        let mut sim = Sim::new(settings(n, n));
        for i in 0..n {
            sim.join(&format!("n{i}"));
        }
        sim.run_for(Duration::ZERO);
        assert!((0..n as usize).all(|i| sim.last_complete(i).is_some()));
        let each = |k: u32| u64::from(k);
        let want: BTreeMap<String, u64> = [
            ("add arrivals", each(n)),
            ("append roster", each(n)),
            ("wait size", each(n - 1)),
            ("get size", each(n - 1)),
            ("get roster", 1),
            ("compare_set size", 1),
            ("add ready", each(n - 1)),
            ("wait go", each(n - 1)),
            ("set go", 1),
        ]
        .into_iter()
        .map(|(op, count)| (op.to_string(), count))
        .collect();
        assert_eq!(sim.store.by_op, want, "n={n}");
        assert_closer_5_others_6(&sim, n);
    }
}

#[test]
fn a_roster_line_in_flight_costs_the_closer_a_pause_and_one_get() {
    // n0's arrival is counted but its roster line is still in flight when the closer (the
    // arrival that fills the round) reads the roster. The closer pauses (no store
    // request), reads the roster again, finds the line and closes: that GET costs what
    // its acknowledgement, folded into its compare-set, saves, so the round costs 6 per
    // node.
    let n = 16u32;
    let mut sim = Sim::new(settings(n, n));
    for i in 0..n {
        sim.join(&format!("n{i}"));
    }
    let late = 0;
    let seen = first_actions(&mut sim, late, 1);
    assert!(matches!(&seen[..], [StoreAction::Add { .. }]), "{seen:?}");
    let now = sim.now;
    sim.nodes[late].pending = sim.nodes[late].machine.poll_action(now);
    assert!(
        matches!(&sim.nodes[late].pending, Some(StoreAction::Append { .. })),
        "{:?}",
        sim.nodes[late].pending
    );
    sim.nodes[late].alive = false;
    sim.run_for(Duration::ZERO);
    let pausing: Vec<usize> = (0..n as usize)
        .filter(|&i| matches!(sim.nodes[i].pending, Some(StoreAction::Pause { .. })))
        .collect();
    let [closer] = pausing[..] else {
        panic!("one closer pauses: {pausing:?}");
    };
    assert_eq!(sim.store.by_op["get roster"], 1);
    assert!(!sim.store.kv.contains_key("rdzv.elastic.job/0/size"));
    // The line lands; the pause ends, and one more read finds it.
    sim.nodes[late].alive = true;
    sim.run_for(secs(1));
    assert!((0..n as usize).all(|i| sim.last_complete(i).is_some()));
    assert_eq!(sim.last_complete(late).unwrap().world_size, n);
    assert_eq!(sim.store.by_op["get roster"], 2);
    assert_eq!(sim.store.by_op.get("wait size"), Some(&u64::from(n - 1)));
    assert_eq!(sim.nodes[closer].ops, 6);
    assert!(sim.nodes.iter().all(|node| node.ops == 6));
    let all: u64 = sim.nodes.iter().map(|node| node.ops).sum();
    assert_eq!(all, 6 * u64::from(n));
    assert_eq!(sim.store.ops, all);
    sim.check_agreement();
    sim.check_members_alive();
}

/// Node `i`'s guessed arrival in round 0, and what it does next, as actions.
fn first_actions(sim: &mut Sim, i: usize, count: usize) -> Vec<StoreAction> {
    let mut seen = Vec::new();
    for _ in 0..count {
        let now = sim.now;
        if sim.nodes[i].pending.is_none() {
            sim.nodes[i].pending = sim.nodes[i].machine.poll_action(now);
        }
        let Some(action) = sim.nodes[i].pending.clone() else {
            break;
        };
        seen.push(action);
        if !sim.step(i) {
            break;
        }
    }
    seen
}

#[test]
fn a_full_round_zero_needs_no_mark_for_a_fresh_node_to_find_the_current_round() {
    // Round 0 fills (2 of 2): its closer handed out max_nodes slots and does not mark
    // the arrivals. a's workers fail: round 1 forms, and the hint says 1.
    let mut sim = Sim::new(settings(2, 2));
    let a = sim.join("a");
    let b = sim.join("b");
    sim.run_for(secs(1));
    assert_eq!(sim.store.kv["rdzv.elastic.job/0/arrivals"], b"2", "no mark");
    sim.nodes[a].machine.handle_local(LocalEvent::WorkerFailed);
    sim.run_for(secs(3));
    for i in [a, b] {
        assert_eq!(sim.last_complete(i).unwrap().round, 1, "node {i}");
    }
    // c guesses round 0: slot 3 is above max_nodes, so it reads the hint (1) and arrives
    // in round 1 (full: a hot spare), without a line in round 0's roster.
    let c = sim.join("c");
    let seen = first_actions(&mut sim, c, 3);
    let keys: Vec<&str> = seen.iter().map(|x| x.key()).collect();
    assert_eq!(
        keys,
        [
            "rdzv.elastic.job/0/arrivals",
            "rdzv.elastic.job/round",
            "rdzv.elastic.job/1/arrivals"
        ]
    );
    sim.run_for(secs(3));
    assert_eq!(
        sim.nodes[c].events,
        [Event::Waiting {
            round: 1,
            hot_spare: true
        }]
    );
    assert!(!sim.store.kv["rdzv.elastic.job/0/roster"]
        .windows(2)
        .any(|w| w == b" c"));
    sim.check_agreement();
    sim.check_members_alive();
}

#[test]
fn a_fresh_node_with_a_slot_above_max_in_an_open_round_zero_stays_in_it() {
    // a and b arrive and leave round 0 while it is open: slots 1 and 2 are gone. c's
    // guess takes slot 3, above max_nodes (2): it reads the hint, which says 0, and keeps
    // its slot; d's likewise, and d closes round 0 with c. The closer handed out 4 slots:
    // no mark.
    let mut sim = Sim::new(settings(2, 2));
    for name in ["a", "b"] {
        let i = sim.join(name);
        sim.run_for(secs(1));
        sim.nodes[i].machine.handle_local(LocalEvent::Leave);
        sim.run_for(secs(2));
        assert_eq!(sim.nodes[i].events, [Event::Left], "{name}");
    }
    let c = sim.join("c");
    let seen = first_actions(&mut sim, c, 3);
    assert_eq!(seen[1].key(), "rdzv.elastic.job/round", "{seen:?}");
    assert!(
        matches!(&seen[2], StoreAction::Append { key, .. } if key.ends_with("0/roster")),
        "{seen:?}"
    );
    let d = sim.join("d");
    sim.run_for(secs(1));
    for i in [c, d] {
        let o = sim.last_complete(i).unwrap();
        assert_eq!((o.round, o.world_size), (0, 2), "node {i}");
    }
    let arrivals = &sim.store.kv["rdzv.elastic.job/0/arrivals"];
    assert_eq!(
        core::str::from_utf8(arrivals)
            .unwrap()
            .parse::<i64>()
            .unwrap(),
        4 + 2 * (1 << 32),
        "four slots, two gone, no mark"
    );
    sim.check_agreement();
    sim.check_members_alive();
}

#[test]
fn a_member_struck_between_the_closers_read_and_its_close_fails_the_confirmation() {
    // The closer reads the roster once. b leaves after that read and before the
    // compare-set (its own check finds no size yet), so round 0 closes with b in it. b
    // never acknowledges: the others give up within the keep-alive timeout, the verdict
    // is `fail`, nobody is told round 0, and they form the next round with a newcomer.
    let mut sim = Sim::new(settings(3, 3));
    let a = sim.join("a");
    let b = sim.join("b");
    sim.run_for(Duration::ZERO);
    let c = sim.join("c");
    sim.advance_to(
        c,
        |x| matches!(x, StoreAction::CompareSet { key, .. } if key.ends_with("0/size")),
    );
    // b's wait on the size ends (one keep-alive interval), then it leaves.
    sim.now = sim.now.saturating_add(secs(1));
    sim.nodes[b].machine.handle_local(LocalEvent::Leave);
    for _ in 0..8 {
        sim.step(b);
    }
    assert_eq!(sim.nodes[b].events, [Event::Left]);
    assert!(sim.store.kv["rdzv.elastic.job/0/roster"].ends_with(b"-2\n"));
    let closed_at = sim.now;
    assert!(sim.step(c), "c's compare-set closes round 0");
    assert_eq!(sim.closed[0].members, [a, b, c]);
    sim.run_for(secs(10));
    for i in [a, c] {
        assert!(
            sim.completes(i).is_empty(),
            "node {i}: {:?}",
            sim.nodes[i].events
        );
        assert!(
            sim.nodes[i].events.iter().any(|e| matches!(
                e,
                Event::RoundOver { round: 0, reason } if reason.contains("did not confirm")
            )),
            "node {i}: {:?}",
            sim.nodes[i].events
        );
    }
    // What it cost: the keep-alive timeout (3 s) before round 0 was given up.
    let over_by = sim.now;
    assert!(over_by.saturating_duration_since(closed_at) <= secs(10));
    a_newcomer_completes_round_1_with(&mut sim, [a, c]);
}

#[test]
fn the_last_acknowledgement_after_a_member_gave_up_obeys_the_verdict() {
    // a and b acknowledge; c is slow to, and a gives up first (its keep-alive timeout
    // passes): a finds two of three acknowledgements and compare-sets `fail`. c's
    // acknowledgement then completes the count, but it sees that somebody gave up before
    // it, so it compare-sets the verdict instead of releasing the others, finds `fail`,
    // and the round fails for all three, and for the closer (whose compare-set was its
    // acknowledgement: three more are needed).
    let mut sim = Sim::new(settings(4, 4));
    let all: Vec<usize> = (0..4).map(|i| sim.join(&format!("n{i}"))).collect();
    let (nodes, _closer) = sim.advance_to_confirmation(&all);
    let (a, b, c) = (nodes[0], nodes[1], nodes[2]);
    for i in [a, b] {
        assert!(sim.step(i), "acknowledged");
    }
    sim.now = sim.now.saturating_add(secs(4));
    sim.advance_to(
        a,
        |x| matches!(x, StoreAction::CompareSet { key, .. } if key.ends_with("/verdict")),
    );
    assert!(sim.step(a), "a decides fail");
    assert_eq!(sim.store.kv["rdzv.elastic.job/0/verdict"], b"fail");
    assert!(sim.step(c), "c's acknowledgement, the third");
    let next = first_actions(&mut sim, c, 1);
    assert!(
        matches!(&next[..], [StoreAction::CompareSet { key, desired, .. }]
            if key.ends_with("0/verdict") && desired == b"go"),
        "{next:?}"
    );
    sim.run_for(secs(30));
    for &i in &all {
        assert!(
            !sim.completes(i).iter().any(|o| o.round == 0),
            "node {i}: {:?}",
            sim.nodes[i].events
        );
        assert_eq!(sim.last_complete(i).unwrap().round, 1, "node {i}");
    }
    check_one_verdict(&sim);
    sim.check_agreement();
    sim.check_members_alive();
}

#[test]
fn the_last_acknowledgement_before_anyone_gave_up_releases_without_a_verdict() {
    // Nobody gave up: the third acknowledgement's next request is the SET of go. A member
    // that gives up after it (go still in flight) finds every acknowledgement in and
    // compare-sets `go`: the only verdict there can be. (A round of four: the closer
    // acknowledged by closing.)
    let mut sim = Sim::new(settings(4, 4));
    let all: Vec<usize> = (0..4).map(|i| sim.join(&format!("n{i}"))).collect();
    let (nodes, _closer) = sim.advance_to_confirmation(&all);
    for &i in &nodes {
        assert!(sim.step(i), "acknowledged");
    }
    let last = nodes[2];
    let now = sim.now;
    sim.nodes[last].pending = sim.nodes[last].machine.poll_action(now);
    assert!(
        matches!(&sim.nodes[last].pending, Some(StoreAction::Set { key, .. }) if key.ends_with("0/go")),
        "{:?}",
        sim.nodes[last].pending
    );
    sim.nodes[last].alive = false;
    sim.now = sim.now.saturating_add(secs(4));
    sim.advance_to(
        nodes[0],
        |x| matches!(x, StoreAction::CompareSet { key, .. } if key.ends_with("/verdict")),
    );
    assert!(sim.step(nodes[0]));
    assert_eq!(sim.store.kv["rdzv.elastic.job/0/verdict"], b"go");
    sim.nodes[last].alive = true;
    sim.run_for(Duration::ZERO);
    for &i in &all {
        assert_eq!(sim.last_complete(i).unwrap().round, 0, "node {i}");
    }
    check_one_verdict(&sim);
    sim.check_agreement();
}

#[test]
fn two_closers_with_the_same_world_tell_the_winner_apart() {
    // a and b's last calls end together and both close with the same roster. Each
    // proposal names its closer, so only the winner takes its compare-set for its
    // acknowledgement; the other acknowledges, and the round completes without a give-up.
    let mut sim = Sim::new(settings(2, 4));
    let a = sim.join("a");
    let b = sim.join("b");
    sim.run_for(secs(3));
    assert_eq!(
        sim.store.by_op["compare_set size"], 2,
        "{:?}",
        sim.store.by_op
    );
    assert_eq!(sim.store.by_op["add ready"], 1, "{:?}", sim.store.by_op);
    assert_eq!(sim.store.kv["rdzv.elastic.job/0/ready"], b"1");
    for i in [a, b] {
        let o = sim.last_complete(i).unwrap();
        assert_eq!((o.round, o.world_size), (0, 2), "node {i}");
    }
    assert!(!sim.store.kv.contains_key("rdzv.elastic.job/0/verdict"));
    sim.check_agreement();
}

#[test]
fn a_round_of_one_completes_at_its_close() {
    // Nobody else to hear from: the closer's compare-set completes the round, without an
    // acknowledgement or a release (ADD, APPEND, GET roster, compare-set: 4 requests).
    let mut sim = Sim::new(settings(1, 1));
    let a = sim.join("a");
    sim.run_for(Duration::ZERO);
    let o = sim.last_complete(a).unwrap();
    assert_eq!((o.round, o.rank, o.world_size), (0, 0, 1));
    assert_eq!(sim.nodes[a].ops, 4);
    assert!(!sim.store.kv.contains_key("rdzv.elastic.job/0/ready"));
    assert!(!sim.store.kv.contains_key("rdzv.elastic.job/0/go"));
}

#[test]
fn a_closer_killed_after_its_compare_set_is_like_a_member_dead_after_its_acknowledgement() {
    // The closer's compare-set is its acknowledgement: killed right after it, the round
    // is still complete for the others (two acknowledgements of three members), and the
    // closer's watcher ends it within the keep-alive timeout, as for any member that dies
    // after acknowledging; the survivors then form the next round with a newcomer.
    let mut sim = Sim::new(settings(3, 3));
    let all: Vec<usize> = (0..3).map(|i| sim.join(&format!("n{i}"))).collect();
    let (ackers, closer) = sim.advance_to_confirmation(&all);
    assert_eq!(ackers.len(), 2);
    sim.kill(closer);
    let killed_at = sim.now;
    sim.run_for(Duration::ZERO);
    for &i in &ackers {
        let o = sim.last_complete(i).unwrap();
        assert_eq!((o.round, o.world_size), (0, 3), "node {i}");
    }
    assert_eq!(sim.store.kv["rdzv.elastic.job/0/ready"], b"2");
    sim.run_for(secs(10));
    for &i in &ackers {
        let over = sim.nodes[i]
            .overs
            .iter()
            .find(|(round, _)| *round == 0)
            .map(|&(_, at)| at);
        let over = over.unwrap_or_else(|| panic!("node {i}: {:?}", sim.nodes[i].events));
        // The keep-alive timeout (3 s), and the interval before the first look.
        assert!(
            over.saturating_duration_since(killed_at) <= secs(5),
            "{over:?}"
        );
    }
    a_newcomer_completes_round_1_with(&mut sim, [ackers[0], ackers[1]]);
}

#[test]
fn on_a_lease_store_the_watcher_strikes_a_gone_key_and_never_a_present_one() {
    let mut sim = Sim::with_leases(settings(3, 3));
    let nodes: Vec<usize> = (0..3).map(|i| sim.join(&format!("n{i}"))).collect();
    sim.run_for(secs(3));
    // Many TTLs with everyone beating: a present key reads a value that moves, so no
    // stalled interval is ever counted against it.
    sim.run_for(secs(60));
    assert!(nodes.iter().all(|&i| sim.nodes[i].overs.is_empty()));
    let victim = nodes[1];
    let watcher = nodes
        .iter()
        .copied()
        .find(|&i| {
            let rank = sim.last_complete(i).unwrap().rank;
            (rank + 1) % 3 == sim.last_complete(victim).unwrap().rank
        })
        .unwrap();
    sim.kill(victim);
    sim.run_for(secs(10));
    let reason = sim.nodes[watcher]
        .events
        .iter()
        .find_map(|e| match e {
            Event::RoundOver { reason, .. } => Some(reason.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{:?}", sim.nodes[watcher].events));
    assert!(
        reason.contains("heartbeat key is gone: its lease expired"),
        "{reason}"
    );
    assert!(sim.lease_lost.is_empty());
}
