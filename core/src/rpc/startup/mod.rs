//! The group's start-up as state machines over store operations, in the vocabulary of
//! [`super::step`] ([`Action`] / [`Outcome`]).
//!
//! [`StaticInit`] (a world size was given; PyTorch's `_tensorpipe_init_backend_handler`
//! with the agent's constructor and `startImpl`):
//!
//! 1. `set(names/{rank}, name)`; wait (with the store timeout) for every other rank's
//!    `names/{r}` and read them in rank order: a duplicate name or rank fails;
//! 2. `set(devices/{rank}, (name, device_count, device_maps, devices))`; wait for and
//!    read every other rank's, then check every worker's maps as a static group;
//! 3. [`Action::Listen`]: the runtime starts the agent; `set(addrs/{name}, address)`;
//!    wait for and read every peer's address;
//! 4. [`Action::InstallGroup`], then the store barrier `init_barrier` over the world.
//!
//! [`DynamicJoin`] (no world size; `_group_membership_management`), run while this worker
//! holds the group token ([`super::token`]): claim `names/{rank}` with a compare-set (a
//! rank held by another name fails), read `_ALL_WORKER_INFOS` (creating it empty),
//! publish this worker's devices and read every member's, check the maps as a dynamic
//! group, read every member's address, listen, publish the address, install the group,
//! announce the join to every member (a reserved call), then list this worker.
//!
//! A wait that times out does not fail at once: the machine checks each key it waited
//! for and fails with [`StartupError::Timeout`], naming the ranks that never published.
//!
//! The machines perform no I/O and read no clock: the store enforces the timeouts it is
//! given, and the runtime starts listeners, installs the group and makes calls.

use alloc::borrow::ToOwned;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;

use super::membership::{JoinAnnouncement, GROUP_JOIN};
use super::name::{WorkerId, WorkerInfo};
pub use super::step::{Action, GroupPeer, Outcome, StartupGroup};
use super::store_keys::{
    append_worker_info, check_rank_claim, decode_worker_devices, encode_worker_devices,
    parse_worker_infos, static_ranks_to_fetch, DuplicateWorkerId, NameTable, NameTableError,
    RpcKeys, WorkerInfosError,
};
use crate::device_map::{
    create_reverse_mapping, exchange_and_check_device_maps, validate_device_maps, DeviceMapError,
    DeviceMaps, GroupKind, WorkerDevices,
};

/// What a start-up wait was for, for errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// `names/{rank}`.
    Names,
    /// `devices/{rank}`.
    Devices,
    /// `addrs/{name}`.
    Addresses,
}

impl Stage {
    const fn what(self) -> &'static str {
        match self {
            Stage::Names => "names",
            Stage::Devices => "device information",
            Stage::Addresses => "addresses",
        }
    }
}

/// Why a start-up machine failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StartupError {
    /// The outcome does not answer the pending action (a driver bug).
    UnexpectedOutcome {
        /// The pending action.
        expected: &'static str,
        /// The outcome given.
        got: &'static str,
    },
    /// The world size exceeds the worker id range.
    WorldSize {
        /// The world size given.
        world_size: u32,
    },
    /// Two workers share a name or a rank, or a name read from the store is invalid.
    Names(NameTableError),
    /// A dynamic member's rank is taken by another name.
    DuplicateId(DuplicateWorkerId),
    /// The dynamic group's member list is malformed.
    WorkerList(WorkerInfosError),
    /// A worker's device information does not encode or decode.
    BadDeviceInfo {
        /// The worker's rank.
        rank: u32,
        /// What postcard said.
        reason: String,
    },
    /// The group's device maps are inconsistent.
    DeviceMaps(DeviceMapError),
    /// Some workers did not publish in time.
    Timeout {
        /// What was waited for.
        stage: Stage,
        /// The ranks whose keys are missing, in order.
        missing: Vec<u32>,
        /// The timeout, in milliseconds.
        timeout_ms: u64,
    },
}

