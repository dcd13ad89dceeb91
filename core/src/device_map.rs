//! Device maps: which local device a tensor leaves from and which remote device it lands
//! on, per peer; their validation, their reverse, and the device list an RPC agent uses.
//!
//! This module re-creates `torch/distributed/rpc/backend_registry.py`:
//! [`validate_device_maps`] is `_validate_device_maps` (every check, in the same order,
//! with the same messages, for static and dynamic groups), [`create_reverse_mapping`] is
//! `_create_reverse_mapping`, [`create_device_list`] is `_create_device_list` and
//! [`exchange_and_check_device_maps`] is what `_tensorpipe_exchange_and_check_all_device_maps`
//! does once the `all_gather_object` has returned. Worker names are strings; a
//! [`DeviceMap`] maps a local [`Device`] to a remote one, and [`DeviceMaps`] holds one per
//! peer name. Both keep insertion order, as Python dicts do, because PyTorch's error
//! messages print them in that order.
//!
//! It does not gather anything from peers, ask CUDA how many devices there are, or decide
//! which tensors go where at send time: each worker's `device_count` and `devices` are
//! inputs ([`WorkerDevices`]), collected by whoever runs the group.
//!
//! Where PyTorch would crash with a `TypeError` (a `cuda` device without an index in a
//! place where its index is compared with the device count, or a sort that mixes `cuda`
//! with `cuda:N`), rdzv treats the index-less device as invalid, respectively sorts it
//! first.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use crate::device::{Device, DeviceType};

/// A map from local devices to the remote devices a peer should use for them
/// (`Dict[torch.device, torch.device]`).
///
/// Keys are unique; inserting an existing key replaces its value in place, as a Python
/// dict does, and iteration follows insertion order. Values need not be unique here (a
/// map received from a peer may be invalid); [`validate_device_maps`] rejects maps that
/// are not one-to-one. Equality ignores order, as dict equality does.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(from = "Vec<(Device, Device)>", into = "Vec<(Device, Device)>")]
pub struct DeviceMap {
    entries: Vec<(Device, Device)>,
}

impl DeviceMap {
    /// An empty map.
    pub const fn new() -> Self {
        DeviceMap {
            entries: Vec::new(),
        }
    }

    /// Maps `local` to `remote`, returning the remote device `local` was mapped to before.
    pub fn insert(&mut self, local: Device, remote: Device) -> Option<Device> {
        match self.entries.iter_mut().find(|(k, _)| *k == local) {
            Some((_, v)) => Some(core::mem::replace(v, remote)),
            None => {
                self.entries.push((local, remote));
                None
            }
        }
    }

    /// The remote device `local` maps to.
    pub fn get(&self, local: &Device) -> Option<Device> {
        self.entries
            .iter()
            .find(|(k, _)| k == local)
            .map(|&(_, v)| v)
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the map has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The `(local, remote)` entries in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (Device, Device)> + '_ {
        self.entries.iter().copied()
    }

    /// The local devices (keys), in insertion order.
    pub fn sources(&self) -> impl Iterator<Item = Device> + '_ {
        self.entries.iter().map(|&(k, _)| k)
    }

    /// The remote devices (values), in insertion order.
    pub fn targets(&self) -> impl Iterator<Item = Device> + '_ {
        self.entries.iter().map(|&(_, v)| v)
    }

    /// Whether no two local devices map to the same remote device.
    pub fn is_injective(&self) -> bool {
        !has_duplicates(self.targets())
    }

    /// `{v: k for k, v in map.items()}`: for a one-to-one map, its inverse. (For a map that
    /// is not one-to-one the last local device wins, at the position of the first, as in
    /// Python.)
    pub fn reversed(&self) -> DeviceMap {
        self.iter().map(|(k, v)| (v, k)).collect()
    }

    /// Shows the map as Python's `repr` of the dict does:
    /// `{device(type='cuda', index=0): device(type='cuda', index=1)}`.
    pub fn repr(&self) -> DeviceMapRepr<'_> {
        DeviceMapRepr(self)
    }
}

impl PartialEq for DeviceMap {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().all(|(k, v)| other.get(&k) == Some(v))
    }
}

impl Eq for DeviceMap {}

impl FromIterator<(Device, Device)> for DeviceMap {
    fn from_iter<I: IntoIterator<Item = (Device, Device)>>(iter: I) -> Self {
        let mut map = DeviceMap::new();
        for (k, v) in iter {
            map.insert(k, v);
        }
        map
    }
}

impl From<Vec<(Device, Device)>> for DeviceMap {
    fn from(entries: Vec<(Device, Device)>) -> Self {
        entries.into_iter().collect()
    }
}

impl From<DeviceMap> for Vec<(Device, Device)> {
    fn from(map: DeviceMap) -> Self {
        map.entries
    }
}

impl<const N: usize> From<[(Device, Device); N]> for DeviceMap {
    fn from(entries: [(Device, Device); N]) -> Self {
        entries.into_iter().collect()
    }
}

/// Shows a [`DeviceMap`] as Python's dict `repr`; made by [`DeviceMap::repr`].
#[derive(Debug, Clone, Copy)]
pub struct DeviceMapRepr<'a>(&'a DeviceMap);

