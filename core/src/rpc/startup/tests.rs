//! Start-up machines under virtual time: a model store, workers stepped in any order, no
//! sleeps. A wait with a timeout expires only when no worker can move.

use alloc::boxed::Box;
use alloc::collections::{BTreeMap, VecDeque};
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;

use proptest::prelude::*;

use super::*;
use crate::device::Device;
use crate::device_map::DeviceMap;
use crate::rpc::store_keys::{membership_token, Membership};
use crate::rpc::token::{TokenAcquire, TokenRelease};

trait Machine {
    fn action(&self) -> Action<'_>;
    fn feed(&mut self, outcome: Outcome<'_>) -> Result<(), String>;
}

macro_rules! machine {
    ($($t:ty),*) => {$(
        impl Machine for $t {
            fn action(&self) -> Action<'_> {
                self.poll_action()
            }
            fn feed(&mut self, outcome: Outcome<'_>) -> Result<(), String> {
                self.handle(outcome).map_err(|e| format!("{e:?}"))
            }
        }
    )*};
}
machine!(StaticInit, DynamicJoin, TokenAcquire, TokenRelease);

#[derive(Default)]
struct Store {
    map: BTreeMap<String, Vec<u8>>,
    barriers: BTreeMap<String, i64>,
}

struct Worker {
    name: String,
    machines: VecDeque<Box<dyn Machine>>,
    log: Vec<String>,
    installed: Option<StartupGroup>,
    /// Names this worker was told joined (announcements received).
    announced: Vec<String>,
    arrived: bool,
    error: Option<String>,
    done: bool,
}

struct World {
    store: Store,
    workers: Vec<Worker>,
}

fn devices(name: &str) -> WorkerDevices {
    WorkerDevices {
        name: name.to_string(),
        device_count: 0,
        device_maps: DeviceMaps::new(),
        devices: Vec::new(),
    }
}

fn keys() -> RpcKeys {
    RpcKeys::new(0)
}

fn info(name: &str, rank: u32) -> WorkerInfo {
    WorkerInfo::new(name, i64::from(rank)).unwrap()
}

const TIMEOUT_MS: u64 = 30_000;

fn static_worker(name: &str, rank: u32, world: u32) -> Worker {
    let m = StaticInit::new(&keys(), &info(name, rank), world, devices(name), TIMEOUT_MS);
    worker(name, vec![Box::new(m)])
}

fn dynamic_worker(name: &str, rank: u32) -> Worker {
    let token = membership_token(name, Membership::Join);
    let machines: Vec<Box<dyn Machine>> = vec![
        Box::new(TokenAcquire::new(&keys(), &token)),
        Box::new(DynamicJoin::new(&keys(), &info(name, rank), devices(name))),
        Box::new(TokenRelease::new(&keys(), &token)),
    ];
    worker(name, machines)
}

fn worker(name: &str, machines: Vec<Box<dyn Machine>>) -> Worker {
    Worker {
        name: name.to_string(),
        machines: machines.into(),
        log: Vec::new(),
        installed: None,
        announced: Vec::new(),
        arrived: false,
        error: None,
        done: false,
    }
}

enum Reply {
    Now(OwnedOutcome),
    Blocked,
    Finished,
}

enum OwnedOutcome {
    Set,
    Got(Vec<u8>),
    Waited,
    Checked(bool),
    Compared(Vec<u8>),
    Added(i64),
    Passed,
    Paused,
    Listening(String),
    Installed,
    Called,
}

impl World {
    fn new(workers: Vec<Worker>) -> World {
        World {
            store: Store::default(),
            workers,
        }
    }

