//! Whether InfiniBand verbs (RDMA) can be used on this host, and with which device, port
//! and GID.
//!
//! [`probe`] answers with an [`IbvViability`]: either an [`IbvSelection`] or an
//! [`IbvNotViable`] reason (libibverbs cannot be loaded, the kernel has no verbs support,
//! no device, no active port, the requested device/port/GID does not exist, or a verb
//! failed). It never panics and logs its outcome through `tracing`. It only reads device
//! attributes: it creates no protection domain, queue pair or memory region, and says
//! nothing about whether a particular peer is reachable.
//!
//! The module is split so that the decisions are testable without hardware:
//! [`config`] parses the user's choice, [`topology`] describes what the host has,
//! [`select`] picks (pure), and [`discover`] fills the description from libibverbs.
//!
//! The data paths: [`connection`] (one RC queue pair with message rings, zero-copy large
//! messages and one-sided reads), [`transport`] (the agent's `ibv` transport over it) and
//! [`lending`] (memory lent to peers who READ it: `cuda_gdr`'s path).
//!
//! libibverbs itself is loaded at run time by [`sys`] (the crate's `sys::ibv`, re-exported
//! here): the crate's `unsafe` code lives under `sys` alone, and the rest denies it.

pub mod config;
pub mod connection;
pub mod discover;
pub mod lending;
pub mod regcache;
pub mod select;
pub use crate::sys::ibv as sys;
pub mod topology;
pub mod transport;
pub mod wc_status;
pub mod wire;

use std::fmt;
use std::io;

use tracing::{debug, info, warn};

pub use config::{IbvConfig, IbvConfigError};
pub use discover::IbvError;
pub use select::{IbvSelection, SelectError};

/// Outcome of [`probe`].
#[derive(Debug)]
pub enum IbvViability {
    /// RDMA can be used with this device, port and GID.
    Viable(IbvSelection),
    /// RDMA cannot be used, and why.
    NotViable(IbvNotViable),
}

impl IbvViability {
    /// Whether RDMA can be used.
    pub fn is_viable(&self) -> bool {
        matches!(self, IbvViability::Viable(_))
    }

    /// The selection, when viable.
    pub fn selection(&self) -> Option<&IbvSelection> {
        match self {
            IbvViability::Viable(selection) => Some(selection),
            IbvViability::NotViable(_) => None,
        }
    }

    /// The reason, when not viable.
    pub fn reason(&self) -> Option<&IbvNotViable> {
        match self {
            IbvViability::Viable(_) => None,
            IbvViability::NotViable(reason) => Some(reason),
        }
    }
}

/// Why RDMA cannot be used on this host.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IbvNotViable {
    /// The dynamic loader cannot load libibverbs (rdma-core is not installed).
    #[error("{library} cannot be loaded (is rdma-core / libibverbs installed?)")]
    LibraryUnavailable {
        /// The shared object that was tried.
        library: &'static str,
        /// The loader's message, or the missing entry point.
        #[source]
        source: crate::sys::ibv::LibraryError,
    },
    /// libibverbs is loaded but reports that the kernel has no verbs support (`ENOSYS`: no
    /// `ib_uverbs`, or a kernel built without InfiniBand).
    #[error("the kernel has no RDMA verbs support (ibv_get_device_list: ENOSYS)")]
    KernelWithoutVerbs {
        /// The `ENOSYS` error.
        #[source]
        source: io::Error,
    },
    /// The `RDZV_IB_*` environment variables hold an invalid value.
    #[error(transparent)]
    Config(#[from] IbvConfigError),
    /// A verb call failed.
    #[error(transparent)]
    Verbs(#[from] IbvError),
    /// Devices were listed but none (or not the requested one) is usable.
    #[error(transparent)]
    Selection(#[from] SelectError),
}

impl fmt::Display for IbvViability {
    /// `viable: <selection>` or `not viable: <reason with its causes>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IbvViability::Viable(selection) => write!(f, "viable: {selection}"),
            IbvViability::NotViable(reason) => {
                write!(f, "not viable: {}", crate::error_chain::ErrorChain(reason))
            }
        }
    }
}

