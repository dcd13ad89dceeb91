//! The RPC agent's store layout: every key it reads or writes, the values it puts there,
//! and the checks PyTorch makes on what it reads back.
//!
//! `init_rpc` wraps the rendezvous store in `PrefixStore("rpc_prefix_{n}")`, `n` counting
//! `init_rpc` calls in the process, and the agent nests three more prefix stores in it
//! (`PrefixStore::joinKey` is `prefix + "/" + key`). The keys, relative to the store given
//! to `init_rpc`, are therefore ([`RpcKeys`]):
//!
//! | key | value | written by |
//! |---|---|---|
//! | `rpc_prefix_{n}/names/{rank}` | the worker's name | every worker (static: `set`; dynamic: `compare_set` from empty) |
//! | `rpc_prefix_{n}/names/_ALL_WORKER_INFOS` | `"name1-0,name2-1,"` | dynamic members, on join and leave |
//! | `rpc_prefix_{n}/addrs/{name}` | the worker's listening URL | every worker, at start |
//! | `rpc_prefix_{n}/shutdown/{PROCESS_COUNT,ACTIVE_CALLS,READY}_ID_{b}` | counters / empty | `join` barriers ([`super::shutdown`]) |
//! | `rpc_prefix_{n}/rpcIsStaticGroup` | `"true"` / `"false"` | every worker, `compare_set` from empty |
//! | `rpc_prefix_{n}/RpcGroupManagementToken` | `""` or `Token_for_{name}_{join,leave}` | dynamic members, around a join or leave |
//! | `rpc_prefix_{n}/Token_for_{name}_{join,leave}` | `"Done"` | the token holder, on release |
//! | `rpc_prefix_{n}/devices/{rank}` | the worker's [`WorkerDevices`], postcard | every worker, at start (PyTorch gathers these through a process group) |
//! | `rpc_prefix_{n}/init_barrier` | the store's barrier keys | a static group's members, once started |
//!
//! Errors carry PyTorch's messages: duplicate names ("RPC worker name {name} is not
//! unique. Workers {a} and {b} share the same name."), a claimed rank ("RPC worker id {id}
//! is not unique. ..."), and a group that mixes static and dynamic members.
//!
//! Deliberate difference: PyTorch splits each `_ALL_WORKER_INFOS` entry at its *first*
//! `-`, so a dynamic member named `trainer-1` with rank 3 (`trainer-1-3,`) is read back as
//! `trainer` with id 1. Names may contain `-` but ids written here are never negative, so
//! rdzv splits at the *last* `-` and reads names with dashes correctly; it refuses to write
//! a negative id into the list. PyTorch's `std::stoi` also accepts junk around the number
//! (` 3`, `3x`); rdzv wants exactly the decimal digits it writes.
//!
//! Nothing here talks to a store: callers (the runtime, or the [`super::shutdown`] state
//! machine) perform the operations.

use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use super::name::{validate_worker_name_bytes, NameError, WorkerId, WorkerInfo};
use crate::device::RejectedInput;
use crate::device_map::WorkerDevices;

/// The key that lists a dynamic group's members, under `names/`.
pub const ALL_WORKER_INFOS: &str = "_ALL_WORKER_INFOS";
/// The key that says whether the group is static, under the RPC prefix.
pub const IS_STATIC_GROUP: &str = "rpcIsStaticGroup";
/// The group secret's key, when the store shares it.
pub const GROUP_SECRET: &str = "rpcGroupSecret";
/// The dynamic group's join/leave mutex, under the RPC prefix.
pub const GROUP_MANAGEMENT_TOKEN: &str = "RpcGroupManagementToken";
/// The value a token holder writes under its own token on release.
pub const TOKEN_DONE: &[u8] = b"Done";

/// `PrefixStore::joinKey`: `prefix/key`.
pub fn join_key(prefix: &str, key: &str) -> String {
    format!("{prefix}/{key}")
}