    /// Tries one step of worker `i`; whether it moved.
    fn step(&mut self, i: usize) -> bool {
        let World { store, workers } = self;
        if workers[i].error.is_some() {
            return false;
        }
        let Some(mut machine) = workers[i].machines.pop_front() else {
            return false;
        };
        let action = machine.action();
        let reply = match action {
            Action::StoreSet { key, value } => {
                store.map.insert(key.to_string(), value.to_vec());
                Reply::Now(OwnedOutcome::Set)
            }
            Action::StoreGet { key } => match store.map.get(key) {
                Some(v) => Reply::Now(OwnedOutcome::Got(v.clone())),
                None => Reply::Blocked,
            },
            Action::StoreWait { key } => match store.map.contains_key(key) {
                true => Reply::Now(OwnedOutcome::Waited),
                false => Reply::Blocked,
            },
            Action::StoreWaitAll { keys, .. } => {
                match keys.iter().all(|k| store.map.contains_key(k)) {
                    true => Reply::Now(OwnedOutcome::Waited),
                    false => Reply::Blocked,
                }
            }
            Action::StoreCheck { key } => {
                Reply::Now(OwnedOutcome::Checked(store.map.contains_key(key)))
            }
            Action::StoreCompareSet {
                key,
                expected,
                desired,
            } => {
                let current = store.map.get(key).cloned();
                let returned = match current {
                    None if expected.is_empty() => {
                        store.map.insert(key.to_string(), desired.to_vec());
                        desired.to_vec()
                    }
                    None => expected.to_vec(),
                    Some(v) if v == expected => {
                        store.map.insert(key.to_string(), desired.to_vec());
                        desired.to_vec()
                    }
                    Some(v) => v,
                };
                Reply::Now(OwnedOutcome::Compared(returned))
            }
            Action::StoreAdd { key, delta } => {
                let old = store
                    .map
                    .get(key)
                    .and_then(|v| core::str::from_utf8(v).ok()?.parse::<i64>().ok())
                    .unwrap_or(0);
                store
                    .map
                    .insert(key.to_string(), format!("{}", old + delta).into_bytes());
                Reply::Now(OwnedOutcome::Added(old + delta))
            }
            Action::StoreBarrier { key, world_size } => {
                if !workers[i].arrived {
                    workers[i].arrived = true;
                    *store.barriers.entry(key.to_string()).or_insert(0) += 1;
                }
                if store.barriers.get(key).copied().unwrap_or(0) >= world_size {
                    Reply::Now(OwnedOutcome::Passed)
                } else {
                    Reply::Blocked
                }
            }
            Action::Pause { .. } => Reply::Now(OwnedOutcome::Paused),
            Action::Listen => Reply::Now(OwnedOutcome::Listening(format!(
                "tcp://{}",
                workers[i].name
            ))),
            Action::InstallGroup { group } => {
                workers[i].installed = Some(group.clone());
                Reply::Now(OwnedOutcome::Installed)
            }
            Action::Call {
                to,
                method,
                payload,
            } => {
                assert_eq!(method, GROUP_JOIN);
                let joined = JoinAnnouncement::decode(payload).unwrap();
                let name = joined.name.clone();
                let target = to.to_string();
                for w in workers.iter_mut().filter(|w| w.name == target) {
                    w.announced.push(name.clone());
                }
                Reply::Now(OwnedOutcome::Called)
            }
            Action::Done => Reply::Finished,
            Action::Failed => Reply::Blocked,
            other => panic!("unexpected action {}", other.name()),
        };
        let w = &mut workers[i];
        match reply {
            Reply::Blocked => {
                w.machines.push_front(machine);
                false
            }
            Reply::Finished => {
                w.done = w.machines.is_empty();
                true
            }
            Reply::Now(owned) => {
                let line = describe(machine.action());
                w.log.push(line);
                let outcome = match &owned {
                    OwnedOutcome::Set => Outcome::Set,
                    OwnedOutcome::Got(v) => Outcome::Got(v),
                    OwnedOutcome::Waited => Outcome::Waited,
                    OwnedOutcome::Checked(b) => Outcome::Checked(*b),
                    OwnedOutcome::Compared(v) => Outcome::Compared(v),
                    OwnedOutcome::Added(v) => Outcome::Added(*v),
                    OwnedOutcome::Passed => Outcome::PassedBarrier,
                    OwnedOutcome::Paused => Outcome::Paused,
                    OwnedOutcome::Listening(a) => Outcome::Listening(a),
                    OwnedOutcome::Installed => Outcome::Installed,
                    OwnedOutcome::Called => Outcome::Called,
                };
                if let Err(e) = machine.feed(outcome) {
                    w.error = Some(e);
                }
                w.machines.push_front(machine);
                true
            }
        }
    }

    /// Lets time pass: every worker waiting with a timeout times out.
    fn expire(&mut self) -> bool {
        let mut any = false;
        for w in &mut self.workers {
            let Some(m) = w.machines.front_mut() else {
                continue;
            };
            if w.error.is_none() && matches!(m.action(), Action::StoreWaitAll { .. }) {
                w.log.push("timed out".to_string());
                if let Err(e) = m.feed(Outcome::TimedOut) {
                    w.error = Some(e);
                }
                any = true;
            }
        }
        any
    }

