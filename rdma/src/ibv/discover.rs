//! Reads the host's RDMA devices, ports and GIDs from libibverbs.
//!
//! This is the thin layer between libibverbs (through [`super::sys`], which loads it
//! at run time) and the plain [`topology`](super::topology) description: it makes the verb
//! calls (`ibv_get_device_list`, `ibv_open_device`, `ibv_query_device`, `ibv_query_port`,
//! `ibv_query_gid`, `_ibv_query_gid_ex`) and converts their raw attribute fields, keeping
//! values it does not know as "unknown" rather than failing. It decides nothing about
//! which port to use.

use std::io;

use tracing::{debug, warn};

use crate::error_chain::ErrorChain;

use super::sys::{self, Context, DeviceList};
use super::topology::{
    Gid, GidEntry, GidType, LinkLayer, Mtu, PortSpeed, PortState, RdmaDevice, RdmaPort,
};

/// The shared object loaded at run time.
pub const LIBIBVERBS: &str = sys::LIBIBVERBS;

/// A failed verb call, with the device and port it was about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IbvError {
    /// `ibv_get_device_list` returned NULL.
    #[error("ibv_get_device_list failed")]
    GetDeviceList {
        /// errno reported by libibverbs.
        #[source]
        source: io::Error,
    },
    /// `ibv_open_device` failed.
    #[error("ibv_open_device failed for RDMA device {device}")]
    OpenDevice {
        /// Device name.
        device: String,
        /// errno reported by libibverbs.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_device_ex` failed.
    #[error("ibv_query_device_ex failed for RDMA device {device}")]
    QueryDevice {
        /// Device name.
        device: String,
        /// errno reported by libibverbs.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_port` failed.
    #[error("ibv_query_port failed for RDMA port {device}:{port}")]
    QueryPort {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// errno reported by libibverbs.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_gid` failed.
    #[error("ibv_query_gid failed for RDMA port {device}:{port} GID index {gid_index}")]
    QueryGid {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// GID table index.
        gid_index: u32,
        /// errno reported by libibverbs.
        #[source]
        source: io::Error,
    },
}

impl IbvError {
    /// The device the failed call was about (`None` for `ibv_get_device_list`).
    pub fn device(&self) -> Option<&str> {
        match self {
            IbvError::GetDeviceList { .. } => None,
            IbvError::OpenDevice { device, .. }
            | IbvError::QueryDevice { device, .. }
            | IbvError::QueryPort { device, .. }
            | IbvError::QueryGid { device, .. } => Some(device),
        }
    }

    /// The errno of the failed call, when libibverbs gave one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            IbvError::GetDeviceList { source }
            | IbvError::OpenDevice { source, .. }
            | IbvError::QueryDevice { source, .. }
            | IbvError::QueryPort { source, .. }
            | IbvError::QueryGid { source, .. } => source.raw_os_error(),
        }
    }
}

/// What [`discover`] found: the devices it could read, and the verb calls that failed on
/// the others (a device or port whose attributes could not be read is left out).
#[derive(Debug, Default)]
pub struct Discovery {
    /// Devices in libibverbs order.
    pub devices: Vec<RdmaDevice>,
    /// Failures, in the order they happened.
    pub failures: Vec<IbvError>,
}

/// Whether the dynamic loader can load libibverbs (with every entry point rdzv uses), and
/// if not, why.
///
/// # Errors
/// [`sys::LibraryError`]: the loader's message, or the missing entry point.
pub fn check_library() -> Result<(), sys::LibraryError> {
    sys::check_library()
}

/// Lists the devices; `Err` only when the list itself cannot be had.
pub fn discover() -> Result<Discovery, IbvError> {
    let list = DeviceList::new().map_err(|source| IbvError::GetDeviceList { source })?;
    let mut discovery = Discovery::default();
    debug!(count = list.len(), "ibv_get_device_list");
    for index in 0..list.len() {
        let Some(name) = list.name(index) else {
            continue;
        };
        let context = match list.open(index) {
            Ok(context) => context,
            Err(source) => {
                discovery.failures.push(IbvError::OpenDevice {
                    device: name,
                    source,
                });
                continue;
            }
        };
        match read_device(&context, name) {
            Ok((rdma_device, port_failures)) => {
                discovery.failures.extend(port_failures);
                discovery.devices.push(rdma_device);
            }
            Err(failure) => discovery.failures.push(failure),
        }
    }
    for failure in &discovery.failures {
        warn!(error = %ErrorChain(failure), "RDMA discovery: verb failed");
    }
    Ok(discovery)
}