/// The prefix `init_rpc` puts in front of every RPC key: `rpc_prefix_{init_counter}`.
pub fn rpc_prefix(init_counter: u64) -> String {
    format!("rpc_prefix_{init_counter}")
}

/// Every store key of one `init_rpc` generation, relative to the store given to
/// `init_rpc`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RpcKeys {
    prefix: String,
}

/// The three keys of one `syncCallCount` barrier.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BarrierKeys {
    /// `.../shutdown/PROCESS_COUNT_ID_{b}`: how many workers arrived.
    pub process_count: String,
    /// `.../shutdown/ACTIVE_CALLS_ID_{b}`: the sum of the workers' active calls.
    pub active_calls: String,
    /// `.../shutdown/READY_ID_{b}`: set (empty) by the last worker to arrive.
    pub ready: String,
}

/// Whether a member is joining or leaving a dynamic group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Membership {
    /// `init_rpc` without a world size.
    Join,
    /// `shutdown` of a dynamic member.
    Leave,
}

impl Membership {
    /// `join` or `leave`, as in the token.
    pub const fn name(self) -> &'static str {
        match self {
            Membership::Join => "join",
            Membership::Leave => "leave",
        }
    }
}

/// The token value a member competes for: `Token_for_{name}_{join|leave}`. It is also,
/// under the RPC prefix, the key set to `Done` when the member releases the mutex.
pub fn membership_token(name: &str, op: Membership) -> String {
    format!("Token_for_{name}_{}", op.name())
}

impl RpcKeys {
    /// The keys under `rpc_prefix_{init_counter}`.
    pub fn new(init_counter: u64) -> RpcKeys {
        RpcKeys {
            prefix: rpc_prefix(init_counter),
        }
    }

    /// The keys under an arbitrary prefix (keys are `prefix/...`).
    pub fn with_prefix(prefix: &str) -> RpcKeys {
        RpcKeys {
            prefix: String::from(prefix),
        }
    }

    /// The prefix, e.g. `rpc_prefix_0`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `{prefix}/names/{id}`: the name of the worker with this id.
    pub fn rank_name(&self, id: WorkerId) -> String {
        format!("{}/names/{id}", self.prefix)
    }

    /// `{prefix}/names/_ALL_WORKER_INFOS`: a dynamic group's member list.
    pub fn all_worker_infos(&self) -> String {
        format!("{}/names/{ALL_WORKER_INFOS}", self.prefix)
    }

    /// `{prefix}/addrs/{name}`: the worker's listening URL.
    pub fn address(&self, name: &str) -> String {
        format!("{}/addrs/{name}", self.prefix)
    }

    /// `{prefix}/shutdown/..._ID_{barrier_id}`: the keys of one barrier. PyTorch numbers
    /// barriers with a process-wide counter whose first value is 1.
    pub fn barrier(&self, barrier_id: u64) -> BarrierKeys {
        let key = |what: &str| format!("{}/shutdown/{what}_ID_{barrier_id}", self.prefix);
        BarrierKeys {
            process_count: key("PROCESS_COUNT"),
            active_calls: key("ACTIVE_CALLS"),
            ready: key("READY"),
        }
    }

    /// `{prefix}/shutdown/JOINING_{b}/{worker}`: set (empty) by `worker` as it enters a
    /// join whose first barrier is `b` (rdzv's, not PyTorch's). The barriers only count
    /// arrivals; a join that times out names the members whose key is missing as the
    /// workers that never reached it.
    pub fn join_entry(&self, first_barrier_id: u64, worker: &str) -> String {
        format!(
            "{}/shutdown/JOINING_{first_barrier_id}/{worker}",
            self.prefix
        )
    }

    /// `{prefix}/rpcIsStaticGroup`.
    pub fn is_static_group(&self) -> String {
        join_key(&self.prefix, IS_STATIC_GROUP)
    }

    /// `{prefix}/rpcGroupSecret`: the group secret of the pipe handshake, when the
    /// workers share it through the store (`rpc::auth`).
    pub fn group_secret(&self) -> String {
        join_key(&self.prefix, GROUP_SECRET)
    }