impl fmt::Display for StartupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartupError::UnexpectedOutcome { expected, got } => write!(
                f,
                "RPC start-up expected the outcome of {expected} but got {got} (a runtime bug)"
            ),
            StartupError::WorldSize { world_size } => write!(
                f,
                "invalid RPC option world_size: {world_size} workers exceed the worker id range"
            ),
            StartupError::Names(e) => e.fmt(f),
            StartupError::DuplicateId(e) => e.fmt(f),
            StartupError::WorkerList(e) => e.fmt(f),
            StartupError::BadDeviceInfo { rank, reason } => write!(
                f,
                "the device information of rank {rank} in the store is malformed ({reason}); \
                 is another program using the same store keys?"
            ),
            StartupError::DeviceMaps(e) => e.fmt(f),
            StartupError::Timeout {
                stage,
                missing,
                timeout_ms,
            } => {
                write!(
                    f,
                    "RPC start-up timed out after {timeout_ms} ms waiting for the {} of ranks ",
                    stage.what()
                )?;
                for (i, rank) in missing.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{rank}")?;
                }
                f.write_str(
                    ": start those workers with the same init_method and world_size, \
                     or raise the store timeout",
                )
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for StartupError {}

/// The rank of a worker id (ids of valid workers are never negative).
fn rank_of(id: WorkerId) -> u32 {
    u32::try_from(id.get()).unwrap_or(0)
}