/// Reads one opened device; port-level failures leave the port out and are returned.
fn read_device(context: &Context, name: String) -> Result<(RdmaDevice, Vec<IbvError>), IbvError> {
    let port_count = context
        .phys_port_cnt()
        .map_err(|source| IbvError::QueryDevice {
            device: name.clone(),
            source,
        })?;
    let mut ports = Vec::with_capacity(usize::from(port_count));
    let mut failures = Vec::new();
    for number in 1..=port_count {
        match read_port(context, &name, number) {
            Ok(port) => ports.push(port),
            Err(failure) => failures.push(failure),
        }
    }
    debug!(device = %name, port_count, "RDMA device read");
    Ok((RdmaDevice { name, ports }, failures))
}

fn read_port(context: &Context, device: &str, number: u8) -> Result<RdmaPort, IbvError> {
    let raw = context
        .query_port(number)
        .map_err(|source| IbvError::QueryPort {
            device: device.to_owned(),
            port: number,
            source,
        })?;
    let state = PortState::from_raw(raw.state);
    let link_layer = LinkLayer::from_raw(raw.link_layer);
    let gid_table_len = u32::try_from(raw.gid_tbl_len).unwrap_or(0);
    // GIDs of ports that are not active are of no use to anyone: do not read them.
    let gids = if state.is_active() {
        read_gids(context, device, number, link_layer, gid_table_len)?
    } else {
        Vec::new()
    };
    debug!(
        device,
        port = number,
        %state,
        %link_layer,
        gids = gids.len(),
        "RDMA port read"
    );
    Ok(RdmaPort {
        number,
        state,
        link_layer,
        lid: raw.lid,
        active_mtu: Mtu::from_raw(raw.active_mtu),
        max_msg_size: raw.max_msg_sz,
        speed: PortSpeed::from_raw(raw.active_width, raw.active_speed, raw.active_speed_ex),
        gid_table_len,
        gids,
    })
}

fn read_gids(
    context: &Context,
    device: &str,
    port: u8,
    link_layer: LinkLayer,
    table_len: u32,
) -> Result<Vec<GidEntry>, IbvError> {
    let mut gids = Vec::new();
    for index in 0..table_len {
        let gid = context
            .query_gid(port, index)
            .map_err(|source| IbvError::QueryGid {
                device: device.to_owned(),
                port,
                gid_index: index,
                source,
            })?;
        let gid = Gid(gid);
        if gid.is_zero() {
            continue;
        }
        let gid_type = if link_layer.is_infiniband() {
            GidType::InfiniBand
        } else {
            match context.query_gid_type(port, index) {
                // On Ethernet, type 0 ("IB/RoCE v1" in sysfs) is RoCE v1.
                Ok(sys::GID_TYPE_IB | sys::GID_TYPE_ROCE_V1) => GidType::RoceV1,
                Ok(sys::GID_TYPE_ROCE_V2) => GidType::RoceV2,
                Ok(other) => {
                    debug!(device, port, index, raw = other, "unknown GID type");
                    GidType::Unknown
                }
                Err(err) => {
                    // Old libibverbs lack _ibv_query_gid_ex; the entry stays usable by
                    // explicit index.
                    debug!(device, port, index, error = %err, "_ibv_query_gid_ex failed");
                    GidType::Unknown
                }
            }
        };
        gids.push(GidEntry {
            index,
            gid,
            gid_type,
        });
    }
    Ok(gids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_carry_device_port_and_errno() {
        let err = IbvError::QueryPort {
            device: "mlx5_0".into(),
            port: 2,
            source: io::Error::from_raw_os_error(libc::EINVAL),
        };
        let text = ErrorChain(&err).to_string();
        assert!(
            text.starts_with("ibv_query_port failed for RDMA port mlx5_0:2: "),
            "{text}"
        );
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
        assert_eq!(err.device(), Some("mlx5_0"));
    }
}