impl fmt::Display for IbvSelection {
    /// One line: `mlx5_0 port 1, Ethernet, GID[3] ::ffff:10.0.0.5 (RoCEv2), LID 0, MTU 4096,
    /// 4x EDR (100 Gb/s)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} port {}, {}, GID[{}] {} ({}), LID {}",
            self.device,
            self.port,
            self.link_layer,
            self.gid_index,
            self.gid,
            self.gid_type,
            self.lid
        )?;
        match self.active_mtu {
            Some(mtu) => write!(f, ", MTU {mtu}")?,
            None => f.write_str(", MTU unknown")?,
        }
        if let Some(speed) = self.speed {
            write!(f, ", {speed}")?;
        }
        Ok(())
    }
}

/// Probes libibverbs and chooses a device, port and GID according to `config`.
pub fn probe(config: &IbvConfig) -> IbvViability {
    let outcome = probe_inner(config);
    match &outcome {
        Ok(selection) => info!(%selection, "RDMA (ibverbs) viable"),
        Err(reason) => {
            info!(reason = %crate::error_chain::ErrorChain(reason), "RDMA (ibverbs) not viable")
        }
    }
    match outcome {
        Ok(selection) => IbvViability::Viable(selection),
        Err(reason) => IbvViability::NotViable(reason),
    }
}

/// [`probe`] with the configuration read from the process environment (`RDZV_IB_DEVICE`,
/// `RDZV_IB_PORT`, `RDZV_IB_GID_INDEX`); an invalid value makes it not viable.
pub fn probe_env() -> IbvViability {
    match IbvConfig::from_process_env() {
        Ok(config) => probe(&config),
        Err(err) => {
            info!(reason = %err, "RDMA (ibverbs) not viable");
            IbvViability::NotViable(IbvNotViable::Config(err))
        }
    }
}

fn probe_inner(config: &IbvConfig) -> Result<IbvSelection, IbvNotViable> {
    discover::check_library().map_err(|source| IbvNotViable::LibraryUnavailable {
        library: discover::LIBIBVERBS,
        source,
    })?;
    let discovery = match discover::discover() {
        Ok(discovery) => discovery,
        Err(IbvError::GetDeviceList { source }) if source.raw_os_error() == Some(libc::ENOSYS) => {
            return Err(IbvNotViable::KernelWithoutVerbs { source })
        }
        Err(err) => return Err(err.into()),
    };
    debug!(
        devices = discovery.devices.len(),
        failures = discovery.failures.len(),
        "RDMA discovery done"
    );
    decide(discovery, config)
}