impl fmt::Display for DeviceMapRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}: {}", k.repr(), v.repr())?;
        }
        f.write_str("}")
    }
}

/// One [`DeviceMap`] per peer worker name (`Dict[str, Dict[torch.device, torch.device]]`),
/// in insertion order, with unique names.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(from = "Vec<(String, DeviceMap)>", into = "Vec<(String, DeviceMap)>")]
pub struct DeviceMaps {
    entries: Vec<(String, DeviceMap)>,
}

impl DeviceMaps {
    /// No maps.
    pub const fn new() -> Self {
        DeviceMaps {
            entries: Vec::new(),
        }
    }

    /// Sets the map for `peer`, returning the one it replaces.
    pub fn insert(&mut self, peer: impl Into<String>, map: DeviceMap) -> Option<DeviceMap> {
        let peer = peer.into();
        match self.entries.iter_mut().find(|(name, _)| *name == peer) {
            Some((_, old)) => Some(core::mem::replace(old, map)),
            None => {
                self.entries.push((peer, map));
                None
            }
        }
    }

    /// The map for `peer`.
    pub fn get(&self, peer: &str) -> Option<&DeviceMap> {
        self.entries
            .iter()
            .find(|(name, _)| name == peer)
            .map(|(_, map)| map)
    }

    /// The number of peers with a map.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no maps.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The peers with a map, in insertion order.
    pub fn peers(&self) -> impl Iterator<Item = &str> + '_ {
        self.entries.iter().map(|(name, _)| name.as_str())
    }

    /// `(peer, map)` in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &DeviceMap)> + '_ {
        self.entries.iter().map(|(name, map)| (name.as_str(), map))
    }
}

impl PartialEq for DeviceMaps {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().all(|(peer, map)| other.get(peer) == Some(map))
    }
}

impl Eq for DeviceMaps {}

impl<S: Into<String>> FromIterator<(S, DeviceMap)> for DeviceMaps {
    fn from_iter<I: IntoIterator<Item = (S, DeviceMap)>>(iter: I) -> Self {
        let mut maps = DeviceMaps::new();
        for (peer, map) in iter {
            maps.insert(peer, map);
        }
        maps
    }
}

impl From<Vec<(String, DeviceMap)>> for DeviceMaps {
    fn from(entries: Vec<(String, DeviceMap)>) -> Self {
        entries.into_iter().collect()
    }
}

impl From<DeviceMaps> for Vec<(String, DeviceMap)> {
    fn from(maps: DeviceMaps) -> Self {
        maps.entries
    }
}

/// What one worker contributes to device-map validation: the tuple
/// `(name, device_count, device_maps, devices)` that PyTorch gathers from every worker.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkerDevices {
    /// The worker's name.
    pub name: String,
    /// How many CUDA devices it sees (`torch.cuda.device_count()`).
    pub device_count: u32,
    /// Its device maps, keyed by destination worker name (`options.device_maps`).
    pub device_maps: DeviceMaps,
    /// The devices it said it would use (`options.devices`); empty means "derive them".
    pub devices: Vec<Device>,
}

/// Whether the group's membership is fixed at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// `world_size` was given: every worker is known, so device maps may only name them.
    Static,
    /// Workers join and leave: a map may name a worker that has not joined yet.
    Dynamic,
}

/// Why a set of device maps was rejected. `Display` is `_validate_device_maps`'s
/// `ValueError` text.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceMapError {
    /// A worker listed the same device twice in `devices`.
    DuplicatedDevices {
        /// The worker.
        node: String,
        /// Its devices.
        devices: Vec<Device>,
    },
    /// A worker listed a CUDA device that it does not have.
    InvalidDeviceIndices {
        /// The worker.
        node: String,
        /// Its devices.
        devices: Vec<Device>,
        /// Its device count.
        device_count: u32,
    },
    /// A worker has a device map for a name that is not in the (static) group.
    InvalidTargetNames {
        /// The worker.
        node: String,
        /// The names its device maps are for.
        targets: Vec<String>,
        /// The names of every worker in the group.
        names: Vec<String>,
    },
    /// A device map sends two local devices to the same remote device.
    DuplicatedTargetDevices {
        /// The worker whose map it is.
        node: String,
        /// The peer the map is for.
        target: String,
        /// The map.
        map: DeviceMap,
    },
    /// A device map uses a local device that the worker did not list in `devices`.
    UnexpectedSourceDevices {
        /// The worker whose map it is.
        node: String,
        /// The peer the map is for.
        target: String,
        /// The map.
        map: DeviceMap,
        /// The worker's devices.
        devices: Vec<Device>,
    },
    /// A device map uses a local CUDA device that the worker does not have.
    InvalidSourceIndices {
        /// The worker whose map it is.
        node: String,
        /// The peer the map is for.
        target: String,
        /// The map.
        map: DeviceMap,
        /// The worker's device count.
        device_count: u32,
    },
    /// A device map sends tensors to a device that the peer did not list in `devices`.
    UnexpectedTargetDevices {
        /// The worker whose map it is.
        node: String,
        /// The peer the map is for.
        target: String,
        /// The map.
        map: DeviceMap,
        /// The peer's devices.
        devices: Vec<Device>,
    },
    /// A device map sends tensors to a CUDA device that the peer does not have.
    InvalidTargetIndices {
        /// The worker whose map it is.
        node: String,
        /// The peer the map is for.
        target: String,
        /// The map.
        map: DeviceMap,
        /// The peer's device count.
        device_count: u32,
    },
}