    /// `{prefix}/RpcGroupManagementToken`.
    pub fn group_management_token(&self) -> String {
        join_key(&self.prefix, GROUP_MANAGEMENT_TOKEN)
    }

    /// `{prefix}/{token}`: the key a token holder sets to `Done` on release, and that a
    /// member waits on while `token` holds the mutex.
    pub fn token_done(&self, token: &str) -> String {
        join_key(&self.prefix, token)
    }

    /// `{prefix}/devices/{rank}`: the worker's devices and device maps
    /// ([`encode_worker_devices`]).
    pub fn devices(&self, rank: u32) -> String {
        format!("{}/devices/{rank}", self.prefix)
    }

    /// `{prefix}/init_barrier`: the store barrier a static group meets at once every
    /// member has started.
    pub fn init_barrier(&self) -> String {
        join_key(&self.prefix, "init_barrier")
    }
}

/// The value of [`RpcKeys::devices`]: postcard bytes of the worker's [`WorkerDevices`].
///
/// # Errors
/// postcard's error (it cannot fail for these types short of running out of memory).
pub fn encode_worker_devices(devices: &WorkerDevices) -> Result<Vec<u8>, postcard::Error> {
    postcard::to_allocvec(devices)
}

/// Reads a value written by [`encode_worker_devices`]; anything else is an error, never
/// a panic. Device maps are then validated with `device_map::validate_device_maps`.
///
/// # Errors
/// What postcard found wrong with the bytes.
pub fn decode_worker_devices(value: &[u8]) -> Result<WorkerDevices, postcard::Error> {
    postcard::from_bytes(value)
}

/// The value written under `rpcIsStaticGroup`.
pub const fn static_group_value(is_static: bool) -> &'static [u8] {
    if is_static {
        b"true"
    } else {
        b"false"
    }
}

/// The group mixes static and dynamic members (`checkAndSetStaticGroup`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MixedGroupError {
    /// Whether this worker is in a static group.
    pub is_static: bool,
    /// What `compare_set` returned (the value the first member wrote).
    pub returned: RejectedInput,
}

impl fmt::Display for MixedGroupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // PyTorch's message, its argument order and its trailing space included.
        write!(
            f,
            "RPC group mixes statically and dynamically initialized members which is not \
             supported. Static group property is initialized as {} and is trying to be set as \
             {} ",
            self.is_static, self.returned
        )
    }
}

#[cfg(feature = "std")]
impl std::error::Error for MixedGroupError {}

/// Checks the reply of `compare_set(rpcIsStaticGroup, "", static_group_value(is_static))`.
///
/// # Errors
/// [`MixedGroupError`] if an earlier member wrote the other value.
pub fn check_static_group(is_static: bool, returned: &[u8]) -> Result<(), MixedGroupError> {
    if returned == static_group_value(is_static) {
        Ok(())
    } else {
        Err(MixedGroupError {
            is_static,
            returned: RejectedInput::new(&alloc::string::String::from_utf8_lossy(returned)),
        })
    }
}

/// Two workers share a name: "RPC worker name {name} is not unique. Workers {first} and
/// {second} share the same name."
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuplicateWorkerName {
    /// The shared name.
    pub name: String,
    /// The id that had it first.
    pub first: WorkerId,
    /// The id that also claims it.
    pub second: WorkerId,
}

impl fmt::Display for DuplicateWorkerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RPC worker name {} is not unique. Workers {} and {} share the same name.",
            self.name, self.first, self.second
        )
    }
}

#[cfg(feature = "std")]
impl std::error::Error for DuplicateWorkerName {}

/// Why a name read from the store could not join the name table.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NameTableError {
    /// The name is not a valid worker name.
    InvalidName(NameError),
    /// The name is taken.
    Duplicate(DuplicateWorkerName),
    /// The id is taken (by another name).
    DuplicateId {
        /// The id.
        id: WorkerId,
    },
}

