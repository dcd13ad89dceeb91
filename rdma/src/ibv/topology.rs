//! A plain description of the RDMA devices, ports and GIDs on a host.
//!
//! These types hold what [`discover`](super::discover) read from libibverbs, already
//! converted from the verbs ABI's raw numbers into Rust values, so that
//! [`select`](super::select) can be a pure function tested without hardware. Unknown raw
//! values are kept (`Unknown(n)`) instead of panicking. Nothing here calls into libibverbs.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// One RDMA device (an HCA or RNIC, e.g. `mlx5_0`), with the ports that could be queried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaDevice {
    /// Name as libibverbs reports it.
    pub name: String,
    /// Physical ports, in port-number order.
    pub ports: Vec<RdmaPort>,
}

/// One physical port of an [`RdmaDevice`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaPort {
    /// 1-based port number.
    pub number: u8,
    /// Logical port state.
    pub state: PortState,
    /// Link layer: InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
    /// Base LID assigned by the subnet manager (InfiniBand only; 0 on Ethernet).
    pub lid: u16,
    /// Active MTU, `None` if the device reported a value outside the verbs ABI.
    pub active_mtu: Option<Mtu>,
    /// Largest message the port accepts, in bytes.
    pub max_msg_size: u32,
    /// Active link width and speed, `None` if the device reported values outside the ABI.
    pub speed: Option<PortSpeed>,
    /// Number of entries in the port's GID table (including empty ones).
    pub gid_table_len: u32,
    /// The non-zero GIDs of the table, in index order.
    pub gids: Vec<GidEntry>,
}

/// One non-empty entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Index into the port's GID table.
    pub index: u32,
    /// The GID itself.
    pub gid: Gid,
    /// Its type (wire format).
    pub gid_type: GidType,
}

/// A 128-bit Global Identifier, in network byte order. For RoCE it is the IPv6 address (or
/// IPv4-mapped IPv6 address) of the network interface; for InfiniBand it is the subnet
/// prefix followed by the port GUID.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The GID as an IPv6 address.
    pub fn to_ipv6(self) -> Ipv6Addr {
        Ipv6Addr::from(self.0)
    }

    /// The IPv4 address if this is an IPv4-mapped GID (`::ffff:a.b.c.d`), as RoCE v2 uses for
    /// interfaces with IPv4 addresses.
    pub fn ipv4_mapped(self) -> Option<Ipv4Addr> {
        self.to_ipv6().to_ipv4_mapped()
    }

    /// Whether every byte is zero (an unused table slot).
    pub fn is_zero(self) -> bool {
        self.0 == [0; 16]
    }
}

impl From<Ipv6Addr> for Gid {
    fn from(addr: Ipv6Addr) -> Self {
        Gid(addr.octets())
    }
}

impl From<Ipv4Addr> for Gid {
    /// The IPv4-mapped GID of an IPv4 address.
    fn from(addr: Ipv4Addr) -> Self {
        Gid(addr.to_ipv6_mapped().octets())
    }
}

impl fmt::Display for Gid {
    /// IPv6 text form; IPv4-mapped GIDs print as `::ffff:10.0.0.1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.to_ipv6(), f)
    }
}

/// Type of a GID: which wire format packets addressed with it use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// Native InfiniBand GRH.
    InfiniBand,
    /// RoCE v1: InfiniBand GRH over an Ethernet frame (not routable over IP).
    RoceV1,
    /// RoCE v2: UDP/IP encapsulation (port 4791), routable.
    RoceV2,
    /// libibverbs could not report the type.
    Unknown,
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GidType::InfiniBand => "IB",
            GidType::RoceV1 => "RoCEv1",
            GidType::RoceV2 => "RoCEv2",
            GidType::Unknown => "unknown",
        })
    }
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// The driver did not say; by verbs convention this means InfiniBand.
    Unspecified,
    /// InfiniBand.
    InfiniBand,
    /// Ethernet: the port speaks RoCE.
    Ethernet,
    /// A value this crate does not know.
    Unknown(u8),
}

impl LinkLayer {
    /// From the verbs ABI value (`IBV_LINK_LAYER_*`).
    pub fn from_raw(raw: u8) -> Self {
        match raw {
            0 => LinkLayer::Unspecified,
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            other => LinkLayer::Unknown(other),
        }
    }