impl fmt::Display for DeviceMapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceMapError::DuplicatedDevices { node, devices } => write!(
                f,
                "Node {node} has duplicated devices\ndevices = {}",
                DeviceList(devices)
            ),
            DeviceMapError::InvalidDeviceIndices {
                node,
                devices,
                device_count,
            } => write!(
                f,
                "Node {node} has devices with invalid indices\ndevices = {}\n\
                 device count = {device_count}",
                DeviceList(devices)
            ),
            DeviceMapError::InvalidTargetNames {
                node,
                targets,
                names,
            } => write!(
                f,
                "Node {node} has invalid target node names in its device maps\n\
                 device maps = dict_keys({})\nnode names = {}",
                NameList(targets),
                NameList(names)
            ),
            DeviceMapError::DuplicatedTargetDevices { node, target, map } => write!(
                f,
                "Node {node} has duplicated target devices in its device map for {target}\n\
                 device map = {}",
                map.repr()
            ),
            DeviceMapError::UnexpectedSourceDevices {
                node,
                target,
                map,
                devices,
            } => write!(
                f,
                "Node {node} has unexpected source devices in its device map for {target}\n\
                 device map = {}\ndevices = {}",
                map.repr(),
                DeviceList(devices)
            ),
            DeviceMapError::InvalidSourceIndices {
                node,
                target,
                map,
                device_count,
            } => write!(
                f,
                "Node {node} has source devices with invalid indices in its device map for \
                 {target}\ndevice map = {}\ndevice count = {device_count}",
                map.repr()
            ),
            DeviceMapError::UnexpectedTargetDevices {
                node,
                target,
                map,
                devices,
            } => write!(
                f,
                "Node {node} has unexpected target devices in its device map for {target}\n\
                 device map = {}\ndevices = {}",
                map.repr(),
                DeviceList(devices)
            ),
            DeviceMapError::InvalidTargetIndices {
                node,
                target,
                map,
                device_count,
            } => write!(
                f,
                "Node {node} has target devices with invalid indices in its device map for \
                 {target}\ndevice map = {}\ndevice count = {device_count}",
                map.repr()
            ),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for DeviceMapError {}

/// A list of devices as Python prints it: `[device(type='cuda', index=0)]`.
struct DeviceList<'a>(&'a [Device]);

impl fmt::Display for DeviceList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}", d.repr())?;
        }
        f.write_str("]")
    }
}

/// A list of strings as Python prints it: `['worker0', 'worker1']`.
struct NameList<'a>(&'a [String]);

impl fmt::Display for NameList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, name) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}", PyStr(name))?;
        }
        f.write_str("]")
    }
}

/// A string as Python's `repr` prints it: single quotes unless the text has a single
/// quote and no double quote, backslash escapes for the quote, `\\`, `\t`, `\n`, `\r`,
/// and `\x`/`\u`/`\U` escapes for control characters (Python also escapes a few other
/// non-printable code points, e.g. unassigned ones; those are printed as they are).
struct PyStr<'a>(&'a str);

impl fmt::Display for PyStr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write;
        let quote = if self.0.contains('\'') && !self.0.contains('"') {
            '"'
        } else {
            '\''
        };
        f.write_char(quote)?;
        for ch in self.0.chars() {
            match ch {
                '\\' => f.write_str("\\\\")?,
                '\t' => f.write_str("\\t")?,
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                c if c == quote => write!(f, "\\{c}")?,
                c if c.is_control() => match u32::from(c) {
                    n @ 0..=0xff => write!(f, "\\x{n:02x}")?,
                    n @ 0x100..=0xffff => write!(f, "\\u{n:04x}")?,
                    n => write!(f, "\\U{n:08x}")?,
                },
                c => f.write_char(c)?,
            }
        }
        f.write_char(quote)
    }
}

/// `_tensorpipe_validate_devices`: every device is a CPU, or a CUDA device whose index is
/// below `device_count` (an index-less `cuda` is invalid here; Python raises `TypeError`).
fn devices_are_valid(devices: impl IntoIterator<Item = Device>, device_count: u32) -> bool {
    devices.into_iter().all(|d| match d.kind() {
        DeviceType::Cpu => true,
        DeviceType::Cuda => d.index().is_some_and(|i| u32::from(i) < device_count),
    })
}

fn has_duplicates(devices: impl IntoIterator<Item = Device>) -> bool {
    let mut seen = alloc::collections::BTreeSet::new();
    devices.into_iter().any(|d| !seen.insert(d))
}

