//! Which device, port and GID to use, given what the host has and what the user asked for.
//!
//! [`select`] is a pure function over the plain [`topology`](super::topology) description:
//! it never calls libibverbs, so every rule below is unit-tested without hardware. It
//! decides the choice and, when there is none, the most specific reason why; it does not
//! open devices, create queue pairs or check that a remote peer can be reached.
//!
//! Rules, applied to devices in libibverbs order and ports in number order:
//! 1. `device` set: only that device is considered; otherwise all are.
//! 2. `port` set: only that port number is considered on each device.
//! 3. A port must be `ACTIVE`.
//! 4. GID: `gid_index` set: that entry must exist in the port's table. Otherwise an
//!    InfiniBand port uses GID index 0 (subnet prefix + port GUID; traffic is routed by
//!    LID), and an Ethernet port uses the first RoCE v2 GID that holds an IPv4-mapped
//!    address (`::ffff:a.b.c.d`), the entry that is routable over the IPv4 network.
//! 5. The first port meeting 3 and 4 wins.
//!
//! TensorPipe's ibv transport, by contrast, always takes device 0, port 1 and GID 0, which
//! on RoCE is usually the link-local RoCE v1 entry.

use std::fmt;

use super::config::IbvConfig;
use super::topology::{
    Gid, GidEntry, GidType, LinkLayer, Mtu, PortSpeed, PortState, RdmaDevice, RdmaPort,
};

/// The device, port and GID chosen for RDMA traffic, with what a peer needs to know about
/// the port (LID, GID, MTU) and what a person wants to see (link layer, speed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IbvSelection {
    /// Device name, e.g. `mlx5_0`.
    pub device: String,
    /// 1-based port number.
    pub port: u8,
    /// Link layer of the port.
    pub link_layer: LinkLayer,
    /// LID of the port (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// The chosen GID.
    pub gid: Gid,
    /// Its index in the port's GID table.
    pub gid_index: u32,
    /// Its type.
    pub gid_type: GidType,
    /// Active MTU of the port, if the device reported a valid one.
    pub active_mtu: Option<Mtu>,
    /// Largest message the port accepts, in bytes.
    pub max_msg_size: u32,
    /// Active width and speed, if the device reported valid ones.
    pub speed: Option<PortSpeed>,
}

/// A port as it appears in a "nothing usable" explanation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortSummary {
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u8,
    /// Its state.
    pub state: PortState,
    /// Its link layer.
    pub link_layer: LinkLayer,
}

impl PortSummary {
    fn of(device: &RdmaDevice, port: &RdmaPort) -> Self {
        Self {
            device: device.name.clone(),
            port: port.number,
            state: port.state,
            link_layer: port.link_layer,
        }
    }
}

impl fmt::Display for PortSummary {
    /// E.g. `mlx5_0:1 (DOWN, Ethernet)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{} ({}, {})",
            self.device, self.port, self.state, self.link_layer
        )
    }
}

/// Why [`select`] found nothing usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SelectError {
    /// libibverbs listed no device at all.
    #[error("no RDMA device found")]
    NoDevices,
    /// The requested device is not in the list.
    #[error("RDMA device {requested:?} not found (available: {})", join(available))]
    DeviceNotFound {
        /// The name asked for.
        requested: String,
        /// Devices that exist.
        available: Vec<String>,
    },
    /// The requested port number does not exist (on the requested device, or on any device).
    #[error("{}", port_not_found(device.as_deref(), *port, available))]
    PortNotFound {
        /// The requested device, if one was requested.
        device: Option<String>,
        /// The port number asked for.
        port: u8,
        /// Port numbers of the requested device (empty when no device was requested).
        available: Vec<u8>,
    },
    /// Every port considered exists but none is `ACTIVE`.
    #[error("{}", no_active_port(ports))]
    NoActivePort {
        /// The ports considered.
        ports: Vec<PortSummary>,
    },
    /// The requested GID index is empty or out of range on every active port considered.
    #[error(
        "GID index {gid_index} not found on any active port considered: {}",
        join(ports)
    )]
    GidNotFound {
        /// The index asked for.
        gid_index: u32,
        /// The active ports considered.
        ports: Vec<PortSummary>,
    },
    /// Active ports exist but none has a GID the automatic rule accepts (RoCE v2 with an
    /// IPv4 address on Ethernet, index 0 on InfiniBand).
    #[error(
        "no usable GID on the active ports {} (Ethernet ports need a RoCE v2 GID with an IPv4 address: assign one to the network interface or set RDZV_IB_GID_INDEX)",
        join(ports)
    )]
    NoUsableGid {
        /// The active ports considered.
        ports: Vec<PortSummary>,
    },
}