/// Selection over what discovery found, and the reason to give when nothing is usable.
fn decide(
    discovery: discover::Discovery,
    config: &IbvConfig,
) -> Result<IbvSelection, IbvNotViable> {
    let select_err = match select::select(&discovery.devices, config) {
        Ok(selection) => return Ok(selection),
        Err(select_err) => select_err,
    };
    // A device or port that could not be read is the likelier root cause than "nothing
    // usable" among the rest, unless the user asked for another device.
    let relevant = discovery.failures.into_iter().find(|failure| {
        match (config.device.as_deref(), failure.device()) {
            (Some(wanted), Some(failed)) => wanted == failed,
            _ => true,
        }
    });
    match relevant {
        Some(failure) => {
            warn!(selection = %select_err, "RDMA selection failed after verb failures");
            Err(IbvNotViable::Verbs(failure))
        }
        None => Err(IbvNotViable::Selection(select_err)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ibv::topology::{Gid, GidType, LaneRate, LinkLayer, Mtu, PortSpeed};
    use std::net::Ipv4Addr;

    fn roce_selection() -> IbvSelection {
        IbvSelection {
            device: "mlx5_0".into(),
            port: 1,
            link_layer: LinkLayer::Ethernet,
            lid: 0,
            gid: Gid::from(Ipv4Addr::new(10, 0, 0, 5)),
            gid_index: 3,
            gid_type: GidType::RoceV2,
            active_mtu: Some(Mtu::B4096),
            max_msg_size: 1 << 30,
            speed: Some(PortSpeed {
                lanes: 4,
                lane_rate: LaneRate::Edr,
            }),
        }
    }

    #[test]
    fn viable_display() {
        let v = IbvViability::Viable(roce_selection());
        assert!(v.is_viable());
        assert_eq!(
            v.to_string(),
            "viable: mlx5_0 port 1, Ethernet, GID[3] ::ffff:10.0.0.5 (RoCEv2), LID 0, MTU 4096, 4x EDR (100 Gb/s)"
        );
    }

    #[test]
    fn not_viable_display_includes_causes() {
        let v = IbvViability::NotViable(IbvNotViable::KernelWithoutVerbs {
            source: io::Error::from_raw_os_error(libc::ENOSYS),
        });
        assert!(!v.is_viable());
        let text = v.to_string();
        assert!(
            text.starts_with(
                "not viable: the kernel has no RDMA verbs support (ibv_get_device_list: ENOSYS): "
            ),
            "{text}"
        );
        assert!(text.contains("os error 38"), "{text}");
    }

    #[test]
    fn config_error_is_a_not_viable_reason() {
        let err = IbvConfig::from_env(|v| (v == config::ENV_PORT).then_some("abc")).unwrap_err();
        let v = IbvViability::NotViable(err.into());
        assert_eq!(
            v.to_string(),
            "not viable: RDZV_IB_PORT=\"abc\" is not valid: expected a port number from 1 to 255"
        );
    }

    fn open_failure(device: &str) -> IbvError {
        IbvError::OpenDevice {
            device: device.into(),
            source: io::Error::from_raw_os_error(libc::EACCES),
        }
    }

    fn ib_device(name: &str) -> topology::RdmaDevice {
        topology::RdmaDevice {
            name: name.into(),
            ports: vec![topology::RdmaPort {
                number: 1,
                state: topology::PortState::Active,
                link_layer: LinkLayer::InfiniBand,
                lid: 3,
                active_mtu: Some(Mtu::B2048),
                max_msg_size: 1 << 30,
                speed: None,
                gid_table_len: 128,
                gids: vec![topology::GidEntry {
                    index: 0,
                    gid: Gid([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]),
                    gid_type: GidType::InfiniBand,
                }],
            }],
        }
    }

    #[test]
    fn verb_failures_are_ignored_when_another_device_is_usable() {
        let discovery = discover::Discovery {
            devices: vec![ib_device("mlx5_1")],
            failures: vec![open_failure("mlx5_0")],
        };
        let selection = decide(discovery, &IbvConfig::default()).unwrap();
        assert_eq!(selection.device, "mlx5_1");
    }

    #[test]
    fn verb_failure_explains_an_empty_result() {
        let discovery = discover::Discovery {
            devices: vec![],
            failures: vec![open_failure("mlx5_0")],
        };
        let reason = decide(discovery, &IbvConfig::default()).unwrap_err();
        assert!(
            matches!(&reason, IbvNotViable::Verbs(IbvError::OpenDevice { device, .. }) if device == "mlx5_0"),
            "{reason}"
        );
        let text = crate::error_chain::ErrorChain(&reason).to_string();
        assert!(
            text.starts_with("ibv_open_device failed for RDMA device mlx5_0: "),
            "{text}"
        );
    }

    #[test]
    fn failure_on_another_device_does_not_hide_device_not_found() {
        let discovery = discover::Discovery {
            devices: vec![ib_device("mlx5_1")],
            failures: vec![open_failure("mlx5_0")],
        };
        let config = IbvConfig {
            device: Some("rxe0".into()),
            ..IbvConfig::default()
        };
        let reason = decide(discovery, &config).unwrap_err();
        assert!(
            matches!(
                reason,
                IbvNotViable::Selection(SelectError::DeviceNotFound { .. })
            ),
            "{reason}"
        );
    }

    #[test]
    fn failure_on_the_requested_device_is_the_reason() {
        let discovery = discover::Discovery {
            devices: vec![ib_device("mlx5_1")],
            failures: vec![open_failure("mlx5_0")],
        };
        let config = IbvConfig {
            device: Some("mlx5_0".into()),
            ..IbvConfig::default()
        };
        assert!(matches!(
            decide(discovery, &config),
            Err(IbvNotViable::Verbs(IbvError::OpenDevice { .. }))
        ));
    }
}