/// The entry for `name`, with dict semantics: PyTorch builds `{name: … for … in gathered}`
/// so the last worker with a name wins.
fn lookup<'a>(workers: &'a [WorkerDevices], name: &str) -> Option<&'a WorkerDevices> {
    workers.iter().rev().find(|w| w.name == name)
}

/// `_validate_device_maps(all_names, all_device_counts, all_device_maps, all_devices,
/// is_static_group)`, with `workers` in `all_names` order.
///
/// Checks, in this order, stopping at the first failure:
/// 1. for every worker: no device twice in `devices`; every CUDA device in `devices`
///    below its `device_count`;
/// 2. for every worker: in a [`GroupKind::Static`] group, every peer named by its device
///    maps is a worker; then for every `(peer, map)`: the map is one-to-one; its local
///    devices are in `devices` (if `devices` is not empty) or else valid for the
///    worker's `device_count`; its remote devices are in the peer's `devices` (if the peer
///    is known and its `devices` is not empty) or else valid for the peer's
///    `device_count` (if the peer is known; a dynamic group cannot check a peer that has
///    not joined).
pub fn validate_device_maps(
    workers: &[WorkerDevices],
    group: GroupKind,
) -> Result<(), DeviceMapError> {
    for node in workers {
        let Some(node) = lookup(workers, &node.name) else {
            continue;
        };
        if has_duplicates(node.devices.iter().copied()) {
            return Err(DeviceMapError::DuplicatedDevices {
                node: node.name.clone(),
                devices: node.devices.clone(),
            });
        }
        if !devices_are_valid(node.devices.iter().copied(), node.device_count) {
            return Err(DeviceMapError::InvalidDeviceIndices {
                node: node.name.clone(),
                devices: node.devices.clone(),
                device_count: node.device_count,
            });
        }
    }
    for source in workers {
        let Some(source) = lookup(workers, &source.name) else {
            continue;
        };
        if group == GroupKind::Static
            && !source
                .device_maps
                .peers()
                .all(|peer| lookup(workers, peer).is_some())
        {
            return Err(DeviceMapError::InvalidTargetNames {
                node: source.name.clone(),
                targets: source.device_maps.peers().map(String::from).collect(),
                names: workers.iter().map(|w| w.name.clone()).collect(),
            });
        }
        for (target, map) in source.device_maps.iter() {
            if !map.is_injective() {
                return Err(DeviceMapError::DuplicatedTargetDevices {
                    node: source.name.clone(),
                    target: target.into(),
                    map: map.clone(),
                });
            }
            if !source.devices.is_empty() {
                if !map.sources().all(|d| source.devices.contains(&d)) {
                    return Err(DeviceMapError::UnexpectedSourceDevices {
                        node: source.name.clone(),
                        target: target.into(),
                        map: map.clone(),
                        devices: source.devices.clone(),
                    });
                }
            } else if !devices_are_valid(map.sources(), source.device_count) {
                return Err(DeviceMapError::InvalidSourceIndices {
                    node: source.name.clone(),
                    target: target.into(),
                    map: map.clone(),
                    device_count: source.device_count,
                });
            }
            let peer = lookup(workers, target);
            let peer_devices = peer.map_or(&[][..], |p| p.devices.as_slice());
            if !peer_devices.is_empty() {
                if !map.targets().all(|d| peer_devices.contains(&d)) {
                    return Err(DeviceMapError::UnexpectedTargetDevices {
                        node: source.name.clone(),
                        target: target.into(),
                        map: map.clone(),
                        devices: peer_devices.to_vec(),
                    });
                }
            } else if let Some(peer) = peer {
                if !devices_are_valid(map.targets(), peer.device_count) {
                    return Err(DeviceMapError::InvalidTargetIndices {
                        node: source.name.clone(),
                        target: target.into(),
                        map: map.clone(),
                        device_count: peer.device_count,
                    });
                }
            }
        }
    }
    Ok(())
}

/// `_create_reverse_mapping(my_name, all_names, all_device_maps)`: for every worker (in
/// `workers` order) that has a device map for `my_name`, that map reversed, keyed by the
/// worker's name. An RPC agent uses these to send responses back.
pub fn create_reverse_mapping(my_name: &str, workers: &[WorkerDevices]) -> DeviceMaps {
    let mut reverse = DeviceMaps::new();
    for node in workers {
        let Some(node) = lookup(workers, &node.name) else {
            continue;
        };
        if let Some(map) = node.device_maps.get(my_name) {
            reverse.insert(node.name.clone(), map.reversed());
        }
    }
    reverse
}

/// `_create_device_list(my_devices, my_device_maps, reverse_device_maps)`: the devices an
/// agent uses.
///
/// If `my_devices` is empty they are the local devices of every map and reverse map, once
/// each, without `cpu` (an explicit `cpu:0` stays, as in PyTorch). Either way the list is
/// sorted by index, stably; devices with equal indices keep the order given (derived
/// devices, which Python collects in a set, come in [`Device`] order), and an index-less
/// `cuda` sorts first.
pub fn create_device_list(
    my_devices: &[Device],
    my_device_maps: &DeviceMaps,
    reverse_device_maps: &DeviceMaps,
) -> Vec<Device> {
    let mut devices: Vec<Device> = if my_devices.is_empty() {
        let mut set = alloc::collections::BTreeSet::new();
        for (_, map) in my_device_maps.iter().chain(reverse_device_maps.iter()) {
            set.extend(map.sources());
        }
        set.remove(&Device::CPU);
        set.into_iter().collect()
    } else {
        my_devices.to_vec()
    };
    devices.sort_by_key(|d| d.index());
    devices
}