impl fmt::Display for NameTableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NameTableError::InvalidName(e) => e.fmt(f),
            NameTableError::Duplicate(e) => e.fmt(f),
            NameTableError::DuplicateId { id } => {
                write!(f, "RPC worker id {id} appears twice in the worker list")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for NameTableError {}

/// The name → id table `collectNames` / `collectCurrentNames` build, starting from this
/// worker's own entry. Iterates in name order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameTable {
    by_name: BTreeMap<String, WorkerId>,
}

impl NameTable {
    /// A table holding only `me`.
    pub fn new(me: &WorkerInfo) -> NameTable {
        let mut by_name = BTreeMap::new();
        by_name.insert(String::from(me.name()), me.id());
        NameTable { by_name }
    }

    /// Adds the worker `id` whose name was read as `name` (raw store bytes).
    ///
    /// # Errors
    /// [`NameTableError::InvalidName`] if the bytes are not a valid name (PyTorch fails the
    /// same way when it builds the `WorkerInfo`), [`NameTableError::Duplicate`] if another
    /// id has that name, [`NameTableError::DuplicateId`] if the id is in the table already.
    pub fn insert(&mut self, name: &[u8], id: WorkerId) -> Result<(), NameTableError> {
        let name = validate_worker_name_bytes(name).map_err(NameTableError::InvalidName)?;
        if let Some(&first) = self.by_name.get(name) {
            return Err(NameTableError::Duplicate(DuplicateWorkerName {
                name: String::from(name),
                first,
                second: id,
            }));
        }
        if self.by_name.values().any(|&known| known == id) {
            return Err(NameTableError::DuplicateId { id });
        }
        self.by_name.insert(String::from(name), id);
        Ok(())
    }

    /// The id of `name`.
    pub fn get(&self, name: &str) -> Option<WorkerId> {
        self.by_name.get(name).copied()
    }

    /// `(name, id)` in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, WorkerId)> + '_ {
        self.by_name.iter().map(|(n, &id)| (n.as_str(), id))
    }

    /// The number of workers.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Always false: the table holds at least this worker.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// The entries as [`WorkerInfo`]s, in name order.
    pub fn worker_infos(&self) -> Vec<WorkerInfo> {
        self.iter()
            .filter_map(|(name, id)| WorkerInfo::with_id(name, id).ok())
            .collect()
    }
}

/// The ranks a static worker reads `names/{rank}` for, in PyTorch's order: `0..world_size`
/// without its own.
pub fn static_ranks_to_fetch(me: WorkerId, world_size: u16) -> impl Iterator<Item = WorkerId> {
    (0..world_size)
        .filter_map(|rank| i16::try_from(rank).ok())
        .map(WorkerId::from)
        .filter(move |&id| id != me)
}

/// A dynamic member's rank is taken: "RPC worker id {id} is not unique. Worker {existing}
/// and already has ID and {name} cannot be added." (PyTorch's wording; it prints both
/// names as byte vectors, rdzv as text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuplicateWorkerId {
    /// The contested id.
    pub id: WorkerId,
    /// The name already registered under it.
    pub existing: RejectedInput,
    /// The name that tried to register.
    pub name: String,
}

impl fmt::Display for DuplicateWorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RPC worker id {} is not unique. Worker {} and already has ID and {} cannot be added.",
            self.id, self.existing, self.name
        )
    }
}

#[cfg(feature = "std")]
impl std::error::Error for DuplicateWorkerId {}

/// Checks the reply of `compare_set(names/{me.id}, "", me.name)` (`collectCurrentNames`).
///
/// # Errors
/// [`DuplicateWorkerId`] if another name holds the id.
pub fn check_rank_claim(me: &WorkerInfo, returned: &[u8]) -> Result<(), DuplicateWorkerId> {
    if returned == me.name().as_bytes() {
        Ok(())
    } else {
        Err(DuplicateWorkerId {
            id: me.id(),
            existing: RejectedInput::new(&String::from_utf8_lossy(returned)),
            name: String::from(me.name()),
        })
    }
}