    /// Runs workers `active` in the order `choices` picks until nobody can move, with
    /// timeouts expiring only when everybody is stuck.
    fn run(&mut self, active: &[usize], choices: &[usize]) {
        let mut choices = choices.iter().copied().cycle();
        loop {
            let runnable: Vec<usize> = active
                .iter()
                .copied()
                .filter(|&i| self.can_step(i))
                .collect();
            if runnable.is_empty() {
                if !self.expire() {
                    return;
                }
                continue;
            }
            let pick = choices.next().unwrap_or(0) % runnable.len();
            self.step(runnable[pick]);
        }
    }

    fn can_step(&mut self, i: usize) -> bool {
        // Probe without side effects: only store reads block, and a barrier arrival is
        // idempotent.
        let w = &self.workers[i];
        let Some(m) = w.machines.front() else {
            return false;
        };
        if w.error.is_some() {
            return false;
        }
        let map = &self.store.map;
        match m.action() {
            Action::StoreGet { key } | Action::StoreWait { key } => map.contains_key(key),
            Action::StoreWaitAll { keys, .. } => keys.iter().all(|k| map.contains_key(k)),
            Action::StoreBarrier { key, world_size } => {
                let count =
                    self.store.barriers.get(key).copied().unwrap_or(0) + i64::from(!w.arrived);
                !w.arrived || count >= world_size
            }
            Action::Failed => false,
            _ => true,
        }
    }
}

fn describe(action: Action<'_>) -> String {
    match action {
        Action::StoreSet { key, .. } => format!("set {key}"),
        Action::StoreGet { key } => format!("get {key}"),
        Action::StoreWaitAll { keys, .. } => format!("wait {}", keys.join(" ")),
        Action::StoreCheck { key } => format!("check {key}"),
        Action::StoreCompareSet { key, .. } => format!("compare_set {key}"),
        Action::StoreBarrier { key, world_size } => format!("barrier {key} {world_size}"),
        Action::Call { to, .. } => format!("call {to}"),
        other => other.name().to_string(),
    }
}

fn run_static(names: &[&str], choices: &[usize]) -> World {
    let world = u32::try_from(names.len()).unwrap();
    let workers = names
        .iter()
        .enumerate()
        .map(|(r, n)| static_worker(n, u32::try_from(r).unwrap(), world))
        .collect();
    let mut w = World::new(workers);
    let all: Vec<usize> = (0..names.len()).collect();
    w.run(&all, choices);
    w
}

#[test]
fn a_static_worker_publishes_reads_listens_and_meets_the_others() {
    let world = run_static(&["a", "b"], &[0]);
    let p = keys().prefix().to_string();
    assert_eq!(
        world.workers[0].log,
        vec![
            format!("set {p}/names/0"),
            format!("wait {p}/names/1"),
            format!("get {p}/names/1"),
            format!("set {p}/devices/0"),
            format!("wait {p}/devices/1"),
            format!("get {p}/devices/1"),
            "listen".to_string(),
            format!("set {p}/addrs/a"),
            format!("wait {p}/addrs/b"),
            format!("get {p}/addrs/b"),
            "install the group".to_string(),
            format!("barrier {p}/init_barrier 2"),
        ]
    );
    for w in &world.workers {
        assert!(w.done, "{}: {:?}", w.name, w.error);
        let group = w.installed.as_ref().unwrap();
        let names: Vec<(&str, i16, &str)> = group
            .peers
            .iter()
            .map(|p| (p.name.as_str(), p.id.get(), p.address.as_str()))
            .collect();
        assert_eq!(names, vec![("a", 0, "tcp://a"), ("b", 1, "tcp://b")]);
    }
}

#[test]
fn a_single_worker_waits_for_nobody() {
    let world = run_static(&["solo"], &[0]);
    let w = &world.workers[0];
    assert!(w.done);
    assert!(!w.log.iter().any(|l| l.starts_with("wait")), "{:?}", w.log);
}

#[test]
fn a_late_peer_is_waited_for() {
    let mut world = World::new(vec![
        static_worker("early", 0, 2),
        static_worker("late", 1, 2),
    ]);
    // The early worker runs alone until it must wait for the late one.
    while world.step(0) {}
    assert!(matches!(
        world.workers[0].machines[0].action(),
        Action::StoreWaitAll { .. }
    ));
    assert!(!world.workers[0].done);
    world.run(&[0, 1], &[1, 0]);
    assert!(world.workers.iter().all(|w| w.done));
    assert_eq!(world.workers[0].installed, world.workers[1].installed);
}