/// What a static group's agent needs once every worker's [`WorkerDevices`] is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSetup {
    /// Maps for sending responses, keyed by the worker whose requests they answer.
    pub reverse_device_maps: DeviceMaps,
    /// The devices the agent uses.
    pub devices: Vec<Device>,
}

/// The part of `_tensorpipe_exchange_and_check_all_device_maps` after the
/// `all_gather_object`: validate every worker's maps as a static group, then build `me`'s
/// reverse maps and device list. `workers` is the gathered list (including `me`), in rank
/// order.
pub fn exchange_and_check_device_maps(
    me: &WorkerDevices,
    workers: &[WorkerDevices],
) -> Result<DeviceSetup, DeviceMapError> {
    validate_device_maps(workers, GroupKind::Static)?;
    let reverse_device_maps = create_reverse_mapping(&me.name, workers);
    let devices = create_device_list(&me.devices, &me.device_maps, &reverse_device_maps);
    Ok(DeviceSetup {
        reverse_device_maps,
        devices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::format;
    use alloc::string::ToString;
    use alloc::vec;
    use proptest::prelude::*;

    fn cuda(i: u8) -> Device {
        Device::cuda(i)
    }

    fn worker(
        name: &str,
        device_count: u32,
        maps: DeviceMaps,
        devices: &[Device],
    ) -> WorkerDevices {
        WorkerDevices {
            name: name.into(),
            device_count,
            device_maps: maps,
            devices: devices.to_vec(),
        }
    }

    fn maps<const N: usize>(entries: [(&str, DeviceMap); N]) -> DeviceMaps {
        entries.into_iter().collect()
    }

    fn err(workers: &[WorkerDevices], group: GroupKind) -> String {
        match validate_device_maps(workers, group) {
            Ok(()) => panic!("accepted {workers:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn duplicated_devices() {
        let w = [worker(
            "w0",
            2,
            DeviceMaps::new(),
            &[cuda(0), cuda(1), cuda(0)],
        )];
        assert_eq!(
            err(&w, GroupKind::Static),
            "Node w0 has duplicated devices\ndevices = [device(type='cuda', index=0), \
             device(type='cuda', index=1), device(type='cuda', index=0)]"
        );
    }

    #[test]
    fn devices_with_invalid_indices() {
        let w = [
            worker("w0", 2, DeviceMaps::new(), &[cuda(0)]),
            worker("w1", 1, DeviceMaps::new(), &[Device::CPU, cuda(1)]),
        ];
        assert_eq!(
            err(&w, GroupKind::Dynamic),
            "Node w1 has devices with invalid indices\n\
             devices = [device(type='cpu'), device(type='cuda', index=1)]\ndevice count = 1"
        );
        // An index-less `cuda` is not a valid entry (PyTorch: TypeError).
        let w = [worker(
            "w0",
            1,
            DeviceMaps::new(),
            &[Device::cuda_current()],
        )];
        assert_eq!(
            err(&w, GroupKind::Static),
            "Node w0 has devices with invalid indices\ndevices = [device(type='cuda')]\n\
             device count = 1"
        );
    }

    #[test]
    fn invalid_target_node_names_static_only() {
        let m = DeviceMap::from([(cuda(0), cuda(0))]);
        let w = [
            worker("w0", 1, maps([("w1", m.clone()), ("w9", m.clone())]), &[]),
            worker("w1", 1, DeviceMaps::new(), &[]),
        ];
        assert_eq!(
            err(&w, GroupKind::Static),
            "Node w0 has invalid target node names in its device maps\n\
             device maps = dict_keys(['w1', 'w9'])\nnode names = ['w0', 'w1']"
        );
        // A dynamic group accepts a map for a worker that has not joined yet, and cannot
        // check its targets.
        let w = [worker(
            "w0",
            1,
            maps([("late", DeviceMap::from([(cuda(0), cuda(7))]))]),
            &[],
        )];
        assert_eq!(validate_device_maps(&w, GroupKind::Dynamic), Ok(()));
    }

    #[test]
    fn duplicated_target_devices() {
        let m = DeviceMap::from([(cuda(0), cuda(1)), (cuda(1), cuda(1))]);
        let w = [
            worker("w0", 2, maps([("w1", m)]), &[]),
            worker("w1", 2, DeviceMaps::new(), &[]),
        ];
        let expected = "Node w0 has duplicated target devices in its device map for w1\n\
                        device map = {device(type='cuda', index=0): device(type='cuda', index=1), \
                        device(type='cuda', index=1): device(type='cuda', index=1)}";
        assert_eq!(err(&w, GroupKind::Static), expected);
        assert_eq!(err(&w, GroupKind::Dynamic), expected);
    }

    #[test]
    fn unexpected_source_devices() {
        let m = DeviceMap::from([(cuda(1), cuda(0))]);
        let w = [
            worker("w0", 2, maps([("w1", m)]), &[cuda(0)]),
            worker("w1", 2, DeviceMaps::new(), &[]),
        ];
        assert_eq!(
            err(&w, GroupKind::Static),
            "Node w0 has unexpected source devices in its device map for w1\n\
             device map = {device(type='cuda', index=1): device(type='cuda', index=0)}\n\
             devices = [device(type='cuda', index=0)]"
        );
    }

    #[test]
    fn source_devices_with_invalid_indices() {
        let m = DeviceMap::from([(Device::CPU, Device::CPU), (cuda(2), cuda(0))]);
        let w = [
            worker("w0", 2, maps([("w1", m)]), &[]),
            worker("w1", 2, DeviceMaps::new(), &[]),
        ];
        assert_eq!(
            err(&w, GroupKind::Static),
            "Node w0 has source devices with invalid indices in its device map for w1\n\
             device map = {device(type='cpu'): device(type='cpu'), \
             device(type='cuda', index=2): device(type='cuda', index=0)}\ndevice count = 2"
        );
    }

    #[test]
    fn unexpected_target_devices() {
        let m = DeviceMap::from([(cuda(0), cuda(1))]);
        let w = [
            worker("w0", 2, maps([("w1", m)]), &[]),
            worker("w1", 2, DeviceMaps::new(), &[cuda(0)]),
        ];
        assert_eq!(
            err(&w, GroupKind::Dynamic),
            "Node w0 has unexpected target devices in its device map for w1\n\
             device map = {device(type='cuda', index=0): device(type='cuda', index=1)}\n\
             devices = [device(type='cuda', index=0)]"
        );
    }

    #[test]
    fn target_devices_with_invalid_indices() {
        let m = DeviceMap::from([(cuda(0), cuda(3))]);
        let w = [
            worker("w0", 1, maps([("w1", m)]), &[]),
            worker("w1", 3, DeviceMaps::new(), &[]),
        ];
        assert_eq!(
            err(&w, GroupKind::Static),
            "Node w0 has target devices with invalid indices in its device map for w1\n\
             device map = {device(type='cuda', index=0): device(type='cuda', index=3)}\n\
             device count = 3"
        );
    }

    #[test]
    fn checks_run_in_the_seed_order() {
        // Per-worker device checks for every worker come before any map check.
        let bad_map = DeviceMap::from([(cuda(5), cuda(0))]);
        let w = [
            worker("w0", 1, maps([("w1", bad_map)]), &[]),
            worker("w1", 1, DeviceMaps::new(), &[cuda(0), cuda(0)]),
        ];
        assert!(err(&w, GroupKind::Static).starts_with("Node w1 has duplicated devices"));
        // Target-name check comes before the per-map checks of the same worker.
        let dup = DeviceMap::from([(cuda(0), cuda(0)), (cuda(1), cuda(0))]);
        let w = [worker(
            "w0",
            2,
            maps([("w0", dup), ("nobody", DeviceMap::new())]),
            &[],
        )];
        assert!(err(&w, GroupKind::Static).contains("invalid target node names"));
        assert!(err(&w, GroupKind::Dynamic).contains("duplicated target devices"));
    }

    #[test]
    fn a_valid_group_passes_and_yields_its_setup() {
        let w0 = worker(
            "w0",
            2,
            maps([(
                "w1",
                DeviceMap::from([(cuda(0), cuda(1)), (cuda(1), cuda(0))]),
            )]),
            &[],
        );
        let w1 = worker(
            "w1",
            2,
            maps([("w0", DeviceMap::from([(cuda(1), cuda(1))]))]),
            &[],
        );
        let all = [w0.clone(), w1.clone()];
        let setup = exchange_and_check_device_maps(&w0, &all).unwrap();
        assert_eq!(
            setup.reverse_device_maps,
            maps([("w1", DeviceMap::from([(cuda(1), cuda(1))]))])
        );
        assert_eq!(setup.devices, vec![cuda(0), cuda(1)]);
        let setup = exchange_and_check_device_maps(&w1, &all).unwrap();
        assert_eq!(
            setup.reverse_device_maps,
            maps([(
                "w0",
                DeviceMap::from([(cuda(1), cuda(0)), (cuda(0), cuda(1))])
            )])
        );
        assert_eq!(setup.devices, vec![cuda(0), cuda(1)]);
    }

    #[test]
    fn reverse_mapping_follows_the_seed() {
        let w = [
            worker(
                "a",
                2,
                maps([("me", DeviceMap::from([(cuda(0), cuda(1))]))]),
                &[],
            ),
            worker(
                "b",
                2,
                maps([("a", DeviceMap::from([(cuda(0), cuda(1))]))]),
                &[],
            ),
            worker(
                "me",
                2,
                maps([("me", DeviceMap::from([(cuda(1), cuda(0))]))]),
                &[],
            ),
        ];
        let reverse = create_reverse_mapping("me", &w);
        assert_eq!(reverse.peers().collect::<Vec<_>>(), ["a", "me"]);
        assert_eq!(
            reverse.get("a"),
            Some(&DeviceMap::from([(cuda(1), cuda(0))]))
        );
        assert_eq!(
            reverse.get("me"),
            Some(&DeviceMap::from([(cuda(0), cuda(1))]))
        );
        assert!(create_reverse_mapping("nobody", &w).is_empty());
    }

    #[test]
    fn device_list_derivation() {
        let mine = maps([(
            "p",
            DeviceMap::from([(cuda(3), cuda(0)), (Device::CPU, cuda(1))]),
        )]);
        let reverse = maps([(
            "q",
            DeviceMap::from([(cuda(1), cuda(2)), (cuda(3), cuda(1))]),
        )]);
        // Derived: union of local devices, `cpu` dropped, sorted by index.
        assert_eq!(
            create_device_list(&[], &mine, &reverse),
            vec![cuda(1), cuda(3)]
        );
        // Given: kept as given (duplicates included), sorted by index.
        assert_eq!(
            create_device_list(&[cuda(2), cuda(0)], &mine, &reverse),
            vec![cuda(0), cuda(2)]
        );
        // `cpu:0` is not `cpu` and stays, as in PyTorch; ties keep Device order.
        let cpu0: Device = "cpu:0".parse().unwrap();
        let odd = maps([(
            "p",
            DeviceMap::from([(cuda(0), cuda(0)), (cpu0, Device::CPU)]),
        )]);
        assert_eq!(
            create_device_list(&[], &odd, &DeviceMaps::new()),
            vec![cpu0, cuda(0)]
        );
        assert!(create_device_list(&[], &DeviceMaps::new(), &DeviceMaps::new()).is_empty());
    }

    #[test]
    fn device_map_behaves_like_a_dict() {
        let mut m = DeviceMap::new();
        assert_eq!(m.insert(cuda(0), cuda(1)), None);
        assert_eq!(m.insert(cuda(2), cuda(3)), None);
        assert_eq!(m.insert(cuda(0), cuda(4)), Some(cuda(1)));
        assert_eq!(m.sources().collect::<Vec<_>>(), [cuda(0), cuda(2)]);
        assert_eq!(m.get(&cuda(0)), Some(cuda(4)));
        assert_eq!(
            m,
            DeviceMap::from([(cuda(2), cuda(3)), (cuda(0), cuda(4))]),
            "equality ignores order"
        );
        assert_eq!(DeviceMap::new().repr().to_string(), "{}");
        // Reversing a map that is not one-to-one: the last key wins at the first position.
        let m = DeviceMap::from([(cuda(0), cuda(9)), (cuda(1), cuda(9))]);
        assert_eq!(
            m.reversed().iter().collect::<Vec<_>>(),
            [(cuda(9), cuda(1))]
        );
    }

    #[test]
    fn python_string_repr() {
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let render = |n: &[&str]| NameList(&names(n)).to_string();
        assert_eq!(render(&[]), "[]");
        assert_eq!(render(&["a", "b:1"]), "['a', 'b:1']");
        assert_eq!(render(&["it's"]), "[\"it's\"]");
        assert_eq!(render(&["'\""]), "['\\'\"']");
        assert_eq!(
            render(&["a\\b\n\t\r\u{1}\u{7f}"]),
            "['a\\\\b\\n\\t\\r\\x01\\x7f']"
        );
        assert_eq!(render(&["é\u{85}"]), "['é\\x85']");
    }

    // ---- properties -------------------------------------------------------------------

    /// Raw material for a group; [`build_valid`] turns it into a valid configuration.
    #[derive(Debug, Clone)]
    struct Seed {
        counts: Vec<u32>,
        explicit: Vec<(bool, u8)>,
        pairs: Vec<(usize, usize, u8, u8)>,
    }

    fn seed() -> impl Strategy<Value = Seed> {
        (1usize..6).prop_flat_map(|n| {
            (
                proptest::collection::vec(0u32..5, n),
                proptest::collection::vec((any::<bool>(), any::<u8>()), n),
                proptest::collection::vec((0..n, 0..n, 0u8..6, 0u8..6), 0..24),
            )
                .prop_map(|(counts, explicit, pairs)| Seed {
                    counts,
                    explicit,
                    pairs,
                })
        })
    }

    /// The devices a worker may use: its explicit list, or `cpu` and every CUDA device.
    fn usable(w: &WorkerDevices) -> Vec<Device> {
        if w.devices.is_empty() {
            core::iter::once(Device::CPU)
                .chain((0..w.device_count).filter_map(|i| u8::try_from(i).ok().map(cuda)))
                .collect()
        } else {
            w.devices.clone()
        }
    }

    fn build_valid(seed: &Seed) -> Vec<WorkerDevices> {
        let mut workers: Vec<WorkerDevices> = seed
            .counts
            .iter()
            .zip(&seed.explicit)
            .enumerate()
            .map(|(i, (&count, &(explicit, mask)))| {
                let devices = if explicit {
                    (0..count)
                        .filter(|bit| mask & (1 << bit) != 0)
                        .filter_map(|i| u8::try_from(i).ok().map(cuda))
                        .collect()
                } else {
                    Vec::new()
                };
                WorkerDevices {
                    name: format!("worker{i}"),
                    device_count: count,
                    device_maps: DeviceMaps::new(),
                    devices,
                }
            })
            .collect();
        for &(from, to, s, t) in &seed.pairs {
            let sources = usable(&workers[from]);
            let targets = usable(&workers[to]);
            let (Some(&src), Some(&dst)) = (
                sources.get(usize::from(s) % sources.len().max(1)),
                targets.get(usize::from(t) % targets.len().max(1)),
            ) else {
                continue;
            };
            let peer = workers[to].name.clone();
            let mut map = workers[from]
                .device_maps
                .get(&peer)
                .cloned()
                .unwrap_or_default();
            if map.get(&src).is_none() && !map.targets().any(|d| d == dst) {
                map.insert(src, dst);
                workers[from].device_maps.insert(peer, map);
            }
        }
        workers
    }

    fn arbitrary_device() -> impl Strategy<Value = Device> {
        prop_oneof![
            Just(Device::CPU),
            Just(Device::cuda_current()),
            (0u8..5).prop_map(cuda)
        ]
    }

    fn arbitrary_workers() -> impl Strategy<Value = Vec<WorkerDevices>> {
        let names = prop_oneof![Just("a"), Just("b"), Just("c"), Just("d")];
        let map = proptest::collection::vec((arbitrary_device(), arbitrary_device()), 0..4)
            .prop_map(DeviceMap::from);
        let maps = proptest::collection::vec((names.clone(), map), 0..3)
            .prop_map(|v| v.into_iter().collect::<DeviceMaps>());
        proptest::collection::vec(
            (
                names,
                0u32..4,
                maps,
                proptest::collection::vec(arbitrary_device(), 0..3),
            )
                .prop_map(|(name, device_count, device_maps, devices)| WorkerDevices {
                    name: name.into(),
                    device_count,
                    device_maps,
                    devices,
                }),
            0..5,
        )
    }

    proptest! {
        #[test]
        fn built_configurations_are_valid(seed in seed()) {
            let workers = build_valid(&seed);
            prop_assert_eq!(validate_device_maps(&workers, GroupKind::Static), Ok(()));
            prop_assert_eq!(validate_device_maps(&workers, GroupKind::Dynamic), Ok(()));
        }

        #[test]
        fn reversed_maps_are_valid_and_reverse_back(seed in seed()) {
            let workers = build_valid(&seed);
            // Every worker's maps replaced by its reverse maps: still a valid group.
            let reversed: Vec<WorkerDevices> = workers
                .iter()
                .map(|w| WorkerDevices {
                    device_maps: create_reverse_mapping(&w.name, &workers),
                    ..w.clone()
                })
                .collect();
            prop_assert_eq!(validate_device_maps(&reversed, GroupKind::Static), Ok(()));
            // Reversing twice gives every worker its own maps back.
            for w in &workers {
                prop_assert_eq!(&create_reverse_mapping(&w.name, &reversed), &w.device_maps);
                for (_, map) in w.device_maps.iter() {
                    prop_assert!(map.reversed().is_injective());
                    prop_assert_eq!(&map.reversed().reversed(), map);
                }
            }
        }

        #[test]
        fn device_lists_are_sorted_and_cpu_free(seed in seed()) {
            let workers = build_valid(&seed);
            for w in &workers {
                let setup = exchange_and_check_device_maps(w, &workers);
                prop_assert!(setup.is_ok());
                let Ok(setup) = setup else { continue };
                prop_assert!(setup.devices.windows(2).all(|p| p[0].index() <= p[1].index()));
                if w.devices.is_empty() {
                    prop_assert!(!setup.devices.contains(&Device::CPU));
                    prop_assert!(!has_duplicates(setup.devices.iter().copied()));
                    for (_, map) in w.device_maps.iter().chain(setup.reverse_device_maps.iter()) {
                        for d in map.sources().filter(|d| *d != Device::CPU) {
                            prop_assert!(setup.devices.contains(&d));
                        }
                    }
                } else {
                    let mut given = w.devices.clone();
                    given.sort();
                    let mut got = setup.devices.clone();
                    got.sort();
                    prop_assert_eq!(given, got);
                }
            }
        }

        #[test]
        fn arbitrary_configurations_never_panic(workers in arbitrary_workers()) {
            let static_result = validate_device_maps(&workers, GroupKind::Static);
            let dynamic_result = validate_device_maps(&workers, GroupKind::Dynamic);
            if static_result.is_ok() {
                // A dynamic group checks a subset of what a static one does.
                prop_assert_eq!(dynamic_result, Ok(()));
                for w in &workers {
                    for (_, map) in create_reverse_mapping(&w.name, &workers).iter() {
                        prop_assert!(map.is_injective());
                        prop_assert_eq!(map.reversed().reversed(), map.clone());
                    }
                }
            }
            if let Err(e) = validate_device_maps(&workers, GroupKind::Static) {
                prop_assert!(e.to_string().starts_with("Node "));
            }
        }
    }
}