/// Why `_ALL_WORKER_INFOS` could not be read or changed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkerInfosError {
    /// The value is not UTF-8.
    NotUtf8,
    /// A non-empty value does not end with `,`.
    MissingTrailingComma,
    /// An entry is not `name-id`.
    MalformedEntry {
        /// The entry.
        entry: RejectedInput,
    },
    /// An entry's id is not a decimal `int16_t` without sign or padding.
    BadId {
        /// The entry.
        entry: RejectedInput,
    },
    /// An entry's name is not a valid worker name.
    InvalidName(NameError),
    /// A negative id cannot be written into the list (it would not read back).
    NegativeId {
        /// The id.
        id: WorkerId,
    },
    /// `removeCurrentName` did not find `name-id,` in the list.
    NotListed {
        /// The name.
        name: RejectedInput,
        /// The id.
        id: WorkerId,
    },
}

impl fmt::Display for WorkerInfosError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Invalid RPC worker list (_ALL_WORKER_INFOS): ")?;
        match self {
            WorkerInfosError::NotUtf8 => f.write_str("it is not UTF-8"),
            WorkerInfosError::MissingTrailingComma => f.write_str("it does not end with ','"),
            WorkerInfosError::MalformedEntry { entry } => {
                write!(f, "entry '{entry}' is not name-id")
            }
            WorkerInfosError::BadId { entry } => {
                write!(f, "entry '{entry}' has an id that is not a worker id")
            }
            WorkerInfosError::InvalidName(e) => e.fmt(f),
            WorkerInfosError::NegativeId { id } => {
                write!(f, "negative worker id {id} cannot be listed")
            }
            WorkerInfosError::NotListed { name, id } => {
                write!(f, "worker {name} with id {id} is not listed")
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for WorkerInfosError {}

fn parse_id(digits: &str) -> Option<WorkerId> {
    if digits.is_empty()
        || !digits.bytes().all(|b| b.is_ascii_digit())
        || (digits.len() > 1 && digits.starts_with('0'))
    {
        return None;
    }
    digits.parse::<i16>().ok().map(WorkerId::from)
}

/// The entries of an `_ALL_WORKER_INFOS` value, in list order, each checked.
///
/// # Errors
/// The first [`WorkerInfosError`] met: the value as a whole (UTF-8, trailing comma) is
/// checked before any entry.
pub fn parse_worker_infos(value: &[u8]) -> Result<Vec<(&str, WorkerId)>, WorkerInfosError> {
    let text = core::str::from_utf8(value).map_err(|_| WorkerInfosError::NotUtf8)?;
    if text.is_empty() {
        return Ok(Vec::new());
    }
    let body = text
        .strip_suffix(',')
        .ok_or(WorkerInfosError::MissingTrailingComma)?;
    body.split(',')
        .map(|entry| {
            let (name, id) =
                entry
                    .rsplit_once('-')
                    .ok_or_else(|| WorkerInfosError::MalformedEntry {
                        entry: RejectedInput::new(entry),
                    })?;
            let id = parse_id(id).ok_or_else(|| WorkerInfosError::BadId {
                entry: RejectedInput::new(entry),
            })?;
            validate_worker_name_bytes(name.as_bytes()).map_err(WorkerInfosError::InvalidName)?;
            Ok((name, id))
        })
        .collect()
}

/// `_ALL_WORKER_INFOS` with `name-id,` appended (`collectCurrentNames`).
///
/// # Errors
/// [`WorkerInfosError::NegativeId`] for a negative id.
pub fn append_worker_info(list: &str, me: &WorkerInfo) -> Result<String, WorkerInfosError> {
    if me.id().get() < 0 {
        return Err(WorkerInfosError::NegativeId { id: me.id() });
    }
    Ok(format!("{list}{}-{},", me.name(), me.id()))
}

/// `_ALL_WORKER_INFOS` without this worker's entry (`removeCurrentName`). Only a whole
/// entry matches: removing `a-1` from `ba-1,a-1,` leaves `ba-1,` (PyTorch erases the
/// first substring match, which would cut `ba-1,` instead).
///
/// # Errors
/// [`WorkerInfosError::NotListed`] if the entry is not there (PyTorch throws
/// `std::out_of_range` from `erase(npos)`).
pub fn remove_worker_info(list: &str, me: &WorkerInfo) -> Result<String, WorkerInfosError> {
    let entry = format!("{}-{},", me.name(), me.id());
    let mut at = 0;
    while let Some(found) = list.get(at..).and_then(|rest| rest.find(&entry)) {
        let start = at + found;
        if start == 0 || list.as_bytes().get(start - 1) == Some(&b',') {
            let mut out = String::with_capacity(list.len() - entry.len());
            out.push_str(list.get(..start).unwrap_or_default());
            out.push_str(list.get(start + entry.len()..).unwrap_or_default());
            return Ok(out);
        }
        at = start + 1;
    }
    Err(WorkerInfosError::NotListed {
        name: RejectedInput::new(me.name()),
        id: me.id(),
    })
}

/// What a member does with the reply of
/// `compare_set(RpcGroupManagementToken, "", my_token)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenStep {
    /// It holds the mutex: do the join or leave, then `set(RpcGroupManagementToken, "")`
    /// and `set({prefix}/{my_token}, "Done")`.
    Acquired,
    /// Someone else holds it: `wait([key])`, then try again.
    WaitFor {
        /// `{prefix}/{their token}`.
        key: String,
    },
}

/// Decides the next step of `_group_membership_management` from the `compare_set` reply.
/// An empty reply cannot come back from a `compare_set` from `""` to a non-empty token
/// (it writes and returns the token), so it is treated as "try again at once" by
/// returning [`TokenStep::WaitFor`] the management key itself, which exists.
pub fn token_step(keys: &RpcKeys, my_token: &str, returned: &[u8]) -> TokenStep {
    if returned == my_token.as_bytes() {
        TokenStep::Acquired
    } else if returned.is_empty() {
        TokenStep::WaitFor {
            key: keys.group_management_token(),
        }
    } else {
        TokenStep::WaitFor {
            key: keys.token_done(&String::from_utf8_lossy(returned)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;
    use alloc::vec;
    use proptest::prelude::*;

    fn info(name: &str, id: i16) -> WorkerInfo {
        WorkerInfo::new(name, i64::from(id)).unwrap()
    }

    #[test]
    fn keys_follow_the_prefix_store_layout() {
        let keys = RpcKeys::new(0);
        assert_eq!(keys.prefix(), "rpc_prefix_0");
        assert_eq!(keys.rank_name(WorkerId::from(3)), "rpc_prefix_0/names/3");
        assert_eq!(
            keys.all_worker_infos(),
            "rpc_prefix_0/names/_ALL_WORKER_INFOS"
        );
        assert_eq!(keys.address("worker1"), "rpc_prefix_0/addrs/worker1");
        let b = keys.barrier(1);
        assert_eq!(b.process_count, "rpc_prefix_0/shutdown/PROCESS_COUNT_ID_1");
        assert_eq!(b.active_calls, "rpc_prefix_0/shutdown/ACTIVE_CALLS_ID_1");
        assert_eq!(b.ready, "rpc_prefix_0/shutdown/READY_ID_1");
        assert_eq!(
            keys.join_entry(4, "worker1"),
            "rpc_prefix_0/shutdown/JOINING_4/worker1"
        );
        assert_eq!(keys.is_static_group(), "rpc_prefix_0/rpcIsStaticGroup");
        assert_eq!(
            keys.group_management_token(),
            "rpc_prefix_0/RpcGroupManagementToken"
        );
        let token = membership_token("w1", Membership::Join);
        assert_eq!(token, "Token_for_w1_join");
        assert_eq!(
            membership_token("w1", Membership::Leave),
            "Token_for_w1_leave"
        );
        assert_eq!(keys.token_done(&token), "rpc_prefix_0/Token_for_w1_join");
        assert_eq!(
            RpcKeys::new(7).rank_name(WorkerId::from(0)),
            "rpc_prefix_7/names/0"
        );
        assert_eq!(RpcKeys::with_prefix("p").address("x"), "p/addrs/x");
    }

    #[test]
    fn static_group_flag_and_its_message() {
        assert_eq!(static_group_value(true), b"true");
        assert_eq!(static_group_value(false), b"false");
        assert_eq!(check_static_group(true, b"true"), Ok(()));
        assert_eq!(check_static_group(false, b"false"), Ok(()));
        let e = check_static_group(true, b"false").unwrap_err();
        assert_eq!(
            e.to_string(),
            "RPC group mixes statically and dynamically initialized members which is not \
             supported. Static group property is initialized as true and is trying to be set \
             as false "
        );
    }

    #[test]
    fn static_collection_detects_duplicates_with_pytorchs_text() {
        let me = info("worker1", 1);
        let mut table = NameTable::new(&me);
        let ranks: Vec<_> = static_ranks_to_fetch(me.id(), 4)
            .map(WorkerId::get)
            .collect();
        assert_eq!(ranks, vec![0, 2, 3]);
        table.insert(b"worker0", WorkerId::from(0)).unwrap();
        table.insert(b"worker2", WorkerId::from(2)).unwrap();
        let err = table.insert(b"worker1", WorkerId::from(3)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "RPC worker name worker1 is not unique. Workers 1 and 3 share the same name."
        );
        assert!(matches!(
            table.insert(b"bad name", WorkerId::from(3)),
            Err(NameTableError::InvalidName(_))
        ));
        assert_eq!(
            table.insert(b"other", WorkerId::from(2)),
            Err(NameTableError::DuplicateId {
                id: WorkerId::from(2)
            })
        );
        assert_eq!(table.len(), 3);
        assert_eq!(table.get("worker2"), Some(WorkerId::from(2)));
        let names: Vec<_> = table.iter().map(|(n, _)| n).collect();
        assert_eq!(names, vec!["worker0", "worker1", "worker2"]);
        assert_eq!(table.worker_infos().len(), 3);
    }

    #[test]
    fn rank_claims() {
        let me = info("w", 2);
        assert_eq!(check_rank_claim(&me, b"w"), Ok(()));
        let e = check_rank_claim(&me, b"other").unwrap_err();
        assert_eq!(
            e.to_string(),
            "RPC worker id 2 is not unique. Worker other and already has ID and w cannot be \
             added."
        );
    }

    #[test]
    fn worker_infos_encode_and_parse() {
        let list = append_worker_info("", &info("name1", 0)).unwrap();
        let list = append_worker_info(&list, &info("name2", 1)).unwrap();
        assert_eq!(list, "name1-0,name2-1,");
        assert_eq!(
            parse_worker_infos(list.as_bytes()).unwrap(),
            vec![("name1", WorkerId::from(0)), ("name2", WorkerId::from(1))]
        );
        assert_eq!(parse_worker_infos(b"").unwrap(), vec![]);
        // Names with dashes read back whole (PyTorch splits at the first '-').
        let dashed = append_worker_info("", &info("trainer-1", 3)).unwrap();
        assert_eq!(
            parse_worker_infos(dashed.as_bytes()).unwrap(),
            vec![("trainer-1", WorkerId::from(3))]
        );
        assert_eq!(
            append_worker_info("", &info("neg", -1)),
            Err(WorkerInfosError::NegativeId {
                id: WorkerId::from(-1)
            })
        );
    }

    #[test]
    fn worker_infos_parse_errors() {
        assert_eq!(parse_worker_infos(b"\xff,"), Err(WorkerInfosError::NotUtf8));
        assert_eq!(
            parse_worker_infos(b"a-1"),
            Err(WorkerInfosError::MissingTrailingComma)
        );
        assert!(matches!(
            parse_worker_infos(b"a1,"),
            Err(WorkerInfosError::MalformedEntry { .. })
        ));
        assert!(matches!(
            parse_worker_infos(b","),
            Err(WorkerInfosError::MalformedEntry { .. })
        ));
        for bad in [
            &b"a-,"[..],
            b"a-x,",
            b"a- 1,",
            b"a-01,",
            b"a-+1,",
            b"a-40000,",
        ] {
            assert!(
                matches!(parse_worker_infos(bad), Err(WorkerInfosError::BadId { .. })),
                "{bad:?}"
            );
        }
        assert!(matches!(
            parse_worker_infos(b"-1,"),
            Err(WorkerInfosError::InvalidName(NameError::Empty))
        ));
        assert!(matches!(
            parse_worker_infos(b"a b-1,"),
            Err(WorkerInfosError::InvalidName(_))
        ));
        let e = parse_worker_infos(b"a1,").unwrap_err();
        assert_eq!(
            e.to_string(),
            "Invalid RPC worker list (_ALL_WORKER_INFOS): entry 'a1' is not name-id"
        );
    }

    #[test]
    fn removal_matches_whole_entries_only() {
        assert_eq!(
            remove_worker_info("a-0,b-1,c-2,", &info("b", 1)).unwrap(),
            "a-0,c-2,"
        );
        assert_eq!(
            remove_worker_info("ba-1,a-1,", &info("a", 1)).unwrap(),
            "ba-1,"
        );
        assert_eq!(remove_worker_info("a-1,", &info("a", 1)).unwrap(), "");
        assert!(matches!(
            remove_worker_info("a-0,", &info("a", 1)),
            Err(WorkerInfosError::NotListed { .. })
        ));
        assert!(matches!(
            remove_worker_info("ba-1,", &info("a", 1)),
            Err(WorkerInfosError::NotListed { .. })
        ));
    }

    #[test]
    fn token_protocol() {
        let keys = RpcKeys::new(0);
        let mine = membership_token("w2", Membership::Join);
        assert_eq!(
            token_step(&keys, &mine, mine.as_bytes()),
            TokenStep::Acquired
        );
        assert_eq!(
            token_step(&keys, &mine, b"Token_for_w1_leave"),
            TokenStep::WaitFor {
                key: "rpc_prefix_0/Token_for_w1_leave".to_string()
            }
        );
        assert_eq!(
            token_step(&keys, &mine, b""),
            TokenStep::WaitFor {
                key: keys.group_management_token()
            }
        );
        assert_eq!(TOKEN_DONE, b"Done");
    }

    fn name_strategy() -> impl Strategy<Value = String> {
        "[A-Za-z0-9_:-]{1,20}"
    }

    proptest! {
        #[test]
        fn worker_lists_round_trip(entries in proptest::collection::btree_map(
            name_strategy(), 0i16..i16::MAX, 0..12)) {
            let mut list = String::new();
            for (name, &id) in &entries {
                list = append_worker_info(&list, &info(name, id)).unwrap();
            }
            let parsed = parse_worker_infos(list.as_bytes()).unwrap();
            let expected: Vec<_> = entries.iter().map(|(n, &id)| (n.as_str(), WorkerId::from(id))).collect();
            prop_assert_eq!(&parsed, &expected);
            // Removing each entry in turn leaves the others, in order.
            for (name, &id) in &entries {
                let shorter = remove_worker_info(&list, &info(name, id)).unwrap();
                let rest = parse_worker_infos(shorter.as_bytes()).unwrap();
                let others: Vec<_> = expected.iter().copied().filter(|(n, _)| n != name).collect();
                prop_assert_eq!(rest, others);
            }
        }

        #[test]
        fn parsing_never_panics(value in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(entries) = parse_worker_infos(&value) {
                // What parses re-encodes to the same bytes.
                let mut list = String::new();
                for (name, id) in entries {
                    list = append_worker_info(&list, &WorkerInfo::with_id(name, id).unwrap()).unwrap();
                }
                prop_assert_eq!(list.as_bytes(), &value[..]);
            }
        }
    }
}