/// A wait on some ranks' keys, with the check that names the missing ones.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Waiting {
    /// `StoreWaitAll` on every key.
    Wait,
    /// After a timeout: `StoreCheck` of key `at`, with the missing ranks so far.
    Check { at: usize, missing: Vec<u32> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum StaticStep {
    PublishName,
    Await(Stage, Waiting),
    GetName(usize),
    PublishDevices,
    GetDevices(usize),
    Listen,
    PublishAddress,
    GetAddress(usize),
    Install,
    Barrier,
    Done,
    Failed,
}

/// A static group's start-up for one worker (see the module documentation).
#[derive(Debug, Clone)]
pub struct StaticInit {
    keys: RpcKeys,
    me: WorkerInfo,
    world_size: u16,
    timeout_ms: u64,
    mine: WorkerDevices,
    /// The other ranks, in rank order.
    others: Vec<WorkerId>,
    /// The keys of the wait in progress, one per rank of `others`.
    waited: Vec<String>,
    /// The key and value of the pending get or set.
    key: String,
    value: Vec<u8>,
    names: NameTable,
    /// Names by rank (this worker's included), filled as they are read.
    ranked: Vec<Option<String>>,
    devices: Vec<Option<WorkerDevices>>,
    addresses: Vec<Option<String>>,
    group: StartupGroup,
    step: StaticStep,
    error: Option<StartupError>,
}

impl StaticInit {
    /// Starts worker `me`'s start-up in a group of `world_size` under `keys`, publishing
    /// `mine` as its devices; each wait for other workers lasts at most `timeout_ms`.
    /// `me` must have a rank below `world_size` (the caller checks it first).
    pub fn new(
        keys: &RpcKeys,
        me: &WorkerInfo,
        world_size: u32,
        mine: WorkerDevices,
        timeout_ms: u64,
    ) -> StaticInit {
        let mut init = StaticInit {
            keys: keys.clone(),
            me: me.clone(),
            world_size: 0,
            timeout_ms,
            mine,
            others: Vec::new(),
            waited: Vec::new(),
            key: keys.rank_name(me.id()),
            value: me.name().as_bytes().to_vec(),
            names: NameTable::new(me),
            ranked: Vec::new(),
            devices: Vec::new(),
            addresses: Vec::new(),
            group: StartupGroup::default(),
            step: StaticStep::PublishName,
            error: None,
        };
        match u16::try_from(world_size) {
            Ok(world) => {
                init.world_size = world;
                init.others = static_ranks_to_fetch(me.id(), world).collect();
                let slots = usize::from(world);
                init.ranked = alloc::vec![None; slots];
                init.devices = alloc::vec![None; slots];
                init.addresses = alloc::vec![None; slots];
                let at = init.my_slot();
                if let Some(slot) = init.ranked.get_mut(at) {
                    *slot = Some(me.name().to_string());
                }
            }
            Err(_) => init.fail(StartupError::WorldSize { world_size }),
        }
        init
    }

    fn my_slot(&self) -> usize {
        usize::try_from(rank_of(self.me.id())).unwrap_or(usize::MAX)
    }

    fn fail(&mut self, error: StartupError) {
        self.error = Some(error);
        self.step = StaticStep::Failed;
    }

    /// What the runtime must do next.
    pub fn poll_action(&self) -> Action<'_> {
        match &self.step {
            StaticStep::PublishName | StaticStep::PublishDevices | StaticStep::PublishAddress => {
                Action::StoreSet {
                    key: &self.key,
                    value: &self.value,
                }
            }
            StaticStep::Await(_, Waiting::Wait) => Action::StoreWaitAll {
                keys: &self.waited,
                timeout_ms: self.timeout_ms,
            },
            StaticStep::Await(_, Waiting::Check { at, .. }) => Action::StoreCheck {
                key: self.waited.get(*at).map_or("", String::as_str),
            },
            StaticStep::GetName(_) | StaticStep::GetDevices(_) | StaticStep::GetAddress(_) => {
                Action::StoreGet { key: &self.key }
            }
            StaticStep::Listen => Action::Listen,
            StaticStep::Install => Action::InstallGroup { group: &self.group },
            StaticStep::Barrier => Action::StoreBarrier {
                key: &self.key,
                world_size: i64::from(self.world_size),
            },
            StaticStep::Done => Action::Done,
            StaticStep::Failed => Action::Failed,
        }
    }

    /// Starts waiting for every other rank's key of `stage`.
    fn await_stage(&mut self, stage: Stage) -> StaticStep {
        self.waited = self
            .others
            .iter()
            .map(|&id| self.stage_key(stage, id))
            .collect();
        if self.waited.is_empty() {
            return self.after_wait(stage);
        }
        StaticStep::Await(stage, Waiting::Wait)
    }

    fn stage_key(&self, stage: Stage, id: WorkerId) -> String {
        match stage {
            Stage::Names => self.keys.rank_name(id),
            Stage::Devices => self.keys.devices(rank_of(id)),
            Stage::Addresses => {
                let at = usize::try_from(rank_of(id)).unwrap_or(usize::MAX);
                let name = self.ranked.get(at).cloned().flatten().unwrap_or_default();
                self.keys.address(&name)
            }
        }
    }

    /// The first read after a wait (or the step after it when there is no other rank).
    fn after_wait(&mut self, stage: Stage) -> StaticStep {
        self.get_step(stage, 0)
    }

    /// Reads `stage`'s key of the `at`-th other rank, or moves on when all are read.
    fn get_step(&mut self, stage: Stage, at: usize) -> StaticStep {
        if let Some(&id) = self.others.get(at) {
            self.key = self.stage_key(stage, id);
            return match stage {
                Stage::Names => StaticStep::GetName(at),
                Stage::Devices => StaticStep::GetDevices(at),
                Stage::Addresses => StaticStep::GetAddress(at),
            };
        }
        match stage {
            Stage::Names => {
                let rank = rank_of(self.me.id());
                self.key = self.keys.devices(rank);
                match encode_worker_devices(&self.mine) {
                    Ok(value) => {
                        self.value = value;
                        StaticStep::PublishDevices
                    }
                    Err(e) => {
                        self.error = Some(StartupError::BadDeviceInfo {
                            rank,
                            reason: e.to_string(),
                        });
                        StaticStep::Failed
                    }
                }
            }
            Stage::Devices => self.check_devices(),
            Stage::Addresses => self.finish_group(),
        }
    }

    fn check_devices(&mut self) -> StaticStep {
        let workers: Vec<WorkerDevices> = self
            .devices
            .iter()
            .enumerate()
            .map(|(rank, d)| match d {
                Some(d) => d.clone(),
                None if rank == self.my_slot() => self.mine.clone(),
                None => WorkerDevices {
                    name: String::new(),
                    device_count: 0,
                    device_maps: DeviceMaps::new(),
                    devices: Vec::new(),
                },
            })
            .collect();
        match exchange_and_check_device_maps(&self.mine, &workers) {
            Ok(setup) => {
                self.group.reverse_device_maps = setup.reverse_device_maps;
                self.group.devices = setup.devices;
                let at = self.my_slot();
                if let Some(slot) = self.devices.get_mut(at) {
                    *slot = Some(self.mine.clone());
                }
                StaticStep::Listen
            }
            Err(e) => {
                self.error = Some(StartupError::DeviceMaps(e));
                StaticStep::Failed
            }
        }
    }

    fn finish_group(&mut self) -> StaticStep {
        let mut peers = Vec::with_capacity(self.ranked.len());
        for (rank, name) in self.ranked.iter().enumerate() {
            let id = WorkerId::from(i16::try_from(rank).unwrap_or(i16::MAX));
            peers.push(GroupPeer {
                name: name.clone().unwrap_or_default(),
                id,
                address: self
                    .addresses
                    .get(rank)
                    .cloned()
                    .flatten()
                    .unwrap_or_default(),
                devices: self
                    .devices
                    .get(rank)
                    .cloned()
                    .flatten()
                    .unwrap_or_else(|| self.mine.clone()),
            });
        }
        self.group.peers = peers;
        StaticStep::Install
    }

    /// Takes the outcome of the last action.
    ///
    /// # Errors
    /// Why the machine failed (it has then): a duplicate name, inconsistent device maps,
    /// malformed device information, ranks that did not publish in time, or an outcome
    /// that does not answer the pending action (a driver bug).
    pub fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), StartupError> {
        let step = core::mem::replace(&mut self.step, StaticStep::Failed);
        let next = match (step, outcome) {
            (StaticStep::PublishName, Outcome::Set) => Ok(self.await_stage(Stage::Names)),
            (StaticStep::PublishDevices, Outcome::Set) => Ok(self.await_stage(Stage::Devices)),
            (StaticStep::PublishAddress, Outcome::Set) => Ok(self.await_stage(Stage::Addresses)),
            (StaticStep::Await(stage, Waiting::Wait), Outcome::Waited) => {
                Ok(self.after_wait(stage))
            }
            (StaticStep::Await(stage, Waiting::Wait), Outcome::TimedOut) => Ok(StaticStep::Await(
                stage,
                Waiting::Check {
                    at: 0,
                    missing: Vec::new(),
                },
            )),
            (
                StaticStep::Await(stage, Waiting::Check { at, mut missing }),
                Outcome::Checked(present),
            ) => {
                if !present {
                    if let Some(&id) = self.others.get(at) {
                        missing.push(rank_of(id));
                    }
                }
                if at + 1 < self.waited.len() {
                    Ok(StaticStep::Await(
                        stage,
                        Waiting::Check {
                            at: at + 1,
                            missing,
                        },
                    ))
                } else if missing.is_empty() {
                    // Everything arrived just after the timeout: go on.
                    Ok(self.after_wait(stage))
                } else {
                    Err(StartupError::Timeout {
                        stage,
                        missing,
                        timeout_ms: self.timeout_ms,
                    })
                }
            }
            (StaticStep::GetName(at), Outcome::Got(value)) => {
                let id = self.others.get(at).copied().unwrap_or(WorkerId::from(0));
                match self.names.insert(value, id) {
                    Ok(()) => {
                        let slot = usize::try_from(rank_of(id)).unwrap_or(usize::MAX);
                        if let Some(s) = self.ranked.get_mut(slot) {
                            *s = Some(String::from_utf8_lossy(value).into_owned());
                        }
                        Ok(self.get_step(Stage::Names, at + 1))
                    }
                    Err(e) => Err(StartupError::Names(e)),
                }
            }
            (StaticStep::GetDevices(at), Outcome::Got(value)) => {
                let rank = self.others.get(at).map_or(0, |&id| rank_of(id));
                match decode_worker_devices(value) {
                    Ok(devices) => {
                        let slot = usize::try_from(rank).unwrap_or(usize::MAX);
                        if let Some(s) = self.devices.get_mut(slot) {
                            *s = Some(devices);
                        }
                        Ok(self.get_step(Stage::Devices, at + 1))
                    }
                    Err(e) => Err(StartupError::BadDeviceInfo {
                        rank,
                        reason: e.to_string(),
                    }),
                }
            }
            (StaticStep::Listen, Outcome::Listening(address)) => {
                let at = self.my_slot();
                if let Some(s) = self.addresses.get_mut(at) {
                    *s = Some(address.to_owned());
                }
                self.key = self.keys.address(self.me.name());
                self.value = address.as_bytes().to_vec();
                Ok(StaticStep::PublishAddress)
            }
            (StaticStep::GetAddress(at), Outcome::Got(value)) => {
                let slot = self.others.get(at).map_or(usize::MAX, |&id| {
                    usize::try_from(rank_of(id)).unwrap_or(usize::MAX)
                });
                if let Some(s) = self.addresses.get_mut(slot) {
                    *s = Some(String::from_utf8_lossy(value).into_owned());
                }
                Ok(self.get_step(Stage::Addresses, at + 1))
            }
            (StaticStep::Install, Outcome::Installed) => {
                self.key = self.keys.init_barrier();
                Ok(StaticStep::Barrier)
            }
            (StaticStep::Barrier, Outcome::PassedBarrier) => Ok(StaticStep::Done),
            (step, got) => {
                self.step = step;
                Err(StartupError::UnexpectedOutcome {
                    expected: self.poll_action().name(),
                    got: got.name(),
                })
            }
        };
        match next {
            Ok(step) => {
                self.step = step;
                match &self.error {
                    Some(e) if self.step == StaticStep::Failed => Err(e.clone()),
                    _ => Ok(()),
                }
            }
            Err(e) => {
                self.fail(e.clone());
                Err(e)
            }
        }
    }

    /// The group, once start-up is done (or at [`Action::InstallGroup`]).
    pub fn group(&self) -> &StartupGroup {
        &self.group
    }

    /// Whether start-up finished.
    pub fn is_done(&self) -> bool {
        self.step == StaticStep::Done
    }

    /// Why the machine failed, once it has.
    pub fn error(&self) -> Option<&StartupError> {
        self.error.as_ref()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JoinStep {
    ClaimRank,
    ReadList,
    PublishDevices,
    GetDevices(usize),
    GetAddress(usize),
    Listen,
    PublishAddress,
    Install,
    Announce(usize),
    ListMe,
    Done,
    Failed,
}

/// A newcomer's join of a dynamic group, run while it holds the group token (see the
/// module documentation).
#[derive(Debug, Clone)]
pub struct DynamicJoin {
    keys: RpcKeys,
    me: WorkerInfo,
    mine: WorkerDevices,
    /// The members listed before this worker, in list order.
    members: Vec<(String, WorkerId)>,
    /// The list as read, to append to.
    list: String,
    members_devices: Vec<WorkerDevices>,
    addresses: Vec<String>,
    key: String,
    value: Vec<u8>,
    group: StartupGroup,
    step: JoinStep,
    error: Option<StartupError>,
}

impl DynamicJoin {
    /// Starts worker `me`'s join of the dynamic group under `keys`, publishing `mine`.
    pub fn new(keys: &RpcKeys, me: &WorkerInfo, mine: WorkerDevices) -> DynamicJoin {
        DynamicJoin {
            keys: keys.clone(),
            me: me.clone(),
            mine,
            members: Vec::new(),
            list: String::new(),
            members_devices: Vec::new(),
            addresses: Vec::new(),
            key: keys.rank_name(me.id()),
            value: me.name().as_bytes().to_vec(),
            group: StartupGroup::default(),
            step: JoinStep::ClaimRank,
            error: None,
        }
    }

    /// What the runtime must do next.
    pub fn poll_action(&self) -> Action<'_> {
        match self.step {
            JoinStep::ClaimRank => Action::StoreCompareSet {
                key: &self.key,
                expected: b"",
                desired: &self.value,
            },
            // compare_set from "" to "" reads the list, creating it empty if missing.
            JoinStep::ReadList => Action::StoreCompareSet {
                key: &self.key,
                expected: b"",
                desired: b"",
            },
            JoinStep::PublishDevices | JoinStep::PublishAddress | JoinStep::ListMe => {
                Action::StoreSet {
                    key: &self.key,
                    value: &self.value,
                }
            }
            JoinStep::GetDevices(_) | JoinStep::GetAddress(_) => {
                Action::StoreGet { key: &self.key }
            }
            JoinStep::Listen => Action::Listen,
            JoinStep::Install => Action::InstallGroup { group: &self.group },
            JoinStep::Announce(at) => Action::Call {
                to: self.members.get(at).map_or("", |(n, _)| n.as_str()),
                method: GROUP_JOIN,
                payload: &self.value,
            },
            JoinStep::Done => Action::Done,
            JoinStep::Failed => Action::Failed,
        }
    }

    fn devices_step(&mut self, at: usize) -> Result<JoinStep, StartupError> {
        if let Some(&(_, id)) = self.members.get(at) {
            self.key = self.keys.devices(rank_of(id));
            return Ok(JoinStep::GetDevices(at));
        }
        let mut workers = Vec::with_capacity(self.members.len() + 1);
        workers.push(self.mine.clone());
        workers.extend(self.members_devices.iter().cloned());
        validate_device_maps(&workers, GroupKind::Dynamic).map_err(StartupError::DeviceMaps)?;
        self.group.reverse_device_maps = create_reverse_mapping(self.me.name(), &workers);
        Ok(self.address_step(0))
    }

    fn address_step(&mut self, at: usize) -> JoinStep {
        match self.members.get(at) {
            Some((name, _)) => {
                self.key = self.keys.address(name);
                JoinStep::GetAddress(at)
            }
            None => JoinStep::Listen,
        }
    }

    fn announce_step(&mut self, at: usize) -> Result<JoinStep, StartupError> {
        if at < self.members.len() {
            return Ok(JoinStep::Announce(at));
        }
        let listed = append_worker_info(&self.list, &self.me).map_err(StartupError::WorkerList)?;
        self.key = self.keys.all_worker_infos();
        self.value = listed.into_bytes();
        Ok(JoinStep::ListMe)
    }

    /// Takes the outcome of the last action.
    ///
    /// # Errors
    /// Why the machine failed (it has then): the rank is taken, the member list or a
    /// member's device information is malformed, the device maps are inconsistent, or an
    /// outcome does not answer the pending action (a driver bug).
    pub fn handle(&mut self, outcome: Outcome<'_>) -> Result<(), StartupError> {
        let step = core::mem::replace(&mut self.step, JoinStep::Failed);
        let next = match (step, outcome) {
            (JoinStep::ClaimRank, Outcome::Compared(returned)) => {
                match check_rank_claim(&self.me, returned) {
                    Ok(()) => {
                        self.key = self.keys.all_worker_infos();
                        Ok(JoinStep::ReadList)
                    }
                    Err(e) => Err(StartupError::DuplicateId(e)),
                }
            }
            (JoinStep::ReadList, Outcome::Compared(list)) => self.read_list(list),
            (JoinStep::PublishDevices, Outcome::Set) => self.devices_step(0),
            (JoinStep::GetDevices(at), Outcome::Got(value)) => {
                let rank = self.members.get(at).map_or(0, |&(_, id)| rank_of(id));
                match decode_worker_devices(value) {
                    Ok(devices) => {
                        self.members_devices.push(devices);
                        self.devices_step(at + 1)
                    }
                    Err(e) => Err(StartupError::BadDeviceInfo {
                        rank,
                        reason: e.to_string(),
                    }),
                }
            }
            (JoinStep::GetAddress(at), Outcome::Got(value)) => {
                self.addresses
                    .push(String::from_utf8_lossy(value).into_owned());
                Ok(self.address_step(at + 1))
            }
            (JoinStep::Listen, Outcome::Listening(address)) => self.listening(address),
            (JoinStep::PublishAddress, Outcome::Set) => Ok(JoinStep::Install),
            (JoinStep::Install, Outcome::Installed) => {
                let me = self.group.peers.last().cloned();
                match me {
                    Some(me) => {
                        let announcement = JoinAnnouncement {
                            name: me.name,
                            id: me.id.get(),
                            address: me.address,
                            devices: me.devices,
                        };
                        match announcement.encode() {
                            Ok(payload) => {
                                self.value = payload;
                                self.announce_step(0)
                            }
                            Err(e) => Err(StartupError::BadDeviceInfo {
                                rank: rank_of(self.me.id()),
                                reason: e.to_string(),
                            }),
                        }
                    }
                    None => self.announce_step(0),
                }
            }
            (JoinStep::Announce(at), Outcome::Called) => self.announce_step(at + 1),
            (JoinStep::ListMe, Outcome::Set) => Ok(JoinStep::Done),
            (step, got) => {
                self.step = step;
                Err(StartupError::UnexpectedOutcome {
                    expected: self.poll_action().name(),
                    got: got.name(),
                })
            }
        };
        match next {
            Ok(step) => {
                self.step = step;
                Ok(())
            }
            Err(e) => {
                self.error = Some(e.clone());
                self.step = JoinStep::Failed;
                Err(e)
            }
        }
    }

    fn read_list(&mut self, list: &[u8]) -> Result<JoinStep, StartupError> {
        let parsed = parse_worker_infos(list).map_err(StartupError::WorkerList)?;
        let mut names = NameTable::new(&self.me);
        for (name, id) in &parsed {
            names
                .insert(name.as_bytes(), *id)
                .map_err(StartupError::Names)?;
        }
        self.members = parsed
            .into_iter()
            .map(|(n, id)| (n.to_string(), id))
            .collect();
        self.list = String::from_utf8_lossy(list).into_owned();
        let rank = rank_of(self.me.id());
        self.key = self.keys.devices(rank);
        self.value =
            encode_worker_devices(&self.mine).map_err(|e| StartupError::BadDeviceInfo {
                rank,
                reason: e.to_string(),
            })?;
        Ok(JoinStep::PublishDevices)
    }

    fn listening(&mut self, address: &str) -> Result<JoinStep, StartupError> {
        let mut peers = Vec::with_capacity(self.members.len() + 1);
        for (i, (name, id)) in self.members.iter().enumerate() {
            peers.push(GroupPeer {
                name: name.clone(),
                id: *id,
                address: self.addresses.get(i).cloned().unwrap_or_default(),
                devices: self
                    .members_devices
                    .get(i)
                    .cloned()
                    .unwrap_or_else(|| WorkerDevices {
                        name: name.clone(),
                        device_count: 0,
                        device_maps: DeviceMaps::new(),
                        devices: Vec::new(),
                    }),
            });
        }
        peers.push(GroupPeer {
            name: self.me.name().to_string(),
            id: self.me.id(),
            address: address.to_owned(),
            devices: self.mine.clone(),
        });
        self.group.peers = peers;
        self.key = self.keys.address(self.me.name());
        self.value = address.as_bytes().to_vec();
        Ok(JoinStep::PublishAddress)
    }

    /// The group, once the join is done (or at [`Action::InstallGroup`]).
    pub fn group(&self) -> &StartupGroup {
        &self.group
    }

    /// The members this worker found (and announced itself to), in list order.
    pub fn members(&self) -> impl Iterator<Item = &str> + '_ {
        self.members.iter().map(|(n, _)| n.as_str())
    }

    /// Whether the join finished.
    pub fn is_done(&self) -> bool {
        self.step == JoinStep::Done
    }

    /// Why the machine failed, once it has.
    pub fn error(&self) -> Option<&StartupError> {
        self.error.as_ref()
    }
}

#[cfg(test)]
mod tests;