    /// Whether the port uses InfiniBand addressing (LIDs), which libibverbs assumes when the
    /// link layer is unspecified.
    pub fn is_infiniband(self) -> bool {
        matches!(self, LinkLayer::InfiniBand | LinkLayer::Unspecified)
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkLayer::Unspecified | LinkLayer::InfiniBand => f.write_str("InfiniBand"),
            LinkLayer::Ethernet => f.write_str("Ethernet"),
            LinkLayer::Unknown(raw) => write!(f, "unknown({raw})"),
        }
    }
}

/// Logical state of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// Reserved value.
    Nop,
    /// Link is down.
    Down,
    /// Physical link up, waiting for the subnet manager.
    Init,
    /// Configured by the subnet manager but not yet active.
    Armed,
    /// Usable.
    Active,
    /// Was active, recovering from a physical link failure.
    ActiveDefer,
    /// A value this crate does not know.
    Unknown(u32),
}

impl PortState {
    /// From the verbs ABI value (`IBV_PORT_*`).
    pub fn from_raw(raw: u32) -> Self {
        match raw {
            0 => PortState::Nop,
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 => PortState::Active,
            5 => PortState::ActiveDefer,
            other => PortState::Unknown(other),
        }
    }

    /// Whether traffic can flow (`IBV_PORT_ACTIVE`).
    pub fn is_active(self) -> bool {
        self == PortState::Active
    }
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortState::Nop => f.write_str("NOP"),
            PortState::Down => f.write_str("DOWN"),
            PortState::Init => f.write_str("INIT"),
            PortState::Armed => f.write_str("ARMED"),
            PortState::Active => f.write_str("ACTIVE"),
            PortState::ActiveDefer => f.write_str("ACTIVE_DEFER"),
            PortState::Unknown(raw) => write!(f, "unknown({raw})"),
        }
    }
}

/// An RDMA path MTU. Unlike Ethernet, only these five sizes exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    B256,
    /// 512 bytes.
    B512,
    /// 1024 bytes.
    B1024,
    /// 2048 bytes.
    B2048,
    /// 4096 bytes.
    B4096,
}

impl Mtu {
    /// From the verbs ABI value (`IBV_MTU_*`, 1 to 5); `None` for anything else.
    pub fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            1 => Some(Mtu::B256),
            2 => Some(Mtu::B512),
            3 => Some(Mtu::B1024),
            4 => Some(Mtu::B2048),
            5 => Some(Mtu::B4096),
            _ => None,
        }
    }

    /// Size in bytes.
    pub fn bytes(self) -> u32 {
        match self {
            Mtu::B256 => 256,
            Mtu::B512 => 512,
            Mtu::B1024 => 1024,
            Mtu::B2048 => 2048,
            Mtu::B4096 => 4096,
        }
    }
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

/// Per-lane signalling generation of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneRate {
    /// Single data rate, 2.5 Gb/s.
    Sdr,
    /// Double data rate, 5 Gb/s.
    Ddr,
    /// Quad data rate, 10 Gb/s.
    Qdr,
    /// FDR10, 10 Gb/s.
    Fdr10,
    /// Fourteen data rate, 14 Gb/s.
    Fdr,
    /// Enhanced data rate, 25 Gb/s.
    Edr,
    /// High data rate, 50 Gb/s.
    Hdr,
    /// Next data rate, 100 Gb/s.
    Ndr,
    /// Extended data rate, 200 Gb/s.
    Xdr,
}

impl LaneRate {
    /// From the verbs ABI value (`IBV_SPEED_*` bit).
    pub fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            1 => Some(LaneRate::Sdr),
            2 => Some(LaneRate::Ddr),
            4 => Some(LaneRate::Qdr),
            8 => Some(LaneRate::Fdr10),
            16 => Some(LaneRate::Fdr),
            32 => Some(LaneRate::Edr),
            64 => Some(LaneRate::Hdr),
            128 => Some(LaneRate::Ndr),
            256 => Some(LaneRate::Xdr),
            _ => None,
        }
    }

    /// Per-lane rate in Mb/s, as `ibv_devinfo` prints it.
    pub fn mbps(self) -> u64 {
        match self {
            LaneRate::Sdr => 2_500,
            LaneRate::Ddr => 5_000,
            LaneRate::Qdr | LaneRate::Fdr10 => 10_000,
            LaneRate::Fdr => 14_000,
            LaneRate::Edr => 25_000,
            LaneRate::Hdr => 50_000,
            LaneRate::Ndr => 100_000,
            LaneRate::Xdr => 200_000,
        }
    }
}