fn join<T: fmt::Display>(items: &[T]) -> String {
    if items.is_empty() {
        return "none".to_owned();
    }
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn port_not_found(device: Option<&str>, port: u8, available: &[u8]) -> String {
    match device {
        Some(device) => format!(
            "RDMA device {device} has no port {port} (ports: {})",
            join(available)
        ),
        None => format!("no RDMA device has a port {port}"),
    }
}

fn no_active_port(ports: &[PortSummary]) -> String {
    match ports {
        [only] => format!(
            "RDMA port {}:{} is not active (state {})",
            only.device, only.port, only.state
        ),
        _ => format!("no active RDMA port (ports: {})", join(ports)),
    }
}

/// Chooses a device, port and GID from `devices` following the module's rules.
pub fn select(devices: &[RdmaDevice], config: &IbvConfig) -> Result<IbvSelection, SelectError> {
    if devices.is_empty() {
        return Err(SelectError::NoDevices);
    }
    let candidates: Vec<&RdmaDevice> = match &config.device {
        Some(name) => match devices.iter().find(|d| d.name == *name) {
            Some(device) => vec![device],
            None => {
                return Err(SelectError::DeviceNotFound {
                    requested: name.clone(),
                    available: devices.iter().map(|d| d.name.clone()).collect(),
                })
            }
        },
        None => devices.iter().collect(),
    };

    let mut inactive = Vec::new();
    let mut active_without_gid = Vec::new();
    let mut port_seen = false;
    for device in candidates {
        for port in &device.ports {
            if config.port.is_some_and(|wanted| wanted != port.number) {
                continue;
            }
            port_seen = true;
            if !port.state.is_active() {
                inactive.push(PortSummary::of(device, port));
                continue;
            }
            match choose_gid(port, config.gid_index) {
                Some(gid) => return Ok(selection(device, port, gid)),
                None => active_without_gid.push(PortSummary::of(device, port)),
            }
        }
    }

    if !port_seen {
        if let Some(port) = config.port {
            let available = match &config.device {
                Some(name) => devices
                    .iter()
                    .filter(|d| d.name == *name)
                    .flat_map(|d| d.ports.iter().map(|p| p.number))
                    .collect(),
                None => Vec::new(),
            };
            return Err(SelectError::PortNotFound {
                device: config.device.clone(),
                port,
                available,
            });
        }
    }
    if active_without_gid.is_empty() {
        return Err(SelectError::NoActivePort { ports: inactive });
    }
    Err(match config.gid_index {
        Some(gid_index) => SelectError::GidNotFound {
            gid_index,
            ports: active_without_gid,
        },
        None => SelectError::NoUsableGid {
            ports: active_without_gid,
        },
    })
}

/// The GID entry of an active port that the rules accept, if any.
fn choose_gid(port: &RdmaPort, wanted: Option<u32>) -> Option<GidEntry> {
    if let Some(index) = wanted {
        return port.gids.iter().find(|g| g.index == index).copied();
    }
    if port.link_layer.is_infiniband() {
        port.gids.iter().find(|g| g.index == 0).copied()
    } else if port.link_layer == LinkLayer::Ethernet {
        port.gids
            .iter()
            .find(|g| g.gid_type == GidType::RoceV2 && g.gid.ipv4_mapped().is_some())
            .copied()
    } else {
        None
    }
}

fn selection(device: &RdmaDevice, port: &RdmaPort, gid: GidEntry) -> IbvSelection {
    IbvSelection {
        device: device.name.clone(),
        port: port.number,
        link_layer: port.link_layer,
        lid: port.lid,
        gid: gid.gid,
        gid_index: gid.index,
        gid_type: gid.gid_type,
        active_mtu: port.active_mtu,
        max_msg_size: port.max_msg_size,
        speed: port.speed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ibv::config::{ENV_DEVICE, ENV_GID_INDEX, ENV_PORT};
    use crate::ibv::topology::LaneRate;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn ib_gid(index: u32) -> GidEntry {
        GidEntry {
            index,
            gid: Gid::from(
                "fe80::248a:703:49:d4f0"
                    .parse::<Ipv6Addr>()
                    .expect("literal"),
            ),
            gid_type: GidType::InfiniBand,
        }
    }

    fn roce_gid(index: u32, gid: Gid, gid_type: GidType) -> GidEntry {
        GidEntry {
            index,
            gid,
            gid_type,
        }
    }

    fn link_local() -> Gid {
        Gid::from(
            "fe80::a288:c2ff:fe0b:1"
                .parse::<Ipv6Addr>()
                .expect("literal"),
        )
    }

    fn ipv4(a: u8, b: u8, c: u8, d: u8) -> Gid {
        Gid::from(Ipv4Addr::new(a, b, c, d))
    }

    /// A typical RoCE port: link-local v1/v2 at 0/1, IPv4 v1/v2 at 2/3.
    fn roce_gids(addr: Gid) -> Vec<GidEntry> {
        vec![
            roce_gid(0, link_local(), GidType::RoceV1),
            roce_gid(1, link_local(), GidType::RoceV2),
            roce_gid(2, addr, GidType::RoceV1),
            roce_gid(3, addr, GidType::RoceV2),
        ]
    }

    fn port(number: u8, state: PortState, link_layer: LinkLayer, gids: Vec<GidEntry>) -> RdmaPort {
        RdmaPort {
            number,
            state,
            link_layer,
            lid: if link_layer.is_infiniband() { 7 } else { 0 },
            active_mtu: Some(Mtu::B4096),
            max_msg_size: 1 << 30,
            speed: Some(PortSpeed {
                lanes: 4,
                lane_rate: LaneRate::Edr,
            }),
            gid_table_len: 256,
            gids,
        }
    }

    fn device(name: &str, ports: Vec<RdmaPort>) -> RdmaDevice {
        RdmaDevice {
            name: name.to_owned(),
            ports,
        }
    }

    /// A device with one active port (1) of `link_layer` with `gids`.
    fn active_device(name: &str, link_layer: LinkLayer, gids: Vec<GidEntry>) -> RdmaDevice {
        device(name, vec![port(1, PortState::Active, link_layer, gids)])
    }

    /// A device with one InfiniBand port (1) in `state`, with GID 0.
    fn ib_device(name: &str, state: PortState) -> RdmaDevice {
        device(
            name,
            vec![port(1, state, LinkLayer::InfiniBand, vec![ib_gid(0)])],
        )
    }

    fn cfg(device: Option<&str>, port: Option<u8>, gid_index: Option<u32>) -> IbvConfig {
        IbvConfig {
            device: device.map(str::to_owned),
            port,
            gid_index,
        }
    }

    #[test]
    fn no_devices() {
        assert_eq!(
            select(&[], &IbvConfig::default()),
            Err(SelectError::NoDevices)
        );
    }

    #[test]
    fn infiniband_uses_gid_zero_and_lid() {
        let devices = [ib_device("mlx5_0", PortState::Active)];
        let sel = select(&devices, &IbvConfig::default()).unwrap();
        assert_eq!(sel.device, "mlx5_0");
        assert_eq!(sel.port, 1);
        assert_eq!(sel.gid_index, 0);
        assert_eq!(sel.gid_type, GidType::InfiniBand);
        assert_eq!(sel.lid, 7);
        assert_eq!(sel.link_layer, LinkLayer::InfiniBand);
        assert_eq!(sel.active_mtu, Some(Mtu::B4096));
    }

    #[test]
    fn unspecified_link_layer_counts_as_infiniband() {
        let devices = [active_device(
            "qib0",
            LinkLayer::Unspecified,
            vec![ib_gid(0)],
        )];
        assert_eq!(
            select(&devices, &IbvConfig::default()).unwrap().gid_index,
            0
        );
    }

    #[test]
    fn roce_prefers_ipv4_rocev2_over_index_zero() {
        let addr = ipv4(10, 0, 0, 5);
        let devices = [active_device(
            "mlx5_0",
            LinkLayer::Ethernet,
            roce_gids(addr),
        )];
        let sel = select(&devices, &IbvConfig::default()).unwrap();
        assert_eq!(sel.gid_index, 3);
        assert_eq!(sel.gid, addr);
        assert_eq!(sel.gid_type, GidType::RoceV2);
        assert_eq!(sel.gid.to_string(), "::ffff:10.0.0.5");
        assert_eq!(sel.lid, 0);
    }

    #[test]
    fn rxe_layout_picks_index_one() {
        // Soft-RoCE on an IPv4 interface: link-local v2 at 0, IPv4 v2 at 1.
        let addr = ipv4(192, 168, 1, 20);
        let devices = [active_device(
            "rxe0",
            LinkLayer::Ethernet,
            vec![
                roce_gid(0, link_local(), GidType::RoceV2),
                roce_gid(1, addr, GidType::RoceV2),
            ],
        )];
        assert_eq!(
            select(&devices, &IbvConfig::default()).unwrap().gid_index,
            1
        );
    }

    #[test]
    fn roce_without_ipv4_v2_gid_is_not_usable() {
        let devices = [active_device(
            "mlx5_0",
            LinkLayer::Ethernet,
            vec![
                roce_gid(0, link_local(), GidType::RoceV1),
                roce_gid(1, link_local(), GidType::RoceV2),
                roce_gid(2, ipv4(10, 0, 0, 1), GidType::RoceV1),
            ],
        )];
        let err = select(&devices, &IbvConfig::default()).unwrap_err();
        assert!(matches!(&err, SelectError::NoUsableGid { ports } if ports.len() == 1));
        assert!(err.to_string().contains("RDZV_IB_GID_INDEX"), "{err}");
        assert!(
            err.to_string().contains("mlx5_0:1 (ACTIVE, Ethernet)"),
            "{err}"
        );
        // ...but an explicit index is honoured even if it is not the automatic choice.
        let sel = select(&devices, &cfg(None, None, Some(1))).unwrap();
        assert_eq!(sel.gid_index, 1);
        assert_eq!(sel.gid_type, GidType::RoceV2);
    }

    #[test]
    fn first_device_with_an_active_port_wins() {
        let addr = ipv4(10, 0, 0, 9);
        let devices = [
            ib_device("mlx5_0", PortState::Down),
            device(
                "mlx5_1",
                vec![
                    port(1, PortState::Init, LinkLayer::Ethernet, roce_gids(addr)),
                    port(2, PortState::Active, LinkLayer::Ethernet, roce_gids(addr)),
                ],
            ),
            ib_device("mlx5_2", PortState::Active),
        ];
        let sel = select(&devices, &IbvConfig::default()).unwrap();
        assert_eq!((sel.device.as_str(), sel.port), ("mlx5_1", 2));
    }

    #[test]
    fn active_port_without_usable_gid_is_skipped_for_a_later_one() {
        let devices = [
            active_device(
                "mlx5_0",
                LinkLayer::Ethernet,
                vec![roce_gid(0, link_local(), GidType::RoceV1)],
            ),
            ib_device("mlx5_1", PortState::Active),
        ];
        assert_eq!(
            select(&devices, &IbvConfig::default()).unwrap().device,
            "mlx5_1"
        );
    }

    #[test]
    fn all_ports_inactive() {
        let devices = [
            ib_device("mlx5_0", PortState::Down),
            ib_device("mlx5_1", PortState::Armed),
        ];
        let err = select(&devices, &IbvConfig::default()).unwrap_err();
        assert!(matches!(&err, SelectError::NoActivePort { ports } if ports.len() == 2));
        assert_eq!(
            err.to_string(),
            "no active RDMA port (ports: mlx5_0:1 (DOWN, InfiniBand), mlx5_1:1 (ARMED, InfiniBand))"
        );
    }

    #[test]
    fn device_without_ports_reports_no_active_port() {
        let devices = [device("mlx5_0", vec![])];
        assert_eq!(
            select(&devices, &IbvConfig::default()),
            Err(SelectError::NoActivePort { ports: vec![] })
        );
    }

    #[test]
    fn requested_device_is_used_even_if_not_first() {
        let devices = [
            ib_device("mlx5_0", PortState::Active),
            ib_device("mlx5_1", PortState::Active),
        ];
        let sel = select(&devices, &cfg(Some("mlx5_1"), None, None)).unwrap();
        assert_eq!(sel.device, "mlx5_1");
    }

    #[test]
    fn requested_device_missing() {
        let devices = [device("mlx5_0", vec![]), device("mlx5_1", vec![])];
        let err = select(&devices, &cfg(Some("rxe0"), None, None)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "RDMA device \"rxe0\" not found (available: mlx5_0, mlx5_1)"
        );
    }

    #[test]
    fn requested_device_with_only_inactive_ports_does_not_fall_back() {
        let devices = [
            ib_device("mlx5_0", PortState::Down),
            ib_device("mlx5_1", PortState::Active),
        ];
        let err = select(&devices, &cfg(Some("mlx5_0"), None, None)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "RDMA port mlx5_0:1 is not active (state DOWN)"
        );
    }

    #[test]
    fn requested_port() {
        let devices = [device(
            "mlx5_0",
            vec![
                port(1, PortState::Active, LinkLayer::InfiniBand, vec![ib_gid(0)]),
                port(2, PortState::Active, LinkLayer::InfiniBand, vec![ib_gid(0)]),
            ],
        )];
        assert_eq!(select(&devices, &cfg(None, Some(2), None)).unwrap().port, 2);
        let err = select(&devices, &cfg(Some("mlx5_0"), Some(3), None)).unwrap_err();
        assert_eq!(
            err,
            SelectError::PortNotFound {
                device: Some("mlx5_0".into()),
                port: 3,
                available: vec![1, 2],
            }
        );
        assert_eq!(
            err.to_string(),
            "RDMA device mlx5_0 has no port 3 (ports: 1, 2)"
        );
        let err = select(&devices, &cfg(None, Some(9), None)).unwrap_err();
        assert_eq!(err.to_string(), "no RDMA device has a port 9");
    }

    #[test]
    fn requested_port_inactive() {
        let devices = [device(
            "mlx5_0",
            vec![
                port(1, PortState::Active, LinkLayer::InfiniBand, vec![ib_gid(0)]),
                port(2, PortState::Down, LinkLayer::InfiniBand, vec![ib_gid(0)]),
            ],
        )];
        let err = select(&devices, &cfg(Some("mlx5_0"), Some(2), None)).unwrap_err();
        assert_eq!(
            err,
            SelectError::NoActivePort {
                ports: vec![PortSummary {
                    device: "mlx5_0".into(),
                    port: 2,
                    state: PortState::Down,
                    link_layer: LinkLayer::InfiniBand,
                }],
            }
        );
    }

    #[test]
    fn requested_gid_index_missing() {
        let devices = [active_device(
            "mlx5_0",
            LinkLayer::Ethernet,
            roce_gids(ipv4(10, 0, 0, 1)),
        )];
        let err = select(&devices, &cfg(None, None, Some(7))).unwrap_err();
        assert!(matches!(err, SelectError::GidNotFound { gid_index: 7, .. }));
        assert_eq!(
            err.to_string(),
            "GID index 7 not found on any active port considered: mlx5_0:1 (ACTIVE, Ethernet)"
        );
    }

    #[test]
    fn infiniband_port_with_empty_gid_table_is_not_usable() {
        let devices = [device(
            "mlx5_0",
            vec![port(1, PortState::Active, LinkLayer::InfiniBand, vec![])],
        )];
        assert!(matches!(
            select(&devices, &IbvConfig::default()),
            Err(SelectError::NoUsableGid { .. })
        ));
    }

    #[test]
    fn unknown_link_layer_needs_explicit_gid() {
        let devices = [device(
            "odd0",
            vec![port(
                1,
                PortState::Active,
                LinkLayer::Unknown(9),
                vec![ib_gid(0)],
            )],
        )];
        assert!(select(&devices, &IbvConfig::default()).is_err());
        assert_eq!(
            select(&devices, &cfg(None, None, Some(0)))
                .unwrap()
                .gid_index,
            0
        );
    }

    #[test]
    fn env_overrides_drive_selection() {
        let addr0 = ipv4(10, 0, 0, 1);
        let addr1 = ipv4(10, 0, 1, 1);
        let devices = [
            active_device("mlx5_0", LinkLayer::Ethernet, roce_gids(addr0)),
            device(
                "mlx5_1",
                vec![
                    port(1, PortState::Active, LinkLayer::Ethernet, roce_gids(addr1)),
                    port(2, PortState::Active, LinkLayer::Ethernet, roce_gids(addr1)),
                ],
            ),
        ];
        let config = IbvConfig::from_env(|var| match var {
            ENV_DEVICE => Some("mlx5_1"),
            ENV_PORT => Some("2"),
            ENV_GID_INDEX => Some("2"),
            _ => None,
        })
        .unwrap();
        let sel = select(&devices, &config).unwrap();
        assert_eq!(
            (
                sel.device.as_str(),
                sel.port,
                sel.gid_index,
                sel.gid_type,
                sel.gid
            ),
            ("mlx5_1", 2, 2, GidType::RoceV1, addr1)
        );
        let auto = select(&devices, &IbvConfig::from_env(|_| None::<&str>).unwrap()).unwrap();
        assert_eq!(
            (auto.device.as_str(), auto.port, auto.gid_index),
            ("mlx5_0", 1, 3)
        );
    }
}