#[test]
fn a_timeout_names_the_missing_ranks() {
    let mut world = World::new(vec![
        static_worker("w0", 0, 4),
        static_worker("w1", 1, 4),
        static_worker("w2", 2, 4),
        static_worker("w3", 3, 4),
    ]);
    // Ranks 1 and 3 never start.
    world.run(&[0, 2], &[0, 1]);
    let expected = "Timeout { stage: Names, missing: [1, 3], timeout_ms: 30000 }";
    assert_eq!(world.workers[0].error.as_deref(), Some(expected));
    assert_eq!(world.workers[2].error.as_deref(), Some(expected));
    let error = StartupError::Timeout {
        stage: Stage::Names,
        missing: vec![1, 3],
        timeout_ms: 30_000,
    };
    assert_eq!(
        error.to_string(),
        "RPC start-up timed out after 30000 ms waiting for the names of ranks 1, 3: start \
         those workers with the same init_method and world_size, or raise the store timeout"
    );
}

#[test]
fn keys_that_arrive_right_after_a_timeout_let_start_up_go_on() {
    let mut init = StaticInit::new(&keys(), &info("a", 0), 2, devices("a"), 10);
    init.handle(Outcome::Set).unwrap();
    init.handle(Outcome::TimedOut).unwrap();
    assert!(matches!(init.poll_action(), Action::StoreCheck { .. }));
    init.handle(Outcome::Checked(true)).unwrap();
    assert!(matches!(init.poll_action(), Action::StoreGet { .. }));
}

#[test]
fn duplicate_names_fail_on_every_worker() {
    let world = run_static(&["twin", "twin"], &[0, 1]);
    for (rank, w) in world.workers.iter().enumerate() {
        let (first, second) = if rank == 0 { (0, 1) } else { (1, 0) };
        let error = StartupError::Names(NameTableError::Duplicate(
            crate::rpc::store_keys::DuplicateWorkerName {
                name: "twin".to_string(),
                first: WorkerId::from(first),
                second: WorkerId::from(second),
            },
        ));
        assert_eq!(w.error.as_deref(), Some(format!("{error:?}").as_str()));
        assert_eq!(
            error.to_string(),
            format!("RPC worker name twin is not unique. Workers {first} and {second} share the same name.")
        );
    }
}

#[test]
fn inconsistent_device_maps_fail_before_listening() {
    let mut maps = DeviceMaps::new();
    maps.insert("b", DeviceMap::from([(Device::cuda(0), Device::cuda(1))]));
    let mut a = devices("a");
    a.device_count = 1;
    a.device_maps = maps;
    let mut b = devices("b");
    b.device_count = 1;
    let mut world = World::new(vec![
        worker(
            "a",
            vec![Box::new(StaticInit::new(&keys(), &info("a", 0), 2, a, 10))],
        ),
        worker(
            "b",
            vec![Box::new(StaticInit::new(&keys(), &info("b", 1), 2, b, 10))],
        ),
    ]);
    world.run(&[0, 1], &[0]);
    for w in &world.workers {
        let error = w.error.as_deref().unwrap_or_default();
        assert!(error.starts_with("DeviceMaps("), "{}: {error}", w.name);
        assert!(!w.log.iter().any(|l| l == "listen"), "{:?}", w.log);
    }
}

#[test]
fn a_too_large_world_fails_at_once() {
    let init = StaticInit::new(&keys(), &info("a", 0), 70_000, devices("a"), 10);
    assert_eq!(init.poll_action(), Action::Failed);
    assert_eq!(
        init.error(),
        Some(&StartupError::WorldSize { world_size: 70_000 })
    );
}

#[test]
fn an_outcome_that_answers_nothing_fails_the_machine() {
    let mut init = StaticInit::new(&keys(), &info("a", 0), 1, devices("a"), 10);
    let error = init.handle(Outcome::Waited).unwrap_err();
    assert_eq!(
        error,
        StartupError::UnexpectedOutcome {
            expected: "store set",
            got: "waited"
        }
    );
    assert_eq!(init.poll_action(), Action::Failed);
    let mut join = DynamicJoin::new(&keys(), &info("a", 0), devices("a"));
    assert!(join.handle(Outcome::Installed).is_err());
    assert_eq!(join.poll_action(), Action::Failed);
}