impl fmt::Display for LaneRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaneRate::Sdr => "SDR",
            LaneRate::Ddr => "DDR",
            LaneRate::Qdr => "QDR",
            LaneRate::Fdr10 => "FDR10",
            LaneRate::Fdr => "FDR",
            LaneRate::Edr => "EDR",
            LaneRate::Hdr => "HDR",
            LaneRate::Ndr => "NDR",
            LaneRate::Xdr => "XDR",
        })
    }
}

/// Active width and per-lane rate of a port. Ethernet ports report their speed in the same
/// terms (100 GbE shows as 4x EDR).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortSpeed {
    /// Number of lanes (1, 2, 4, 8 or 12).
    pub lanes: u8,
    /// Per-lane rate.
    pub lane_rate: LaneRate,
}

impl PortSpeed {
    /// From the raw `active_width`, `active_speed` and `active_speed_ex` port attributes;
    /// `active_speed_ex` wins when non-zero (NDR and later do not fit in `active_speed`).
    pub fn from_raw(active_width: u8, active_speed: u8, active_speed_ex: u32) -> Option<Self> {
        let lanes = match active_width {
            1 => 1,
            16 => 2,
            2 => 4,
            4 => 8,
            8 => 12,
            _ => return None,
        };
        let speed = if active_speed_ex != 0 {
            active_speed_ex
        } else {
            u32::from(active_speed)
        };
        Some(PortSpeed {
            lanes,
            lane_rate: LaneRate::from_raw(speed)?,
        })
    }

    /// Total rate in Mb/s.
    pub fn total_mbps(self) -> u64 {
        u64::from(self.lanes) * self.lane_rate.mbps()
    }
}

impl fmt::Display for PortSpeed {
    /// E.g. `4x EDR (100 Gb/s)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.total_mbps();
        write!(f, "{}x {} ({}", self.lanes, self.lane_rate, total / 1000)?;
        if !total.is_multiple_of(1000) {
            write!(f, ".{}", (total % 1000) / 100)?;
        }
        f.write_str(" Gb/s)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_conversions_never_panic() {
        for raw in 0..=u8::MAX {
            let _ = LinkLayer::from_raw(raw);
            for speed in [0u8, 1, 2, 3, 32, 255] {
                let _ = PortSpeed::from_raw(raw, speed, 0);
            }
        }
        for raw in [0u32, 1, 4, 5, 6, 99, u32::MAX] {
            let _ = PortState::from_raw(raw);
            let _ = Mtu::from_raw(raw);
            let _ = LaneRate::from_raw(raw);
        }
        assert_eq!(LinkLayer::from_raw(7), LinkLayer::Unknown(7));
        assert_eq!(PortState::from_raw(9), PortState::Unknown(9));
        assert_eq!(Mtu::from_raw(0), None);
        assert_eq!(Mtu::from_raw(5), Some(Mtu::B4096));
    }

    #[test]
    fn speed_display() {
        let edr4 = PortSpeed::from_raw(2, 32, 0).unwrap();
        assert_eq!(edr4.to_string(), "4x EDR (100 Gb/s)");
        let ndr4 = PortSpeed::from_raw(2, 0, 128).unwrap();
        assert_eq!(ndr4.to_string(), "4x NDR (400 Gb/s)");
        let sdr1 = PortSpeed::from_raw(1, 1, 0).unwrap();
        assert_eq!(sdr1.to_string(), "1x SDR (2.5 Gb/s)");
        let fdr12 = PortSpeed::from_raw(8, 16, 0).unwrap();
        assert_eq!(fdr12.total_mbps(), 168_000);
        assert_eq!(PortSpeed::from_raw(3, 32, 0), None);
        assert_eq!(PortSpeed::from_raw(2, 3, 0), None);
    }

    #[test]
    fn gid_forms() {
        let gid = Gid::from(Ipv4Addr::new(10, 1, 2, 3));
        assert_eq!(gid.to_string(), "::ffff:10.1.2.3");
        assert_eq!(gid.ipv4_mapped(), Some(Ipv4Addr::new(10, 1, 2, 3)));
        let link_local: Ipv6Addr = "fe80::248a:703:49:d4f0".parse().unwrap();
        assert_eq!(Gid::from(link_local).ipv4_mapped(), None);
        assert!(Gid::default().is_zero());
        assert!(!gid.is_zero());
    }

    #[test]
    fn unspecified_link_layer_is_infiniband() {
        assert!(LinkLayer::Unspecified.is_infiniband());
        assert!(LinkLayer::InfiniBand.is_infiniband());
        assert!(!LinkLayer::Ethernet.is_infiniband());
        assert_eq!(LinkLayer::Unspecified.to_string(), "InfiniBand");
    }
}