#[test]
fn bad_device_information_names_the_rank() {
    let mut init = StaticInit::new(&keys(), &info("a", 0), 2, devices("a"), 10);
    init.handle(Outcome::Set).unwrap();
    init.handle(Outcome::Waited).unwrap();
    init.handle(Outcome::Got(b"b")).unwrap();
    init.handle(Outcome::Set).unwrap();
    init.handle(Outcome::Waited).unwrap();
    let error = init.handle(Outcome::Got(b"\xff\xff\xff")).unwrap_err();
    assert!(
        matches!(error, StartupError::BadDeviceInfo { rank: 1, .. }),
        "{error:?}"
    );
}

#[test]
fn a_dynamic_newcomer_joins_an_empty_group_then_another_joins_it() {
    let mut world = World::new(vec![
        dynamic_worker("first", 0),
        dynamic_worker("second", 1),
    ]);
    world.run(&[0], &[0]);
    let p = keys().prefix().to_string();
    assert!(world.workers[0].done, "{:?}", world.workers[0].error);
    assert!(world.workers[0]
        .log
        .contains(&format!("compare_set {p}/names/0")));
    world.run(&[1], &[0]);
    assert!(world.workers[1].done, "{:?}", world.workers[1].error);
    assert!(world.workers[1].log.contains(&"call first".to_string()));
    assert_eq!(world.workers[0].announced, vec!["second".to_string()]);
    let list = world.store.map.get(&keys().all_worker_infos()).unwrap();
    let listed = parse_worker_infos(list).unwrap();
    assert_eq!(listed.len(), 2);
}

#[test]
fn a_taken_dynamic_rank_fails_with_both_names() {
    let mut world = World::new(vec![
        dynamic_worker("first", 3),
        dynamic_worker("second", 3),
    ]);
    world.run(&[0], &[0]);
    world.run(&[1], &[0]);
    let error = world.workers[1].error.as_deref().unwrap_or_default();
    assert!(error.starts_with("DuplicateId("), "{error}");
}

/// Every worker knows every other: from its installed group or an announcement.
fn assert_everyone_knows_everyone(world: &World) {
    for w in &world.workers {
        assert!(w.done, "{}: {:?} {:?}", w.name, w.error, w.log);
        let group = w.installed.as_ref().unwrap();
        for other in &world.workers {
            let known = group.peers.iter().any(|p| p.name == other.name)
                || w.announced.contains(&other.name);
            assert!(known, "{} does not know {}", w.name, other.name);
        }
    }
}

#[test]
fn two_racing_joins_are_serialised_by_the_token() {
    for choices in [[0usize, 1], [1, 0], [0, 0], [1, 1]] {
        let mut world = World::new(vec![dynamic_worker("x", 0), dynamic_worker("y", 1)]);
        world.run(&[0, 1], &choices);
        assert_everyone_knows_everyone(&world);
    }
}

proptest! {
    #[test]
    fn static_workers_in_any_order_end_with_the_same_group(
        n in 1usize..6,
        choices in proptest::collection::vec(0usize..64, 1..64),
    ) {
        let names: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let world = run_static(&refs, &choices);
        let first = world.workers[0].installed.clone();
        prop_assert!(first.is_some());
        for w in &world.workers {
            prop_assert!(w.done, "{}: {:?}", w.name, w.error);
            prop_assert_eq!(&w.installed, &first);
        }
        let group = first.unwrap_or_default();
        let got: Vec<&str> = group.peers.iter().map(|p| p.name.as_str()).collect();
        prop_assert_eq!(got, refs);
    }

    #[test]
    fn dynamic_joins_in_any_order_know_each_other(
        n in 1usize..5,
        choices in proptest::collection::vec(0usize..64, 1..64),
    ) {
        let workers = (0..n)
            .map(|i| dynamic_worker(&format!("d{i}"), u32::try_from(i).unwrap_or(0)))
            .collect();
        let mut world = World::new(workers);
        let all: Vec<usize> = (0..n).collect();
        world.run(&all, &choices);
        assert_everyone_knows_everyone(&world);
        let list = world.store.map.get(&keys().all_worker_infos()).cloned().unwrap_or_default();
        prop_assert_eq!(parse_worker_infos(&list).map(|l| l.len()).unwrap_or(0), n);
    }
}
